"""Joining a torchrun job: check torchrun's shape against the plan, and meet on torchrun's store
before forming the process group.

Under torchrun (`meshplan run` started by ``torchrun --nnodes N --nproc-per-node M``), global rank
r runs plan device r. Devices are numbered host-major and torchrun numbers ranks node by node, so
the plan's host h is torchrun's node h (``--node-rank``) and its device d of that host is
LOCAL_RANK d (the GPU of that index).

What torchrun and PyTorch lack, and this module adds:

- torchrun does not know the plan, so nothing of its own checks that ``--nnodes`` x
  ``--nproc-per-node`` is the plan's hosts x devices per host; with the same world size but
  another split, a mesh axis planned inside a host (priced at the host's link) would silently run
  across hosts. `check_torchrun_shape` refuses that, naming both shapes and the torchrun options
  that match the plan.
- torchrun starts every host's ranks only once all hosts' launchers have met, but
  ``init_process_group`` has no way for a rank to say it will never come: a rank that fails before
  joining the process group (a missing plan file on one host) leaves every other rank waiting
  there until ``--timeout``. So every rank first meets on the launchers' own store
  (MASTER_ADDR:MASTER_PORT, served by host 0's launcher where torchrun sets
  TORCHELASTIC_USE_AGENT_STORE) in `join_peers`: a rank that fails before joining writes its
  error there (`tell_peers`) and every other rank stops within a second naming it (or, where host
  0's launcher has already exited with its failed ranks, saying the store is gone); a rank that
  never arrives (a host whose launcher died) stops the others after ``--join-timeout`` seconds.
- Nothing in torchrun or ``init_process_group`` compares what the ranks were told to do: hosts
  given different plan files or options would form one group and run programs that do not
  match. Every rank writes a digest of its plan and options (`run_digest`) at the meeting, and a rank whose
  digest differs from the first one written is refused there.
- A rank that exits with meshplan's one-line error leaves torchrun's failure table with
  "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html" as
  its root cause. `record_error` writes the line where torchrun's agent reads a rank's error
  (TORCHELASTIC_ERROR_FILE) so the table shows it. PyTorch's
  ``ErrorHandler.record_exception`` writes the Python traceback there, which the table would
  print instead of the line.

Without the agent store (TORCHELASTIC_USE_AGENT_STORE unset: rank 0 serves the store itself once
it initialises the process group) there is nothing to meet on beforehand, and joining is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cost_models.errors import MeshplanError
from planner.vocab.plan_file import ParallelPlan

if TYPE_CHECKING:
    from torch.distributed import TCPStore

JOIN_POLL_S = 0.25  # how often a joining rank looks for its peers and their failures
# Seconds a rank tries to reach torchrun's store (connecting, and each request).
STORE_TIMEOUT_S = 15.0


class PeerFailed(MeshplanError):
    """This rank stops because another rank failed before the group formed (not re-reported)."""


def check_torchrun_shape(plan: ParallelPlan, env: Mapping[str, str]) -> None:
    """The plan's hosts x devices per host against torchrun's nodes x processes per node
    (GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE); skipped where torchrun did not set them."""
    hosts, per_host = plan.cluster.get("hosts"), plan.cluster.get("devices_per_host")
    nodes, local = env.get("GROUP_WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if None in (hosts, per_host, nodes, local):
        return
    if (int(nodes), int(local)) != (hosts, per_host):
        spec = plan.cluster.get("spec", f"{hosts}x{per_host}")
        raise MeshplanError(
            f"the plan is for {hosts} host(s) x {per_host} devices ({spec}), but torchrun "
            f"started {nodes} node(s) x {local} processes; run torchrun with --nnodes {hosts} "
            f"--nproc-per-node {per_host}, or plan for --cluster {nodes}x{local}x..."
        )


def record_error(message: str, env: Mapping[str, str] | None = None) -> None:
    """Under torchrun, write `message` to this rank's error file (TORCHELASTIC_ERROR_FILE) as
    ``ErrorHandler.record_exception`` does, with `message` in place of the traceback (the
    "py_callstack" the failure table prints); nothing elsewhere, or where the file cannot be
    written (the exit code still tells torchrun the rank failed)."""
    path = (os.environ if env is None else env).get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)


def _join_prefix(env: Mapping[str, str]) -> str:
    """Keys of this launch attempt on torchrun's store (a restarted group starts afresh)."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    return f"meshplan/join/{run_id}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


