"""The search over micro-batch sizes behind `planner.api.plan`: each size is traced and searched on
its own (`planner.size_eval.evaluate`), in this process or in worker processes.

Why processes: a size's search is mostly Python holding the GIL (tracing, DTensor's strategies,
prices, building the programs; only HiGHS releases it, `planner.intra.highs.solves_overlap`), and
the sizes are independent. Threads would take turns on one core; processes use them all. On
Linux the workers are forked from this process (`start_method`): they start with its imports,
its caches and the model as the caller gave it, so an `nn.Module` object (a Hugging Face model,
say), which need not be picklable, is searched in workers too. Elsewhere, or where this process
has initialised CUDA (a forked child cannot use it), they are spawned: a spawned worker imports
the planner and rebuilds the model from its name, so only a model given by name or spec is
searched in workers; an `nn.Module` object is then searched in this process. A worker searches
one size at a time and returns that size's best plan, assembled. A process that finds no size
left first searches the sizes beyond the list that the caller guesses it will need
(`SearchAhead`), then helps one still being searched, listed or guessed (`help_sizes`): it
traces that size too and solves meshes from the back of its list, which the size's owner enters
in job order (`planner.inter.mesh_share`). The results are those of the serial search: the
sizes' best plans are compared in the order the serial search visits them (ties go to the
earlier), so the plan does not depend on the process count. The fastest plan of a kept size so
far is shared by the processes: a size whose least possible iteration time exceeds it is traced
but not searched, or given up between two of its meshes when such a plan comes in meanwhile
(`planner.size_eval.evaluate`), since none of its plans could be the fastest, whichever
process finds which first.
`MESHPLAN_PLANNER_PROCESSES` sets the count, this process included (1: everything in this
process); by default one per core this process may use, at most one per size, and none in a
daemonic process (a rank started by `runtime.launch`), which multiprocessing allows no children.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cost_models.errors import MeshplanError
from planner.collector import sparse_collections
from planner.inter.mesh_search import help_search
from planner.inter.mesh_share import PENDING_POLL_S, JobCursor, MeshShare
from planner.orphans import end_with_parent
from planner.plans.assemble import assemble
from planner.size_eval import (
    Progress,
    SizeJob,
    SizeResult,
    evaluate,
    search_args,
)
from planner.tracing.inputs import ModelSource, resolve_model


@dataclass
class SearchAhead:
    """Sizes beyond `evaluate_all`'s list that a process with none of them left searches ahead
    of need (`planner.api.walk_next`: the next size the walk over larger sizes would try on
    the results so far): `pick(done, busy)` names one or None (`done`: the seconds of each size
    finished so far; `busy`: the sizes searched ahead still running), and each one's result
    lands in `found`. The walk uses a result only when it tries that size, so the plan is the
    one found without them; they put an idle core to work (the 1T GPT on 384x8 A100s: seven
    sizes on two processes left one idle for the last size's 20 s, and the walk then tries 64
    rows)."""

    pick: Callable[[dict[int, float], set[int]], int | None]
    found: dict[int, SizeResult] = field(default_factory=dict)


#: The sizes searched ahead (the first ones) whose meshes are shared as the listed sizes' are
#: (`planner.inter.mesh_share`; each needs a queue made before the workers start): the last
#: size the 1T GPT's walk needs on 384x8 A100s, 64 rows, searched ahead, took 15 s from its
#: trace to its plan on one process after every listed size was done, 12.1 s shared
#: (benchmarks/planning_time_log.md, 2026-12-06 16:40-17:30).
AHEAD_SHARED = 4


def processes(job: SizeJob, sizes: int) -> int:
    """Worker processes for `sizes` micro-batch sizes (module docstring)."""
    wanted = wanted_processes()
    if not isinstance(job.model, str) and start_method() != "fork":
        return 1  # a spawned worker could not rebuild the module
    return min(wanted, sizes)


def wanted_processes() -> int:
    """`MESHPLAN_PLANNER_PROCESSES`, else one per core this process may use; 1 in a daemonic
    process (a rank of `runtime.launch`), which may not have children."""
    env = os.environ.get("MESHPLAN_PLANNER_PROCESSES")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise MeshplanError(
                f"MESHPLAN_PLANNER_PROCESSES must be a positive integer, got {env!r}"
            )
        wanted = int(env)
    else:
        wanted = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    return 1 if multiprocessing.current_process().daemon else wanted


def start_method() -> str:
    """How worker processes start (module docstring): "fork" on Linux unless this process has
    initialised CUDA, else "spawn"."""
    if sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def evaluate_all(
    job: SizeJob,
    make: ModelSource,
    sizes: list[int],
    say: Progress,
    kept: Collection[int] | None = None,
    bar: float = np.inf,
    ahead: SearchAhead | None = None,
) -> list[SizeResult]:
    """`evaluate` every size, in worker processes when `processes` says so; results in the
    order of `sizes`.

    With processes, each size's best plan is assembled where it was searched (the traced graph
    does not cross processes), unless it is slower than `bar` (the best time among the caller's
    results so far) or than a size of `kept` already searched (the indices of `sizes` whose
    results the caller keeps; default all): that plan cannot be the caller's best, and is left
    `beaten` (llama3-70b on 8x8 H100s: 0.4 s of CPU a size).

    With n > 1 processes this process is one of them, beside n - 1 workers: each process takes
    the next size nobody has taken when it is free (a feeder thread per worker hands it one
    when it returns one), in `take_order`: from the middle size out when every size is kept,
    else in the list's order (the kept sizes first). No process sits idle waiting for the
    others, and one worker fewer is one fewer to start (a spawned worker first imports the
    planner: seconds of CPU).

    With `ahead`, a process that finds no size of `sizes` left first searches the sizes
    `ahead.pick` names (never kept: each is assembled only when faster than every kept size
    so far; none once every size of `sizes` is done and one named is still running), then
    helps; the first `AHEAD_SHARED` of them are shared as the listed sizes are."""
    workers = processes(job, len(sizes))
    n = len(sizes)
    order = take_order(sizes) if kept is None else list(range(n))
    kept = set(range(n) if kept is None else kept)
    if workers <= 1:
        out: list[SizeResult] = []
        for k, b in enumerate(sizes):
            seen = min([bar] + [r.seconds for i, r in enumerate(out) if i in kept])
            out.append(
                evaluate(job, make, b, _labelled(say, k, n), beat=lambda s=seen: s)
            )
        return out
    method = start_method()
    context = multiprocessing.get_context(method)
    messages = context.Queue()
    best = context.Value("d", bar)  # the fastest plan of a kept size so far
    # a size's meshes shared with processes that have no size left (`planner.inter.mesh_share`)
    slots = n + (AHEAD_SHARED if ahead is not None else 0)
    cursor = JobCursor(context, slots)
    for k, b in enumerate(sizes):
        cursor.assign(k, b)
    inboxes = [context.Queue() for _ in range(slots)]
    # a forked worker inherits `make`; a spawned one rebuilds it from the model's name
    pool = ProcessPoolExecutor(
        workers - 1,
        mp_context=context,
        initializer=_init_worker,
        initargs=(
            messages,
            job,
            make if method == "fork" else None,
            os.getpid(),
            best,
            (n, cursor, inboxes),
        ),
    )
    relay = threading.Thread(target=_relay, args=(messages, say), daemon=True)
    extra: list[int] = []  # the sizes searched ahead, at indices n, n + 1, ...

    def size(k: int) -> int:
        return sizes[k] if k < n else extra[k - n]

    def more(done: dict[int, SizeResult]) -> int | None:
        if ahead is None:
            return None
        finished = {size(k): r.seconds for k, r in done.items()}
        busy = {b for i, b in enumerate(extra) if n + i not in done}
        # every listed size done and one searched ahead still running: a second guess started
        # now has nothing left to overlap but that one, and would only delay the end where the
        # walk stops (the 1T GPT on 384x8 A100s, the listed sizes given up early: 128 rows
        # done before 64, then 256 rows guessed, 21 s after everything else)
        if busy and all(k in done for k in range(n)):
            return None
        b = ahead.pick(finished, busy)
        if b is None:
            return None
        extra.append(b)
        k = n + len(extra) - 1
        if k < slots:  # shared as the listed sizes are
            cursor.assign(k, b)
        return k

    def here(k: int) -> SizeResult:
        # assembled as a worker's are: this process does not keep every size's graph
        def beat() -> float:
            return best.value

        meshes = MeshShare(cursor, k, inboxes[k]) if k < slots else None
        found = evaluate(job, make, size(k), _labelled(say, k, n), meshes, beat)
        return _assembled(found, best, k in kept)

    def there(k: int) -> SizeResult:
        b = size(k)
        return _in_worker(pool, b, _evaluate_in_worker, b, k, n, k in kept)

    try:
        if method == "fork":
            # The pool forks all its workers at the first task: give it one now, before this
            # process starts the relay and the helper threads, so that no thread of ours is
            # forked holding a lock.
            pool.submit(os.getpid).result()
        relay.start()
        out = share(
            n,
            workers - 1,
            order,
            here,
            there,
            lambda: help_sizes(job, make, n, cursor, inboxes, say),
            lambda: _in_worker(pool, None, _help_in_worker),
            more,
        )
        if ahead is not None:
            ahead.found.update(zip(extra, out[n:]))
        return out[:n]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        messages.put(None)
        if relay.is_alive():
            relay.join()


def _in_worker(
    pool: ProcessPoolExecutor, b: int | None, fn: Callable, *args: Any
) -> Any:
    """``fn(*args)`` on `pool` (`_evaluate_in_worker` of micro-batch size `b`, or with `b` None
    `_help_in_worker`); a worker that died (killed, say for memory, or unable to start) is one
    line naming the size and what to do instead of the pool's traceback."""
    try:
        return pool.submit(fn, *args).result()
    except BrokenProcessPool as exc:
        what = "another's micro-batch size" if b is None else f"micro-batch size {b}"
        raise MeshplanError(
            f"a planner worker process died while searching {what} (killed, "
            "perhaps for memory, or unable to start: a script read from standard input cannot "
            "start one); plan in this process alone with MESHPLAN_PLANNER_PROCESSES=1"
        ) from exc


