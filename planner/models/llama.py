"""Llama: the Llama 3 decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU).

One pre-norm ``Block`` (``h`` hidden, ``n`` query heads of ``d = h / n``, ``g`` key/value heads,
``f`` the MLP's width)::

    x = x + attn.o(attention(rope(attn.q(a)), rope(attn.k(a)), attn.v(a)))   a = attn_norm(x)
    x = x + mlp.down(silu(mlp.gate(m)) * mlp.up(m))                           m = mlp_norm(x)

``attn.q: h -> n d``, ``attn.k`` and ``attn.v: h -> g d``, ``attn.o: n d -> h``, ``mlp.gate`` and
``mlp.up: h -> f``, ``mlp.down: f -> h``, all without biases. Grouped-query attention repeats each
key/value head for ``n / g`` query heads and runs ``F.scaled_dot_product_attention`` (causal), as
Hugging Face's ``sdpa`` path does (``attn="explicit"`` or ``"explicit-batch"``: the scores, masked softmax, optional
``attn_dropout`` and product with v written out, `planner.models.gpt.explicit_attention`); sharding q, k, v by output features over ``t`` devices keeps
whole heads on every device when ``t`` divides ``g``. Rotary embeddings (theta ``rope_theta``)
use cos/sin tables kept as non-persistent buffers. The model ends with a final RMSNorm ``norm`` and
an untied ``lm_head`` (Llama 3 does not tie them), and returns the mean next-token cross-entropy.

Published sizes (Meta's model cards; `llama_param_count` gives 8.03 B, 70.55 B and 405.85 B):

    name         h      layers  n    g  f      vocab
    llama3-8b    4096   32      32   8  14336  128256
    llama3-70b   8192   80      64   8  28672  128256
    llama3-405b  16384  126     128  8  53248  128256
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError
from planner.models.gpt import attend, check_attention, lm_loss

__all__ = ["LLAMA_CONFIGS", "Llama", "LlamaConfig", "llama_param_count"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama model (module docstring); ``seq`` is the training sequence length."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    seq: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attn: str = "fused"
    attn_dropout: float = 0.0

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"Llama {key} must be a positive integer, got {value!r}"
                )
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise MeshplanError(
                f"Llama hidden={self.hidden} must be divisible by heads={self.heads} into an "
                "even head size (rotary embeddings rotate pairs)"
            )
        if self.heads % self.kv_heads:
            raise MeshplanError(
                f"Llama heads={self.heads} must be divisible by kv_heads={self.kv_heads}"
            )
        for key in ("rope_theta", "norm_eps"):
            if not getattr(self, key) > 0:
                raise MeshplanError(f"Llama {key} must be positive")
        check_attention("Llama", self.attn, self.attn_dropout)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "llama3-70b": LlamaConfig(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "llama3-405b": LlamaConfig(
        hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248
    ),
}


def llama_param_count(c: LlamaConfig) -> int:
    """Closed-form parameter count of ``Llama(c)``: per block ``2 h^2 + 2 h g d`` (q, o, k, v),
    ``3 h f`` (gate, up, down) and ``2 h`` (two norms); plus the embedding and the untied head
    (``vocab * h`` each) and the final norm (``h``)."""
    h, kv = c.hidden, c.kv_heads * c.head_dim
    block = 2 * h * h + 2 * h * kv + 3 * h * c.ffn + 2 * h
    return c.layers * block + 2 * c.vocab * h + h


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32."""

    def __init__(
        self, hidden: int, eps: float, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(
    seq: int, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq, head_dim]`` of rotary embeddings (each frequency used twice, for the
    two halves that `rotate` pairs)."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[B, heads, s, d]``: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions (module docstring)."""

    def __init__(self, c: LlamaConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        self.attn, self.attn_dropout = c.attn, c.attn_dropout
        kv = c.kv_heads * c.head_dim
        self.q = nn.Linear(c.hidden, c.hidden, bias=False, dtype=dtype)
        self.k = nn.Linear(c.hidden, kv, bias=False, dtype=dtype)
        self.v = nn.Linear(c.hidden, kv, bias=False, dtype=dtype)
        self.o = nn.Linear(c.hidden, c.hidden, bias=False, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """``x[B, s, h] -> [B, s, h]``."""
        b, s, h = x.shape
        d = self.head_dim
        q = self.q(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        if group > 1:  # each key/value head serves `group` query heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = attend(q, k, v, self.attn, self.attn_dropout, self.training)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class FeedForward(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self, hidden: int, ffn: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """A pre-norm Llama block: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``."""

    def __init__(self, c: LlamaConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden, c.norm_eps, dtype=dtype)
        self.attn = Attention(c, dtype=dtype)
        self.mlp_norm = RMSNorm(c.hidden, c.norm_eps, dtype=dtype)
        self.mlp = self.make_mlp(c, dtype)

    def make_mlp(self, c: LlamaConfig, dtype: torch.dtype) -> nn.Module:
        """The block's MLP: SwiGLU (a subclass may route to experts instead)."""
        return FeedForward(c.hidden, c.ffn, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        aux: list[torch.Tensor],
    ) -> torch.Tensor:
        """``x[B, s, h] -> [B, s, h]``; a block with a router appends its auxiliary loss to
        `aux` (`planner.models.mixtral`)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.run_mlp(self.mlp_norm(x), aux)

    def run_mlp(self, x: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The MLP's output for `x` (a subclass with a router also appends to `aux`)."""
        return self.mlp(x)


class Llama(nn.Module):
    """Llama language model; ``forward(tokens[B, s], targets[B, s])`` returns the mean loss (plus
    ``config.aux_loss_coef`` times the blocks' auxiliary losses, for a `block_cls` that routes)."""

    block_cls: type[nn.Module] = Block
    #: each block's forward depends on its own modules and parameters, not on its index: the
    #: tracer may trace a few and repeat them (`planner.tracing.repeat`)
    repeats_blocks = True

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab, c.hidden, dtype=dtype)
        self.blocks = nn.ModuleList(
            self.make_block(c, i, dtype) for i in range(c.layers)
        )
        self.norm = RMSNorm(c.hidden, c.norm_eps, dtype=dtype)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False, dtype=dtype)
        cos, sin = rotary_tables(c.seq, c.head_dim, c.rope_theta, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():
            # on the meta device there are no values to draw (and drawing costs ~0.1 s a build)
            if (
                isinstance(module, (nn.Linear, nn.Embedding))
                and not module.weight.is_meta
            ):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def make_block(self, c: LlamaConfig, index: int, dtype: torch.dtype) -> nn.Module:
        """Block `index` of the stack (a subclass may vary it by depth)."""
        return self.block_cls(c, dtype=dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (int64 ``[B, s]``) against ``targets``."""
        s = tokens.shape[1]
        if s > self.config.seq:
            raise MeshplanError(
                f"sequence length {s} exceeds the model's seq={self.config.seq}"
            )
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.wte(tokens)
        aux: list[torch.Tensor] = []
        for block in self.blocks:
            x = block(x, cos, sin, aux)
        loss = lm_loss(self.lm_head(self.norm(x)), targets)
        coef = getattr(self.config, "aux_loss_coef", 0.0)
        if aux and coef > 0:
            loss = loss + coef * torch.stack(aux).sum().to(loss.dtype)
        return loss
