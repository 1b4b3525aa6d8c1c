"""Manual (Megatron-LM style) plans, priced by the same cost models as automatic ones.

A configuration (dp, tp, pp, micro-batches, recompute, sequence parallelism, interleaving) becomes
a `ParallelPlan`:
the model's layers are split into pp balanced stages (pp * v chunks when interleaved), each stage
runs on dp * tp devices as a (dp, tp) logical mesh with tensor parallelism inside a host (Megatron's
recommendation), and the intra-op program is restricted to Megatron's parameter placements
(`planner.intra.megatron`, which the automatic planner also solves as seeds):

    attention qkv and MLP fc weights (and biases): split by output features   S(0) on the tp axis
    attention and MLP output projections:         split by input features     S(1) on the tp axis
    token embedding and LM head:                  split by vocabulary          S(0) on the tp axis
    MoE expert weights wi [E, h, f] / wo [E, f, h]: split by f                  S(2) / S(1) on tp
    everything else:                              replicated
    every parameter replicated on the dp axis (no ZeRO; ZeRO-2 with ``fsdp="zero2"``)

With `expert_parallel=True` (GShard/DeepSpeed-MoE expert parallelism) the MoE expert weights
`mlp.wi` [E, h, f] and `mlp.wo` [E, f, h] are also split by experts, S(0), on the dp axis (each
data-parallel rank holds E / dp experts; tokens reach them by all-to-all); E must divide by dp.
With `expert_parallel=ep` (an int, Megatron-Core's --expert-model-parallel-size) the experts are
split over groups of ep of the dp replicas instead: with tp = 1 a stage is a (dp / ep, ep)
logical mesh, the batch split over both axes, the expert weights S(0) on axis 1 (an all-to-all
inside each group of ep) and replicated on axis 0 (their gradients all-reduced over the dp / ep
groups), every other parameter replicated on both. With tp > 1 or context parallelism that
would be a (dp / ep, ep, tp) mesh, which `manual_plan` does not build: refused.

For models without experts every activation is split by the batch, S(0), on the dp axis, as
Megatron and DDP run (`planner.intra.megatron.batch_axes`), unless some op cannot run on a batch split
(batch norm; `planner.intra.batch_split.batch_split_options`); the other activation placements follow
from DTensor's strategies at the least cost, which reproduces Megatron's dataflow (one
all-reduce per sub-block forward) at the sizes Megatron runs: gpt:hidden=2048 and 6144 at
sequence 2048 under tp8 split the attention by heads. For small layers the least cost may
instead all-gather a split weight and split the batch on the tensor-parallel axis, FSDP's
dataflow, cheaper there under the cost model (gpt:hidden=1024, 8 x 512 tokens, tp4 on A100s:
4.19 ms with it, 4.29 ms with every weight read split). Holding every op to read its weights
split (tried 2026-12-04, not kept) left the pp2 x tp2 plan of tests/test_runtime_comm.py with
a partial value at its stage boundary (the residual stream not yet reduced, which the sending
stage reduces on its way out) and its measured all-gather bytes 12% off the priced ones
(294,912 against 262,144).
MoE activations are left to the least cost on every axis.
With `sequence_parallel=True` (Megatron-SP) the norms, dropouts and residual adds between a
row-parallel output and the next column-parallel input are split along the sequence on the tp
axis (`planner.intra.megatron.sequence_filter`): reduce-scatter and all-gather around them
instead of the all-reduce; with `sequence_parallel=False` they are replicated on the tp axis, as
Megatron without sequence parallelism runs them; None (the default) leaves them to the least
cost (which may split them by the sequence, or keep the residual stream partial).

With `context_parallel=cp` > 1 and dp = 1 a stage is a (cp, tp) mesh: every attention is
context-parallel on axis 0 (the sequence split, keys and values all-gathered;
`planner.intra.context`), parameters replicated there (or FSDP-sharded with ``fsdp="full"``).
With dp > 1 (tp = 1) it is a (dp, cp) mesh, the rows on axis 0, one per replica per micro-batch,
and the attention context-parallel on axis 1 (Megatron's ``--context-parallel-size`` beside
data parallelism; the parameters' state sharded over both axes with ``fsdp="zero2"`` or
``"full"``, as Megatron-Core's distributed optimizer and torchtitan's FSDP shard over the data x
context devices). With dp > 1 and tp > 1 it is a (dp, cp, tp) mesh of three axes, Megatron's
order (tp inside a host, then cp, then dp; `cost_models.communication.LogicalMesh`): rows on
axis 0, attention context-parallel on axis 1, Megatron's placements on axis 2 (Megatron-Core's
published Llama 3 70B and 405B layouts, DP2 TP4 CP2 and DP4 TP8 CP2).
With cp = 1 (the default) no attention is context-parallel on any axis
(`planner.intra.context.without_context`): a configuration without CP is priced without it,
where the least cost would otherwise split a long sequence's attention on the tp axis.

With ``fsdp="zero2"`` every parameter replicated on an axis of more than one device keeps its
optimizer state (and its gradient between steps) sharded over those axes (ZeRO-2,
`planner.intra.fsdp_prices`): Megatron-Core's distributed optimizer (its
``--use-distributed-optimizer``, on in NVIDIA's published recipes). Both reduce-scatter the
gradients once per step and all-gather the updated weights, and both hold each gradient whole
until then (Megatron-Core in its gradient buffer; the runtime accumulates it at its full local
size, `planner.inter.held_memory`), so the price is theirs in time and memory.

Recomputation: "full" checkpoints every transformer block on its own, "layer" each chunk
whole, "selective" only the attention cores (`planner.tracing.attention`), priced by the stage
DP's own prices (`planner.inter.full_recompute`, `planner.inter.selective`); with FSDP or HSDP too
(torchtitan's default: the recomputed forward gathers the parameters again, `runtime.fsdp`).
A manual chunk is a range of the stage table's layers, one per transformer block
(`planner.tracing.blocks.block_units`): FSDP gathers one block at a time, its collectives
overlapping the neighbouring blocks' compute (`planner.intra.fsdp_prices.fsdp_exposed`), as
torchtitan wraps every block in FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError, gib
from cost_models.memory import canonical_schedule
from planner.inter import boundaries as bd
from planner.inter import stage_solves
from planner.inter.layers import layers_in
from planner.intra.context import context_filter, without_context
from planner.intra.megatron import (
    axes_filter,
    batch_axes,
    is_expert_weight,
    megatron_filter,
    megatron_placement,
    sequence_filter,
)
from planner.plans.assemble import PlanSpec, assemble, stage_from_profile
from planner.plans.recompute import block_chunks
from planner.tracing.blocks import block_units
from planner.tracing.inputs import resolve_model, training_dtype
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_check import FSDP_MODES, RECOMPUTE_MODES, recompute_mode
from planner.vocab.plan_file import ParallelPlan

__all__ = ["manual_plan", "megatron_filter", "megatron_placement"]


def manual_plan(
    model: nn.Module | str,
    cluster: Cluster | str,
    example_batch: Any = None,
    *,
    dp: int,
    tp: int,
    pp: int,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    global_batch: int | None = None,
    recompute: bool | str = "none",
    sequence_parallel: bool | None = None,
    virtual_stages: int = 1,
    dtype: torch.dtype | str | None = None,
    optimizer: str = "adam_mixed",
    memory_budget: float | None = None,
    allow_oom: bool = False,
    expert_parallel: bool | int = False,
    split: str = "balanced",
    schedule: str | None = None,
    fsdp: str = "none",
    context_parallel: int = 1,
) -> ParallelPlan:
    """Price a Megatron configuration. `microbatch_size` is the rows of the global batch in one
    micro-batch, as in `plan` (global batch = microbatch_size * num_microbatches; each of the dp
    replicas gets microbatch_size / dp rows, Megatron's --micro-batch-size). Raises MeshplanError if a stage does
    not fit in memory, unless `allow_oom` (the plan's `manual["fits"]` says so). `expert_parallel`
    splits MoE expert weights by experts over the dp axis (True), or over groups of that many of
    the dp replicas (an int dividing dp; module docstring). `split`: "balanced"
    cuts the layers into pp * v chunks of about equal FLOPs; "blocks" cuts as Megatron-LM does, the
    same number of transformer blocks per chunk, the embedding in the first and the head and loss in
    the last (`block_chunks`). `recompute`: "none", "selective" (the attention cores), "full"
    (each transformer block checkpointed on its own, Megatron's --checkpoint-activations) or
    "layer" (each chunk checkpointed whole); True and False mean full and none. `sequence_parallel`: True for
    Megatron-SP on the tp axis, False for Megatron without it, None for the least cost (module
    docstring; True and False need tp > 1). `schedule`: "1f1b" (default), "gpipe",
    "interleaved" (the default when `virtual_stages` > 1) or "zero_bubble" (`cost_models.pipeline`). `fsdp`: "none" (Megatron's
    replicas), "zero2" (ZeRO-2: gradients and optimizer state sharded over the axes that
    replicate a parameter, weights kept whole; Megatron-Core's distributed optimizer, module
    docstring), "full" (every parameter FSDP-sharded over all the axes that replicate it,
    torchtitan's FSDP) or "hybrid" (HSDP, tp = 1 only: the dp devices as a (hosts, devices per
    host) mesh, every parameter sharded inside a host and replicated across hosts).
    `context_parallel` (cp): the sequence split over cp devices, every attention computed on
    its own queries against all-gathered keys and values (`planner.vocab.context`), the ops
    around it split along the sequence at the least cost (`planner.intra.context`); dp x cp x
    tp x pp = the devices, each stage a (cp, tp) logical mesh (cp on axis 0), with tp = 1 a
    (dp, cp) one, or a (dp, cp, tp) one (cp on axis 1 in both). With dp > 1 it needs
    micro-batches of one row per replica (raises otherwise; `fsdp="full"` shards the
    parameters over the dp x cp devices, as torchtitan combines FSDP with CP)."""
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    recompute = recompute_mode(recompute)
    if recompute not in RECOMPUTE_MODES:
        raise MeshplanError(
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
        )
    if sequence_parallel is not None and tp < 2:
        raise MeshplanError(
            "sequence_parallel=True/False places norms on the tensor-parallel axis; "
            f"tp={tp} has none (leave it None)"
        )
    dtype = training_dtype(model, dtype)
    D, M = cluster.num_devices, cluster.devices_per_host
    for key, v in (
        ("dp", dp),
        ("tp", tp),
        ("pp", pp),
        ("virtual_stages", virtual_stages),
        ("context_parallel", context_parallel),
    ):
        if not isinstance(v, int) or v < 1:
            raise MeshplanError(f"{key} must be a positive integer, got {v!r}")
    cp = context_parallel
    if dp * cp * tp * pp != D:
        names, sizes = ("dp", "tp", "pp"), (dp, tp, pp)
        if cp > 1:
            names, sizes = ("dp", "cp", "tp", "pp"), (dp, cp, tp, pp)
        raise MeshplanError(
            f"{' x '.join(names)} = {'x'.join(map(str, sizes))} = {dp * cp * tp * pp}, but "
            f"{cluster.spec} has {D} devices"
        )
    ep = _expert_degree(expert_parallel, dp)
    if cp > 1 and (fsdp == "hybrid" or ep > 1):
        raise MeshplanError(
            f"context_parallel={cp} runs on a (cp, tp), (dp, cp) or (dp, cp, tp) mesh: it needs "
            f"no hybrid sharding and no expert parallelism, got fsdp={fsdp} "
            f"expert_parallel={expert_parallel} (fsdp='full' shards over the dp x cp devices)"
        )
    if 1 < ep < dp and (tp > 1 or fsdp == "hybrid"):
        raise MeshplanError(
            f"expert parallelism over {ep} of the dp={dp} replicas runs on a (dp / ep, ep) mesh: "
            f"it needs tp=1 and no hybrid sharding (a (dp / ep, ep, tp) mesh otherwise, which "
            f"manual_plan does not build), got tp={tp} "
            f"fsdp={fsdp}"
        )
    if M % tp:
        raise MeshplanError(
            f"tensor parallelism stays inside a host: tp={tp} must divide the {M} devices per host"
        )
    if fsdp not in FSDP_MODES:
        raise MeshplanError(
            f"fsdp must be one of {', '.join(FSDP_MODES)}, got {fsdp!r}"
        )
    if fsdp == "hybrid" and (tp > 1 or ep > 1 or dp * tp <= M):
        raise MeshplanError(
            "fsdp=hybrid shards inside a host and replicates across hosts: it needs tp=1, no "
            f"expert parallelism and a stage on several hosts (dp > {M} devices per host), "
            f"got dp={dp} tp={tp}"
        )
    name, make, default_batch = resolve_model(model, example_batch, dtype, None)
    G = default_batch if global_batch is None else global_batch
    if G < 1:
        raise MeshplanError(f"global batch must be positive, got {G}")
    if (num_microbatches is None) == (microbatch_size is None):
        raise MeshplanError("give exactly one of num_microbatches and microbatch_size")
    if microbatch_size is not None and (
        microbatch_size < 1 or microbatch_size % dp or G % microbatch_size
    ):
        raise MeshplanError(
            f"microbatch_size {microbatch_size} (rows of the global batch per micro-batch) must "
            f"divide the global batch {G} and split evenly over dp={dp} replicas"
        )
    B = num_microbatches or G // microbatch_size
    if B < 1 or G % B or (G // B) % dp:
        raise MeshplanError(
            f"global batch {G} does not split into {B} micro-batches divisible by dp={dp}"
        )
    b = G // B
    if cp > 1 and dp > 1 and b != dp:
        raise MeshplanError(
            f"context_parallel={cp} with dp={dp} runs one row per data-parallel replica per "
            f"micro-batch (microbatch_size={dp}, Megatron's --micro-batch-size 1); got {b} rows "
            f"per micro-batch ({G} rows in {B} micro-batches)"
        )
    graph = make.trace(b)
    chunks = pp * virtual_stages
    if split not in ("balanced", "blocks"):
        raise MeshplanError(f"split must be 'balanced' or 'blocks', got {split!r}")
    layers = (
        block_chunks(graph, chunks) if split == "blocks" else layers_in(graph, chunks)
    )
    if len(layers) != chunks:
        raise MeshplanError(f"{name} has too few ops for {chunks} pipeline chunks")
    layers, ranges = block_units(graph, layers)
    n = dp * cp * tp
    sub = (1, n) if n <= M else (n // M, M)
    experts = _check_experts(graph, ep, name)
    if 1 < ep < dp:
        mesh = LogicalMesh(cluster, sub, (dp // ep, ep))
        param_filter = axes_filter(
            None, 1, fsdp == "full", zero=mesh.shape if fsdp == "zero2" else None
        )
    elif fsdp == "hybrid":
        mesh = LogicalMesh(cluster, sub, sub)  # axis 0 across hosts, axis 1 inside one
        param_filter = axes_filter(None, None, fsdp=True, hybrid=(1,))
    else:
        # (dp, tp), (cp, tp), (dp, cp) with the sequence split on axis 1 inside the replicas,
        # or all three (dp, cp, tp), Megatron's order (tp inside, then cp, then dp)
        if dp == 1 or cp == 1:
            shape = (dp * cp, tp)
        else:
            shape = (dp, cp, tp) if tp > 1 else (dp, cp)
        mesh = LogicalMesh(cluster, sub, shape)
        # Megatron's placements (`megatron_filter` on a (dp, tp) mesh) on the last axis
        param_filter = axes_filter(
            len(shape) - 1 if tp > 1 else None,
            0 if ep > 1 and dp > 1 else None,
            fsdp == "full",
            zero=mesh.shape if fsdp == "zero2" else None,
        )
    if cp > 1:  # the sequence on axis 1 (0 without data parallelism), rows on axis 0
        context = context_filter(graph, int(dp > 1), cp, rows=dp)
        data = (0,) if dp > 1 else ()
    else:  # no attention split along the sequence, not even on the tp axis, where the least
        # cost would otherwise pick it for a sequence long enough
        context = without_context(graph)
        data = batch_axes(mesh.shape, 1 if tp > 1 else None, experts)
    layer_of = bd.layer_of_nodes(graph, layers)
    bounds = bd.boundary_values(graph, layer_of, len(layers))
    budget = float(memory_budget or cluster.device.memory_bytes)
    prof = stage_solves.profiles_for(
        graph,
        mesh,
        layer_of,
        bounds,
        len(layers),
        num_microbatches=B,
        budget=np.inf,
        optimizer=optimizer,
        param_filter=param_filter,
        activation_filter=_both(
            None
            if sequence_parallel is None
            else sequence_filter(
                graph, len(mesh.shape) - 1, tp, split=sequence_parallel
            ),
            context,
        ),
        batch_axes=data,
    )[0]
    schedule = canonical_schedule(
        schedule or ("interleaved" if virtual_stages > 1 else "1f1b")
    )
    if virtual_stages > 1 and schedule != "interleaved":
        raise MeshplanError(
            f"virtual_stages={virtual_stages} needs the interleaved schedule, not {schedule}"
        )
    if schedule == "zero_bubble" and (
        recompute != "none" or fsdp in ("full", "hybrid")
    ):
        # torch keeps the autograd graph from the input- to the weight-gradient pass: what a
        # recomputed layer holds then is not priced, and FSDP's in-backward reduce-scatters are
        # not split (`runtime.torch_pipeline`)
        raise MeshplanError(
            f"the zero_bubble schedule is priced and run without recomputation and FSDP; got "
            f"recompute={recompute!r}, fsdp={fsdp!r}"
        )
    memo: dict = {}  # every stage is priced from the one profile
    stages = [stage_from_profile(r, sub, prof, recompute, memo) for r in ranges]
    spec = PlanSpec(
        model_name=name,
        graph=graph,
        layers=layers,
        cluster=cluster,
        stages=stages,
        num_microbatches=B,
        global_batch=G,
        schedule=schedule,
        optimizer=optimizer,
        kind="manual",
        memory_budget=budget,
        virtual_stages=virtual_stages,
    )
    plan = assemble(spec)
    peak = plan.estimate.peak_memory_bytes
    fits = peak <= budget
    plan.manual = {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "num_microbatches": B,
        "microbatch_size": b,
        "recompute": recompute,
        "sequence_parallel": sequence_parallel,
        "virtual_stages": virtual_stages,
        "expert_parallel": ep > 1,
        "expert_parallel_degree": ep,
        "fsdp": fsdp,
        "context_parallel": cp,
        "fits": fits,
    }
    if not fits and not allow_oom:
        raise MeshplanError(
            f"dp={dp} {f'cp={cp} ' if cp > 1 else ''}tp={tp} pp={pp} with {B} micro-batches "
            "does not fit: a stage needs "
            "{} per device, {} available".format(*gib(peak, budget))
        )
    return plan


def _expert_degree(expert_parallel: bool | int, dp: int) -> int:
    """The devices a group splits the experts over: dp for True, 1 (none) for False, else the
    int given, which must divide dp."""
    if isinstance(expert_parallel, bool):
        return dp if expert_parallel else 1
    if (
        not isinstance(expert_parallel, int)
        or expert_parallel < 1
        or dp % expert_parallel
    ):
        raise MeshplanError(
            "expert_parallel must be True, False or a number of devices dividing "
            f"dp={dp}, got {expert_parallel!r}"
        )
    return expert_parallel


def _check_experts(graph: OpGraph, ep: int, model: str) -> bool:
    """Whether the model has expert weights; raises when `ep` > 1 and it has none, or when
    `ep` does not divide their count."""
    paths = graph.placeholder_paths
    counts = {
        graph.node(n).outputs[0].shape[0]
        for n, p in paths.items()
        if is_expert_weight(p)
    }
    if ep > 1 and not counts:
        raise MeshplanError(
            f"expert parallelism over {ep} devices splits MoE expert weights, and {model} has "
            "none (leave expert parallelism off)"
        )
    for e in sorted(counts):
        if e % ep:
            raise MeshplanError(
                f"expert parallelism over {ep} devices needs the experts per layer to divide "
                f"by {ep}, but the model has {e}"
            )
    return bool(counts)


def _both(
    a: Callable[[str, Any], bool] | None, b: Callable[[str, Any], bool] | None
) -> Callable[[str, Any], bool] | None:
    """The options both filters allow (None: no restriction)."""
    if a is None or b is None:
        return a or b
    return lambda name, option: a(name, option) and b(name, option)
