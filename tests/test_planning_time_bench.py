"""benchmarks.planning_time: the slowest committed case of a suite is found from the results
files, and a case is planned in a fresh CLI process with its dtype and optimizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import planning_time as pt


def _record(model: str, seconds: float | None, **extra) -> dict:
    auto = {} if seconds is None else {"planner_time_s": seconds}
    return {
        "model": model,
        "cluster": "1x8xV100-16GB",
        "global_batch": 64,
        "auto": auto,
    } | extra


def test_slowest_case_reads_every_device(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "wresnet-V100-16GB.json").write_text(
        json.dumps(
            {"cases": [_record("wresnet-1b", 12.0), _record("wresnet-2b", None)]}
        )
    )
    (tmp_path / "wresnet-A100-80GB.json").write_text(
        json.dumps(
            {
                "cases": [
                    _record("wresnet-4b", 40.0, dtype="float32", optimizer="adam_fp32")
                ]
            }
        )
    )
    monkeypatch.setattr(pt, "RESULTS", tmp_path)
    case = pt.slowest_case("wresnet")
    assert (case.model, case.dtype, case.optimizer, case.target_s) == (
        "wresnet-4b",
        "float32",
        "adam_fp32",
        60.0,
    )
    with pytest.raises(RuntimeError, match="no committed results of the moe suite"):
        pt.slowest_case("moe")


def test_run_once_plans_in_a_fresh_process() -> None:
    run = pt.run_once(pt.Case("mlp", "1x2xV100-16GB", 8, None, "float32", "sgd"))
    assert run["iteration_time_s"] > 0 and run["wall_s"] >= run["planner_time_s"] > 0
    assert len(run["load_average_before"]) == 3
    assert run["python_speed_s"] > 0
