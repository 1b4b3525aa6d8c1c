"""The local measured suite (benchmarks/local_suite.py), its report, and the per-op overhead term.

One launch of 2 gloo ranks runs a tiny case end to end (profile with a shrunk option set, plan,
grid, both plans trained); the report and the overhead's pricing are checked without processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import pytest
import torch
from profiles import cpu_profile

from benchmarks import local_report
from benchmarks.local_suite import (
    LocalCase,
    format_row,
    launch_record,
    local_cases,
    profile_options,
    run_local_suite,
    summary,
)
from benchmarks.records import compared, load_results, write_results
from benchmarks.report import report
from cost_models.cluster import Cluster
from cost_models.compute import op_overhead
from cost_models.profile import (
    COLLECTIVE_OPS,
    CollectiveFit,
    DeviceProfile,
    load_profile,
    save_profile,
)
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from runtime.profiler import KB

SPEC = "gpt:hidden=16,layers=2,heads=2,seq=8,vocab=32"
BATCH = 4
STEPS = 2
MEMORY_TOLERANCE = (
    0.10  # issue #22: predicted peak memory within 10% of the measured peak
)


#: the calibration's (steps, warmup, repeats), in the suite's launch and in its own
CALIBRATION_ROUNDS = (2, 1, 2)


@functools.cache
def _calibration_plans(world: int) -> list:
    """`calibration_plans` for `world` ranks, made once (a CLI child process per run) for both
    launches of this module."""
    from runtime.overhead import calibration_plans

    return calibration_plans(world)


def _tiny_options(n: int):
    opts = profile_options(n)
    opts.sizes = [4 * KB, 64 * KB]
    opts.repeats = 1
    opts.matmul_shapes = [(64, 64, 64), (256, 128, 128)]
    opts.matmul_repeats = 1
    opts.bandwidth_bytes = 4 << 20
    opts.calibration_plans = _calibration_plans(n)
    opts.calibration_rounds = CALIBRATION_ROUNDS
    return opts


@pytest.fixture(scope="module")
def doc() -> dict:
    return run_local_suite(
        cases=[LocalCase("gpt", SPEC, 2, BATCH)],
        steps=STEPS,
        warmup=1,
        options=_tiny_options,
    )


def _single_device_loss() -> float:
    """Ground truth: the first step's loss on one device (same seed and data as the ranks)."""
    from runtime.train import seeded_model_and_batches

    model, batches = seeded_model_and_batches(SPEC, BATCH, 1, seed=0)
    with torch.no_grad():
        return float(model(*batches[0]))


