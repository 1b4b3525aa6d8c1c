"""Start N local worker processes in one process group, run a function on each, and collect results.

    results = launch(fn, world_size=4, args=(x,))   # fn(*args) runs on every rank, list of returns

Each rank is forked from multiprocessing's fork server, a process started once (at the first
launch) that has imported torch, its distributed packages and this runtime but runs nothing
(`PRELOAD`). Forking the caller, which may already run torch thread pools, is unsafe; a fresh
interpreter per rank ("spawn") imports torch every time (on a 2-core machine a 4-rank launch took
4-6 s and 8.5 s of CPU that way; from the fork server 0.1-0.4 s, after its start of about 6 s at
the first launch). A rank then sets up as a spawned one would: the caller's working directory,
`sys.path`, main module and environment (passed with the job: the server keeps the environment of
its own start). Its `torch.distributed` default group is initialised over localhost, through a
store the launching process serves (`_serve_store`), with gloo on CPU or NCCL when there is one GPU
per rank, before `fn` is called; `fn` reads its rank with
`torch.distributed.get_rank()`. `fn` and its arguments must be picklable (a module-level
function), and a script that calls `launch` needs the usual `if __name__ == "__main__":` guard
(each rank re-imports it). A module the server preloaded stays the version of the server's start:
a process that edits this runtime's code between launches (an autoreloading notebook) sees the
change in its ranks only once restarted.
With gloo each rank is bound to its own cores and uses that many torch threads (`rank_cpu_sets`), so
that measured profiles and training runs see the same per-rank compute.

Fail fast: the parent watches every rank's process and result pipe. As soon as a rank raises or dies
(os._exit, a signal, the OOM killer), every other rank is terminated (SIGTERM, then SIGKILL after a
short grace) and `launch` raises a one-line MeshplanError naming the rank and its error; the full
traceback is kept on the exception (`LaunchError.tracebacks`). A launch that outlives `timeout_s`
(for example a collective that deadlocks) is terminated the same way, after each rank still running
has written the Python stack of every thread (`faulthandler`, on SIGUSR1) into
`LaunchError.tracebacks`: where a hang sits, without a debugger. So is a rank that dies while
starting: each rank reads its job (`fn` and its arguments, pickled once) from a pipe once it runs,
so nothing waits on a rank that never will. That pipe stays open until the launch ends: a rank
whose launching process is killed sees it close and exits (`runtime.rank`). A rank that
raises while joining the process group, before `fn`, is the one failure after which the ranks
start again, once (`JOIN_RESTARTS`), saying so on stderr.

Why not torchrun? Its programmatic form, `torch.distributed.launcher.api.elastic_launch` (checked on
torch 2.13), does return every rank's value and does fail fast: a rank raising ValueError ended the
launch in ~3 s with a ChildFailedError naming rank 1 and its traceback. What it lacks for us: no
deadline for a run that hangs (LaunchConfig has only rendezvous and shutdown timeouts), restarts
the whole group by default (max_restarts=3), a c10d rendezvous and agent per launch, logs every
failure through its own loggers onto stderr (dozens of lines), multi-line errors rather than one
line for the CLI, and no core binding for CPU ranks. `torch.multiprocessing.start_processes` kills
the other ranks on a failure but collects no return values, reports whichever failed rank it
happens to see first (often a rank that only saw its peer's connection drop), and waits 30 s before
SIGKILL. This module is the thin piece between them: results, a root-cause rank, a deadline, one
line, core binding.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cost_models.errors import MeshplanError
from runtime.rank import run_rank

MAX_LOCAL_RANKS_CPU = 8  # gloo on one of the development machines; see DESIGN.md

#: What the fork server imports once for every rank (module docstring): torch, the distributed
#: pieces a rank runs, and the runtime that runs plans (which imports the planner's plan files).
#: A program whose ranks import more names those modules in ``MESHPLAN_PRELOAD`` (comma
#: separated; read when the server starts): each rank then finds them imported.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "runtime.executor",
    "runtime.train",
)
PRELOAD_ENV = "MESHPLAN_PRELOAD"


#: How many times a launch whose blamed rank raised while joining the process group starts its
#: ranks again (no rank has run `fn` then). Under `pytest -n 2` on a 2-core machine, gloo's
#: connectFullMesh failed in CI (2026-12-01, 2026-12-04, 2026-12-06) in one rank of 2 alone
#: ("Connection closed by peer" from a peer that did not fail), the second and third time with a
#: store of the launch's own (`_serve_store`); never twice in one launch. torchrun's agent restarts
#: its whole group after any failure instead.
JOIN_RESTARTS = 1


class LaunchError(MeshplanError):
    """A launch failed: `rank` is the rank blamed (None on a timeout), `tracebacks` maps rank -> text;
    `stacks` lists the ranks whose text is a stack dump the one-line message cannot carry (each
    hung rank on a timeout, the blamed rank when it crashed), which `meshplan run` prints;
    `joining` says the blamed rank raised while joining the process group, before `fn`."""

    def __init__(
        self,
        message: str,
        rank: int | None,
        tracebacks: dict[int, str],
        stacks: Sequence[int] = (),
        joining: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks
        self.stacks = list(stacks)
        self.joining = joining


def free_port() -> int:
    """A TCP port on localhost that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_store(world_size: int, timeout_s: float) -> Any:
    """The launch's rendezvous store, served by the launching process on a port the OS picks as
    it binds. Rank 0 used to serve it on a port `free_port` had found free a moment before: under
    parallel test runs another launch could take that port first (the likely cause of a CI
    failure in which rank 1 of 2 alone failed with "Gloo connectFullMesh failed ... Connection
    closed by peer")."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
    )


def default_backend(world_size: int) -> str:
    """ "nccl" when CUDA has at least `world_size` devices, otherwise "gloo"."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _available_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cpu_sets(world_size: int) -> list[list[int]]:
    """The cores each local rank is bound to: disjoint equal blocks of the cores this process may
    use when there are at least as many cores as ranks, else one core each, round-robin."""
    cpus = _available_cpus()
    if len(cpus) >= world_size:
        per = len(cpus) // world_size
        return [cpus[r * per : (r + 1) * per] for r in range(world_size)]
    return [[cpus[r % len(cpus)]] for r in range(world_size)]


