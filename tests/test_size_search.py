"""The micro-batch sizes searched in worker processes give the serial search's plan."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from processes import running

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner import size_search
from planner.api import plan
from planner.inter.mesh_shapes import submesh_shapes
from planner.models import build_model
from planner.size_eval import Ranked, SizeJob, SizeResult, evaluate
from planner.size_search import processes, share, take_order
from planner.tracing.inputs import resolve_model


def _without_time(p) -> dict:
    d = p.to_json()
    d.pop("planner_time_s")
    return d


SEARCHED = {"global_batch": 8, "microbatch_size": [8, 4, 2, 1]}


@functools.cache
def _serial_plan() -> dict:
    """gpt-tiny's plan over `SEARCHED`'s sizes, in this process (the same for both start methods)."""
    return _without_time(plan("gpt-tiny", "1x4xA100-80GB", **SEARCHED))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_processes_give_the_serial_plan(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} here")
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    monkeypatch.setattr(size_search, "start_method", lambda: method)
    said: list[str] = []
    parallel = plan("gpt-tiny", "1x4xA100-80GB", progress=said.append, **SEARCHED)
    assert _without_time(parallel) == _serial_plan()
    # the workers' progress reaches the caller: every size traced
    for b in (8, 4, 2, 1):
        assert any(f"with micro-batch {b}" in m for m in said), said


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_process_with_no_size_left_searches_ahead(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `SearchAhead`, a process that finds no size left searches the size it names (in a
    worker or in this process), once, with the result the serial search gives that size; the
    sizes listed come back as before and the size searched ahead is reported so (given up
    when a listed size's plan is faster than its bound)."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} here")
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    monkeypatch.setattr(size_search, "start_method", lambda: method)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    name, make, _ = resolve_model("gpt-tiny", None, torch.float16, None)
    job = SizeJob(
        "gpt-tiny",
        None,
        torch.float16,
        name,
        cluster,
        8,
        float(cluster.device.memory_bytes),
        "adam_mixed",
        "auto",
        "auto",
        None,
        submesh_shapes(cluster),
    )
    asked: list[tuple[dict, set]] = []

    def pick(done: dict[int, float], busy: set[int]) -> int | None:
        asked.append((done, busy))
        assert set(done) <= {8, 4, 2} and busy <= {2} and not busy & set(done)
        # not asked again while 2 rows runs once 8 and 4 are done: nothing left to overlap
        assert not (busy and {8, 4} <= set(done))
        return 2 if len(asked) == 1 else None

    ahead = size_search.SearchAhead(pick)
    said: list[str] = []
    out = size_search.evaluate_all(job, make, [8, 4], said.append, ahead=ahead)
    serial = {b: evaluate(job, make, b, lambda m: None) for b in (8, 4, 2)}
    assert [(r.size, r.seconds) for r in out] == [
        (b, serial[b].seconds) for b in (8, 4)
    ]
    assert list(ahead.found) == [2]
    # or given up, as a faster plan of a listed size rules it out (`planner.size_eval._Bounded`)
    r = ahead.found[2]
    assert r.seconds == serial[2].seconds or (
        r.bounded is not None
        and min(serial[8].seconds, serial[4].seconds) < r.bounded <= serial[2].seconds
    )
    assert any(m.startswith("[searched ahead] tracing") for m in said), said


class Unpicklable(torch.nn.Module):
    """gpt-tiny with a lock (it cannot be pickled) that notes the process tracing it."""

    def __init__(self, path) -> None:
        super().__init__()
        self.inner, _ = build_model("gpt-tiny", device="meta")
        self.lock, self.path = threading.Lock(), path

    def forward(self, *batch):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return self.inner(*batch)


@pytest.mark.skipif(
    size_search.start_method() != "fork", reason="workers are spawned here"
)
def test_a_module_object_is_searched_in_forked_workers(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `nn.Module` that cannot be pickled is searched in forked workers as well as in this
    process, with the serial search's plan."""
    traced_by = tmp_path / "pids"
    model = Unpicklable(traced_by)
    _, batch = build_model("gpt-tiny", batch=8, device="meta")
    kw = {"global_batch": 8, "microbatch_size": [8, 4, 2, 1]}
    serial = plan(model, "1x4xA100-80GB", batch, **kw)
    assert set(traced_by.read_text().split()) == {str(os.getpid())}
    traced_by.unlink()
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    said: list[str] = []
    parallel = plan(model, "1x4xA100-80GB", batch, progress=said.append, **kw)
    assert _without_time(parallel) == _without_time(serial)
    pids = traced_by.read_text().split()
    # each size traced in one of the 2 processes; a process with no size left traces another's
    # again to help it (`help_sizes`), sooner where a size is ruled out by its bound
    assert len(pids) >= 4 and len(set(pids)) == 2, pids
    for b in (8, 4, 2, 1):
        assert any(f"with micro-batch {b}" in m for m in said), said


