"""Repeated blocks of a traced model (``blocks.0``, ``blocks.1``, ...): which block a node belongs
to, and which nodes of identical blocks stand for each other, so the intra-op program solves a
repeated transformer block once (`planner.intra.solve`), manual plans split and checkpoint by
block (`planner.plans.recompute`), and layers are cut into the units FSDP gathers one after
another (`block_units`).
"""

from __future__ import annotations

from collections import defaultdict

from planner.tracing.opgraph import OpGraph


def block_of(path: str) -> str | None:
    """``blocks.7.attn.qkv`` -> ``blocks.7``; None for a path without an index."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def representatives(graph: OpGraph, names: list[str]) -> dict[str, str]:
    """Map each node of a repeated block to the same position in the first identical block.
    Made once per graph and list of names (every logical mesh of a search asks again); do not
    modify the dict returned."""
    made = graph.derived("representatives", dict)
    key = tuple(names)
    if key not in made:
        made.clear()  # one list of names at a time: the whole graph's, or one stage's
        made[key] = _representatives(graph, names)
    return made[key]


def _representatives(graph: OpGraph, names: list[str]) -> dict[str, str]:
    blocks: dict[str, list[str]] = defaultdict(list)
    for n in names:
        key = block_of(graph.node(n).module_path)
        if key is not None:
            blocks[key].append(n)
    first: dict[tuple, list[str]] = {}
    rep: dict[str, str] = {}
    for key, members in blocks.items():
        local = {n: i for i, n in enumerate(members)}
        sig = tuple(
            (
                graph.node(n).op,
                graph.node(n).target,
                graph.node(n).module_path.removeprefix(key),
                tuple(graph.node(n).outputs),
                tuple(local.get(i, -1) for i in graph.node(n).inputs),
            )
            for n in members
        )
        base = first.setdefault(sig, members)
        rep.update(zip(members, base))
    return rep


def block_units(
    graph: OpGraph, chunks: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Each chunk's op range (a layer, a manual plan's pipeline chunk) cut where a transformer block
    begins (`planner.tracing.blocks.block_of`): (the units, and each chunk's first and last unit).
    Ops before a chunk's first block join its first unit; a chunk without a block start stays
    one unit. FSDP gathers and overlaps one unit at a time (`runtime.fsdp`,
    `planner.intra.fsdp_prices.fsdp_exposed`), as torchtitan wraps every transformer block in
    FSDP2; a manual plan's layers are these units."""
    ops = graph.ops
    starts: set[int] = set()
    seen: set[str] = set()
    for i, n in enumerate(ops):
        key = block_of(n.module_path)
        if key is not None and key not in seen:
            seen.add(key)
            starts.add(i)
    units: list[tuple[int, int]] = []
    ranges = []
    for a, b in chunks:
        inside = sorted(i for i in starts if a < i <= b)
        cuts = [a] + inside[a not in starts :]  # ops before the first block join it
        first = len(units)
        units += list(zip(cuts, [c - 1 for c in cuts[1:]] + [b]))
        ranges.append((first, len(units) - 1))
    return units, ranges


def layer_ranges(graph: OpGraph, layer_of: dict[str, int]) -> list[tuple[int, int]]:
    """The op index range of each layer of `layer_of` (layers are consecutive ops)."""
    out: list[list[int]] = []
    for i, n in enumerate(graph.ops):
        k = layer_of[n.name]
        if k == len(out):
            out.append([i, i])
        else:
            out[k][1] = i
    return [(a, b) for a, b in out]
