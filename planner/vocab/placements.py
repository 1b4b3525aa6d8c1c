"""Placements and their string form, as plans write them and the runtime reads them.

A placement says how a tensor lies on one axis of a stage's logical mesh. A plan writes one string
per mesh axis:

    "R"        replicated: every device of the axis holds the whole tensor      (Replicate())
    "S(d)"     sharded: split evenly along tensor dimension d >= 0              (Shard(d))
    "P"        partial sum: the devices' tensors add up to the value            (Partial("sum"))
    "P(op)"    partial under op in avg, max, min                                (Partial(op))
    "P(mask)"  a vocabulary-sharded embedding's masked partial (DTensor's _MaskPartial)
    "P(norm)"  a sharded norm's partial (DTensor's _NormPartial)

"P(mask)" and "P(norm)" carry data DTensor attaches when the op runs, so they can be read from a
DTensor but not built from a string (no strategy needs them as an input). The conversions to and
from DTensor's placement objects are `planner.vocab.dtensor_ext.placement_to_str` and
`str_to_placement`; this module needs no torch, so reading a plan file is cheap.
"""

from __future__ import annotations

import math
import re

Placements = tuple[str, ...]  # one placement per mesh axis

PARTIAL_OPS = ("sum", "avg", "max", "min")
_PLACEMENT = re.compile(r"R|S\((0|[1-9][0-9]*)\)|P|P\((sum|avg|max|min|mask|norm)\)")
VALID = "R, S(d) with d >= 0, P, or P(op) with op in sum, avg, max, min, mask, norm"


def is_placement(s: object) -> bool:
    """Whether `s` is the string form of a placement (module docstring)."""
    return isinstance(s, str) and _PLACEMENT.fullmatch(s) is not None


def norm(p: str) -> str:
    """A partial placement of any kind as "P" (they move alike)."""
    return "P" if p.startswith("P") else p


def shards(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """Into how many pieces `placements` split a tensor on a mesh of `mesh_shape`."""
    return math.prod(
        size for p, size in zip(placements, mesh_shape) if p.startswith("S")
    )


def mesh_axes(mesh_shape: tuple[int, ...]) -> list[int]:
    """The logical-mesh axes a DeviceMesh keeps: those of size > 1. Strategies are derived on
    them, and a stage's DeviceMesh has exactly them (`device_mesh_shape`)."""
    return [a for a, size in enumerate(mesh_shape) if size > 1]


def device_mesh_shape(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the DeviceMesh a logical mesh runs on: its size-1 axes dropped ((1,) when
    all are)."""
    return tuple(mesh_shape[a] for a in mesh_axes(mesh_shape)) or (1,)


def zero_shard(
    shape: tuple[int, ...],
    placements: Placements,
    mesh_shape: tuple[int, ...],
    axes: tuple[int, ...] | list[int] | None = None,
) -> Placements:
    """Where a ZeRO / FSDP parameter keeps its optimizer-side shard: `placements` with every
    replicated axis of size > 1 turned into ``S(d)``, d the largest dimension that the axis
    divides after the planned sharding (the first such on ties); an axis with no such dimension
    stays replicated. `axes`: only these axes are sharded (hybrid sharding, HSDP: the axes
    inside a host; ``StagePlan.fsdp_axes``), the others stay as planned; None: every axis. The
    runtime shards by this rule and the planner prices it."""
    local = list(shape)
    for p, n in zip(placements, mesh_shape):
        if p.startswith("S"):
            local[int(p[2:-1])] //= n
    out = list(placements)
    for a, (p, n) in enumerate(zip(placements, mesh_shape)):
        if p != "R" or n == 1 or (axes is not None and a not in axes):
            continue
        dims = [d for d in range(len(local)) if local[d] % n == 0 and local[d] >= n]
        if dims:
            d = max(dims, key=lambda d: local[d])
            out[a] = f"S({d})"
            local[d] //= n
    return tuple(out)


def fsdp_gradient(planned: Placements, mesh_shape: tuple[int, ...]) -> Placements:
    """An FSDP / HSDP parameter's gradient as its consumers hand it back: partial on every
    replicating axis of size > 1 (the consumers are split there, as data parallelism splits
    them), as planned elsewhere."""
    return tuple("P" if p == "R" and n > 1 else p for p, n in zip(planned, mesh_shape))


def reduce_midpoint(planned: tuple, held: tuple, grad: tuple) -> tuple:
    """Where an FSDP / HSDP gradient `grad` goes first on its way to the shard `held`: the
    shard on the axes that shard it (reduce-scatter), `grad`'s placement on the others. From
    there an all-reduce of the shard on the axes still partial reaches `held` (HSDP: inside the
    host first, then across hosts on 1/m of the bytes, as torch's FSDP2 reduces; for FSDP the
    midpoint is the shard itself). Elementwise on any placements that compare by value
    (strings here, DTensor's placements in `runtime.fsdp`)."""
    return tuple(h if h != p else g for p, h, g in zip(planned, held, grad))
