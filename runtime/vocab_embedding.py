"""Run an embedding planned vocabulary-parallel: the table split by rows (vocabulary) on some mesh
axes, the output partial there (the plan's "P(mask)"), as Megatron's VocabParallelEmbedding
computes it.

Each rank looks up the tokens that fall in its rows (the others read row 0 and are zeroed) and
returns a partial sum over the axes that split the table; the consumer's edge reduces it as the
planner priced ("P(mask)" moves as "P", `planner.vocab.placements.norm`). Written in local ops,
so autograd differentiates them: the table's gradient is this rank's rows only, split like the
table (a partial sum on the axes that split the tokens, where each rank holds its own tokens'
share, to be reduced when the gradients are synced), and the rows of tokens outside them get
nothing.

What PyTorch lacks: DTensor runs the forward the same way (its ``_MaskPartial``), but its rule for
the backward (``embedding_dense_backward``) has no row split: the replicated output gradient
gives a replicated table gradient, the whole vocabulary on every device, sliced to the shard only
when the gradients are synced (`runtime.grad_sync`). A 4-process run (tp2 x pp2 GPT, vocabulary
512) held that full 256 KiB gradient where the plan prices a 128 KiB shard; for a 128K x 8192
vocabulary in bf16 that is 2 GiB per device beside a 256 MiB shard of 8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "EMBEDDING",
    "MASK",
    "output_placements",
    "vocab_axes",
    "vocab_parallel_embedding",
]

MASK = "P(mask)"
EMBEDDING = torch.ops.aten.embedding.default


def vocab_axes(weight: Sequence[str], output: Sequence[str]) -> list[int] | None:
    """The mesh axes on which a planned embedding (its weight's and output's placement strings)
    is vocabulary-parallel: the weight split by rows and the output "P(mask)" there, the weight
    replicated elsewhere. None when the plan is anything else (left to DTensor)."""
    axes = [i for i, p in enumerate(weight) if p == "S(0)"]
    if not axes or any(p not in ("R", "S(0)") for p in weight):
        return None
    if [i for i, p in enumerate(output) if p == MASK] != axes:
        return None
    return axes


def vocab_parallel_embedding(
    mesh: DeviceMesh,
    weight_shape: Sequence[int],
    weight_placements: tuple[Placement, ...],
    out_placements: tuple[Placement, ...],
) -> Callable[..., DTensor]:
    """The embedding node's callable (``aten.embedding``'s signature) on DTensors: the weight split
    by rows, the indices as planned; the output in `out_placements` (``Partial("sum")`` on the
    vocabulary axes, on the squeezed `mesh`). ``scale_grad_by_freq`` and ``sparse`` are not
    vocabulary-parallel here (the masked tokens would count as row 0's): DTensor runs those."""

    # this rank's rows of the table, found before any trace (the mesh coordinate is data there)
    shape, offset = compute_local_shape_and_global_offset(
        torch.Size(weight_shape), mesh, weight_placements
    )
    lo, rows = offset[0], shape[0]

    def run(
        weight: DTensor,
        indices: DTensor,
        padding_idx: int = -1,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> DTensor:
        if scale_grad_by_freq or sparse:
            return EMBEDDING(weight, indices, padding_idx, scale_grad_by_freq, sparse)
        # the gradient: this rank's rows where the table is split; a partial sum where it is
        # replicated but the tokens are split (each rank has its own tokens' share)
        split = indices.placements if isinstance(indices, DTensor) else ()
        grad = tuple(
            Partial()
            if p.is_replicate() and i < len(split) and not split[i].is_replicate()
            else p
            for i, p in enumerate(weight.placements)
        )
        local = weight.to_local(grad_placements=grad)
        ids = indices.to_local() if isinstance(indices, DTensor) else indices
        outside = (ids < lo) | (ids >= lo + rows)
        pad = padding_idx - lo if lo <= padding_idx < lo + rows else -1
        out = EMBEDDING(local, (ids - lo).masked_fill(outside, 0), pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return DTensor.from_local(out, mesh, out_placements, run_check=False)

    return run


def output_placements(
    strings: Sequence[str], axes: Sequence[int], parse: Callable[[tuple], Any]
) -> tuple[Placement, ...]:
    """The output's DTensor placements: `strings` (one per logical-mesh axis) with "P(mask)" on
    the vocabulary `axes` read as "P"; `parse` turns plan strings into placements."""
    return parse(tuple("P" if i in axes else s for i, s in enumerate(strings)))
