"""Views that merge or split a dimension sharded on two mesh axes: data x context parallelism.

With data parallelism on axis ``a`` and the sequence split on a later axis ``b`` (context or
sequence parallelism), a micro-batch of one row per data-parallel device lies as
``[rows, s, h]`` placed ``(S(0), S(1))``: device ``(i, j)`` holds row ``i``, sequence block ``j``.
A traced linear flattens it to ``[rows * s, h]`` around its matrix product; there that device
holds the contiguous block ``i * B + j`` (B the size of axis b), which is ``(S(0), S(0))``,
DTensor's nesting of one dimension on two axes (axis a outer), and splitting the merged
dimension back gives ``(S(0), S(1))`` again. Neither view moves data::

    flatten    [.., n, m, ..] (S(d) on a, S(d+1) on b)  ->  [.., n * m, ..] (S(d) on a and b)
    unflatten  the reverse

exactly when ``n`` equals the size of axis a (one row per device along it; with more rows the
merged dimension is a strided shard, which the plan vocabulary has no string for) and ``m``
divides by the size of axis b. Every other axis (tensor parallelism on a (dp, cp, tp) mesh)
keeps its placement through the view: replicated, partial (a row-parallel product's output,
reduce-scattered later for sequence parallelism), or sharding a dim the view leaves alone (the
hidden or feed-forward dim of a column-parallel product), divisibly.

What PyTorch lacks: DTensor's view rule runs the flatten, its output written as
``_StridedShard(d, split_factor=1)`` on axis b (the layout of ``Shard(d)``), and runs the
unflatten when its input is written so; given ``Shard(d)`` on both axes the unflatten (torch
2.13) computes a local shape for a sharding it does not do and fails. The planner's probes give
no such strategy (`planner.intra.strategies` drops strided shards), so `nested_view_strategies`
adds both views' strategies, and the runtime hands the unflatten its input in the strided
writing (`runtime.executor`; `runtime.redistribute` relabels between the two writings of one
layout without communication).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from planner.vocab.placements import Placements
from planner.vocab.strategy import Strategy

__all__ = ["NESTED_SOURCE", "VIEWS", "nested_unflatten", "nested_view_strategies"]

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
NESTED_SOURCE = "nested_view"


def _merged(split: Sequence[int], merged: Sequence[int]) -> int | None:
    """The dim d such that `merged` is `split` with dims d and d + 1 multiplied into one, or
    None."""
    if len(merged) != len(split) - 1:
        return None
    for d in range(len(merged)):
        if (
            tuple(split[:d]) == tuple(merged[:d])
            and split[d] * split[d + 1] == merged[d]
            and tuple(split[d + 2 :]) == tuple(merged[d + 1 :])
        ):
            return d
    return None


def nested_view_strategies(
    in_shape: Sequence[int], out_shape: Sequence[int], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """The flatten or unflatten strategies of a view from `in_shape` to `out_shape` on a mesh of
    `mesh_shape` (module docstring): per pair of axes a < b of more than one device where the
    split side has exactly mesh_shape[a] entries in the outer dim and the inner dim divides by
    mesh_shape[b], one per placement of the other axes (each replicated, partial, or sharding
    a dim outside the view's, evenly). [] for any other view."""
    flatten = _merged(in_shape, out_shape)
    split_shape, d = (in_shape, flatten)
    if flatten is None:
        split_shape, d = (out_shape, _merged(out_shape, in_shape))
        if d is None:
            return []
    n = len(mesh_shape)
    out = []
    for a in range(n):
        for b in range(a + 1, n):
            A, B = mesh_shape[a], mesh_shape[b]
            if A < 2 or B < 2 or split_shape[d] != A or split_shape[d + 1] % B:
                continue
            others = [c for c in range(n) if c not in (a, b) and mesh_shape[c] > 1]
            for rest in itertools.product(
                *(_kept(split_shape, d, mesh_shape[c]) for c in others)
            ):
                if not _divides(split_shape, rest, [mesh_shape[c] for c in others]):
                    continue
                split, merged = ["R"] * n, ["R"] * n
                split[a], split[b] = f"S({d})", f"S({d + 1})"
                merged[a] = merged[b] = f"S({d})"
                for c, k in zip(others, rest):
                    kept = isinstance(k, str)  # "R" or "P"
                    split[c] = k if kept else f"S({k})"
                    merged[c] = k if kept else f"S({k - (k > d)})"
                src, dst = (split, merged) if flatten is not None else (merged, split)
                out.append(Strategy((tuple(dst),), (tuple(src),), NESTED_SOURCE))
    return out


def _kept(split_shape: Sequence[int], d: int, size: int) -> list:
    """What another axis of `size` devices may hold through the view: "R", "P", or a dim of the
    split side outside d and d + 1 (as an int)."""
    return ["R", "P"] + [
        k
        for k in range(len(split_shape))
        if k not in (d, d + 1) and split_shape[k] % size == 0
    ]


def _divides(split_shape: Sequence[int], rest: tuple, sizes: list[int]) -> bool:
    """Whether the dims the other axes shard divide by the product of their axes' sizes."""
    shards: dict[int, int] = {}
    for k, size in zip(rest, sizes):
        if not isinstance(k, str):
            shards[k] = shards.get(k, 1) * size
    return all(split_shape[k] % m == 0 for k, m in shards.items())


def nested_unflatten(inp: Placements, output: Placements) -> int | None:
    """The later of the two axes sharding one dimension of the view's input `inp` when the view
    splits that dimension over them (`output` places them on two dims): the axis whose
    ``Shard`` DTensor must see as ``_StridedShard(d, 1)`` (module docstring); None otherwise."""
    for b, p in enumerate(inp):
        if p.startswith("S") and p in inp[:b]:
            a = inp.index(p)
            if output[a] != output[b]:
                return b
    return None
