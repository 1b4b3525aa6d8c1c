"""A plan from priced stages: the one place where a plan's memory and iteration time are summed.

`plan()` (automatic) and `manual_plan()` (a Megatron configuration) both describe the plan they
chose as a `PlanSpec`: the traced model, its layers, the cluster, and per stage its layer range,
submesh, intra-op solution, recomputation and `StageCost`. `assemble` turns it into the
`ParallelPlan` file:

* devices: stage i of p groups runs on device group i % p (p = stages / virtual_stages), groups
  allocated larger first, each aligned to its size (`stage_devices`);
* memory per device: `cost_models.memory.device_peak_bytes` of the stages (chunks) a device
  group runs, with the micro-batches its schedule keeps in flight
  (`cost_models.memory.microbatches_in_flight`, so GPipe holds all of them);
* iteration time: `cost_models.pipeline.iteration_time` of the stage times and the values crossing
  each stage boundary (`predicted_iteration_time`, which the search also ranks candidates by),
  with each stage's forward and weight-gradient times for the zero-bubble schedule;
* tied parameters (one tensor read by the ops of several stages: an input embedding and the LM
  head sharing its weight; `tied_params`): every stage reading one holds its own copy, placed
  as that stage's solution places the parameter, listed in its ``param_placements`` and in the
  plan's ``tied_params``. A copy beyond the first on a device group adds its parameter state
  (the parameter's row of the stage solution's `node_cost_table`) to the stage's memory and its own
  time to the stage's; summing the copies' gradients once per step (`tied_sync_seconds`) is a
  fixed time per step of the iteration.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh, MeshAxis, collective_time
from cost_models.compute import step_overhead
from cost_models.memory import (
    device_peak_bytes,
    microbatches_in_flight,
    weight_grads_pending,
)
from cost_models.pipeline import iteration_time
from planner.inter import boundaries as bd
from planner.inter import stage_table as st
from planner.inter.dp_overlap import NO_SYNC, DpSync, stage_dp_sync
from planner.inter.held_memory import param_grad_terms
from planner.inter.range_costs import range_footprint
from planner.intra.solution import StageSolution
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards
from planner.vocab.plan_check import recompute_mode, validate
from planner.vocab.plan_file import Estimate, ParallelPlan, StagePlan
from planner.vocab.strategy import strategy_to_json, tied_copies_align

__all__ = [
    "PlanSpec",
    "StageChoice",
    "StageCost",
    "assemble",
    "device_memory",
    "dp_sync",
    "param_readers",
    "received_placements",
    "stage_from_profile",
    "tied_params",
    "tied_sync_seconds",
]


@dataclass(frozen=True)
class StageCost:
    """One stage's price per micro-batch."""

    time_s: float  # forward + backward, recomputation and gradient-sync share included
    param_bytes: float  # weights, gradients and optimizer state per device
    kept_bytes: float  # activations kept per micro-batch in flight
    transient_bytes: (
        float  # live only while one layer is recomputed and back-propagated
    )
    compute_s: float  # the layers' own time, without the stage's fixed costs
    # of time_s: the forward compute and the weight-gradient products (`planner.inter.wgrad`);
    # the rest is the input gradient (zero-bubble schedule, `cost_models.pipeline`)
    forward_s: float = 0.0
    weight_grad_s: float = 0.0
    # bytes of the weight products' output gradients a deferred weight gradient keeps
    weight_grad_bytes: float = 0.0
    # held only during the backward of micro-batches after the first (a second set of fresh
    # gradients: `cost_models.memory.stage_peak_bytes`'s ``accumulating``)
    accumulate_bytes: float = 0.0
    # held by a later micro-batch's backward run eagerly (zero bubble): the gradients the
    # first's working set found not yet made (`LayerProfile.unmade_bytes`)
    unmade_bytes: float = 0.0


