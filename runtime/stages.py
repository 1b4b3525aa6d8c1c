"""Split a traced graph into the per-stage sub-graphs of a pipeline plan, and drive the executor
from a plan's string strategies and its recomputation.

`split_stages(graph, plan)` cuts ``graph.gm`` (the aten fx graph of `planner.tracing.tracer.trace`) at the
plan's stage boundaries (``plan.layer_nodes`` and ``StagePlan.layers``). Stage ``i`` gets a
`StageGraph`: an `OpGraph` whose ``gm`` has placeholders for

* the parameters and buffers its ops use (their paths, as in the full graph),
* the batch inputs its ops use (``"batch[i]"``: every rank holds the whole micro-batch),
* the boundary values it receives: values produced by an earlier stage (named as their producer,
  path ``"stage_input:<name>"``),

and returns, for a stage before the last, the values that later stages read (in
``StageGraph.outputs`` order); the last stage returns the graph's output (the loss).

`stage_program(stage_graph, stage_plan, fallback_nodes)` reads the plan's strings
(``StagePlan.node_strategies``, ``param_placements``) as the `StageProgram` that
`runtime.executor.PlanExecutor` runs, so the executor runs exactly the planned strategies. Leaves
without a plan entry (batch inputs, buffers, received boundary values) are replicated: every rank
of the stage holds the full tensor, and the edge to the first consumer only slices locally.

A parameter read by the ops of several stages (tied weights: one placeholder in the traced graph,
listed once by ``named_parameters``) is a placeholder of each of those stage graphs; the plan must
list it in ``tied_params`` with exactly those stages (`check_tied`).

Recomputation (``StagePlan.recompute``, `recomputed`): "full" - the stage's executor runs each
transformer block ("layer": each of the plan's layers) under a non-reentrant
``torch.utils.checkpoint`` (`runtime.executor.PlanExecutor`, ``recompute_layers``);
"selective" - only each attention core (`planner.tracing.attention.attention_cores`: its ops form
one checkpointed segment, every other op runs as usual and keeps its saved tensors), as
`planner.inter.selective` prices it; a stage without an attention core has nothing to recompute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import fx

from cost_models.errors import MeshplanError
from planner.tracing.attention import attention_cores
from planner.tracing.blocks import block_of, block_units
from planner.tracing.opgraph import OpGraph, OpNode
from planner.vocab.plan_file import ParallelPlan, StagePlan
from planner.vocab.strategy import StageProgram

__all__ = [
    "StageGraph",
    "check_tied",
    "fsdp_units",
    "layer_of_nodes",
    "recomputed",
    "shared_params",
    "split_stages",
    "stage_of_nodes",
    "stage_program",
]

INPUT_PREFIX = "stage_input:"


@dataclass
class StageGraph:
    """One pipeline stage's part of the traced graph (module docstring)."""

    index: int
    graph: OpGraph  # sub-graph; ``graph.gm`` runs the stage's ops
    # boundary value received -> stage producing it (topological order)
    inputs: dict[str, int]
    outputs: dict[str, list[int]]  # value sent -> stages reading it (gm output order)
    is_last: bool

    def meta(self, name: str) -> OpNode:
        """The op-graph node of a value of this stage (its shape and dtype)."""
        return self.graph.node(name)


def stage_of_nodes(graph: OpGraph, plan: ParallelPlan) -> dict[str, int]:
    """Op node name -> index of the stage that runs it (by the plan's layer ranges)."""
    bounds = plan.layer_ranges([n.name for n in graph.ops])
    out: dict[str, int] = {}
    ops = graph.ops
    for s, stage in enumerate(plan.stages):
        first, last = stage.layers
        for n in ops[bounds[first][0] : bounds[last][1] + 1]:
            out[n.name] = s
    missing = [n.name for n in ops if n.name not in out]
    if missing:
        raise MeshplanError(
            f"the plan's stages leave {len(missing)} ops unassigned ({missing[0]}, ...)"
        )
    return out


