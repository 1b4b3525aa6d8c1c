"""DeepSeek-MoE: a DeepSeek-V3-style layer stack on Llama's decoder (`planner.models.llama`).

Blocks ``0 .. dense_layers - 1`` are Llama's (dense SwiGLU MLP of width ``ffn``); every later block
replaces the MLP by DeepSeekMoE's mixture (Dai et al. 2024; DeepSeek-V2/V3)::

    x = x + attn(attn_norm(x))                               # Llama's attention, rotary
    x = x + shared(m) + sum_{e in top_k(m)} w_e expert_e(m)  # m = mlp_norm(x)

* ``shared``: ``shared`` shared experts, always applied. They are fused into one SwiGLU of width
  ``shared * expert_ffn`` (the same function as the sum of ``shared`` SwiGLUs of width
  ``expert_ffn``, as Hugging Face's DeepSeek-V3 builds them), held by the mixture itself as
  ``mlp.gate``, ``mlp.up``, ``mlp.down``: the names of Llama's MLP, so Megatron's column/row rules
  (`planner.intra.megatron`) place them like Llama's.
* ``experts`` routed SwiGLU experts of width ``expert_ffn`` with stacked weights
  ``w_gate[E, h, f]``, ``w_up[E, h, f]``, ``w_down[E, f, h]`` (Mixtral's names), reached through
  ``router = Linear(h, E)`` and GShard's dense dispatch generalised to ``top_k`` choices
  (`planner.models.moe.topk_gating`: groups of ``group_size`` tokens, capacity
  ``C = min(S, ceil(top_k S / E * capacity_factor))`` slots per expert and group, first choices
  before second ones; a choice whose expert is full is dropped).

Departures from DeepSeek-V3, chosen so that every op traces on fake tensors and shards with DTensor:

* **Attention is grouped-query attention (Llama's), not multi-head latent attention (MLA).** In
  training MLA expands its compressed keys and values to every head, so it computes like attention
  with ``kv_heads = heads``; ``deepseek-v3`` therefore uses 128 key/value heads (MHA). Its
  projections hold ``4 h^2`` = 205.5 M parameters a layer where MLA holds 187.1 M.
* **The router is a softmax with an auxiliary loss** (DeepSeek-V2's choice), not V3's sigmoid
  affinities with bias-based, auxiliary-loss-free balancing: each token's ``top_k`` softmax
  probabilities are renormalised to sum to one (V3's ``norm_topk_prob``), and the loss is GShard's
  (`topk_gating`: from first choices, 1 for uniform routing) weighted ``aux_loss_coef`` = 0.003,
  DeepSeek-V2's expert-level balance factor. Node-limited (group) routing, the routed scaling
  factor and multi-token prediction are left out; experts have a capacity where V3 is dropless.

Sizes (``h`` hidden, ``n`` heads, ``g`` key/value heads, ``f`` dense width, ``E`` routed experts,
``f_e`` expert width)::

    name          h     layers  dense  n    g    f      E    shared  top_k  f_e   vocab
    deepseek-v3   7168  61      3      128  128  18432  256  1       8      2048  129280

`deepseek_param_count` gives 672.15 B for ``deepseek-v3`` (DeepSeek: 671 B) and
`deepseek_active_param_count` 38.68 B per token (DeepSeek: 37 B); with MLA's 187.1 M attention
parameters a layer in place of 205.5 M the same closed forms give 671.03 B and 37.55 B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.models import llama, mixtral
from planner.models.llama import Llama, LlamaConfig

__all__ = [
    "DEEPSEEK_CONFIGS",
    "DeepSeek",
    "DeepSeekConfig",
    "DeepSeekMoE",
    "deepseek_active_param_count",
    "deepseek_param_count",
]


@dataclass(frozen=True, kw_only=True)
class DeepSeekConfig(LlamaConfig):
    """Llama's sizes (``ffn``: the dense blocks' width) plus the mixture's (module docstring)."""

    vocab: int = 129280
    seq: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    experts: int
    shared: int
    top_k: int
    expert_ffn: int
    dense_layers: int
    group_size: int = 4096
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.003

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("experts", "shared", "top_k", "expert_ffn", "group_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"DeepSeek-MoE {key} must be a positive integer, got {value!r}"
                )
        d = self.dense_layers
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= self.layers:
            raise MeshplanError(
                f"DeepSeek-MoE dense_layers must be an integer from 0 to layers={self.layers}, "
                f"got {d!r}"
            )
        if self.top_k > self.experts:
            raise MeshplanError(
                f"DeepSeek-MoE top_k={self.top_k} must be at most experts={self.experts}"
            )
        if not self.capacity_factor > 0 or not self.aux_loss_coef >= 0:
            raise MeshplanError(
                "DeepSeek-MoE capacity_factor must be > 0 and aux_loss_coef >= 0, got "
                f"{self.capacity_factor!r} and {self.aux_loss_coef!r}"
            )

    @property
    def moe_layers(self) -> int:
        """Number of blocks with a mixture (the last ``layers - dense_layers``)."""
        return self.layers - self.dense_layers


