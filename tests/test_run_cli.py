"""`meshplan run`: train a plan on local ranks (or under torchrun), refuse bad plans before any
process starts, and fail fast naming the rank that died.

Real launches (2 gloo ranks each, ~10 s apiece on a 2-core machine): a 2-stage pipeline plan of a
small GPT trained for 2 steps (losses equal single-device training within 1e-5), the same under
`torchrun --standalone --nproc-per-node 2`, a run whose rank 1 is SIGKILLed at step 2 (non-zero
exit naming rank 1 within 60 s), and a run without --plan (planned for 2 processes from a stub
profile, then trained). The refusals (fingerprint, --nproc, dtype) start no process.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import single_device
import torch
from profiles import cpu_profile

import runtime.launch
import runtime.profiler
from cost_models.cluster import Cluster
from cost_models.profile import (
    CollectiveFit,
    DeviceProfile,
    save_profile,
)
from planner.plans.manual import manual_plan
from runtime.cli import ORDER, command_modules, main
from runtime.commands.run import Fault, launch_mode
from runtime.train import seeded_model_and_batches

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128"
OTHER = "gpt:hidden=64,layers=3,heads=4,seq=16,vocab=128"
BATCH = 4
STEPS = 2
LR = 0.1
REPO = Path(__file__).resolve().parents[1]


def _plan_file(
    tmp_path: Path,
    dtype: str = "float32",
    dp: int = 1,
    tp: int = 1,
    pp: int = 2,
    batch: int = BATCH,
) -> str:
    plan = manual_plan(
        SPEC,
        f"1x{dp * tp * pp}xA100-80GB",
        dp=dp,
        tp=tp,
        pp=pp,
        num_microbatches=pp,
        global_batch=batch,
        dtype=dtype,
    )
    path = tmp_path / f"plan-{dtype}-dp{dp}-tp{tp}-pp{pp}.json"
    plan.save(path)
    return str(path)


def _reference(steps: int = STEPS, seed: int = 0, batch: int = BATCH) -> list[float]:
    """Single-device SGD on the model and batches `meshplan run` uses."""
    model, batches = seeded_model_and_batches(SPEC, batch, steps, seed)
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )[0]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to start processes fail the test."""

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(runtime.launch, "launch", refuse)
    monkeypatch.setattr(runtime.profiler, "run_profile", refuse)


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshplan: error:"), err
    return err[0]


def test_commands_are_found_through_entry_points_in_order() -> None:
    found = [(ep.name, ep.value) for ep in command_modules()]
    assert ("run", "runtime.commands.run") in found
    assert ("bench", "benchmarks.commands") in found
    assert [name for name, _ in found][: len(ORDER)] == list(ORDER)


def test_launch_mode_selects_torchrun_from_the_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert launch_mode(env) == "torchrun"
    assert launch_mode({}) == "spawn"
    assert launch_mode({k: v for k, v in env.items() if k != "MASTER_ADDR"}) == "spawn"


def test_fault_option_parses() -> None:
    assert Fault.parse("1:2") == Fault(1, 2, "kill")
    assert Fault.parse("0:3:raise") == Fault(0, 3, "raise")