def layer_of_nodes(graph: OpGraph, plan: ParallelPlan) -> dict[str, int]:
    """Op node name -> index of the plan's layer (``plan.layer_nodes``) that holds it."""
    index = {n.name: i for i, n in enumerate(graph.ops)}
    out: dict[str, int] = {}
    for k, (a, b) in enumerate(plan.layer_nodes):
        for n in graph.ops[index[a] : index[b] + 1]:
            out[n.name] = k
    return out


def fsdp_units(graph: OpGraph, plan: ParallelPlan) -> dict[str, int]:
    """Op node name -> its FSDP unit: the plan's layers cut where each transformer block begins
    (`planner.tracing.blocks.block_units`), the units whose reduce-scatters `runtime.fsdp`
    paces and `planner.inter.stage_table` prices one after another."""
    index = {n.name: i for i, n in enumerate(graph.ops)}
    layers = [(index[a], index[b]) for a, b in plan.layer_nodes]
    units, _ = block_units(graph, layers)
    return {n.name: k for k, (a, b) in enumerate(units) for n in graph.ops[a : b + 1]}


def recomputed(
    graph: OpGraph, recompute: str, layer_of: dict[str, int]
) -> dict[str, int] | None:
    """The executor's ``recompute_layers`` for a stage's recomputation (module docstring): op of
    the model's `graph` -> its checkpointed segment, or None when nothing is recomputed. "full": each transformer block
    (`planner.tracing.blocks.block_of`) on its own, the ops outside the blocks (embedding, final
    norm, head, loss) not recomputed; in a model without numbered blocks, each of the plan's
    layers. "layer": each of the plan's layers. "selective": each attention core
    (`planner.inter.full_recompute` and `planner.inter.selective` price them)."""
    if recompute == "full":
        index: dict[str, int] = {}  # block -> its segment number
        blocks = {
            n.name: index.setdefault(b, len(index))
            for n in graph.ops
            if (b := block_of(n.module_path)) is not None
        }
        return blocks or layer_of
    if recompute == "layer":
        return layer_of
    if recompute == "selective":
        return attention_cores(graph) or None
    return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def split_stages(graph: OpGraph, plan: ParallelPlan) -> list[StageGraph]:
    """The plan's stages as sub-graphs of `graph` (module docstring)."""
    if graph.gm is None:
        raise MeshplanError("the op graph has no fx GraphModule to split")
    stage_of = stage_of_nodes(graph, plan)
    S = len(plan.stages)
    nodes = list(graph.gm.graph.nodes)
    for n in nodes:
        if n.op == "call_function" and n.name not in stage_of:
            raise MeshplanError(f"fx node {n.name} is not in the op graph")
    # values crossing stages: producer stage -> consumer stages
    consumers: dict[str, set[int]] = {}
    out_node = next(n for n in nodes if n.op == "output")
    for n in nodes:
        if n.op != "call_function":
            continue
        for u in n.all_input_nodes:
            if u.op == "call_function" and stage_of[u.name] != stage_of[n.name]:
                if stage_of[u.name] > stage_of[n.name]:
                    raise MeshplanError(f"{u.name} feeds an earlier stage ({n.name})")
                if not _is_tensor(u):
                    raise MeshplanError(
                        f"stage boundary value {u.name} is not a tensor (cut a plan "
                        "between a multi-output op and its getitem?)"
                    )
                consumers.setdefault(u.name, set()).add(stage_of[n.name])
    for u in out_node.all_input_nodes:
        if u.op == "call_function" and stage_of[u.name] != S - 1:
            raise MeshplanError(
                f"the loss ({u.name}) is not computed by the last stage"
            )
    return [_stage(graph, nodes, stage_of, consumers, s, S) for s in range(S)]


