"""Run an attention node planned context-parallel (`planner.vocab.context`).

The executor has already moved the node's inputs to the planned placements: q split along the
sequence on the CP axis, k and v all-gathered there (the edges S(2) -> R, whose backward
reduce-scatters the partial gradients, `runtime.redistribute.Edge`). `context_attention` computes
this rank's queries against the keys up to its last position, with the causal mask offset by its
first position, on the local tensors, and returns the outputs split along the sequence. k's and
v's local tensors are taken with ``grad_placements`` partial on the CP axis: each rank's gradient
of the gathered keys is its queries' share, summed over the axis by the edge's reduce-scatter.
No collective is issued here; every one is an edge the planner priced.

What PyTorch lacks: DTensor has no sharding rule for attention split along the sequence (it
would run the kernel on local queries with the causal mask not offset), and torch's
``context_parallel`` handles only the CUDA attention kernels, module-wide
(`planner.vocab.context`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from cost_models.errors import MeshplanError
from planner.vocab.context import SEQ_DIM, causal_offset_mask

__all__ = ["context_attention"]


def context_attention(
    kernel: Callable[..., Any],
    mesh: DeviceMesh,
    dim: int,
    strides: tuple[tuple[int, ...], tuple[int, ...]],
) -> Callable[..., tuple[DTensor, DTensor]]:
    """The attention node's callable (the CPU kernel's signature) with the sequence split over
    `mesh` dimension `dim`; `kernel` computes attention on local tensors (the CPU kernel, or the
    device's, `runtime.device_ops`). `strides`: the traced node's output and logsumexp strides,
    given to the outputs as their global strides (DTensor would infer them from the local
    tensors, where the kernel may give a dimension of one entry, such as a micro-batch row per
    data-parallel device, any stride, and a later view of the output then fails)."""
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)

    def run(
        q: DTensor,
        k: DTensor,
        v: DTensor,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> tuple[DTensor, DTensor]:
        if dropout_p or attn_mask is not None:
            raise MeshplanError(
                "context-parallel attention takes no dropout and no explicit mask"
            )
        gathered = tuple(
            Partial() if i == dim else p for i, p in enumerate(k.placements)
        )
        ql = q.to_local()
        kl = k.to_local(grad_placements=gathered)
        vl = v.to_local(grad_placements=gathered)
        n = ql.shape[SEQ_DIM]
        if kl.shape[SEQ_DIM] != n * size:
            raise MeshplanError(
                f"context-parallel attention: {n} local queries on {size} devices against "
                f"{kl.shape[SEQ_DIM]} keys"
            )
        mask = None
        if is_causal:  # keys after this rank's last query never count: not even read
            start = rank * n
            kl, vl = kl[:, :, : start + n], vl[:, :, : start + n]
            mask = causal_offset_mask(n, start, ql.dtype, ql.device)
        out, lse = kernel(ql, kl, vl, 0.0, False, attn_mask=mask, scale=scale)[:2]
        shapes = ((*q.shape[:3], v.shape[3]), q.shape[:3])
        return tuple(
            DTensor.from_local(
                _laid_out(t, stride),
                mesh,
                q.placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
            for t, shape, stride in zip((out, lse), shapes, strides)
        )

    return run


def _laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`t` with its dimensions in memory in the order of `stride` (outermost first), copied
    when they are not: the CPU kernel lays its output out as its queries are, and queries that
    a redistribution made contiguous in ``[B, heads, s, d]`` give an output whose transpose a
    later view (as traced, on the kernel's ``[B, s, heads, d]`` layout) cannot merge."""
    order = sorted(range(t.dim()), key=lambda i: -stride[i])
    if t.permute(order).is_contiguous():
        return t
    back = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(back)