@pytest.mark.slow
def test_end_to_end_record(doc, tmp_path):
    assert doc["suite"] == "local" and doc["device"] == "CPU"
    assert doc["steps"] == STEPS and doc["date"] and doc["machine"]
    (c,) = doc["cases"]
    assert (c["suite"], c["model"], c["num_devices"]) == ("gpt", SPEC, 2)
    assert c["cluster"] == "1x2xCPU" and len(c["load_average"]) == 2
    # op_overhead_s is measured but not asserted > 0: with compiled stages the calibration step
    # is only ~2x its own collectives on 2 cores, and outside load can erase the difference
    # (CI saw 0); its arithmetic is checked without processes below
    assert isinstance(c["profile"]["op_overhead_s"], float)
    for part in (c["auto"], compared(c)):
        assert part["iteration_time_s"] > 0
        assert len(part["measured_step_times_s"]) == STEPS
        med = sorted(part["measured_step_times_s"])[STEPS // 2 - 1 : STEPS // 2 + 1]
        assert min(med) <= part["measured_iteration_time_s"] <= max(med)
        assert math.isclose(
            part["error"],
            part["iteration_time_s"] / part["measured_iteration_time_s"] - 1,
        )
    a, m = c["auto"], compared(c)
    # Peak memory, per rank of both plans, against the plan's prediction (issue #22: within 10%)
    for part in (a, m):
        mem = part["memory"]
        assert [r["rank"] for r in mem["ranks"]] == [0, 1]
        for r in mem["ranks"]:
            assert r["measured_bytes"] > 0 and r["stages"]
            assert r["ratio"] == pytest.approx(
                r["predicted_bytes"] / r["measured_bytes"]
            )
        assert mem["max_abs_error"] <= MEMORY_TOLERANCE, mem["stages"]
    assert doc["summary"]["memory_max_abs_error"] == max(
        a["memory"]["max_abs_error"], m["memory"]["max_abs_error"]
    )
    assert a["planner_time_s"] > 0 and a["stages"] and a["num_microbatches"] >= 1
    assert m["config"]["dp"] * m["config"]["tp"] * m["config"]["pp"] == 2
    best = c["manual_best"]
    assert math.isclose(c["ratio"], best["iteration_time_s"] / a["iteration_time_s"])
    if c["runner_up"]:  # the best manual plan is the automatic one; the next best ran
        assert c["same_plan"] and "measured_iteration_time_s" not in best
        assert m["label"] != best["label"]
        assert m["iteration_time_s"] >= best["iteration_time_s"]
    if c["agree"] is None:
        assert c["same_plan"] and not c["runner_up"]
    else:
        assert c["agree"] == (
            (m["iteration_time_s"] >= a["iteration_time_s"])
            == (m["measured_iteration_time_s"] >= a["measured_iteration_time_s"])
        )
    # Both plans trained the same model on the same data: one device's loss.
    truth = _single_device_loss()
    assert c["first_losses"] == pytest.approx([truth, truth], rel=1e-5)
    assert doc["summary"]["cases"] == 1
    assert doc["summary"]["median_abs_error"] == pytest.approx(
        (abs(a["error"]) + abs(m["error"])) / 2
    )
    assert SPEC.split(":")[0] in format_row(c)
    # The document is plain JSON and the report renders it.
    write_results(doc, tmp_path / "local-CPU.json")
    (back,) = load_results(tmp_path)
    assert back["cases"] == json.loads(json.dumps(doc["cases"]))
    text = report(tmp_path)
    assert "## local suite" in text and "(d) local suite" in text
    assert "(f) local suite" in text and "measured peak MiB" in text


def test_plans_take_turns_in_blocks(monkeypatch):
    """`measure_rank`: warm-up steps of each plan in turn, then blocks of one untimed step and up
    to `block` timed ones per plan in turn, `steps` timed per plan, both plans on the same
    batches in the same order (a step right after another trainer's measured 24-32% slower)."""
    import benchmarks.local_suite as ls
    import runtime.train

    order: list[tuple[str, int]] = []

    class Trainer:
        def __init__(self, plan: Any, *args: Any, **kw: Any) -> None:
            self.name = plan.name

        def step(self, batch: int) -> float:
            order.append((self.name, batch))
            return float(batch)

    clock = iter(range(1000))
    monkeypatch.setattr(runtime.train, "Trainer", Trainer)
    monkeypatch.setattr(
        runtime.train,
        "seeded_model_and_batches",
        lambda model, batch, n, seed: (None, list(range(n))),
    )
    monkeypatch.setattr(ls, "_timed", lambda fn, *a: (fn(*a), float(next(clock))))
    plans = [
        dataclasses.make_dataclass("P", ["name", "global_batch"])(n, 4) for n in "ab"
    ]
    out = ls.measure_rank(plans, "m", steps=7, warmup=1, block=3)
    # warm-up, then blocks of 1 untimed + 3, 3 and 1 timed steps
    expected, timed_at = [("a", 0), ("b", 0)], []
    i = 1
    for timed in (3, 3, 1):
        for plan in "ab":
            for j in range(timed + 1):
                if j and plan == "a":
                    timed_at.append(len(expected))
                expected.append((plan, i + j))
        i += timed + 1
    assert order == expected
    assert out["times"][0] == [
        float(t) for t in timed_at
    ]  # the clock's reading per step
    assert [len(t) for t in out["times"]] == [7, 7]
    assert out["losses"][0] == out["losses"][1] == [0.0] + list(map(float, range(1, i)))


def test_local_cases_select_by_process_count():
    assert {c.num_devices for c in local_cases([2])} == {2}
    assert len(local_cases()) >= 5
    with pytest.raises(ValueError, match="no case for \\[3\\]"):
        local_cases([3])


# ---------------------------------------------------------------------------------------------
# The report of local results (no processes)


def _case(n: int, pred: tuple[float, float], meas: tuple[float, float]) -> dict:
    def part(p: float, m: float) -> dict:
        return {
            "iteration_time_s": p,
            "measured_iteration_time_s": m,
            "error": p / m - 1,
        }

    auto = part(pred[0], meas[0]) | {
        "num_microbatches": 2,
        "stages": [
            {"layers": [0, 3], "logical_mesh": [1, n], "recompute": False},
        ],
    }
    return {
        "suite": "gpt",
        "num_devices": n,
        "auto": auto,
        "manual_best": part(pred[1], meas[1]) | {"label": f"dp{n} tp1 pp1 B1"},
        "agree": (pred[1] >= pred[0]) == (meas[1] >= meas[0]),
        "profile": {"op_overhead_s": 1e-4},
    }


def _doc(cases: list[dict]) -> dict:
    return {
        "suite": "local",
        "device": "CPU",
        "machine": "box (x86_64, 2 CPUs)",
        "date": "2026-01-01T00:00:00+00:00",
        "file": "local-CPU.json",
        "cases": cases,
    }


def test_report_checks_pass_and_fail():
    good = _doc([_case(2, (0.10, 0.12), (0.11, 0.13))] * 5)
    d, e = local_report.local_checks(good)
    assert d.endswith("yes (8%; largest 9%)") and e.endswith("yes (5 of 5)")
    # 50% errors, and the predicted-faster plan measured slower in 2 of 5 cases.
    bad = _doc(
        [_case(2, (0.10, 0.12), (0.20, 0.24))] * 3
        + [_case(4, (0.10, 0.12), (0.24, 0.20))] * 2
    )
    d, e = local_report.local_checks(bad)
    assert ": no (" in d and e.endswith("no (3 of 5)")
    # issue #22: median 15% and every error within 30% (here the median is 8%, the largest 9%)
    # in each of three launches in a row: one launch is not enough
    assert local_report.issue22_check(good)[0].endswith(
        "no (met in 1 of the 1 launches of this file: median 8%, largest 9%)"
    )
    one_off = _doc(
        [_case(2, (0.10, 0.12), (0.11, 0.13))] * 4
        + [_case(2, (0.16, 0.12), (0.11, 0.13))]
    )  # a median of 8%, but one case predicted 45% slow
    assert local_report.issue22_check(one_off)[0].endswith(
        "no (met in 0 of the 1 launches of this file: median 8%, largest 45%)"
    )
    assert local_report.issue22_check(bad)[0].endswith(
        "no (met in 0 of the 1 launches of this file: median 50%, largest 58%)"
    )
    # the runs of `--launches 3` (`launch_record`): the last three must all meet it
    runs = [
        launch_record(d | {"total_time_s": 1.0, "summary": summary(d["cases"])})
        for d in (good, one_off, good)
    ]
    three = good | {"launches": runs}
    assert local_report.issue22_check(three)[0].endswith(
        "no (met in 2 of the 3 launches of this file: median 8%, largest 9%; "
        "median 8%, largest 45%; median 8%, largest 9%)"
    )
    three["launches"] = [runs[0], runs[2], runs[0]]
    assert ": yes (met in 3 of the 3" in local_report.issue22_check(three)[0]
    # Where the automatic plan is the manual one there is no faster plan: no verdict either way.
    same = _case(2, (0.10, 0.10), (0.11, 0.12)) | {"same_plan": True, "agree": None}
    d, e = local_report.local_checks(
        _doc([same] * 2 + [_case(2, (0.1, 0.12), (0.1, 0.13))] * 3)
    )
    assert e.endswith(
        "no (3 of 5; in 2 the automatic plan is the manual one, which has no faster plan)"
    )
    assert local_report.local_table(_doc([same]))[2].count("| same plan / auto |") == 1
    # ... unless the runner-up ran: then its order against the automatic plan is the verdict
    runner = _case(2, (0.10, 0.10), (0.11, 0.12)) | {"same_plan": True}
    runner["runner_up"] = runner["manual_best"] | {
        "label": "dp1 tp2 pp1 B1",
        "iteration_time_s": 0.13,
        "error": 0.13 / 0.12 - 1,
    }
    d, e = local_report.local_checks(_doc([runner] * 5))
    assert e.endswith(
        "yes (5 of 5; in 5 against the runner-up, the best manual plan being the automatic)"
    )
    assert d.endswith("(9%; largest 9%)")  # |0.10/0.11 - 1| and |0.13/0.12 - 1|
    row = local_report.local_table(_doc([runner]))[2]
    assert "| dp1 tp2 pp1 B1 (runner-up) | 130.0 | 120.0 | +8% | auto / auto |" in row


def test_report_table_and_figure(tmp_path):
    doc = _doc(
        [_case(2, (0.10, 0.12), (0.11, 0.13)), _case(4, (0.2, 0.1), (0.25, 0.1))]
    )
    rows = local_report.local_table(doc)
    assert len(rows) == 2 + 2
    assert (
        "| 2 | gpt | B=2; 0-3@1x2 | 100.0 | 110.0 | -9% | dp2 tp1 pp1 B1 |" in rows[2]
    )
    assert rows[3].endswith("| manual / manual | 100 / - / -; -; - / - | - |")
    pytest.importorskip("matplotlib")
    lines = local_report.local_section(doc, tmp_path)
    assert (tmp_path / "local-CPU.png").stat().st_size > 0
    assert any("local-CPU.png" in line for line in lines)


# ---------------------------------------------------------------------------------------------
# The per-op overhead in the profile file and in the cost model


def _profile(overhead: float, devices: int = 1, step: float = 5e-3) -> DeviceProfile:
    return cpu_profile(
        devices_per_host=devices, op_overhead_s=overhead, step_overhead_s=step
    )


def test_profile_file_keeps_the_overhead_and_defaults_to_zero(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_profile(3e-4), path)
    assert load_profile(path).op_overhead_s == 3e-4
    assert load_profile(path).step_overhead_s == 5e-3
    data = json.loads(path.read_text())
    del data["op_overhead_s"]  # a profile written before the fields existed
    del data["step_overhead_s"]
    path.write_text(json.dumps(data))
    assert load_profile(path).op_overhead_s == 0.0
    assert load_profile(path).step_overhead_s == 0.0
    assert op_overhead(Cluster.from_spec("1x1xA100-80GB")) == 0.0


def _one_device_iteration(
    profile: DeviceProfile, microbatches: int
) -> tuple[float, Any]:
    """The predicted iteration of SPEC on one device of `profile` over `microbatches`
    micro-batches, and the traced graph of one micro-batch."""
    p = manual_plan(
        SPEC,
        Cluster.from_profile(profile),
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=microbatches,
        global_batch=BATCH,
        dtype="float32",
        optimizer="sgd",
    )
    model, batch = build_model(SPEC, batch=BATCH // microbatches, device="meta")
    return p.estimate.iteration_time_s, trace(model, batch, model_name=SPEC)


def test_overhead_priced_once_per_op_per_microbatch():
    """One device, one stage: the iteration is B micro-batches in a row, so the overhead adds
    B * (call nodes of one micro-batch's graph) * overhead to the prediction."""
    overhead, B = 1e-3, 2
    assert op_overhead(Cluster.from_profile(_profile(overhead))) == overhead
    base, graph = _one_device_iteration(_profile(0.0), B)
    with_overhead, _ = _one_device_iteration(_profile(overhead), B)
    calls = sum(1 for n in graph.nodes if n.op == "call")
    assert with_overhead - base == pytest.approx(B * calls * overhead, rel=1e-6)


def test_parameter_overhead_priced_per_parameter_per_microbatch_and_per_step(tmp_path):
    """One device, one stage of B micro-batches in a row: the per-parameter overheads add
    (parameter tensors) * (B * param_overhead_s + param_step_overhead_s) to the prediction, and
    a profile file keeps both figures."""
    from cost_models.compute import param_overhead

    q, r, B = 2e-4, 3e-4, 2
    profile = dataclasses.replace(
        _profile(0.0), param_overhead_s=q, param_step_overhead_s=r
    )
    assert param_overhead(Cluster.from_profile(profile), B) == pytest.approx(q + r / B)
    base, graph = _one_device_iteration(_profile(0.0), B)
    with_overhead, _ = _one_device_iteration(profile, B)
    assert with_overhead - base == pytest.approx(
        len(graph.params) * (B * q + r), rel=1e-6
    )
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert (loaded.param_overhead_s, loaded.param_step_overhead_s) == (q, r)


def test_gradient_bytes_priced_once_per_step_on_the_bytes_a_device_holds(tmp_path):
    """The per-byte overhead adds (gradient bytes on a device) * grad_byte_overhead_s once per
    step: on one device every parameter's bytes, whatever the micro-batch count; under tensor
    parallelism on two devices less than all of them and more than half (split weights count
    their shard, replicated biases and norms whole). A profile file keeps the figure."""
    g = 1e-9
    # g and 2 g: a profile with the figure prices the optimizer's step in it (none without)
    base_profile = dataclasses.replace(_profile(0.0), grad_byte_overhead_s=g)
    profile = dataclasses.replace(_profile(0.0), grad_byte_overhead_s=2 * g)
    model, _ = build_model(SPEC, batch=BATCH, device="meta")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for B in (1, 2):
        base, _ = _one_device_iteration(base_profile, B)
        more, _ = _one_device_iteration(profile, B)
        assert more - base == pytest.approx(nbytes * g, rel=1e-6)

    def tp2(grad_byte: float) -> float:
        two = dataclasses.replace(
            _profile(0.0, devices=2), grad_byte_overhead_s=grad_byte
        )
        two.collectives = [CollectiveFit(op, 2, 1e-4, 1e-9) for op in COLLECTIVE_OPS]
        return manual_plan(
            SPEC,
            Cluster.from_profile(two),
            dp=1,
            tp=2,
            pp=1,
            num_microbatches=1,
            global_batch=BATCH,
            dtype="float32",
            optimizer="sgd",
        ).estimate.iteration_time_s

    added = tp2(2 * g) - tp2(g)
    assert nbytes * g / 2 < added < nbytes * g
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path).grad_byte_overhead_s == 2 * g


def test_step_overhead_added_once_per_iteration():
    """The profile's per-step overhead adds itself once to every plan's predicted iteration,
    pipelined or not, manual or automatic (it does not scale with micro-batches or stages)."""
    from planner import plan

    def times(step: float) -> list[float]:
        profile = _profile(1e-5, devices=2, step=step)
        profile.collectives = [
            CollectiveFit(op, 2, 1e-4, 1e-9) for op in COLLECTIVE_OPS
        ]
        cluster = Cluster.from_profile(profile)
        manual = [
            manual_plan(
                SPEC,
                cluster,
                dp=2 // pp,
                tp=1,
                pp=pp,
                num_microbatches=2,
                global_batch=BATCH,
                dtype="float32",
                optimizer="sgd",
            ).estimate.iteration_time_s
            for pp in (1, 2)
        ]
        auto = plan(SPEC, cluster, global_batch=BATCH, dtype="float32", optimizer="sgd")
        return [*manual, auto.estimate.iteration_time_s]

    base, more = times(0.0), times(0.25)
    assert [b - a for a, b in zip(base, more)] == pytest.approx([0.25] * 3, rel=1e-9)


def test_profile_options_cover_the_planned_world_sizes():
    assert profile_options(2).world_sizes == [2]
    assert profile_options(8).world_sizes == [2, 4, 8]
    assert dataclasses.asdict(profile_options(4))["concurrent_compute"] is True
    # with a case, the rates of its model's non-GEMM ops at one rank's share of the batch
    case = local_cases([4])[0]
    opts = profile_options(4, case)
    assert opts.op_models == (case.model,)
    assert opts.op_batch == case.global_batch // 4
    assert profile_options(4).op_models == ()


def test_overhead_takes_off_the_collectives_timed_in_the_same_run():
    """A run's net time (`_net`) is its step less the collectives timed beside the steps
    (comm_s); only a record without them is priced with the all_reduce fit, and never < 0."""
    from runtime.overhead import _net

    run = {"step_s": 0.05, "comm_s": 0.01, "grad_bytes": 4096.0, "world": 2.0}
    slow_fit = CollectiveFit(
        "all_reduce", 2, 1.0, 0.0
    )  # 1 s per call: more than the step
    assert _net(run, slow_fit) == pytest.approx(0.04)
    del run["comm_s"]
    assert _net(run, slow_fit) == 0.0
    fit = CollectiveFit("all_reduce", 2, 1e-3, 0.0)
    assert _net(run, fit) == pytest.approx(0.05 - 2e-3)  # gradients and the loss
    assert _net({**run, "world": 1.0}, fit) == pytest.approx(0.05)


# (ops, parameters, gradient bytes) of the calibration models, as
# `test_calibration_runs_determine_the_overheads` checks against their traces
CALIBRATION_COUNTS = {
    0: (98, 29, 8192),
    1: (338, 101, 29120),
    2: (327, 39, 7456),
    3: (441, 23, 5920),
    4: (98, 29, 6356992),
}


def _calibration_raw(truth, noise=()):
    """`measure_op_overhead`-like runs of ``CALIBRATION_RUNS`` timed as `truth` (an Overheads)
    says, plus 2 ms of collectives, each net time scaled by 1 + its `noise`."""
    from runtime.overhead import CALIBRATION_MODELS, CALIBRATION_RUNS

    runs = []
    for i, (spec, b) in enumerate(CALIBRATION_RUNS):
        ops, params, grad_bytes = CALIBRATION_COUNTS[CALIBRATION_MODELS.index(spec)]
        net = (
            truth.step_s
            + b * (truth.microbatch_s + ops * truth.op_s + params * truth.param_s)
            + params * truth.param_step_s
            + grad_bytes * truth.grad_byte_s
        ) * (1 + (noise[i] if noise else 0.0))
        runs.append(
            {"step_s": net + 0.002, "comm_s": 0.002, "ops": ops, "params": params}
            | {"grad_bytes": grad_bytes, "world": 4, "microbatches": b}
        )
    return {"runs": runs}


def test_overheads_are_recovered_from_the_calibration_runs():
    """Runs timed by known overheads give them back, each of the six figures, also from repeats
    one of which is disturbed."""
    from runtime.overhead import Overheads, overheads_from_steps

    truth = Overheads(
        op_s=60e-6,
        param_s=215e-6,
        param_step_s=158e-6,
        microbatch_s=0.012,
        step_s=0.005,
        grad_byte_s=1.6e-9,
    )
    got = overheads_from_steps(_calibration_raw(truth), None)
    figures = (
        "op_s",
        "param_s",
        "param_step_s",
        "microbatch_s",
        "step_s",
        "grad_byte_s",
    )
    for f in figures:
        assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=1e-6), f
    # repeated calibrations: one fit of each run's median time, so one disturbed repeat (every
    # step three times as long) does not move the profile
    disturbed = _calibration_raw(truth, noise=(2.0,) * 7)
    raw = {"repeats": [_calibration_raw(truth), disturbed, _calibration_raw(truth)]}
    got = overheads_from_steps(raw, None)
    for f in figures:
        assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=1e-6), f


