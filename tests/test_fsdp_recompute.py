"""FSDP with activation recomputation (torchtitan's default for Llama 3: FSDP2 + activation
checkpointing): priced (`planner.inter.stage_table.LayerProfile.fsdp_recompute`), searched, and
executed as priced (`runtime.fsdp`: the recomputed forward reads the backward's gathered copies).

One gloo launch of 2 ranks trains a small Llama (hidden 64, 4 layers) data-parallel over both
with every parameter FSDP-sharded (`manual_plan(fsdp="full")`), 2 micro-batches, Adam
(lr 1e-3), 3 steps, once with full recomputation (each transformer block checkpointed), once
with layer (each of the plan's layers, the embedding and head with the first and last block)
and once with selective (the attention cores), and checks against one device (losses and parameters
within 1e-5), the collectives of one step against the priced ones site by site (two all-gathers
and one reduce-scatter per parameter and micro-batch: no more with recomputation), the blocks'
ops run twice per micro-batch (recomputed) with their parameters gathered once in backward, in
the recomputed forward, and the bytes each rank holds (parameter, gradient and Adam state
shards) against the price.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import single_device
import torch
from profiles import cpu_cluster

from cost_models.communication import LogicalMesh
from planner.intra import fsdp_prices as fp
from planner.intra.prices import Option, StageSettings
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.blocks import block_of
from planner.vocab.plan_file import ParallelPlan
from planner.vocab.strategy import Strategy
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
CLUSTER = "1x2xA100-80GB"
STEPS, LR, BATCH, B = 3, 1e-3, 8, 2
UNPRICED_SITES = ("bwd:nll_loss_forward", "bwd:embedding")  # test_fsdp's
MODES = ("full", "layer", "selective")
_KW = {
    "dp": 2,
    "tp": 1,
    "pp": 1,
    "num_microbatches": B,
    "global_batch": BATCH,
    "dtype": "float32",
    "optimizer": "adam_fp32",
    "allow_oom": True,
    "fsdp": "full",
}


# ------------------------------------------------------------------ prices


@functools.cache
def _fsdp_profile() -> Any:
    """3 layers of a data-parallel solution over 2 devices with every weight FSDP-sharded."""
    from cost_models.cluster import Cluster
    from planner.inter import boundaries as bd
    from planner.inter import stage_table as stt
    from planner.inter.layers import layers_in
    from planner.intra.solve import solve_stage
    from planner.tracing.tracer import trace

    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH, device="meta", dtype=torch.float32)
    g = trace(model, b)
    mesh = LogicalMesh(Cluster.from_spec(CLUSTER), (1, 2), (1, 2))

    def fsdp(path: str, option: Option) -> bool:
        return option.zero == 3 and all(p == "R" for p in option.strategy.output[0])

    sol = solve_stage(g, mesh, batch_axes=(1,), param_filter=fsdp)
    L = 3  # of 4 blocks: a layer of one block and one of two
    layer_of = bd.layer_of_nodes(g, layers_in(g, L))
    return stt.profile(sol, g, layer_of, bd.boundary_values(g, layer_of, L), L)


def _closed_form(F: Any, K: Any, G: Any, R: Any, k: int, j: int) -> float:
    """`tests/test_fsdp.py`'s: FSDP's exposed collectives of layers k..j."""
    nxt = [R[l + 1] if l < j else 0.0 for l in range(k, j + 1)]
    return (
        R[k]
        + min(G[k], F[k])
        + min(G[j], K[j])
        + sum(
            max(0.0, G[l] - F[l]) + max(0.0, G[l] + r - K[l])
            for l, r in zip(range(k, j + 1), nxt)
        )
    )


def test_recomputed_fsdp_stage_follows_its_derivation() -> None:
    """A stage of layers k..j with FSDP parameters and recomputation: its ops' time (the
    collectives taken out), the recomputed forward X (the blocks' forward for full, the layers'
    for layer, the attention cores' for selective), and the FSDP collectives exposed as without
    recomputation but with the backward compute K + X hiding them, unit by unit (a layer cut
    where each transformer block begins, `planner.tracing.blocks.block_units`): the closed
    form over the units from layer k's first to layer j's last. A layer of one unit alone
    exposes every collective whatever the compute; ranges of several may hide more than
    without recomputation."""
    from planner.inter import range_costs as rc

    prof = _fsdp_profile()
    F, K, G, R = prof.fsdp_terms
    assert (G > 0).all() and (R > 0).all()
    L, units = len(prof.time), prof.unit_layer
    assert len(units) > L  # the embedding's layer holds a block too
    start = [int(np.searchsorted(units, k)) for k in range(L)]
    end = [int(np.searchsorted(units, k, side="right")) - 1 for k in range(L)]
    e_u, first_u, last_u = fp.fsdp_exposed(F, K, G, R)
    e = np.array([e_u[start[k] : end[k] + 1].sum() for k in range(L)])
    # what `time` and `fixed` hold without the exposed collectives
    ops = prof.time - e
    base = prof.fixed - first_u[start][:, None] - last_u[end][None, :]
    assert prof.block_redo is not None
    for mode, X in (
        ("full", prof.block_redo),
        ("layer", prof.redo),
        ("selective", prof.core_time),
    ):
        assert (X > 0).all()
        Xu = prof.unit_extra[mode]
        per_layer = [Xu[start[k] : end[k] + 1].sum() for k in range(L)]
        assert per_layer == pytest.approx(X)
        table = prof.range_times(mode)
        for k in range(L):
            for j in range(k, L):
                want = (
                    ops[k : j + 1].sum()
                    + X[k : j + 1].sum()
                    + base[k, j]
                    + _closed_form(F, K + Xu, G, R, start[k], end[j])
                )
                assert table[k, j] == pytest.approx(want), (mode, k, j)
                assert prof.range_time(k, j, mode) == pytest.approx(want)
        none = prof.range_times("none")
        single = np.diag(table) - np.diag(none)
        # a layer of one unit: all its collectives exposed either way
        alone = [k for k in range(L) if start[k] == end[k]]
        assert alone and single[alone] == pytest.approx(X[alone])
        # several layers: recomputation's compute may hide more of them (here compute already
        # hides the backward's; with gathers 1000 times slower it hides some)
        assert table[0, L - 1] - none[0, L - 1] <= X.sum() * (1 + 1e-12)
        slow = dataclasses.replace(prof, fsdp_terms=np.stack([F, K, G * 1e3, R]))
        per_layer, fixed = slow.fsdp_recompute(mode)
        assert per_layer.sum() + fixed[0, L - 1] < 0
        k = alone[0]
        assert per_layer[k] + fixed[k, k] == pytest.approx(0.0, abs=1e-12)
    # the search's table takes such stages (memory permitting)
    inflight, send = np.array([0.0, 1.0]), np.zeros(L)
    for mode in MODES:
        cost, _ = rc.range_costs(prof, inflight, np.inf, send, mode)
        assert np.isfinite(cost[0, L - 1, 1])
    # memory of layers 0..L-1: layer keeps the layers' inputs, full the blocks' inputs and what
    # runs outside the blocks, selective all but the cores' bytes; live while one layer (one
    # block, one core) is recomputed: its saved bytes, and in every mode what the backward holds
    # and two units' gathered copies (the one running, the next; layer: two layers')
    held = prof.backward_bytes()[0, L - 1]
    assert (prof.unit_gathered <= prof.gathered).all()
    assert (prof.unit_gathered < prof.gathered).any()  # a layer of two blocks
    layers, blocks = 2 * prof.gathered.max(), 2 * prof.unit_gathered.max()

    def recomputed(kept: np.ndarray, live: np.ndarray) -> float:
        """Layer l recomputed: the layers before it keep theirs, l holds `live[l]`."""
        return max(0.0, max(kept[:i].sum() + live[i] for i in range(L)) - kept.sum())

    selective = prof.acts - prof.core_bytes
    for mode, kept, transient in (
        (
            "layer",
            prof.inputs,
            recomputed(prof.inputs, prof.inputs + prof.acts) + layers,
        ),
        (
            "full",
            prof.block_kept,
            recomputed(prof.block_kept, prof.block_held) + blocks,
        ),
        (
            "selective",
            selective,
            recomputed(selective, selective + prof.core_peak) + blocks,
        ),
        ("none", prof.acts, blocks),
    ):
        _, k, t = rc.range_footprint(prof, mode)
        assert (k[0, L - 1], t[0, L - 1]) == pytest.approx(
            (kept.sum(), transient + held)
        )


def test_manual_fsdp_with_recomputation() -> None:
    """`manual_plan` prices FSDP and HSDP with each recomputation (the stage recomputes and
    keeps its FSDP parameters): slower and smaller than FSDP alone."""
    plans = _plans()
    kw = {k: v for k, v in _KW.items() if k != "fsdp"}
    none = manual_plan(SPEC, CLUSTER, fsdp="full", **kw)
    for mode in MODES:
        s = plans[mode].stages[0]
        assert s.recompute == mode and s.fsdp_params == none.stages[0].fsdp_params
        assert s.time_s > none.stages[0].time_s
        assert s.memory_bytes < none.stages[0].memory_bytes
    kw |= {"dp": 4}
    h = manual_plan(SPEC, "2x2xA100-80GB", fsdp="hybrid", recompute="full", **kw)
    assert h.stages[0].fsdp_axes and h.stages[0].recompute == "full"


# ------------------------------------------------------------------ runtime


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    return {mode: manual_plan(SPEC, CLUSTER, recompute=mode, **_KW) for mode in MODES}


@functools.cache
def _graph() -> Any:
    from planner.tracing.tracer import trace

    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH // B, device="cpu")
    return trace(model, b)


def _model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _train(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    """Body of every rank, per plan: 3 Adam steps (the second counted: collectives, op runs,
    and the parameters read by recomputed forwards), then the bytes held before an update."""
    import logging

    from runtime.comm_count import CommCounter
    from runtime.train import Trainer, split_batch

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, plan in plans.items():
        model, batches = _model_and_batches()
        tr = Trainer(plan, model, batches[0], optimizer="adam", lr=LR)
        losses = [tr.step(batches[0])]
        ex = tr.runner.executor
        fs = ex.fsdp
        runs: dict[str, int] = {}
        recomputed: list[str] = []  # parameters read by a recomputed forward

        def counted(n: Any, run_node: Any = ex.run_node, runs: dict = runs) -> Any:
            runs[n.name] = runs.get(n.name, 0) + 1
            return run_node(n)

        def value(
            name: str, fs: Any = fs, value: Any = fs.value, read: list = recomputed
        ) -> Any:
            if fs._recompute_mb is not None:
                read.append(name)
            return value(name)

        ex.run_node, fs.value = counted, value
        with CommCounter() as counter:
            losses.append(tr.step(batches[1]))
        del ex.run_node, fs.value
        losses.append(tr.step(batches[2]))
        tr.runner.step(tr.params, split_batch(batches[0], B), tr.buffers)
        held = single_device.held_state_bytes(tr.params, tr.optimizer.state)
        tr.optimizer.zero_grad(set_to_none=True)
        out[name] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "records": counter.records,
            "held": held,
            "runs": runs,
            "recomputed": recomputed,
            "paths": dict(fs.paths),
            "compiled": ex.compile,
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train, 2, args=(_plans(),), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_trains_like_one_device(runs: list[dict[str, Any]], mode: str) -> None:
    model, batches = _model_and_batches()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    for r in runs:
        got = r[mode]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
        params = {k: torch.from_numpy(v) for k, v in got["params"].items()}
        single_device.assert_same_parameters(params, ref_params)
        assert got["compiled"] is False


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_communicates_what_was_priced(runs: list[dict[str, Any]], mode: str) -> None:
    """Per site, once per micro-batch: every FSDP parameter's all-gather in forward, its
    all-gather again and its gradient's reduce-scatter in backward (the recomputed forward
    gathers nothing more), and the edges' collectives (none but those under data parallelism)."""
    from comm_check import compare

    from cost_models.cluster import Cluster
    from planner.intra.priced_comm import predicted_collectives
    from runtime.stages import split_stages, stage_program

    plan = _plans()[mode]
    st = split_stages(_graph(), plan)[0]
    sp = plan.stages[0]
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    once = predicted_collectives(
        st.graph, stage_program(st, sp), lmesh, fsdp=sp.fsdp_params
    )
    predicted = {label: colls * B for label, colls in once.items()}
    assert sum(k.startswith("bwd:fsdp:") for k in predicted) == len(sp.fsdp_params)
    for r in runs:
        measured = [x for x in r[mode]["records"] if x.site not in UNPRICED_SITES]
        totals, diffs = compare(predicted, measured)
        assert not diffs, "\n".join(diffs[:10])
        assert totals["reduce_scatter"][0] > 0
        # no gradient all-reduce: the only one is the loss's, a scalar per micro-batch
        assert totals.get("all_reduce", (0.0, 0.0))[1] <= 4 * B


