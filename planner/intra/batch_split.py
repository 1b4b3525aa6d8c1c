"""Data parallelism as Megatron-LM and DDP run it: every value computed from the data split by
its first (batch) dimension on the data-parallel mesh axes. `planner.intra.solve.solve_stage`
restricts the intra-op program with `batch_split_options`; `planner.inter.stage_table` checks with it
whether a solution already obeys a seed.
"""

from __future__ import annotations

import math

from planner.intra.prices import Option
from planner.tracing.opgraph import OpGraph, OpNode


def data_nodes(graph: OpGraph) -> frozenset[str]:
    """Names of the graph's data inputs and of every node computed from them (made once per
    graph: every solve with data parallelism reads them)."""

    def make() -> frozenset[str]:
        out: set[str] = set()
        for node in graph.nodes:
            if node.op == "input" or any(i in out for i in node.inputs):
                out.add(node.name)
        return frozenset(out)

    return graph.derived("data_nodes", make)


def batch_split_options(
    graph: OpGraph,
    names: list[str],
    options: dict[str, list[Option]],
    rep: dict[str, str],
    axes: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    memo: dict | None = None,
) -> dict[str, list[Option]]:
    """The options of the representatives among `names` computed from the data (`data_nodes`)
    restricted to those splitting the batch on `axes` (`shards_batch`; scalars such as the loss
    are free), or {} - no restriction - when `axes` is empty or some such value has no
    batch-split option: a micro-batch too small to split, or an op whose DTensor strategy needs
    the whole batch (batch norm in training). Forcing its neighbours would only add
    redistributions around it that data parallelism does not have, so the stage is left free.
    `memo` (one per pricing: the same graph and mesh) keeps each options list's filtered list,
    so that the solves of one pricing filter a list once."""
    if not axes:
        return {}
    data = data_nodes(graph)
    memo = {} if memo is None else memo
    out = {}
    for n in names:
        if rep.get(n, n) == n and n in data:
            key = (id(options[n]), axes)
            hit = memo.get(key)
            if hit is None or hit[0] is not options[n]:
                node = graph.node(n)
                kept = [
                    o for o in options[n] if shards_batch(node, o, axes, mesh_shape)
                ]
                # the list itself kept with its filtered one: its id is not reused meanwhile
                hit = memo[key] = (options[n], kept)
            out[n] = hit[1]
            if not out[n]:
                return {}
    return out


def shards_batch(
    node: OpNode, option: Option, axes: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> bool:
    """Whether `option` splits each non-scalar output of `node` evenly by dim 0 on every axis of
    `axes` (of a mesh of `mesh_shape`)."""
    ways = math.prod(mesh_shape[a] for a in axes)
    for meta, placements in zip(node.outputs, option.strategy.output):
        if not meta.shape or not placements:
            continue
        if meta.shape[0] % ways or any(placements[a] != "S(0)" for a in axes):
            return False
    return True
