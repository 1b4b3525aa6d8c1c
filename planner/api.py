"""`plan(model, cluster)`: the planner's front door.

1. Trace the model on fake tensors for each candidate micro-batch size.
2. Cluster its ops into layers (`planner.layers`): the automatic count L, and also p layers for
   every divisor p < L of the device count (a p-stage manual pipeline's balanced split).
3. For every submesh shape (1,1), (1,2), ..., (1,M), (2,M), ..., (N,M) and its logical meshes, solve
   the intra-op program (time-optimal, a memory ladder, Megatron's placements as seeds) and
   attribute time and memory to the layers of each clustering (`planner.stage_table`).
4. Run the stage DP (`planner.inter_op`) for each micro-batch count and clustering; keep the plan
   whose predicted iteration time (`cost_models.pipeline.pipeline_time`, activations sent between
   stages included) is least.
5. Return a `ParallelPlan` with the stages, shardings, schedule and predicted time and memory.

Modes (Alpa's ablations): "auto"; "intra-only" (one stage on the whole cluster); "inter-only"
(stages with pure data parallelism inside).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh, p2p_time
from cost_models.compute import step_overhead
from cost_models.errors import MeshplanError
from cost_models.memory import microbatches_in_flight
from cost_models.pipeline import pipeline_time
from planner import stage_table as st
from planner.blocks import block_of
from planner.ilp import solves_overlap
from planner.inter_op import stage_dp
from planner.layers import auto_num_layers, cluster_layers
from planner.megatron import is_expert_weight, seed_filters
from planner.opgraph import OpGraph
from planner.plan_format import Estimate, ParallelPlan, StagePlan
from planner.stage_costs import Option
from planner.tracer import trace

MODES = ("auto", "intra-only", "inter-only")
Progress = Callable[[str], None]


def submesh_shapes(cluster: Cluster) -> list[tuple[int, int]]:
    """(1, 1), (1, 2), (1, 4), ..., (1, M), then (n, M) for n = 2..N hosts, keeping the n that are
    powers of two or divide N: fewer shapes for the intra-op pass to solve, and any N hosts are
    still tiled (by powers of two)."""
    N, M = cluster.shape
    out = [
        (1, m) for m in range(1, M + 1) if M % m == 0 and (m & (m - 1) == 0 or m == M)
    ]
    return out + [(n, M) for n in range(2, N + 1) if N % n == 0 or n & (n - 1) == 0]


def logical_shapes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """The logical meshes tried on a submesh.

    * Inside one host: one flat axis and every a x m/a with 1 < a < m (both 2 x 4 and 4 x 2 on 8
      devices).
    * Across n hosts: n x m (a flat axis across hosts would run every collective through the slow
      inter-host link, which the n x m mesh can always match); on two hosts also m x 2, tensor
      parallelism in device pairs inside a host with data parallelism over the rest (the best
      manual configuration of gpt-15b on 4x8 A100s: dp8 x tp2 per 16-device stage). Larger
      multi-host submeshes do not get it: it is one of the costliest intra-op programs, and on
      3 or more hosts it doubled plan-39b's planning time (50 to 100 s, `benchmarks.bench_planner`).

    A mesh and its transpose are not interchangeable: a dimension sharded on both axes nests axis 0
    outside axis 1 (DTensor's default shard order; `planner.strategies` has no strided shards). On
    4 x 2 with tensor parallelism on axis 1, Megatron's dp-outer, tp-inner activation layout is
    (S(0), S(0)), and moving between it and (S(0), R) is one collective over the 2 tp devices. With
    tensor parallelism on axis 0 of 2 x 4 the same layout nests the other way round, and DTensor
    first replicates a misaligned nested shard (`cost_models.resharding`). gpt-39b on 8x8 A100s
    plans 19.14 s per iteration without 4 x 2, 19.04 s with it."""
    n, m = submesh
    if n > 1:
        return (
            [(n, m), (n * m // 2, 2)] if n == 2 and m % 2 == 0 and m > 2 else [(n, m)]
        )
    return [(1, m)] + [(a, m // a) for a in range(2, m) if m % a == 0]


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
    layer's dispatch grows faster than linearly in its tokens), and the sizes of the manual grid
    (`benchmarks.manual_grid`: 1 to 16 rows per data-parallel replica) must be in the search
    space: gpt-39b on 64 V100s is fastest at micro-batch size 1 (tp4 x pp16), gpt-1.3b on 4 A100s
    at 64 (dp4, 16 rows each). Beyond one host the larger sizes are not tried: they would add
    passes to the largest searches (`benchmarks/bench_planner.py`, plan-39b), and no best manual
    configuration of the committed suites beyond 8 GPUs runs micro-batches of more than 32 rows."""
    top = 32
    if cluster is not None and cluster.hosts == 1:
        top = max(top, 16 * cluster.num_devices)
    return [1 << i for i in range(top.bit_length()) if global_batch % (1 << i) == 0]


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
    least = [
        np.inf
    ]  # per-device memory of the whole model as one stage on all devices, at best
    found: list[tuple] = []  # (iteration time, dp, choices, layers, graph, B)

    for b in sorted(sizes_b, reverse=True):
        say(f"tracing {name} with micro-batch {b}")
        module, batch = make(b)
        graph = trace(module, batch, model_name=name)
        # per trace: the op count may depend on the micro-batch size (e.g. size-1 dims)
        layers = _layerings(graph, num_layers, D if mode == "auto" else 1)
        counts = ", ".join(str(len(x)) for x in layers)
        say(f"{len(graph.ops)} ops in {counts} layers")
        B = G // b
        for dp, choices, lay in _search(
            graph, layers, cluster, subs, B, budget, optimizer, mode, say, least
        ):
            t = _iteration_time(graph, lay, cluster, dp, choices, subs, B, schedule)
            found.append((t, dp, choices, lay, graph, B))
    best = min(found, key=lambda r: r[0]) if found else None
    if best is None:
        raise MeshplanError(
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


def _param_filter(mode: str) -> Callable[[str, Option], bool] | None:
    if mode == "inter-only":
        return lambda path, o: (
            not o.zero and all(p == "R" for p in o.strategy.output[0])
        )
    return None


def _seeds(graph: OpGraph, cluster: Cluster, shape: tuple[int, int], mode: str):
    """Megatron-style parameter placements solved as extra candidates (`planner.megatron`)."""
    if mode == "inter-only":
        return []
    experts = any(is_expert_weight(p) for p in graph.placeholder_paths.values())
    M = cluster.devices_per_host
    return seed_filters(shape, experts, {t for t in range(2, M + 1) if M % t == 0})


class _Table:
    """The stage DP's cost table for one layer clustering (see `planner.stage_table`)."""

    def __init__(self, graph, layers, cluster, subs, B, mode) -> None:
        self.layers = layers
        self.L = L = len(layers)
        self.layer_of = st.layer_of_nodes(graph, layers)
        self.bounds = st.boundary_values(graph, self.layer_of, L)
        self.boundary_bytes = st.boundary_bytes(graph, self.bounds)
        S = min(L, cluster.num_devices) if mode != "intra-only" else 1
        self.inflight = np.array(
            [0] + [microbatches_in_flight("1f1b", B, s, 0) for s in range(1, S + 1)],
            dtype=float,
        )
        self.cost = np.full((L, L, len(subs), S + 1), np.inf)
        self.choices: dict[tuple[int, int, int, int], tuple] = {}

    def add(self, m, mesh, prof, budget, crosses_hosts, whole) -> float:
        """Enter one profile for submesh index m; returns the least memory of all layers as one
        stage (for the error message when nothing fits) when `whole`, else inf."""
        send = st.send_times(mesh, self.boundary_bytes, crosses_hosts=crosses_hosts)
        least = np.inf
        for rc in (False, True):
            c, mem = st.range_costs(prof, self.inflight, budget, send, rc)
            if whole:
                least = min(least, float(mem[0, self.L - 1, 1]))
            better = c < self.cost[:, :, m, :]
            self.cost[:, :, m, :] = np.where(better, c, self.cost[:, :, m, :])
            for k, j, s in zip(*np.nonzero(better)):
                self.choices[int(k), int(j), m, int(s)] = (mesh, prof, rc)
        return least


def _solver_threads() -> int:
    """Threads for the per-mesh intra-op solves: the cores this process may use, at most 4
    (`MESHPLAN_PLANNER_THREADS` overrides)."""
    env = os.environ.get("MESHPLAN_PLANNER_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise MeshplanError(
                f"MESHPLAN_PLANNER_THREADS must be a positive integer, got {env!r}"
            )
        return int(env)
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1
    )
    return max(1, min(4, cores))


def _lean_layers(tables: list, sub: tuple[int, int], devices: int) -> tuple | None:
    """The clustering whose layers the memory ladder (`planner.stage_table.profiles_for`) must
    make lean on submesh `sub`: the p-layer one where p stages of this size fill the cluster, else
    None (the first clustering's). A p-stage manual pipeline's stage is one of those p layers;
    its time-optimal placements may not fit where the finer layers' do (gpt-15b on 4x8 A100s:
    dp8 x tp2 on two 2-host stages needs a rung of the ladder the 16-layer clustering stops
    before)."""
    size = sub[0] * sub[1]
    for t in tables[1:]:
        if t.L * size == devices:
            return t.layer_of, t.bounds, t.L
    return None


def _search(graph, layerings, cluster, subs, B, budget, optimizer, mode, say, least):
    """Solve the intra-op pass once per logical mesh (time-optimal, memory ladder, Megatron seeds),
    attribute every solution to each layer clustering, run the stage DP on each clustering's
    table; return (DP result, choices, layers) of every clustering where something fits."""
    tables = [_Table(graph, layers, cluster, subs, B, mode) for layers in layerings]
    first = tables[0]
    jobs = [
        (m, sub, LogicalMesh(cluster, sub, shape))
        for m, sub in enumerate(subs)
        for shape in (
            [(1, sub[0] * sub[1])] if mode == "inter-only" else logical_shapes(sub)
        )
    ]

    def solve(job: tuple) -> list:
        _, sub, mesh = job
        shape = mesh.shape
        with solves_overlap():
            say(
                f"micro-batches {B}: submesh {sub[0]}x{sub[1]}, logical mesh {shape[0]}x{shape[1]}"
            )
            return st.profiles_for(
                graph,
                mesh,
                first.layer_of,
                first.bounds,
                first.L,
                num_microbatches=B,
                budget=budget,
                optimizer=optimizer,
                param_filter=_param_filter(mode),
                seeds=_seeds(graph, cluster, shape, mode),
                lean_layers=_lean_layers(tables, sub, cluster.num_devices),
            )

    # The meshes' intra-op programs are independent: threads overlap one mesh's HiGHS solve with
    # another's pricing (`planner.ilp.solves_overlap`). Results are entered in job order, so the
    # plan does not depend on the thread count. On an error or Ctrl-C the queued passes are
    # cancelled (the running ones finish first).
    pool = ThreadPoolExecutor(max_workers=_solver_threads())
    try:
        for (m, sub, mesh), profiles in zip(jobs, pool.map(solve, jobs)):
            crosses = cluster.hosts > 1 and sub[1] == cluster.devices_per_host
            for t in tables:
                for prof in profiles:
                    if t is not first:
                        prof = st.profile(
                            prof.solution, graph, t.layer_of, t.bounds, t.L
                        )
                    low = t.add(m, mesh, prof, budget, crosses, sub == cluster.shape)
                    least[0] = min(least[0], low)
    finally:
        pool.shutdown(cancel_futures=True)
    out = []
    for t in tables:
        if mode == "intra-only":  # one stage: only the range of all layers
            whole = t.cost[0, t.L - 1].copy()
            t.cost[:] = np.inf
            t.cost[0, t.L - 1] = whole
        try:
            dp = stage_dp(
                t.cost, [a * b for a, b in subs], cluster.num_devices, B, epsilon=1e-3
            )
        except MeshplanError:
            continue
        out.append((dp, t.choices, t.layers))
    return out


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
    share (as the stage DP prices it, `planner.stage_table.send_times`), over the inter-host link
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


def _stage_time(prof, k: int, j: int, rc: bool) -> float:
    """Per-micro-batch time of layers k..j under a profile (recomputation adds their forward)."""
    return float(
        prof.time[k : j + 1].sum() + (prof.fwd[k : j + 1].sum() if rc else 0.0)
    )


def _iteration_time(graph, layers, cluster, dp, choices, subs, B, schedule) -> float:
    """The iteration time `_assemble` predicts for a stage DP result (1 virtual stage)."""
    S = len(dp.stages)
    devices = _allocate([subs[m][0] * subs[m][1] for _, _, m in dp.stages], cluster)
    times = []
    for i, (k, j, m) in enumerate(dp.stages):
        _, prof, rc = choices[k, j, m, S - i]
        times.append(_stage_time(prof, k, j, rc))
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
        t = _stage_time(prof, k, j, rc)
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
