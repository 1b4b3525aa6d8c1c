"""The least iteration time of a micro-batch size (`planner.size_bound`) is the one-device plan's
time over the device count (the bound `benchmarks.ceiling` takes at one micro-batch), no plan
of the size beats it (brute force: every size's own search and the manual grid; on one device
each size's plan attains it), and the sizes it rules out leave the plan as searching every size
gives it, in one process and in two."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from profiles import cpu_profile
from size_plans import plans_without_and_with_skips, size_plan_times

from benchmarks.ceiling import ceiling
from cost_models.cluster import Cluster
from planner import size_eval
from planner.api import microbatch_sizes
from planner.plans.manual import manual_plan
from planner.size_bound import least_iteration_time
from planner.size_eval import SizeJob, evaluate
from planner.tracing.inputs import resolve_model

# moe-tiny on two A100s plans fastest at 32 rows; at 8 rows and below the bound alone is slower
MODEL, CLUSTER, G = "moe-tiny", "1x2xA100-80GB", 32


def _bound(model: str, cluster: Cluster, G: int, b: int, optimizer: str) -> float:
    _, make, _ = resolve_model(model, None, torch.float16, None)
    return least_iteration_time(make.trace(b), cluster, G // b, G, optimizer, model)


@pytest.mark.parametrize("b", [2, 8, 16])
def test_the_bound_is_the_one_device_plan_over_the_devices(b: int) -> None:
    cluster = Cluster.from_spec("1x4xA100-80GB")
    one = manual_plan(
        "gpt-tiny",
        cluster.with_shape(1, 1),
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=16 // b,
        global_batch=16,
        recompute=False,
        dtype="float16",
        allow_oom=True,
    )
    bound = _bound("gpt-tiny", cluster, 16, b, "adam_mixed")
    assert bound == pytest.approx(one.estimate.iteration_time_s / 4, rel=1e-12)
    if b == 16:  # the whole batch in one micro-batch: `benchmarks.ceiling`'s bound
        t_min = ceiling("gpt-tiny", cluster, 16)["iteration_time_s"]
        assert bound == pytest.approx(t_min, rel=1e-12)


def test_no_bound_with_a_measured_profile() -> None:
    cluster = replace(Cluster.from_spec(CLUSTER), profile=cpu_profile())
    _, make, _ = resolve_model(MODEL, None, torch.float16, None)
    assert least_iteration_time(make.trace(4), cluster, G // 4, G, "adam_mixed") is None


@pytest.mark.parametrize(
    "model,spec,G,suite",
    [
        (MODEL, CLUSTER, G, "moe"),
        ("gpt-tiny", "2x2xV100-16GB", 8, "gpt"),
        ("gpt-tiny", "1x1xA100-80GB", 16, "gpt"),
    ],
)
@pytest.mark.slow
def test_no_plan_of_a_size_beats_its_bound(model, spec, G, suite) -> None:
    cluster = Cluster.from_spec(spec)
    bounds = {
        b: _bound(model, cluster, G, b, "adam_mixed")
        for b in microbatch_sizes(G, cluster)
    }
    times = size_plan_times(model, cluster, G, bounds, suite)
    assert len(times) >= 12
    below = {
        k: (t, bounds[b])
        for k, (b, t, _) in times.items()
        if t < bounds[b] * (1 - 1e-9)
    }
    assert not below, f"faster than their size's bound: {below}"
    if cluster.num_devices == 1:  # tight there: each size's plan is the bound's own
        for b, bound in bounds.items():
            assert times[f"auto at {b} rows"][1] == pytest.approx(bound, rel=1e-9)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_sizes_the_bound_rules_out_change_no_plan(monkeypatch, processes) -> None:
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", processes)
    plans, said = plans_without_and_with_skips(monkeypatch, MODEL, CLUSTER, G)
    assert plans[0] == plans[1]
    # skipped once traced, or given up between meshes when a faster plan came in meanwhile
    skipped = [
        int(m.split("micro-batch ")[1].split()[0])
        for m in said
        if re.search(r"(skipped|given up): none of its plans", m)
    ]
    searched = [m for m in said if " s per iteration, the best of " in m]
    # 1 and 2 rows come after a faster size in either order (`take_order`), and serially
    # after 32 rows; every size is searched or skipped (none larger: 16 rows per device)
    cluster = Cluster.from_spec(CLUSTER)
    sizes = microbatch_sizes(G, cluster)
    assert {1, 2} <= set(skipped) and len(skipped) + len(searched) == len(sizes), said
    best = plans[1]["estimate"]["iteration_time_s"]
    for b in skipped:
        assert _bound(MODEL, cluster, G, b, "adam_mixed") > best


def test_a_size_is_given_up_when_a_faster_plan_comes_in_during_its_search(
    monkeypatch,
) -> None:
    """A size whose bound a plan found by another process beats while the size is searched stops
    before its next mesh: moe-tiny at 2 rows, a plan of 1e-6 s "found" once its first mesh has
    started. Before that, and with the switch off, the size is searched whole."""
    monkeypatch.setenv("MESHPLAN_PLANNER_THREADS", "1")
    cluster = Cluster.from_spec(CLUSTER)
    name, make, _ = resolve_model(MODEL, None, torch.float16, None)
    job = SizeJob(
        MODEL,
        None,
        torch.float16,
        name,
        cluster,
        G,
        cluster.device.memory_bytes,
        "adam_mixed",
        "auto",
        "auto",
        None,
        [(1, 1), (1, 2)],
    )
    said: list[str] = []

    def beat() -> float:  # a faster plan exists once a mesh of this size has started
        return 1e-6 if any("logical mesh" in m for m in said) else float("inf")

    def meshes() -> list[str]:
        return [m for m in said if "logical mesh" in m]

    # the switch off: every mesh of the size searched
    monkeypatch.setattr(size_eval, "SKIP_BOUNDED_SIZES", False)
    whole = evaluate(job, make, 2, said.append, beat=beat)
    assert whole.found and whole.bounded is None
    every = len(meshes())
    assert every > 1, said
    monkeypatch.setattr(size_eval, "SKIP_BOUNDED_SIZES", True)
    said.clear()
    out = evaluate(job, make, 2, said.append, beat=beat)
    assert out.bounded == _bound(MODEL, cluster, G, 2, "adam_mixed") > 1e-6
    assert out.best is None and not out.found
    assert len(meshes()) == 1 and f"(1 of {every})" in meshes()[0], said
    assert re.search(
        r"micro-batch 2 given up: none of its plans takes under [0-9.]+ s per "
        r"iteration, and one of 1e-06 s was found",
        said[-1],
    ), said
