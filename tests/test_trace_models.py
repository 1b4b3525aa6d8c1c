"""Tracing the built-in models: parameter counts and FLOPs against closed-form derivations."""

from __future__ import annotations

import math

import pytest

from planner import trace
from planner.models import build_model, get_config
from planner.models.moe import MoEConfig

GPT_NAMES = [
    "gpt-125m",
    "gpt-350m",
    "gpt-760m",
    "gpt-1.3b",
    "gpt-2.6b",
    "gpt-6.7b",
    "gpt-15b",
    "gpt-39b",
]
CUSTOM_GPT = "gpt:hidden=1024,layers=6,heads=8,seq=512,vocab=32000"


def _module_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", GPT_NAMES + [CUSTOM_GPT])
def test_gpt_params_and_flops(name: str) -> None:
    b = 2
    model, batch = build_model(name, batch=b, device="meta")
    graph = trace(model, batch, model_name=name)
    assert graph.num_params == _module_params(model)
    c = get_config(name)
    s, L, h, V = c.seq, c.layers, c.hidden, c.vocab
    # Megatron-LM (Narayanan et al. 2021, eq. 3 without recomputation): 3 x forward.
    expected = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert graph.flops_per_iteration == pytest.approx(expected, rel=0.02)


def test_moe_params_and_flops() -> None:
    name, b = (
        "moe:hidden=256,layers=4,experts=8,heads=4,seq=256,vocab=1000,group_size=128",
        2,
    )
    model, batch = build_model(name, batch=b, device="meta")
    graph = trace(model, batch, model_name=name)
    assert graph.num_params == _module_params(model)
    c: MoEConfig = get_config(name)
    h, s, V, E, f = c.hidden, c.seq, c.vocab, c.experts, c.ffn * c.hidden
    T = b * s
    S = c.group_for(T)
    G, C = T // S, c.capacity(S)
    attention = (
        2 * T * h * 3 * h + 2 * T * h * h + 4 * b * s * s * h
    )  # qkv, proj, QK^T and AV
    dense_mlp = 2 * T * h * f * 2
    gate = 2 * T * h * E
    dispatch = 2 * G * S * E * C * h  # einsum gsec,gsm->egcm contracts over S
    experts = 2 * (E * G * C) * h * f * 2  # wi and wo on E*G*C token slots
    combine = 2 * G * S * E * C * h  # einsum gsec,egcm->gsm contracts over (E, C)
    head = 2 * T * h * V
    n_moe = sum(c.is_moe_layer(i) for i in range(c.layers))
    n_dense = c.layers - n_moe
    fwd = (
        c.layers * attention
        + n_dense * dense_mlp
        + n_moe * (gate + dispatch + experts + combine)
        + head
    )
    # Backward is 2x forward for every product, except the dispatch einsum: its 0/1 mask needs no
    # gradient, so only the tokens' gradient is computed (1x).
    bwd = 2 * fwd - n_moe * dispatch
    assert graph.fwd_flops == fwd
    assert graph.bwd_flops == bwd


def test_wresnet_params_and_flops() -> None:
    name, b = "wresnet:layers=26,channels=16,width=2,image=64,classes=10", 2
    model, batch = build_model(name, batch=b, device="meta")
    graph = trace(model, batch, model_name=name)
    assert graph.num_params == _module_params(model)
    c = get_config(name)

    def conv(cin: int, cout: int, k: int, side_out: int) -> int:
        return 2 * b * side_out * side_out * cout * cin * k * k

    side = math.floor((c.image + 2 * 3 - 7) / 2) + 1  # stem conv 7x7/2, padding 3
    stem = conv(3, c.channels, 7, side)
    side = math.floor((side + 2 - 3) / 2) + 1  # max-pool 3x3/2, padding 1
    body, cin = 0, c.channels
    for i, blocks in enumerate(c.stages):
        f = c.channels * 2**i
        for j in range(blocks):
            stride = 2 if i > 0 and j == 0 else 1
            out = side // stride
            body += (
                conv(cin, f, 1, side)
                + conv(f, f * c.width, 3, out)
                + conv(f * c.width, 4 * f, 1, out)
            )
            if cin != 4 * f or stride != 1:
                body += conv(cin, 4 * f, 1, out)
            side, cin = out, 4 * f
    fc = 2 * b * cin * c.classes
    assert graph.fwd_flops == stem + body + fc
    # Backward: input and weight gradients (2x) everywhere but the stem, whose input (the images)
    # needs no gradient (1x).
    assert graph.bwd_flops == stem + 2 * (body + fc)


EXPLICIT = [
    "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,attn=explicit,attn_dropout=0.1",
    "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,attn=explicit-batch,attn_dropout=0.1",
    "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16,attn=explicit",
]


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_attention_flops_equal_the_closed_form(name: str) -> None:
    """Explicit attention (``attn=explicit``: scores, masked softmax, dropout, product with v)
    traces two batched products of ``2 B n s^2 d = 2 B s^2 h`` FLOPs each forward, over all s x s
    positions as the fused op is counted; softmax, mask and dropout count no FLOPs. Backward is
    twice the forward. GPT: ``24 T h^2`` per block in its four projections, Llama: q, k, v, o and
    three SwiGLU products; then the head ``2 T h V``."""
    batch = 3
    model, b = build_model(name, batch=batch, device="meta")
    graph = trace(model, b, model_name=name)
    c = get_config(name)
    T, s, h = batch * c.seq, c.seq, c.hidden
    if name.startswith("gpt"):
        projections = 24 * T * h * h
    else:
        kv = c.kv_heads * c.head_dim
        projections = 2 * T * h * (2 * h + 2 * kv) + 2 * T * h * c.ffn * 3
    forward = c.layers * (projections + 4 * batch * s * s * h) + 2 * T * h * c.vocab
    assert graph.fwd_flops == forward
    assert graph.bwd_flops == 2 * forward
    targets = {n.target for n in graph.ops}
    assert "aten.bmm.default" in targets and "aten._softmax.default" in targets
    assert not any("scaled_dot_product" in t for t in targets)
    assert ("aten.bernoulli.p" in targets) == name.startswith("gpt")  # dropout 0.1 / 0


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_explicit_attention_computes_what_the_fused_kernel_does(family: str) -> None:
    """Without dropout, the written-out attention gives the fused kernel's loss and gradients."""
    import torch

    spec = (
        "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128"
        if family == "gpt"
        else "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
    )
    results = []
    for attn in ("fused", "explicit", "explicit-batch"):
        torch.manual_seed(0)
        model, batch = build_model(f"{spec},attn={attn}", batch=2)
        loss = model(*batch)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (l0, g0), *others = results
    for l1, g1 in others:
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
