"""benchmarks.published: the rows it prices, its leave-one-out fit, and the committed fit's figures.

The whole benchmark prices 13 large models (minutes); these tests check its pieces and the
committed results file instead, in about a second."""

from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks import published
from benchmarks.published import (
    E_PROBES,
    FIT_DEVICE,
    MODES,
    alpa_rows,
    fit_u,
    korthikanti_rows,
    leave_one_out,
    tensor_core_e_max,
)
from cost_models import compute
from cost_models.errors import MeshplanError

COMMITTED = published.RESULTS / "published.json"


def test_rows_are_the_references_configurations() -> None:
    rows = korthikanti_rows()
    assert [r.name for r in rows if r.mode == "full"] == ["22B", "175B", "530B", "1T"]
    assert {r.mode for r in rows} == {"full", "selective"}
    for r in rows:
        hosts, per_host, device = r.cluster.split("x", 2)
        assert device == "A100-80GB" and int(hosts) * int(per_host) == r.tp * r.pp
        assert "attn=explicit" in r.model and r.dp == 1
    full = {r.name: r for r in rows if r.mode == "full"}
    sel = {r.name: r for r in rows if r.mode == "selective"}
    assert all(
        sel[n].measured_s < full[n].measured_s for n in full
    )  # selective is faster
    assert full["175B"].virtual_stages == 3 and full["1T"].num_microbatches == 512
    alpa = alpa_rows()
    assert [r.cluster.split("x", 2)[2] for r in alpa] == ["V100-16GB"] * 5
    for r in alpa:
        hosts, per_host, _ = r.cluster.split("x", 2)
        assert int(hosts) * int(per_host) == r.dp * r.tp * r.pp
        assert r.measured_s > 0


def _points(u: float, n: int, seed: int) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.uniform(0.1, 5.0), rng.uniform(1.0, 50.0)
        out.append((a, b, (a + b * u) * rng.uniform(0.97, 1.03)))
    return out


def test_fit_recovers_a_consistent_parameter() -> None:
    u = 1 / 0.73
    exact = [(a, b, a + b * u) for a, b, _ in _points(u, 5, 0)]
    assert fit_u(exact) == pytest.approx(u, rel=1e-12)
    # the fit minimises the squared relative error: any other u does worse
    noisy = _points(u, 5, 1)

    def loss(x: float) -> float:
        return sum(((a + b * x) / m - 1) ** 2 for a, b, m in noisy)

    best = fit_u(noisy)
    assert loss(best) < loss(best * 1.001) and loss(best) < loss(best * 0.999)
    with pytest.raises(MeshplanError, match="nothing to fit"):
        fit_u([(1.0, 0.0, 1.0)])


def test_leave_one_out_keeps_the_held_out_row_out_of_its_fit() -> None:
    points = _points(1 / 0.75, 4, 2)
    loo = leave_one_out(points)
    for i in range(len(points)):
        a, b, m = points[i]
        moved = list(points)
        moved[i] = (a, b, m * 3.0)  # the held-out measurement changes ...
        assert leave_one_out(moved)[i] == loo[i]  # ... its own prediction does not
        other = (i + 1) % len(points)
        assert leave_one_out(moved)[other] != loo[other]  # it is in the others' fits
        assert loo[i] == fit_u(points[:i] + points[i + 1 :])
    with pytest.raises(MeshplanError, match="at least two"):
        leave_one_out(points[:1])


def test_e_max_override_is_scoped() -> None:
    before = dict(compute.TENSOR_CORE_E_MAX)
    with tensor_core_e_max("A100-80GB", 0.5):
        assert compute.max_efficiency("float16", "A100-80GB") == 0.5
        assert (
            compute.max_efficiency("float16", "V100-16GB")
            == compute.TENSOR_CORE_CURVE[0]
        )
        assert compute.max_efficiency("float32", "A100-80GB") == compute.FP32_CURVE[0]
    assert compute.TENSOR_CORE_E_MAX == before


@pytest.mark.skipif(not COMMITTED.exists(), reason="no committed published.json")
def test_committed_fit_reproduces_its_own_figures() -> None:
    """The committed results: the fit re-run on its own rows' lines gives the committed E_max
    (and the preset carries it), each fitted row's prediction is its line at the E_max fitted
    without it, the whole fit's line agrees with pricing at the fitted E_max (the line is the
    price, not an approximation of it), and the summary is the rows'."""
    doc = json.loads(COMMITTED.read_text())
    fitted = [r for r in doc["rows"] if r["fitted_on_it"]]
    assert [r["name"] for r in fitted] == doc["fit"]["rows"]
    assert doc["fit"]["e_probes"] == list(E_PROBES)
    points = [(r["line_a_s"], r["line_b_s"], r["measured_s"]) for r in fitted]
    u_all = fit_u(points)
    assert 1 / u_all == pytest.approx(doc["fit"]["e_max"], rel=1e-12)
    assert compute.TENSOR_CORE_E_MAX[FIT_DEVICE] == pytest.approx(
        doc["fit"]["e_max"], abs=5e-4
    )
    for r, u in zip(fitted, leave_one_out(points)):
        assert r["device" if "device" in r else "cluster"].endswith(FIT_DEVICE)
        assert r["loo_e_max"] == pytest.approx(1 / u, rel=1e-12)
        assert r["predicted_s"] == pytest.approx(
            r["line_a_s"] + r["line_b_s"] * u, rel=1e-12
        )
        assert r["fit_all_priced_s"] == pytest.approx(
            r["fit_all_predicted_s"], rel=0.01
        )
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    for r in doc["rows"]:
        assert (r["predicted_s"] is None) == (r["mode"] not in MODES)
    errs = [abs(r["error"]) for r in doc["rows"] if r["error"] is not None]
    assert doc["summary"]["all"]["mean_abs_error"] == pytest.approx(
        sum(errs) / len(errs)
    )
    assert doc["summary"]["all"]["max_abs_error"] == max(errs)
    assert not math.isnan(doc["summary"]["all"]["mean_abs_error"])


def test_report_includes_the_table(tmp_path) -> None:
    from benchmarks.report import report

    row = {
        "source": "korthikanti-full",
        "name": "22B",
        "cluster": "1x8xA100-80GB",
        "tp": 8,
        "pp": 1,
        "num_microbatches": 1,
        "virtual_stages": 1,
        "measured_s": 1.42,
        "mode": "full",
        "fitted_on_it": True,
        "loo_e_max": 0.75,
        "predicted_s": 1.5,
        "error": 1.5 / 1.42 - 1,
    }
    pending = row | {"mode": "selective", "fitted_on_it": False, "predicted_s": None}
    pending |= {"source": "korthikanti-selective", "error": None}
    doc = {
        "date": "d",
        "attn_dropout": 0.1,
        "fit": {"parameter": "p", "e_max": 0.75, "rows": ["22B"]},
        "rows": [row, pending],
        "summary": published.summary([row, pending]),
    }
    (tmp_path / "published.json").write_text(json.dumps(doc))
    text = report(tmp_path)
    assert "## Published measured runs, predicted against measured" in text
    assert "| 1.42 | 1.50 | +5.6% | 0.750 (LOO) |" in text
    assert "| not priced yet |" in text
    assert "all: 1 rows, mean |predicted/measured - 1| 5.6%" in text
