"""Benchmark suites (small cases only; `meshplan bench --suite SUITE` runs them all): the case
records' JSON fields, the manual grid (expert parallelism for MoE, memory pruning), and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.manual_grid import grid, model_facts, parallel_degrees
from benchmarks.records import (
    RESULTS,
    load_results,
    merge_results,
    record_differences,
    write_results,
)
from benchmarks.report import write_report
from benchmarks.suites import run_case, suite_cases
from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.plans.manual import manual_plan


def test_suite_cases_follow_the_reference() -> None:
    gpt = {c.num_devices: c for c in suite_cases("gpt")}
    assert sorted(gpt) == [1, 2, 4, 8, 16, 32, 64]
    assert gpt[1].model == "gpt-350m" and gpt[1].global_batch == 128
    assert gpt[64].cluster == "8x8xV100-16GB" and gpt[64].model == "gpt-39b"
    wres = {c.num_devices: c for c in suite_cases("wresnet", device="A100-80GB")}
    assert wres[32].global_batch == 1520 and wres[16].global_batch == 1536
    assert wres[2].cluster == "1x2xA100-80GB" and wres[2].dtype == "float32"
    assert suite_cases("moe", [16])[0].model == "moe-10b"


def test_parallel_degrees_keep_tp_in_a_host() -> None:
    degrees = parallel_degrees(16, 8, max_pp=24)
    assert all(dp * tp * pp == 16 and tp in (1, 2, 4, 8) for dp, tp, pp in degrees)
    assert (2, 8, 1) in degrees and (1, 1, 16) in degrees
    assert all(tp == 1 for _, tp, _ in parallel_degrees(8, 8, 8, tensor_parallel=False))


def test_grid_prunes_by_memory_and_adds_expert_parallel() -> None:
    groups, pruned = grid(
        "gpt-39b", Cluster.from_spec("8x8xV100-16GB"), 1024, "adam_mixed", "gpt"
    )
    # 39 B parameters x 16 bytes need tp * pp >= 39 devices of 16 GB; pp <= 48 blocks.
    assert {(g[0].dp, g[0].tp, g[0].pp) for g in groups} == {
        (1, 2, 32),
        (1, 4, 16),
        (1, 8, 8),
    }
    assert pruned > 0
    groups, _ = grid(
        "moe-690m", Cluster.from_spec("1x2xV100-16GB"), 1024, "adam_mixed", "moe"
    )
    assert any(g[0].expert_parallel and g[0].dp == 2 for g in groups)
    assert model_facts("moe-690m").experts == 16


def test_expert_parallel_shards_expert_weights_on_dp() -> None:
    p = manual_plan(
        "moe-tiny",
        "1x2xV100-16GB",
        dp=2,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=4,
        expert_parallel=True,
        allow_oom=True,
    )
    placements = p.stages[0].param_placements
    wi = [v for k, v in placements.items() if k.endswith("mlp.wi")]
    assert wi and all(v == ["S(0)", "R"] for v in wi)
    assert all(
        v[0] == "R"
        for k, v in placements.items()
        if not k.endswith(("mlp.wi", "mlp.wo"))
    )
    assert p.manual["expert_parallel"]


@pytest.mark.parametrize("suite,gpus", [("gpt", 1), ("moe", 1), ("wresnet", 1)])
@pytest.mark.slow
def test_case_record(suite: str, gpus: int) -> None:
    case = run_case(suite_cases(suite, [gpus])[0])
    json.dumps(case)  # plain JSON
    assert case["suite"] == suite and case["num_devices"] == gpus
    auto = case["auto"]
    for key in ("iteration_time_s", "tflops_per_device", "planner_time_s"):
        assert auto[key] > 0
    assert auto["fits"] and auto["stages"]
    assert {"layers", "submesh", "logical_mesh", "dp_tp"} <= set(auto["stages"][0])
    best = case["manual_best"]
    assert {"dp", "tp", "pp", "num_microbatches", "recompute"} <= set(best["config"])
    assert case["ratio"] == pytest.approx(
        best["iteration_time_s"] / auto["iteration_time_s"]
    )
    assert case["ratio"] > 0
    bound = case["ceiling"]  # no plan beats the bound: the ratio is at most its max
    assert 0 < bound["iteration_time_s"] <= auto["iteration_time_s"]
    assert case["ratio"] <= bound["max_ratio"] * (1 + 1e-9)
    if (
        suite == "gpt"
    ):  # on one device the automatic plan is pure data parallel, as good as manual
        assert case["ratio"] >= 1.0 - 1e-6
    assert case["measured_tflops_per_device"]
    # The committed record of the same case (V100s, as these run): re-planned, the plans and the
    # prices are unchanged (planning times aside).
    committed = json.loads((RESULTS / f"{suite}-V100-16GB.json").read_text())
    old = next(c for c in committed["cases"] if c["num_devices"] == gpus)
    assert record_differences(case, old) == []
    if suite == "gpt" and gpus == 1:
        listed = case["megatron_listed"]
        assert listed["config"] == {"dp": 1, "tp": 1, "pp": 1, "microbatches": 8}
        assert listed["measured_tflops_per_device"] == 47.5
        assert listed["relative_error"] == pytest.approx(
            listed["predicted_tflops_per_device"] / 47.5 - 1
        )


def test_record_differences_names_what_changed() -> None:
    old = {
        "auto": {"iteration_time_s": 2.0, "stages": [1], "planner_time_s": 9.0},
        "manual_best": {"config": {"dp": 2}, "iteration_time_s": 3.0},
    }
    same = {
        "auto": {
            "iteration_time_s": 2.0 * (1 + 1e-12),
            "stages": [1],
            "planner_time_s": 1,
        },
        "manual_best": {"config": {"dp": 2}, "iteration_time_s": 3.0},
    }
    assert record_differences(same, old) == []
    moved = {
        "auto": same["auto"] | {"stages": [2]},
        "manual_best": {"config": {"dp": 2}},
    }
    assert record_differences(moved, old) == [
        "auto.stages: [1] -> [2]",
        "manual_best.iteration_time_s: 3.0 -> None",
    ]


def test_a_case_that_does_not_fit_is_recorded(tmp_path) -> None:
    """gpt-39b's Adam state alone (16 bytes per parameter) is 7x one A100's memory: no plan, no
    manual configuration; the record says so and the report and the console row render it."""
    from benchmarks.suites import Case, format_row

    case = run_case(Case("moe", "gpt-39b", 1, "1x1xA100-80GB", 8))
    json.dumps(case)
    auto = case["auto"]
    assert (
        not auto["fits"] and auto["stages"] == [] and auto["tflops_per_device"] is None
    )
    assert "does not fit on 1x1xA100-80GB" in auto["error"]
    assert case["manual_best"]["config"] is None and case["ratio"] is None
    assert "none fits" in format_row(case) and format_row(case).endswith("does not fit")
    doc = {"suite": "moe", "device": "A100-80GB", "date": "d", "cases": [case]}
    write_results(doc, tmp_path / "moe-A100-80GB.json")
    text = write_report(tmp_path).read_text()
    assert "| 1 | gpt-39b | - | does not fit |" in text


def test_report_from_a_tiny_results_file(tmp_path) -> None:
    case = {
        "suite": "gpt",
        "model": "gpt-350m",
        "num_devices": 1,
        "cluster": "1x1xV100-16GB",
        "global_batch": 128,
        "auto": {
            "iteration_time_s": 4.0,
            "tflops_per_device": 70.0,
            "planner_time_s": 3.0,
            "num_microbatches": 16,
            "stages": [{"layers": [0, 11], "logical_mesh": [1, 1], "recompute": False}],
        },
        "manual_best": {
            "label": "dp1 tp1 pp1 B16",
            "iteration_time_s": 5.0,
            "tflops_per_device": 56.0,
            "config": {},
        },
        "ratio": 1.25,
        "measured_tflops_per_device": {"Alpa (auto)": 45.1, "Megatron-LM": 47.5},
        "megatron_listed": {
            "config": {"dp": 1, "tp": 1, "pp": 1, "microbatches": 8},
            "predicted_tflops_per_device": 56.6,
            "measured_tflops_per_device": 47.5,
            "relative_error": 0.19,
            "fits": False,
        },
    }
    doc = {
        "suite": "gpt",
        "device": "V100-16GB",
        "machine": "test",
        "date": "2026-01-01",
        "cases": [case],
        "reruns": [{"date": "2026-02-02", "torch": "2.x", "total_time_s": 7.0}],
    }
    doc["reruns"][0]["num_devices"] = [1]
    write_results(doc, tmp_path / "gpt-V100-16GB.json")
    (tmp_path / "other.json").write_text("[1, 2]")  # not results files: ignored
    (tmp_path / "cases.json").write_text('{"cases": []}')
    assert len(load_results(tmp_path)) == 1
    text = write_report(tmp_path).read_text()
    assert "## gpt on V100-16GB" in text and "2026-01-01" in text
    assert "Re-run on 2026-02-02 (torch 2.x, 7 s): 1 GPUs." in text
    assert "| 1 | gpt-350m | 70.0 |" in text and "1.25" in text and "+19%" in text
    assert "(a) every GPT case on V100-16GB has ratio >= 1.00: yes" in text
    assert "Measured on one GPU" not in text
    # every device's suite is checked, not only the V100 one
    slow = {**case, "num_devices": 4, "ratio": 0.99}
    write_results({**doc, "device": "A100-80GB", "cases": [slow]}, tmp_path / "a.json")
    text = write_report(tmp_path).read_text()
    assert "(a) every GPT case on A100-80GB has ratio >= 1.00: no: 4 GPUs 0.99" in text
    assert "within 15% of measured: no (largest error 19%)" in text
    if (tmp_path / "gpt-V100-16GB.png").exists():
        assert "(gpt-V100-16GB.png)" in text


def test_report_names_the_cases_no_plan_can_win(tmp_path) -> None:
    """(b) names the cases whose max ratio (`benchmarks.ceiling`) is below 1.3, and the table
    shows the bound."""
    base = {
        "suite": "moe",
        "model": "moe-10b",
        "cluster": "2x8xA100-80GB",
        "global_batch": 1024,
        "auto": {
            "iteration_time_s": 1.0,
            "tflops_per_device": 170.0,
            "planner_time_s": 3.0,
            "num_microbatches": 8,
            "stages": [{"layers": [0, 7], "logical_mesh": [2, 8], "recompute": False}],
        },
        "manual_best": {"label": "dp16 tp1 pp1 B8", "iteration_time_s": 1.1},
        "ratio": 1.1,
    }
    capped = base | {
        "num_devices": 16,
        "ceiling": {
            "iteration_time_s": 0.9,
            "tflops_per_device": 195.0,
            "max_ratio": 1.22,
        },
    }
    room = base | {
        "num_devices": 32,
        "ceiling": {
            "iteration_time_s": 0.5,
            "tflops_per_device": 340.0,
            "max_ratio": 2.2,
        },
    }
    doc = {"suite": "moe", "device": "A100-80GB", "cases": [capped, room]}
    write_results(doc, tmp_path / "moe-A100-80GB.json")
    text = write_report(tmp_path).read_text()
    assert (
        "(b) moe on A100-80GB at >= 16 GPUs has ratio >= 1.3: no: 16 GPUs 1.10, 32 GPUs "
        "1.10; no plan can reach 1.3 at 16 GPUs (max 1.22)\n" in text
    )
    assert "| 1.10 | 195.0 | 1.22 |" in text and "| 1.10 | 340.0 | 2.20 |" in text


def test_report_shows_one_gpu_measurements(tmp_path) -> None:
    c = {"model": "gpt:hidden=64", "global_batch": 8, "num_microbatches": 1}
    c |= {"predicted_s": 0.03, "runtime_s": 0.04, "reference_s": 0.032}
    c |= {"prediction_error": -0.25, "runtime_over_reference": 1.25}
    doc = {"gpu": "NVIDIA H100", "torch": "2.11", "date": "2026-11-22", "cases": [c]}
    doc["planned_for"] = "1x1xH100-80GB"
    (tmp_path / "gpu-H100-80GB.json").write_text(json.dumps(doc))
    text = write_report(tmp_path).read_text()
    assert "## Measured on one GPU: NVIDIA H100" in text
    assert (
        "| gpt:hidden=64 | 8 | 1 | 30.0 | 40.0 | 32.0 | -25% | 1.25 | - | - | - |"
        in text
    )
    # with the kernels' busy time, the memory record and the profile-priced time
    c["kernels"] = {"runtime": {"busy_s": 0.035}}
    c["memory"] = {"predicted_bytes": 3 * 2**30, "measured_bytes": 2.5 * 2**30}
    c |= {"predicted_profile_s": 0.036, "profile_error": -0.1}
    (tmp_path / "gpu-H100-80GB.json").write_text(json.dumps(doc))
    text = write_report(tmp_path).read_text()
    row = "| 1.25 | 35.0 | 3.00 / 2.50 (+20%) | 36.0 (-10%) |"
    assert row in text


def test_merge_replaces_rerun_cases_and_keeps_the_others(tmp_path) -> None:
    def case(n: int, ratio: float) -> dict:
        return {"num_devices": n, "ratio": ratio}

    old = {"suite": "moe", "device": "H100-80GB", "date": "d0", "total_time_s": 9.0}
    old["cases"] = [case(1, 1.0), case(2, 1.1), case(16, 0.97)]
    new = {"suite": "moe", "device": "H100-80GB", "date": "d1", "torch": "t"}
    new |= {"machine": "m", "total_time_s": 5.0, "cases": [case(16, 1.01)]}
    merged = merge_results(old, new)
    assert merged["cases"] == [case(1, 1.0), case(2, 1.1), case(16, 1.01)]
    assert merged["date"] == "d0" and merged["total_time_s"] == 9.0
    assert merged["reruns"] == [
        {
            "date": "d1",
            "machine": "m",
            "torch": "t",
            "total_time_s": 5.0,
            "num_devices": [16],
        }
    ]
    with pytest.raises(
        MeshplanError, match="cannot merge moe on H100-80GB into .* gpt on"
    ):
        merge_results({**old, "suite": "gpt"}, new)
    # in the suite's order (the llama suite's is not by GPU count)
    old["cases"] = [
        {"model": m, "num_devices": n} for m, n in (("a", 8), ("b", 64), ("c", 8))
    ]
    new["cases"] = [{"model": m, "num_devices": 8, "ratio": 1.0} for m in ("a", "c")]
    order = [("a", 8), ("b", 64), ("c", 8)]
    merged = merge_results(old, new, order)
    assert [(c["model"], c.get("ratio")) for c in merged["cases"]] == [
        ("a", 1.0),
        ("b", None),
        ("c", 1.0),
    ]


@pytest.mark.slow
def test_best_manual_skips_the_plans_it_is_told_to() -> None:
    """Ground truth: every configuration of the grid priced alone; skipping the best one's plan
    gives the fastest feasible configuration among the rest."""
    from benchmarks.manual_grid import ManualConfig, best_manual, price

    model, spec, G = (
        "gpt:hidden=64,layers=2,heads=2,seq=32,vocab=128",
        "1x2xA100-80GB",
        8,
    )
    best = best_manual(model, spec, G, suite="gpt")
    groups, _ = grid(model, Cluster.from_spec(spec), G, "adam_mixed", "gpt")
    times = {
        c: price(model, Cluster.from_spec(spec), c, G, "float16", "adam_mixed")
        for group in groups
        for c in group
        if not c.recompute
    }
    top = ManualConfig(**best["config"])
    assert best["iteration_time_s"] == min(
        p.estimate.iteration_time_s for p in times.values()
    )
    other = best_manual(
        model, spec, G, suite="gpt", skip=lambda p: p.manual == times[top].manual
    )
    rest = min(p.estimate.iteration_time_s for c, p in times.items() if c != top)
    assert other["config"] != best["config"] and other["iteration_time_s"] == rest
    assert (
        best_manual(model, spec, G, suite="gpt", skip=lambda p: True)["config"] is None
    )


@pytest.mark.slow
def test_best_manual_in_processes_is_the_serial_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grid's layouts walked in two forked processes give what one process gives: the
    best, the counts and the context-parallel record (today's grid on 4 devices: 40 of its
    120 layouts priced, 12 of them context-parallel; on 8, with dp x cp x tp, a walk took
    35 s against 11 s)."""
    from benchmarks.manual_grid import best_manual

    spec = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
    got = {}
    for n in ("1", "2"):
        monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", n)
        got[n] = best_manual(spec, "1x4xH100-80GB", 8, suite="llama", dtype="bfloat16")
        del got[n]["search_time_s"]
    assert got["1"] == got["2"]
    assert got["1"]["context_parallel"]["priced"] > 0


def test_bench_refuses_unknown_gpu_count_before_printing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from runtime.cli import main

    assert main(["bench", "--suite", "gpt", "--gpus", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no table header before the refusal
    assert "gpt: no case for [3] GPUs" in err


def test_bench_without_the_reference_says_where_it_looked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A checkout without ../shared beside it: the suites' sizes cannot be read, and the bench
    says which file it missed instead of a traceback."""
    from benchmarks import reference
    from runtime.cli import main

    missing = tmp_path / "alpa-osdi22-suite.md"
    monkeypatch.setattr(reference, "REFERENCE", missing)
    reference._text.cache_clear()
    reference._tables.cache_clear()
    try:
        assert main(["bench", "--suite", "gpt", "--gpus", "1"]) == 2
    finally:
        reference._text.cache_clear()
        reference._tables.cache_clear()
    err = capsys.readouterr().err
    assert f"cannot read the reference suite {missing}" in err
    assert "../shared/reference" in err and "Traceback" not in err