@dataclass(frozen=True)
class StageChoice:
    """One stage (a chunk, when interleaved) of a plan to assemble."""

    layers: tuple[int, int]  # first and last layer, inclusive
    submesh: tuple[int, int]  # hosts, devices per host
    solution: (
        StageSolution  # the intra-op solution its layers take their strategies from
    )
    recompute: (
        str  # none | selective | full (`planner.vocab.plan_check.RECOMPUTE_MODES`)
    )
    cost: StageCost
    # the gradient all-reduce buckets its price assumed (`planner.inter.dp_overlap`): parameter
    # paths in launch order, recorded in the plan for the runtime (`StagePlan.grad_buckets`)
    grad_buckets: tuple[tuple[str, ...], ...] = ()


@dataclass
class PlanSpec:
    """Everything `assemble` needs (module docstring)."""

    model_name: str
    graph: OpGraph  # traced on one micro-batch
    layers: list[tuple[int, int]]  # op index ranges of the layers
    cluster: Cluster
    stages: list[StageChoice]
    num_microbatches: int
    global_batch: int
    schedule: str
    optimizer: str
    kind: str  # auto | manual | intra-only | inter-only
    memory_budget: float
    virtual_stages: int = 1
    planner_time_s: float = 0.0

    @property
    def microbatch_size(self) -> int:
        """Rows of the global batch in one micro-batch."""
        return self.global_batch // self.num_microbatches


def stage_from_profile(
    layers: tuple[int, int],
    submesh: tuple[int, int],
    profile: st.LayerProfile,
    recompute: str,
    memo: dict | None = None,
) -> StageChoice:
    """A stage holding `layers` priced from a solution's per-layer profile
    (`planner.inter.stage_table`: the stage DP's own prices). `memo` (a dict the caller keeps
    while it prices stages of a few profiles) holds each (profile, recompute)'s [k, j] arrays:
    a candidate's stages mostly share one profile (the 1T GPT's interleaved candidates: 96
    stages of one, each array 128 x 128)."""
    k, j = layers
    params, kept, transient, accumulate, unmade = _range_arrays(
        profile, recompute, memo
    )
    sync = dp_sync(profile, layers, recompute)
    cost = StageCost(
        time_s=profile.range_time(k, j, recompute) + sync.adjust_s,
        param_bytes=float(params[k, j]),
        kept_bytes=float(kept[k, j]),
        transient_bytes=float(transient[k, j]),
        compute_s=float(profile.time[k : j + 1].sum()),
        forward_s=float(profile.fwd[k : j + 1].sum()),
        weight_grad_s=0.0
        if profile.wgrad is None
        else float(profile.wgrad[k : j + 1].sum()),
        weight_grad_bytes=0.0
        if profile.wgrad_bytes is None
        else float(profile.wgrad_bytes[k : j + 1].sum()),
        accumulate_bytes=float(accumulate[k, j]),
        unmade_bytes=float(unmade[k, j]),
    )
    return StageChoice(layers, submesh, profile.solution, recompute, cost, sync.buckets)


def _range_arrays(
    profile: st.LayerProfile, recompute: str, memo: dict | None
) -> tuple[np.ndarray, ...]:
    """`stage_from_profile`'s [k, j] arrays of `profile` under `recompute`, kept in `memo`."""
    key = (id(profile), recompute)
    if memo is not None and key in memo:
        return memo[key][1]
    out = (
        *range_footprint(profile, recompute),
        profile.accumulate_bytes(recompute),
        profile.unmade_bytes(),
    )
    if memo is not None:  # the profile kept with its arrays: its id stays its own
        memo[key] = (profile, out)
    return out


def dp_sync(
    profile: st.LayerProfile, layers: tuple[int, int], recompute: str
) -> DpSync:
    """The gradient all-reduce buckets of a stage holding `layers` of `profile` and what their
    overlap with backward changes in its time (`planner.inter.dp_overlap.stage_dp_sync`)."""
    if profile.layer_of is None or profile.solution._ctx is None:
        return NO_SYNC
    return stage_dp_sync(
        profile.solution, profile.layer_of, layers[0], layers[1], recompute
    )


