"""Two runtime correctness cases against single-device training (principle 7), one gloo launch.

* ``tp2_vocab``: GPT (hidden 64, 4 layers, vocab 128) on a (1, 2) mesh with a vocabulary-sharded
  embedding, as the planner picks it for ``gpt:hidden=256,...,vocab=4096``: ``wte`` S(0), the
  embedding's output ``P(mask)`` (DTensor's ``_MaskPartial``), the residual stream after the first
  add kept partial (``P``). Before `runtime.redistribute.unmask`, the second step's embedding failed
  with "MaskBuffer has been materialized with conflicting data" (the first step's mask was never
  released). SGD, 3 steps: losses and parameters equal one device within 1e-5.
* ``*_adam``: torch.optim.Adam (lr 1e-3) on data-parallel plans with and without ZeRO-2
  (`manual_plan(fsdp="zero2")`, Megatron-Core's distributed optimizer as priced;
  ``zero_params``: the parameter the optimizer updates, and its Adam state, sharded on the
  data-parallel axis), 3 steps. ZeRO's parameters equal those of the plan without ZeRO up to the
  order of gloo's sums (it reduce-scatters what the plain plan all-reduces); against one device
  both agree within 1e-5 everywhere except in the attention's key bias. Its gradient is zero in exact arithmetic (softmax is invariant to adding
  ``q . b_k`` to every logit of a query) and rounding noise (~1e-11) in floating point; Adam divides
  the gradient by its own magnitude, so the key bias takes steps of up to ``lr`` driven by that noise,
  which differs with the order of the sums (a batch split across ranks or micro-batches; one device
  against itself with two micro-batches differs there too). That was the "3% off" seen with Adam
  (it is the same without ZeRO). The test checks that this gradient is noise on one device and
  excludes those entries from the 1e-5 comparison. At lr 0.1 those noise-driven steps moved the
  next steps' activations enough to put other parameters 1e-4 off once the data-parallel plans
  split every activation by the batch (the weight gradients then sum in another order than on
  one device); at lr 1e-3 every parameter is within 1e-5, while a wrong ZeRO update (a shard's
  update lost, or applied to another shard) would still be off by ~lr per step.

``tp2_vocab`` runs compiled (AOTAutograd), the Adam plans eagerly (the same arithmetic; ZeRO
compiled is trained in `tests/test_runtime_moe.py` and `tests/test_tied_params.py`).
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

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
HIDDEN, HEADS, VOCAB = 64, 4, 128
ONE = "1x4xA100-80GB"
STEPS = 3
SGD_LR = 0.1
ADAM_LR = 1e-3
KW = {"global_batch": 8, "dtype": "float32", "allow_oom": True}


def _vocab_sharded(plan: ParallelPlan) -> ParallelPlan:
    """`plan` (tensor parallel on the mesh's second axis) with the embedding sharded by vocabulary
    and its output kept partial into the first add, as the ILP chooses for a large vocabulary."""
    p = copy.deepcopy(plan)
    st = p.stages[0]
    st.param_placements["wte.weight"] = ["R", "S(0)"]
    st.node_strategies["embedding"] = {
        "inputs": [["R", "S(0)"], ["R", "R"]],
        "outputs": [["R", "P(mask)"]],
    }
    st.node_strategies["add"] = {
        "inputs": [["R", "P"], ["R", "P"]],
        "outputs": [["R", "P"]],
    }
    return p


@functools.cache
def _plans() -> dict[str, tuple[ParallelPlan, str]]:
    """name -> (plan, optimizer)."""
    tp2 = manual_plan(SPEC, "1x2xA100-80GB", dp=1, tp=2, pp=1, num_microbatches=1, **KW)
    dp4 = manual_plan(SPEC, ONE, dp=4, tp=1, pp=1, num_microbatches=1, **KW)
    dp2tp2 = manual_plan(SPEC, ONE, dp=2, tp=2, pp=1, num_microbatches=1, **KW)
    # Megatron-Core's distributed optimizer as manual_plan prices it: every parameter ZeRO-2
    # on the data-parallel axis (each is replicated there), placed as without it
    zero = {
        "dp4": manual_plan(
            SPEC, ONE, dp=4, tp=1, pp=1, num_microbatches=1, fsdp="zero2", **KW
        ),
        "dp2tp2": manual_plan(
            SPEC, ONE, dp=2, tp=2, pp=1, num_microbatches=1, fsdp="zero2", **KW
        ),
    }
    for name, plain in (("dp4", dp4), ("dp2tp2", dp2tp2)):
        st = zero[name].stages[0]
        assert sorted(st.zero_params) == sorted(st.param_placements)
        assert st.param_placements == plain.stages[0].param_placements
    dp4_zero, dp2tp2_zero = zero["dp4"], zero["dp2tp2"]
    return {
        "tp2_vocab": (_vocab_sharded(tp2), "sgd"),
        "dp4_adam": (dp4, "adam"),
        "dp4_zero_adam": (dp4_zero, "adam"),
        "dp2_tp2_adam": (dp2tp2, "adam"),
        "dp2_tp2_zero_adam": (dp2tp2_zero, "adam"),
    }


def _model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _optimizer(params: list[torch.Tensor], kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR, foreach=False)
    return torch.optim.SGD(params, lr=SGD_LR, foreach=False)


@functools.cache
def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches()
    return single_device.train(
        model, batches, _optimizer(list(model.parameters()), kind)
    )


def _landed(grads: dict[str, tuple[int, ...]], k: str, t: torch.Tensor) -> None:
    """Post-accumulate-grad hook: the local shape of parameter `k`'s first gradient."""
    grads.setdefault(k, tuple(t.grad._local_tensor.shape))


def _train_all(plans: dict[str, tuple[ParallelPlan, str]]) -> dict[str, Any]:
    """Body of every rank: train each plan for 3 steps (ranks outside a plan idle); losses, full
    parameters, local sizes of the parameters and of Adam's state."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for name, (plan, kind) in plans.items():
        model, batches = _model_and_batches()
        lr = ADAM_LR if kind == "adam" else SGD_LR
        compile = name == "tp2_vocab"  # the Adam plans eagerly (module docstring)
        tr = single_device.trainer(
            plan, model, batches[0], SPEC, optimizer=kind, lr=lr, compile=compile
        )
        # each gradient's local shape when it lands
        grads: dict[str, tuple[int, ...]] = {}

        for k, p in tr.params.items():
            p.register_post_accumulate_grad_hook(functools.partial(_landed, grads, k))
        losses = [tr.step(b) for b in batches]
        ex = tr.runner.executor
        state = tr.optimizer.state if tr.optimizer is not None else {}
        out[name] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "mismatches": [] if ex is None else ex.mismatches,
            "param_local": {k: p._local_tensor.numel() for k, p in tr.params.items()},
            "param_shape": {
                k: tuple(p._local_tensor.shape) for k, p in tr.params.items()
            },
            "grad_shape": grads,
            "state_local": {
                k: state[p]["exp_avg"]._local_tensor.numel()
                for k, p in tr.params.items()
                if kind == "adam"
            },
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train_all, 4, args=(_plans(),), timeout_s=400)


def _key_bias(t: torch.Tensor) -> torch.Tensor:
    """The key part of a head-major ``qkv.bias`` (``[heads, (q, k, v), head_dim]``)."""
    return t.view(HEADS, 3, HIDDEN // HEADS)[:, 1]


def _without_key_bias(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in params.items():
        if k.endswith("attn.qkv.bias"):
            p = p.view(HEADS, 3, HIDDEN // HEADS)[:, [0, 2]].reshape(-1)
        out[k] = p
    return out


@pytest.mark.slow
def test_vocab_sharded_embedding_trains_like_one_device(
    runs: list[dict[str, Any]],
) -> None:
    ref_losses, ref_params = _reference("sgd")
    for rank in (0, 1):
        res = runs[rank]["tp2_vocab"]
        # DTensor gave the embedding's planned output, P(mask), every time (else a mismatch)
        assert res["mismatches"] == []
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got = {k: torch.from_numpy(v) for k, v in res["params"].items()}
        single_device.assert_same_parameters(got, ref_params)
        # the table's gradient is this rank's rows, as the plan prices it, not the whole
        # vocabulary DTensor's backward rule gives (`runtime.vocab_embedding`)
        assert res["grad_shape"]["wte.weight"] == res["param_shape"]["wte.weight"]
        assert res["param_shape"]["wte.weight"] == (VOCAB // 2, HIDDEN)


def test_key_bias_gradient_is_rounding_noise() -> None:
    """On one device: the key bias's gradient is ~1e-11 while the query's and value's are not."""
    model, batches = _model_and_batches()
    model(*batches[0]).backward()
    for name, p in model.named_parameters():
        if name.endswith("attn.qkv.bias"):
            g = p.grad.view(HEADS, 3, HIDDEN // HEADS)
            assert g[:, 1].abs().max() < 1e-6 * g[:, 2].abs().max(), name


@pytest.mark.parametrize("name", ["dp4_zero_adam", "dp2_tp2_zero_adam"])
@pytest.mark.slow
def test_zero_adam_matches_one_device(runs: list[dict[str, Any]], name: str) -> None:
    ref_losses, ref_params = _reference("adam")
    base = name.replace("_zero", "")
    for rank, r in enumerate(runs):
        res = r[name]
        assert res["mismatches"] == []
        if base == "dp2_tp2_adam":  # vocabulary-parallel on tp, its tokens split on dp
            plain = r[base]
            assert (
                plain["grad_shape"]["wte.weight"] == plain["param_shape"]["wte.weight"]
            )
            assert plain["param_shape"]["wte.weight"] == (VOCAB // 2, HIDDEN)
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        # ZeRO changes where the update happens, not what it computes (up to the order of
        # gloo's sums: it reduce-scatters what the plain plan all-reduces); the key bias, whose
        # gradient is rounding noise that Adam normalises, is left out.
        got = {k: torch.from_numpy(v) for k, v in res["params"].items()}
        plain = {k: torch.from_numpy(v) for k, v in r[base]["params"].items()}
        plain = _without_key_bias(plain)
        for k, v in _without_key_bias(got).items():
            torch.testing.assert_close(
                v, plain[k], rtol=1e-5, atol=1e-6, msg=f"{rank} {k}"
            )
        single_device.assert_same_parameters(
            _without_key_bias(got), _without_key_bias(ref_params)
        )
        # Adam's state lives on the shard: as many local entries as the local parameter
        assert res["state_local"] == res["param_local"]
    zero = _plans()[name][0].stages[0].zero_params
    sharded = [
        k for k in zero if runs[0][name]["param_local"][k] < ref_params[k].numel()
    ]
    assert sharded, "no ZeRO parameter was sharded"
