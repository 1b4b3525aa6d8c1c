"""`meshplan run` on two hosts under torchrun: two launchers on this machine play the two hosts
(`--nnodes 2 --nproc-per-node 2`, static rendezvous on 127.0.0.1) and train a plan for `2x2xCPU`.

The plan is made with the CLI, as the README says: tensor parallel inside each host and a
two-stage pipeline across the hosts (stage 0 on host 0's two ranks, stage 1 on host 1's), so that
the activations and their gradients cross hosts every micro-batch. Its losses equal single-device
training within 1e-5 relative. A launcher whose ranks fail before the group forms (no plan file
on one host, first or second) stops the other host's ranks at once, both launchers exiting
non-zero, instead of leaving them in `init_process_group` until `--timeout`. The README's
commands are the ones run here (`test_readme_gives_the_commands_run_here`).

Joining (`runtime.torchrun.join_peers`) is also checked in-process against a store of our own:
a failure reported by one rank, a rank that never comes, a rank given another plan; and a plan for
another hosts x devices shape is refused before any process group forms.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import single_device
import torch
import torch.distributed as dist
from profiles import cpu_profile

from cost_models.errors import MeshplanError
from cost_models.profile import CollectiveFit, save_profile
from planner.plans.manual import manual_plan
from runtime.cli import main
from runtime.launch import free_port
from runtime.torchrun import PeerFailed, join_peers, tell_peers
from runtime.train import seeded_model_and_batches

REPO = Path(__file__).resolve().parents[1]
MODEL, BATCH, STEPS, LR = "gpt-tiny", 8, 3, 0.1  # LR: `meshplan run`'s default
PLAN_CMD = (
    f"meshplan manual {MODEL} --cluster 2x2xCPU --profile profile.json --dp 1 --tp 2 --pp 2 "
    f"--microbatches 2 --batch {BATCH} --dtype float32 --json plan.json"
)
TORCHRUN_CMD = (
    "torchrun --nnodes 2 --nproc-per-node 2 --node-rank {node} --master-addr {addr} "
    f"--master-port {{port}} -m runtime.cli run {MODEL} --plan plan.json --steps {STEPS} "
    "--json run.json"
)
README_ADDR, README_PORT = "$MASTER", 29500  # how the README writes them
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun_argv(node: int, port: int, plan: str = "plan.json") -> list[str]:
    argv = shlex.split(TORCHRUN_CMD.format(node=node, addr="127.0.0.1", port=port))
    argv[argv.index("--plan") + 1] = plan
    return [str(TORCHRUN), *argv[1:]]


def _start_hosts(cwd: Path, plans: tuple[str, str]) -> list[subprocess.Popen[bytes]]:
    """The two launchers, each in its own session (so that it and its ranks can be killed
    together), writing to host0.log and host1.log."""
    port = free_port()
    return [
        subprocess.Popen(
            _torchrun_argv(node, port, plans[node]),
            cwd=cwd,
            stdout=(cwd / f"host{node}.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for node in (0, 1)
    ]


def _wait_hosts(
    procs: list[subprocess.Popen[bytes]], deadline_s: float
) -> tuple[list[int | None], float]:
    """Wait for every launcher until `deadline_s` has passed; then kill the ones left (their
    whole session), which report None. Also the seconds waited."""
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < deadline_s:
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes, time.monotonic() - t0


def _log(cwd: Path, node: int) -> str:
    return (cwd / f"host{node}.log").read_text(errors="replace")


def _stub_profile(path: Path) -> None:
    """A measured-looking CPU profile: it sets predicted times only, never what runs."""
    save_profile(
        cpu_profile(
            peak_flops={"float32": 1e10},
            collectives=[
                CollectiveFit("all_reduce", 2, 1e-4, 1e-9, [(65536, 1.6e-4)]),
                CollectiveFit("send_recv", 2, 5e-5, 5e-10, [(65536, 8e-5)]),
            ],
        ),
        path,
    )


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`meshplan manual ...` (PLAN_CMD), run once as a CLI subprocess: the plan file's text."""
    cwd = tmp_path_factory.mktemp("plan")
    _stub_profile(cwd / "profile.json")
    argv = [sys.executable, "-m", "runtime.cli", *shlex.split(PLAN_CMD)[1:]]
    proc = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return (cwd / "plan.json").read_text()


def _reference() -> list[float]:
    """Single-device SGD on the model and batches `meshplan run` uses."""
    model, batches = seeded_model_and_batches(MODEL, BATCH, STEPS, 0)
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )[0]


def test_readme_gives_the_commands_run_here() -> None:
    readme = (REPO / "README.md").read_text()
    assert PLAN_CMD in readme
    for node in (0, 1):
        cmd = TORCHRUN_CMD.format(node=node, addr=README_ADDR, port=README_PORT)
        assert cmd in readme, cmd


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
@pytest.mark.slow
def test_two_hosts_train_like_one_device(tmp_path: Path, plan_text: str) -> None:
    (tmp_path / "plan.json").write_text(plan_text)
    plan = json.loads(plan_text)
    assert (plan["cluster"]["hosts"], plan["cluster"]["devices_per_host"]) == (2, 2)
    assert [s["devices"] for s in plan["stages"]] == [[0, 1], [2, 3]]  # host 0, host 1
    codes, waited = _wait_hosts(_start_hosts(tmp_path, ("plan.json",) * 2), 300)
    assert codes == [0, 0], (
        codes,
        _log(tmp_path, 0)[-3000:],
        _log(tmp_path, 1)[-3000:],
    )
    result = json.loads((tmp_path / "run.json").read_text())  # rank 0 is on host 0
    assert "wrote run.json" in _log(tmp_path, 0)
    assert len(result["step_times_s"]) == STEPS
    assert result["losses"] == pytest.approx(_reference(), rel=1e-5)
    print(f"two hosts trained {STEPS} steps in {waited:.1f} s")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