def take_order(sizes: list[int]) -> list[int]:
    """The positions of `sizes` in the order processes take them (`evaluate_all`): the middle
    size first, then outwards, the larger of two alike first.

    Why: a size's search ends with its longest mesh job (one branch-and-bound of a memory rung
    can take most of it), which no helper can split, so a costly size taken last ends the
    search late. The middle sizes were the costliest: CPU seconds per micro-batch size of 1, 2,
    ..., 64 rows, planning mixtral-8x7b on 8x8 H100s 34, 20, 25, 43, 21, 21, 22 (8 rows: a
    19 s branch-and-bound), moe-70b on 8x8 A100s 25, 24, 18, 26, 39, 20, 24 (two processes),
    llama3-70b on 8x8 H100s 15, 13, 14, 14, 13, 11, 12 (one). Taken from both ends of the list
    (the earlier order), mixtral's 8 rows came last, started at 71 s: 97.8 s of planning in one
    run, 89.8 s from the middle out (benchmarks/planning_time_log.md, 2026-12-05)."""
    rank = sorted(range(len(sizes)), key=lambda k: sizes[k])
    mid = len(sizes) - 1
    by_distance = sorted(range(len(sizes)), key=lambda r: (abs(2 * r - mid), -r))
    return [rank[r] for r in by_distance]


