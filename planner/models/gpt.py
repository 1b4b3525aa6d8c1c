"""GPT: a decoder-only transformer language model (GPT-2/GPT-3 layout, as in Alpa's GPT suite).

Layout of one pre-LayerNorm ``Block`` (``h`` = hidden size, ``n`` = heads, ``d = h / n``)::

    x = x + attn.proj(attention(attn.qkv(ln_1(x))))      # qkv: Linear(h, 3h), proj: Linear(h, h)
    x = x + mlp.proj(gelu(mlp.fc(ln_2(x))))             # fc: Linear(h, 4h), proj: Linear(4h, h)

The output features of ``attn.qkv`` are ordered head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``
(Megatron-LM's layout), so sharding ``qkv`` by output columns over ``m`` devices gives every device
whole heads whenever ``n`` is divisible by ``m`` (Megatron-style tensor parallelism needs no
redistribution between ``qkv`` and the attention).

The model adds learned position embeddings ``wpe`` to token embeddings ``wte`` and ends with
``ln_f`` and ``lm_head``. ``lm_head`` is a separate ``Linear(h, vocab, bias=False)``: it is **not**
tied to ``wte``. Tying would make one parameter used at both ends of the network, which a pipeline
split across stages cannot express without an extra gradient exchange; untied, every parameter
belongs to one layer. The price is ``vocab * h`` extra parameters (39 M for gpt-125m), so the
parameter counts are a little above the names of the reference table (which counted a tied head).

``forward(tokens, targets)`` returns the mean next-token cross-entropy; it uses only ops DTensor can
shard (embedding, linear, view/transpose, layer_norm, gelu, scaled_dot_product_attention,
cross_entropy) and has static shapes.

Attention (``GPTConfig.attn``): ``"fused"`` (the default) calls ``F.scaled_dot_product_attention``,
which runs a flash / memory-efficient kernel that never writes the ``s x s`` scores; ``"explicit"``
(and ``"explicit-batch"``) writes attention out as Megatron-LM's 2021-2022 runs computed it
(``explicit_attention``): the
score product ``q k^T``, the scaled causal-masked softmax, attention dropout and the product with
``v``, so the ``s x s`` scores, probabilities and dropout mask are materialised, traced and priced
as the separate ops they were. ``attn_dropout`` is the attention-dropout probability; it defaults
to 0.0 (the models here have no other dropout, and a run with dropout trains like one device only
through ``runtime.dropout``'s masks). Megatron-LM's GPT runs of 2021-2022 used 0.1
(``--attention-dropout`` default), which ``benchmarks.published`` passes to price them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError

__all__ = [
    "GPT",
    "GPT_CONFIGS",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "check_attention",
    "explicit_attention",
    "gpt_param_count",
]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT model: hidden size, number of layers, attention heads, sequence, vocabulary."""

    hidden: int
    layers: int
    heads: int
    seq: int = 1024
    vocab: int = 51200
    attn: str = "fused"
    attn_dropout: float = 0.0

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "seq", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"GPT {key} must be a positive integer, got {value!r}"
                )
        if self.hidden % self.heads:
            raise MeshplanError(
                f"GPT hidden={self.hidden} must be divisible by heads={self.heads}"
            )
        check_attention("GPT", self.attn, self.attn_dropout)


#: Attention kernels a built-in model can be traced with (module docstring).
ATTENTION_KINDS = ("fused", "explicit", "explicit-batch")