def _stop(procs: Sequence[Any], grace_s: float) -> None:
    """SIGTERM every live process, then SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = None,
    pin_cpus: bool | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = 2.0,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` new local ranks; return every rank's return value.

    backend: "gloo" or "nccl"; None picks by device availability (`default_backend`).
    timeout_s: deadline for the whole launch (start-up included) and the process-group timeout.
    threads_per_rank: torch intra-op threads in each rank; None shares the CPU cores evenly.
    pin_cpus: bind each rank to its own cores (`cpu_sets`); None means yes with gloo (on a 2-core
        machine this makes 4-rank gloo collectives ~1.5x faster and steadier), no with NCCL.
    env: extra environment variables for the workers.
    Raises LaunchError (a MeshplanError) naming the failing rank, or the timeout.
    """
    if world_size < 1:
        raise MeshplanError(f"world size must be at least 1, got {world_size}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise MeshplanError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    cpu_sets: list[list[int] | None] = [None] * world_size
    if pin_cpus if pin_cpus is not None else backend == "gloo":
        cpu_sets = list(rank_cpu_sets(world_size))
    if threads_per_rank is None and backend == "gloo":
        threads_per_rank = max(1, len(_available_cpus()) // world_size)
    ctx = mp.get_context("forkserver")
    # read when the server starts, at the first launch
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    ctx.set_forkserver_preload([*PRELOAD, *extra])
    # Plain pickle, by value: multiprocessing's ForkingPickler shares a tensor's storage through
    # a file descriptor that only one process can take, and every rank unpickles this payload.
    payload = pickle.dumps(
        (fn, tuple(args), dict(kwargs or {})), pickle.HIGHEST_PROTOCOL
    )
    deadline = time.monotonic() + timeout_s
    restarts = 0
    while True:
        try:
            return _launch_once(
                ctx,
                payload,
                world_size,
                backend,
                threads_per_rank,
                cpu_sets,
                dict(os.environ) | dict(env or {}),
                timeout_s,
                deadline,
                grace_s,
            )
        except LaunchError as exc:
            if not exc.joining or restarts == JOIN_RESTARTS:
                raise
            restarts += 1
            print(
                f"meshplan: starting the {world_size} ranks again (restart {restarts} of "
                f"{JOIN_RESTARTS}): while joining the process group, {exc}",
                file=sys.stderr,
                flush=True,
            )


def _launch_once(
    ctx: Any,
    payload: bytes,
    world_size: int,
    backend: str,
    threads_per_rank: int | None,
    cpu_sets: Sequence[list[int] | None],
    env: dict[str, str],
    timeout_s: float,
    deadline: float,
    grace_s: float,
) -> list[Any]:
    """One start of the ranks (`launch`), which must all end before `deadline`."""
    store = _serve_store(world_size, timeout_s)
    port = store.port
    # ranks remove their own files when the launch ends (`runtime.rank`)
    stack_dir = tempfile.TemporaryDirectory(
        prefix="meshplan-stacks-", ignore_cleanup_errors=True
    )
    stack_files = [
        os.path.join(stack_dir.name, f"rank{r}.txt") for r in range(world_size)
    ]
    procs: list[Any] = []
    conns: dict[Any, int] = {}
    # the job pipes' sending ends, open until the launch ends (`runtime.rank`)
    jobs: list[mpc.Connection] = []
    # The job goes through a pipe once the rank runs, not with the process's arguments:
    # multiprocessing writes those before it closes its copy of the child's end, so a rank that
    # dies while starting (a script read from standard input cannot be re-imported) left a
    # parent writing a large job (a plan) blocked for ever, past any deadline.
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        job_recv, job_send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=run_rank,
            args=(
                rank,
                world_size,
                port,
                backend,
                threads_per_rank,
                cpu_sets[rank],
                env,
                timeout_s,
                stack_files[rank],
                job_recv,
                send,
            ),
            name=f"meshplan-rank{rank}",
            daemon=True,
        )
        p.start()
        send.close()
        job_recv.close()
        procs.append(p)
        conns[recv] = rank
        jobs.append(job_send)
        # a thread per rank: the deadline below holds while a rank is slow to read its job
        threading.Thread(
            target=_send_job, args=(job_send, payload), daemon=True
        ).start()

    results: dict[int, Any] = {}
    # rank -> (time, one line, traceback, raised while joining the group) of an exception
    errors: dict[int, tuple[float, str, str, bool]] = {}
    # rank -> (time, exit code) of a rank that exited without a report
    deaths: dict[int, tuple[float, int]] = {}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}

    def take(conn: Any) -> None:
        """Read one rank's report (or its EOF) from its pipe."""
        rank = conns.pop(conn)
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # exited without a report; its sentinel tells how
            return
        if msg[0] == "ok":
            results[rank] = msg[2]
        else:
            errors[rank] = (msg[2], msg[3], msg[4], msg[5])

    def reap(ready: list[Any]) -> None:
        """Take the reports among `ready`, then note the ranks among it that exited."""
        for obj in ready:
            if obj in conns:
                take(obj)
        for obj in ready:
            if obj not in sentinels:
                continue
            rank = sentinels.pop(obj)
            procs[rank].join()
            for c in [c for c, r in conns.items() if r == rank and c.poll()]:
                take(c)  # a report that arrived with the exit
            if rank not in results and rank not in errors:
                code = procs[rank].exitcode
                deaths[rank] = (time.time(), code if code is not None else -1)

    try:
        while len(results) < world_size and not errors and not deaths:
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r in range(world_size) if r not in results]
                raise LaunchError(
                    f"launch of {world_size} ranks timed out after {timeout_s:g} s; "
                    f"ranks still running: {running} (each one's Python stack: "
                    "LaunchError.tracebacks; `meshplan run` prints them)",
                    None,
                    _stacks(procs, running, stack_files),
                    running,
                )
            reap(mpc.wait(list(conns) + list(sentinels), timeout=min(left, 1.0)))
        if errors or deaths:
            # Let near-simultaneous reports and exits arrive so the root cause can be chosen
            # (a rank that exits makes its peers' collectives fail: its death may come second),
            # then stop all.
            time.sleep(0.1)
            reap(mpc.wait(list(conns) + list(sentinels), timeout=0))
            raise _failure(world_size, errors, deaths, stack_files)
    finally:
        _stop(procs, grace_s)
        for c in [*conns, *jobs]:
            c.close()
        stack_dir.cleanup()
        del store  # its only reference: the server closes now, even if an error keeps this frame
    return [results[r] for r in range(world_size)]