def _plans_in_a_rank() -> int:
    os.environ["MESHPLAN_PLANNER_PROCESSES"] = "2"
    p = plan("gpt-tiny", "1x4xA100-80GB", global_batch=8, microbatch_size=[8, 4])
    return p.num_microbatches


def test_a_rank_plans_in_its_own_process() -> None:
    """A rank of `runtime.launch` (a daemonic process, which may not start workers) plans in
    its own process whatever MESHPLAN_PLANNER_PROCESSES says, as the local suite's rank 0
    does on a machine with more cores than ranks."""
    from runtime.launch import launch

    serial = plan("gpt-tiny", "1x4xA100-80GB", global_batch=8, microbatch_size=[8, 4])
    assert launch(_plans_in_a_rank, 1) == [serial.num_microbatches]


DIES_IN_A_WORKER = """
import multiprocessing, os
from planner.models import build_model

def make(batch=1, **kw):
    if multiprocessing.parent_process() is not None:
        os._exit(3)  # as a worker killed for memory
    return build_model("gpt-tiny", batch=batch, **kw)
"""


@pytest.mark.slow
def test_a_dead_worker_is_one_line(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process that dies (here: exits at once) ends the plan with one line naming
    the size and the way out, not the process pool's traceback."""
    (tmp_path / "dies_in_worker.py").write_text(DIES_IN_A_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    kw = {"global_batch": 8, "microbatch_size": [8, 4]}
    with pytest.raises(MeshplanError, match="worker process died while searching "
                       r"micro-batch size 8 .*MESHPLAN_PLANNER_PROCESSES=1"):  # fmt: skip
        plan("dies_in_worker:make", "1x4xA100-80GB", **kw)
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "1")
    assert plan("dies_in_worker:make", "1x4xA100-80GB", **kw).stages


HANGS_IN_A_WORKER = """
import multiprocessing, os, sys, time
from planner.models import build_model

def make(batch=1, **kw):
    if multiprocessing.parent_process() is not None:
        with open(os.path.join(os.path.dirname(__file__), "worker.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)  # a long size
    return build_model("gpt-tiny", batch=batch, **kw)

if __name__ == "__main__":
    os.environ["MESHPLAN_PLANNER_PROCESSES"] = "2"
    sys.path.insert(0, os.path.dirname(__file__))
    {run}
"""
#: The searches that fork workers: the planner's sizes, the manual grid's layouts.
SEARCHES = {
    "plan": "from planner.api import plan; plan('hangs_in_worker:make', '1x4xA100-80GB', "
    "global_batch=8, microbatch_size=[8, 4])",
    # the grid reads a built-in model's config: its pricing hangs in a worker instead
    "grid": "from benchmarks import manual_grid as g; g.price = lambda *a: make(); "
    "g.best_manual('gpt-tiny', '1x4xA100-80GB', 8, suite='gpt')",
}


@pytest.mark.slow
@pytest.mark.skipif(
    size_search.start_method() != "fork", reason="workers are spawned here"
)
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_forked_workers_end_when_the_planning_process_is_killed(
    tmp_path, search: str
) -> None:
    """SIGKILL to the planning (or grid-searching) process mid-search leaves no worker running
    (`planner.orphans.end_with_parent`)."""
    script = tmp_path / "hangs_in_worker.py"
    script.write_text(HANGS_IN_A_WORKER.replace("{run}", SEARCHES[search]))
    proc = subprocess.Popen([sys.executable, str(script)])
    pid_at = tmp_path / "worker.pid"
    deadline = time.monotonic() + 60
    while not (pid_at.exists() and pid_at.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "no worker started"
        time.sleep(0.2)
    pid = int(pid_at.read_text())
    assert running(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid), pid


MASK_FROM_ONES = """
import os, sys
import torch
import torch.nn.functional as F
from torch import nn

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

    def forward(self, idx, targets):
        x = self.wte(idx)
        T = x.shape[1]
        future = torch.ones(T, T, dtype=torch.bool).triu(1)  # real values, while tracing too
        scores = (x @ x.transpose(1, 2)).masked_fill(future, float("-inf"))
        h = torch.softmax(scores, -1) @ x
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

if __name__ == "__main__":
    os.environ["MESHPLAN_PLANNER_PROCESSES"] = "2"
    torch.set_num_threads(2)
    from planner import plan, trace
    batch = (torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8)))
    trace(Masked(), batch)  # this process runs an OpenMP region (the mask's triu)
    kw = {"global_batch": 8, "microbatch_size": [8, 4], "dtype": "float32"}
    p = plan(Masked(), "1x2xA100-80GB", batch, **kw)
    print("planned", p.stages[0].logical_mesh)
"""


@pytest.mark.skipif(
    size_search.start_method() != "fork", reason="workers are spawned here"
)
def test_forked_workers_trace_after_the_parent_ran_openmp(tmp_path) -> None:
    """A process that traced a model computing on real tensors (an OpenMP region: a causal
    mask's ``triu``) then plans it in forked workers: they used to wait for ever on the parent's
    OpenMP threads, which do not survive a fork (`size_search.start_forked_worker`)."""
    script = tmp_path / "mask_from_ones.py"
    script.write_text(MASK_FROM_ONES)
    out = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "planned" in out.stdout


@pytest.mark.parametrize("helpers", [1, 3])
def test_share_runs_each_index_once_in_order(helpers: int) -> None:
    """Every thread takes the next index of the take order nobody has taken: each index runs
    once, each thread's indices come in the take order, the results come back in index order,
    and the calling thread runs some."""
    me = threading.get_ident()
    ran: dict[int, int] = {}
    lock = threading.Lock()

    def f(k: int) -> int:
        with lock:
            assert k not in ran
            ran[k] = threading.get_ident()
        return k * k

    started = threading.Event()  # the helpers wait until the calling thread has run one

    def here(k: int) -> int:
        started.set()
        return f(k)

    def there(k: int) -> int:
        assert started.wait(30)
        return f(k)

    n = 9
    order = [4, 3, 5, 2, 6, 1, 7, 0, 8]
    assert share(n, helpers, order, here, there) == [k * k for k in range(n)]
    assert sorted(ran) == list(range(n))
    for thread in set(ran.values()):  # `ran` in the order the indices started
        positions = [order.index(k) for k, t in ran.items() if t == thread]
        assert positions == sorted(positions), positions
    assert me in ran.values()


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_share_asks_for_more_when_nothing_is_left(helpers: int) -> None:
    """A thread that finds no index left asks `more`, given the results so far, for another
    (n, n + 1, ...): each runs once, its result appended; asked only once every index of the
    order is taken, and until it says None; then the thread helps."""
    n, extra = 4, 2
    ran: list[int] = []
    asked: list[dict] = []
    helped: list[int] = []
    lock = threading.Lock()

    def f(k: int) -> int:
        with lock:
            ran.append(k)
        return 10 * k

    def more(done: dict[int, int]) -> int | None:
        assert len(ran) >= n  # every index of the order taken
        assert all(done[k] == 10 * k for k in done)
        asked.append(done)
        k = n + len(asked) - 1  # n, n + 1, ... then None
        return k if k < n + extra else None

    out = share(
        n,
        helpers,
        [2, 1, 3, 0],
        f,
        f,
        lambda: helped.append(0),
        lambda: helped.append(1),
        more,
    )
    assert out == [10 * k for k in range(n + extra)]
    assert sorted(ran) == list(range(n + extra))
    assert len(helped) == helpers + 1  # every thread helped once after


def test_share_asks_again_when_an_index_ends() -> None:
    """A thread that `more` gave nothing while another index ran asks again once it ends: the
    two extra indices `more` names only then run on both threads at once (each waits for the
    other to start)."""
    one_ended = threading.Event()
    both = threading.Barrier(2, timeout=10)

    def f(k: int) -> int:
        if k == 1:  # the calling thread ends index 0 first and finds nothing more
            time.sleep(0.2)
            one_ended.set()
        if k >= 2:
            both.wait()
        return k

    extra = iter([2, 3])

    def more(done: dict[int, int]) -> int | None:
        return next(extra, None) if 1 in done else None

    assert share(2, 1, [0, 1], f, f, more=more) == [0, 1, 2, 3]
    assert one_ended.is_set()


def test_share_helps_again_while_an_index_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread with nothing left helps, and helps again every `HELP_AGAIN_S` while another
    index runs (a size taken just before may not have listed its jobs yet), and stops once
    none runs."""
    monkeypatch.setattr(size_search, "HELP_AGAIN_S", 0.05)
    helped: list[float] = []
    ended: list[float] = []

    def f(k: int) -> int:
        time.sleep(0.6)
        ended.append(time.perf_counter())
        return k

    def helping() -> None:
        helped.append(time.perf_counter())

    assert share(1, 1, [0], f, f, helping, helping) == [0]
    assert len(helped) >= 4, helped
    # none once the index has ended but the one that may have begun as it ended
    assert sum(t > ended[0] for t in helped) <= 1, (helped, ended)


def test_take_order_goes_from_the_middle_size_out() -> None:
    """The middle size first, then outwards, the larger of two alike first, whatever order
    the sizes are listed in."""
    assert take_order([64, 32, 16, 8, 4, 2, 1]) == [3, 2, 4, 1, 5, 0, 6]
    assert take_order([1024, 32, 16, 8, 4, 2, 1]) == [3, 2, 4, 1, 5, 0, 6]
    assert take_order([1, 2, 4, 8]) == [2, 1, 3, 0]
    assert take_order([8, 4, 2, 1]) == [1, 2, 0, 3]
    assert take_order([5]) == [0]


@pytest.mark.parametrize("failing", ["here", "there"])
def test_share_raises_the_first_failure(failing: str) -> None:
    """A failure on either side is raised, and no index is taken after it."""
    failed = threading.Event()
    ran: list[int] = []

    def boom(k: int) -> int:
        ran.append(k)
        failed.set()
        raise MeshplanError(f"size {k} failed")

    def waits(k: int) -> int:  # still running when the other side fails
        ran.append(k)
        assert failed.wait(30)
        return k

    sides = (boom, waits) if failing == "here" else (waits, boom)
    with pytest.raises(MeshplanError, match="failed"):
        share(4, 1, list(range(4)), *sides)
    # one index each at most, the first of the take order: none taken after the failure
    assert len(ran) <= 2 and sorted(ran) == list(range(len(ran))), ran


def test_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    job = SizeJob("gpt-tiny", *[None] * 11)
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "3")
    assert processes(job, 6) == 3
    assert processes(job, 2) == 2  # at most one a size
    # a model object: in forked workers, or in this process where workers are spawned
    module = SizeJob(object(), *[None] * 11)
    monkeypatch.setattr(size_search, "start_method", lambda: "fork")
    assert processes(module, 6) == 3
    monkeypatch.setattr(size_search, "start_method", lambda: "spawn")
    assert processes(module, 6) == 1
    assert processes(job, 6) == 3
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "zero")
    with pytest.raises(MeshplanError, match="MESHPLAN_PLANNER_PROCESSES"):
        processes(job, 6)


def test_cli_progress_and_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    """`meshplan plan` tells what it traces and solves, numbered; `--quiet` silences it."""
    from runtime.cli import main

    args = ["plan", "gpt-tiny", "--cluster", "1x2xA100-80GB", "--batch", "4"]
    args += ["--microbatch-size", "4", "--microbatch-size", "2"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[size 1 of 2] tracing gpt-tiny with micro-batch 4" in err, err
    assert "[size 2 of 2] tracing gpt-tiny with micro-batch 2" in err, err
    assert "logical mesh 1x2 (" in err and " of " in err, err
    # each size's outcome, so a user sees why one lost
    assert re.search(r"\[size 1 of 2\] micro-batch 4: [0-9.]+ s per iteration", err), (
        err
    )
    assert main([*args, "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "auto plan for gpt-tiny" in out.out


def test_a_plan_slower_than_a_kept_sizes_is_not_assembled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_assembled` assembles a size's plan unless it is slower than the fastest kept size's so
    far, which only kept sizes lower (ties are assembled: the earlier size wins them)."""
    made = []
    monkeypatch.setattr(size_search, "assemble", lambda spec: made.append(spec) or spec)
    best = multiprocessing.get_context().Value("d", float("inf"))

    def result(seconds: float, kept: bool) -> SizeResult:
        out = SizeResult(1, seconds, best=Ranked(seconds, f"plan {seconds}"))
        return size_search._assembled(out, best, kept)

    assert result(5.0, kept=True).plan == "plan 5.0" and best.value == 5.0
    assert result(4.0, kept=False).plan == "plan 4.0" and best.value == 5.0
    late = result(6.0, kept=True)
    assert late.beaten and late.plan is None and late.best is None
    assert late.seconds == 6.0 and best.value == 5.0
    assert result(7.0, kept=False).beaten
    assert result(5.0, kept=True).plan == "plan 5.0"
    assert made == ["plan 5.0", "plan 4.0", "plan 5.0"]