def test_noisy_overheads_are_the_nonnegative_least_squares_fit():
    """Noise that would make a figure negative gives the best fit with figures >= 0: checked by
    the optimality conditions of that convex problem (KKT: a free figure's gradient is 0, a zero
    figure's gradient >= 0); the unconstrained fit has a negative figure."""
    import numpy as np

    from runtime.overhead import Overheads, _features, _net, nonnegative_fit

    truth = Overheads(op_s=60e-6, param_s=5e-6, step_s=0.001, microbatch_s=0.0)
    raw = _calibration_raw(truth, noise=(0.1, -0.05, 0.08, -0.08, -0.1, 0.05, 0.0))
    a = np.array([_features(r) for r in raw["runs"]])
    y = np.array([_net(r, None) for r in raw["runs"]])
    # the unconstrained least-squares fit is not a valid figure set
    assert np.linalg.lstsq(a, y, rcond=None)[0].min() < 0
    x = nonnegative_fit(a, y)
    assert (x >= 0).all()
    grad = a.T @ (a @ x - y)
    scale = np.abs(a.T @ y)
    assert np.all(np.abs(grad[x > 0]) <= 1e-9 * scale[x > 0])
    assert np.all(grad[x == 0] >= -1e-9 * scale[x == 0])


def test_calibration_runs_determine_the_overheads():
    """The calibration models' traced ops and parameters are those the fit tests assume, and
    their runs determine all six figures; runs of one model cannot (a clear error)."""
    import numpy as np

    from cost_models.errors import MeshplanError
    from planner.models import build_model
    from planner.tracing.tracer import trace
    from runtime.overhead import (
        CALIBRATION_BATCH,
        CALIBRATION_MODELS,
        Overheads,
        _features,
        nonnegative_fit,
    )

    for i, spec in enumerate(CALIBRATION_MODELS):
        meta, micro = build_model(spec, batch=CALIBRATION_BATCH, device="meta")
        graph = trace(meta, micro, model_name=spec)
        grad_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
        counts = (len(graph.ops), len(graph.params), grad_bytes)
        assert counts == CALIBRATION_COUNTS[i], spec
    runs = _calibration_raw(Overheads())["runs"]
    assert np.linalg.matrix_rank(np.array([_features(r) for r in runs])) == 6
    gpt_only = [r for r in runs if r["params"] / r["ops"] > 0.2]
    with pytest.raises(MeshplanError, match="two ratios of parameters to ops"):
        nonnegative_fit(
            np.array([_features(r) for r in gpt_only]), np.ones(len(gpt_only))
        )


