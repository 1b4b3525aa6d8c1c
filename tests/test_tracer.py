"""The tracer: shapes, parameters, FLOPs, saved bytes and module paths of the op graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError
from planner import trace


class TinyBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln(x)).split(h, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, h))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 50, h: int = 32, heads: int = 4, seq: int = 8
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.block = TinyBlock(h, heads)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            self.head(self.block(self.emb(tokens))).flatten(0, 1), targets.flatten()
        )


def _batch(
    b: int = 2, s: int = 8, vocab: int = 50, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, vocab, (b, s), generator=g)
    return tok.to(device), tok.roll(-1, 1).to(device)


def test_tiny_lm_graph_facts() -> None:
    b, s, h, v, heads = 2, 8, 32, 50, 4
    graph = trace(TinyLM(v, h, heads, s), _batch(b, s, v))
    assert graph.num_params == sum(
        p.numel() for p in TinyLM(v, h, heads, s).parameters()
    )
    assert list(graph.params) == [
        n for n, _ in TinyLM(v, h, heads, s).named_parameters()
    ]
    # Derivation: qkv 2*T*h*3h, proj 2*T*h*h, head 2*T*h*V (T = b*s tokens), attention 2 bmm of 2*b*s*s*h;
    # backward is 2x forward for matrix products; the embedding's input needs no gradient.
    t = b * s
    fwd = 2 * t * h * 3 * h + 2 * t * h * h + 2 * t * h * v + 2 * (2 * b * s * s * h)
    assert graph.fwd_flops == fwd
    assert graph.bwd_flops == 2 * fwd
    addmms = [n for n in graph.ops if n.target == "aten.addmm.default"]
    assert [n.module_path for n in addmms] == ["block.qkv", "block.proj"]
    assert addmms[0].params == ["block.qkv.bias", "block.qkv.weight"]
    assert addmms[0].outputs[0].shape == (t, 3 * h)
    sdpa = next(n for n in graph.ops if "scaled_dot_product" in n.target)
    assert sdpa.fwd_flops == 4 * b * s * s * h and sdpa.bwd_flops == 8 * b * s * s * h
    assert all(n.requires_grad for n in graph.ops if n.kind == "matmul")


def test_saved_activation_bytes_match_derivation() -> None:
    b, s, h, v, heads = 2, 8, 32, 50, 4
    graph = trace(TinyLM(v, h, heads, s), _batch(b, s, v))
    t, f4 = b * s, 4
    # Values autograd keeps (fp32), each once: embedding indices (int64, b*s); layer-norm input x (t*h)
    # plus mean and rstd (t each); the qkv input = layer-norm output (t*h); qkv output, whose q, k, v
    # views attention saves (3*t*h); attention output (t*h) and logsumexp (b*heads*s); proj input = the
    # attention output re-viewed (no extra storage); head input = block output (t*h); log-softmax
    # output (t*v); the targets (int64, t) and the loss's total weight (one fp32 scalar).
    expected = (
        8 * t
        + f4
        * (
            t * h
            + 2 * t
            + t * h
            + 3 * t * h
            + t * h
            + b * heads * s
            + t * h
            + t * v
            + 1
        )
        + 8 * t
    )
    assert graph.saved_activation_bytes() == expected


def test_meta_and_real_models_give_the_same_graph() -> None:
    torch.manual_seed(0)
    real = trace(TinyLM(), _batch())
    with torch.device("meta"):
        meta_model = TinyLM()
    meta = trace(meta_model, _batch(device="meta"))
    assert real.fingerprint() == meta.fingerprint()
    assert real.flops_per_iteration == meta.flops_per_iteration
    assert [n.target for n in real.ops] == [n.target for n in meta.ops]


def test_untraceable_model_names_the_line() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if y.sum() > 0:  # data-dependent control flow cannot be traced
                return y.sum()
            return -y.sum()

    with pytest.raises(MeshplanError) as err:
        trace(Bad(), torch.zeros(2, 4))
    msg = str(err.value)
    assert "\n" not in msg
    assert (
        "cannot trace Bad" in msg and "test_tracer.py" in msg and "y.sum() > 0" in msg
    )


def test_non_tensor_batch_is_rejected() -> None:
    with pytest.raises(MeshplanError, match="example batch item 0"):
        trace(TinyLM(), ("tokens",))


def test_fingerprint_ignores_batch_size_but_not_structure() -> None:
    a = trace(TinyLM(), _batch(b=2))
    assert a.fingerprint() == trace(TinyLM(), _batch(b=4)).fingerprint()
    assert a.fingerprint() != trace(TinyLM(h=64), _batch(b=2)).fingerprint()
