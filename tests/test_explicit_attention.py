"""Explicit attention with attention dropout (`planner.models.gpt.explicit_attention`) trains under
plans like one device: one launch of 2 gloo processes.

Ground truth: one device, ``torch.manual_seed(SEED)`` then 3 SGD steps (`single_device.train`),
every keep-mask drawn from the default generator at the whole batch's shape. Plans: tensor
parallel over the heads with ``attn=explicit`` (heads-first fold) and data parallel with
``attn=explicit-batch`` (batch-first fold), each with 2 micro-batches, so that every micro-batch
needs its own rows of the whole batch's mask. Control: the same tp2 plan with every rank drawing
its own masks does not match, so the comparison can fail. ``tp2`` runs compiled (AOTAutograd,
the masks as graph inputs), ``dp2`` and the control eagerly (the same arithmetic)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch

from planner.models import build_model
from planner.plans.manual import manual_plan
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "gpt:hidden=32,layers=2,heads=4,seq=8,vocab=64,attn_dropout=0.1,attn="
BATCH, LR, STEPS, SEED = 4, 0.1, 3, 5
CASES = {
    "tp2": ("explicit", {"dp": 1, "tp": 2}),
    "dp2": ("explicit-batch", {"dp": 2, "tp": 1}),
    "tp2_own_draws": ("explicit", {"dp": 1, "tp": 2}),
}


def _model_and_batches(attn: str) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model, example = build_model(
        SPEC + attn, batch=BATCH, device="cpu", dtype=torch.float32
    )
    return model, _random_batches(example, STEPS, seed=1)


@functools.cache
def _plans() -> dict[str, Any]:
    out = {}
    for case, (attn, kw) in CASES.items():
        model, batches = _model_and_batches(attn)
        out[case] = manual_plan(
            model,
            "1x2xA100-80GB",
            batches[0],
            pp=1,
            num_microbatches=2,
            global_batch=BATCH,
            dtype="float32",
            allow_oom=True,
            **kw,
        )
    return out


def _train(plans: dict[str, Any]) -> dict[str, Any]:

    out = {}
    for case, p in plans.items():
        model, batches = _model_and_batches(CASES[case][0])
        compile = case == "tp2"  # the others eagerly (module docstring)
        tr = single_device.trainer(
            p,
            model,
            batches[0],
            SPEC + CASES[case][0],
            lr=LR,
            seed=SEED,
            compile=compile,
        )
        if case.endswith("own_draws"):
            for ex in tr.runner.executors.values():
                ex.masks = None
            tr.masks = None
        losses = [tr.step(b) for b in batches]
        params = {k: v.numpy().copy() for k, v in tr.full_params().items()}
        out[case] = {"losses": losses, "params": params}
    return out


@functools.cache
def _runs() -> list[dict[str, Any]]:
    return launch(_train, 2, args=(_plans(),), timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_explicit_attention_with_dropout_trains_like_one_device(case: str) -> None:
    model, batches = _model_and_batches(CASES[case][0])
    torch.manual_seed(SEED)
    ref_losses, ref_params = single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )
    got = [r[case] for r in _runs()]
    if case.endswith("own_draws"):
        assert got[0]["losses"][0] != pytest.approx(ref_losses[0], rel=1e-5)
        return
    for r in got:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), case
        single_device.assert_same_parameters(
            {k: torch.from_numpy(v) for k, v in r["params"].items()}, ref_params
        )
