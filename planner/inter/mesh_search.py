"""The search for one micro-batch size: the submeshes and logical meshes tried, an intra-op pass
per logical mesh (time-optimal, memory ladder, Megatron seeds; on threads), the stage DP's cost
table per layer clustering (`planner.inter.stage_table`), and the stage DP (`planner.inter.stage_dp`) on
each; with the schedule "auto" or "interleaved", also the interleaved 1F1B options
(`planner.inter.interleave`). `planner.api.plan` runs it for every candidate micro-batch size and
assembles the best. Once a plan has been found (at another size), a logical mesh none of whose
plans could beat it (`planner.inter.mesh_bound`) is not solved (`search`'s `skip_mesh`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from cost_models.memory import microbatches_in_flight
from planner.inter import boundaries as bd
from planner.inter import mesh_bound, mesh_share, stage_solves
from planner.inter import stage_table as st
from planner.inter.interleave import InterleavedSearch, interleave_layering
from planner.inter.mesh_shapes import (
    _param_filter,
    _seeds,
    _seeds_only,
    logical_shapes,
)
from planner.inter.mesh_share import JobCursor, MeshShare
from planner.inter.range_costs import range_costs
from planner.inter.stage_dp import stage_dp
from planner.intra.context import without_context
from planner.intra.highs import solves_overlap
from planner.intra.priced_stage import PricedStage
from planner.intra.solve import StagePricing, price_stage
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
    skipped: int = 0  # logical meshes not solved: no plan with a stage on one could win


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


def solver_threads() -> int:
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


class _MeshJobs:
    """One micro-batch size's search (`search`): the layer clusterings' tables, the interleaved
    options, the logical meshes to solve (`jobs`), how a job is solved (`solve`), its profiles
    attributed to every clustering (`attribute`) and entered (`enter`, in job order), and the
    stage DP's candidates at the end (`result`)."""

    def __init__(
        self,
        graph,
        layerings,
        cluster,
        subs,
        B,
        budget,
        optimizer,
        mode,
        schedule,
        say,
        context_parallel=True,
        chunk_layers=None,
    ) -> None:
        self.graph, self.cluster, self.subs, self.B = graph, cluster, subs, B
        self.budget, self.optimizer, self.mode, self.schedule = (
            budget,
            optimizer,
            mode,
            schedule,
        )
        self.say, self.context_parallel = say, context_parallel
        self.tables = [
            _Table(graph, layers, cluster, subs, B, mode, schedule)
            for layers in layerings
        ]
        # without context parallelism: no attention node may take a CP strategy, seeded or not
        self.acts = None if context_parallel else without_context(graph)
        self.inter = None
        if schedule in SEARCHED and mode != "intra-only":
            chunks = chunk_layers or interleave_layering(graph)
            self.inter = InterleavedSearch(
                graph, chunks, cluster.num_devices, B, budget
            )
        self.least = np.inf
        self.first = self.tables[0]
        self.layer_maps = [t.layer_of for t in self.tables]
        meshes = [
            (m, sub, LogicalMesh(cluster, sub, shape))
            for m, sub in enumerate(subs)
            for shape in (
                [(1, sub[0] * sub[1])] if mode == "inter-only" else logical_shapes(sub)
            )
        ]
        self.jobs = [job for job in meshes if self._fits(job)]
        # The order the jobs are taken in when shared (`_shared`, `help_search`; each is
        # entered in job order, whoever solved it): the free programs before the seeds-only
        # ones, on larger submeshes first. The costliest come first, taken by the owner before
        # a helper joins, whose threads run at a lower priority (`mesh_share.lower_priority`):
        # mixtral-8x7b at 8 rows per micro-batch spends 21.9 s of its 38 s on the 4x8 mesh of
        # 4 hosts, then 1.5-2 s on each other free program and under 1 s on a seeds-only one.
        self.order = sorted(
            range(len(self.jobs)),
            key=lambda i: (
                _seeds_only(self.jobs[i][1], self.jobs[i][2].shape, mode),
                -self.jobs[i][2].num_devices,
                i,
            ),
        )
        self._pricings: dict = {}  # the owner's pricing of a helper's mesh (`result`)
        # per helper's profile, by id (the tables hold it): the one `rebuild` made, so that the
        # stages picked from it share one profile and what is derived from it (the 1T GPT
        # at 64 rows on 384x8 A100s: 468 picks, 2.1 s pricing the candidates instead of 0.6)
        self._rebuilt: dict[int, st.LayerProfile] = {}
        # per job: its pricing made by the size's bound (`beyond`) before its solve, which
        # takes it over; its prices once solved (`solve`)
        self._priced: dict[int, StagePricing] = {}
        self._done: dict[int, PricedStage] = {}
        self._least: mesh_bound.LeastTime | None = None
        self._bound_at: dict[int, int] = {}  # job -> its mesh's index in `_least`
        # `search`'s `skip_mesh` (this process's own solves only) and the meshes it skipped
        self.skip: Callable[[Callable[[float], bool]], str | None] | None = None
        self.skipped = 0

    def _price(self, i: int) -> StagePricing:
        return price_stage(
            self.graph,
            self.jobs[i][2],
            num_microbatches=self.B,
            optimizer=self.optimizer,
        )

    def _prices(self, i: int) -> PricedStage:
        """Job i's prices: its solve's, else made here and kept for its solve."""
        if i in self._done:
            return self._done[i]
        if i not in self._priced:
            self._priced[i] = self._price(i)
        return self._priced[i].ctx

    def beyond(self, seconds: float) -> float | None:
        """A least iteration time of the size's plans on its meshes above `seconds`
        (`planner.inter.mesh_bound`, its meshes priced as far as needed), else None; None for
        zero bubble (no bound)."""
        if self.schedule == "zero_bubble":
            return None
        least = self._bound()
        return least.seconds if least.exceeds(seconds) else None

    def beyond_with(self, i: int, seconds: float) -> bool:
        """Whether every plan of the size with a stage on job i's logical mesh takes more than
        `seconds` (`mesh_bound.LeastTime.exceeds_with`, the meshes priced as far as needed);
        never for zero bubble."""
        if self.schedule == "zero_bubble":
            return False
        return self._bound().exceeds_with(self._bound_at[i], seconds)

    def _bound(self) -> mesh_bound.LeastTime:
        """The size's `mesh_bound.LeastTime`, made the first time it is needed."""
        if self._least is None:
            layerings = [t.layers for t in self.tables]
            if self.inter is not None:
                layerings.append(self.inter.layers)
            # the smallest meshes first: the cheapest to price, and where communication is
            # least, the likeliest to bring the bound below a plan (moe-70b on 8x8 A100s at 4
            # rows: 2 meshes, 0.17 s, against 16 and 4.8 s largest first)
            order = sorted(
                range(len(self.jobs)), key=lambda i: self.jobs[i][2].num_devices
            )
            self._bound_at = {i: p for p, i in enumerate(order)}
            self._least = mesh_bound.LeastTime(
                self.graph,
                layerings,
                [
                    (self.jobs[i][2].num_devices, lambda i=i: self._prices(i))
                    for i in order
                ],
                self.B,
                self.cluster.num_devices,
            )
        return self._least

    def job(self, p: int) -> tuple:
        """The job at position p of the take order."""
        return self.jobs[self.order[p]]

    def _fits(self, job: tuple) -> bool:
        """A mesh where no layer's parameter state fits is not solved: none of its solutions
        could enter a table or the interleaved options (`stage_solves.least_layer_state`; the
        chunks' layers count where the submesh's device groups can be interleaved); the whole
        cluster's is, for the least memory the error message reports when nothing fits."""
        _, sub, mesh = job
        if sub == self.cluster.shape:
            return True
        inter = self.inter
        maps = self.layer_maps + (
            [inter.layer_of] if inter and inter.groups(sub) else []
        )
        return (
            stage_solves.least_layer_state(self.graph, mesh, maps, self.optimizer)
            <= self.budget
        )

    def solve(self, job: tuple) -> list[st.LayerProfile]:
        """The solutions of one logical mesh, profiled for the first clustering."""
        _, sub, mesh = job
        shape, first, mode = mesh.shape, self.first, self.mode
        i = self.jobs.index(job)
        with solves_overlap():
            where = (
                f"micro-batches {self.B}: submesh {sub[0]}x{sub[1]}, logical mesh "
                f"{shape[0]}x{shape[1]}"
            )
            why = (
                None
                if self.skip is None
                else self.skip(functools.partial(self.beyond_with, i))
            )
            if why is not None:
                self.skipped += 1
                self.say(f"{where} skipped: {why}")
                return []
            pricing = self._priced.pop(i, None) or self._price(i)
            self.say(f"{where} ({i + 1} of {len(self.jobs)})")
            profiles = stage_solves.profiles_for(
                self.graph,
                mesh,
                first.layer_of,
                first.bounds,
                first.L,
                num_microbatches=self.B,
                budget=self.budget,
                optimizer=self.optimizer,
                param_filter=_param_filter(mode),
                activation_filter=self.acts,
                seeds=_seeds(self.graph, mesh, mode, self.context_parallel),
                lean_layers=_lean_layers(self.tables, sub, self.cluster.num_devices),
                seeds_only=_seeds_only(sub, shape, mode),
                pricing=pricing,
            )
            self._done[i] = pricing.ctx  # for the bound, should it be asked later
            # a pricing the bound made meanwhile: this one serves it now
            self._priced.pop(i, None)
            return profiles

    def attribute(self, job: tuple, profiles: list) -> list[list[st.LayerProfile]]:
        """A job's profiles per clustering (the tables', then the interleaved options' when its
        device groups can use the submesh); a solution none of whose layers fits a clustering is
        left out of it (not on the whole cluster, for the least memory of the error message)."""
        _, sub, _ = job
        whole = sub == self.cluster.shape
        out = []
        for t in self.tables:
            out.append(
                [
                    p
                    if t is self.first
                    else st.profile(p.solution, self.graph, t.layer_of, t.bounds, t.L)
                    for p in profiles
                    if t is self.first or whole or not _fits_nowhere(p, t, self.budget)
                ]
            )
        inter = self.inter
        if inter is not None and inter.groups(sub):
            same = inter.layers == self.first.layers
            out.append(
                [
                    p
                    if same
                    else st.profile(
                        p.solution, self.graph, inter.layer_of, inter.bounds, inter.L
                    )
                    for p in profiles
                    if same or not _fits_nowhere(p, inter, self.budget)
                ]
            )
        return out

    def enter(self, job: tuple, attributed: list[list[st.LayerProfile]]) -> None:
        """Enter a job's profiles, per clustering as `attribute` gives them."""
        m, sub, mesh = job
        crosses = self.cluster.hosts > 1 and sub[1] == self.cluster.devices_per_host
        whole = sub == self.cluster.shape
        for t, profs in zip(self.tables, attributed):
            for prof in profs:
                self.least = min(
                    self.least, t.add(m, mesh, prof, self.budget, crosses, whole)
                )
        if len(attributed) > len(self.tables):
            for prof in attributed[-1]:
                self.inter.add(
                    sub,
                    mesh,
                    prof,
                    crosses,
                    lambda rc, mesh=mesh, prof=prof: StageOption(mesh, prof, rc),
                )

    def _own(self, pick: StagePick) -> StagePick:
        """`pick` with a helper's profile given this process's pricing back."""
        option = pick.option
        if not mesh_share.is_shipped(option.profile):
            return pick
        key = id(option.profile)
        if key not in self._rebuilt:
            self._rebuilt[key] = mesh_share.rebuild(
                option.profile,
                self.graph,
                option.mesh,
                self.B,
                self.optimizer,
                self._pricings,
            )
        prof = self._rebuilt[key]
        return dataclasses.replace(
            pick, option=dataclasses.replace(option, profile=prof)
        )

    def result(self) -> SearchResult:
        """The stage DP's candidate per clustering and the interleaved options."""
        inter = self.inter
        out = []
        for pick in inter.best() if inter is not None else []:
            stages = [StagePick(c, pick.submesh, pick.option) for c in pick.chunks]
            out.append(
                Candidate(inter.layers, stages, "interleaved", pick.virtual_stages)
            )
        if self.schedule != "interleaved":
            out += self._dp_candidates()
        out = [
            dataclasses.replace(c, stages=[self._own(s) for s in c.stages]) for c in out
        ]
        return SearchResult(out, self.least, self.skipped)

    def _dp_candidates(self) -> list[Candidate]:
        B, subs, schedule, mode = self.B, self.subs, self.schedule, self.mode
        out = []
        for t in self.tables:
            if mode == "intra-only":  # one stage: only the range of all layers
                whole = t.cost[0, t.L - 1].copy()
                t.cost[:] = np.inf
                t.cost[0, t.L - 1] = whole
            zb = schedule == "zero_bubble"
            if (
                zb
            ):  # torch's zero bubble: B >= S stages and a multiple of its rounds B // S
                for S in range(1, t.cost.shape[3]):
                    if B < S or B % (B // S):
                        t.cost[..., S] = np.inf
            try:
                dp = stage_dp(
                    t.cost,
                    [a * b for a, b in subs],
                    self.cluster.num_devices,
                    B,
                    by_total=zb,
                )
            except MeshplanError:
                continue
            S = len(dp.stages)
            picks = [
                StagePick(
                    (k, j), subs[m], t.options[t.choice[k, j, m, S if zb else S - i]]
                )
                for i, (k, j, m) in enumerate(dp.stages)
            ]
            out.append(
                Candidate(t.layers, picks, "1f1b" if schedule in SEARCHED else schedule)
            )
        return out


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
    share: MeshShare | None = None,
    give_up: Callable[[Callable[[float], float | None]], bool] | None = None,
    skip_mesh: Callable[[Callable[[float], bool]], str | None] | None = None,
) -> SearchResult | None:
    """Solve the intra-op pass once per logical mesh (time-optimal, memory ladder, Megatron seeds,
    context-parallel seeds unless `context_parallel` is False),
    attribute every solution to each layer clustering, run the stage DP on each clustering's
    table (memory with the micro-batches `schedule` keeps in flight; for zero bubble, where
    that depends on the pipeline's number of stages, the DP `by_total`: its latency objective
    stays 1F1B's, the candidates are ranked by the plan's own price). With `schedule` "auto" the
    stage DP's 1F1B candidates and the interleaved options (`planner.inter.interleave`, on its own
    clustering `chunk_layers`, by default `interleave_layering`'s; every profile is attributed to it
    as to the others) are returned together; with "interleaved" only the latter. With `share`,
    other planner processes may solve some of the meshes (`planner.inter.mesh_share`); the
    result is the same. `give_up(beyond)` is asked before each mesh is solved here,
    `beyond(seconds)` giving the size's least iteration time on its meshes when it exceeds
    `seconds` (`planner.inter.mesh_bound`), else None: once it is true, no further mesh is
    started (nor taken by a helper) and the search returns None. `skip_mesh(beyond)` is asked
    before each mesh is solved here, `beyond(seconds)` telling whether every plan of the size
    with a stage on that mesh takes more than `seconds`: a reason (said in the progress) when
    none of them can be the caller's best, and the mesh is not solved."""
    jobs = _MeshJobs(
        graph,
        layerings,
        cluster,
        subs,
        B,
        budget,
        optimizer,
        mode,
        schedule,
        say,
        context_parallel=context_parallel,
        chunk_layers=chunk_layers,
    )
    # The meshes' intra-op programs are independent: threads overlap one mesh's HiGHS solve with
    # another's pricing (`planner.intra.highs.solves_overlap`). Results are entered in job order, so the
    # plan does not depend on the thread count. On an error or Ctrl-C the queued passes are
    # cancelled (the running ones finish first).
    ask = None if give_up is None else functools.partial(give_up, jobs.beyond)
    jobs.skip = skip_mesh
    stop = _Stop(ask, None if share is None else share.end)
    pool = ThreadPoolExecutor(max_workers=solver_threads())
    try:
        if share is None:
            solve = stop.unless(jobs.solve)
            for job, profiles in zip(jobs.jobs, pool.map(solve, jobs.jobs)):
                if profiles is None:
                    return None
                jobs.enter(job, jobs.attribute(job, profiles))
        elif not _shared(jobs, share, pool, stop):
            return None
    finally:
        pool.shutdown(cancel_futures=True)
    return jobs.result()


