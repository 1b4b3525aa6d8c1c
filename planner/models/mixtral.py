"""Mixtral: Llama's decoder (`planner.models.llama`) with a top-2 mixture of SwiGLU experts in every
block.

One block::

    x = x + attn(attn_norm(x))                      # Llama's grouped-query attention, rotary
    x = x + moe(mlp_norm(x))                        # router, then 2 of E SwiGLU experts per token

The mixture ``moe``: ``router = Linear(h, E)``, softmax over the experts, each token's two best
experts with their probabilities renormalised to sum to one (Mixtral's routing weights), and the
experts' stacked weights ``w_gate[E, h, f]``, ``w_up[E, h, f]``, ``w_down[E, f, h]``:
``expert(x) = (silu(x w_gate) * (x w_up)) w_down``. Tokens reach the experts by GShard's dense
dispatch (`planner.models.moe.top2_gating`: groups of ``group_size`` tokens, capacity
``C = ceil(2 S / E * capacity_factor)`` slots per expert and group, static shapes that trace on
fake tensors and shard with DTensor), where Mixtral runs dropless: with ``capacity_factor = 1``
(the default) the experts compute exactly the two experts' work per token of top-2 routing, and a
token whose expert is full loses that expert. The auxiliary load-balancing loss is GShard's,
weighted ``aux_loss_coef`` (0.02, Mixtral's router coefficient in Hugging Face).

Published sizes (Mistral AI; `mixtral_param_count` gives 46.70 B and 140.62 B):

    name            h     layers  n   g  f      E  vocab
    mixtral-8x7b    4096  32      32  8  14336  8  32000
    mixtral-8x22b   6144  56      48  8  16384  8  32768
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError
from planner.models import llama
from planner.models.llama import Llama, LlamaConfig
from planner.models.moe import capacity, group_for, topk_gating

__all__ = ["MIXTRAL_CONFIGS", "Mixtral", "MixtralConfig", "mixtral_param_count"]


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Llama's sizes plus the mixture's (module docstring)."""

    vocab: int = 32000
    seq: int = 4096
    rope_theta: float = 1000000.0
    experts: int = 8
    group_size: int = 4096
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("experts", "group_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"Mixtral {key} must be a positive integer, got {value!r}"
                )
        if self.experts < 2:
            raise MeshplanError(
                f"Mixtral experts must be at least 2 for top-2 routing, got {self.experts}"
            )
        if not self.capacity_factor > 0 or not self.aux_loss_coef >= 0:
            raise MeshplanError(
                "Mixtral capacity_factor must be > 0 and aux_loss_coef >= 0, got "
                f"{self.capacity_factor!r} and {self.aux_loss_coef!r}"
            )


MIXTRAL_CONFIGS: dict[str, MixtralConfig] = {
    "mixtral-8x7b": MixtralConfig(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336
    ),
    "mixtral-8x22b": MixtralConfig(
        hidden=6144, layers=56, heads=48, kv_heads=8, ffn=16384, vocab=32768
    ),
}


def mixtral_param_count(c: MixtralConfig) -> int:
    """Closed-form parameter count of ``Mixtral(c)``: per block the attention's ``2 h^2 + 2 h g d``,
    the router's ``h E``, the experts' ``3 E h f`` and two norms ``2 h``; plus the embedding and
    the untied head (``vocab * h`` each) and the final norm (``h``)."""
    h, kv = c.hidden, c.kv_heads * c.head_dim
    block = 2 * h * h + 2 * h * kv + h * c.experts + 3 * c.experts * h * c.ffn + 2 * h
    return c.layers * block + 2 * c.vocab * h + h


def add_experts(
    m: nn.Module, experts: int, hidden: int, ffn: int, dtype: torch.dtype
) -> None:
    """Give `m` a router ``Linear(hidden, experts)`` and ``experts`` stacked SwiGLU experts of
    width `ffn`: ``w_gate``, ``w_up`` ``[E, h, f]`` and ``w_down`` ``[E, f, h]``."""
    m.router = nn.Linear(hidden, experts, bias=False, dtype=dtype)
    m.w_gate = nn.Parameter(torch.empty(experts, hidden, ffn, dtype=dtype))
    m.w_up = nn.Parameter(torch.empty(experts, hidden, ffn, dtype=dtype))
    m.w_down = nn.Parameter(torch.empty(experts, ffn, hidden, dtype=dtype))
    for w in (m.w_gate, m.w_up, m.w_down):
        if not w.is_meta:  # no values to draw on the meta device
            nn.init.normal_(w, std=0.02)


def run_experts(
    m: nn.Module, x: torch.Tensor, group_size: int, capacity_factor: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[B, s, h] -> (y[B, s, h], aux_loss)``: top-`top_k` routing of each group's tokens to
    the experts `add_experts` gave `m`, GShard's dense dispatch and combine (module docstring)."""
    b, s, h = x.shape
    group = group_for(b * s, group_size)
    xg = x.reshape(b * s // group, group, h)  # [G, S, h]
    gates = F.softmax(m.router(xg).float(), dim=-1)  # [G, S, E]
    experts = gates.shape[-1]
    slots = capacity(group, experts, capacity_factor, top_k)
    combine, dispatch, aux = topk_gating(gates, slots, top_k)
    combine, dispatch = combine.to(x.dtype), dispatch.to(x.dtype)
    tokens = torch.einsum("gsec,gsm->egcm", dispatch, xg)
    hidden = F.silu(torch.einsum("egcm,emf->egcf", tokens, m.w_gate))
    hidden = hidden * torch.einsum("egcm,emf->egcf", tokens, m.w_up)
    out = torch.einsum("egcf,efm->egcm", hidden, m.w_down)
    y = torch.einsum("gsec,egcm->gsm", combine, out)
    return y.reshape(b, s, h), aux


class SparseMoE(nn.Module):
    """Top-2 routing to ``experts`` SwiGLU experts (module docstring)."""

    def __init__(self, c: MixtralConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = c
        add_experts(self, c.experts, c.hidden, c.ffn, dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[B, s, h] -> (y[B, s, h], aux_loss)``."""
        c = self.config
        return run_experts(self, x, c.group_size, c.capacity_factor, 2)


class Block(llama.Block):
    """A pre-norm Mixtral block: Llama's, with the mixture as its ``mlp``."""

    def make_mlp(self, c: MixtralConfig, dtype: torch.dtype) -> nn.Module:
        return SparseMoE(c, dtype=dtype)

    def run_mlp(self, x: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The mixture's output for `x`, appending the router's auxiliary loss to `aux`."""
        y, loss = self.mlp(x)
        aux.append(loss)
        return y


class Mixtral(Llama):
    """Mixtral language model; ``forward(tokens, targets)`` returns LM loss + ``aux_loss_coef``
    times the routers' auxiliary losses."""

    block_cls = Block
