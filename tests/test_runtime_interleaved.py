"""runtime.pipeline / schedules: interleaved 1F1B plans train to the same numbers as one device.

Plans of a small GPT (4 layers, hidden 64), global batch 8, 2 pipeline groups of 2 chunks each
(chunk c on group c % 2: chunk 1 -> chunk 2 wraps from the last group to the first), run as real
gloo ranks in one launch of 4 ranks (ranks outside a plan idle):

* ``pp2_v2``: groups of 1 device (ranks 0, 1), 4 micro-batches (warm-up, steady 1F1B, cool-down);
* ``pp2_tp2_v2``: groups of 2 devices (ranks 0-1, 2-3), Megatron tensor parallel inside each,
  2 micro-batches (B == p: every forward is warm-up);
* ``auto_v2``: the automatic planner's plan with the interleaved schedule pinned
  (`planner.inter.interleave`) on 1x4 devices, micro-batches of 2 rows: 2 groups of 2 devices,
  the 4 layers cut into 4 chunks, each chunk's shardings the search's own.

For each: the losses of 3 SGD steps and the parameters after them equal single-device training on
the whole batch within 1e-5 (relative), on our own runner (``pipeline="ours"``;
`tests/test_runtime_torch_pipeline.py` runs interleaved plans on torch.distributed.pipelining). The
schedule itself is checked without ranks. ``auto_v2`` runs compiled (AOTAutograd), the manual
plans eagerly (the same arithmetic; AOTAutograd's tracing was most of the launch's time).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch

from cost_models.errors import MeshplanError
from planner import plan as auto_plan
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.schedules import deadlock_free, interleaved_order
from runtime.train import _random_batches

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
LR = 0.1
STEPS = 3
P, V = 2, 2


def _interleaved(tp: int, B: int) -> ParallelPlan:
    """The interleaved plan pp=2, v=2 with `tp`-way tensor parallelism and `B` micro-batches."""
    plan = manual_plan(
        SPEC,
        f"1x{P * tp}xA100-80GB",
        dp=1,
        tp=tp,
        pp=P,
        num_microbatches=B,
        virtual_stages=V,
        global_batch=8,
        dtype="float32",
        allow_oom=True,
    )
    assert [s.devices for s in plan.stages] == [
        list(range((c % P) * tp, (c % P + 1) * tp)) for c in range(P * V)
    ]
    return plan


def _automatic() -> ParallelPlan:
    """The automatic plan with the interleaved schedule pinned (module docstring)."""
    return auto_plan(
        SPEC,
        "1x4xA100-80GB",
        global_batch=8,
        microbatch_size=[2],
        schedule="interleaved",
        dtype="float32",
    )


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    return {
        "pp2_v2": _interleaved(1, 4),
        "pp2_tp2_v2": _interleaved(2, 2),
        "auto_v2": _automatic(),
    }


def _model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches()
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )


def _train_all(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    """Body of every rank: train each plan for 3 steps; its losses and full chunk parameters."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, plan in plans.items():
        model, batches = _model_and_batches()
        compile = name == "auto_v2"  # the manual plans eagerly (module docstring)
        tr = single_device.trainer(
            plan, model, batches[0], SPEC, lr=LR, pipeline="ours", compile=compile
        )
        losses = [tr.step(b) for b in batches]
        runner = tr.runner
        out[name] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "chunks": runner.chunks,
            "mismatches": [
                m for ex in runner.executors.values() for m in ex.mismatches
            ],
            "sharded": sorted(
                k
                for k, p in tr.params.items()
                if any(x.is_shard() for x in p.placements)
            ),
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train_all, 4, args=(_plans(),), timeout_s=300)


@pytest.mark.parametrize("name", ["pp2_v2", "pp2_tp2_v2", "auto_v2"])
@pytest.mark.slow
def test_same_numbers_as_one_device(runs: list[dict[str, Any]], name: str) -> None:
    plan = _plans()[name]
    assert plan.schedule == "interleaved" and plan.virtual_stages == V
    assert len(plan.stages) == P * V
    ref_losses, ref_params = _reference()
    got: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(runs):
        res = r[name]
        group = next((g for g in range(P) if rank in plan.stages[g].devices), None)
        assert res["chunks"] == ([] if group is None else [group, group + P])
        assert res["mismatches"] == []
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got.update({k: torch.from_numpy(v) for k, v in res["params"].items()})
    single_device.assert_same_parameters(got, ref_params)
    if (
        plan.kind == "manual" and plan.stages[-1].logical_mesh[1] > 1
    ):  # tensor-parallel chunks really shard weights
        rank = plan.stages[-1].devices[0]
        assert "lm_head.weight" in runs[rank][name]["sharded"]


def test_interleaved_order_is_megatrons() -> None:
    F = [("F", c, m) for c, m in [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2)]]
    assert interleaved_order(0, 2, 2, 4) == [
        *F,
        *[("B", 2, 0), ("F", 0, 3), ("B", 2, 1), ("F", 2, 2), ("B", 0, 0)],
        *[("F", 2, 3), ("B", 0, 1)],
        *[("B", 2, 2), ("B", 2, 3), ("B", 0, 2), ("B", 0, 3)],
    ]
    assert interleaved_order(1, 2, 2, 4)[:4] == [
        ("F", 1, 0),
        ("F", 1, 1),
        ("F", 3, 0),
        ("B", 3, 0),
    ]
    # B == p: every forward first
    assert [a for a, _, _ in interleaved_order(0, 2, 2, 2)] == ["F"] * 4 + ["B"] * 4
    with pytest.raises(MeshplanError, match="multiple"):
        interleaved_order(0, 2, 2, 3)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_interleaved_order_is_complete_and_deadlock_free(p: int) -> None:
    for v in (1, 2, 3):
        for B in (p, 2 * p, 3 * p):
            S = p * v
            orders = [interleaved_order(g, p, v, B) for g in range(p)]
            for g, order in enumerate(orders):
                want = [
                    (a, c, m) for a in "FB" for c in range(g, S, p) for m in range(B)
                ]
                assert sorted(order) == sorted(want)
            chain = {c: {c - 1} for c in range(1, S)}
            skips = {c: set(range(c)) for c in range(S)}  # values skipping chunks too
            assert deadlock_free(orders, chain) == []
            assert deadlock_free(orders, skips) == []


def test_deadlock_free_finds_a_deadlock() -> None:
    # group 1 waits for the backward of chunk 2 before its own first forward
    orders = [
        [("F", 0, 0), ("F", 2, 0), ("B", 2, 0), ("B", 0, 0)],
        [("B", 1, 0), ("F", 1, 0)],
    ]
    blocked = deadlock_free(orders, {1: {0}, 2: {1}})
    assert ("B", 1, 0) in blocked and ("F", 2, 0) in blocked
