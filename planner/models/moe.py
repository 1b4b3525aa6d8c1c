"""GShard-style mixture-of-experts (MoE) transformer language model, as in Alpa's MoE suite.

The model is GPT's (``gpt.py``: pre-LayerNorm blocks, learned positions, untied ``lm_head``) with
the dense MLP of every other block (blocks 0, 2, 4, ...; Alpa's placement) replaced by a top-2
gated mixture of ``E`` experts, in GShard's dense-dispatch formulation (Lepikhin et al. 2020):

1. the ``T = B * s`` tokens are reshaped into ``G`` groups of ``S`` tokens, ``x[G, S, h]``;
2. ``gates = softmax(gate(x))`` with ``gate = Linear(h, E, bias=False)``; every token picks its best
   expert and its second best (``argmax`` twice, no random second-expert policy, so training is
   deterministic);
3. each expert takes at most ``C = min(S, ceil(2 * S / E * capacity_factor))`` tokens of a group, in
   token order, first choices before second choices (``cumsum`` of one-hot masks); overflowing
   tokens are dropped for that expert. The two kept gate values are renormalised to sum to one;
4. ``dispatch[G, S, E, C]`` (0/1) and ``combine[G, S, E, C]`` (gate weights) are built from one-hot
   comparisons against ``arange`` (static shapes, no ``.item()``, traceable by ``make_fx``);
   `topk_gating` is steps 2-4 for ``k`` choices (``top2_gating`` is its ``k = 2``; Mixtral and
   DeepSeek-MoE route with it);
5. ``x_e = einsum(dispatch, x) -> [E, G, C, h]``, the experts' FFN with stacked weights
   ``wi[E, h, f]``, ``wo[E, f, h]`` (GeLU in between, no biases, like Alpa's ``wi``/``wo``),
   and ``y = einsum(combine, expert_out) -> [G, S, h]``.

Choices, documented:

* ``capacity_factor = 1.0``: ``C = 2S/E``, GShard's expert capacity for top-2 gating and what Alpa
  used (``C = 2 * S // E``).
* Auxiliary load-balancing loss, GShard's (lingvo ``top2_gating``): per MoE layer
  ``aux = E^2 * mean_{g,e}(density_e * mean_gate_e)`` where ``density_e`` is the fraction of the
  group's tokens whose *first* choice is ``e`` and ``mean_gate_e`` the mean gate probability; it is
  1 for perfectly uniform routing. The model returns ``lm_loss + aux_loss_coef * sum_layers(aux)``
  with ``aux_loss_coef = 0.01`` (the coefficient of GShard/Switch-style training).
* The group size used is ``min(group_size, T)`` when that divides ``T``; otherwise the largest
  divisor of ``T`` below ``group_size`` (so any micro-batch size traces; GShard requires equal
  groups).
* FFN width ``ffn = 8`` (``f = 8h``), dense and expert MLPs alike: Alpa's MoE benchmark sets
  ``intermediate_size = hidden * 8`` ("specific to gspmd") and its parameter counts, hence the names
  moe-380m ... moe-70b, use ``mlp_factor=8``. With ``f = 4h`` the named models would hold about half
  their names' parameters. ``ffn`` can be set in a spec string.
* Gating is computed in float32 (counts up to ``S`` must be exact, which bf16/fp16 are not), and
  ``dispatch``/``combine`` are cast back to the model dtype.

The named sizes land within 8% of their names; the excess comes from the untied ``lm_head``
(``32000 * h``) that Alpa's count, with tied embeddings, leaves out (e.g. moe-380m: 409 M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError
from planner.models.gpt import (
    CausalSelfAttention,
    FeedForward,
    attention_param_count,
    embed,
    init_transformer_weights,
    lm_loss,
)

__all__ = [
    "MOE_CONFIGS",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "capacity",
    "group_for",
    "moe_param_count",
    "top2_gating",
    "topk_gating",
]


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of a MoE model; see the module docstring for the meaning of the MoE knobs."""

    hidden: int
    layers: int
    experts: int
    heads: int = 16
    seq: int = 1024
    vocab: int = 32000
    group_size: int = 2048
    ffn: int = 8
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for key in (
            "hidden",
            "layers",
            "experts",
            "heads",
            "seq",
            "vocab",
            "group_size",
            "ffn",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"MoE {key} must be a positive integer, got {value!r}"
                )
        if self.hidden % self.heads:
            raise MeshplanError(
                f"MoE hidden={self.hidden} must be divisible by heads={self.heads}"
            )
        if self.experts < 2:
            raise MeshplanError(
                f"MoE experts must be at least 2 for top-2 gating, got {self.experts}"
            )
        if not self.capacity_factor > 0:
            raise MeshplanError(
                f"MoE capacity_factor must be > 0, got {self.capacity_factor!r}"
            )
        if not self.aux_loss_coef >= 0:
            raise MeshplanError(
                f"MoE aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` holds experts (every other block, starting with block 0)."""
        return index % 2 == 0

    def group_for(self, tokens: int) -> int:
        """The group size ``S`` used for ``tokens`` tokens (see the module docstring)."""
        return group_for(tokens, self.group_size)

    def capacity(self, group: int) -> int:
        """Expert capacity ``C`` for a group of ``group`` tokens."""
        return capacity(group, self.experts, self.capacity_factor)


def group_for(tokens: int, group_size: int) -> int:
    """The largest divisor of `tokens` that is at most `group_size` (GShard's groups are equal)."""
    s = min(group_size, tokens)
    while tokens % s:
        s -= 1
    return s


def capacity(group: int, experts: int, capacity_factor: float, k: int = 2) -> int:
    """Top-`k` expert capacity of a group: ``min(S, ceil(k S / E * capacity_factor))``."""
    return min(group, math.ceil(k * group / experts * capacity_factor))


#: The MoE sizes of Alpa's end-to-end suite (seq 1024, vocab 32000, 16 heads, group 2048).
MOE_CONFIGS: dict[str, MoEConfig] = {
    "moe-380m": MoEConfig(hidden=768, layers=8, experts=8),
    "moe-690m": MoEConfig(hidden=768, layers=8, experts=16),
    "moe-1.3b": MoEConfig(hidden=768, layers=16, experts=16),
    "moe-2.4b": MoEConfig(hidden=1024, layers=16, experts=16),
    "moe-10b": MoEConfig(hidden=1536, layers=16, experts=32),
    "moe-27b": MoEConfig(hidden=2048, layers=16, experts=48),
    "moe-70b": MoEConfig(hidden=2048, layers=32, experts=64),
}


def moe_param_count(config: MoEConfig) -> int:
    """Closed-form parameter count of ``MoE(config)``.

    Every block: attention ``4h^2 + 4h`` and two LayerNorms ``4h``. A dense block adds
    ``2 f h + f + h`` (``f = ffn * h``, with biases); a MoE block adds ``h E`` (gate) and
    ``2 E h f`` (``wi``, ``wo``). Plus ``wte`` and ``lm_head`` (``vocab * h`` each), ``wpe``
    (``seq * h``) and ``ln_f`` (``2h``).
    """
    h, e = config.hidden, config.experts
    f = config.ffn * h
    common = attention_param_count(h) + 4 * h
    dense = common + 2 * f * h + f + h
    moe = common + h * e + 2 * e * h * f
    n_moe = sum(config.is_moe_layer(i) for i in range(config.layers))
    n_dense = config.layers - n_moe
    return n_moe * moe + n_dense * dense + 2 * config.vocab * h + config.seq * h + 2 * h


def _one_hot(index: torch.Tensor, n: int) -> torch.Tensor:
    """float32 one-hot of ``index`` over ``n`` classes, by comparison with ``arange`` (traceable)."""
    classes = torch.arange(n, device=index.device, dtype=index.dtype)
    return (index.unsqueeze(-1) == classes).to(torch.float32)


def top2_gating(
    gates: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard top-2 gating of float32 ``gates[G, S, E]`` (softmax outputs): `topk_gating` with
    ``k = 2``. Returns ``combine[G, S, E, C]``, ``dispatch[G, S, E, C]`` (float32) and the scalar
    auxiliary load-balancing loss."""
    return topk_gating(gates, capacity, 2)


def topk_gating(
    gates: torch.Tensor, capacity: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's dense-dispatch gating generalised to top-`k`, for float32 ``gates[G, S, E]``.

    Every token's choices are its ``k`` best experts (``argmax`` ``k`` times, ties to the lower
    index). Each expert fills its ``capacity`` slots of a group in choice order, then token
    order: all first choices of the group, then all second choices, ... (GShard's priority for
    ``k = 2``); a choice that finds its expert full is dropped. The kept choices' gate values are
    renormalised to sum to one per token. The auxiliary loss is GShard's, from the first choices
    before capacity: ``E^2 * mean_{g,e}(density_e * mean_gate_e)`` (1 for uniform routing).

    Returns ``combine[G, S, E, C]`` (gate weights), ``dispatch[G, S, E, C]`` (0/1), both float32,
    and the scalar auxiliary loss. ``k = 2`` gives exactly what GShard's ``top2_gating`` gives.
    """
    e = gates.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise MeshplanError(f"top-k gating needs 1 <= k <= experts={e}, got k={k!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise MeshplanError(
            f"gating capacity must be a positive integer, got {capacity!r}"
        )
    masks: list[torch.Tensor] = []  # [G, S, E] one-hot of each choice
    values: list[torch.Tensor] = []  # [G, S] gate value of each choice
    remaining = gates
    for i in range(k):
        mask = _one_hot(remaining.argmax(dim=-1), e)
        masks.append(mask)
        values.append((remaining * mask).sum(dim=-1))
        if i < k - 1:
            remaining = remaining * (1.0 - mask)

    # GShard's auxiliary loss, from the first choices before capacity is applied.
    density = masks[0].mean(dim=1)  # [G, E]
    density_proxy = gates.mean(dim=1)  # [G, E]
    aux = (density * density_proxy).mean() * float(e * e)

    # Position of every choice in its expert's buffer, after the earlier choices' kept tokens;
    # drop the choices beyond the capacity.
    positions: list[torch.Tensor] = []
    offset: torch.Tensor | None = None  # [G, 1, E] slots taken by the earlier choices
    for i in range(k):
        mask = masks[i]
        pos = torch.cumsum(mask, dim=1) - mask
        if offset is not None:
            pos = pos + offset
        mask = mask * (pos < capacity).to(torch.float32)
        masks[i] = mask
        positions.append((pos * mask).sum(dim=-1))  # [G, S]
        if i < k - 1:
            count = mask.sum(dim=1, keepdim=True)
            offset = count if offset is None else offset + count

    values = [v * m.sum(dim=-1) for v, m in zip(values, masks)]
    denom = values[0]
    for v in values[1:]:
        denom = denom + v
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    values = [v / denom for v in values]

    slots = [  # [G, S, E, C]: each kept choice's slot
        mask.unsqueeze(-1) * _one_hot(pos, capacity).unsqueeze(2)
        for mask, pos in zip(masks, positions)
    ]
    dispatch = slots[0]
    for slot in slots[1:]:
        dispatch = dispatch + slot
    weighted = [v[..., None, None] * slot for v, slot in zip(values, slots)]
    combine = weighted[0]
    for w in weighted[1:]:
        combine = combine + w
    return combine, dispatch, aux


class MoEMLP(nn.Module):
    """Top-2 gated mixture of ``experts`` FFNs (``gate``, stacked ``wi[E, h, f]``, ``wo[E, f, h]``)."""

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        h, e, f = config.hidden, config.experts, config.ffn * config.hidden
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)
        self.wi = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.wo = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        if not self.wi.is_meta:  # no values to draw on the meta device
            nn.init.normal_(self.wi, std=0.02)
            nn.init.normal_(self.wo, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[B, s, h] -> (y[B, s, h], aux_loss)``."""
        b, s, h = x.shape
        group = self.config.group_for(b * s)
        capacity = self.config.capacity(group)
        xg = x.reshape(b * s // group, group, h)  # [G, S, h]
        gates = F.softmax(self.gate(xg).float(), dim=-1)  # [G, S, E]
        combine, dispatch, aux = top2_gating(gates, capacity)
        combine, dispatch = combine.to(x.dtype), dispatch.to(x.dtype)
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, xg)
        hidden = F.gelu(torch.einsum("egcm,emf->egcf", expert_in, self.wi))
        expert_out = torch.einsum("egcf,efm->egcm", hidden, self.wo)
        y = torch.einsum("gsec,egcm->gsm", combine, expert_out)
        return y.reshape(b, s, h), aux


class MoEBlock(nn.Module):
    """A pre-LayerNorm block whose ``mlp`` is a dense ``FeedForward`` or a ``MoEMLP``."""

    def __init__(
        self, config: MoEConfig, moe: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        h = config.hidden
        self.is_moe = moe
        self.ln_1 = nn.LayerNorm(h, dtype=dtype)
        self.attn = CausalSelfAttention(h, config.heads, dtype=dtype)
        self.ln_2 = nn.LayerNorm(h, dtype=dtype)
        self.mlp = (
            MoEMLP(config, dtype=dtype)
            if moe
            else FeedForward(h, config.ffn, dtype=dtype)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x[B, s, h] -> (x[B, s, h], aux_loss or None for a dense block)``."""
        x = x + self.attn(self.ln_1(x))
        if self.is_moe:
            y, aux = self.mlp(self.ln_2(x))
            return x + y, aux
        return x + self.mlp(self.ln_2(x)), None


class MoE(nn.Module):
    """MoE language model; ``forward(tokens[B, s], targets[B, s])`` returns LM loss + aux loss."""

    #: each block's forward depends on its own modules and parameters, not on its index: the
    #: tracer may trace a few and repeat them (`planner.tracing.repeat`)
    repeats_blocks = True

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.wte = nn.Embedding(config.vocab, h, dtype=dtype)
        self.wpe = nn.Embedding(config.seq, h, dtype=dtype)
        self.blocks = nn.ModuleList(
            MoEBlock(config, config.is_moe_layer(i), dtype=dtype)
            for i in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(h, dtype=dtype)
        self.lm_head = nn.Linear(h, config.vocab, bias=False, dtype=dtype)
        init_transformer_weights(self, config.layers)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``lm_loss + aux_loss_coef * sum of the MoE layers' auxiliary losses`` (a scalar)."""
        x = embed(self.wte, self.wpe, tokens, self.config.seq)
        aux_total = None
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        loss = lm_loss(self.lm_head(self.ln_f(x)), targets)
        if aux_total is not None and self.config.aux_loss_coef > 0:
            loss = loss + self.config.aux_loss_coef * aux_total.to(loss.dtype)
        return loss
