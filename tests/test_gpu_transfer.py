"""`benchmarks.gpu_transfer`: a GPU's memory-bound efficiency fitted from its eager steps and the
kernels of the same chip with other memory; the H100 preset's constants are that fit's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_transfer import main, transfer
from cost_models.cluster import PRESETS

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# the H200's datasheet bandwidth over the H100's
H200 = (
    PRESETS["H200-141GB"].device.memory_bandwidth_bytes_per_s
    / PRESETS["H100-80GB"].device.memory_bandwidth_bytes_per_s
)


def _source(cases: list[tuple[str, float, float]], torch: str = "2.11") -> dict:
    """An H200 result recorded with --kernels: (model, reference step, its bandwidth-bound
    kernels split between memory and the optimizer)."""
    return {
        "planned_for": "1x1xH200-141GB",
        "torch": torch,
        "cases": [
            {
                "model": m,
                "reference_s": s,
                "runtime_s": 1.5 * s,
                "kernels": {
                    side: {
                        "by_kind": {
                            "products": s / 2,
                            "attention": s / 8,
                            "memory": 0.75 * b,
                            "optimizer": 0.25 * b,
                        }
                    }
                    for side in ("reference", "runtime")
                },
            }
            for m, s, b in cases
        ],
    }


def _target(steps: dict[str, float], torch: str = "2.11") -> dict:
    return {
        "planned_for": "1x1xH100-80GB",
        "torch": torch,
        "cases": [
            {"model": m, "reference_s": t, "runtime_s": 2 * t} for m, t in steps.items()
        ],
    }


def test_steps_made_with_one_k_give_that_k_and_its_efficiency_back() -> None:
    from cost_models.compute import memory_efficiency

    rows = [("a", 0.040, 0.010), ("b", 0.050, 0.020), ("c", 0.150, 0.030)]
    k = 1.6
    got = transfer(_target({m: s + (k - 1) * b for m, s, b in rows}), [_source(rows)])
    assert got["k"] == pytest.approx(k)
    assert got["bandwidth_ratio"] == pytest.approx(H200)
    assert got["memory_efficiency"] == pytest.approx(
        memory_efficiency("H200-141GB") * H200 / k
    )
    for c, (_, s, b) in zip(got["cases"], rows):
        assert c["k_without"] == pytest.approx(k) and c["left_out_s"] == pytest.approx(
            c["target_step_s"]
        )
        assert c["at_ratio_s"] == pytest.approx(s + (H200 - 1) * b)
        # the runtime's step carried over by the same k
        assert c["runtime_projected_s"] == pytest.approx(1.5 * s + (k - 1) * b)


def test_two_sources_are_averaged_and_a_left_out_model_is_priced_by_the_others() -> (
    None
):
    one = _source([("a", 0.040, 0.010), ("b", 0.050, 0.020)])
    two = _source([("a", 0.044, 0.014), ("b", 0.050, 0.020)])
    # a: mean step 0.042, bound 0.012; the target's steps fit k = 2 for a and k = 1.5 for b
    got = transfer(_target({"a": 0.042 + 0.012, "b": 0.050 + 0.010}), [one, two])
    a, b = got["cases"]
    assert (a["source_step_s"], a["bound_s"]) == pytest.approx((0.042, 0.012))
    assert a["k_without"] == pytest.approx(1.5) and b["k_without"] == pytest.approx(2.0)
    assert a["left_out_s"] == pytest.approx(0.042 + 0.5 * 0.012)
    assert 1.5 < got["k"] < 2.0


def test_the_h100_presets_constants_are_the_committed_fit() -> None:
    from cost_models.compute import DEVICE_MEMORY_EFFICIENCY, FUSED_ATTENTION_E

    got = main(
        [
            str(RESULTS / "gpu-H100-80GB.json"),
            "--source",
            str(RESULTS / "gpu-H200-141GB.json"),
            str(RESULTS / "gpu-H200-141GB-fit.json"),
        ]
    )
    assert DEVICE_MEMORY_EFFICIENCY["H100-80GB"] == pytest.approx(
        got["memory_efficiency"], abs=5e-5
    )
    assert FUSED_ATTENTION_E["H100-80GB"] == FUSED_ATTENTION_E["H200-141GB"]
    # each H100 step predicted by the others' fit within 5%
    for c in got["cases"]:
        assert abs(c["left_out_s"] / c["target_step_s"] - 1) < 0.05, c["model"]
    committed = json.loads((RESULTS / "transfer-H100-80GB.json").read_text())
    assert committed["memory_efficiency"] == pytest.approx(got["memory_efficiency"])


def test_inputs_that_cannot_be_compared_are_named(tmp_path: Path) -> None:
    rows = [("a", 0.040, 0.010)]
    with pytest.raises(SystemExit, match="different torch builds"):
        transfer(_target({"a": 0.05}, torch="2.12"), [_source(rows)])
    with pytest.raises(SystemExit, match=r"no source case .*\['b'\].*\['a'\]"):
        transfer(_target({"a": 0.05, "b": 0.06}), [_source(rows)])
    other = dict(_source(rows), planned_for="1x1xA100-80GB")
    with pytest.raises(SystemExit, match="several GPUs"):
        transfer(_target({"a": 0.05}), [_source(rows), other])
    unknown = dict(_target({"a": 0.05}), planned_for="1x1xH300")
    with pytest.raises(SystemExit, match="gpu_transfer: .*H300"):
        transfer(unknown, [_source(rows)])
    with pytest.raises(SystemExit, match="cannot read .*none.json"):
        main([str(tmp_path / "none.json"), "--source", str(tmp_path / "none.json")])
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SystemExit, match="is not a bench_gpu result"):
        main([str(tmp_path / "list.json"), "--source", str(tmp_path / "list.json")])


def test_the_report_shows_a_committed_fit(tmp_path: Path) -> None:
    from benchmarks.report import transfer_section

    rows = [("a", 0.040, 0.010), ("b", 0.050, 0.020)]
    for name, doc in (("t", _target({"a": 0.046, "b": 0.062})), ("s", _source(rows))):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    main(
        [
            str(tmp_path / "t.json"),
            "--source",
            str(tmp_path / "s.json"),
            "--json",
            str(tmp_path / "transfer-H100-80GB.json"),
        ]
    )
    text = "\n".join(transfer_section(tmp_path))
    assert (
        "## H100-80GB's memory-bound efficiency from the H200-141GB's kernels" in text
    )
    # a: 40 ms on the H200, 10 ms of it bandwidth-bound, 46 ms on the H100; k = 1.6 fits both
    assert "| a | 40.0 | 10.0 | 46.0 |" in text and "k = 1.6000" in text
