"""The search for one micro-batch size: the submeshes and logical meshes tried, an intra-op pass
per logical mesh (time-optimal, memory ladder, Megatron seeds; on threads), the stage DP's cost
table per layer clustering (`planner.inter.stage_table`), and the stage DP (`planner.inter.stage_dp`) on
each; with the schedule "auto" or "interleaved", also the interleaved 1F1B options
(`planner.inter.interleave`). `planner.api.plan` runs it for every candidate micro-batch size and
assembles the best."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from cost_models.memory import microbatches_in_flight
from planner.inter import boundaries as bd
from planner.inter import stage_solves
from planner.inter import stage_table as st
from planner.inter.interleave import InterleavedSearch, interleave_layering
from planner.inter.range_costs import range_costs
from planner.inter.stage_dp import stage_dp
from planner.intra.context import without_context
from planner.intra.fsdp_prices import hybrid_axes
from planner.intra.highs import solves_overlap
from planner.intra.megatron import context_seeds, is_expert_weight, seed_filters
from planner.intra.prices import Option
from planner.tracing.opgraph import OpGraph


@dataclass(frozen=True)
class StageOption:
    """How a stage DP table entry runs: the logical mesh, the intra-op solution attributed to the
    layers (its profile) and the stage's recomputation (none, selective or full)."""

    mesh: LogicalMesh
    profile: st.LayerProfile
    recompute: str


@dataclass(frozen=True)
class StagePick:
    """One stage of a stage DP result: layers k..j on a submesh, run as `option` says."""

    layers: tuple[int, int]
    submesh: tuple[int, int]
    option: StageOption


@dataclass(frozen=True)
class Candidate:
    """The stage DP's best assignment for one layer clustering (schedule 1F1B, GPipe or zero
    bubble), or an interleaved option (`planner.inter.interleave`: the chunks as stages, chunk c
    on device group c mod p)."""

    layers: list[tuple[int, int]]  # op index ranges of the clustering's layers
    stages: list[StagePick]
    schedule: str
    virtual_stages: int = 1