DEEPSEEK_CONFIGS: dict[str, DeepSeekConfig] = {
    "deepseek-v3": DeepSeekConfig(
        hidden=7168,
        layers=61,
        heads=128,
        kv_heads=128,
        ffn=18432,
        experts=256,
        shared=1,
        top_k=8,
        expert_ffn=2048,
        dense_layers=3,
    ),
}


def _expert_params(c: DeepSeekConfig) -> int:
    """Parameters of one routed expert: ``3 h f_e`` (gate, up, down)."""
    return 3 * c.hidden * c.expert_ffn


def deepseek_param_count(c: DeepSeekConfig) -> int:
    """Closed-form parameter count of ``DeepSeek(c)``. Every block: attention ``2 h^2 + 2 h g d``
    and two norms ``2 h``; a dense block adds ``3 h f``, a mixture block the router ``h E``, the
    routed experts ``3 E h f_e`` and the shared ones ``3 shared h f_e``; plus the embedding and the
    untied head (``vocab * h`` each) and the final norm (``h``)."""
    h, kv = c.hidden, c.kv_heads * c.head_dim
    common = 2 * h * h + 2 * h * kv + 2 * h
    dense = common + 3 * h * c.ffn
    moe = common + h * c.experts + (c.experts + c.shared) * _expert_params(c)
    return c.dense_layers * dense + c.moe_layers * moe + 2 * c.vocab * h + h


def deepseek_active_param_count(c: DeepSeekConfig) -> int:
    """Parameters a token uses: all of `deepseek_param_count` but the ``E - top_k`` routed
    experts it is not sent to in each mixture block, ``(E - top_k) * 3 h f_e`` a block (the
    embedding and the head count whole, as in DeepSeek's 37 B)."""
    unused = (c.experts - c.top_k) * _expert_params(c)
    return deepseek_param_count(c) - c.moe_layers * unused


class DeepSeekMoE(llama.FeedForward):
    """Shared experts (this SwiGLU's ``gate``, ``up``, ``down``, width ``shared * expert_ffn``)
    plus top-``top_k`` of ``experts`` routed SwiGLU experts (module docstring)."""

    def __init__(self, c: DeepSeekConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(c.hidden, c.shared * c.expert_ffn, dtype=dtype)
        self.config = c
        mixtral.add_experts(self, c.experts, c.hidden, c.expert_ffn, dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[B, s, h] -> (shared(x) + routed(x), aux_loss)``."""
        c = self.config
        routed, aux = mixtral.run_experts(
            self, x, c.group_size, c.capacity_factor, c.top_k
        )
        return super().forward(x) + routed, aux


class MoEBlock(mixtral.Block):
    """A mixture block: Llama's block with `DeepSeekMoE` as its ``mlp`` (Mixtral's `run_mlp`
    collects the router's auxiliary loss)."""

    def make_mlp(self, c: DeepSeekConfig, dtype: torch.dtype) -> nn.Module:
        return DeepSeekMoE(c, dtype=dtype)


class DeepSeek(Llama):
    """DeepSeek-MoE language model; ``forward(tokens, targets)`` returns LM loss +
    ``aux_loss_coef`` times the mixture blocks' auxiliary losses."""

    def make_block(
        self, c: DeepSeekConfig, index: int, dtype: torch.dtype
    ) -> nn.Module:
        """Llama's dense block for the first ``dense_layers``, then `MoEBlock`s."""
        kind = llama.Block if index < c.dense_layers else MoEBlock
        return kind(c, dtype=dtype)