#: Seconds between a free thread's tries to help while indices run (`share`).
HELP_AGAIN_S = 0.5


def share(
    n: int,
    helpers: int,
    order: list[int],
    here: Callable[[int], Any],
    there: Callable[[int], Any],
    help_here: Callable[[], Any] | None = None,
    help_there: Callable[[], Any] | None = None,
    more: Callable[[dict[int, Any]], int | None] | None = None,
) -> list[Any]:
    """[f(0), ..., f(n - 1)] where each k is run once, by `here(k)` in the calling thread or
    `there(k)` on one of `helpers` threads (each waiting on a worker process): each thread
    takes the next index of `order` (a permutation of range(n)) nobody has taken when it is
    free. A thread that finds none left asks `more` (given the results so far, by index) for
    another index, n, n + 1, ... in turn, run the same way and its result appended to the
    list. When `more` says None it runs `help_here` (the calling thread) or `help_there` (the
    others), if given: help with the indices still running; then it waits for one of those to
    end, or `HELP_AGAIN_S`, and asks again (a result may change the answer) and helps again (a
    size taken just before may not have listed its jobs, nor even begun: the 1T GPT's 64 rows,
    searched ahead, went unhelped so), and ends once none is running. The
    first exception (either side) is raised once every thread is done with the index it has;
    no index is taken after it."""
    left = list(order)  # indices nobody has taken
    lock = threading.Condition()
    results: dict[int, Any] = {}
    running: set[int] = set()
    failed: list[BaseException] = []

    def take() -> int | None:  # with the lock held
        if failed:
            return None
        if left:
            k = left.pop(0)
        else:
            k = None if more is None else more(dict(results))
        if k is not None:
            running.add(k)
        return k

    def run(f: Callable[[int], Any], then: Callable | None) -> None:
        try:
            while True:
                with lock:
                    k = take()
                while k is None:
                    if then is not None and not failed:
                        then()
                    with lock:
                        if (k := take()) is None and running and not failed:
                            lock.wait(HELP_AGAIN_S)
                            k = take()
                        if k is None and (not running or failed):
                            break
                if k is None:
                    return
                r = f(k)
                with lock:
                    results[k] = r
                    running.discard(k)
                    lock.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised by the calling thread
            with lock:
                failed.append(exc)
                lock.notify_all()

    threads = [
        threading.Thread(target=run, args=(there, help_there), daemon=True)
        for _ in range(helpers)
    ]
    for t in threads:
        t.start()
    try:
        run(here, help_here)
    finally:
        for t in threads:
            t.join()
    if failed:
        raise failed[0]
    return [results[k] for k in range(len(results))]


