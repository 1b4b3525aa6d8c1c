"""A plan from priced stages: the one place where a plan's memory and iteration time are summed.

`plan()` (automatic) and `manual_plan()` (a Megatron configuration) both describe the plan they
chose as a `PlanSpec`: the traced model, its layers, the cluster, and per stage its layer range,
submesh, intra-op solution, recomputation and `StageCost`. `assemble` turns it into the
`ParallelPlan` file:

* devices: stage i of p groups runs on device group i % p (p = stages / virtual_stages), groups
  allocated larger first, each aligned to its size (`stage_devices`);
* memory per device: every stage's `cost_models.memory.stage_peak_bytes` with the micro-batches
  its schedule keeps in flight (`cost_models.memory.microbatches_in_flight`, so GPipe holds all of
  them), summed over the stages (chunks) a device group runs;
* iteration time: `cost_models.pipeline.iteration_time` of the stage times and the values crossing
  each stage boundary (`predicted_iteration_time`, which the search also ranks candidates by).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.cluster import Cluster
from cost_models.memory import microbatches_in_flight, stage_peak_bytes
from cost_models.pipeline import iteration_time
from planner.inter import stage_table as st
from planner.intra.solve import StageSolution
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_check import validate
from planner.vocab.plan_file import Estimate, ParallelPlan, StagePlan
from planner.vocab.strategy import strategy_to_json

__all__ = ["PlanSpec", "StageChoice", "StageCost", "assemble", "stage_from_profile"]


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


@dataclass(frozen=True)
class StageChoice:
    """One stage (a chunk, when interleaved) of a plan to assemble."""

    layers: tuple[int, int]  # first and last layer, inclusive
    submesh: tuple[int, int]  # hosts, devices per host
    solution: (
        StageSolution  # the intra-op solution its layers take their strategies from
    )
    recompute: bool
    cost: StageCost


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
    recompute: bool,
) -> StageChoice:
    """A stage holding `layers` priced from a solution's per-layer profile
    (`planner.inter.stage_table`: the stage DP's own prices)."""
    k, j = layers
    params, kept, transient = st.range_footprint(profile, recompute)
    cost = StageCost(
        time_s=profile.range_time(k, j, recompute),
        param_bytes=float(params[k, j]),
        kept_bytes=float(kept[k, j]),
        transient_bytes=float(transient[k, j]),
        compute_s=float(profile.time[k : j + 1].sum()),
    )
    return StageChoice(layers, submesh, profile.solution, recompute, cost)


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


def predicted_iteration_time(
    spec: PlanSpec, devices: list[list[int]] | None = None
) -> float:
    """The plan's iteration time (`cost_models.pipeline.iteration_time`)."""
    return iteration_time(
        spec.cluster,
        [s.cost.time_s for s in spec.stages],
        st.stage_boundary_bytes(
            spec.graph, spec.layers, [s.layers[1] for s in spec.stages]
        ),
        devices or stage_devices(spec),
        spec.num_microbatches,
        spec.schedule,
        virtual_stages=spec.virtual_stages,
    )


def device_memory(spec: PlanSpec) -> list[float]:
    """Peak bytes per device of every stage's device group: each chunk's
    `cost_models.memory.stage_peak_bytes` with the micro-batches the schedule keeps in flight on
    its group, summed over the group's chunks."""
    S, v = len(spec.stages), spec.virtual_stages
    p = S // v
    chunk = [
        stage_peak_bytes(
            s.cost.param_bytes,
            s.cost.kept_bytes,
            s.cost.transient_bytes,
            microbatches_in_flight(
                spec.schedule, spec.num_microbatches, p, c % p, virtual_stages=v
            ),
        )
        for c, s in enumerate(spec.stages)
    ]
    return [float(sum(chunk[c % p :: p])) for c in range(S)]


def _data_parallel_axes(
    graph: OpGraph, sol: StageSolution, names: set[str], mesh_shape: tuple[int, int]
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
    s: StageChoice,
    layer_of: dict[str, int],
    devices: list[int],
    memory: float,
) -> StagePlan:
    graph, sol = spec.graph, s.solution
    k, j = s.layers
    mine = {n for n, layer in layer_of.items() if k <= layer <= j}
    params = {
        graph.placeholder_paths[n]: list(o.strategy.output[0])
        for n, o in sol.choice.items()
        if n in mine and graph.node(n).op == "param"
    }
    return StagePlan(
        layers=s.layers,
        devices=devices,
        submesh=s.submesh,
        logical_mesh=sol.mesh_shape,
        recompute=s.recompute,
        param_placements=params,
        time_s=s.cost.time_s,
        memory_bytes=memory,
        compute_s=s.cost.compute_s,
        grad_sync_s=float(sol.grad_sync_s),
        zero_params=[p for p in sol.zero_params if p in params],
        node_strategies={
            n: strategy_to_json(o.strategy)
            for n, o in sol.choice.items()
            if n in mine and graph.node(n).op == "call"
        },
        data_parallel_axes=_data_parallel_axes(graph, sol, mine, sol.mesh_shape),
    )


def assemble(spec: PlanSpec) -> ParallelPlan:
    """The `ParallelPlan` of `spec` (module docstring)."""
    graph, cluster = spec.graph, spec.cluster
    devices = stage_devices(spec)
    memory = device_memory(spec)
    layer_of = st.layer_of_nodes(graph, spec.layers)
    stages = [
        _stage_plan(spec, s, layer_of, devices[i], memory[i])
        for i, s in enumerate(spec.stages)
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
    )
    validate(plan, "the planner's plan")  # what the planner emits, the runtime can run
    return plan
