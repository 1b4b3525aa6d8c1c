"""The least iteration time any plan of one micro-batch size can be predicted to take, from the
size's traced graph alone: `planner.size_search` skips a size whose bound already exceeds a plan
found at another size (issue 23's pruning of micro-batch candidates), and `benchmarks.ceiling`
bounds every plan of a case with it.

Bound. Let T1(b) be the predicted iteration time of the whole model on ONE device of the
cluster's kind, running the global batch as B micro-batches of b rows, without recomputation
and ignoring memory (`least_iteration_time`: the intra-op program on a 1x1 mesh, every layer in
one stage, priced as a plan). Then every plan of micro-batch size b on N devices is predicted to
take at least

    T_min(b) = T1(b) / N.

Derivation, for the datasheet cost models (`cost_models.compute.op_time`), op by op. One op priced
on one device is ``max(flops / (peak * eff(d)), bytes / bw) + kernels * c`` with
``eff(d) = E_max * d / (d + d_half)`` increasing in ``d = min(m, n, k)``. Any plan runs the op as
pieces over micro-batches and devices: the pieces' FLOPs add up to at least the op's (sharding
splits them, replication repeats them, recomputation adds a forward), their bytes to at least the
op's (a replicated weight is read by every device, each micro-batch reads it again), each piece's
``d`` is at most the op's at b rows (sharding only shrinks dimensions), and each piece pays its
kernels' launch cost. Since ``sum_i max(a_i, b_i) >= max(sum a_i, sum b_i)``, the pieces' times
add up to at least the op's time in T1(b); likewise the optimizer step (each parameter updated at
least once) and the per-step and per-micro-batch overheads. Communication, pipeline bubbles and
waiting only add time. So the N devices together spend at least T1(b) busy, and the iteration
takes at least T1(b) / N.

The bound grants every piece the efficiency of b rows' products and no communication, so it is
loose where communication or memory decides; it grows as the micro-batch shrinks, since each of
the B micro-batches reads every weight again and launches every kernel again. moe-70b on 8x8
A100s (global batch 1024) plans 2.604 s per iteration at 16 rows; T_min is 3.278 s at 2 rows
and 5.233 s at 1 row (their best plans: 4.328 and 6.796 s), so neither can win. Where
communication and memory decide, it rules nothing out: the 1T GPT on 384x8 A100s has T_min
55.37-56.94 s at its eight sizes against its best plan's 65.49 s, gpt-39b on 8x8 V100s
40.88-43.15 s against 55.40 s (benchmarks/planning_time_log.md, 2026-12-06 08:50); where the
submeshes' communication decides, `planner.inter.mesh_bound` sees more. With a
measured profile attached to the cluster, GEMM rates are interpolated from samples and need not
grow with the shape, so no bound is claimed there (`least_iteration_time` returns None).
"""

from __future__ import annotations

import numpy as np

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.inter import boundaries as bd
from planner.inter.layers import layers_in
from planner.inter.stage_solves import profiles_for
from planner.plans.assemble import (
    PlanSpec,
    predicted_iteration_time,
    stage_from_profile,
)
from planner.tracing.blocks import block_units
from planner.tracing.opgraph import OpGraph


def least_iteration_time(
    graph: OpGraph,
    cluster: Cluster,
    num_microbatches: int,
    global_batch: int,
    optimizer: str,
    model_name: str = "",
) -> float | None:
    """T_min (module docstring) of `graph`, traced at one micro-batch of the size, when the
    global batch runs as `num_microbatches` of them on `cluster`: the plan of one stage on one
    device of its kind (as `planner.plans.manual.manual_plan` prices dp = tp = pp = 1 without
    recomputation, memory ignored) over its device count. None for a cluster with a measured
    profile."""
    if cluster.profile is not None:
        return None
    one = cluster.with_shape(1, 1)
    layers, ranges = block_units(graph, layers_in(graph, 1))
    layer_of = bd.layer_of_nodes(graph, layers)
    bounds = bd.boundary_values(graph, layer_of, len(layers))
    # on one device every node has one option: the time-optimal solve is the only one
    prof = profiles_for(
        graph,
        LogicalMesh(one, (1, 1), (1, 1)),
        layer_of,
        bounds,
        len(layers),
        num_microbatches=num_microbatches,
        budget=np.inf,
        optimizer=optimizer,
    )[0]
    memo: dict = {}
    spec = PlanSpec(
        model_name=model_name,
        graph=graph,
        layers=layers,
        cluster=one,
        stages=[stage_from_profile(r, (1, 1), prof, "none", memo) for r in ranges],
        num_microbatches=num_microbatches,
        global_batch=global_batch,
        schedule="1f1b",
        optimizer=optimizer,
        kind="manual",
        memory_budget=np.inf,
    )
    return predicted_iteration_time(spec) / cluster.num_devices