_STORES: dict[tuple[str, int], TCPStore] = {}


def agent_store(env: Mapping[str, str]) -> TCPStore | None:
    """This process's client of the store torchrun's launchers share (MASTER_ADDR:MASTER_PORT),
    or None when the ranks do not use it (TORCHELASTIC_USE_AGENT_STORE unset: rank 0 serves the
    store itself once it initialises the process group, so there is nothing to join on before).
    `meshplan run` connects at once: on a connection made before the first host's launcher exits,
    every later request fails at once instead of retrying to connect for STORE_TIMEOUT_S."""
    import torch.distributed as dist

    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    key = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if key not in _STORES:
        try:
            _STORES[key] = dist.TCPStore(
                *key,
                is_master=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            )
        except (
            RuntimeError
        ) as exc:  # torch.distributed.DistNetworkError: nobody serves it
            raise PeerFailed(
                f"rank {env.get('RANK', '?')} lost torchrun's store at {key[0]}:{key[1]} "
                "before joining (did the first host's launcher stop?): "
                + " ".join(str(exc).split())[:200]
            ) from None
    return _STORES[key]


def tell_peers(exc: BaseException, env: Mapping[str, str] | None = None) -> None:
    """Write this rank's failure where ranks that are joining (`join_peers`) look, so they stop
    at once instead of waiting for it. Best effort: a store that cannot be reached is only
    reported on stderr."""
    if isinstance(exc, PeerFailed):
        return
    env = os.environ if env is None else env
    text = " ".join(str(exc).split())[:300]
    if not isinstance(exc, MeshplanError):
        text = f"{type(exc).__name__}: {text}"
    try:
        store = agent_store(env)
        if store is not None:  # the first failure stays (set only where no key is yet)
            store.compare_set(
                _join_prefix(env) + "failed", "", f"rank {env['RANK']}: {text}"
            )
    except Exception as err:  # noqa: BLE001 - the failure being reported matters, not this one
        print(f"meshplan run: could not tell the other ranks: {err}", file=sys.stderr)


def run_digest(plan: ParallelPlan, cfg: object) -> str:
    """What every rank must agree on: the plan (less its planning time) and the run's options
    (`cfg`, by its repr: `meshplan run`'s frozen `RunConfig`)."""
    text = json.dumps(plan.to_json() | {"planner_time_s": None}, sort_keys=True)
    return hashlib.sha256((text + repr(cfg)).encode()).hexdigest()[:16]


def join_peers(
    join_timeout_s: float, digest: str, env: Mapping[str, str] | None = None
) -> None:
    """Wait until every rank of the torchrun group has passed its checks (then the process group
    can form without waiting on a rank that will never come); raise MeshplanError naming a rank
    that failed first (`tell_peers`), a rank given another plan or options (`digest`, from
    `run_digest`), or saying how many ranks came within `join_timeout_s`."""
    env = os.environ if env is None else env
    world, prefix = int(env["WORLD_SIZE"]), _join_prefix(env)
    joined, done, failed = prefix + "joined", prefix + "done", prefix + "failed"
    deadline = time.monotonic() + join_timeout_s
    try:
        store = agent_store(env)
        if store is None:
            return
        first = store.compare_set(prefix + "digest", "", f"{env['RANK']} {digest}")
        other, theirs = first.decode().split(" ", 1)
        if theirs != digest:
            raise MeshplanError(
                f"rank {env['RANK']} was given another plan or other options than rank "
                f"{other}; run every host with the same plan file and `meshplan run` options"
            )
        if store.add(joined, 1) >= world:
            store.set(done, "1")
        while not store.check([done]):
            if store.check([failed]):
                raise PeerFailed(
                    f"rank {env['RANK']} stops: {store.get(failed).decode()} (before every "
                    "rank joined the process group)"
                )
            if time.monotonic() > deadline:
                raise MeshplanError(
                    f"only {store.add(joined, 0)} of {world} ranks joined within "
                    f"{join_timeout_s:g} s (--join-timeout): a host's launcher failed or was "
                    "not started; see every host's torchrun output"
                )
            time.sleep(JOIN_POLL_S)
    except RuntimeError as exc:  # torch.distributed.DistError: the store went away
        raise PeerFailed(
            f"rank {env['RANK']} lost torchrun's store at {env['MASTER_ADDR']}:"
            f"{env['MASTER_PORT']} while joining (did the first host's launcher stop?): "
            + " ".join(str(exc).split())[:200]
        ) from None
