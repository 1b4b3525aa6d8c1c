"""Memory model: model state per parameter, ZeRO sharding, activations, micro-batches in flight."""

from __future__ import annotations

import pytest
import torch
from closed_forms import gpt_layer_activation_bytes

from cost_models import (
    MeshplanError,
    microbatches_in_flight,
    param_state_bytes,
    stage_peak_bytes,
    state_bytes_per_param,
)
from planner.inter.range_costs import range_footprint
from planner.inter.stage_table import LayerProfile
from planner.models import gpt
from planner.tracing import tracer

# GPT-1.3B of Alpa's suite
H, L, V, S, HEADS = 2048, 24, 51200, 1024, 32


def gpt_params(h: int, layers: int, vocab: int, seq: int) -> int:
    """wte + wpe + layers * (qkv 3h^2+3h, proj h^2+h, fc 4h^2+4h, proj 4h^2+h, two LayerNorms 4h)
    + ln_f 2h + an untied lm_head (no bias)."""
    per_layer = (
        (3 * h * h + 3 * h)
        + (h * h + h)
        + (4 * h * h + 4 * h)
        + (4 * h * h + h)
        + 4 * h
    )
    assert per_layer == 12 * h * h + 13 * h
    return vocab * h + seq * h + layers * per_layer + 2 * h + vocab * h


def test_gpt_1_3b_parameter_count():
    n = gpt_params(H, L, V, S)
    # 2 * 51200 * 2048 + 1024 * 2048 + 24 * (12 * 2048^2 + 13 * 2048) + 2 * 2048
    assert n == 209_715_200 + 2_097_152 + 1_208_598_528 + 4_096 == 1_420_414_976
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(hidden=H, layers=L, heads=HEADS, seq=S, vocab=V))
    assert sum(p.numel() for p in model.parameters()) == n


def test_adam_mixed_precision_is_16_bytes_per_parameter():
    n = gpt_params(H, L, V, S)
    assert param_state_bytes(n, "adam_mixed") == 16 * n
    s = state_bytes_per_param("adam_mixed")
    assert (s.param, s.grad, s.optimizer) == (
        2,
        2,
        12,
    )  # fp16 weights, fp16 grads, fp32 master+m+v
    assert state_bytes_per_param("adam_fp32").total == 16  # 4 + 4 + 8
    assert state_bytes_per_param("sgd").total == 8
    assert state_bytes_per_param("sgd_momentum").total == 12
    with pytest.raises(MeshplanError):
        state_bytes_per_param("lamb")


def test_param_state_bytes_with_placement_and_zero():
    """Adam in mixed precision: 2 + 2 + 12 bytes per parameter; a placement sharding it 4 ways
    divides all three, ZeRO over 8 replicas the gradient and optimizer state further."""
    n = 1_000_000
    assert param_state_bytes(n) == 16 * n
    assert param_state_bytes(n, shards=4) == 4 * n
    assert param_state_bytes(n, shards=4, zero_shards=8) == pytest.approx(
        n / 4 * (2 + 14 / 8)
    )
    assert param_state_bytes(n, "sgd") == 8 * n
    with pytest.raises(MeshplanError):
        param_state_bytes(n, zero_shards=0)


def our_block_saved_bytes(s: int, b: int, h: int, a: int, p: int) -> int:
    """Every tensor autograd keeps for one planner.models.gpt.Block (F.scaled_dot_product_attention)."""
    tokens = s * b
    saved = {
        "ln_1 input x": p * tokens * h,
        "ln_1 mean": 4 * tokens,
        "ln_1 rstd": 4 * tokens,
        "qkv input = ln_1(x)": p * tokens * h,
        "qkv output (q, k, v views)": p * tokens * 3 * h,
        "attention output (= proj input)": p * tokens * h,
        "attention logsumexp": 4 * b * a * s,
        "ln_2 input (residual)": p * tokens * h,
        "ln_2 mean": 4 * tokens,
        "ln_2 rstd": 4 * tokens,
        "fc input = ln_2 output": p * tokens * h,
        "gelu input = fc output": p * tokens * 4 * h,
        "mlp.proj input = gelu output": p * tokens * 4 * h,
    }
    return sum(saved.values())


