"""Placements of a tensor on a logical mesh and the price of moving between two of them.

A placement per mesh axis is ``R`` (replicated), ``S(d)`` (sharded on dim d) or ``P`` (partial
sum), as DTensor's Replicate / Shard / Partial; `reshard_steps` turns a change of placements into
collectives on single mesh axes priced by `cost_models.communication` (its byte convention: the
full tensor of the collective's group), and `reshard_cost` sums them, optionally with the
gradient's way back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError


@dataclass(frozen=True)
class Placement:
    """How a tensor lies on one mesh axis: ``R`` replicated, ``S(d)`` sharded on dim d, ``P`` partial sum."""

    kind: str
    dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P") or (self.kind == "S") != (
            self.dim is not None
        ):
            raise MeshplanError(
                f"bad placement {self.kind}{'' if self.dim is None else f'({self.dim})'}"
            )

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int) -> Placement:
    """``S(dim)``."""
    return Placement("S", int(dim))


_SHARD_RE = re.compile(
    r"^(?:s|shard)\s*(?:\(\s*(?:dim\s*=\s*)?([+-]?\d+)\s*\)|([+-]?\d+))$", re.IGNORECASE
)


def parse_placement(text: str | Placement | object) -> Placement:
    """``"R"``, ``"S(0)"``, ``"S0"``, ``"P"``, or DTensor's ``Replicate()``, ``Shard(dim=0)``, ``Partial(sum)``, ``P(sum)``."""
    if isinstance(text, Placement):
        return text
    if isinstance(text, str):
        hit = _PARSED.get(text)
        if hit is None:
            hit = _PARSED[text] = _parse_placement(text)
        return hit
    return _parse_placement(text)


_PARSED: dict[str, Placement] = {}  # text -> placement (placements are immutable)


def _parse_placement(text: object) -> Placement:
    s = str(text).strip()
    low = s.lower()
    if low in ("r", "replicate", "replicate()"):
        return REPLICATE
    if low in ("p", "p(sum)", "partial", "partial()", "partial(sum)"):
        return PARTIAL
    m = _SHARD_RE.match(s)
    if m:
        return shard(int(m.group(1) or m.group(2)))
    raise MeshplanError(f"bad placement {s!r}; expected R, S(dim) or P")


def parse_placements(spec: str | tuple | list) -> tuple[Placement, ...]:
    """One placement per mesh axis from ``"S(0),R"``, ``"(S(0), R)"`` or a sequence of placements."""
    if isinstance(spec, str):
        body = spec.strip()
        if body[:1] in "([" and body[-1:] in ")]" and not _SHARD_RE.match(body):
            body = body[1:-1]
        parts, depth, cur = [], 0, ""
        for ch in body:
            depth += ch == "("
            depth -= ch == ")"
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        return tuple(parse_placement(p) for p in parts if p.strip())
    return tuple(parse_placement(p) for p in spec)


def format_placements(placements: tuple | list | str) -> str:
    """``(S(0), R)``."""
    return "(" + ", ".join(str(p) for p in parse_placements(placements)) + ")"


@dataclass(frozen=True)
class ReshardStep:
    """One step of a redistribution: mesh axis, placements before/after, collective (None: local), cost."""

    axis: int
    src: Placement
    dst: Placement
    collective: str | None
    nbytes: float
    seconds: float

    def __str__(self) -> str:
        what = self.collective or "local"
        return f"axis {self.axis}: {self.src} -> {self.dst} ({what}, {self.nbytes:.0f} B, {self.seconds:.3g} s)"


def _is_gloo(cluster: Cluster) -> bool:
    profile = cluster.profile
    return profile is not None and profile.backend.lower() == "gloo"


def _step_collective(src: Placement, dst: Placement) -> str | None:
    if src.kind == "S" and dst.kind == "S":
        return "all_to_all"
    return {
        ("S", "R"): "all_gather",
        ("P", "R"): "all_reduce",
        ("P", "S"): "reduce_scatter",
    }.get((src.kind, dst.kind))


