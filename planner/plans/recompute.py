"""Megatron-LM's pipeline split and per-block activation checkpointing, for manual plans.

Megatron-LM (``--pipeline-model-parallel-size p``, ``--checkpoint-activations``) differs from the
balanced chunks of the automatic planner in two ways that matter for its cost:

* Pipeline split (``block_chunks``): every chunk holds ``num_blocks / chunks`` consecutive
  transformer blocks; the embedding joins the first chunk and the final norm, LM head and loss the
  last. So the last stage does more work than the others (the head of a 51200-word vocabulary costs
  about one block of a 350M-2.6B GPT), and the pipeline runs at the pace of that stage.
* Recomputation granularity (``recompute_costs``): each transformer block is checkpointed on its
  own. The forward keeps each block's input; the backward of block k first re-runs block k's
  forward, so only ONE block's saved activations exist at a time. Ops outside the blocks (embedding,
  final norm, head, loss) are not checkpointed and keep their saved tensors. Per chunk and
  micro-batch::

      kept      = sum over blocks of (block input bytes) + saved bytes of the non-block ops
      transient = max over blocks of (saved bytes of the block)
      recompute = sum over block ops of their forward time
                  + half of the activation resharding on edges into block ops

  The last term is the forward's communication re-run (Megatron's tensor-parallel all-reduce ``g``
  after each row-parallel matmul); the edge price covers that collective and its gradient's, of
  the same size, so the forward's share is half.
"""

from __future__ import annotations

from collections import defaultdict

from cost_models.errors import MeshplanError
from planner.intra import prices as sc
from planner.intra.solve import StageSolution
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards


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


def recompute_costs(
    sol: StageSolution,
    graph: OpGraph,
    layer_of: dict[str, int],
    chunks: int,
) -> list[tuple[float, float, float] | None]:
    """Per chunk: (recompute seconds, kept bytes, transient bytes) per micro-batch with per-block
    checkpointing (module docstring), for the solved intra-op program ``sol``; None for a chunk
    without numbered blocks (the caller checkpoints it whole)."""
    ctx = sol._ctx
    if ctx is None:
        raise MeshplanError("recompute_costs needs a solved stage with its context")
    costs = sol.node_costs()
    block_acts: list[dict[str, float]] = [defaultdict(float) for _ in range(chunks)]
    other_acts = [0.0] * chunks
    inputs = [0.0] * chunks
    recompute = [0.0] * chunks
    block_inputs: list[dict[str, set[str]]] = [defaultdict(set) for _ in range(chunks)]
    for n, opt in sol.choice.items():
        node = graph.node(n)
        c = layer_of.get(n, 0)
        key = block_of(node.module_path) if node.op == "call" else None
        am = costs[n][3]
        if key is None:
            other_acts[c] += am
            continue
        block_acts[c][key] += am
        recompute[c] += sc.forward_time(node, opt, ctx.settings)
        for u in node.inputs:
            src = graph.node(u)
            if src.op in ("param", "buffer"):
                continue
            if src.op == "call" and block_of(src.module_path) == key:
                continue
            block_inputs[c][key].add(u)
    for u, v in ctx.edges:
        node = graph.node(v)
        if node.op != "call" or block_of(node.module_path) is None:
            continue
        if u in ctx.param_derived:
            continue
        act, _ = ctx.edge(u, v)
        i = ctx.options[u].index(sol.choice[u])
        j = ctx.options[v].index(sol.choice[v])
        recompute[layer_of.get(v, 0)] += 0.5 * float(act[i, j])
    for c in range(chunks):
        for values in block_inputs[c].values():
            for u in values:
                opt = sol.choice.get(u)
                src = graph.node(u)
                inputs[c] += (
                    src.output_bytes
                    if opt is None
                    else src.output_bytes
                    / shards(opt.strategy.output[0], sol.mesh_shape)
                )
    return [
        (
            recompute[c],
            inputs[c] + other_acts[c],
            max(block_acts[c].values()),
        )
        if block_acts[c]
        else None  # no transformer block in the chunk: it is checkpointed as a whole
        for c in range(chunks)
    ]