class _Stop:
    """`search`'s `give_up`, asked before a mesh is solved (holding the planner's lock, as a
    solve's Python work does: the question may price the graph, `planner.size_eval`); once
    true, it stays true. `ended()` runs before `stopped` is set (with a share: its jobs closed
    to every process before the owner waits on the helper's last messages)."""

    def __init__(
        self, give_up: Callable[[], bool] | None, ended: Callable[[], None] | None
    ) -> None:
        self.give_up, self.ended, self.stopped = give_up, ended, False

    def now(self) -> bool:
        if not self.stopped and self.give_up is not None:
            with solves_overlap():
                if self.give_up():
                    if self.ended is not None:
                        self.ended()
                    self.stopped = True
        return self.stopped

    def unless(self, solve: Callable) -> Callable:
        """`solve`, or None once stopped."""
        return lambda job: None if self.now() else solve(job)


def _shared(
    jobs: _MeshJobs, share: MeshShare, pool: ThreadPoolExecutor, stop: _Stop
) -> bool:
    """`search`'s solves with helpers (`planner.inter.mesh_share`): this process's threads take
    jobs from the front; each job's profiles are entered in job order, a helper's as they
    arrive. False when `stop` ends the search: no job is taken any more, and the helper's jobs
    already taken are waited for (its messages must all be read)."""

    def local() -> tuple[int, list] | None:
        if stop.now():
            return None
        p = share.take_front()
        return None if p is None else (jobs.order[p], jobs.solve(jobs.job(p)))

    share.open(len(jobs.jobs))
    futures = iter([pool.submit(local) for _ in jobs.jobs])
    solved: dict[int, list] = {}
    maps = jobs.layer_maps + ([jobs.inter.layer_of] if jobs.inter else [])
    position = {i: p for p, i in enumerate(jobs.order)}
    for i, job in enumerate(jobs.jobs):
        while i not in solved:
            f = None if share.helped(position[i]) else next(futures, None)
            # given up: jobs below i are entered (their messages read), read the rest's
            if f is None and stop.stopped:
                for p in range(len(jobs.jobs)):
                    if share.helped(p) and jobs.order[p] >= i:
                        share.receive(jobs.order[p])
                return False
            if f is None:  # a helper took it
                jobs.enter(job, mesh_share.received(share.receive(i), maps))
                break
            if (r := f.result()) is not None:
                solved[r[0]] = r[1]
        if i in solved:
            jobs.enter(job, jobs.attribute(job, solved.pop(i)))
    return True