def _prepare(
    mesh: Cluster | LogicalMesh, shape: tuple[int, ...], src: object, dst: object
) -> tuple[LogicalMesh, tuple[Placement, ...], tuple[Placement, ...]]:
    lm = mesh if isinstance(mesh, LogicalMesh) else LogicalMesh.of(mesh)
    ndim = len(shape)

    def norm(ps: object, what: str) -> tuple[Placement, ...]:
        out = parse_placements(ps)  # type: ignore[arg-type]
        if len(out) != len(lm.shape):
            raise MeshplanError(
                f"{what} placements {format_placements(out)} need one entry per mesh axis ({len(lm.shape)})"
            )
        fixed = []
        for p in out:
            if p.is_shard:
                d = p.dim + ndim if p.dim < 0 else p.dim
                if not 0 <= d < ndim:
                    raise MeshplanError(
                        f"{what} placement {p} is out of range for a {ndim}-d tensor {tuple(shape)}"
                    )
                p = shard(d)
            fixed.append(p)
        return tuple(fixed)

    return lm, norm(src, "source"), norm(dst, "target")


def _transitions(
    sizes: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """DTensor's greedy redistribution order (torch 2.13 ``generate_greedy_transform_infos``).

    If the source is sharded at all, walk the mesh axes from last to first, moving each to its target,
    except that a target ``S(d)`` whose sharding of dim d on EARLIER axes differs between the current
    and the target placements (nested sharding out of order) goes to ``R`` first. Then walk the axes
    first to last finishing every axis still off target.
    """
    cur, tgt = list(src), list(dst)
    steps = []
    num_shards = 1
    for p, n in zip(src, sizes):
        num_shards *= n if p.is_shard else 1
    if num_shards > 1:
        for i in reversed(range(len(cur))):
            c, t = cur[i], tgt[i]
            if t.is_shard:
                before_c = [j for j in range(i) if cur[j] == t]
                before_t = [j for j in range(i) if tgt[j] == t]
                if before_c != before_t:
                    t = REPLICATE
            if c != t:
                steps.append((i, c, t))
                cur[i] = t
    for i in range(len(cur)):
        if cur[i] != tgt[i]:
            steps.append((i, cur[i], tgt[i]))
            cur[i] = tgt[i]
    return steps


def reshard_steps(
    mesh: Cluster | LogicalMesh,
    shape: tuple[int, ...],
    dtype_bytes: float,
    src: object,
    dst: object,
) -> list[ReshardStep]:
    """The steps redistributing a tensor of global ``shape`` from ``src`` to ``dst`` placements, priced.

    Order: DTensor's (``_transitions``). Per axis step, with B = the tensor's bytes divided by the
    sizes of the OTHER axes that currently shard it (the group's full tensor):

    ================  ==========================  ================  ==========================
    step              collective                  step              collective
    ================  ==========================  ================  ==========================
    S(d) -> R         all_gather(B)               R -> S(d)         none (local slice)
    P -> R            all_reduce(B)               R -> P            none (local: keep v / n)
    P -> S(d)         reduce_scatter(B)           S(i) -> S(j)      all_to_all(B)
    S(d) -> P         all_gather(B), then R -> P  same -> same      nothing
    ================  ==========================  ================  ==========================

    DTensor refuses S -> P outright; we decompose it into S -> R -> P (two steps listed), which is
    also how the runtime must perform it. DTensor may fuse consecutive same-kind steps over a
    flattened mesh when one exists; we price the steps separately.
    """
    return [ReshardStep(*step) for step in _priced(mesh, shape, dtype_bytes, src, dst)]


def _priced(
    mesh: Cluster | LogicalMesh,
    shape: tuple[int, ...],
    dtype_bytes: float,
    src: object,
    dst: object,
) -> Iterator[tuple[int, Placement, Placement, str | None, float, float]]:
    """`reshard_steps`' fields, step by step (`reshard_cost` sums the seconds alone)."""
    lm = mesh if isinstance(mesh, LogicalMesh) else LogicalMesh.of(mesh)
    sizes = lm.shape
    try:
        key = (tuple(n > 1 for n in sizes), len(shape), src, dst)
        plan = _PLANS.get(key)
    except TypeError:  # unhashable placements (lists): not kept
        key, plan = None, None
    if plan is None:
        plan = _steps_plan(lm, shape, src, dst)
        if key is not None:
            _PLANS[key] = plan
    total = float(dtype_bytes)
    for n in shape:
        total *= n
    for i, c, t, divisors, op in plan:
        group = total
        for j in divisors:
            group /= sizes[j]
        if op == "all_to_all" and _is_gloo(lm.cluster):
            # DTensor's shard-to-shard on a CPU (gloo) mesh is an all-gather of the group's tensor
            # followed by a local chunk: gloo has no all-to-all (torch 2.13, shard_dim_alltoall).
            op = "all_gather"
        yield i, c, t, op, group, lm.collective(op, group, i) if op else 0.0


# (which mesh axes have more than one device, tensor dims, source, target) -> `_steps_plan`: what
# `reshard_steps` reads of neither the tensor's bytes, the axis sizes nor the cluster, the same for
# every tensor of that many dims on every mesh of that pattern (the 13 two-axis meshes of 64
# devices share one)
_PLANS: dict[
    tuple, list[tuple[int, Placement, Placement, tuple[int, ...], str | None]]
] = {}


def _steps_plan(
    lm: LogicalMesh, shape: tuple[int, ...], src: object, dst: object
) -> list[tuple[int, Placement, Placement, tuple[int, ...], str | None]]:
    """`reshard_steps` without the bytes: per step its axis, placements before and after, the
    other axes then sharding the tensor (its group's bytes are the tensor's divided by their
    sizes, in this order) and its collective (before gloo's substitution). The sizes matter
    only as more than one device or not (`_transitions`)."""
    _, s, d = _prepare(lm, shape, src, dst)
    sizes = lm.shape
    cur = list(s)
    expanded: list[tuple[int, Placement, Placement]] = []
    for i, c, t in _transitions(sizes, s, d):
        if c.is_shard and t.kind == "P":
            expanded += [(i, c, REPLICATE), (i, REPLICATE, t)]
        else:
            expanded.append((i, c, t))
    plan = []
    for i, c, t in expanded:
        divisors = tuple(j for j, p in enumerate(cur) if j != i and p.is_shard)
        plan.append((i, c, t, divisors, _step_collective(c, t)))
        cur[i] = t
    return plan


def backward_placements(
    src: object, dst: object
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(gradient's placements, target) of the backward of a ``src -> dst`` redistribution.

    The gradient arrives in ``dst``'s placements except that the gradient of a partial-sum tensor is
    the gradient of the sum, i.e. replicated (P -> R). It returns to ``src`` except that a target P
    reached from S or R stays R, as DTensor's ``_redistribute_backward`` does.
    """
    s, d = parse_placements(src), parse_placements(dst)  # type: ignore[arg-type]
    grad = tuple(REPLICATE if p.kind == "P" else p for p in d)
    target = tuple(
        REPLICATE if t.kind == "P" and g.kind != "P" else t for g, t in zip(grad, s)
    )
    return grad, target


def reshard_cost(
    mesh: Cluster | LogicalMesh,
    shape: tuple[int, ...],
    dtype_bytes: float,
    src: object,
    dst: object,
    *,
    include_backward: bool = False,
) -> float:
    """Seconds to redistribute a tensor from ``src`` to ``dst`` placements (sum of ``reshard_steps``).

    ``mesh`` is a LogicalMesh or a Cluster (then its whole physical mesh, hosts x devices per host).
    ``include_backward`` adds the gradient's way back (``backward_placements``).
    """
    fwd = sum(seconds for *_, seconds in _priced(mesh, shape, dtype_bytes, src, dst))
    if not include_backward:
        return fwd
    grad, target = backward_placements(src, dst)
    return fwd + sum(
        seconds for *_, seconds in _priced(mesh, shape, dtype_bytes, grad, target)
    )


def local_bytes(
    mesh: Cluster | LogicalMesh,
    shape: tuple[int, ...],
    dtype_bytes: float,
    placements: object,
) -> float:
    """Bytes one device holds: the tensor's bytes divided by the size of every axis that shards it."""
    lm, p, _ = _prepare(mesh, shape, placements, placements)
    out = float(dtype_bytes)
    for n in shape:
        out *= n
    for pl, n in zip(p, lm.shape):
        if pl.is_shard:
            out /= n
    return out
