"""The manual grid's walk (`benchmarks.manual_grid.best_manual`): each layout's groups priced in
order, with the pruning its docstring describes, in forked worker processes where
`planner.size_search` would use them; the result is the serial walk's."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.size_search import start_forked_worker, start_method, wanted_processes
from planner.vocab.plan_file import ParallelPlan

#: a `benchmarks.manual_grid.ManualConfig` (not imported: manual_grid imports this module)
Config = Any


def _by_size(group: list[Config]) -> list[list[Config]]:
    """A group's configurations split by micro-batch size: each size's recomputation ladder."""
    out: list[list[Config]] = []
    for c in group:
        if out and out[-1][0].num_microbatches == c.num_microbatches:
            out[-1].append(c)
        else:
            out.append([c])
    return out


@dataclass(frozen=True, order=True)
class Priced:
    """One priced configuration: its place in the serial walk (`index`) and what the search
    keeps of its plan."""

    index: int
    config: Config = field(compare=False)
    time_s: float = field(compare=False)
    tflops: float = field(compare=False)
    peak: float = field(compare=False)
    fits: bool = field(compare=False)
    skipped: bool = field(compare=False)  # `skip` accepted the plan


def layout_runs(
    groups: list[list[Config]],
) -> list[list[tuple[int, list[Config]]]]:
    """The groups split into runs of one layout (dp, tp, pp, expert parallel, fsdp, cp), its
    1F1B group first (`grid` lists them so), each group with the serial walk's index of its
    first configuration."""
    runs: list[list[tuple[int, list[Config]]]] = []
    index, key = 0, None
    for group in groups:
        g = group[0]
        layout = (g.dp, g.tp, g.pp, g.expert_parallel, g.fsdp, g.context_parallel)
        if layout != key or g.virtual_stages == 1:
            runs.append([])
        runs[-1].append((index, group))
        index += len(group)
        key = layout
    return runs


@dataclass(frozen=True)
class Walk:
    """Walks one layout's groups (`__call__`), as `best_manual` describes."""

    price: Callable[..., ParallelPlan]  # `benchmarks.manual_grid.price`
    model: str
    cluster: Cluster
    global_batch: int
    dtype: str
    optimizer: str
    say: Callable[[str], None] | None
    skip: Callable[[ParallelPlan], bool] | None

    def __call__(self, run: list[tuple[int, list[Config]]]) -> list[Priced]:
        """Price the run's groups: interleaved ones only when the 1F1B group had a
        configuration that fits (module docstring); in a group, micro-batch sizes in order until
        one does not fit or is slower than the one before, at each size the recomputation ladder
        up to the first rung that fits."""
        out: list[Priced] = []
        fitted_1f1b = False
        for start, group in run:
            if group[0].virtual_stages > 1 and not fitted_1f1b:
                continue
            previous = float("inf")  # best time at the previous micro-batch size
            first = 0  # ladder rungs below this one did not fit at a smaller size
            index = start
            for rungs in _by_size(group):
                fitted, here = False, float("inf")
                for k, config in enumerate(rungs):
                    if k < first:
                        continue
                    try:
                        p = self.price(
                            self.model,
                            self.cluster,
                            config,
                            self.global_batch,
                            self.dtype,
                            self.optimizer,
                        )
                    except MeshplanError as exc:  # e.g. too few ops for pp stages
                        if self.say:
                            self.say(f"  {config.label()}: skipped ({exc})")
                        continue
                    e, fits = p.estimate, bool(p.manual["fits"])
                    skipped = bool(fits and self.skip and self.skip(p))
                    out.append(
                        Priced(
                            index + k,
                            config,
                            e.iteration_time_s,
                            e.tflops_per_device,
                            e.peak_memory_bytes,
                            fits,
                            skipped,
                        )
                    )
                    if not fits:
                        first = max(first, k + 1)
                        continue
                    fitted = True
                    fitted_1f1b |= config.virtual_stages == 1
                    here = e.iteration_time_s
                    if self.say:
                        self.say(f"  {config.label()}: {here:.2f} s")
                    break  # more recomputation would only be slower
                index += len(rungs)
                if not fitted or here > previous:
                    break
                previous = here
        return out


_WALK: Walk | None = None  # a worker's walk, set by `_start_worker`


def _start_worker(walk: Walk, parent: int) -> None:
    global _WALK
    _WALK = walk
    start_forked_worker(parent)


def _walk_in_worker(run: list[tuple[int, list[Config]]]) -> list[Priced]:
    assert _WALK is not None
    return _WALK(run)


def walk_all(
    walk: Walk, runs: list[list[tuple[int, list[Config]]]]
) -> list[list[Priced]]:
    """`walk` over every run, in forked worker processes when more than one is wanted (the
    walk's `say` and `skip` need not be picklable: a forked worker inherits them)."""
    n = min(wanted_processes(), len(runs))
    if n < 2 or start_method() != "fork":
        return [walk(run) for run in runs]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(
        n, mp_context=context, initializer=_start_worker, initargs=(walk, os.getpid())
    ) as pool:
        return list(pool.map(_walk_in_worker, runs))
