"""The noise-floor bounds of `benchmarks.local_noise`, against brute force (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.local_noise import floors, main


def _launch(predicted: float, measured: float) -> dict:
    return {
        "predicted_s": predicted,
        "measured_s": measured,
        "step_times_s": [measured] * 20,
    }


def test_floors_are_the_least_largest_error_of_any_scale_or_constant() -> None:
    """The calibrated floor is min over k of max_i |k predicted_i / measured_i - 1|, and the
    constant floor min over c of max_i |c / measured_i - 1|: both found by a fine grid."""
    rng = np.random.default_rng(0)
    grid = np.linspace(0.01, 0.4, 200_001)
    for _ in range(20):
        p = rng.uniform(0.05, 0.1, 5)
        m = rng.uniform(0.05, 0.15, 5)
        got = floors([_launch(a, b) for a, b in zip(p, m)])
        scaled = np.abs(np.outer(grid / 0.1, p / m) - 1).max(axis=1).min()
        constant = np.abs(np.outer(grid, 1 / m) - 1).max(axis=1).min()
        assert got["calibrated_floor"] == pytest.approx(scaled, abs=1e-5)
        assert got["constant_floor"] == pytest.approx(constant, abs=1e-5)


def test_block_spread_is_the_largest_block_median_over_the_smallest() -> None:
    steps = [1.0] * 5 + [2.0] * 5 + [1.5] * 5 + [1.2] * 5
    r = _launch(1.0, 1.35) | {"step_times_s": steps}
    assert floors([r, _launch(1.0, 1.0)])["block_spread_median"] == pytest.approx(1.5)


def test_unknown_case_and_one_launch_are_refused(capsys) -> None:
    for argv, says in (
        (["--procs", "3"], "no local-suite case gpt on 3"),
        (["--launches", "1"], "at least 2"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert says in capsys.readouterr().err


def test_report_line_reads_the_noise_file(tmp_path) -> None:
    import json

    from benchmarks.local_report import NOISE_FILE, noise_check

    assert noise_check(tmp_path) == []
    runs = [_launch(0.08, 0.1), _launch(0.08, 0.12)]
    for r in runs:
        r["date"] = "2026-11-30T06:00:00+0000"
    doc = {"case": {"model": "gpt:x", "num_devices": 4}, "plan": "dp4 tp1 pp1 B1"}
    doc |= {"steps": 20, "block": 5, "launches": runs, **floors(runs)}
    (tmp_path / NOISE_FILE).write_text(json.dumps(doc))
    (line,) = noise_check(tmp_path)
    assert "measured 100.0 to 120.0 ms, predicted 80.0 to 80.0 ms" in line
    q = (0.1 / 0.08, 0.12 / 0.08)  # measured / predicted
    calibrated, constant = (q[1] - q[0]) / sum(q), (0.12 - 0.1) / (0.12 + 0.1)
    assert (
        f"within {calibrated:.0%}, one fixed prediction not within {constant:.0%}"
        in line
    )
