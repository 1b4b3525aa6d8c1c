"""What full recomputation changes in a solved stage, per node and per layer
(`planner.inter.stage_table` sums it per layer, where a stage's time and memory are priced).

Two granularities (`planner.vocab.plan_check.RECOMPUTE_MODES`), both run by the runtime
(`runtime.stages.recomputed`):

* "full": every transformer block (a numbered module prefix, `planner.tracing.blocks.block_of`)
  under its own checkpoint, as Megatron-LM checkpoints one layer at a time and torchtitan's full
  activation checkpointing wraps each TransformerBlock. The forward keeps each block's inputs;
  backward re-runs one block's forward at a time. Ops outside the blocks (embedding, final norm,
  head, loss) are not recomputed and keep their saved tensors. A model without numbered blocks
  is checkpointed by layer, as "layer".
* "layer": each of the plan's layers (several blocks, `planner.inter.layers`) under one
  checkpoint: the forward keeps only the layer's input boundary; backward re-runs the whole layer.

Per layer l of a clustering and per micro-batch:

    full:  kept(l)    = sum over blocks b of the bytes of the values from outside b that b's ops
                        in l read (no parameter or buffer) + the saved bytes of l's ops outside
                        every block
           peak(l)    = max over blocks b of the saved bytes of b's ops in l
           seconds(l) = sum over l's ops inside a block of redo(n)
    layer: kept(l)    = the bytes of l's input boundary (`LayerProfile.inputs`)
           peak(l)    = the saved bytes of l's ops (`LayerProfile.acts`)
           seconds(l) = sum over l's ops of redo(n)

with redo(n) = forward(n) + 1/2 * the resharding on the edges into n: the recomputed forward
re-runs its redistributions (a tensor-parallel all-reduce, say), and an edge's price covers that
collective and its gradient's, of equal size (`planner.inter.selective`'s convention). The saved
bytes of a node include the redistributed inputs it saves (`planner.inter.held_memory.
resharded_saves`), as `LayerProfile.acts` does.

Which granularity needs less memory depends on the micro-batches in flight: "full" keeps every
block's inputs (about 1/20 of a transformer block's saved bytes) for each of them, "layer" keeps
one boundary per layer but holds a whole layer's saved bytes while it is recomputed; the stage DP
tries both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.intra.solve import StageSolution
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards


@dataclass(frozen=True)
class NodeTerms:
    """Per node of ``sol.node_cost_table()``'s order: its block's index (-1 outside every block)
    and redo(n) (module docstring); and every block input, as parallel arrays: the block, the
    value read (a node position), its bytes, and the position of the op reading it."""

    block: np.ndarray
    redo: np.ndarray
    input_block: np.ndarray
    input_value: np.ndarray
    input_bytes: np.ndarray
    input_reader: np.ndarray


def node_terms(sol: StageSolution, graph: OpGraph) -> NodeTerms:
    """`NodeTerms` of a solution; computed once per solution (kept in ``sol._derived`` when
    `graph` is the solution's own)."""
    own = sol._ctx.graph is graph
    if own and "full_recompute" in sol._derived:
        return sol._derived["full_recompute"]
    ctx = sol._ctx
    names, table = sol.node_cost_table()
    index = {n: i for i, n in enumerate(names)}
    keys: dict[str, int] = {}
    block = np.full(len(names), -1)
    for n, i in index.items():
        node = graph.node(n)
        if node.op == "call" and (key := block_of(node.module_path)) is not None:
            block[i] = keys.setdefault(key, len(keys))
    redo = table[:, 1].copy()
    chosen = sol._chosen()
    for u, v in ctx.edges:
        if u not in ctx.param_derived:
            act, _ = ctx.edge(u, v)
            redo[index[v]] += 0.5 * float(act[chosen[u], chosen[v]])
    reads: dict[tuple[int, int], int] = {}  # (block, value) -> the first op reading it
    for n, i in index.items():
        b = block[i]
        if b < 0:
            continue
        for u in graph.node(n).inputs:
            j = index.get(u)
            if j is None or block[j] == b or graph.node(u).op in ("param", "buffer"):
                continue
            reads.setdefault((int(b), j), i)
    pairs = np.array([(b, j, i) for (b, j), i in reads.items()], dtype=int)
    pairs = pairs.reshape(-1, 3)
    value_bytes = np.array(
        [_local_bytes(sol, graph, names[j]) for j in pairs[:, 1]], dtype=float
    )
    terms = NodeTerms(block, redo, pairs[:, 0], pairs[:, 1], value_bytes, pairs[:, 2])
    if own:
        sol._derived["full_recompute"] = terms
    return terms


def _local_bytes(sol: StageSolution, graph: OpGraph, name: str) -> float:
    node, opt = graph.node(name), sol.choice.get(name)
    if opt is None:
        return node.output_bytes
    return node.output_bytes / shards(opt.strategy.output[0], sol.mesh_shape)


def layer_terms(
    terms: NodeTerms,
    index: np.ndarray,
    saved: np.ndarray,
    L: int,
) -> tuple[np.ndarray, ...]:
    """Per layer (module docstring): the seconds of "layer", and the seconds, kept bytes and peak
    bytes of "full" (None for a model without blocks). `index` is each node's layer, `saved`
    each node's saved bytes per micro-batch."""
    redo_layer = np.zeros(L)
    np.add.at(redo_layer, index, terms.redo)
    inside = terms.block >= 0
    if not inside.any():
        return redo_layer, None, None, None
    seconds = np.zeros(L)
    np.add.at(seconds, index[inside], terms.redo[inside])
    kept = np.zeros(L)
    np.add.at(kept, index[~inside], saved[~inside])
    if len(terms.input_reader):
        # a value one block reads in two layers is kept in each
        layer = index[terms.input_reader]
        _, first = np.unique(
            np.stack([terms.input_block, terms.input_value, layer]),
            axis=1,
            return_index=True,
        )
        np.add.at(kept, layer[first], terms.input_bytes[first])
    peak = _largest_block(terms.block, index, saved, L)
    return redo_layer, seconds, kept, peak


def _largest_block(
    block: np.ndarray, index: np.ndarray, values: np.ndarray, L: int
) -> np.ndarray:
    """Per layer: the largest sum of `values` over the nodes of one block in that layer."""
    inside = block >= 0
    blocks = int(block.max()) + 1
    if blocks == 0:
        return np.zeros(L)
    per_block = np.zeros(L * blocks)
    np.add.at(per_block, index[inside] * blocks + block[inside], values[inside])
    return per_block.reshape(L, blocks).max(axis=1)
