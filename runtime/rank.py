"""The body of one rank of `runtime.launch`: run in a process forked from multiprocessing's fork
server, it takes the caller's environment, reads its job from a pipe, joins the process group
through the launching process's store, runs the job and reports the result or the error. Its
stacks go to a file on SIGUSR1 or a crash; it exits when the launching process closes the job
pipe."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing.connection as mpc
import os
import pickle
import signal
import threading
import time
import traceback

from planner.orphans import end_with_parent


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock in this rank. ``torch.fx.Interpreter.run`` (the executor) opens a
    disabled tqdm bar, and tqdm's default class lock holds a multiprocessing RLock: a semaphore
    registered with the launching process's resource tracker, which then warns of "leaked
    semaphore objects" after every launch. A rank's bars are its own: a thread lock serves."""
    from torch.hub import tqdm  # tqdm's own, or torch's stand-in without locks

    if hasattr(tqdm, "set_lock"):
        tqdm.set_lock(threading.RLock())


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int | None,
    cpus: list[int] | None,
    env: dict[str, str],
    timeout_s: float,
    stack_file: str,
    job: mpc.Connection,
    conn: mpc.Connection,
) -> None:
    """Body of one rank: read (fn, args, kwargs) from `job`, init the group, run `fn`, send
    ("ok", rank, value) or ("error", rank, time, one line, traceback, whether it was joining the
    process group) to the parent. SIGUSR1 writes every thread's stack to `stack_file` (the
    parent asks on a timeout)."""
    # its parent is the fork server, which exits when the launching process does
    end_with_parent()
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # and on a crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): where the rank was in Python
    faulthandler.enable(file=stacks, all_threads=True)
    os.environ.clear()  # the caller's environment, not the fork server's (`runtime.launch`)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    joining = False  # while this rank joins the process group (`runtime.launch.JOIN_RESTARTS`)
    try:
        fn, args, kwargs = pickle.loads(job.recv_bytes())
        threading.Thread(
            target=_exit_with_launcher, args=(job, stack_file), daemon=True
        ).start()
        import torch
        import torch.distributed as dist

        _thread_lock_for_tqdm()
        if cpus:
            os.sched_setaffinity(0, cpus)
        if threads:
            torch.set_num_threads(threads)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
        joining = True
        # a client of the store the launching process serves (`runtime.launch`)
        store = dist.TCPStore("127.0.0.1", port, world_size, timeout=timeout)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        joining = False
        value = fn(*args, **kwargs)
        dist.destroy_process_group()
        conn.send(("ok", rank, value))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        # Report before anything else: the time stamp must precede the peers' "connection reset"
        # errors this rank's exit will cause, so the parent blames the root cause. No
        # destroy_process_group here (it can block on dead peers); the exit closes the sockets.
        failed_at = time.time()
        with contextlib.suppress(
            Exception
        ):  # if even this fails, the exit code tells the parent
            conn.send(
                (
                    "error",
                    rank,
                    failed_at,
                    _one_line(exc),
                    traceback.format_exc(),
                    joining,
                )
            )
        conn.close()
        os._exit(1)
    conn.close()


def _exit_with_launcher(job: mpc.Connection, stack_file: str) -> None:
    """In a rank: wait for the end of the job pipe, which the launching process closes when the
    launch ends or it dies, and exit. The parent-death signal alone does not cover that: a rank's
    parent is the fork server, which outlives a launching process killed mid-run while ranks
    hold its liveness pipe (multiprocessing hands it to every child). A launching process killed
    so cannot remove its directory of stack files either: each rank removes its own file on the
    way out, and the last one the directory."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            job.recv_bytes()
    with contextlib.suppress(OSError):
        os.remove(stack_file)
    with contextlib.suppress(OSError):  # another rank's file is still there
        os.rmdir(os.path.dirname(stack_file))
    os._exit(1)
