"""Strategies and a stage's program: what the planner chose for every node, as the runtime runs it.

A `Strategy` gives, for one fx node, the placements (`planner.vocab.placements`, one string per mesh
axis) of each of its outputs and of each input it requires. A `StageProgram` is one stage's logical
mesh and the strategy of every node of the stage's graph: the planner writes it into a plan
(`StagePlan.node_strategies` and `param_placements`, in the string form of `strategy_to_json`),
and the executor runs it (`runtime.executor.PlanExecutor`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cost_models.errors import MeshplanError
from planner.vocab.placements import Placements

__all__ = [
    "StageProgram",
    "Strategy",
    "consumed_output",
    "getitem_source",
    "leaf",
    "strategy_from_json",
    "strategy_to_json",
]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: placements (one per mesh axis) of each output and required inputs.

    ``output[k]`` is for the k-th tensor output (``()`` for a non-tensor output); ``inputs[i]`` is for
    ``node.all_input_nodes[i]`` (None where it does not matter: non-tensor inputs).
    """

    output: tuple[Placements, ...]
    inputs: tuple[Placements | None, ...]
    source: str

    def __str__(self) -> str:
        def fmt(p: Placements | None) -> str:
            return "-" if p is None else "[" + ",".join(p) + "]"

        outs = ", ".join(fmt(p) for p in self.output)
        ins = ", ".join(fmt(p) for p in self.inputs)
        return f"({ins}) -> ({outs}) {self.source}"


def leaf(placements: Placements, source: str = "leaf") -> Strategy:
    """The strategy of a placeholder (parameter, buffer, batch input): one output, no inputs."""
    return Strategy((tuple(placements),), (), source)


def strategy_to_json(s: Strategy) -> dict[str, list]:
    """A call node's strategy as a plan writes it: ``{"inputs": [...], "outputs": [...]}``."""
    return {
        "inputs": [list(p) if p is not None else None for p in s.inputs],
        "outputs": [list(p) for p in s.output],
    }


def strategy_from_json(d: Mapping[str, Any], source: str = "plan") -> Strategy:
    """Inverse of `strategy_to_json`."""
    return Strategy(
        tuple(tuple(p) for p in d["outputs"]),
        tuple(None if p is None else tuple(p) for p in d["inputs"]),
        source,
    )


@dataclass(frozen=True)
class StageProgram:
    """What one stage runs: its logical mesh and the strategy of every node (by fx node name)."""

    mesh_shape: tuple[int, ...]
    strategies: Mapping[str, Strategy]

    @classmethod
    def from_plan(
        cls,
        logical_mesh: Iterable[int],
        param_placements: Mapping[str, Iterable[str]],
        node_strategies: Mapping[str, Mapping[str, Any]],
        placeholders: Mapping[str, str],
        calls: Iterable[str],
        params: Iterable[str] = (),
        fallback: Iterable[str] = (),
    ) -> StageProgram:
        """A stage's program from its plan entry (``StagePlan.logical_mesh``, ``param_placements``,
        ``node_strategies``) for a stage graph with `placeholders` (node name -> path) and `calls`
        (the call nodes' names). `param_placements` may list other placeholders by path too
        (`runtime.stages.stage_program`: the values received from another stage); placeholders
        without a placement (batch inputs, buffers) are replicated; every parameter in `params`
        and every call must have an entry. Nodes in `fallback` get the source "fallback" (the
        runtime registers DTensor's replicate strategy for their ops)."""
        shape = tuple(logical_mesh)
        rep = ("R",) * len(shape)
        params, fallback = set(params), set(fallback)
        out: dict[str, Strategy] = {}
        for name, path in placeholders.items():
            if path in params and path not in param_placements:
                raise MeshplanError(f"the stage plan has no placement for {path}")
            out[name] = leaf(tuple(param_placements.get(path, rep)))
        for name in calls:
            entry = node_strategies.get(name)
            if entry is None:
                raise MeshplanError(f"the stage plan has no strategy for node {name}")
            out[name] = strategy_from_json(
                entry, "fallback" if name in fallback else "plan"
            )
        return cls(shape, out)


# ------------------------------------------------------------------------- fx graph structure


def getitem_source(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(producer, output index) when `node` is ``operator.getitem`` of a multi-output op."""
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
    ):
        return node.args[0], int(node.args[1])
    return None


def consumed_output(producer: torch.fx.Node, consumer: torch.fx.Node) -> int:
    """Index into ``Strategy.output`` of `producer` that `consumer` reads (its getitem index, else 0)."""
    src = getitem_source(consumer)
    return src[1] if src is not None and src[0] is producer else 0


# ------------------------------------------------------------------------- tied parameters


def tied_copies_align(
    copies: Iterable[tuple[Iterable[int], Iterable[str], bool]],
) -> bool:
    """Whether the copies of a tied parameter, each given as (its stage's logical mesh shape, its
    placements, whether ZeRO shards it), lie alike: equal meshes, placements and ZeRO. Then the
    device at mesh position i of every copy's stage holds the same shard, and one all-reduce per
    mesh position over those devices sums the copies' gradients. Otherwise each copy's gradient
    is gathered whole within its stage and summed over all the copies' devices (the runtime's
    `runtime.grad_sync.sync_tied` and the planner's price, `planner.plans.assemble`)."""
    keys = {(tuple(m), tuple(p), bool(z)) for m, p, z in copies}
    return len(keys) <= 1
