"""Repeated blocks of a traced model (``blocks.0``, ``blocks.1``, ...): which block a node belongs
to, and which nodes of identical blocks stand for each other, so the intra-op program solves a
repeated transformer block once (`planner.intra.solve`) and manual plans split and checkpoint by
block (`planner.plans.recompute`).
"""

from __future__ import annotations

from collections import defaultdict

from planner.tracing.opgraph import OpGraph


def block_of(path: str) -> str | None:
    """``blocks.7.attn.qkv`` -> ``blocks.7``; None for a path without an index."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def representatives(graph: OpGraph, names: list[str]) -> dict[str, str]:
    """Map each node of a repeated block to the same position in the first identical block."""
    blocks: dict[str, list[str]] = defaultdict(list)
    for n in names:
        key = block_of(graph.node(n).module_path)
        if key is not None:
            blocks[key].append(n)
    first: dict[tuple, list[str]] = {}
    rep: dict[str, str] = {}
    for key, members in blocks.items():
        local = {n: i for i, n in enumerate(members)}
        sig = tuple(
            (
                graph.node(n).op,
                graph.node(n).target,
                graph.node(n).module_path.removeprefix(key),
                tuple(graph.node(n).outputs),
                tuple(local.get(i, -1) for i in graph.node(n).inputs),
            )
            for n in members
        )
        base = first.setdefault(sig, members)
        rep.update(zip(members, base))
    return rep