def check_attention(family: str, attn: str, dropout: float) -> None:
    """Raise MeshplanError unless `attn` is one of ``ATTENTION_KINDS`` and `dropout` a probability
    in [0, 1), non-zero only with an explicit ``attn``."""
    if attn not in ATTENTION_KINDS:
        raise MeshplanError(
            f"{family} attn must be one of {', '.join(ATTENTION_KINDS)}, got {attn!r}"
        )
    if not 0.0 <= dropout < 1.0:
        raise MeshplanError(f"{family} attn_dropout must be in [0, 1), got {dropout!r}")
    if dropout and attn == "fused":
        raise MeshplanError(
            f"{family} attn_dropout={dropout} needs attn=explicit (the fused kernel is "
            "planned without dropout)"
        )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn: str,
    dropout: float,
    training: bool,
) -> torch.Tensor:
    """Causal attention of ``q, k, v [B, n, s, d]`` as `attn` says: "fused"
    (``scaled_dot_product_attention``), "explicit" or "explicit-batch" (`explicit_attention`,
    heads or batch folded first)."""
    if attn == "fused":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return explicit_attention(
        q, k, v, dropout, training, heads_first=attn == "explicit"
    )


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    training: bool,
    *,
    heads_first: bool = True,
) -> torch.Tensor:
    """Causal attention of ``q, k, v [B, n, s, d]`` written out as Megatron-LM's 2021-2022 GPT runs
    computed it: ``dropout(softmax(q k^T / sqrt(d) + causal mask)) v``, with ``N = B n s^2`` score
    elements materialised.

    The ops, as traced, and the Megatron-LM kernel each stands for:

    ==========================================  ===============================================
    op                                          Megatron-LM
    ==========================================  ===============================================
    ``baddbmm(mask, q, k^T, alpha=1/sqrt(d))``  ``baddbmm(buffer, q, k^T, beta=0, alpha=...)``
    ``softmax``                                 the fused scale-mask-softmax kernel
    ``bernoulli`` (bool keep-mask, N bytes)     the fused dropout kernel (1-byte mask)
    ``probs * keep``                            (same kernel)
    ``bmm(probs, v / (1 - p))``                 ``bmm(probs, v)``
    ==========================================  ===============================================

    The causal mask is the score GEMM's additive ``[s, s]`` input (0 on and below the diagonal,
    -inf above), so the scores are masked as they are written, with no pass of their own; the
    dropout's ``1 / (1 - p)`` scales ``v`` (``B n s d`` elements) rather than the ``N``
    probabilities: ``(P * keep / (1 - p)) v = (P * keep) (v / (1 - p))``.

    The batched products run on one folded batch dimension, ``[n B, s, d]`` with ``heads_first``
    (``attn="explicit"``), ``[B n, s, d]`` without (``attn="explicit-batch"``). DTensor carries a
    split through a fold as a plain ``Shard`` only when it splits the fold's leading dimension (a
    split of the second is a ``_StridedShard``, whose strategies the planner drops, so it
    reshards around the products instead). Heads first suits tensor parallelism (heads split) with
    dp = 1, batch first data parallelism (batch split) with tp = 1: either way each device runs
    what Megatron-LM's local ``[b n_local, s, d]`` fold runs. Neither carries both splits at once;
    the fused kernel has no fold and no such limit."""
    b, n, s, d = q.shape
    if heads_first:
        q, k, v = (t.transpose(0, 1).reshape(n * b, s, d) for t in (q, k, v))
    else:
        q, k, v = (t.reshape(b * n, s, d) for t in (q, k, v))
    mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(d))
    probs = torch.softmax(scores, dim=-1)
    if dropout and training:
        # The keep-mask is drawn on the unfolded [B, n, s, s] view, whose batch dimension is
        # its own (dimension 0), so `runtime.dropout` gives each micro-batch its rows of the
        # mask one device draws for the whole batch.
        unfolded = (
            probs.view(n, b, s, s).transpose(0, 1)
            if heads_first
            else probs.view(b, n, s, s)
        )
        keep = torch.empty_like(unfolded, dtype=torch.bool).bernoulli_(1.0 - dropout)
        dropped = unfolded * keep
        probs = (
            dropped.transpose(0, 1).reshape(n * b, s, s)
            if heads_first
            else dropped.reshape(b * n, s, s)
        )
        v = v * (1.0 / (1.0 - dropout))
    out = torch.bmm(probs, v)
    return out.view(n, b, s, d).transpose(0, 1) if heads_first else out.view(b, n, s, d)


#: The GPT sizes of Alpa's end-to-end suite (seq 1024, vocab 51200).
GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-125m": GPTConfig(hidden=768, layers=12, heads=12),
    "gpt-350m": GPTConfig(hidden=1024, layers=24, heads=16),
    "gpt-760m": GPTConfig(hidden=1536, layers=24, heads=16),
    "gpt-1.3b": GPTConfig(hidden=2048, layers=24, heads=32),
    "gpt-2.6b": GPTConfig(hidden=2560, layers=32, heads=32),
    "gpt-6.7b": GPTConfig(hidden=4096, layers=32, heads=32),
    "gpt-15b": GPTConfig(hidden=5120, layers=48, heads=40),
    "gpt-39b": GPTConfig(hidden=8192, layers=48, heads=64),
    "gpt-76b": GPTConfig(hidden=10240, layers=60, heads=80),
}