@pytest.mark.slow
def test_run_matches_single_device(tmp_path: Path) -> None:
    """`meshplan run` as a user starts it: one device's losses, and nothing on stderr but its
    own lines (no warning of semaphores the ranks left to the resource tracker, no DTensor
    advice to flatten the dp x tp mesh its loss is reduced over: `runtime.meshes`)."""
    out = tmp_path / "run.json"
    # at global batch 8 the loss is Partial on both mesh axes, which made DTensor print its
    # advice; at batch 4 it printed none
    plan = _plan_file(tmp_path, dp=2, tp=2, pp=1, batch=8)
    argv = ["run", SPEC, "--plan", plan, "--steps", str(STEPS), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.cli", *argv, "--lr", str(LR)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert "[rank" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["step_times_s"]) == STEPS
    assert all(t > 0 for t in result["step_times_s"])
    assert result["losses"] == pytest.approx(_reference(batch=8), rel=1e-5, abs=1e-5)


def test_fingerprint_mismatch_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    assert main(["run", OTHER, "--plan", _plan_file(tmp_path)]) == 2
    assert "fingerprint" in _one_line_error(capsys)


def test_bad_nproc_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    assert main(["run", SPEC, "--plan", _plan_file(tmp_path), "--nproc", "3"]) == 2
    line = _one_line_error(capsys)
    assert "--nproc 3" in line and "2 devices" in line
    assert main(["run", SPEC, "--plan", _plan_file(tmp_path), "--nproc", "0"]) == 2
    _one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal")
def test_half_precision_plan_refused_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    assert main(["run", SPEC, "--plan", _plan_file(tmp_path, "float16")]) == 2
    assert "float32" in _one_line_error(capsys)


@pytest.mark.slow
def test_killed_rank_fails_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    code = main(
        ["run", SPEC, "--plan", _plan_file(tmp_path), "--steps", "3"]
        + ["--fault", "1:2:kill", "--timeout", "600"]
    )
    elapsed = time.monotonic() - t0
    assert code != 0
    assert elapsed < 200  # far below the 600 s deadline
    err = capsys.readouterr().err
    assert "rank 1 of 2 was killed by signal SIGKILL" in err


@pytest.mark.slow
def test_hung_run_stops_and_shows_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank that hangs: the run stops at --timeout, and the error shows every rank's stack,
    the hung one's in the fault's sleep, the other's in the collective it waits in."""
    code = main(
        ["run", SPEC, "--plan", _plan_file(tmp_path), "--steps", "3"]
        + ["--fault", "1:1:hang", "--timeout", "30"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "timed out after 30 s; ranks still running: [0, 1]" in err
    stacks = err.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in trigger" not in stacks[0] and "in step" in stacks[0], stacks[0]
    assert "in trigger" in stacks[1], stacks[1]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
@pytest.mark.slow
def test_torchrun_runs_one_rank_per_process(tmp_path: Path) -> None:
    out = tmp_path / "torchrun.json"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "runtime.cli"]
    cmd += ["run", SPEC, "--plan", _plan_file(tmp_path), "--steps", str(STEPS)]
    cmd += ["--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    # the ranks' own output precedes torchrun's summary of the failure
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:6000]
    assert "running" not in proc.stderr  # joined torchrun's group, spawned nothing
    assert json.loads(out.read_text())["losses"] == pytest.approx(
        _reference(), rel=1e-5, abs=1e-5
    )


def _stub_profile() -> DeviceProfile:
    return cpu_profile(
        peak_flops={"float32": 1e10},
        collectives=[
            CollectiveFit("all_reduce", 2, 1e-4, 1e-9, [(65536, 1.6e-4)]),
            CollectiveFit("send_recv", 2, 5e-5, 5e-10, [(65536, 8e-5)]),
        ],
    )


@pytest.mark.slow
def test_run_without_plan_profiles_plans_and_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def quick(opts: runtime.profiler.ProfileOptions) -> DeviceProfile:
        calls.append(opts.nproc)
        return _stub_profile()

    monkeypatch.setattr(runtime.profiler, "run_profile", quick)
    out, saved = tmp_path / "auto.json", tmp_path / "plan.json"
    argv = ["run", SPEC, "--nproc", "2", "--batch", str(BATCH), "--steps", "2"]
    argv += ["--json", str(out), "--save-plan", str(saved)]
    assert main(argv) == 0
    assert calls == [2]
    assert "plan for" in capsys.readouterr().out
    assert saved.exists()
    assert json.loads(out.read_text())["losses"] == pytest.approx(
        _reference(), rel=1e-5, abs=1e-5
    )


def test_plan_command_cluster_is_the_profiles() -> None:
    """`run` without --plan plans with `meshplan plan --cluster 1xNxCPU --profile FILE`: the
    cluster of the profile on N local processes, whatever device the profile measured."""
    gpu = dataclasses.replace(
        _stub_profile(), backend="nccl", device_name="NVIDIA H100"
    )
    for profile in (_stub_profile(), gpu):
        assert Cluster.from_spec("1x2xCPU", profile=profile) == Cluster.from_profile(
            profile, hosts=1, devices_per_host=2
        )


@pytest.mark.slow
def test_planning_error_comes_back_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    profile = tmp_path / "profile.json"
    save_profile(_stub_profile(), profile)
    argv = ["run", "no-such-model", "--nproc", "2", "--profile", str(profile)]
    assert main(argv) == 2
    assert "no-such-model" in _one_line_error(capsys)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_numbers_in_cli_tables_never_print_an_exponent() -> None:
    from planner.commands.fmt import nbytes, si

    assert si(1.3e9, "FLOP") == "1.3 GFLOP"
    assert si(999.7e3, "B/s") == "1 MB/s"  # not "1e+03 KB/s"
    assert nbytes(1000 * 1024) == "0.977 MiB"  # not "1e+03 KiB"
    assert nbytes(944 * 1024) == "944 KiB"
    assert nbytes(1023) == "0.999 KiB"  # not "1.02e+03 B"


def test_plan_summary_counts_parameters_and_micro_batches_as_people_write_them() -> (
    None
):
    from planner.commands.fmt import param_count
    from planner.commands.plan import summary
    from planner.plans.manual import manual_plan

    assert [param_count(n) for n in (70.55e9, 124.4e6, 14336, 512)] == [
        "70.55 B",
        "124.4 M",
        "14.3 K",
        "512",
    ]
    p = manual_plan(
        "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128",
        "1x2xA100-80GB",
        dp=2,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=8,
        dtype="float32",
    )
    head = summary(p).splitlines()[0]
    assert f"({param_count(p.model['params'])} params)" in head, head
    assert "1 micro-batch," in head, head
