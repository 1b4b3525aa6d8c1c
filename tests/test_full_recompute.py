"""Full recomputation's two granularities in the automatic plan's prices
(`planner.inter.full_recompute`): "full" checkpoints each transformer block on its own, "layer"
each of the plan's layers whole. On one device, a 4-block GPT clustered into one layer: the
closed forms of `test_megatron_gpt`'s per-block derivation hold for "full" in the search's own
table, and "layer" holds the whole layer's saved set while it is recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from closed_forms import gpt_layer_activation_bytes

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.inter import boundaries as bd
from planner.inter import range_costs as rc
from planner.inter import stage_table as st
from planner.intra.solve import solve_stage
from planner.models.gpt import GPTConfig
from planner.tracing.blocks import block_units
from planner.tracing.inputs import resolve_model
from planner.tracing.tracer import trace

SPEC = "gpt:hidden=256,layers=4,heads=4,seq=128,vocab=1024"
CFG = GPTConfig(hidden=256, layers=4, heads=4, seq=128, vocab=1024)
BATCH, P = 8, 2  # rows, fp16 bytes


def _profile(per_block: bool) -> st.LayerProfile:
    module, example = resolve_model(SPEC, None, torch.float16, None)[1](BATCH)
    graph = trace(module, example, model_name=SPEC)
    whole = [(0, len(graph.ops) - 1)]
    layers = block_units(graph, whole)[0] if per_block else whole
    num_layers = len(layers)
    layer_of = bd.layer_of_nodes(graph, layers)
    bounds = bd.boundary_values(graph, layer_of, num_layers)
    mesh = LogicalMesh(Cluster.from_spec("1x1xV100-16GB"), (1, 1), (1, 1))
    sol = solve_stage(graph, mesh)
    return st.profile(sol, graph, layer_of, bounds, num_layers)


def test_full_keeps_block_inputs_and_recomputes_one_block_at_a_time() -> None:
    """One layer of 4 blocks. full: kept = every block's input (2 s b h each) + the head's saved
    tensors (not checkpointed); live while recomputing: ONE block's saved set, less what the
    head keeps after the last block (back-propagated, so freed, before it is recomputed).
    layer: kept = the layer's input (the token ids); live: all 4 blocks' saved sets and the
    head's. Both add the backward's bytes (`LayerProfile.backward_bytes`) alike; full re-runs
    the blocks' forward, layer the head's too."""
    prof = _profile(per_block=False)
    s, b, h, v = CFG.seq, BATCH, CFG.hidden, CFG.vocab
    one_block = gpt_layer_activation_bytes(s, b, h, CFG.heads, P, recompute=False)
    head = P * s * b * h + 8 * s * b + P * s * b * h + P * s * b * v
    held = prof.backward_bytes()[0, 0]
    _, kept, transient = rc.range_footprint(prof, "full")
    assert kept[0, 0] == pytest.approx(CFG.layers * P * s * b * h + head, rel=0.02)
    # the head's saved tensors are freed before the last block is recomputed; the loss's int64
    # labels (a batch input, 8 s b) stay
    assert transient[0, 0] - held == pytest.approx(
        one_block + 8 * s * b - head, rel=0.02
    )
    _, kept, transient = rc.range_footprint(prof, "layer")
    assert kept[0, 0] == prof.inputs[0] <= 2 * 8 * s * b  # int64 token ids and labels
    assert transient[0, 0] - held == prof.acts[0]
    assert prof.acts[0] > CFG.layers * one_block + head * 0.98
    full, layer = prof.extra_time("full")[0], prof.extra_time("layer")[0]
    assert 0 < full < layer <= prof.fwd[0] * (1 + 1e-9)
    assert prof.recompute_modes() == ("none", "selective", "full", "layer")


def test_layers_of_one_block_each_price_both_alike_inside() -> None:
    """With a layer per block (`planner.tracing.blocks.block_units`: the embedding joins the
    first, the head the last), the inner layers' full and layer prices agree: the same ops
    recomputed, the same saved set live, and the same residual stream kept."""
    prof = _profile(per_block=True)
    assert len(prof.time) == CFG.layers
    inner = slice(1, CFG.layers - 1)
    # held while the block is recomputed: its saved set and its input
    assert np.allclose(prof.block_held[inner], prof.acts[inner] + prof.inputs[inner])
    assert np.allclose(prof.block_redo[inner], prof.redo[inner])
    assert np.allclose(prof.block_kept[inner], prof.inputs[inner])
    # the outer layers: layer recomputes the embedding and the head as well, full keeps them
    for end in (0, -1):
        assert prof.block_redo[end] < prof.redo[end]
    # the first layer keeps the embedding's saved tensors and the block's input, all live
    # while the block is recomputed; the last layer's head (kept after its block) is not
    one = prof.acts[1]
    assert prof.block_held[0] == pytest.approx(one + prof.block_kept[0])
    # the head's saved tensors: the final norm's input, fp32 statistics and output, the
    # log-softmax's output; the loss's labels, a batch input, stay
    s, b, h, v = CFG.seq, BATCH, CFG.hidden, CFG.vocab
    head = P * s * b * h + 8 * s * b + P * s * b * h + P * s * b * v
    assert prof.block_held[-1] == pytest.approx(
        one + prof.block_kept[-1] - head, rel=1e-3
    )


def test_recomputed_bytes_match_brute_force() -> None:
    """`range_costs.recomputed` for every range k..j of random layers: the most, over the layer
    l being recomputed, of the kept bytes of layers k..l-1 plus what l holds, beyond the range's
    kept bytes (0 when the start of backward, everything kept, is the larger)."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        L = int(rng.integers(1, 7))
        kept, held = rng.uniform(0, 10, L), rng.uniform(0, 30, L)
        got = rc.recomputed(kept, held)
        for k in range(L):
            for j in range(k, L):
                most = max(kept[k:i].sum() + held[i] for i in range(k, j + 1))
                want = max(0.0, most - kept[k : j + 1].sum())
                assert got[k, j] == pytest.approx(want, abs=1e-9)