def stage_devices(spec: PlanSpec) -> list[list[int]]:
    """Device ranks (host-major) of every stage: chunk c runs on device group c % p; groups are
    allocated larger submeshes first, each aligned to its size."""
    p = len(spec.stages) // spec.virtual_stages
    sizes = [s.submesh[0] * s.submesh[1] for s in spec.stages[:p]]
    free = np.ones(spec.cluster.num_devices, dtype=bool)
    groups: list[list[int]] = [[] for _ in sizes]
    for i in sorted(range(p), key=lambda i: -sizes[i]):
        n = sizes[i]
        start = next(
            s for s in range(0, spec.cluster.num_devices, n) if free[s : s + n].all()
        )
        free[start : start + n] = False
        groups[i] = list(range(start, start + n))
    return [groups[c % p] for c in range(len(spec.stages))]


def _param_ops(graph: OpGraph) -> dict[str, list[int]]:
    """Parameter placeholder -> the indices (in ``graph.ops``) of the ops reading it; made once
    per graph (the search prices many plans of one traced graph)."""

    def make() -> dict[str, list[int]]:
        table: dict[str, list[int]] = {}
        for k, o in enumerate(graph.ops):
            for u in dict.fromkeys(o.inputs):
                if graph.node(u).op == "param":
                    table.setdefault(u, []).append(k)
        return table

    return graph.derived("param_ops", make)


def param_readers(spec: PlanSpec) -> dict[str, list[int]]:
    """Parameter placeholder -> the stages (ascending) whose ops read it; a parameter no op reads
    is left out. Made once per graph and stage layout (pricing one candidate plan asks for it
    several times: its iteration time, its memory, its tied copies). Do not modify it."""
    # op index where each layer starts, ascending
    starts = tuple(a for a, _ in spec.layers)
    layout = tuple(tuple(s.layers) for s in spec.stages)
    known = spec.graph.derived("param_readers", dict)
    if (starts, layout) not in known:
        stage_of = {k: i for i, s in enumerate(layout) for k in range(s[0], s[1] + 1)}
        known[starts, layout] = {
            u: sorted({stage_of[bisect.bisect_right(starts, k) - 1] for k in ks})
            for u, ks in _param_ops(spec.graph).items()
        }
    return known[starts, layout]


def tied_params(spec: PlanSpec) -> dict[str, list[int]]:
    """Parameter placeholder -> the stages reading it, for those read by two or more stages."""
    return {u: s for u, s in param_readers(spec).items() if len(s) > 1}


def _copies(spec: PlanSpec, stages: list[int]) -> list[int]:
    """Of `stages` holding one tied parameter, those holding their own copy: the first chunk of
    every device group (chunks of one group share the copy)."""
    p = len(spec.stages) // spec.virtual_stages
    first: dict[int, int] = {}
    for i in stages:
        first.setdefault(i % p, i)
    return list(first.values())


def _copy_costs(spec: PlanSpec) -> list[tuple[float, float, float]]:
    """Per stage: (seconds per micro-batch, parameter-state bytes per device, bytes of fresh
    gradients) of the tied parameters' copies it holds beyond the first (whose cost the stage of
    the parameter's first reader already has: `planner.inter.stage_table` attributes a parameter
    to that layer). The parameter-state bytes include the copy's gradient held beyond its priced
    size until the step's sync (`planner.inter.held_memory.param_grad_terms`, from the stage's
    own readers of it); the fresh gradients are `cost_models.memory.stage_peak_bytes`'s
    ``accumulating`` share of the copy."""
    out = [(0.0, 0.0, 0.0) for _ in spec.stages]
    rows: dict[int, dict[str, np.ndarray]] = {}
    for u, stages in tied_params(spec).items():
        for i in _copies(spec, stages)[1:]:
            stage = spec.stages[i]
            sol = stage.solution
            if id(sol) not in rows:
                names, table = sol.node_cost_table()
                rows[id(sol)] = dict(zip(names, table))
            row = rows[id(sol)][u]  # (time, forward time, parameter bytes, activations)
            a, b = spec.layers[stage.layers[0]][0], spec.layers[stage.layers[1]][1]
            readers = {n.name for n in spec.graph.ops[a : b + 1]}
            fresh, priced = param_grad_terms(sol, spec.graph, u, readers)
            out[i] = (
                out[i][0] + float(row[0]),
                out[i][1] + float(row[2]) + fresh - priced,
                out[i][2] + fresh,
            )
    return out


