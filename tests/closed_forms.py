"""Closed forms the tests check traced and priced quantities against."""

from __future__ import annotations


def gpt_layer_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    dtype_bytes: int,
    recompute: bool,
    *,
    flash_attention: bool = True,
) -> int:
    """Bytes one GPT block (``planner.models.gpt.Block``) saves for backward, per device, unsharded.

    The block: ``x1 = x + proj(sdpa(qkv(ln_1(x))))``, ``out = x1 + mlp.proj(gelu(mlp.fc(ln_2(x1))))``;
    no dropout. With s = seq, b = batch, h = hidden, a = heads, p = dtype_bytes, the saved tensors:

    ================================  =====================  ==================================
    tensor                            saved by               bytes
    ================================  =====================  ==================================
    x (block input)                   ln_1                   p * s*b*h
    ln_1 mean, rstd (fp32)            ln_1                   8 * s*b
    ln_1(x)                           qkv (Linear input)     p * s*b*h
    q, k, v (one qkv output)          attention              p * 3*s*b*h
    attention output                  attention, proj input  p * s*b*h  (one tensor, saved once)
    logsumexp (fp32, flash only)      attention              4 * a*s*b
    softmax probs (explicit only)     softmax, probs @ v     p * a*s*s*b
    x1 (residual)                     ln_2                   p * s*b*h
    ln_2 mean, rstd (fp32)            ln_2                   8 * s*b
    ln_2(x1)                          mlp.fc                 p * s*b*h
    fc output                         gelu                   p * 4*s*b*h
    gelu output                       mlp.proj               p * 4*s*b*h
    ================================  =====================  ==================================

    Total: ``p*16*s*b*h + 16*s*b + 4*a*s*b`` with fused (flash) attention, as
    ``F.scaled_dot_product_attention`` runs; ``p*(16*s*b*h + a*s^2*b) + 16*s*b`` with explicit
    softmax attention. For comparison, Korthikanti et al. 2022 count ``s*b*h*(34 + 5*a*s/h)`` for fp16
    Megatron blocks with explicit attention and dropout: their extra ``2*s*b*h + 3*a*s^2*b`` bytes are
    the dropout masks and dropout outputs we do not have (and they ignore the small fp32 terms).
    With full recomputation only the block input is kept: ``p * s*b*h`` (``2*s*b*h`` in fp16).
    """
    s, b, h, a, p = seq, batch, hidden, heads, dtype_bytes
    if recompute:
        return p * s * b * h
    core = p * 16 * s * b * h + 16 * s * b
    if flash_attention:
        return core + 4 * a * s * b
    return core + p * a * s * s * b