def help_search(
    *search_args: Any, cursor: JobCursor, k: int, outbox: Any, **search_kw: Any
) -> int:
    """A helper's side of `search` with a share (`planner.inter.mesh_share`), given `search`'s
    arguments but the share: the jobs of size k (the owner's, as `search` lists them from the
    same arguments) taken from the back, each solved, attributed to every clustering and put on
    `outbox` for the owner; the number of jobs solved. An error is put there too, for the owner
    to raise."""
    jobs = _MeshJobs(*search_args, **search_kw)
    say, B = jobs.say, jobs.B
    if len(jobs.jobs) != cursor.count(k):  # a trace that differs: leave the size alone
        say(
            f"micro-batches {B}: not helping, {len(jobs.jobs)} mesh jobs against {cursor.count(k)}"
        )
        return 0

    def work() -> int:
        mesh_share.lower_priority()
        done = 0
        while (p := cursor.take_back(k)) is not None:
            i = jobs.order[p]
            try:
                job = jobs.jobs[i]
                profiles = jobs.attribute(job, jobs.solve(job))
                outbox.put((i, pickle.dumps(mesh_share.ship(profiles))))
                done += 1
            except Exception as exc:  # the owner raises it too
                outbox.put((i, f"{type(exc).__name__}: {exc}"))
                raise
        return done

    pool = ThreadPoolExecutor(max_workers=solver_threads())
    try:
        futures = [pool.submit(work) for _ in range(solver_threads())]
        return sum(f.result() for f in futures)
    finally:
        pool.shutdown(cancel_futures=True)
