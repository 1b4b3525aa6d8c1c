"""The micro-batch sizes searched in worker processes give the serial search's plan."""

from __future__ import annotations

import threading

import pytest

from cost_models.errors import MeshplanError
from planner.api import plan
from planner.size_search import SizeJob, processes, share


def _without_time(p) -> dict:
    d = p.to_json()
    d.pop("planner_time_s")
    return d


def test_worker_processes_give_the_serial_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {"global_batch": 8, "microbatch_size": [8, 4, 2, 1]}
    serial = plan("gpt-tiny", "1x4xA100-80GB", **kw)
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "2")
    said: list[str] = []
    parallel = plan("gpt-tiny", "1x4xA100-80GB", progress=said.append, **kw)
    assert _without_time(parallel) == _without_time(serial)
    # the workers' progress reaches the caller: every size traced
    for b in (8, 4, 2, 1):
        assert any(f"with micro-batch {b}" in m for m in said), said


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


@pytest.mark.parametrize("helpers", [1, 3])
def test_share_runs_each_index_once_in_order(helpers: int) -> None:
    """The calling thread takes indices from the back, the helpers from the front: each index
    runs once, the results come back in index order, and the calling thread's indices are a
    suffix (it has imports done; a worker's first size waits for the worker's start)."""
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
    assert share(n, helpers, here, there) == [k * k for k in range(n)]
    assert sorted(ran) == list(range(n))
    mine = sorted(k for k, t in ran.items() if t == me)
    assert mine and mine == list(range(n - len(mine), n))


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
        share(4, 1, *sides)
    assert 1 not in ran and 2 not in ran, ran


def test_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    job = SizeJob("gpt-tiny", *[None] * 11)
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "3")
    assert processes(job, 6) == 3
    assert processes(job, 2) == 2  # at most one a size
    # a model object is searched in this process
    assert processes(SizeJob(object(), *[None] * 11), 6) == 1
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
    assert main([*args, "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "auto plan for gpt-tiny" in out.out