def test_same_plan_ignores_size_one_axes_and_layer_numbering():
    """One plan written two ways - logical mesh (1, 2) or (2, 1), layers numbered in another
    clustering - is the same plan; a different placement of one parameter is not."""
    import copy

    from benchmarks.local_suite import same_plan

    p = manual_plan(
        SPEC,
        "1x2xA100-80GB",
        dp=2,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=BATCH,
        dtype="float32",
        optimizer="sgd",
    )
    s = p.stages[0]
    assert [n for n in s.logical_mesh if n > 1] == [2]
    q = copy.deepcopy(p)
    t = q.stages[0]
    t.logical_mesh = tuple(reversed(s.logical_mesh))
    t.layers = (0, 7)
    t.param_placements = {k: list(reversed(v)) for k, v in s.param_placements.items()}
    t.node_strategies = {
        n: {k: [list(reversed(x)) if x else x for x in v] for k, v in st.items()}
        for n, st in s.node_strategies.items()
    }
    assert same_plan(p, q)
    path = next(iter(t.param_placements))
    t.param_placements[path] = (
        ["R", "S(0)"] if t.param_placements[path] != ["R", "S(0)"] else ["R", "R"]
    )
    assert not same_plan(p, q)


def test_runner_up_is_planned_when_the_best_manual_plan_is_the_automatic_one():
    """With this profile the grid's best (dp2) is the automatic plan: the case also plans the best
    manual configuration whose plan differs, and that is the manual plan it would run. (With
    all-reduces of 20 us the automatic plan replicates the whole model instead: on this
    profile's fast ops that costs less than the loss's and the gradients' all-reduces.)"""
    from benchmarks.local_suite import _plan_case, same_plan

    prof = dataclasses.replace(
        _profile(1e-5, devices=2),
        collectives=[
            CollectiveFit("all_reduce", 2, 2e-6, 1e-9),
            CollectiveFit("send_recv", 2, 20e-6, 1e-9),
        ],
    )
    r = _plan_case(LocalCase("gpt", SPEC, 2, 8), prof)
    best, runner = r["manual"], r["runner_up"]
    assert runner["config"] != best["config"]
    assert runner["iteration_time_s"] >= best["iteration_time_s"]
    assert not same_plan(r["auto"], r["manual_plan"])
    assert r["manual_plan"].estimate.iteration_time_s == runner["iteration_time_s"]