@pytest.mark.parametrize(
    "s, b, h, a, p", [(S, 1, H, HEADS, 2), (S, 8, H, HEADS, 2), (128, 4, 256, 4, 4)]
)
def test_gpt_layer_activation_bytes(s, b, h, a, p):
    assert gpt_layer_activation_bytes(
        s, b, h, a, p, recompute=False
    ) == our_block_saved_bytes(s, b, h, a, p)
    # with explicit softmax attention the s x s probabilities replace the logsumexp
    explicit = our_block_saved_bytes(s, b, h, a, p) - 4 * b * a * s + p * a * s * s * b
    assert (
        gpt_layer_activation_bytes(s, b, h, a, p, False, flash_attention=False)
        == explicit
    )
    # full recomputation keeps only the block input
    assert gpt_layer_activation_bytes(s, b, h, a, p, recompute=True) == p * s * b * h


def test_gpt_layer_vs_korthikanti():
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) with dropout; ours has no dropout: 2 s b h of dropout
    # masks/outputs and 3 a s^2 b of attention-dropout tensors fewer, plus the small fp32 terms.
    s, b, h, a = S, 1, H, HEADS
    korthikanti = s * b * h * (34 + 5 * a * s / h)
    ours = gpt_layer_activation_bytes(s, b, h, a, 2, False, flash_attention=False)
    assert ours == korthikanti - 2 * s * b * h - 3 * a * s * s * b + 16 * s * b
    assert gpt_layer_activation_bytes(s, b, h, a, 2, True) == 2 * s * b * h


def test_gpt_layer_formula_matches_traced_block():
    s, b, h, a = 32, 2, 64, 4

    class OneBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = gpt.Block(h, a)

        def forward(self, x):
            return self.block(x).sum()

    graph = tracer.trace(OneBlock().to("meta"), (torch.randn(b, s, h, device="meta"),))
    assert graph.saved_activation_bytes() == gpt_layer_activation_bytes(
        s, b, h, a, 4, False
    )


def test_stage_memory_keeps_inputs_when_recomputing():
    """Three layers' parameter state, saved activations and input bytes per micro-batch: without
    recomputation a stage keeps every saved tensor of every micro-batch in flight; with it only
    the layers' inputs, plus one layer's saved tensors while it is recomputed, less the inputs of
    the layers after it (back-propagated before it, their inputs freed)."""
    import numpy as np

    saved, inputs, params = [100.0, 300.0, 200.0], [10.0, 10.0, 20.0], [5.0, 6.0, 7.0]
    zeros = np.zeros(3)
    prof = LayerProfile(
        None, zeros, zeros, np.array(params), np.array(saved), np.array(inputs), zeros
    )
    p, kept, transient = range_footprint(prof, recompute=False)
    assert (p[0, 2], kept[0, 2], transient[0, 2]) == (18.0, 600.0, 0.0)
    assert stage_peak_bytes(p[0, 2], kept[0, 2], transient[0, 2], 3) == 18 + 3 * 600
    p, kept, transient = range_footprint(prof, recompute=True)
    # the peak: layer 1 recomputed (300) while layers 0 and 1 keep their inputs, layer 2's freed
    assert (p[0, 2], kept[0, 2], transient[0, 2]) == (18.0, 40.0, 300.0 - 20.0)
    assert (kept[1, 2], transient[1, 2]) == (30.0, 300.0 - 20.0)
    assert stage_peak_bytes(p[0, 2], kept[0, 2], transient[0, 2], 3) == 18 + 120 + 280
    assert transient[2, 2] == 200.0


def test_microbatches_in_flight():
    B, stages = 8, 4
    assert [microbatches_in_flight("gpipe", B, stages, i) for i in range(stages)] == [
        8,
        8,
        8,
        8,
    ]
    assert [microbatches_in_flight("1f1b", B, stages, i) for i in range(stages)] == [
        4,
        3,
        2,
        1,
    ]
    assert [microbatches_in_flight("1F1B", 2, stages, i) for i in range(stages)] == [
        2,
        2,
        2,
        1,
    ]
    assert microbatches_in_flight("Schedule1F1B", 8, 1, 0) == 1
    for bad in (("dualpipe", 8, 4, 0), ("gpipe", 0, 4, 0), ("gpipe", 8, 4, 4)):
        with pytest.raises(MeshplanError):
            microbatches_in_flight(*bad)
    for schedule, held in (("1f1b", 3), ("gpipe", 8)):
        n = microbatches_in_flight(schedule, 8, 4, 1)
        assert stage_peak_bytes(1.0, 10.0, 5.0, n) == 1 + held * 10 + 5