def _stage(
    graph: OpGraph,
    nodes: list[fx.Node],
    stage_of: dict[str, int],
    consumers: dict[str, set[int]],
    s: int,
    S: int,
) -> StageGraph:
    mine = [n for n in nodes if n.op == "call_function" and stage_of[n.name] == s]
    used = {u for n in mine for u in n.all_input_nodes}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    paths: dict[str, str] = {}
    for n in nodes:  # parameters, buffers and batch inputs, in the original order
        if n.op == "placeholder" and n in used:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
            paths[n.name] = graph.placeholder_paths[n.name]
    inputs: dict[str, int] = {}
    for n in nodes:  # boundary values received, in topological order
        if n.op == "call_function" and n in used and stage_of[n.name] != s:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
            paths[n.name] = INPUT_PREFIX + n.name
            inputs[n.name] = stage_of[n.name]
    for n in mine:
        env[n] = g.node_copy(n, lambda a: env[a])
    outputs: dict[str, list[int]] = {}
    if s == S - 1:
        out_node = next(n for n in nodes if n.op == "output")
        g.output(fx.node.map_arg(out_node.args[0], lambda a: env[a]))
    else:
        outputs = {
            n.name: sorted(consumers[n.name]) for n in mine if n.name in consumers
        }
        g.output(tuple(env[next(m for m in mine if m.name == v)] for v in outputs))
    gm = fx.GraphModule(graph.gm, g)
    sub_nodes = []
    for n in g.nodes:
        if n.op == "output":
            if s == S - 1:  # the model's output, whose first value is the loss
                sub_nodes.append(graph.node(out_node.name))  # (`OpGraph.loss_value`)
            continue
        node = graph.node(n.name)
        if n.name in inputs:  # a received value is a leaf of this stage
            node = dataclasses.replace(node, op="input", inputs=[], params=[])
        sub_nodes.append(node)
    sub = OpGraph(
        nodes=sub_nodes,
        params={p: m for p, m in graph.params.items() if p in paths.values()},
        buffers={p: m for p, m in graph.buffers.items() if p in paths.values()},
        placeholder_paths=paths,
        gm=gm,
        model_name=graph.model_name,
    )
    return StageGraph(s, sub, inputs, outputs, s == S - 1)


def shared_params(stages: list[StageGraph]) -> dict[str, list[int]]:
    """Parameter path -> the stages (ascending) whose graphs read it, for the parameters read by
    two or more stages (tied weights)."""
    out: dict[str, list[int]] = {}
    for st in stages:
        for path in st.graph.params:
            out.setdefault(path, []).append(st.index)
    return {p: s for p, s in out.items() if len(s) > 1}


def check_tied(stages: list[StageGraph], plan: ParallelPlan) -> None:
    """The plan's ``tied_params`` must be the parameters its stage graphs share, each with the
    stages that read it: a parameter in several stages is one tensor read by each of them."""
    got = shared_params(stages)
    if got != dict(plan.tied_params):
        wrong = sorted(
            p
            for p in set(got) | set(plan.tied_params)
            if got.get(p) != plan.tied_params.get(p)
        )
        p = wrong[0]
        given = plan.tied_params.get(p)
        said = f"give {p!r} to stages {given}" if given else f"do not list {p!r}"
        raise MeshplanError(
            f"the plan's tied_params {said}, but the plan's stages reading it in this model "
            f"are {got.get(p) or 'only one'} (a tied parameter is one tensor read by several "
            "stages, each holding a copy); plan it again with `meshplan plan`"
        )


def stage_program(
    stage: StageGraph, plan: StagePlan, fallback_nodes: set[str] = frozenset()
) -> StageProgram:
    """The program a stage's executor runs: the plan's strategies for the stage graph's nodes
    (`planner.vocab.strategy.StageProgram.from_plan`; ``source="fallback"`` for the nodes in
    `fallback_nodes`, so that the executor registers DTensor's replicate strategy for their ops).
    A value received from an earlier stage is a placeholder planned in the placement the plan
    lists for it (``StagePlan.input_placements``: the stage's solution's, whose edges were
    priced), replicated when not listed."""
    gm_nodes = stage.graph.gm.graph.nodes
    received = {INPUT_PREFIX + v: p for v, p in plan.input_placements.items()}
    return StageProgram.from_plan(
        plan.logical_mesh,
        {**plan.param_placements, **received},
        plan.node_strategies,
        {
            n.name: stage.graph.placeholder_paths[n.name]
            for n in gm_nodes
            if n.op == "placeholder"
        },
        [n.name for n in gm_nodes if n.op == "call_function"],
        params=stage.graph.params,
        fallback=fallback_nodes,
    )