def _calibrate_in_order(plans: list) -> tuple[dict, list[int]]:
    """Inside a launch: `measure_op_overhead` over `plans`, every step logged by its run."""
    from runtime import overhead

    order: list[int] = []
    step = overhead._Calibration.step
    ids: dict[int, int] = {}

    def logged(self) -> None:
        order.append(ids.setdefault(id(self), len(ids)))
        step(self)

    overhead._Calibration.step = logged
    steps, warmup, repeats = CALIBRATION_ROUNDS
    return overhead.measure_op_overhead(plans, steps, warmup, repeats), order


@pytest.mark.slow
def test_calibration_runs_are_interleaved():
    """The calibration runs are built once, warmed up, then stepped in turn (one step of each
    per round), so the fit compares them on the same machine; the record has every run's
    figures per repeat, counted as `CALIBRATION_COUNTS` says. Three of the runs (one micro-batch,
    several, the wide GPT): the interleaving does not depend on how many, and each run's trainer
    costs seconds to build; `test_calibration_runs_determine_the_overheads` counts them all."""
    from runtime.launch import launch
    from runtime.overhead import CALIBRATION_MODELS, CALIBRATION_RUNS, MICROBATCHES

    picked = [0, CALIBRATION_RUNS.index((CALIBRATION_MODELS[0], MICROBATCHES)), -1]
    runs = [CALIBRATION_RUNS[i] for i in picked]
    plans = [_calibration_plans(2)[i] for i in picked]
    n = len(runs)
    raw, order = launch(_calibrate_in_order, 2, (plans,), timeout_s=300)[0]
    assert order == list(range(n)) * (1 + 2 * 2)  # warm-up, then 2 repeats of 2 rounds
    assert len(raw["repeats"]) == 2
    for rep in raw["repeats"]:
        assert len(rep["runs"]) == n
        for (spec, b), r in zip(runs, rep["runs"]):
            ops, params, grad_bytes = CALIBRATION_COUNTS[CALIBRATION_MODELS.index(spec)]
            got = (r["ops"], r["params"], r["grad_bytes"], r["microbatches"])
            assert got == (ops, params, grad_bytes, b)
            assert r["world"] == 2 and r["step_s"] > 0 and r["comm_s"] > 0
