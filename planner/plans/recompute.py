"""Megatron-LM's pipeline split, for manual plans (``block_chunks``).

Megatron-LM (``--pipeline-model-parallel-size p``) differs from the balanced chunks of the
automatic planner: every chunk holds ``num_blocks / chunks`` consecutive transformer blocks; the
embedding joins the first chunk and the final norm, LM head and loss the last. So the last stage
does more work than the others (the head of a 51200-word vocabulary costs about one block of a
350M-2.6B GPT), and the pipeline runs at the pace of that stage. Its per-block activation
checkpointing is the "full" recomputation of every plan (`planner.inter.full_recompute`).
"""

from __future__ import annotations

from cost_models.errors import MeshplanError
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph


def block_chunks(graph: OpGraph, chunks: int) -> list[tuple[int, int]]:
    """Op index ranges of ``chunks`` pipeline chunks of equally many transformer blocks.

    Blocks are the distinct numbered module prefixes (``blocks.7``) in op order. Raises
    ``MeshplanError`` when the model has no numbered blocks or their number is not a multiple of
    ``chunks`` (Megatron requires layers divisible by the pipeline size)."""
    ops = graph.ops
    keys = list(dict.fromkeys(k for n in ops if (k := block_of(n.module_path))))
    if not keys or len(keys) % chunks:
        raise MeshplanError(
            f"split='blocks' needs a number of transformer blocks divisible by {chunks} "
            f"pipeline chunks; {graph.model_name or 'the model'} "
            f"has {len(keys)}"
        )
    per = len(keys) // chunks
    first = {}
    for i, n in enumerate(ops):
        k = block_of(n.module_path)
        if k is not None:
            first.setdefault(k, i)
    starts = [0] + [first[keys[c * per]] for c in range(1, chunks)]
    ends = [s - 1 for s in starts[1:]] + [len(ops) - 1]
    return list(zip(starts, ends))


def block_layers(
    graph: OpGraph, chunks: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Each chunk's op range cut where a transformer block begins: (the layers, and each chunk's
    first and last layer). A manual stage's FSDP parameters are gathered one layer at a time
    and its collectives overlap the neighbouring layers' compute (`runtime.fsdp`,
    `planner.intra.fsdp_prices.fsdp_exposed`), as FSDP2 wraps every transformer block in
    torchtitan; ops before a chunk's first block join its first layer. A chunk without a block
    start stays one layer."""
    ops = graph.ops
    starts: set[int] = set()
    seen: set[str] = set()
    for i, n in enumerate(ops):
        key = block_of(n.module_path)
        if key is not None and key not in seen:
            seen.add(key)
            starts.add(i)
    layers: list[tuple[int, int]] = []
    ranges = []
    for a, b in chunks:
        inside = sorted(i for i in starts if a < i <= b)
        cuts = [a] + inside[a not in starts :]  # ops before the first block join it
        first = len(layers)
        layers += list(zip(cuts, [c - 1 for c in cuts[1:]] + [b]))
        ranges.append((first, len(layers) - 1))
    return layers, ranges