@pytest.mark.slow
def test_recomputed_forward_reads_the_backward_gathers(
    runs: list[dict[str, Any]],
) -> None:
    """Full: every op of a transformer block runs twice per micro-batch (forward, recomputed in
    backward; a block's last ops may be left out, as its residual add: torch's checkpoint
    stops once backward has what it needs), the ops outside the blocks once; every block parameter is read by the
    recomputed forward (gathered there, the gather counted once above), the others never.
    Layer: the ops outside the blocks as well. Selective: only attention cores are recomputed,
    and they read no parameter."""
    g = _graph()
    blocks = {n.name for n in g.ops if block_of(n.module_path) is not None}
    for r in runs:
        full = r["full"]
        twice = {n for n, c in full["runs"].items() if c == 2 * B}
        outside = {n.name for n in g.ops} - blocks
        assert all(full["runs"][n] == B for n in outside if n in full["runs"])
        assert twice <= blocks and len(twice) > 0.9 * len(blocks)
        assert {n for n in blocks if n.startswith("mm")} <= twice  # every matmul
        read = {full["paths"][n] for n in full["recomputed"]}
        in_blocks = {p for p in full["paths"].values() if p.startswith("blocks.")}
        assert read == in_blocks, sorted(read ^ in_blocks)
        assert len(full["recomputed"]) >= B * len(in_blocks)
        # layer: the manual plan's layers (a block each, the embedding in the first, the
        # head and loss in the last) checkpointed whole: ops outside the blocks run twice too,
        # and their parameters are read by the recomputed forward
        layer = r["layer"]
        again = {n for n, c in layer["runs"].items() if c == 2 * B}
        assert twice < again and again - blocks
        assert {layer["paths"][n] for n in layer["recomputed"]} > read
        assert r["selective"]["recomputed"] == []
        assert max(r["selective"]["runs"].values()) == 2 * B


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_holds_the_priced_bytes(runs: list[dict[str, Any]], mode: str) -> None:
    """Per parameter: the planner's weights + gradients + Adam state (fp32: 4 + 4 + 8 bytes per
    element) on one device, against the local shards each rank holds."""
    plan, graph = _plans()[mode], _graph()
    s = StageSettings(
        LogicalMesh(cpu_cluster(2), (1, 2), (1, 2)), B, optimizer="adam_fp32"
    )
    names = {p: n for n, p in graph.placeholder_paths.items()}
    sp = plan.stages[0]
    assert sorted(sp.fsdp_params) == sorted(sp.param_placements)
    for r in runs:
        for path, (param, grad, adam) in r[mode]["held"].items():
            meta = graph.node(names[path]).outputs[0]
            strategy = Strategy((tuple(sp.param_placements[path]),), (), "param")
            priced = fp.param_state_bytes(meta, Option(strategy, zero=3), s)
            assert param + grad + adam == priced, path
            assert param < meta.nbytes, path  # sharded
