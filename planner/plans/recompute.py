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