def attention_param_count(hidden: int) -> int:
    """Parameters of one ``CausalSelfAttention`` (qkv and proj, with biases)."""
    return (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden)


def gpt_param_count(config: GPTConfig) -> int:
    """Closed-form parameter count of ``GPT(config)`` (untied ``lm_head``, biases, LayerNorms).

    Per block: ``12 h^2 + 13 h`` (qkv, proj, fc, proj with biases, two LayerNorms); plus
    ``wte`` and ``lm_head`` (``vocab * h`` each), ``wpe`` (``seq * h``) and ``ln_f`` (``2 h``).
    """
    h = config.hidden
    block = 12 * h * h + 13 * h
    return config.layers * block + 2 * config.vocab * h + config.seq * h + 2 * h


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused, head-major ``qkv`` projection."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        dtype: torch.dtype = torch.float32,
        *,
        attn: str = "fused",
        attn_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_attention("GPT", attn, attn_dropout)
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.attn, self.attn_dropout = attn, attn_dropout
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, s, h] -> [B, s, h]``."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # each [B, s, n, d]
        q, k, v = (
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
        )  # [B, n, s, d]
        y = attend(q, k, v, self.attn, self.attn_dropout, self.training)
        y = y.transpose(1, 2).reshape(b, s, self.hidden)
        return self.proj(y)


class FeedForward(nn.Module):
    """The dense MLP: ``proj(gelu(fc(x)))`` with ``fc: h -> ffn*h`` (``ffn`` 4 in GPT)."""

    def __init__(
        self, hidden: int, ffn: int = 4, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, ffn * hidden, dtype=dtype)
        self.proj = nn.Linear(ffn * hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., h] -> [..., h]``."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``ln_1``, ``attn``, ``ln_2``, ``mlp``."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        dtype: torch.dtype = torch.float32,
        *,
        attn: str = "fused",
        attn_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = CausalSelfAttention(
            hidden, heads, dtype=dtype, attn=attn, attn_dropout=attn_dropout
        )
        self.ln_2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = FeedForward(hidden, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, s, h] -> [B, s, h]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_transformer_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by
    ``1/sqrt(2 * layers)``. Skipped on the meta device, which holds no values."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)) and not sub.weight.is_meta:
            std = 0.02
            if isinstance(sub, nn.Linear) and name.endswith(".proj"):
                std = 0.02 / math.sqrt(2 * num_layers)
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                nn.init.zeros_(sub.bias)


def embed(
    wte: nn.Embedding, wpe: nn.Embedding, tokens: torch.Tensor, max_seq: int
) -> torch.Tensor:
    """Token plus learned position embeddings of ``tokens[B, s]`` (``s <= max_seq``)."""
    s = tokens.shape[1]
    if s > max_seq:
        raise MeshplanError(f"sequence length {s} exceeds the model's seq={max_seq}")
    positions = torch.arange(s, device=tokens.device)
    return wte(tokens) + wpe(positions)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[B, s, V]`` against ``targets[B, s]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """GPT language model; ``forward(tokens[B, s], targets[B, s])`` returns the mean loss."""

    #: each block's forward depends on its own modules and parameters, not on its index: the
    #: tracer may trace a few and repeat them (`planner.tracing.repeat`)
    repeats_blocks = True

    def __init__(self, config: GPTConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.wte = nn.Embedding(config.vocab, h, dtype=dtype)
        self.wpe = nn.Embedding(config.seq, h, dtype=dtype)
        self.blocks = nn.ModuleList(
            Block(
                h,
                config.heads,
                dtype=dtype,
                attn=config.attn,
                attn_dropout=config.attn_dropout,
            )
            for _ in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(h, dtype=dtype)
        self.lm_head = nn.Linear(h, config.vocab, bias=False, dtype=dtype)
        init_transformer_weights(self, config.layers)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (int64 ``[B, s]``) against ``targets``."""
        x = embed(self.wte, self.wpe, tokens, self.config.seq)
        for block in self.blocks:
            x = block(x)
        return lm_loss(self.lm_head(self.ln_f(x)), targets)