@pytest.mark.slow
@pytest.mark.parametrize("bad_node", [1, 0])
def test_a_failed_host_stops_both(
    tmp_path: Path, plan_text: str, bad_node: int
) -> None:
    """Host `bad_node` has no plan file: its ranks fail before the group forms. The other
    host's ranks stop by themselves long before --join-timeout (300 s), naming the cause; or,
    where host 0 failed and its launcher exited (taking torchrun's store with it) before the
    other ranks came to look, saying that they lost the store at host 0's address."""
    (tmp_path / "plan.json").write_text(plan_text)
    plans = ["plan.json", "plan.json"]
    plans[bad_node] = "missing.json"
    codes, waited = _wait_hosts(_start_hosts(tmp_path, tuple(plans)), 150)
    assert None not in codes, f"a launcher was still running after {waited:.0f} s"
    assert all(c != 0 for c in codes), codes
    other = _log(tmp_path, 1 - bad_node)
    named = "cannot read plan missing.json" in other and "before every rank" in other
    lost = bad_node == 0 and "lost torchrun's store at 127.0.0.1:" in other
    assert named or lost, other[-3000:]
    # torchrun's failure table on the failed host names the error as the root cause
    root = _log(tmp_path, bad_node).split("Root Cause")[-1]
    assert "meshplan: error: cannot read plan missing.json" in root, root
    print(f"both launchers stopped in {waited:.1f} s")


def test_an_error_under_torchrun_is_the_root_cause_torchrun_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshplan run`'s one-line error goes to the file torchrun's agent reads, read back here
    by torchrun's own code."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.chdir(tmp_path)
    assert main(["run", MODEL, "--plan", "missing.json", "--steps", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("meshplan: error: cannot read plan missing.json"), line
    failure = ProcessFailure(
        local_rank=0, pid=1, exitcode=2, error_file=str(error_file)
    )
    table = ChildFailedError("meshplan run", {0: failure}).format_msg()
    assert f"traceback : {line}" in table, table


def test_plan_for_other_hosts_refused_before_joining(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2x2 plan under torchrun with 1 node x 4 processes: refused, naming both shapes."""
    plan = manual_plan(
        MODEL,
        "2x2xA100-80GB",
        dp=1,
        tp=2,
        pp=2,
        num_microbatches=2,
        global_batch=BATCH,
        dtype="float32",
    )
    plan.save(tmp_path / "plan.json")
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a process group was initialised")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    assert main(["run", MODEL, "--plan", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshplan: error:"), err
    assert "2 host(s) x 2 devices" in err[0] and "1 node(s) x 4 processes" in err[0]
    assert "--nnodes 2 --nproc-per-node 2" in err[0]


@pytest.fixture
def store_env() -> tuple[dist.TCPStore, dict[str, str]]:
    """A store served here, and the environment torchrun would give rank 1 of 2 using it."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env | {"TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_join_returns_once_every_rank_came(
    store_env: tuple[dist.TCPStore, dict[str, str]],
) -> None:
    store, env = store_env
    store.add("meshplan/join/t/0/joined", 1)  # rank 0 came first, with the same digest
    store.set("meshplan/join/t/0/digest", "0 abc")
    join_peers(5.0, "abc", env)
    assert store.add("meshplan/join/t/0/joined", 0) == 2


def test_join_stops_at_once_on_a_reported_failure(
    store_env: tuple[dist.TCPStore, dict[str, str]],
) -> None:
    _, env = store_env
    tell_peers(MeshplanError("cannot read plan p.json"), env | {"RANK": "3"})
    t0 = time.monotonic()
    with pytest.raises(
        PeerFailed, match="rank 1 stops: rank 3: cannot read plan p.json"
    ):
        join_peers(30.0, "abc", env)
    assert time.monotonic() - t0 < 5


def test_join_gives_up_after_the_join_timeout(
    store_env: tuple[dist.TCPStore, dict[str, str]],
) -> None:
    _, env = store_env
    t0 = time.monotonic()
    with pytest.raises(MeshplanError, match="only 1 of 2 ranks joined within 0.5 s"):
        join_peers(0.5, "abc", env)
    assert 0.5 <= time.monotonic() - t0 < 5


def test_join_refuses_a_rank_given_another_plan(
    store_env: tuple[dist.TCPStore, dict[str, str]],
) -> None:
    store, env = store_env
    store.set("meshplan/join/t/0/digest", "0 abc")
    with pytest.raises(MeshplanError, match="rank 1 was given another plan .* rank 0"):
        join_peers(5.0, "xyz", env)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_a_store_nobody_serves_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that starts after the first host's launcher exited (taking torchrun's store with
    it) stops saying so, not with torch's connection traceback."""
    import runtime.torchrun as tr

    monkeypatch.setattr(tr, "STORE_TIMEOUT_S", 1.0)
    port = free_port()
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "true",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "2",
    }
    with pytest.raises(
        tr.PeerFailed, match=f"rank 2 lost torchrun's store at 127.0.0.1:{port}"
    ):
        tr.agent_store(env)
