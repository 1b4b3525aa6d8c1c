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

    full:  kept(l)    = the bytes of the values from outside a block that the block's ops in l
                        read (no parameter or buffer; each value once) + the saved bytes of l's
                        ops outside every block
           held(l)    = max over blocks b of (the saved bytes of b's ops in l + the part of
                        kept(l) kept at or before b's last op)
           seconds(l) = sum over l's ops inside a block of redo(n)
    layer: kept(l)    = the bytes of l's input boundary (`LayerProfile.inputs`)
           held(l)    = kept(l) + the saved bytes of l's ops (`LayerProfile.acts`)
           seconds(l) = sum over l's ops of redo(n)

held(l) is what layer l holds of one micro-batch while one of its blocks is recomputed: backward
runs in reverse, so what l keeps after that block (the final norm and loss's saved tensors, in
the last layer) is freed by then, and of the layers after l nothing is left
(`planner.inter.range_costs.range_footprint`).

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

from planner.intra.solution import StageSolution
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards


@dataclass(frozen=True)
class NodeTerms:
    """Per node of ``sol.node_cost_table()``'s order: its block's index (-1 outside every block)
    and redo(n) (module docstring); and every block input, as parallel arrays: the block, the
    value read (a node position), its bytes, and the position of the op reading it. And where
    the ops outside every block keep other bytes than their saved bytes (priced at each value's
    producer): at which position, how many more (or fewer)."""

    block: np.ndarray
    redo: np.ndarray
    input_block: np.ndarray
    input_value: np.ndarray
    input_bytes: np.ndarray
    input_reader: np.ndarray
    outside_at: np.ndarray
    outside_bytes: np.ndarray


def node_terms(sol: StageSolution, graph: OpGraph) -> NodeTerms:
    """`NodeTerms` of a solution; computed once per solution (kept in ``sol._derived`` when
    `graph` is the solution's own)."""
    own = sol._ctx.graph is graph
    if own and "full_recompute" in sol._derived:
        return sol._derived["full_recompute"]
    names, table = sol.node_cost_table()
    shape = _structure(sol, graph, names)
    redo = table[:, 1].copy()
    if len(shape.edge_at):
        # the solution's edge prices in edge order (`node_cost_table` made them): an edge
        # leaving no parameter or view of one has its `ctx.edge` price there as it is
        acts = np.asarray(sol._edge_terms[0])[shape.edge_at]
        # in edge order, one addition at a time: the same sums as adding edge by edge
        np.add.at(redo, shape.edge_reader, 0.5 * acts)
    pairs = shape.pairs
    value_bytes = np.array(
        [_local_bytes(sol, graph, names[j]) for j in pairs[:, 1]], dtype=float
    )
    fix = np.array(
        [
            _local_bytes(sol, graph, u) * sign
            for u, sign in zip(shape.outside_values, shape.outside_sign)
        ],
        dtype=float,
    )
    terms = NodeTerms(
        shape.block,
        redo,
        pairs[:, 0],
        pairs[:, 1],
        value_bytes,
        pairs[:, 2],
        shape.outside_at,
        fix,
    )
    if own:
        sol._derived["full_recompute"] = terms
    return terms


@dataclass(frozen=True)
class _Structure:
    """What `node_terms` reads of the graph alone, alike for every solution of one pricing: each
    node's block, the edges whose resharding recomputation re-runs (positions in ``ctx.edges``
    and their readers' positions), the (block, value, reader) block inputs, and the values
    outside the blocks whose kept bytes differ from their saved bytes (their positions and
    signs, `_outside_fixes`)."""

    block: np.ndarray
    edge_at: np.ndarray
    edge_reader: np.ndarray
    pairs: np.ndarray
    outside_at: np.ndarray
    outside_values: list[str]
    outside_sign: list[int]


def _structure(sol: StageSolution, graph: OpGraph, names: list[str]) -> _Structure:
    """`_Structure` of the solution's pricing, made once per pricing when `graph` is its own
    (every solution of a pricing has the same nodes in the same order and the same edges)."""
    ctx = sol._ctx
    return ctx.per_pricing(
        graph,
        ("full_recompute_structure", len(names)),
        lambda: _make_structure(ctx, graph, names),
    )


def _make_structure(ctx, graph: OpGraph, names: list[str]) -> _Structure:
    index = {n: i for i, n in enumerate(names)}
    keys: dict[str, int] = {}
    block = np.full(len(names), -1)
    for n, i in index.items():
        node = graph.node(n)
        if node.op == "call" and (key := block_of(node.module_path)) is not None:
            block[i] = keys.setdefault(key, len(keys))
    edge_at = [e for e, (u, _) in enumerate(ctx.edges) if u not in ctx.param_derived]
    edge_reader = [index[ctx.edges[e][1]] for e in edge_at]
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
    at, values, signs = _outside_fixes(graph, index, block)
    return _Structure(
        block,
        np.array(edge_at, dtype=int),
        np.array(edge_reader, dtype=int),
        pairs.reshape(-1, 3),
        np.array(at, dtype=int),
        values,
        signs,
    )


def _outside_fixes(
    graph: OpGraph, index: dict[str, int], block: np.ndarray
) -> tuple[list[int], list[str], list[int]]:
    """What ops outside every block keep, against their values' saved bytes (priced at the
    producer): a value produced outside the blocks that only blocks' ops save is not kept
    (checkpointed; a block input at most, counted as one), a value produced in a block that an
    op outside saves is (the final norm's input), from the first such op on. (positions, the
    values, +1 for bytes kept, -1 for bytes not kept.)"""
    saved_outside: dict[str, int] = {}
    saved_any: set[str] = set()
    for n, i in index.items():
        for u in graph.node(n).saved:
            saved_any.add(u)
            if block[i] < 0:
                saved_outside.setdefault(u, i)
    at, values, signs = [], [], []
    for u in saved_any:
        j = index.get(u)
        if j is None or (block[j] < 0) == (u in saved_outside):
            continue
        at.append(j if block[j] < 0 else saved_outside[u])
        values.append(u)
        signs.append(-1 if block[j] < 0 else 1)
    return at, values, signs


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
    """Per layer (module docstring): the seconds of "layer", and the seconds, kept bytes and held
    bytes of "full" (None for a model without blocks). `index` is each node's layer (nodes in
    graph order), `saved` each node's saved bytes per micro-batch."""
    redo_layer = np.zeros(L)
    np.add.at(redo_layer, index, terms.redo)
    inside = terms.block >= 0
    if not inside.any():
        return redo_layer, None, None, None
    seconds = np.zeros(L)
    np.add.at(seconds, index[inside], terms.redo[inside])
    # what each layer keeps, at the position of the op keeping it: what ops outside every
    # block save (`_outside_fixes`), and the block inputs, once per layer (blocks reading one value, the
    # rotary tables, say, keep the same tensor; a value read in two layers is kept in each)
    outside = np.flatnonzero(~inside)
    at = np.concatenate([outside, terms.outside_at])
    nbytes = np.concatenate([saved[outside], terms.outside_bytes])
    if len(terms.input_reader):
        layer = index[terms.input_reader]
        _, first = np.unique(
            np.stack([terms.input_value, layer]),
            axis=1,
            return_index=True,
        )
        at = np.concatenate([at, terms.input_reader[first]])
        nbytes = np.concatenate([nbytes, terms.input_bytes[first]])
    kept = np.zeros(L)
    np.add.at(kept, index[at], nbytes)
    held = _held(terms.block, index, saved, at, nbytes, L)
    return redo_layer, seconds, kept, held


def _held(
    block: np.ndarray,
    index: np.ndarray,
    saved: np.ndarray,
    at: np.ndarray,
    nbytes: np.ndarray,
    L: int,
) -> np.ndarray:
    """Per layer, held(l) (module docstring): the most, over its blocks b, of b's saved bytes
    plus the kept bytes `nbytes` the layer keeps at positions `at` up to b's last op."""
    inside = np.flatnonzero(block >= 0)
    blocks = int(block.max()) + 1
    keys, which = np.unique(index[inside] * blocks + block[inside], return_inverse=True)
    last = np.full(len(keys), -1)
    np.maximum.at(last, which, inside)
    own = np.zeros(len(keys))
    np.add.at(own, which, saved[inside])
    layer = keys // blocks
    # kept bytes sorted by (layer, position): a block's are a contiguous run of them
    n = len(index) + 1
    order = np.argsort(index[at] * n + at, kind="stable")
    pos = (index[at] * n + at)[order]
    cum = np.concatenate([[0.0], np.cumsum(nbytes[order])])
    live = (
        cum[np.searchsorted(pos, layer * n + last, side="right")]
        - cum[np.searchsorted(pos, layer * n, side="left")]
    )
    out = np.zeros(L)
    np.maximum.at(out, layer, own + live)
    return out
