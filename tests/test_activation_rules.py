"""planner.vocab.dtensor_ext's rules for the backward ops of elementwise activations
(`ELEMENTWISE_BACKWARD`): without them DTensor cannot run the backward of ReLU6, Hardtanh,
Hardswish, Hardsigmoid, LogSigmoid, Softshrink or Hardshrink on sharded tensors (their forward
runs), so any plan that sharded one failed at its first backward.

Ground truth: plain PyTorch on one process. On 4 gloo processes in one launch:
* each activation's output and input gradient on a 2 x 2 mesh, the input sharded on both axes
  (S(0), S(1)) and replicated with a column-parallel product after it, which hands the
  activation's backward a Partial gradient;
* a plain-PyTorch model with these activations in its MLPs trained 3 SGD steps under tensor x
  data parallelism (tp2 x dp2, the activations' inputs sharded along their last dimension) and
  under the automatic plan for a CPU cluster, to one device's losses and parameters.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch
import torch.nn.functional as F
from profiles import cpu_cluster
from torch import nn

from planner import plan
from planner.plans.manual import manual_plan
from runtime.launch import launch
from runtime.train import _random_batches

ACTIVATIONS = {
    "relu6": F.relu6,
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.75),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "logsigmoid": F.logsigmoid,
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, 0.3),
}
V, H, S, BATCH, LR, STEPS = 64, 16, 8, 8, 0.1, 3


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 12, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(12, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    return x, w, g


def _reference(name: str) -> dict[str, torch.Tensor]:
    """Output and input gradients of both cases on plain tensors."""
    x, w, g = _inputs()
    act = ACTIVATIONS[name]
    x1 = x.clone().requires_grad_()
    y = act(x1)
    (y * g).sum().backward()
    x2 = x.clone().requires_grad_()
    (act(x2) @ w).sum().backward()
    return {"y": y.detach(), "grad": x1.grad, "grad_partial": x2.grad}


def _on_mesh() -> dict[str, dict[str, Any]]:
    """Body of every rank: `_reference`'s values computed on DTensors of a 2 x 2 mesh (as numpy
    arrays: a tensor would cross to the launching process in shared memory this rank frees)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from planner.vocab.dtensor_ext import register_missing_rules

    register_missing_rules()
    mesh = init_device_mesh("cpu", (2, 2))
    x, w, g = _inputs()
    out = {}
    for name, act in ACTIVATIONS.items():
        x1 = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
        y = act(x1)
        (y * distribute_tensor(g, mesh, [Shard(0), Shard(1)])).sum().backward()
        x2 = distribute_tensor(x, mesh, [Replicate(), Replicate()]).requires_grad_()
        (act(x2) @ distribute_tensor(w, mesh, [Replicate(), Shard(1)])).sum().backward()
        out[name] = {
            "y": y.full_tensor().detach().numpy(),
            "grad": x1.grad.full_tensor().numpy(),
            "grad_partial": x2.grad.full_tensor().numpy(),
        }
    return out


class Net(nn.Module):
    """Embedding, one MLP block per activation pair (names as GPT's, so Megatron's column- then
    row-parallel placements apply), LM head and cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList()
        acts = list(ACTIVATIONS)
        for k in range(0, len(acts), 2):
            block = nn.Module()
            block.ln = nn.LayerNorm(H)
            block.mlp = nn.Module()
            block.mlp.fc, block.mlp.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
            block.acts = acts[k : k + 2]
            self.blocks.append(block)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for b in self.blocks:
            h = b.mlp.fc(b.ln(x))
            for name in b.acts:
                h = ACTIVATIONS[name](h)
            x = x + b.mlp.proj(h)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


def _model_and_batches() -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = Net()
    example = (torch.randint(0, V, (BATCH, S)), torch.randint(0, V, (BATCH, S)))
    return model, _random_batches(example, STEPS, seed=1)


@functools.cache
def _plans() -> dict[str, Any]:
    model, batches = _model_and_batches()
    kw = {"global_batch": BATCH, "dtype": "float32"}
    tp = manual_plan(
        model, "1x4xA100-80GB", batches[0], dp=2, tp=2, pp=1, num_microbatches=1, **kw
    )
    return {
        "tp2_dp2": tp,
        "auto": plan(model, cpu_cluster(4), batches[0], **kw),
    }


def _train(plans: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"mesh": _on_mesh()}
    for case, p in plans.items():
        model, batches = _model_and_batches()
        tr = single_device.trainer(p, model, batches[0], "activations", lr=LR)
        losses = [tr.step(b) for b in batches]
        params = {k: v.numpy().copy() for k, v in tr.full_params().items()}
        out[case] = {"losses": losses, "params": params}
    return out


@functools.cache
def _runs() -> list[dict[str, Any]]:
    return launch(_train, 4, args=(_plans(),), timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_backward_on_sharded_and_partial_values(name: str) -> None:
    want = _reference(name)
    for rank in _runs():
        got = rank["mesh"][name]
        for k, v in want.items():
            torch.testing.assert_close(
                torch.from_numpy(got[k]), v, rtol=1e-12, atol=1e-12, msg=k
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2_dp2", "auto"])
def test_activations_train_like_one_device(case: str) -> None:
    model, batches = _model_and_batches()
    ref_losses, ref_params = single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )
    params: dict[str, torch.Tensor] = {}
    for r in _runs():
        assert r[case]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        params |= {k: torch.from_numpy(v) for k, v in r[case]["params"].items()}
    single_device.assert_same_parameters(params, ref_params)