def _labelled(say: Progress, k: int, n: int) -> Progress:
    """`say` with each message of the k-th of n listed sizes prefixed by its number, of a size
    searched ahead (k >= n, `SearchAhead`) prefixed so."""
    if k >= n:
        return lambda msg: say(f"[searched ahead] {msg}")
    return lambda msg: say(f"[size {k + 1} of {n}] {msg}")


def _relay(messages: Any, say: Progress) -> None:
    """Pass the workers' progress messages on until None arrives."""
    while (msg := messages.get()) is not None:
        say(msg)


#: A worker's state (`_init_worker`): its queue of progress messages, the job, the model's maker,
#: the fastest plan of a kept size so far (`evaluate_all`).
_worker: dict[str, Any] = {}


def _init_worker(
    messages: Any,
    job: SizeJob,
    make: ModelSource | None,
    parent: int,
    best: Any,
    shared: tuple,
) -> None:
    _worker.update(messages=messages, job=job, make=make, best=best, shared=shared)
    if make is not None:
        start_forked_worker(parent)


def start_forked_worker(parent: int) -> None:
    """What a forked worker process (of a pool whose tasks trace models) does first:
    * end with its parent (`end_with_parent`): it holds the pool's queues itself, so it would
      never see them close and would wait on them for ever after a planning process killed
      with SIGKILL;
    * run ops on one intra-op thread, so that none enters an OpenMP parallel region: GNU
      OpenMP's threads do not survive a fork, and a child that enters a region after its parent
      ran one waits on them for ever (a model whose forward computes on real tensors, a causal
      mask from ``torch.ones(...).triu()``, traced by a process that had traced it before).
      A worker is one of a process per core; it would not use more threads anyway;
    * never collect what it inherited (`gc.freeze`): a worker forked from a test process that
      had planned before aborted while garbage-collecting ("terminate called after throwing
      an instance of 'std::system_error'"), most likely a C++ object of the parent's solves
      (HiGHS's, whose threads the child does not have) destroyed in the child."""
    end_with_parent(parent)
    torch.set_num_threads(1)
    gc.freeze()


def _worker_make() -> ModelSource:
    """The worker's model maker (rebuilt from the model's name once per spawned worker)."""
    job = _worker["job"]
    if _worker["make"] is None:
        _worker["make"] = resolve_model(
            job.model, job.example_batch, job.dtype, job.model_name
        )[1]
    return _worker["make"]


def _evaluate_in_worker(b: int, k: int, n: int, kept: bool) -> SizeResult:
    """`evaluate` of the k-th size (of n listed; beyond them one searched ahead,
    `SearchAhead`) in a worker, its meshes shared when it has a slot in the cursor, the best
    plan assembled (a `PlanSpec` holds the traced graph, which does not cross processes)."""
    _, cursor, inboxes = _worker["shared"]
    share = MeshShare(cursor, k, inboxes[k]) if k < len(inboxes) else None
    best = _worker["best"]
    say = _labelled(_worker["messages"].put, k, n)
    out = evaluate(_worker["job"], _worker_make(), b, say, share, lambda: best.value)
    return _assembled(out, best, kept)


def _help_in_worker() -> None:
    """`help_sizes` in a worker."""
    n, cursor, inboxes = _worker["shared"]
    say = _worker["messages"].put
    help_sizes(_worker["job"], _worker_make(), n, cursor, inboxes, say)


def help_sizes(
    job: SizeJob,
    make: ModelSource,
    n: int,
    cursor: JobCursor,
    inboxes: list,
    say: Progress,
) -> None:
    """Help the sizes other processes are searching (the n listed ones and those searched
    ahead with a slot in `cursor`) while one has meshes left to solve
    (`planner.inter.mesh_share`): trace it here and solve meshes from the back of its list.
    While a size's owner is still tracing it, wait for its list (gpt-39b on 8x8 V100s: a
    process that found none, 0.05 s before the last size listed its jobs, left that size's
    last 5 s to one core)."""
    while True:
        k = cursor.claim()
        if k is None:
            if not cursor.pending():
                return
            time.sleep(PENDING_POLL_S)
            continue
        b, labelled = cursor.size(k), _labelled(say, k, n)
        labelled(f"helping with micro-batch {b}")
        with sparse_collections():
            args, kw = search_args(job, make.trace(b), b, labelled)
            help_search(*args, **kw, cursor=cursor, k=k, outbox=inboxes[k])


def _assembled(out: SizeResult, best: Any, kept: bool) -> SizeResult:
    """`out` with its best plan assembled, or `beaten` when slower than `best` (a shared
    value: the fastest plan of a kept size so far, which a `kept` size lowers); the traced graph
    let go."""
    if out.best is None:
        return out
    with best.get_lock():
        beaten = out.seconds > best.value
        if kept and not beaten:
            best.value = out.seconds
    if beaten:
        out.best, out.beaten = None, True
    else:
        out.plan, out.best = assemble(out.best.spec), None
    return out