@dataclass(frozen=True)
class SearchResult:
    """Every clustering's `Candidate` where something fits, and the least memory per device of the
    whole model as one stage on all devices (for the error message when nothing fits)."""

    candidates: list[Candidate]
    least_whole_memory: float


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
    * Across n hosts: n x m, one flat axis of n * m devices, and (n * m / t) x t for every t
      with 1 < t < m dividing m: data parallelism (or FSDP) over all devices with tensor
      parallelism in groups of t inside a host, as torchtitan's 2D meshes run it (llama3-405b
      on 64x8 H100s: dp256 x tp2 with FSDP + SP, 482 TFLOP/s per device, where the best of
      64 x 8 and 1 x 512 reached 387). Only their seeds are solved (`_seeds_only`), but for
      m x 2 on two hosts. The flat axis is FSDP over all of them, as torchtitan shards over a
      flat data-parallel mesh. On n x m, a parameter sharded on both
      axes is gathered inner axis first (DTensor's nested shard order), so the inter-host step
      moves (n - 1) / n of the parameter from every device; a flat collective is priced at the
      cluster's all-device bandwidth (llama3-70b on 8x8 H100s, FSDP over all 64 at 2 rows per
      device: one pass's all-gathers 2.57 s on 8 x 8, 0.65 s flat; the step 17.12 against
      16.71 s with full recomputation). On two hosts m x 2 (tensor parallelism in device pairs
      inside a host with data parallelism over the rest: the best manual configuration of
      gpt-15b on 4x8 A100s, dp8 x tp2 per 16-device stage) is solved in full. Larger
      multi-host submeshes do not get that: it is one of the costliest intra-op programs, and
      planning gpt-39b on 8x8 V100s took 48 s with it on two hosts only, 100 s with it on every
      multi-host submesh (one run each).

    A mesh and its transpose are not interchangeable: a dimension sharded on both axes nests axis 0
    outside axis 1 (DTensor's default shard order; `planner.intra.strategies` has no strided shards). On
    4 x 2 with tensor parallelism on axis 1, Megatron's dp-outer, tp-inner activation layout is
    (S(0), S(0)), and moving between it and (S(0), R) is one collective over the 2 tp devices. With
    tensor parallelism on axis 0 of 2 x 4 the same layout nests the other way round, and DTensor
    first replicates a misaligned nested shard (`cost_models.resharding`). gpt-39b on 8x8 A100s
    with micro-batch 8 plans 19.14 s per iteration without 4 x 2, 19.04 s with it."""
    n, m = submesh
    if n > 1:
        groups = [(n * m // t, t) for t in range(2, m) if m % t == 0]
        return [(n, m), *groups, (1, n * m)]
    return [(1, m)] + [(a, m // a) for a in range(2, m) if m % a == 0]


def _seeds_only(sub: tuple[int, int], shape: tuple[int, int], mode: str) -> bool:
    """Whether only the seeds are solved on this logical mesh (data parallelism, FSDP, tensor
    parallelism inside a host, context parallelism; `planner.intra.megatron.seed_filters`):
    on a submesh across hosts, every logical mesh `logical_shapes` offers but hosts x devices
    and, on two hosts, m x 2. Their free time-optimal programs with the memory ladder would be
    the costliest passes of the submesh, and tensor parallelism across hosts cannot win."""
    n, m = sub
    if mode == "inter-only" or n == 1 or shape == sub:
        return False
    return not (n == 2 and shape == (m, 2))


def _param_filter(mode: str) -> Callable[[str, Option], bool] | None:
    if mode == "inter-only":
        return lambda path, o: (
            not o.zero and all(p == "R" for p in o.strategy.output[0])
        )
    return None


def _seeds(
    graph: OpGraph, mesh: LogicalMesh, mode: str, context_parallel: bool = True
) -> list:
    """Megatron-style parameter placements solved as extra candidates (`planner.intra.megatron`);
    on a mesh spanning hosts also HSDP over the axes inside a host; context parallelism
    (`planner.intra.megatron.context_seeds`) unless `context_parallel` is False. On the
    tensor-parallel groups across hosts (`logical_shapes`' (n * m / t) x t, seeds only) only
    the tensor-parallel seeds: data parallelism, FSDP and context parallelism over all devices
    are the flat mesh's."""
    if mode == "inter-only":
        return []
    experts = any(is_expert_weight(p) for p in graph.placeholder_paths.values())
    M = mesh.cluster.devices_per_host
    tps = {t for t in range(2, M + 1) if M % t == 0}
    groups = _seeds_only(mesh.submesh, mesh.shape, mode) and mesh.shape[0] > 1
    seeds = seed_filters(mesh.shape, experts, tps, hybrid_axes(mesh), groups)
    if context_parallel and not groups:
        seeds += context_seeds(mesh.shape, experts, tps)
    return seeds


#: Schedules `search` accepts beyond `cost_models.memory.SCHEDULES`' pinned ones: "auto" searches
#: 1F1B (the stage DP) and interleaved 1F1B (`planner.inter.interleave`); "interleaved" only the
#: latter.
SEARCHED = ("auto", "interleaved")


class _Table:
    """The stage DP's cost table for one layer clustering (see `planner.inter.stage_table`)."""

    def __init__(self, graph, layers, cluster, subs, B, mode, schedule) -> None:
        self.layers = layers
        self.L = L = len(layers)
        self.layer_of = bd.layer_of_nodes(graph, layers)
        self.bounds = bd.boundary_values(graph, self.layer_of, L)
        self.boundary_bytes = bd.boundary_bytes(graph, self.bounds)
        self.grad_bytes = bd.boundary_bytes(graph, self.bounds, gradients=True)
        S = min(L, cluster.num_devices) if mode != "intra-only" else 1
        self.zero_bubble = schedule == "zero_bubble"
        schedule = "1f1b" if schedule in SEARCHED else schedule
        # zero bubble: s is the number of stages in all (`stage_dp` by_total); the last of them
        # defers the most weight gradients, min(B, s): every stage is held to that bound
        self.pending = (
            np.array([0] + [min(B, s) for s in range(1, S + 1)], dtype=float)
            if self.zero_bubble
            else None
        )
        self.inflight = np.array(
            [0] + [microbatches_in_flight(schedule, B, s, 0) for s in range(1, S + 1)],
            dtype=float,
        )
        self.cost = np.full((L, L, len(subs), S + 1), np.inf)
        # [k, j, m, s]: the index in `options` of the entry's option (-1: none fits)
        self.choice = np.full(self.cost.shape, -1, dtype=np.int32)
        self.options: list[StageOption] = []

    def add(self, m, mesh, prof, budget, crosses_hosts, whole) -> float:
        """Enter one profile for submesh index m; returns the least memory of all layers as one
        stage (for the error message when nothing fits) when `whole`, else inf."""
        send = bd.send_times(
            mesh, self.boundary_bytes, crosses_hosts, grad_bytes=self.grad_bytes
        )
        least = np.inf
        modes = prof.recompute_modes()
        # zero bubble is priced and run without recomputation or FSDP (manual_plan)
        if self.zero_bubble:
            if prof.solution.fsdp_params:
                return least
            modes = ("none",)
        for rc in modes:
            c, mem = range_costs(prof, self.inflight, budget, send, rc, self.pending)
            if whole:
                least = min(least, float(mem[0, self.L - 1, 1]))
            better = c < self.cost[:, :, m, :]
            if better.any():
                self.cost[:, :, m, :][better] = c[better]
                self.choice[:, :, m, :][better] = len(self.options)
                self.options.append(StageOption(mesh, prof, rc))
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


def _fits_nowhere(prof: st.LayerProfile, layering, budget: float) -> bool:
    """Whether no layer of `layering` (a `_Table` or the `InterleavedSearch`) has its parameter
    state within `budget` under `prof`'s solution: no range of that clustering fits, so the
    solution's profile for it would enter nothing (`stage_table.least_layer_params`)."""
    least = st.least_layer_params(prof.solution, layering.layer_of, layering.L)
    return least > budget


def _lean_layers(tables: list, sub: tuple[int, int], devices: int) -> tuple | None:
    """The clustering whose layers the memory ladder (`planner.inter.stage_solves.profiles_for`) must
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


def search(
    graph: OpGraph,
    layerings: list[list[tuple[int, int]]],
    cluster: Cluster,
    subs: list[tuple[int, int]],
    B: int,
    budget: float,
    optimizer: str,
    mode: str,
    schedule: str,
    say: Callable[[str], None],
    context_parallel: bool = True,
    chunk_layers: list[tuple[int, int]] | None = None,
) -> SearchResult:
    """Solve the intra-op pass once per logical mesh (time-optimal, memory ladder, Megatron seeds,
    context-parallel seeds unless `context_parallel` is False),
    attribute every solution to each layer clustering, run the stage DP on each clustering's
    table (memory with the micro-batches `schedule` keeps in flight; for zero bubble, where
    that depends on the pipeline's number of stages, the DP `by_total`: its latency objective
    stays 1F1B's, the candidates are ranked by the plan's own price). With `schedule` "auto" the
    stage DP's 1F1B candidates and the interleaved options (`planner.inter.interleave`, on its own
    clustering `chunk_layers`, by default `interleave_layering`'s; every profile is attributed to it
    as to the others) are returned together; with "interleaved" only the latter."""
    tables = [
        _Table(graph, layers, cluster, subs, B, mode, schedule) for layers in layerings
    ]
    # without context parallelism: no attention node may take a CP strategy, seeded or not
    acts = None if context_parallel else without_context(graph)
    inter = None
    if schedule in SEARCHED and mode != "intra-only":
        chunks = chunk_layers or interleave_layering(graph)
        inter = InterleavedSearch(graph, chunks, cluster.num_devices, B, budget)
    least = np.inf
    first = tables[0]
    # A mesh where no layer's parameter state fits is not solved: none of its solutions could
    # enter a table or the interleaved options (`stage_solves.least_layer_state`; the chunks'
    # layers count where the submesh's device groups can be interleaved); the whole cluster's
    # is, for the least memory the error message reports when nothing fits.
    layer_maps = [t.layer_of for t in tables]

    def fits(job: tuple) -> bool:
        _, sub, mesh = job
        if sub == cluster.shape:
            return True
        maps = layer_maps + ([inter.layer_of] if inter and inter.groups(sub) else [])
        return stage_solves.least_layer_state(graph, mesh, maps, optimizer) <= budget

    meshes = [
        (m, sub, LogicalMesh(cluster, sub, shape))
        for m, sub in enumerate(subs)
        for shape in (
            [(1, sub[0] * sub[1])] if mode == "inter-only" else logical_shapes(sub)
        )
    ]
    jobs = [job for job in meshes if fits(job)]

    def solve(job: tuple) -> list:
        _, sub, mesh = job
        shape = mesh.shape
        with solves_overlap():
            say(
                f"micro-batches {B}: submesh {sub[0]}x{sub[1]}, logical mesh "
                f"{shape[0]}x{shape[1]} ({jobs.index(job) + 1} of {len(jobs)})"
            )
            return stage_solves.profiles_for(
                graph,
                mesh,
                first.layer_of,
                first.bounds,
                first.L,
                num_microbatches=B,
                budget=budget,
                optimizer=optimizer,
                param_filter=_param_filter(mode),
                activation_filter=acts,
                seeds=_seeds(graph, mesh, mode, context_parallel),
                lean_layers=_lean_layers(tables, sub, cluster.num_devices),
                seeds_only=_seeds_only(sub, shape, mode),
            )

    # The meshes' intra-op programs are independent: threads overlap one mesh's HiGHS solve with
    # another's pricing (`planner.intra.highs.solves_overlap`). Results are entered in job order, so the
    # plan does not depend on the thread count. On an error or Ctrl-C the queued passes are
    # cancelled (the running ones finish first).
    pool = ThreadPoolExecutor(max_workers=_solver_threads())
    try:
        for (m, sub, mesh), profiles in zip(jobs, pool.map(solve, jobs)):
            crosses = cluster.hosts > 1 and sub[1] == cluster.devices_per_host
            whole = sub == cluster.shape
            for t in tables:
                for prof in profiles:
                    if t is not first:
                        if not whole and _fits_nowhere(prof, t, budget):
                            continue
                        prof = st.profile(
                            prof.solution, graph, t.layer_of, t.bounds, t.L
                        )
                    low = t.add(m, mesh, prof, budget, crosses, whole)
                    least = min(least, low)
            if inter is not None and inter.groups(sub):
                for prof in profiles:
                    if inter.layers != first.layers:
                        if _fits_nowhere(prof, inter, budget):
                            continue
                        prof = st.profile(
                            prof.solution, graph, inter.layer_of, inter.bounds, inter.L
                        )
                    inter.add(
                        sub,
                        mesh,
                        prof,
                        crosses,
                        lambda rc, mesh=mesh, prof=prof: StageOption(mesh, prof, rc),
                    )
    finally:
        pool.shutdown(cancel_futures=True)
    out = []
    for pick in inter.best() if inter is not None else []:
        stages = [StagePick(c, pick.submesh, pick.option) for c in pick.chunks]
        out.append(Candidate(inter.layers, stages, "interleaved", pick.virtual_stages))
    if schedule == "interleaved":
        return SearchResult(out, least)
    for t in tables:
        if mode == "intra-only":  # one stage: only the range of all layers
            whole = t.cost[0, t.L - 1].copy()
            t.cost[:] = np.inf
            t.cost[0, t.L - 1] = whole
        zb = schedule == "zero_bubble"
        if zb:  # torch's zero bubble: B >= S stages and a multiple of its rounds B // S
            for S in range(1, t.cost.shape[3]):
                if B < S or B % (B // S):
                    t.cost[..., S] = np.inf
        try:
            dp = stage_dp(
                t.cost, [a * b for a, b in subs], cluster.num_devices, B, by_total=zb
            )
        except MeshplanError:
            continue
        S = len(dp.stages)
        picks = [
            StagePick((k, j), subs[m], t.options[t.choice[k, j, m, S if zb else S - i]])
            for i, (k, j, m) in enumerate(dp.stages)
        ]
        out.append(
            Candidate(t.layers, picks, "1f1b" if schedule in SEARCHED else schedule)
        )
    return SearchResult(out, least)
