"""Backward ops DTensor cannot run while it runs their forward ops: the rules of
planner.vocab.backward_rules (ReLU6, Hardtanh, Hardswish, Hardsigmoid, LogSigmoid, Softshrink,
Hardshrink; average pooling, local response norm, adaptive max pooling; PReLU; GroupNorm, whose
batch size must be made local) and the backward ops of a replicated fallback op
(`planner.vocab.dtensor_ext.register_fallback`: LSTM's, Unfold's, EmbeddingBag's). Without
them any plan that sharded such an op, or planned one replicated, failed at its first backward
(an EmbeddingBag failed earlier, in planning).

Ground truth: plain PyTorch on one process. On 4 gloo processes in one launch:
* each op's output and gradients on a 2 x 2 mesh, the input sharded on both axes, and
  replicated with a column-parallel product after it, which hands the op's backward a Partial
  gradient;
* plain-PyTorch models trained 3 SGD steps, eagerly, to one device's losses and parameters:
  one with these ops in its MLPs under tensor x data parallelism (tp2 x dp2, the ops' inputs
  sharded along the MLP's hidden dimension) and the automatic plan for a CPU cluster; an LSTM,
  an Unfold, a GroupNorm without weights and an EmbeddingBag, under dp4.
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
from planner.vocab.dtensor_ext import backward_ops
from runtime.launch import launch
from runtime.train import _random_batches

aten = torch.ops.aten

ACTIVATIONS = {
    "relu6": F.relu6,
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.75),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "logsigmoid": F.logsigmoid,
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, 0.3),
}
#: name -> (f(x, weight), shape of x, the dims of x the mesh axes split); weight: one per
#: channel (dim 1), used by PReLU and GroupNorm
CASES = {
    name: (lambda x, w, f=f: f(x), (8, 12), (0, 1)) for name, f in ACTIVATIONS.items()
}
CASES |= {
    "avg_pool2d": (lambda x, w: F.avg_pool2d(x, 2), (4, 4, 6, 6), (0, 1)),
    "avg_pool1d": (lambda x, w: F.avg_pool1d(x, 3, 1, 1), (4, 4, 6), (0, 1)),
    "avg_pool3d": (lambda x, w: F.avg_pool3d(x, 2), (4, 4, 2, 4, 4), (0, 1)),
    "local_response_norm": (
        lambda x, w: F.local_response_norm(x, 2),
        (4, 4, 6, 6),
        (0, 1),
    ),
    "adaptive_max_pool2d": (
        lambda x, w: F.adaptive_max_pool2d(x, 3),
        (4, 4, 6, 6),
        (0, 1),
    ),
    "adaptive_max_pool3d": (
        lambda x, w: F.adaptive_max_pool3d(x, 2),
        (4, 4, 2, 4, 4),
        (0, 1),
    ),
    "prelu": (F.prelu, (4, 4, 6), (0, 2)),
    # the batch of 4 over both axes: one row per device, where a global N would be wrong
    "group_norm": (lambda x, w: F.group_norm(x, 2, w, w * 0.5), (4, 4, 6), (0, 0)),
    "group_norm_plain": (lambda x, w: F.group_norm(x, 2), (4, 4, 3, 2), (0, 0)),
}
V, H, S, BATCH, LR, STEPS = 64, 16, 8, 8, 0.1, 3


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    """x, PReLU's weight, a weight for the product after the op, the output's gradient."""
    f, shape, _ = CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    weight = torch.rand(shape[1], generator=gen, dtype=torch.float64)
    out = f(x, weight)
    w = torch.randn(out[0].numel(), 6, generator=gen, dtype=torch.float64)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return x, weight, w, g


def _values(name: str, x1, x2, weight, w, g) -> dict[str, torch.Tensor]:
    """Output and input (and weight) gradients of op(x1) weighted by g, and of the op's output
    flattened times w, on x2 (the op's gradient Partial where w is split by columns)."""
    f = CASES[name][0]
    y = f(x1, weight)
    (y * g).sum().backward()
    (f(x2, weight).flatten(1) @ w).sum().backward()
    out = {"y": y.detach(), "grad": x1.grad, "grad_partial": x2.grad}
    return out | ({"grad_weight": weight.grad} if weight.grad is not None else {})


def _reference(name: str) -> dict[str, torch.Tensor]:
    """`_values` on plain tensors."""
    x, weight, w, g = _inputs(name)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    return _values(name, x1, x2, weight.requires_grad_(), w, g)


def _on_mesh() -> dict[str, dict[str, Any]]:
    """Body of every rank: `_values` on DTensors of a 2 x 2 mesh, x (and the output's gradient)
    sharded as `CASES` says, then replicated with
    w split by columns; as numpy arrays (a tensor would cross to the launching process in
    shared memory this rank frees)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from planner.vocab.dtensor_ext import register_missing_rules

    register_missing_rules()
    mesh = init_device_mesh("cpu", (2, 2))
    R = [Replicate(), Replicate()]
    out = {}
    for name in CASES:
        x, weight, w, g = _inputs(name)
        split = [Shard(d) for d in CASES[name][2]]
        got = _values(
            name,
            distribute_tensor(x, mesh, split).requires_grad_(),
            distribute_tensor(x, mesh, R).requires_grad_(),
            distribute_tensor(weight, mesh, R).requires_grad_(),
            distribute_tensor(w, mesh, [Replicate(), Shard(1)]),
            distribute_tensor(g, mesh, split),
        )
        out[name] = {k: v.full_tensor().detach().numpy() for k, v in got.items()}
    return out


class Net(nn.Module):
    """Embedding, MLP blocks (names as GPT's, so Megatron's column- then row-parallel placements
    apply) with two of `ACTIVATIONS` each, then one with a per-channel PReLU and an average pool
    over the sequence between its products, LM head and cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList()
        acts = list(ACTIVATIONS)
        for k in range(0, len(acts) + 1, 2):
            block = nn.Module()
            block.ln = nn.LayerNorm(H)
            block.mlp = nn.Module()
            block.mlp.fc, block.mlp.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
            block.acts = acts[k : k + 2]
            if not block.acts:
                block.prelu = nn.PReLU(4 * H, init=0.1)
            self.blocks.append(block)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for b in self.blocks:
            h = b.mlp.fc(b.ln(x))
            for name in b.acts:
                h = ACTIVATIONS[name](h)
            if not b.acts:  # channels (4H) along dim 1, as PReLU and pooling take them
                h = F.avg_pool1d(b.prelu(h.transpose(1, 2)), 3, 1, 1).transpose(1, 2)
            x = x + b.mlp.proj(h)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


class LSTMNet(nn.Module):
    """Embedding, an LSTM (aten's ``mkldnn_rnn_layer``, planned replicated), LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.rnn = nn.Embedding(V, H), nn.LSTM(H, H, batch_first=True)
        self.lm_head = nn.Linear(H, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.wte(idx))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), targets.flatten())


class UnfoldNet(nn.Module):
    """Each position's embedding beside the one before it by ``F.unfold`` (``im2col``, planned
    replicated; its backward is ``col2im``), then a product and the LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.fc = nn.Embedding(V, H), nn.Linear(2 * H, H)
        self.lm_head = nn.Linear(H, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx).transpose(1, 2).unsqueeze(-1)
        pairs = F.unfold(x, (2, 1), padding=(1, 0))[..., :S].transpose(1, 2)
        return F.cross_entropy(
            self.lm_head(self.fc(pairs)).flatten(0, 1), targets.flatten()
        )


