"""A tensor-parallel plan that leaves the residual stream partial (each add sums partial sums;
the layer norms receive it all-reduced) holds what it is predicted to hold: the layer norm keeps
the reduced copy for its backward, the partial sum is freed (`planner.inter.held_memory`).

Before the fix the prediction counted both: the local suite's dp4 x tp2 GPT was predicted 14%
above its measured peak, and this 2-rank plan 16%.
"""

from __future__ import annotations

from typing import Any

import pytest
from profiles import cpu_cluster

from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128"


def _plan() -> ParallelPlan:
    return manual_plan(
        SPEC,
        cpu_cluster(2),
        dp=1,
        tp=2,
        pp=1,
        num_microbatches=1,
        global_batch=8,
        dtype="float32",
        optimizer="sgd",
        allow_oom=True,
    )


def _partial_adds(plan: ParallelPlan) -> list[str]:
    """The residual adds left partial on the tensor-parallel axis (the logical mesh is 1 x 2)."""
    return [
        n
        for n, s in plan.stages[0].node_strategies.items()
        if n.startswith("add") and s["outputs"] and s["outputs"][0] == ["R", "P"]
    ]


def _peaks(plan: ParallelPlan) -> list[dict[str, Any]]:
    from runtime.train import measure_peak_memory, seeded_model_and_batches

    model, batches = seeded_model_and_batches(SPEC, plan.global_batch, 2, seed=0)
    return measure_peak_memory(plan, model, batches, optimizer="sgd", lr=0.01)


@pytest.mark.slow
def test_partial_residual_stream_memory_as_measured() -> None:
    plan = _plan()
    adds = _partial_adds(plan)  # the case at hand: the residual adds stay partial
    assert len(adds) >= 4, plan.stages[0].node_strategies
    for r in launch(_peaks, 2, args=(plan,), timeout_s=300)[0]:
        assert r["ratio"] == pytest.approx(1.0, abs=0.1), r
