"""Context parallelism: attention with the sequence split over a mesh axis (the plan vocabulary's
side, read by the planner and the runtime alike).

A context-parallel (CP) strategy of the CPU attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, what ``F.scaled_dot_product_attention``
traces to; q, k, v ``[B, heads, s, d]``) on mesh axis ``a`` of ``C`` devices is, on that axis::

    q: S(2)    k: R    v: R    ->    out: S(2)    logsumexp: S(2)

with any of DTensor's batch (S(0)) or head (S(1)) strategies on the other axes. It is the
all-gather formulation of Llama 3 (Dubey et al. 2024, section 3.3.2) and torchtitan's
``set_rotate_method("allgather")``: k and v arrive split by the sequence and are all-gathered
(the edge S(2) -> R, priced by `cost_models` as every redistribution); rank ``r`` of the axis
computes its ``n = s / C`` contiguous queries (positions ``r n .. r n + n - 1``) against the keys
``0 .. r n + n - 1`` with the causal mask offset by ``r n`` (`causal_offset_mask`); in backward
its gradients of k and v are partial sums over the axis (the consumer's gradient placement "P",
`planner.vocab.grads.grad_from_consumer`), reduce-scattered back to S(2) by the same edge.

Work: the cost model counts attention as the full ``s_q x s_k`` product (FlopCounterMode's SDPA
formula, no causal discount). The most loaded rank, the last, computes its ``s / C`` queries
against all ``s`` keys: exactly ``1 / C`` of that count, the split-by-C price every sharded op
gets (`planner.intra.prices.split_factor`); the other ranks do less (rank r: ``(r + 1) / C`` of
it) and wait. So the price is the critical rank's, with contiguous chunks, no load balancing. The bytes it
reads: its queries and outputs (1 / C) and the gathered k and v whole (the last rank reads every
key); and the kernel saves those gathered k and v for backward:
`planner.intra.context.gathered_kv_bytes` adds both to the node's prices
(`planner.intra.prices`).

DTensor has no such strategy (its rules shard attention by batch or heads only): local queries
against gathered keys need the offset mask, which no DTensor rule can express. So the planner adds
these strategies itself (`planner.intra.strategies.node_strategies`), and the runtime runs a node
planned so with `runtime.context.context_attention` instead of letting DTensor dispatch it.
PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` handles only the CUDA
kernels (flash, memory-efficient, cuDNN); on torch 2.13 on CPU it fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered" (checked on gloo), and it replaces SDPA module-wide rather than per planned node.

Offered only without dropout and without an explicit mask, for self-attention (q, k, v of equal
sequence length, three distinct input nodes), when the sequence divides by the axis size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from planner.vocab.placements import Placements
from planner.vocab.strategy import Strategy

__all__ = [
    "CP_SOURCE",
    "SDPA",
    "SEQ_DIM",
    "causal_offset_mask",
    "context_axis",
    "context_strategies",
    "eligible",
]

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SEQ_DIM = 2  # q, k, v, out [B, heads, s, d], logsumexp [B, heads, s]
CP_SOURCE = "context"
_SPLIT = f"S({SEQ_DIM})"


def context_axis(strategy: Strategy) -> int | None:
    """The mesh axis on which an attention node's `strategy` is context-parallel (q split along
    the sequence, k and v replicated there), or None."""
    if len(strategy.inputs) < 3 or any(p is None for p in strategy.inputs[:3]):
        return None
    q, k, v = strategy.inputs[:3]
    for a, p in enumerate(q):
        if p == _SPLIT and k[a] == "R" and v[a] == "R":
            return a
    return None


def context_strategies(
    node: torch.fx.Node, base: Sequence[Strategy], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """The CP strategies of an attention `node` (module docstring): for every mesh axis of more
    than one device dividing the sequence, each of DTensor's strategies `base` that is
    replicated on that axis, with the axis made context-parallel. [] for any other node."""
    if node.target is not SDPA or not eligible(node):
        return []
    seq = node.args[0].meta["val"].shape[SEQ_DIM]
    out = []
    for a, size in enumerate(mesh_shape):
        if size < 2 or seq % size:
            continue
        for s in base:
            places = [p for p in (*s.output, *s.inputs) if p]
            if any(p[a] != "R" for p in places):
                continue
            out.append(
                Strategy(
                    tuple(_on(p, a, _SPLIT) for p in s.output),
                    (_on(s.inputs[0], a, _SPLIT), *s.inputs[1:]),
                    CP_SOURCE,
                )
            )
    return out


def _on(p: Placements, axis: int, placement: str) -> Placements:
    return tuple(placement if i == axis else x for i, x in enumerate(p))


def eligible(node: torch.fx.Node) -> bool:
    """Whether attention `node` may be context-parallel (module docstring)."""
    args = node.args
    dropout = args[3] if len(args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if dropout or node.kwargs.get("attn_mask") is not None or len(args) < 3:
        return False
    q, k, v = args[:3]
    if len({q, k, v}) < 3 or not all(isinstance(t, torch.fx.Node) for t in (q, k, v)):
        return False
    shapes = [t.meta["val"].shape for t in (q, k, v)]
    return all(len(s) == 4 for s in shapes) and len({s[SEQ_DIM] for s in shapes}) == 1


def causal_offset_mask(
    queries: int, start: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The additive causal mask ``[queries, start + queries]`` of queries at positions
    ``start .. start + queries - 1`` against keys ``0 .. start + queries - 1``: 0 where the key
    is at or before the query, -inf after (the CPU kernel takes a mask of the query's dtype)."""
    keys = start + queries
    keep = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(start)
    return torch.zeros(queries, keys, dtype=dtype, device=device).masked_fill(
        ~keep, float("-inf")
    )
