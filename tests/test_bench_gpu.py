"""The parts of `benchmarks.bench_gpu` that need no GPU: the union of kernel intervals, the
kernel summary's record of matrix products by shape (on the CPU, no device kernels); and
`benchmarks.gpu_breakdown`: kernels sorted by kind, the measured kinds adding up to what was
recorded, the predicted kinds to the plan's iteration time."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_gpu import _busy_s, kernel_summary


def test_busy_time_is_the_union_of_the_intervals():
    # microseconds: [0, 10] and [5, 20] overlap, [30, 40] apart, [32, 35] inside it
    assert abs(_busy_s([(30, 40), (0, 10), (5, 20), (32, 35)]) - 30e-6) < 1e-12
    assert _busy_s([]) == 0.0


def test_kernel_summary_records_each_product_by_shape():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    bias = torch.zeros(16)

    def step() -> None:
        for _ in range(3):
            a @ b
        torch.addmm(bias, a, b)

    s = kernel_summary(step)
    products = {(p["op"], str(p["shapes"])): p["count"] for p in s["products"]}
    assert products[("aten::mm", str([[64, 32], [32, 16]]))] == 3
    assert products[("aten::addmm", str([[16], [64, 32], [32, 16], [], []]))] == 1
    assert s["wall_s"] > 0
    if not torch.cuda.is_available():
        assert s["kernels"] == 0 and s["busy_s"] == 0.0 and s["by_name"] == []


def test_kernels_are_sorted_into_the_kinds_the_breakdown_prices():
    from benchmarks.gpu_breakdown import kernel_kind

    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "products"
    assert kernel_kind("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "products"
    assert kernel_kind("void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<...>") == (
        "attention"
    )
    assert kernel_kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert kernel_kind(
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>"
    ) == ("optimizer")
    assert kernel_kind(
        "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>"
    ) == ("memory")


def test_measured_kinds_add_up_to_the_kernels_and_the_host_gap():
    from benchmarks.gpu_breakdown import measured

    case = {
        "runtime_s": 0.010,
        "kernels": {
            "runtime": {
                "busy_s": 0.008,
                "kernel_s": 0.008,
                "by_name": [
                    {"name": "nvjet_a", "count": 3, "s": 0.004},
                    {"name": "flash_fwd", "count": 1, "s": 0.001},
                    {"name": "multi_tensor_apply_kernel", "count": 1, "s": 0.0005},
                    {"name": "gelu", "count": 2, "s": 0.002},
                ],
            }
        },
    }
    got = measured(case)
    want = {
        "products": 0.004,
        "attention": 0.001,
        "optimizer": 0.0005,
        "memory": 0.0025,  # gelu, and the 0.5 ms the top kernels leave out
        "host": 0.002,
    }
    assert got == pytest.approx(want)
    case["kernels"]["runtime"]["by_kind"] = dict.fromkeys(
        ("products", "attention", "memory", "optimizer"), 0.002
    )
    assert measured(case)["memory"] == pytest.approx(0.002)


def test_predicted_kinds_add_up_to_the_plans_iteration_time():
    from benchmarks.gpu_breakdown import predicted
    from cost_models.cluster import Cluster
    from cost_models.compute import optimizer_step_time
    from planner.plans.manual import manual_plan

    spec = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128"
    case = {"model": spec, "global_batch": 4, "num_microbatches": 2}
    got = predicted(case, "1x1xH200-141GB")
    plan = manual_plan(
        spec,
        "1x1xH200-141GB",
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=2,
        global_batch=4,
        dtype=torch.bfloat16,
        optimizer="adam_16bit",
    )
    assert min(got["products"], got["attention"], got["memory"]) > 0
    assert got["host"] == 0.0
    # the optimizer's step is in the estimate too, once per step however many micro-batches
    kinds = got["products"] + got["attention"] + got["memory"] + got["optimizer"]
    assert kinds == pytest.approx(plan.estimate.iteration_time_s, rel=1e-9)
    assert got["optimizer"] == pytest.approx(
        optimizer_step_time(
            Cluster.from_spec("1x1xH200-141GB"), plan.model["params"], "adam_16bit"
        )
    )


def _row(model: str, scale_memory: float, scale_attention: float) -> dict:
    predicted = {
        "products": 0.010,
        "attention": 0.002,
        "memory": 0.003,
        "optimizer": 0.001,
        "host": 0.0,
    }
    measured = dict(predicted, host=0.001)
    measured["memory"] *= scale_memory
    measured["optimizer"] *= scale_memory
    measured["attention"] *= scale_attention
    return {"model": model, "predicted": predicted, "measured": measured}


def test_the_fit_scales_each_efficiency_by_predicted_over_measured():
    from benchmarks.gpu_breakdown import fit, leave_one_out
    from cost_models.compute import FUSED_ATTENTION_E, memory_efficiency

    dev = "H200-141GB"
    mem, att = memory_efficiency(dev), FUSED_ATTENTION_E[dev]
    same = [_row("a", 1.0, 1.0), _row("b", 1.0, 1.0)]
    assert fit(same, dev) == pytest.approx(
        {"memory_efficiency": mem, "fused_attention_e": att}
    )
    slower = [_row("a", 2.0, 4.0), _row("b", 2.0, 4.0)]
    assert fit(slower, dev) == pytest.approx(
        {"memory_efficiency": mem / 2, "fused_attention_e": att / 4}
    )
    # leave-one-out: row a re-priced with what b and c fit
    mixed = [_row("a", 2.0, 1.0), _row("b", 2.0, 1.0), _row("c", 1.0, 1.0)]
    loo = {r["model"]: r for r in leave_one_out(mixed, dev)}
    a = loo["a"]
    assert a["memory_efficiency"] == pytest.approx(mem * 4 / 6)  # fitted to b and c
    step = 0.010 + 0.002 + 0.004 * 6 / 4
    assert a["predicted_s"] == pytest.approx(step)
    assert a["error"] == pytest.approx(step / (0.010 + 0.002 + 0.008 + 0.001) - 1)


def test_the_breakdown_names_what_it_cannot_read(tmp_path):
    from benchmarks.gpu_breakdown import main

    with pytest.raises(SystemExit, match="cannot read .*no-such.json"):
        main([str(tmp_path / "no-such.json")])
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(SystemExit, match="is not a bench_gpu result"):
        main([str(tmp_path / "list.json")])
    (tmp_path / "bare.json").write_text(
        '{"planned_for": "1x1xH200-141GB", "cases": []}'
    )
    with pytest.raises(SystemExit, match="no case recorded with --kernels"):
        main([str(tmp_path / "bare.json")])


def test_reprice_plans_committed_cases_again_against_their_measured_steps():
    """`bench_gpu --reprice` needs no GPU: a committed result's case is planned again on its
    preset, as the benchmark plans it, and set against the step and peak it measured."""
    from benchmarks.bench_gpu import _repriced_table, reprice
    from planner.api import plan

    spec = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128"
    result = {
        "planned_for": "1x1xH200-141GB",
        "cases": [
            {
                "model": spec,
                "global_batch": 4,
                "predicted_s": 1e-3,
                "runtime_s": 2e-3,
                "memory": {"measured_bytes": 2**20},
            }
        ],
    }
    (row,) = reprice(result)
    p = plan(
        spec,
        "1x1xH200-141GB",
        global_batch=4,
        dtype=torch.bfloat16,
        optimizer="adam_16bit",
    )
    assert row["predicted_s"] == pytest.approx(p.estimate.iteration_time_s)
    assert row["error"] == pytest.approx(row["predicted_s"] / 2e-3 - 1)
    assert row["predicted_bytes"] == pytest.approx(p.stages[0].memory_bytes)
    assert row["memory_error"] == pytest.approx(row["predicted_bytes"] / 2**20 - 1)
    assert spec in _repriced_table([row])
