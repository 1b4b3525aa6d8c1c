"""One micro-batch size's search behind `planner.api.plan` (`evaluate`): the model traced at
the size, the size skipped when its least possible iteration time (`planner.size_bound`)
exceeds a plan already found, else its meshes searched (`planner.inter.mesh_search`; given up
between two meshes once such a plan is found elsewhere, or once one found is faster than the
least its meshes allow, `planner.inter.mesh_bound`) and its candidate plans ranked by
their predicted iteration time. `planner.size_search` runs it for
every size, in this process or in worker processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.collector import sparse_collections
from planner.inter.layers import graph_layerings
from planner.inter.mesh_search import search
from planner.inter.mesh_share import MeshShare
from planner.plans.assemble import (
    PlanSpec,
    device_memory,
    predicted_iteration_time,
    stage_from_profile,
)
from planner.size_bound import least_iteration_time
from planner.tracing.inputs import ModelSource
from planner.vocab.plan_file import ParallelPlan

Progress = Callable[[str], None]

#: Whether a size whose least possible iteration time (`planner.size_bound`) exceeds a plan found
#: already is skipped (`evaluate`); `benchmarks.size_landscape` turns it off to record every
#: size's best plan. The bound must exceed the plan by `BOUND_MARGIN` (relative), a margin for
#: the rounding of two sums priced apart.
SKIP_BOUNDED_SIZES = True
BOUND_MARGIN = 1e-9


@dataclass(frozen=True)
class SizeJob:
    """What the search of one micro-batch size reads besides the size (picklable when `model`
    is a name or spec)."""

    model: Any  # name, spec or nn.Module, as `plan` got it
    example_batch: Any
    dtype: torch.dtype
    model_name: str | None
    cluster: Cluster
    global_batch: int
    budget: float
    optimizer: str
    mode: str
    schedule: str
    num_layers: int | None
    submeshes: list[tuple[int, int]]
    context_parallel: bool = True  # `planner.plan`'s switch


@dataclass(frozen=True, order=True)
class Ranked:
    """A searched plan and its predicted iteration time (ordered by the time)."""

    seconds: float
    spec: PlanSpec = field(compare=False)


@dataclass
class SizeResult:
    """The best plan of one micro-batch size: `best` (searched here) or `plan` (assembled by a
    worker); neither when nothing fits or the model cannot be traced at the size (`untraceable`),
    or when `beaten`: its plan's time is known but was not assembled, a size whose result the
    search keeps being faster (`planner.size_search.evaluate_all`), or when `bounded`: not
    searched, or not to its end, since none of its plans can beat one found already
    (`evaluate`). `least`:
    per-device memory of the whole model as one stage on all devices, at best."""

    size: int
    seconds: float = np.inf
    best: Ranked | None = None
    plan: ParallelPlan | None = None
    least: float = np.inf
    untraceable: MeshplanError | None = None
    beaten: bool = False
    # not searched (or given up): the least iteration time any of its plans could take
    # (`planner.size_bound`), above a plan found at another size
    bounded: float | None = None

    @property
    def found(self) -> bool:
        return self.best is not None or self.plan is not None


def evaluate(
    job: SizeJob,
    make: ModelSource,
    b: int,
    say: Progress,
    share: MeshShare | None = None,
    beat: Callable[[], float] | None = None,
) -> SizeResult:
    """Trace the model at micro-batch size `b` and search it (`planner.inter.mesh_search`; with
    `share`, other processes may solve some of its meshes), with the garbage collector held
    back (`planner.collector`). `beat()`: the time of the fastest plan found so far among the
    results the caller compares this one with. Where the size's least possible iteration time
    (`planner.size_bound`) exceeds it, no plan of the size can be the caller's best, and the
    size is not searched, or no further mesh of it is when that happens during its search
    (`SizeResult.bounded`; unless `SKIP_BOUNDED_SIZES` is off)."""
    if share is not None:
        share.begin()
    try:
        with sparse_collections():
            return _evaluate(job, make, b, say, share, beat)
    finally:
        if share is not None:
            share.end()


def search_args(job: SizeJob, graph: Any, b: int, say: Progress) -> tuple[list, dict]:
    """The arguments of `planner.inter.mesh_search.search` for one traced size (its owner's and
    its helpers' alike)."""
    # per trace: the op count may depend on the micro-batch size (e.g. size-1 dims)
    D = job.cluster.num_devices
    layers = graph_layerings(graph, job.num_layers, D if job.mode == "auto" else 1)
    args = [
        graph,
        layers,
        job.cluster,
        job.submeshes,
        job.global_batch // b,
        job.budget,
        job.optimizer,
        job.mode,
        job.schedule,
        say,
    ]
    kw = {
        "context_parallel": job.context_parallel,
        "chunk_layers": layers[0] if job.num_layers else None,
    }
    return args, kw


class _Bounded:
    """Whether no plan of a traced size can beat the fastest found so far (`beat()`): its least
    possible iteration time exceeds it. Asked once the size is traced and again before each of
    its meshes is solved (`planner.inter.mesh_search.search`'s `give_up`), as other sizes' plans
    come in. The bound is one device's work over the devices (`planner.size_bound`, made the
    first time a plan has been found), and where that does not rule the size out and its meshes
    are known, what they allow (`planner.inter.mesh_bound`, made the first time it is needed).
    The same per logical mesh (`mesh`): a mesh none of whose plans can beat it is not solved."""

    def __init__(
        self, job: SizeJob, graph: Any, B: int, beat: Callable[[], float] | None
    ):
        self.job, self.graph, self.B = job, graph, B
        self.beat = beat if SKIP_BOUNDED_SIZES else None
        self.fastest = np.inf
        self.least = None  # the bound that ruled the size out

    @functools.cached_property
    def bound(self) -> float | None:
        job = self.job
        return least_iteration_time(
            self.graph,
            job.cluster,
            self.B,
            job.global_batch,
            job.optimizer,
            job.model_name or "",
        )

    def __call__(self, meshes: Callable[[float], float | None] | None = None) -> bool:
        self.fastest = np.inf if self.beat is None else self.beat()
        if not np.isfinite(self.fastest):
            return False
        above = self.fastest / (1 - BOUND_MARGIN)
        if self.bound is not None and self.bound > above:
            self.least = self.bound
        elif meshes is not None:
            self.least = meshes(above)
        return self.least is not None

    def why(self) -> str:
        return (
            f"none of its plans takes under {self.least:.4g} s per iteration, and one of "
            f"{self.fastest:.4g} s was found"
        )

    def mesh(self, beyond: Callable[[float], bool]) -> str | None:
        """Why no plan with a stage on one logical mesh of the size can beat the fastest found
        so far (`beyond(seconds)`: whether every such plan takes more than `seconds`,
        `planner.inter.mesh_search`'s `skip_mesh`), else None."""
        fastest = np.inf if self.beat is None else self.beat()
        if not np.isfinite(fastest) or not beyond(fastest / (1 - BOUND_MARGIN)):
            return None
        return (
            f"no plan with a stage on it takes under the {fastest:.4g} s of one found"
        )


def _evaluate(
    job: SizeJob,
    make: ModelSource,
    b: int,
    say: Progress,
    share: MeshShare | None,
    beat: Callable[[], float] | None,
) -> SizeResult:
    name = job.model_name
    say(f"tracing {name} with micro-batch {b}")
    try:
        graph = make.trace(b)
    except MeshplanError as exc:  # e.g. BatchNorm over a single value per channel
        say(f"micro-batch {b} skipped: {exc}")
        return SizeResult(b, untraceable=exc)
    B = job.global_batch // b
    bounded = _Bounded(job, graph, B, beat)
    if bounded():
        say(f"micro-batch {b} skipped: {bounded.why()}")
        return SizeResult(b, bounded=bounded.least)
    args, kw = search_args(job, graph, b, say)
    counts = ", ".join(str(len(x)) for x in args[1])
    say(f"{len(graph.ops)} ops in {counts} layers")
    result = search(*args, **kw, share=share, give_up=bounded, skip_mesh=bounded.mesh)
    if result is None:
        say(f"micro-batch {b} given up: {bounded.why()}")
        return SizeResult(b, bounded=bounded.least)
    found = []
    memo: dict = {}  # per profile: the arrays its stages are priced from
    for cand in result.candidates:
        stages = [
            stage_from_profile(
                s.layers, s.submesh, s.option.profile, s.option.recompute, memo
            )
            for s in cand.stages
        ]
        spec = PlanSpec(
            model_name=name,
            graph=graph,
            layers=cand.layers,
            cluster=job.cluster,
            stages=stages,
            num_microbatches=B,
            global_batch=job.global_batch,
            schedule=cand.schedule,
            optimizer=job.optimizer,
            kind=job.mode,
            memory_budget=job.budget,
            virtual_stages=cand.virtual_stages,
        )
        # an interleaved option's memory was checked without tied copies: the plan's own price
        if cand.virtual_stages > 1 and max(device_memory(spec)) > job.budget:
            continue
        found.append(Ranked(predicted_iteration_time(spec), spec))
    best = min(found) if found else None
    skipped = result.skipped
    if best:
        said = f"{best.seconds:.4g} s per iteration, the best of {len(found)} candidate plans"
    else:
        said = (
            "no plan " + ("of the meshes solved " if skipped else "") + "fits in memory"
        )
    if skipped:
        said += f" ({skipped} logical mesh{'es' if skipped > 1 else ''} skipped by the bound)"
    say(f"micro-batch {b}: {said}")
    return SizeResult(
        b,
        seconds=best.seconds if best else np.inf,
        best=best,
        least=result.least_whole_memory,
    )
