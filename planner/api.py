"""`plan(model, cluster)`: the planner's front door.

1. Trace the model on fake tensors for each candidate micro-batch size.
2. Cluster its ops into layers (`planner.inter.layers`): the automatic count L, and also p layers for
   every divisor p < L of the device count (a p-stage manual pipeline's balanced split).
3. For every submesh shape (1,1), (1,2), ..., (1,M), (2,M), ..., (N,M) and its logical meshes, solve
   the intra-op program (time-optimal, a memory ladder, Megatron's placements as seeds) and
   attribute time and memory to the layers of each clustering (`planner.inter.mesh_search`,
   `planner.inter.stage_table`).
4. Run the stage DP (`planner.inter.stage_dp`) for each micro-batch count and clustering; keep the plan
   whose predicted iteration time (`cost_models.pipeline.pipeline_time`, activations sent between
   stages included) is least.
5. Return a `ParallelPlan` with the stages, shardings, schedule and predicted time and memory.

Modes (Alpa's ablations): "auto"; "intra-only" (one stage on the whole cluster); "inter-only"
(stages with pure data parallelism inside).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from cost_models.cluster import Cluster
from cost_models.communication import p2p_time
from cost_models.compute import step_overhead
from cost_models.errors import DoesNotFitError, MeshplanError
from cost_models.memory import microbatches_in_flight, state_bytes_per_param
from cost_models.pipeline import pipeline_time
from planner.inter import stage_table as st
from planner.inter.layers import auto_num_layers, cluster_layers
from planner.inter.mesh_search import search, submesh_shapes
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph
from planner.tracing.tracer import trace
from planner.vocab.plan_file import Estimate, ParallelPlan, StagePlan

MODES = ("auto", "intra-only", "inter-only")
Progress = Callable[[str], None]


def _resolve_model(
    model: Any, example_batch: Any, dtype: torch.dtype, name: str | None
):
    """(name, batch_fn(b) -> (module, batch), default global batch)."""
    if isinstance(model, str):
        from planner.models import build_model

        _, probe = build_model(model, device="meta", dtype=dtype)
        default = int(probe[0].shape[0]) if probe and probe[0].dim() else 1
        return (
            name or model,
            lambda b: build_model(model, batch=b, device="meta", dtype=dtype),
            default,
        )
    if not isinstance(model, nn.Module):
        raise MeshplanError(
            f"model must be an nn.Module or a model name, got {type(model).__name__}"
        )
    if example_batch is None:
        raise MeshplanError(
            "planning an nn.Module needs its example batch (a tensor or tuple of tensors)"
        )
    batch = (
        example_batch if isinstance(example_batch, (tuple, list)) else (example_batch,)
    )
    default = int(batch[0].shape[0])

    def make(b: int):
        return model, tuple(
            t.new_empty((b, *t.shape[1:]), device="meta") for t in batch
        )

    return name or type(model).__name__, make, default


def microbatch_sizes(global_batch: int, cluster: Cluster | None = None) -> list[int]:
    """Candidate micro-batch sizes (rows of the global batch per micro-batch), powers of two that
    divide the global batch: 1 to 32, and on a cluster of one host up to 16 per device.

    Each costs one trace and one intra-op pass per mesh; all are evaluated, because the latency
    is not unimodal in the micro-batch size (memory decides when recomputation is needed; an MoE
    layer's dispatch grows faster than linearly in its tokens): gpt-39b on 64 V100s is fastest at
    micro-batch size 1 (tp4 x pp16), gpt-1.3b on 4 A100s at 64 (dp4, 16 rows each). The sizes of
    the manual grid (`benchmarks.manual_grid`: 1 to 16 rows per data-parallel replica, so up to
    16 per device) beyond these are `larger_microbatch_sizes`, tried only while they pay off."""
    top = 32
    if cluster is not None and cluster.hosts == 1:
        top = max(top, 16 * cluster.num_devices)
    return _pow2_divisors(global_batch, 1, top)


def larger_microbatch_sizes(global_batch: int, cluster: Cluster) -> list[int]:
    """Sizes above `microbatch_sizes`' up to 16 rows per device, in increasing order. `plan` tries
    them one by one only while the best plan so far uses the largest size tried: evaluating all
    of them would add passes to the largest searches that cannot win (gpt-39b on 64 V100s does not
    fit at 64 rows and is fastest at 1; one more size costs about 13 s of its planning,
    `benchmarks/bench_planner.py`), while a data-parallel MoE on 16 H100s gains from 32 rows to
    64 and 128 (the manual grid's dp8 x pp2 runs 64)."""
    return _pow2_divisors(
        global_batch,
        max(microbatch_sizes(global_batch, cluster), default=0) + 1,
        16 * cluster.num_devices,
    )


def _pow2_divisors(n: int, low: int, high: int) -> list[int]:
    """Powers of two in [low, high] that divide n, increasing."""
    return [
        1 << i
        for i in range(high.bit_length())
        if low <= 1 << i <= high and n % (1 << i) == 0
    ]


def plan(
    model: nn.Module | str,
    cluster: Cluster | str,
    example_batch: Any = None,
    *,
    global_batch: int | None = None,
    dtype: torch.dtype | str = torch.float16,
    memory_budget: float | None = None,
    schedule: str = "1f1b",
    microbatch_size: int | list[int] | None = None,
    num_layers: int | None = None,
    optimizer: str = "adam_mixed",
    mode: str = "auto",
    progress: Progress | None = None,
    model_name: str | None = None,
) -> ParallelPlan:
    """Plan data, tensor and pipeline parallel training of `model` on `cluster`.

    `model` is an nn.Module (with `example_batch`; it may live on the meta device) or a built-in
    model name or spec. `memory_budget` is bytes per device (default: the device's memory).
    A micro-batch size the model cannot be traced at (BatchNorm over a single value per channel,
    say) is skipped with a progress note; when no size can be traced, the first one's error is
    raised.
    """
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    if mode not in MODES:
        raise MeshplanError(
            f"unknown mode {mode!r}; expected one of {', '.join(MODES)}"
        )
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    name, make, default_batch = _resolve_model(model, example_batch, dtype, model_name)
    G = global_batch or default_batch
    if G < 1:
        raise MeshplanError(f"global batch must be positive, got {G}")
    budget = float(memory_budget or cluster.device.memory_bytes)
    sizes_b = (
        [microbatch_size]
        if isinstance(microbatch_size, int)
        else microbatch_size or microbatch_sizes(G, cluster)
    )
    if any(G % b for b in sizes_b):
        raise MeshplanError(
            f"micro-batch sizes {sizes_b} must divide the global batch {G}"
        )
    subs = (
        [(cluster.hosts, cluster.devices_per_host)]
        if mode == "intra-only"
        else submesh_shapes(cluster)
    )
    D = cluster.num_devices
    _check_state_fits(make(min(sizes_b))[0], name, cluster, optimizer, budget)
    least = [
        np.inf
    ]  # per-device memory of the whole model as one stage on all devices, at best
    found: list[tuple] = []  # (iteration time, dp, choices, layers, graph, B)
    # micro-batch size -> why the model cannot be traced at it
    untraceable: dict[int, MeshplanError] = {}

    def evaluate(b: int) -> None:
        say(f"tracing {name} with micro-batch {b}")
        module, batch = make(b)
        try:
            graph = trace(module, batch, model_name=name)
        except MeshplanError as exc:  # e.g. BatchNorm over a single value per channel
            say(f"micro-batch {b} skipped: {exc}")
            untraceable[b] = exc
            return
        # per trace: the op count may depend on the micro-batch size (e.g. size-1 dims)
        layers = _layerings(graph, num_layers, D if mode == "auto" else 1)
        counts = ", ".join(str(len(x)) for x in layers)
        say(f"{len(graph.ops)} ops in {counts} layers")
        B = G // b
        for dp, choices, lay in search(
            graph, layers, cluster, subs, B, budget, optimizer, mode, say, least
        ):
            t = _iteration_time(graph, lay, cluster, dp, choices, subs, B, schedule)
            found.append((t, dp, choices, lay, graph, B))

    for b in sorted(sizes_b, reverse=True):
        evaluate(b)
    larger = [] if microbatch_size else larger_microbatch_sizes(G, cluster)
    tried = max(sizes_b)
    for b in larger:
        if not found or G // min(found, key=lambda r: r[0])[5] != tried:
            break  # the best plan so far runs smaller micro-batches than the largest tried
        evaluate(tried := b)
    best = min(found, key=lambda r: r[0]) if found else None
    if best is None and len(untraceable) == len(sizes_b):
        raise next(iter(untraceable.values()))
    if best is None:
        raise DoesNotFitError(
            f"{name} does not fit on {cluster.spec}: even as one stage on all {D} devices it needs "
            f"{least[0] / 2**30:.1f} GiB per device, {budget / 2**30:.1f} GiB available "
            "(use more devices, a larger memory budget or a smaller batch)"
        )
    _, dp, choices, best_layers, graph, B = best
    return _assemble(
        name,
        graph,
        best_layers,
        cluster,
        dp,
        choices,
        subs,
        B,
        G,
        schedule,
        optimizer,
        mode,
        budget,
        time.perf_counter() - t0,
    )


def _check_state_fits(
    module: nn.Module, name: str, cluster: Cluster, optimizer: str, budget: float
) -> None:
    """Raise DoesNotFitError before any tracing when the model's weights, gradients and optimizer
    state alone exceed `budget` even spread evenly over every device: each parameter costs
    ``state_bytes_per_param(optimizer).total`` bytes somewhere (`planner.intra.prices.
    param_state_bytes` with every axis sharding it), and the fullest device holds at least the
    average."""
    params = sum(p.numel() for p in module.parameters())
    D = cluster.num_devices
    need = params * state_bytes_per_param(optimizer).total / D
    if need > budget:
        raise DoesNotFitError(
            f"{name} does not fit on {cluster.spec}: its {params / 1e9:.2f} B parameters' "
            f"weights, gradients and {optimizer} state alone need {need / 2**30:.1f} GiB per "
            f"device even sharded over all {D} devices, {budget / 2**30:.1f} GiB available "
            "(use more devices, a larger memory budget or an optimizer with less state)"
        )


def _layers(graph: OpGraph, num_layers: int | None) -> list[tuple[int, int]]:
    return _layerings(graph, num_layers, 1)[0]


def _layerings(
    graph: OpGraph, num_layers: int | None, num_devices: int
) -> list[list[tuple[int, int]]]:
    """Layer clusterings to search: `num_layers` when given; else the automatic count L
    (`auto_num_layers`) first, then every divisor p of the device count with 2 <= p < L, clustered
    into exactly p layers. A manual configuration with p pipeline stages splits the model into p
    balanced layers; with that clustering among the candidates, its stage split is in the search
    space (an L-layer clustering's boundaries need not fall where the p-layer one's do: with an LM
    head, say, the last of 12 equal layers is heavier than an even split of the model in two)."""
    ops = graph.ops
    index = {n.name: i for i, n in enumerate(ops)}
    edges = [
        (index[u], i, graph.node(u).output_bytes)
        for i, n in enumerate(ops)
        for u in dict.fromkeys(n.inputs)
        if u in index
    ]
    flops = [n.fwd_flops + n.bwd_flops for n in ops]
    if num_layers:
        return [cluster_layers(flops, edges, num_layers)]
    blocks = len({block_of(n.module_path) for n in ops if block_of(n.module_path)})
    L = auto_num_layers(flops, blocks=blocks or None)
    extra = [p for p in range(2, min(L, num_devices + 1)) if num_devices % p == 0]
    return [cluster_layers(flops, edges, n) for n in (L, *extra)]


def _data_parallel_axes(
    graph: OpGraph, sol, names: set[str], mesh_shape: tuple[int, int]
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


def _allocate(sizes: list[int], cluster: Cluster) -> list[list[int]]:
    """Device ranks (host-major) per stage: larger submeshes first, each aligned to its size."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    free = np.ones(cluster.num_devices, dtype=bool)
    out: list[list[int]] = [[] for _ in sizes]
    for i in order:
        n = sizes[i]
        start = next(
            s for s in range(0, cluster.num_devices, n) if free[s : s + n].all()
        )
        free[start : start + n] = False
        out[i] = list(range(start, start + n))
    return out


def _send_times(graph, layer_of, layers, stages, devices, cluster) -> list[float]:
    """`boundary_send_times` of a stage DP result's boundaries (`stages`: (first, last, mesh))."""
    sent = st.boundary_bytes(graph, st.boundary_values(graph, layer_of, len(layers)))
    return boundary_send_times([sent[j] for _, j, _ in stages[:-1]], devices, cluster)


def boundary_send_times(
    nbytes: Sequence[float], devices: Sequence[Sequence[int]], cluster: Cluster
) -> list[float]:
    """Round trip of one micro-batch's boundary activations (forward) and their gradient (back)
    from stage i to stage i + 1 (`nbytes[i]` full bytes), each device of stage i sending its 1/n
    share (as the stage DP prices it, `planner.inter.stage_table.send_times`), over the inter-host link
    when the two stages' devices lie in different hosts, where the host's network is shared by
    the stage's devices in that host (all of them for stages of whole hosts, as the stage DP
    assumes; a 1-device stage has the whole network card)."""
    M = cluster.devices_per_host
    out = []
    for i, b in enumerate(nbytes):
        hosts = [{d // M for d in devices[x]} for x in (i, i + 1)]
        share = b / len(devices[i])
        senders = max(Counter(d // M for d in devices[i]).values())
        out.append(
            2
            * p2p_time(
                cluster,
                share,
                crosses_hosts=hosts[0] != hosts[1],
                senders_per_host=senders,
            )
            if b > 0
            else 0.0
        )
    return out


def _iteration_time(graph, layers, cluster, dp, choices, subs, B, schedule) -> float:
    """The iteration time `_assemble` predicts for a stage DP result (1 virtual stage)."""
    S = len(dp.stages)
    devices = _allocate([subs[m][0] * subs[m][1] for _, _, m in dp.stages], cluster)
    times = []
    for i, (k, j, m) in enumerate(dp.stages):
        _, prof, rc = choices[k, j, m, S - i]
        times.append(prof.range_time(k, j, rc))
    layer_of = st.layer_of_nodes(graph, layers)
    sends = _send_times(graph, layer_of, layers, dp.stages, devices, cluster)
    return pipeline_time(times, B, schedule, send_times=sends) + step_overhead(cluster)


def _assemble(
    name,
    graph,
    layers,
    cluster,
    dp,
    choices,
    subs,
    B,
    G,
    schedule,
    optimizer,
    mode,
    budget,
    seconds,
    virtual_stages=1,
) -> ParallelPlan:
    S = len(dp.stages)
    layer_of = st.layer_of_nodes(graph, layers)
    stages: list[StagePlan] = []
    times = []
    # With interleaving, the S stages are p * v chunks and chunk c runs on device group c % p.
    p = S // virtual_stages
    groups = _allocate([subs[m][0] * subs[m][1] for _, _, m in dp.stages[:p]], cluster)
    devices = [groups[i % p] for i in range(S)]
    fallbacks: list[str] = []
    for i, (k, j, m) in enumerate(dp.stages):
        mesh, prof, rc = choices[k, j, m, S - i]
        inflight = np.array([0.0, microbatches_in_flight("1f1b", B, S - i, 0)])
        _, mem = st.range_costs(prof, inflight, np.inf, np.zeros(len(layers)), rc)
        sol = prof.solution
        in_stage = {n for n, layer in layer_of.items() if k <= layer <= j}
        params = {
            graph.placeholder_paths[n]: list(o.strategy.output[0])
            for n, o in sol.choice.items()
            if n in in_stage and graph.node(n).op == "param"
        }
        strategies = {
            n: {
                "inputs": [list(p) if p else None for p in o.strategy.inputs],
                "outputs": [list(p) for p in o.strategy.output],
            }
            for n, o in sol.choice.items()
            if n in in_stage and graph.node(n).op == "call"
        }
        fallbacks += [f for f in sol.fallback_ops if f.split(":")[0] in in_stage]
        dp_axes = _data_parallel_axes(graph, sol, in_stage, mesh.shape)
        t = prof.range_time(k, j, rc)
        times.append(t)
        stages.append(
            StagePlan(
                layers=(k, j),
                devices=devices[i],
                submesh=subs[m],
                logical_mesh=mesh.shape,
                recompute=rc,
                param_placements=params,
                time_s=t,
                memory_bytes=float(mem[k, j, 1]),
                compute_s=float(sum(prof.time[k : j + 1])),
                grad_sync_s=float(sol.grad_sync_s),
                zero_params=[p for p in sol.zero_params if p in params],
                node_strategies=strategies,
                data_parallel_axes=dp_axes,
            )
        )
    sends = _send_times(graph, layer_of, layers, dp.stages, devices, cluster)
    iteration = pipeline_time(
        times, B, schedule, virtual_stages=virtual_stages, send_times=sends
    ) + step_overhead(cluster)
    flops = graph.flops_per_iteration * B
    D = cluster.num_devices
    ops = graph.ops
    return ParallelPlan(
        model={
            "name": name,
            "fingerprint": graph.fingerprint(),
            "params": graph.num_params,
            "flops_per_iteration": flops,
        },
        cluster=cluster.to_json(),
        global_batch=G,
        num_microbatches=B,
        schedule=schedule,
        stages=stages,
        estimate=Estimate(
            iteration, flops / iteration / D / 1e12, max(s.memory_bytes for s in stages)
        ),
        planner_time_s=seconds,
        layer_nodes=[(ops[a].name, ops[b].name) for a, b in layers],
        dtype=next(iter(graph.params.values())).dtype
        if graph.params
        else "float32",  # training dtype
        optimizer=optimizer,
        kind=mode,
        virtual_stages=virtual_stages,
        fallback_ops=sorted(set(fallbacks)),
        memory_budget_bytes=budget,
    )
