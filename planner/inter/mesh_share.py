"""One micro-batch size's logical meshes shared between planner processes
(`planner.size_search`): a process with no size left to search helps one still being searched,
so the processes end together instead of one waiting on another's last size.

The size's owner (the process that took the size) traces it and lists its mesh jobs
(`planner.inter.mesh_search`); it takes the jobs from the front of their take order (the
costliest first), a helper from the back at a lower priority, each the next one nobody has taken
(`JobCursor`, shared memory: positions in that order). A helper traces the same size itself (a
traced graph does not cross processes; the trace is deterministic, so its node names and its
job list are the owner's: the helper checks the count), solves its jobs and
attributes each solution to every layer clustering as the owner would, and sends the profiles
to the owner (`ship`: the solutions without their pricing, which holds the graph). The owner
enters every job's profiles into its tables in job order, so the plan is the one the owner
alone would find. A candidate the stage DP picks from a helper's profile gets its solution's
pricing back from the owner's own pricing of that mesh (`rebuild`): what assembling its plan
reads (the gradient buckets' overlap, the plan's memory) needs it.

What PyTorch and multiprocessing lack: nothing hands out work items from both ends of a list to
processes that join late; this is a lock and four integers per size.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import sys
import threading
from typing import Any

import numpy as np

from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner.inter.stage_table import LayerProfile
from planner.intra.solution import StageSolution
from planner.intra.solve import option_position, price_stage

#: A size is helped only while at least this many of its jobs are left: a helper first traces
#: the size, which a single job's solve may not repay.
MIN_LEFT = 3
#: Seconds between an owner's checks that the helper whose jobs it waits on is alive.
POLL_S = 1.0

_FRONT, _BACK, _HELPER, _COUNT, _OWNER, _SIZE = range(6)
_SLOTS = 6
#: Seconds between a free process's looks for a size whose owner is still tracing it
#: (`JobCursor.pending`).
PENDING_POLL_S = 0.02


class JobCursor:
    """Per size: the next job from the front, the end of the jobs nobody has taken from the
    back (-1 until the owner has listed them), the helper's process id (0: none), the
    number of jobs, the owner's process id (0: not taken yet) and the size itself, in rows
    (`assign`: a slot may be handed out later, to a size searched ahead). Passed to forked or
    spawned processes at their start (multiprocessing shared memory)."""

    def __init__(self, context: Any, sizes: int) -> None:
        self.slots = context.Array("q", _SLOTS * sizes)
        for k in range(sizes):
            self.slots[_SLOTS * k + _BACK] = -1

    def _at(self, k: int, field: int) -> int:
        return _SLOTS * k + field

    def assign(self, k: int, rows: int) -> None:
        """Slot k is the micro-batch size of `rows` rows (before its owner begins it)."""
        self.slots[self._at(k, _SIZE)] = rows

    def size(self, k: int) -> int:
        return self.slots[self._at(k, _SIZE)]

    def begin(self, k: int) -> None:
        """This process owns size k and is tracing it (`pending` until it opens or ends it)."""
        self.slots[self._at(k, _OWNER)] = os.getpid()

    def end(self, k: int) -> None:
        """The owner of size k is done with it, listed or not (skipped, say), or gives it up:
        no job is left for anyone to take (the front meets the back)."""
        with self.slots.get_lock():
            back = self.slots[self._at(k, _BACK)]
            self.slots[self._at(k, _BACK)] = max(back, 0)
            self.slots[self._at(k, _FRONT)] = max(back, 0)

    def pending(self) -> bool:
        """Whether a size nobody helps has a live owner that has not listed its jobs yet (it is
        tracing it): a process with nothing to do waits for it (`claim` again)."""
        with self.slots.get_lock():
            owners = [
                self.slots[self._at(k, _OWNER)]
                for k in range(len(self.slots) // _SLOTS)
                if self.slots[self._at(k, _BACK)] < 0
                and not self.slots[self._at(k, _HELPER)]
            ]
        return any(pid and _alive(pid) for pid in owners)

    def open(self, k: int, jobs: int) -> None:
        """The owner of size k has listed its `jobs` jobs: helpers may take them."""
        with self.slots.get_lock():
            self.slots[self._at(k, _BACK)] = jobs
            self.slots[self._at(k, _COUNT)] = jobs

    def count(self, k: int) -> int:
        return self.slots[self._at(k, _COUNT)]

    def take_front(self, k: int) -> int | None:
        with self.slots.get_lock():
            i, end = self.slots[self._at(k, _FRONT)], self.slots[self._at(k, _BACK)]
            if i >= end:
                return None
            self.slots[self._at(k, _FRONT)] = i + 1
            return i

    def take_back(self, k: int) -> int | None:
        with self.slots.get_lock():
            i, end = self.slots[self._at(k, _FRONT)], self.slots[self._at(k, _BACK)]
            if i >= end:
                return None
            self.slots[self._at(k, _BACK)] = end - 1
            return end - 1

    def helped(self, k: int, p: int) -> bool:
        """Whether a helper took the job at position p of size k's take order (the owner takes
        every one below the back)."""
        with self.slots.get_lock():
            return p >= self.slots[self._at(k, _BACK)] >= 0

    def helper(self, k: int) -> int:
        return self.slots[self._at(k, _HELPER)]

    def claim(self) -> int | None:
        """A size for this process to help: the open one with the most jobs left (at least
        `MIN_LEFT`) that no other process helps; None when there is none."""
        with self.slots.get_lock():
            left = [
                (self.slots[self._at(k, _BACK)] - self.slots[self._at(k, _FRONT)], k)
                for k in range(len(self.slots) // _SLOTS)
                if not self.slots[self._at(k, _HELPER)]
            ]
            most = max(left, default=(0, None))
            if most[0] < MIN_LEFT:
                return None
            self.slots[self._at(most[1], _HELPER)] = os.getpid()
            return most[1]


@dataclasses.dataclass
class MeshShare:
    """One size's side of the sharing, as `planner.inter.mesh_search.search` uses it: the cursor,
    the size's index, and the queue its helper's profiles arrive on."""

    cursor: JobCursor
    k: int
    # a multiprocessing queue of (job index, pickled shipped profiles or an error message); the
    # helper pickles them itself: a queue pickles in a thread of its own, its errors unseen
    inbox: Any
    _arrived: dict[int, Any] = dataclasses.field(default_factory=dict)

    def begin(self) -> None:
        self.cursor.begin(self.k)

    def end(self) -> None:
        self.cursor.end(self.k)

    def open(self, jobs: int) -> None:
        self.cursor.open(self.k, jobs)

    def take_front(self) -> int | None:
        return self.cursor.take_front(self.k)

    def helped(self, p: int) -> bool:
        return self.cursor.helped(self.k, p)

    def receive(self, i: int) -> list[list[LayerProfile]]:
        """The profiles of job i, which a helper took: waits for them (raising when the helper
        reports an error or has died)."""
        while i not in self._arrived:
            try:
                j, payload = self.inbox.get(timeout=POLL_S)
            except queue.Empty:
                pid = self.cursor.helper(self.k)
                if pid and not _alive(pid):
                    raise MeshplanError(
                        f"the planner process helping this micro-batch size (pid {pid}) died; "
                        "plan in one process with MESHPLAN_PLANNER_PROCESSES=1"
                    ) from None
                continue
            if isinstance(payload, str):
                raise MeshplanError(
                    f"a planner process helping this size failed: {payload}"
                )
            self._arrived[j] = pickle.loads(payload)
        return self._arrived.pop(i)


#: The niceness a helper's solver threads take (`lower_priority`).
HELPER_NICENESS = 10


def lower_priority() -> None:
    """Give the calling thread (a helper's solver) a lower CPU priority than the owner's
    threads, on Linux, where a thread has a niceness of its own. The owner's jobs then run
    first: its last job is often one long branch-and-bound (mixtral-8x7b at 8 rows per
    micro-batch: 21 s of its 38 s in one program), which the helper's threads would otherwise
    slow by taking its core half the time; a helper's jobs use whatever the owner leaves idle,
    so nothing is lost."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HELPER_NICENESS)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def ship(attributed: list[list[LayerProfile]]) -> list[list[LayerProfile]]:
    """A job's profiles (per clustering) as a helper sends them: each solution without its
    pricing context and the caches derived from it, with the positions of its choices among
    its pricing's options and the options its program kept (`rebuild` restores them); each
    profile without its node -> layer map (the owner's clustering has it)."""
    stripped: dict[int, StageSolution] = {}

    def strip(sol: StageSolution) -> StageSolution:
        if id(sol) not in stripped:
            ctx = sol._ctx
            out = dataclasses.replace(
                sol,
                _ctx=None,
                _derived={},
                _cost_table=None,
                _index=None,
                _value_table=None,
                _edge_terms=None,
            )
            out._shipped = (
                {n: k.copy() for n, k in ctx.keep.items()},
                {n: option_position(ctx, n, o) for n, o in sol.choice.items()},
            )
            stripped[id(sol)] = out
        return stripped[id(sol)]

    return [
        [
            dataclasses.replace(p, solution=strip(p.solution), layer_of=None)
            for p in profs
        ]
        for profs in attributed
    ]


def received(
    attributed: list[list[LayerProfile]], layer_maps: list[dict[str, int]]
) -> list[list[LayerProfile]]:
    """Shipped profiles with the owner's node -> layer map of each clustering back."""
    return [
        [dataclasses.replace(p, layer_of=m) for p in profs]
        for profs, m in zip(attributed, layer_maps)
    ]


def is_shipped(prof: LayerProfile) -> bool:
    return prof.solution._ctx is None and hasattr(prof.solution, "_shipped")


def rebuild(
    prof: LayerProfile,
    graph: Any,
    mesh: LogicalMesh,
    num_microbatches: int,
    optimizer: str,
    pricings: dict,
) -> LayerProfile:
    """A shipped profile whose solution has its pricing context again: the owner's own pricing
    of `mesh` (made once per mesh, `pricings`), restricted to the options the helper's program
    kept, its choice the same options by position."""
    sol = prof.solution
    keep, index = sol._shipped
    key = (mesh.submesh, mesh.shape)
    if key not in pricings:
        pricings[key] = price_stage(
            graph, mesh, num_microbatches=num_microbatches, optimizer=optimizer
        )
    base = pricings[key].ctx
    ctx = base
    if keep:
        full = base.full_options or base.options
        options = dict(full)
        lists: dict[
            tuple, list
        ] = {}  # a block's copies share their representative's list
        for n, k in keep.items():
            at = (id(full[n]), np.asarray(k).tobytes())
            if at not in lists:
                lists[at] = [full[n][i] for i in k]
            options[n] = lists[at]
        ctx = base.restricted(options)
    choice = {n: ctx.options[n][i] for n, i in index.items()}
    return dataclasses.replace(
        prof,
        solution=dataclasses.replace(sol, choice=choice, _ctx=ctx, _index=dict(index)),
    )