class GroupNormNet(nn.Module):
    """A product, GroupNorm without weights over the hidden units as channels, the LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.fc = nn.Embedding(V, H), nn.Linear(H, H)
        self.norm, self.lm_head = nn.GroupNorm(4, H, affine=False), nn.Linear(H, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.fc(self.wte(idx)).transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


class BagNet(nn.Module):
    """Each position's tokens and the one before it summed by ``nn.EmbeddingBag``
    (``_embedding_bag``, planned replicated; traced as the inference-only kernel before
    `planner.tracing.tracer.TRAINING_KERNELS`), then the LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.lm_head = nn.EmbeddingBag(V, H, mode="sum"), nn.Linear(H, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pairs = torch.stack([idx, idx.roll(1, dims=1)], dim=-1).flatten(0, 1)
        return F.cross_entropy(self.lm_head(self.bag(pairs)), targets.flatten())


#: model -> (class, its manual plan's (dp, tp))
MODELS = {
    "activations": (Net, (2, 2)),
    "lstm": (LSTMNet, (4, 1)),
    "unfold": (UnfoldNet, (4, 1)),
    "group_norm": (GroupNormNet, (4, 1)),
    "embedding_bag": (BagNet, (4, 1)),
}


def _model_and_batches(name: str) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    example = (torch.randint(0, V, (BATCH, S)), torch.randint(0, V, (BATCH, S)))
    return model, _random_batches(example, STEPS, seed=1)


@functools.cache
def _plans() -> dict[tuple[str, str], Any]:
    """(model, "manual" or "auto") -> plan."""
    kw = {"global_batch": BATCH, "dtype": "float32"}
    out = {}
    for name, (_, (dp, tp)) in MODELS.items():
        model, batches = _model_and_batches(name)
        out[name, "manual"] = manual_plan(
            model,
            "1x4xA100-80GB",
            batches[0],
            dp=dp,
            tp=tp,
            pp=1,
            num_microbatches=1,
            **kw,
        )
        if name == "activations":  # the others' automatic plans are dp4 or replicated
            out[name, "auto"] = plan(model, cpu_cluster(4), batches[0], **kw)
    return out


def _train(plans: dict[tuple[str, str], Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {"mesh": _on_mesh()}
    for (name, case), p in plans.items():
        model, batches = _model_and_batches(name)
        # eager: DTensor runs the ops step by step (compiling traced the same ops through
        # DTensor once, and took the launch from 8.5 s to 20.6 s)
        tr = single_device.trainer(p, model, batches[0], name, lr=LR, compile=False)
        losses = [tr.step(b) for b in batches]
        params = {k: v.numpy().copy() for k, v in tr.full_params().items()}
        out[name, case] = {"losses": losses, "params": params}
    return out


@functools.cache
def _runs() -> list[dict[str, Any]]:
    return launch(_train, 4, args=(_plans(),), timeout_s=600)


def test_fallback_backward_ops_are_found_on_meta() -> None:
    """`backward_ops` lists the ops a derivative formula calls (Unfold's ``col2im``, LSTM's
    ``mkldnn_rnn_layer_backward``), not views, and nothing for an op without a derivative."""

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    unfold = backward_ops(
        aten.im2col.default, (meta(2, 8, 3, 1), [2, 1], [1, 1], [1, 0], [1, 1]), {}
    )
    assert aten.col2im.default in unfold
    lstm_args = (
        meta(3, 2, 4),
        meta(16, 4),
        meta(16, 4),
        meta(16),
        meta(16),
        meta(2, 4),
        meta(2, 4),
    )
    lstm_args += (False, [], 2, 4, 1, True, False, True, True)
    assert aten.mkldnn_rnn_layer_backward.default in backward_ops(
        aten.mkldnn_rnn_layer.default, lstm_args, {}
    )
    views = backward_ops(aten.permute.default, (meta(2, 3), [1, 0]), {})
    assert aten.permute.default not in views and all(
        not any(r.alias_info for r in f._schema.returns) for f in views
    )
    assert backward_ops(aten.argmax.default, (meta(2, 3),), {}) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_backward_on_sharded_and_partial_values(name: str) -> None:
    want = _reference(name)
    for rank in _runs():
        got = rank["mesh"][name]
        for k, v in want.items():
            torch.testing.assert_close(
                torch.from_numpy(got[k]), v, rtol=1e-12, atol=1e-12, msg=k
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, case", [(m, "manual") for m in MODELS] + [("activations", "auto")]
)
def test_models_train_like_one_device(name: str, case: str) -> None:
    model, batches = _model_and_batches(name)
    ref_losses, ref_params = single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )
    params: dict[str, torch.Tensor] = {}
    for r in _runs():
        assert r[name, case]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        params |= {k: torch.from_numpy(v) for k, v in r[name, case]["params"].items()}
    single_device.assert_same_parameters(params, ref_params)