def _stacks(
    procs: Sequence[Any],
    ranks: Sequence[int],
    files: Sequence[str],
    wait_s: float = 2.0,
) -> dict[int, str]:
    """Every thread's Python stack of each rank in `ranks` (SIGUSR1 -> faulthandler, see
    `runtime.rank`); a rank that wrote nothing within `wait_s` (not yet past its start, or stuck
    outside Python's reach) gets a line saying so."""
    for r in ranks:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.2)
    deadline = time.monotonic() + wait_s
    out: dict[int, str] = {}
    for r in ranks:
        text = _read(files[r])
        while not text and time.monotonic() < deadline:
            time.sleep(0.1)
            text = _read(files[r])
        if text:  # the dump may still be under way
            time.sleep(0.2)
            text = _read(files[r])
        out[r] = text or f"rank {r} wrote no stack within {wait_s:g} s"
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _send_job(conn: mpc.Connection, payload: bytes) -> None:
    """Hand a rank its pickled job; a rank that died first is reported by its exit code. The
    pipe stays open: it is the rank's lifeline (`runtime.rank`)."""
    with contextlib.suppress(OSError):
        conn.send_bytes(payload)


def _failure(
    world_size: int,
    errors: dict[int, tuple[float, str, str, bool]],
    deaths: dict[int, tuple[float, int]],
    stack_files: Sequence[str],
) -> LaunchError:
    """Blame one rank: a rank that died without reporting (os._exit, a signal) is never a mere
    victim of a peer's failure, so it comes first; otherwise the earliest reported exception.
    A rank killed by a crash signal has its Python stacks at the crash (faulthandler, see
    `runtime.rank`) as its traceback."""
    tracebacks = {r: e[2] for r, e in errors.items()}
    shown: list[int] = []
    for r, (_, code) in deaths.items():
        if code < 0 and (text := _read(stack_files[r])):
            tracebacks[r] = text
    if deaths:
        rank = min(deaths, key=lambda r: deaths[r][0])
        code = deaths[rank][1]
        if code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        elif code == 0:
            how = "exited (code 0) without returning a result"
        else:
            how = f"exited with code {code} without raising"
        what = f"rank {rank} of {world_size} {how}"
        if rank in tracebacks:
            what += " (its Python stack at the crash: LaunchError.tracebacks)"
            shown = [rank]
    else:
        rank = min(errors, key=lambda r: errors[r][0])
        what = f"rank {rank} of {world_size} failed: {errors[rank][1]}"
    others = sorted((set(errors) | set(deaths)) - {rank})
    if others:
        what += f" (also failed: ranks {', '.join(map(str, others))})"
    joining = not deaths and errors[rank][3]
    return LaunchError(what, rank, tracebacks, shown, joining)
