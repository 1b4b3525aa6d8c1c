"""A micro-batch size's meshes shared between planner processes (`planner.inter.mesh_share`): the
owner's plan is the one it finds alone, whichever meshes a helper solved (on its own trace),
and a helper's failure stops the owner with its message."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

import numpy as np
import pytest
import torch

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner import size_search
from planner.api import plan
from planner.inter import mesh_search, mesh_share
from planner.inter.mesh_search import help_search
from planner.inter.mesh_shapes import submesh_shapes
from planner.inter.mesh_share import JobCursor, MeshShare
from planner.plans.assemble import assemble
from planner.size_eval import SizeJob, evaluate, search_args
from planner.tracing.inputs import ModelSource, resolve_model

MODEL = "gpt:hidden=256,layers=4,heads=4,seq=64,vocab=256"
CLUSTER = "2x4xA100-80GB"
G, B = 32, 4


def _job(budget: float) -> tuple[SizeJob, object]:
    cluster = Cluster.from_spec(CLUSTER)
    name, make, _ = resolve_model(MODEL, None, torch.float32, None)
    job = SizeJob(
        MODEL,
        None,
        torch.float32,
        name,
        cluster,
        G,
        budget,
        "adam_mixed",
        "auto",
        "auto",
        None,
        submesh_shapes(cluster),
    )
    return job, make


class _Limited(JobCursor):
    """A cursor whose helper takes at most `limit` jobs."""

    def __init__(self, limit: float) -> None:
        super().__init__(multiprocessing.get_context(), 1)
        self.limit, self.taken = limit, 0

    def take_back(self, k: int) -> int | None:
        if self.taken >= self.limit:
            return None
        i = super().take_back(k)
        self.taken += i is not None
        return i


class _HelpedAtOpen(MeshShare):
    """A share whose helper (this process, on a trace of its own) solves its jobs from the back
    as soon as the owner lists them, before the owner takes any."""

    def __init__(self, job: SizeJob, make, limit: float) -> None:
        super().__init__(_Limited(limit), 0, queue.Queue())
        self.job, self.make = job, make

    def open(self, jobs: int) -> None:
        super().open(jobs)
        self.cursor.slots[mesh_share._HELPER] = 1  # size 0's helper: a live process
        args, kw = search_args(self.job, self.make.trace(B), B, lambda m: None)
        try:
            help_search(*args, **kw, cursor=self.cursor, k=0, outbox=self.inbox)
        except (
            RuntimeError
        ):  # a helper process's own failure: the owner reads its message
            pass


def _plan_json(job, make, share) -> dict:
    result = evaluate(job, make, B, lambda m: None, share)
    out = assemble(result.best.spec).to_json()
    out.pop("planner_time_s", None)
    return out


@pytest.mark.parametrize("limit", [3, float("inf")])
def test_meshes_a_helper_solved_give_the_plan_found_alone(monkeypatch, limit) -> None:
    """Ground truth: the owner alone. Three of the meshes from the back, then every mesh, solved
    by a helper on its own trace; the plan (assembled from rebuilt solutions where the stage
    DP picked a helper's) is the same; with every mesh a helper's, rebuilt ones are picked,
    each once."""
    job, make = _job(Cluster.from_spec(CLUSTER).device.memory_bytes)
    alone = _plan_json(job, make, None)
    rebuilt = []
    real = mesh_share.rebuild

    def counted(prof, *args):
        rebuilt.append(prof)
        return real(prof, *args)

    monkeypatch.setattr(mesh_share, "rebuild", counted)
    share = _HelpedAtOpen(job, make, limit)
    assert _plan_json(job, make, share) == alone
    assert share.cursor.taken == min(limit, share.cursor.count(0)) > 0
    assert rebuilt or limit < share.cursor.count(
        0
    )  # every option a helper's: some rebuilt
    # each helper's profile rebuilt once, however many stages picked it
    assert len(rebuilt) == len({id(p) for p in rebuilt})


def test_a_memory_bound_plan_is_the_same_with_a_helper() -> None:
    """At a budget where the memory ladder and the seeds' restricted programs decide the plan,
    a helper solving every mesh changes nothing (3.83 ms per iteration against 2.85 ms unbounded)."""
    job, make = _job(1.2e7)
    alone = _plan_json(job, make, None)
    assert _plan_json(job, make, _HelpedAtOpen(job, make, float("inf"))) == alone


def test_a_helpers_error_stops_the_owner(monkeypatch) -> None:
    """A job the helper failed on is raised by the owner with the helper's message."""
    job, make = _job(Cluster.from_spec(CLUSTER).device.memory_bytes)
    share = _HelpedAtOpen(job, make, 1)

    def broken(attributed):
        raise RuntimeError("no room to ship")

    monkeypatch.setattr(mesh_share, "ship", broken)
    with pytest.raises(MeshplanError, match="no room to ship"):
        _plan_json(job, make, share)


def test_two_processes_plan_as_one(monkeypatch) -> None:
    """Sizes searched by two processes, whichever helps the other: the plan is the serial one."""
    kw = {"global_batch": G, "microbatch_size": [2, 4, 8]}
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "1")
    serial = plan(MODEL, CLUSTER, **kw).to_json()
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    shared = plan(MODEL, CLUSTER, **kw).to_json()
    for p in (serial, shared):
        p.pop("planner_time_s", None)
    assert shared == serial


