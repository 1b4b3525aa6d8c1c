"""The runtime trains a small MoE model to the same numbers as one device (principle 7).

MoE of hidden 32, 2 layers (block 0 holds 4 experts with top-2 gating: argmax, one-hot by
comparison, cumsum, where), seq 8, vocab 64, groups of 8 tokens (one sequence, so that gating does
not depend on how the batch is split), global batch 8, float32, real seeded weights. Plans (one
gloo launch of 4 ranks runs them all; ranks outside a plan idle):

* ``dp4``: data parallel on (4, 1);
* ``tp4``: Megatron tensor parallel on (1, 4): expert weights ``mlp.wi`` S(2) / ``mlp.wo`` S(1);
* ``pp2``: 2 stages of 1 device, 2 micro-batches, 1F1B;
* ``dp2_tp2``: data x tensor parallel on (2, 2);
* ``pp2_tp2``: 2 stages of 2 devices, tensor parallel inside each;
* ``pp2_dp2_recompute``: 2 stages of 2 data-parallel devices with ``recompute=True`` (every layer
  runs under a non-reentrant activation checkpoint);
* ``dp4_zero``: ``dp4`` with every parameter of the stage in ``zero_params`` (gradients
  reduce-scattered, SGD on the local shard, parameters all-gathered once per step);
* ``dp2_tp2_zero_momentum``: ``dp2_tp2`` with ZeRO for the parameters the plan replicates on the
  data-parallel axis, trained with SGD + momentum 0.9 (its state lives on the shards only).

For each: the losses of 3 steps and the parameters after them equal single-device training within
1e-5 (relative). ``dp2_tp2_zero_momentum`` runs compiled (AOTAutograd), the others eagerly (the
same arithmetic; the compiled executor is checked against the eager one in
`tests/test_compiled.py`). The pipeline plans run on our own runner (``pipeline="ours"``);
`tests/test_runtime_torch_pipeline.py` runs MoE pipelines on torch.distributed.pipelining, one
of them compiled.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import single_device
import torch

from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.train import _random_batches

pytestmark = pytest.mark.slow  # every test reads the launch of 4 gloo ranks

SPEC = "moe:hidden=32,layers=2,experts=4,heads=4,seq=8,vocab=64,group_size=8"
LR = 0.1
STEPS = 3
#: the plans trained compiled; the others run eagerly
COMPILED = ("dp2_tp2_zero_momentum",)
ONE = "1x4xA100-80GB"
NAMES = [
    "dp4",
    "tp4",
    "pp2",
    "dp2_tp2",
    "pp2_tp2",
    "pp2_dp2_recompute",
    "dp4_zero",
    "dp2_tp2_zero_momentum",
]


@functools.cache
def _plans() -> dict[str, tuple[ParallelPlan, str]]:
    """name -> (plan, optimizer)."""
    kw = {"global_batch": 8, "dtype": "float32", "allow_oom": True}
    dp4 = manual_plan(SPEC, ONE, dp=4, tp=1, pp=1, num_microbatches=1, **kw)
    tp4 = manual_plan(SPEC, ONE, dp=1, tp=4, pp=1, num_microbatches=1, **kw)
    pp2 = manual_plan(SPEC, "1x2xA100-80GB", dp=1, tp=1, pp=2, num_microbatches=2, **kw)
    dp2tp2 = manual_plan(SPEC, ONE, dp=2, tp=2, pp=1, num_microbatches=1, **kw)
    pp2tp2 = manual_plan(SPEC, ONE, dp=1, tp=2, pp=2, num_microbatches=2, **kw)
    rec = manual_plan(
        SPEC, ONE, dp=2, tp=1, pp=2, num_microbatches=2, recompute=True, **kw
    )
    zero = copy.deepcopy(dp4)
    zero.stages[0].zero_params = sorted(zero.stages[0].param_placements)
    zero_mom = copy.deepcopy(dp2tp2)
    st = zero_mom.stages[0]
    st.zero_params = sorted(k for k, p in st.param_placements.items() if p[0] == "R")
    return {
        "dp4": (dp4, "sgd"),
        "tp4": (tp4, "sgd"),
        "pp2": (pp2, "sgd"),
        "dp2_tp2": (dp2tp2, "sgd"),
        "pp2_tp2": (pp2tp2, "sgd"),
        "pp2_dp2_recompute": (rec, "sgd"),
        "dp4_zero": (zero, "sgd"),
        "dp2_tp2_zero_momentum": (zero_mom, "momentum"),
    }


def _model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _optimizer(params: list[torch.Tensor], kind: str) -> torch.optim.Optimizer:
    momentum = 0.9 if kind == "momentum" else 0.0
    return torch.optim.SGD(params, lr=LR, momentum=momentum, foreach=False)


@functools.cache
def _reference(optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches()
    return single_device.train(
        model, batches, _optimizer(list(model.parameters()), optimizer)
    )


def _train_all(plans: dict[str, tuple[ParallelPlan, str]]) -> dict[str, Any]:
    """Body of every rank: train each plan for 3 steps; losses, full parameters, shardings."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, (plan, optimizer) in plans.items():
        model, batches = _model_and_batches()
        tr = single_device.trainer(
            plan,
            model,
            batches[0],
            SPEC,
            lr=LR,
            pipeline="ours",
            compile=name in COMPILED,
        )
        if tr.optimizer is not None:
            tr.optimizer = _optimizer(list(tr.params.values()), optimizer)
        losses = [tr.step(b) for b in batches]
        ex = tr.runner.executor
        state_numel = 0
        if tr.optimizer is not None:
            for st in tr.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.ndim > 0:
                        local = getattr(v, "_local_tensor", v)
                        state_numel += local.numel()
        out[name] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "mismatches": [] if ex is None else ex.mismatches,
            "placements": {k: str(p.placements) for k, p in tr.params.items()},
            "local_numel": sum(p.to_local().numel() for p in tr.params.values()),
            "state_numel": state_numel,
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train_all, 4, args=(_plans(),), timeout_s=400)


@pytest.mark.parametrize("name", NAMES)
def test_same_numbers_as_one_device(runs: list[dict[str, Any]], name: str) -> None:
    optimizer = _plans()[name][1]
    ref_losses, ref_params = _reference(optimizer)
    got: dict[str, torch.Tensor] = {}
    for r in runs:
        res = r[name]
        assert res["mismatches"] == []
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got.update({k: torch.from_numpy(v) for k, v in res["params"].items()})
    single_device.assert_same_parameters(got, ref_params)


def test_expert_weights_are_tensor_parallel(runs: list[dict[str, Any]]) -> None:
    places = runs[0]["tp4"]["placements"]
    assert places["blocks.0.mlp.wi"] == "(Shard(dim=2),)"
    assert places["blocks.0.mlp.wo"] == "(Shard(dim=1),)"


def test_zero_shards_parameters_and_optimizer_state(runs: list[dict[str, Any]]) -> None:
    full = sum(p.numel() for p in _reference("sgd")[1].values())
    zero = runs[0]["dp4_zero"]
    assert all("Shard" in p for p in zero["placements"].values())
    assert (
        zero["local_numel"] < full / 3
    )  # a quarter, up to parameters that do not divide
    mom = runs[0]["dp2_tp2_zero_momentum"]
    plain = runs[0]["dp2_tp2"]
    assert mom["local_numel"] < plain["local_numel"]
    # the momentum buffers live on the (ZeRO-sharded) optimizer parameters only
    assert mom["state_numel"] == mom["local_numel"]