def _ranks_axis(spec: PlanSpec, ranks: list[int]) -> MeshAxis:
    """The devices `ranks` (global, host-major) as one collective's axis: inside a host (with
    their stride when evenly spaced), evenly over hosts, or else one per host (the slowest)."""
    M, k = spec.cluster.devices_per_host, len(ranks)
    hosts: dict[int, int] = {}
    for r in ranks:
        hosts[r // M] = hosts.get(r // M, 0) + 1
    if len(hosts) == 1:
        gaps = {b - a for a, b in zip(sorted(ranks), sorted(ranks)[1:])}
        return MeshAxis(k, k, 1, gaps.pop() if len(gaps) == 1 else 1)
    if len(set(hosts.values())) == 1:
        return MeshAxis(k, k // len(hosts), len(hosts))
    return MeshAxis(k, 1, k)


def tied_sync_seconds(spec: PlanSpec, devices: list[list[int]] | None = None) -> float:
    """Seconds per step of summing the gradients of the tied parameters' copies across the
    device groups holding them (after the last backward; `runtime.grad_sync.sync_tied`): when
    the copies lie alike (`planner.vocab.strategy.tied_copies_align`), an all-reduce of one
    device's gradient shard over the devices at one mesh position of every copy's stage (the
    positions in parallel); otherwise every copy's gradient all-gathered within its stage, then
    an all-reduce of the whole gradient over all the copies' devices."""
    devices = devices or stage_devices(spec)
    cluster, total = spec.cluster, 0.0
    for u, stages in tied_params(spec).items():
        held = _copies(spec, stages)
        if len(held) < 2:
            continue
        nbytes = float(spec.graph.node(u).output_bytes)
        choice = [spec.stages[i].solution.choice[u] for i in held]
        meshes = [spec.stages[i].solution.mesh_shape for i in held]
        places = [c.strategy.output[0] for c in choice]
        if tied_copies_align(zip(meshes, places, (c.zero for c in choice))):
            local = nbytes / shards(places[0], meshes[0])
            if choice[0].zero:  # ZeRO shards it further over the replicating axes
                local /= np.prod(
                    [n for p, n in zip(places[0], meshes[0]) if p == "R"] or [1]
                )
            axis = _ranks_axis(spec, [devices[i][0] for i in held])
            total += collective_time(cluster, "all_reduce", local, axis)
            continue
        gather = 0.0
        for i, pl, mesh in zip(held, places, meshes):
            logical = LogicalMesh(cluster, spec.stages[i].submesh, mesh)
            gather = max(
                gather,
                sum(
                    logical.all_gather(nbytes, a)
                    for a, x in enumerate(pl)
                    if x != "R" and mesh[a] > 1
                ),
            )
        union = sorted({r for i in held for r in devices[i]})
        total += gather + collective_time(
            cluster, "all_reduce", nbytes, _ranks_axis(spec, union)
        )
    return total


def predicted_iteration_time(
    spec: PlanSpec, devices: list[list[int]] | None = None
) -> float:
    """The plan's iteration time (`cost_models.pipeline.iteration_time`): the stages' times with
    their tied copies' (`_copy_costs`), and the tied gradients' sum (`tied_sync_seconds`) with
    the runtime's fixed time per step."""
    devices = devices or stage_devices(spec)
    copies = _copy_costs(spec)
    last = [s.layers[1] for s in spec.stages]
    return iteration_time(
        spec.cluster,
        [s.cost.time_s + c[0] for s, c in zip(spec.stages, copies)],
        bd.stage_boundary_bytes(spec.graph, spec.layers, last),
        devices,
        spec.num_microbatches,
        spec.schedule,
        virtual_stages=spec.virtual_stages,
        step_s=step_overhead(spec.cluster) + tied_sync_seconds(spec, devices),
        grad_bytes=bd.stage_boundary_bytes(spec.graph, spec.layers, last, True),
        **_zero_bubble_split(spec),
    )


def _zero_bubble_split(spec: PlanSpec) -> dict[str, list[float]]:
    """The stages' forward and weight-gradient times when the schedule splits backward (zero
    bubble), else nothing."""
    if spec.schedule != "zero_bubble":
        return {}
    return {
        "forward_times": [s.cost.forward_s for s in spec.stages],
        "weight_times": [s.cost.weight_grad_s for s in spec.stages],
    }


def device_memory(spec: PlanSpec) -> list[float]:
    """Peak bytes per device of every stage's device group: its chunks' parameter state (with
    their tied copies', `_copy_costs`) and activations with the micro-batches the schedule keeps
    in flight on the group, and one backward's transient bytes
    (`cost_models.memory.device_peak_bytes`); one entry per stage (chunk), the value of its
    group."""
    S, v = len(spec.stages), spec.virtual_stages
    p = S // v
    copies = _copy_costs(spec)
    zb = spec.schedule == "zero_bubble"
    B = spec.num_microbatches
    cols = []
    for c, s in enumerate(spec.stages):
        cols.append(
            (
                s.cost.param_bytes + copies[c][1],
                s.cost.kept_bytes,
                s.cost.transient_bytes,
                microbatches_in_flight(spec.schedule, B, p, c % p, virtual_stages=v),
                # zero-bubble stages run eager (`runtime.torch_pipeline`): no second gradient set
                s.cost.unmade_bytes
                if zb
                else s.cost.accumulate_bytes + _compiled(s) * copies[c][2],
                weight_grads_pending(spec.schedule, B, p, c % p)
                * s.cost.weight_grad_bytes,
            )
        )
    group = []
    for d in range(p):
        param, kept, transient, inflight, acc, wg = zip(*cols[d::p])
        group.append(
            device_peak_bytes(param, kept, transient, inflight, acc, B, weight_grads=wg)
        )
    return [group[c % p] for c in range(S)]


def _compiled(stage: StageChoice) -> bool:
    """Whether the runtime runs the stage's micro-batches as compiled graphs (no recomputation,
    no FSDP parameters: `planner.inter.stage_table.LayerProfile.accumulate_bytes`)."""
    return recompute_mode(stage.recompute) == "none" and not stage.solution.fsdp_params


def _data_parallel_axes(
    graph: OpGraph, sol: StageSolution, names: set[str], mesh_shape: tuple[int, ...]
) -> list[int]:
    """Axes (of size > 1) on which most of the stage's parameter bytes are not sharded."""
    params = [
        (graph.node(n).output_bytes, sol.choice[n].strategy.output[0])
        for n in names
        if graph.node(n).op == "param" and n in sol.choice
    ]
    total = sum(b for b, _ in params) or 1
    return [
        a
        for a, size in enumerate(mesh_shape)
        if size > 1 and sum(b for b, pl in params if pl[a].startswith("S")) < total / 2
    ]


def _stage_plan(
    spec: PlanSpec,
    i: int,
    layer_of: dict[str, int],
    readers: dict[str, list[int]],
    devices: list[int],
    memory: float,
    copy_s: float,
) -> StagePlan:
    """Stage `i`'s plan: the parameters its ops read (a tied one in every reader; one no op reads
    in the stage of its layer) and the strategies of its ops."""
    s = spec.stages[i]
    graph, sol = spec.graph, s.solution
    k, j = s.layers
    mine = {n for n, layer in layer_of.items() if k <= layer <= j}
    params = {
        graph.placeholder_paths[n]: list(o.strategy.output[0])
        for n, o in sol.choice.items()
        if graph.node(n).op == "param"
        and (i in readers[n] if n in readers else n in mine)
    }
    return StagePlan(
        layers=s.layers,
        devices=devices,
        submesh=s.submesh,
        logical_mesh=sol.mesh_shape,
        recompute=s.recompute,
        param_placements=params,
        time_s=s.cost.time_s + copy_s,
        memory_bytes=memory,
        compute_s=s.cost.compute_s,
        grad_sync_s=float(sol.grad_sync_s),
        optimizer_s=float(sol.optimizer_s),
        zero_params=[p for p in sol.zero_params if p in params],
        fsdp_params=[p for p in sol.fsdp_params if p in params],
        fsdp_axes={p: a for p, a in sol.fsdp_axes.items() if p in params},
        grad_buckets=[list(b) for b in s.grad_buckets],
        node_strategies={
            n: strategy_to_json(o.strategy)
            for n, o in sol.choice.items()
            if n in mine and graph.node(n).op == "call"
        },
        data_parallel_axes=_data_parallel_axes(graph, sol, mine, sol.mesh_shape),
        input_placements=received_placements(graph, sol, mine),
    )


def received_placements(
    graph: OpGraph, sol: StageSolution, mine: set[str]
) -> dict[str, list[str]]:
    """The values the ops in `mine` (a stage) read from ops outside it -> their placement in the
    stage's solution `sol`: the source of the edges to their consumers that the solution priced
    (forward resharding and the gradient's way back, attributed to the consumers' layers). A
    Partial axis becomes "R": the value crosses stages reduced (the sending stage reduces it on
    its way out, `runtime.torch_pipeline` / `runtime.pipeline`), so the received value is
    replicated there, not partial as the solution priced its edges."""
    out: dict[str, list[str]] = {}
    for n in sorted(mine):
        if graph.node(n).op != "call":
            continue
        for u in graph.node(n).inputs:
            if u not in mine and u not in out and graph.node(u).op == "call":
                out[u] = [
                    "R" if x.startswith("P") else x
                    for x in sol.choice[u].strategy.output[0]
                ]
    return out


def assemble(spec: PlanSpec) -> ParallelPlan:
    """The `ParallelPlan` of `spec` (module docstring)."""
    graph, cluster = spec.graph, spec.cluster
    devices = stage_devices(spec)
    memory = device_memory(spec)
    layer_of = bd.layer_of_nodes(graph, spec.layers)
    readers = param_readers(spec)
    copies = _copy_costs(spec)
    stages = [
        _stage_plan(spec, i, layer_of, readers, devices[i], memory[i], copies[i][0])
        for i in range(len(spec.stages))
    ]
    fallbacks = {
        f
        for s in spec.stages
        for f in s.solution.fallback_ops
        if s.layers[0] <= layer_of.get(f.split(":")[0], -1) <= s.layers[1]
    }
    seconds = predicted_iteration_time(spec, devices)
    flops = graph.flops_per_iteration * spec.num_microbatches
    ops = graph.ops
    model: dict[str, Any] = {
        "name": spec.model_name,
        "fingerprint": graph.fingerprint(),
        "params": graph.num_params,
        "flops_per_iteration": flops,
    }
    plan = ParallelPlan(
        model=model,
        cluster=cluster.to_json(),
        global_batch=spec.global_batch,
        num_microbatches=spec.num_microbatches,
        schedule=spec.schedule,
        stages=stages,
        estimate=Estimate(
            seconds, flops / seconds / cluster.num_devices / 1e12, max(memory)
        ),
        planner_time_s=spec.planner_time_s,
        layer_nodes=[(ops[a].name, ops[b].name) for a, b in spec.layers],
        # the training dtype
        dtype=next(iter(graph.params.values())).dtype if graph.params else "float32",
        optimizer=spec.optimizer,
        kind=spec.kind,
        virtual_stages=spec.virtual_stages,
        fallback_ops=sorted(fallbacks),
        memory_budget_bytes=spec.memory_budget,
        tied_params={
            graph.placeholder_paths[u]: stages
            for u, stages in tied_params(spec).items()
        },
    )
    validate(plan, "the planner's plan")  # what the planner emits, the runtime can run
    return plan