@pytest.mark.parametrize("owned", [0, 1, 2])
def test_a_size_given_up_reads_its_helpers_messages_and_closes(
    monkeypatch, owned
) -> None:
    """A size given up between meshes (a faster plan found elsewhere, `planner.size_eval`) after
    the owner started `owned` meshes, three meshes from the back solved by a helper: the search
    ends without waiting on a message that was read already, every message the helper sent is
    read (none left to block its queue), and no job is left for a helper to take."""
    monkeypatch.setenv("MESHPLAN_PLANNER_THREADS", "1")
    job, make = _job(Cluster.from_spec(CLUSTER).device.memory_bytes)
    share = _HelpedAtOpen(job, make, 3)
    said: list[str] = []
    asked = []

    # none once traced; then 1e-9 s once `owned` meshes have started
    def beat() -> float:
        started = sum("logical mesh" in m for m in said)
        asked.append(len(asked) > 0 and started >= owned)
        return 1e-9 if asked[-1] else np.inf

    done: list = []  # in a thread: a wait on a message read already would never end
    run = threading.Thread(
        target=lambda: done.append(evaluate(job, make, B, said.append, share, beat)),
        daemon=True,
    )
    run.start()
    run.join(timeout=120)
    assert done, f"the search did not end: {said}"
    out = done[0]
    assert out.bounded is not None and out.best is None
    assert sum("logical mesh" in m for m in said) == owned
    assert "given up" in said[-1], said
    assert share.inbox.empty() and not share._arrived
    assert share.cursor.take_back(0) is None and share.cursor.take_front(0) is None


def test_a_size_being_traced_is_pending_until_listed_or_ended() -> None:
    """A size whose owner is tracing it is pending (a free process waits for its list) until
    the owner lists its jobs or ends it without listing any; an owner that died leaves
    nothing pending (no wait without end)."""
    cursor = JobCursor(multiprocessing.get_context(), 2)
    assert not cursor.pending()
    cursor.begin(0)
    assert cursor.pending() and cursor.claim() is None
    cursor.open(0, mesh_share.MIN_LEFT)
    assert not cursor.pending() and cursor.claim() == 0
    cursor.begin(1)
    assert cursor.pending()
    cursor.end(1)  # skipped, say: never listed
    assert not cursor.pending() and cursor.claim() is None
    dead = multiprocessing.get_context().Process(target=int)
    dead.start()
    dead.join()
    cursor.slots[mesh_share._SLOTS * 1 + mesh_share._OWNER] = dead.pid
    cursor.slots[mesh_share._SLOTS * 1 + mesh_share._BACK] = -1
    assert not cursor.pending()


def _slow_size_4(monkeypatch) -> None:
    """Two planner processes; 4 rows traced 3 s late, and each mesh solved 0.3 s late: the
    owner has not taken every job by the time the free process (polling every
    `PENDING_POLL_S`, under load) claims the size."""
    trace = ModelSource.trace

    def slow(self, b):
        if b == 4:
            time.sleep(3)
        return trace(self, b)

    monkeypatch.setattr(ModelSource, "trace", slow)
    solve = mesh_search._MeshJobs.solve
    monkeypatch.setattr(
        mesh_search._MeshJobs, "solve", lambda *a: time.sleep(0.3) or solve(*a)
    )
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")


def test_a_free_process_waits_for_a_size_still_being_traced(monkeypatch) -> None:
    """Two processes, two sizes, one traced slowly: the process done first finds the other size
    not listed yet, waits for its list and helps with it; the plan is the serial one."""
    kw = {"global_batch": G, "microbatch_size": [2, 4]}
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "1")
    serial = plan(MODEL, CLUSTER, **kw).to_json()
    _slow_size_4(monkeypatch)
    said: list[str] = []
    shared = plan(MODEL, CLUSTER, progress=said.append, **kw).to_json()
    assert any("helping with micro-batch 4" in m for m in said), said
    for p in (serial, shared):
        p.pop("planner_time_s", None)
    assert shared == serial


def test_a_size_searched_ahead_is_helped(monkeypatch) -> None:
    """Two processes, two listed sizes and one searched ahead (`SearchAhead`), traced slowly:
    the process done with its listed size helps with the one searched ahead, whose result is
    the one a single process finds (4 rows plan faster than 1 or 2: never given up)."""
    job, make = _job(float(Cluster.from_spec(CLUSTER).device.memory_bytes))
    alone = evaluate(job, make, 4, lambda m: None)
    _slow_size_4(monkeypatch)
    ahead = size_search.SearchAhead(lambda done, busy: None if busy or 4 in done else 4)
    said: list[str] = []
    out = size_search.evaluate_all(job, make, [1, 2], said.append, ahead=ahead)
    assert [r.size for r in out] == [1, 2] and list(ahead.found) == [4]
    assert any(m == "[searched ahead] helping with micro-batch 4" for m in said), said
    assert ahead.found[4].seconds == alone.seconds
