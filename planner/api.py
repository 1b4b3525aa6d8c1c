"""`plan(model, cluster)`: the planner's front door.

1. Trace the model on fake tensors for each candidate micro-batch size (each size searched on its
   own, in worker processes: `planner.size_search`).
2. Cluster its ops into layers (`planner.inter.layers`): the automatic count L, and also p layers for
   every divisor p < L of the device count (a p-stage manual pipeline's balanced split).
3. For every submesh shape (1,1), (1,2), ..., (1,M), (2,M), ..., (N,M) and its logical meshes, solve
   the intra-op program (time-optimal, a memory ladder, Megatron's placements as seeds) and
   attribute time and memory to the layers of each clustering (`planner.inter.mesh_search`,
   `planner.inter.stage_table`).
4. Run the stage DP (`planner.inter.stage_dp`) for each micro-batch count and clustering, with the
   memory of the micro-batches the schedule keeps in flight, and (schedule "auto", the default,
   or "interleaved") cut the layers into p * v chunks on p equal device groups for interleaved
   1F1B (`planner.inter.interleave`); keep the plan whose predicted
   iteration time (`planner.plans.assemble.predicted_iteration_time`: `cost_models.pipeline.
   iteration_time`, activations sent between stages included) is least.
5. Return its `ParallelPlan` (`planner.plans.assemble`) with the stages, shardings, schedule and
   predicted time and memory.

Modes (Alpa's ablations): "auto"; "intra-only" (one stage on the whole cluster); "inter-only"
(stages with pure data parallelism inside).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from cost_models.cluster import Cluster
from cost_models.errors import DoesNotFitError, MeshplanError, gib
from cost_models.memory import canonical_schedule, param_state_bytes
from planner.collector import frozen_heap
from planner.commands.fmt import param_count
from planner.inter.mesh_search import solver_threads
from planner.inter.mesh_shapes import submesh_shapes
from planner.inter.stage_solves import solve_time_limit
from planner.plans.assemble import assemble
from planner.size_eval import SizeJob, SizeResult
from planner.size_search import (
    SearchAhead,
    evaluate_all,
    processes,
    wanted_processes,
)
from planner.tracing.inputs import resolve_model, training_dtype
from planner.vocab.plan_file import ParallelPlan

MODES = ("auto", "intra-only", "inter-only")
Progress = Callable[[str], None]


def microbatch_sizes(global_batch: int, cluster: Cluster | None = None) -> list[int]:
    """Candidate micro-batch sizes (rows of the global batch per micro-batch), powers of two that
    divide the global batch: 1 to 32, and on a cluster of one host up to 16 per device.

    Each costs one trace and one intra-op pass per mesh; all are evaluated, because the latency
    is not unimodal in the micro-batch size (memory decides when recomputation is needed; an MoE
    layer's dispatch grows faster than linearly in its tokens): gpt-39b on 64 V100s is fastest at
    micro-batch size 1 (tp4 x pp16), gpt-1.3b on 4 A100s at 64 (dp4, 16 rows each), and llama3-70b
    on 64 H100s (global batch 128) at 1 after 16, 8 and 4 rows lost to 32 (every suite case's sizes:
    `benchmarks.size_landscape`; a walk down that stops early misses such a plan). The sizes of
    the manual grid (`benchmarks.manual_grid`: 1 to 16 rows per data-parallel replica, so up to
    16 per device) beyond these are `larger_microbatch_sizes`, tried only while they pay off."""
    top = 32
    if cluster is not None and cluster.hosts == 1:
        top = max(top, 16 * cluster.num_devices)
    return _pow2_divisors(global_batch, 1, top)


def larger_microbatch_sizes(global_batch: int, cluster: Cluster) -> list[int]:
    """Sizes above `microbatch_sizes`' up to 16 rows per device, in increasing order. `plan` tries
    them in order (`_walk_larger`, which searches the next ones ahead on idle processes) only
    while the best plan so far uses the largest size tried, and in any case
    the first of at least one row per device (that one is searched beside `microbatch_sizes`'
    sizes, in the worker processes, since no result changes whether it is): evaluating all of
    them would add passes to the largest searches that cannot win (gpt-39b on 64 V100s does not
    fit at 64 rows and is fastest at 1; one more size costs about 13 s of its planning,
    `benchmarks/bench_planner.py`), while a data-parallel MoE on 16 H100s gains from 32 rows to
    64 and 128 (the manual grid's dp8 x pp2 runs 64), and data parallelism or FSDP over every
    device needs a row per device: llama3-405b on 512 H100s (global batch 256) plans 22.02 s
    per iteration at 256 rows, where the best of 1 to 32 rows (16) plans 25.88 s
    (`benchmarks.size_landscape`, 2026-12-06)."""
    return _pow2_divisors(
        global_batch,
        max(microbatch_sizes(global_batch, cluster), default=0) + 1,
        16 * cluster.num_devices,
    )


def rows_to_reach(larger: list[int], devices: int) -> int:
    """The size of which `plan` evaluates the first at least as large (`next_size_step`): a
    row per device, or the largest of `larger` (the whole batch) where the global batch has
    fewer rows than the cluster has devices."""
    return min(devices, max(larger, default=0))


def next_size_step(
    size: int, tried: int, best: int, rows: int, before: int | None = None
) -> str:
    """What `plan` does with `size`, the next of `larger_microbatch_sizes`, when `tried` is the
    largest size evaluated so far and `best` the size of the fastest plan: "try" it while the
    best plan uses the largest size tried, or the one before it (`before`, a size of
    `larger_microbatch_sizes` evaluated before `tried`: one larger size may lose on the way to a
    faster one; moe-10b on 16 A100s plans 2.886 s per iteration at 256 rows, 2.929 s at 64 and
    2.966 s at 128, `benchmarks.size_landscape`), and in any case when it is the first of at
    least `rows` (one row per device, or the largest size where the global batch has fewer rows
    than the cluster devices:
    llama3-405b on 512 H100s at global batch 256 is fastest at 256 rows, FSDP over dp256 x tp2,
    where the best of 1 to 32 rows is 16); "skip" it on the way to that one; else "stop"."""
    if best in (tried, before) or tried < rows <= size:
        return "try"
    return "skip" if size < rows else "stop"


def walk_next(
    larger: list[int],
    tried: int,
    rows: int,
    base: list[int],
    listed: set[int],
    done: dict[int, float],
    busy: set[int],
) -> int | None:
    """The first size of `larger` that `plan`'s walk (`_walk_larger`) would search were the
    sizes of `base` (its first results, in their order; `tried` the largest) to end as `done`
    has them so far (seconds per size, also of sizes of `larger` searched), those missing
    changing nothing. A size of `larger` searched ahead and still running (`busy`) is taken to
    win, as the walk's own batches of sizes assume. None when the walk would stop before a
    size neither done nor busy, when it would reach one of the sizes searched with `base`
    (`listed`) that is still running (its result decides), or when no size of `base` is done.
    The guess by which a planner process with nothing left searches ahead
    (`planner.size_search.SearchAhead`)."""
    known = [(done[b], i, b) for i, b in enumerate(base) if b in done]
    if not known:
        return None
    seconds, _, best = min(known)  # ties go to the earlier, as in `_best`
    before = None
    for b in larger:
        step = next_size_step(b, tried, best, rows, before)
        if step == "stop":
            return None
        if step == "skip":
            continue
        if b not in done:
            if b in listed:
                return None
            if b not in busy:
                return b
            seconds, best = -np.inf, b
        elif done[b] < seconds:
            seconds, best = done[b], b
        before, tried = (tried if tried in larger else None), b
    return None


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
    dtype: torch.dtype | str | None = None,
    memory_budget: float | None = None,
    schedule: str = "auto",
    microbatch_size: int | list[int] | None = None,
    num_layers: int | None = None,
    optimizer: str = "adam_mixed",
    mode: str = "auto",
    progress: Progress | None = None,
    model_name: str | None = None,
    context_parallel: bool = True,
) -> ParallelPlan:
    """Plan data, tensor and pipeline parallel training of `model` on `cluster`.

    `model` is an nn.Module (with `example_batch`; it may live on the meta device) or a built-in
    model name or spec. `dtype` (a torch dtype or its name) is the training dtype of a model
    given by name or spec (default float16); an nn.Module is planned in its parameters' dtype,
    and another `dtype` is an error (`planner.tracing.inputs.training_dtype`). `memory_budget`
    is bytes per device (default: the device's memory).
    `context_parallel=False` searches without context parallelism: no attention is split along
    the sequence, neither in the intra-op programs nor as seeds (`planner.intra.context.
    without_context`); the long-context benchmark compares the plans with and without it.
    `schedule`: "auto" (default) searches 1F1B and interleaved 1F1B with 2 to 8 chunks per
    device group (`planner.inter.interleave.VIRTUAL_STAGES`) and returns the faster; "1f1b",
    "interleaved", "gpipe" or "zero_bubble" (or an alias, `cost_models.memory.canonical_schedule`)
    pins one.
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
    schedule = _schedule(schedule, mode)
    # the environment's settings, read where the search uses them, checked before any work
    wanted_processes()
    solver_threads()
    solve_time_limit()
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    dtype = training_dtype(model, dtype)
    name, make, default_batch = resolve_model(model, example_batch, dtype, model_name)
    G = default_batch if global_batch is None else global_batch
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
    _check_state_fits(make(min(sizes_b))[0], name, cluster, optimizer, budget)
    job = SizeJob(
        model,
        example_batch,
        dtype,
        name,
        cluster,
        G,
        budget,
        optimizer,
        mode,
        schedule,
        num_layers,
        subs,
        context_parallel,
    )
    larger = [] if microbatch_size else larger_microbatch_sizes(G, cluster)
    tried = max(sizes_b)
    rows = rows_to_reach(larger, cluster.num_devices)
    # The first larger size of at least `rows` is tried whatever the others find
    # (`next_size_step`): it is searched beside them, not after them on one core.
    certain = next((b for b in larger if b >= rows), None) if tried < rows else None
    base = sorted(sizes_b, reverse=True)
    first = ([certain] if certain else []) + base
    # a process with none of these left searches ahead the size the walk would try next
    ahead = SearchAhead(
        functools.partial(walk_next, larger, tried, rows, base, set(first))
    )
    # the search's collections leave out what it begins with (`planner.collector.frozen_heap`)
    with frozen_heap():
        # every result is kept: the walk never stops before `certain` (`next_size_step`)
        results = evaluate_all(job, make, first, say, ahead=ahead if larger else None)
        if certain:
            ahead.found[certain] = results.pop(0)
        _walk_larger(job, make, results, larger, tried, rows, ahead.found, say)
        best = _best(results)
        if not best.found:
            untraceable = [r.untraceable for r in results if r.untraceable is not None]
            if len(untraceable) == len(results):
                raise untraceable[0]
            needs, available = gib(min(r.least for r in results), budget)
            raise DoesNotFitError(
                f"{name} does not fit on {cluster.spec}: even as one stage on all "
                f"{cluster.num_devices} devices it needs {needs} per device, {available} available "
                "(use more devices, a larger memory budget or a smaller batch)"
            )
        if best.best is not None:
            best.best.spec.planner_time_s = time.perf_counter() - t0
            result = assemble(best.best.spec)
        else:  # assembled by a worker process
            result = best.plan
            result.planner_time_s = time.perf_counter() - t0
    if result.fallback_ops:
        warnings.warn(
            f"{len(result.fallback_ops)} ops of {name} have no DTensor sharding rule and are "
            f"planned replicated (e.g. {result.fallback_ops[0]}); the plan runs, but these ops "
            "gain nothing from the devices they share",
            stacklevel=2,
        )
    return result


def _walk_larger(
    job: SizeJob,
    make: Any,
    results: list[SizeResult],
    larger: list[int],
    tried: int,
    rows: int,
    held: dict[int, SizeResult],
    say: Progress,
) -> None:
    """Append to `results` the sizes of `larger` that `next_size_step` tries, walking them in
    increasing order after the largest size tried so far (`tried`; `held`: sizes already
    searched, the first of at least `rows` and those searched ahead with the first sizes,
    `walk_next`). Each size the walk needs not held is searched together with the
    next sizes it may try after it, one per planner process (`planner.size_search.processes`),
    so that no core idles while one size runs alone: gpt-15b on 4x8 A100s walks 64, 128, 256
    and 512 rows, each winning, about 12 s each on this machine's 2 cores. A size searched
    ahead is used only when the walk reaches it and tries it, so the sizes compared, and the
    plan, are the serial walk's; one the walk stops before costs CPU, not wall time."""
    width = processes(job, len(larger))
    ahead = dict(held)
    before = None
    for k, b in enumerate(larger):
        step = next_size_step(b, tried, _best(results).size, rows, before)
        if step == "stop":
            break
        if step == "skip":
            continue
        if b not in ahead:
            batch = [b] + [c for c in larger[k + 1 :] if c not in ahead][: width - 1]
            # the walk keeps b; the sizes searched ahead only if it reaches them
            found = evaluate_all(
                job,
                make,
                batch,
                lambda m: say(f"larger sizes {m}"),
                kept=[0],
                bar=_best(results).seconds,
            )
            ahead.update(zip(batch, found))
        results.append(ahead.pop(b))
        before, tried = (tried if tried in larger else None), b


def _schedule(schedule: str, mode: str) -> str:
    """The schedule the search runs: "auto", or a pinned one's canonical name."""
    if schedule == "auto":
        return "1f1b" if mode == "intra-only" else schedule
    key = canonical_schedule(schedule)
    if key == "interleaved" and mode == "intra-only":
        raise MeshplanError(
            "the interleaved schedule needs pipeline stages; mode intra-only plans one stage "
            "(use schedule 'auto' or '1f1b')"
        )
    return key


def _best(results: list[SizeResult]) -> SizeResult:
    """The size whose best plan is fastest; the earliest of equals (the serial search's order)."""
    return min(results, key=lambda r: r.seconds)


def _check_state_fits(
    module: nn.Module, name: str, cluster: Cluster, optimizer: str, budget: float
) -> None:
    """Raise DoesNotFitError before any tracing when the model's weights, gradients and optimizer
    state alone exceed `budget` even spread evenly over every device: each parameter costs
    `cost_models.memory.param_state_bytes` somewhere, and the fullest device holds at least the
    average: all of them sharded over every device."""
    params = sum(p.numel() for p in module.parameters())
    D = cluster.num_devices
    need = param_state_bytes(params, optimizer, shards=D)
    if need > budget:
        needs, available = gib(need, budget)
        raise DoesNotFitError(
            f"{name} does not fit on {cluster.spec}: its {param_count(params)} parameters' "
            f"weights, gradients and {optimizer} state alone need {needs} per "
            f"device even sharded over all {D} devices, {available} available "
            "(use more devices, a larger memory budget or an optimizer with less state)"
        )
