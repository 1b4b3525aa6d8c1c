"""Context parallelism (`planner.vocab.context`): priced, chosen, executed.

Planner: the attention kernel gets context-parallel strategies (q split along the sequence, k and
v gathered); the price of the K/V exchange of one attention equals the ring formulas by hand;
`manual_plan(context_parallel=N)` (``meshplan manual --cp N``) makes every attention
context-parallel, with data parallelism too on a (dp, cp) mesh, and refuses what it cannot run;
the intra-op search picks CP for a long sequence that neither the batch nor the heads can split,
and not for a short one with a batch to split; the automatic search picks data x context
parallelism where the batch splits over fewer devices than the stage has.

Runtime: one gloo launch of 4 ranks trains a small Llama (hidden 64, 2 layers, sequence 16),
Adam (lr 1e-3), 3 steps, under three manual plans of 2 micro-batches of one row: ``cp_tp`` (CP 2
x TP 2 on a (2, 2) mesh, compiled), ``cp_fsdp`` (CP 4, every parameter FSDP-sharded over the 4
devices, eager) and ``cp_pp`` (two pipeline stages of CP 2, the attention cores recomputed:
selective recomputation, eager); and three of data x context parallelism, 2 micro-batches of 2
rows (one per data-parallel device): ``cp_dp`` (DP 2 x CP 2, eager: compiling it as well
took 10 s more of a 46 s launch, and ``cp_tp`` compiles the context-parallel attention),
``cp_dp_fsdp`` (the same with every parameter FSDP-sharded over the 4 devices, eager) and
``cp_dp_rc`` (each block recomputed, eager); against one device (losses and parameters within
1e-5). For all but ``cp_pp`` and ``cp_dp_rc`` also the collectives of one counted step against
the priced ones site by site, and for the sharded ones the bytes of parameters, gradients and
Adam state each rank holds against the price.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner.intra import prices as sc
from planner.intra.context import attention_nodes
from planner.intra.prices import Option, StageSettings
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from planner.vocab.context import CP_SOURCE, context_axis
from planner.vocab.plan_file import ParallelPlan
from planner.vocab.strategy import Strategy
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
CLUSTER = "1x4xA100-80GB"
STEPS, LR, BATCH, B = 3, 1e-3, 2, 2
DP_BATCH = 4  # the plans with data parallelism: 2 rows per micro-batch
# nll_loss's total_weight and the embedding's scalar (tests/test_fsdp.py)
UNPRICED_SITES = ("bwd:nll_loss_forward", "bwd:embedding")


@functools.cache
def _graph(spec: str = SPEC, rows: int = BATCH // B) -> Any:
    torch.manual_seed(0)
    model, b = build_model(spec, batch=rows, device="cpu")
    return trace(model, b)


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    kw = {
        "dp": 1,
        "pp": 1,
        "num_microbatches": B,
        "global_batch": BATCH,
        "dtype": "float32",
        "optimizer": "adam_fp32",
        "allow_oom": True,
    }
    # data x context parallelism: a micro-batch of one row per data-parallel device
    dp_kw = kw | {"dp": 2, "global_batch": DP_BATCH}
    return {
        "cp_tp": manual_plan(SPEC, CLUSTER, tp=2, context_parallel=2, **kw),
        "cp_dp": manual_plan(SPEC, CLUSTER, tp=1, context_parallel=2, **dp_kw),
        "cp_dp_fsdp": manual_plan(
            SPEC, CLUSTER, tp=1, context_parallel=2, fsdp="full", **dp_kw
        ),
        "cp_dp_rc": manual_plan(
            SPEC, CLUSTER, tp=1, context_parallel=2, recompute="full", **dp_kw
        ),
        "cp_fsdp": manual_plan(
            SPEC, CLUSTER, tp=1, context_parallel=4, fsdp="full", **kw
        ),
        "cp_pp": manual_plan(
            SPEC,
            CLUSTER,
            tp=1,
            context_parallel=2,
            recompute="selective",
            **kw | {"pp": 2},
        ),
    }


# ------------------------------------------------------------------ planner


def test_manual_plan_makes_every_attention_context_parallel() -> None:
    g = _graph()
    nodes = attention_nodes(g)
    assert len(nodes) == 2
    for name, axis_size in (("cp_tp", (2, 2)), ("cp_fsdp", (4, 1))):
        p = _plans()[name]
        s = p.stages[0]
        assert tuple(s.logical_mesh) == axis_size
        assert p.manual["context_parallel"] == axis_size[0]
        for n in nodes:
            st = s.node_strategies[n]
            strategy = Strategy(
                tuple(map(tuple, st["outputs"])), tuple(map(tuple, st["inputs"])), "p"
            )
            assert context_axis(strategy) == 0, (name, n, st)
        # the blocks' matrix products split along the sequence on the CP axis too (the LM
        # head's is the ILP's to place: at this size it may gather the sequence rather than
        # all-reduce the loss over the CP axis)
        mm = _block_products(g, s)
        assert mm and all(s.node_strategies[n]["outputs"][0][0] == "S(0)" for n in mm)
    base = {"pp": 1, "num_microbatches": B, "global_batch": BATCH}
    with pytest.raises(MeshplanError, match="one row per data-parallel replica"):
        manual_plan(SPEC, CLUSTER, dp=2, tp=1, context_parallel=2,
                    **base | {"global_batch": 8})  # fmt: skip
    with pytest.raises(
        MeshplanError, match="no hybrid sharding"
    ):  # dp x cp x tp: three axes
        manual_plan(SPEC, "2x4xA100-80GB", dp=4, tp=1, context_parallel=2,
                    fsdp="hybrid", **base | {"global_batch": 8})  # fmt: skip
    with pytest.raises(MeshplanError, match="one row"):
        manual_plan(SPEC, CLUSTER, dp=1, tp=1, context_parallel=4, pp=1,
                    num_microbatches=1, global_batch=2)  # fmt: skip
    with pytest.raises(MeshplanError, match="dp x cp x tp x pp"):
        manual_plan(SPEC, CLUSTER, dp=1, tp=1, context_parallel=2, **base)
    with pytest.raises(MeshplanError, match="context_parallel must be a positive"):
        manual_plan(SPEC, CLUSTER, dp=4, tp=1, context_parallel=0, **base)


def test_data_and_context_parallel_plan() -> None:
    """dp x cp (tp = 1): a (dp, cp) mesh, the rows on axis 0, every attention context-parallel
    on axis 1, and the views around the matrix products keep both splits
    (`planner.vocab.nested_views`): no value of the stage's activations is gathered whole on
    either axis but the attention's k and v on the CP axis."""
    p = _plans()["cp_dp"]
    s = p.stages[0]
    assert tuple(s.logical_mesh) == (2, 2)
    assert (p.manual["dp"], p.manual["context_parallel"]) == (2, 2)
    g = _graph(SPEC, _rows("cp_dp"))
    for n in attention_nodes(g):
        st = s.node_strategies[n]
        strategy = Strategy(
            tuple(map(tuple, st["outputs"])), tuple(map(tuple, st["inputs"])), "p"
        )
        assert context_axis(strategy) == 1, (n, st)
    views = {
        n: st
        for n, st in s.node_strategies.items()
        if n.startswith("view")
        and st["inputs"][0] in (["S(0)", "S(1)"], ["S(0)", "S(0)"])
    }
    flat = [n for n, st in views.items() if st["outputs"][0] == ["S(0)", "S(0)"]]
    split = [n for n, st in views.items() if st["outputs"][0] == ["S(0)", "S(1)"]]
    assert flat and split, views
    mm = _block_products(g, s)
    assert mm and all(
        s.node_strategies[n]["outputs"][0] == ["S(0)", "S(0)"] for n in mm
    )


def _block_products(g, s) -> list[str]:
    """The matrix products of the transformer blocks (not the LM head) among the stage's ops."""
    return [
        n
        for n in s.node_strategies
        if n.startswith("mm") and g.node(n).module_path.startswith("blocks.")
    ]


def test_manual_command_cp_flag(tmp_path: Any) -> None:
    """`meshplan manual --cp 2` writes what `manual_plan(context_parallel=2)` prices."""
    from runtime.cli import main

    out = tmp_path / "cp.json"
    args = ["manual", SPEC, "--cluster", CLUSTER, "--dp", "1", "--tp", "2", "--pp", "1"]
    args += ["--cp", "2", "--microbatches", str(B), "--batch", str(BATCH)]
    args += ["--dtype", "float32", "--allow-oom", "--optimizer", "adam_fp32"]
    assert main([*args, "--json", str(out)]) == 0
    p = ParallelPlan.load(out)
    assert p.manual["context_parallel"] == 2
    assert p.estimate == _plans()["cp_tp"].estimate


def test_kv_exchange_priced_as_ring_formulas() -> None:
    """The edge into the attention's k under CP (S(2) -> R on the CP axis of C devices) costs an
    all-gather forward and a reduce-scatter of the partial gradient backward, each
    ``(C - 1) alpha + (C - 1) / C * K * beta`` for K the bytes of the whole k; the gathered k and
    v are priced as saved for backward."""
    g = _graph()
    cluster = Cluster.from_spec(CLUSTER)
    mesh = LogicalMesh(cluster, (1, 4), (4, 1))
    s = StageSettings(mesh, B)
    fx = {n.name: n for n in g.gm.graph.nodes}
    sdpa = fx[attention_nodes(g)[0]]
    k = sdpa.all_input_nodes[1]
    cp = [x for x in sc.node_options(sdpa, g.node(sdpa.name), (4, 1)) if
          x.strategy.source == CP_SOURCE]  # fmt: skip
    assert [x.strategy.inputs[:3] for x in cp] == [
        (("S(2)", "R"), ("R", "R"), ("R", "R"))
    ]
    src = Option(Strategy((("S(2)", "R"),), (), "test"))
    act, grad = sc.edge_matrices(g.node(k.name), sdpa, k, [src], cp, s, False)
    kbytes = g.node(k.name).outputs[0].nbytes
    link = cluster.group_link(4)
    ring = 3 * link.alpha + 3 / 4 * kbytes * link.beta
    assert act[0, 0] == pytest.approx(2 * ring, rel=1e-12)
    assert grad[0, 0] == 0
    # the compute of the critical rank: 1/C of the full product, as every sharded op
    assert sc.split_factor(cp[0].strategy, (4, 1)) == 4
    # memory: the gathered k and v the kernel saves, less the split copies their producers'
    # prices count (v is shaped as k here)
    node = g.node(sdpa.name)
    assert sc.activation_bytes(node, cp[0], False, s) == 3 / 4 * 2 * kbytes
    # time: the critical rank's FLOPs (1/C) and bytes (its queries and outputs, all of k and v)
    assert sc._sharded_bytes(node, cp[0], 4, s) == (
        (node.bytes_read + node.bytes_written - 2 * kbytes) / 4 + 2 * kbytes
    )


def _attention_choice(spec: str, rows: int) -> set[str]:
    from planner.intra.solve import solve_stage

    g = _graph(spec, rows)
    mesh = LogicalMesh(Cluster.from_spec("1x2xA100-80GB"), (1, 2), (1, 2))
    sol = solve_stage(g, mesh)
    return {sol.choice[n].strategy.source for n in attention_nodes(g)}


def test_search_picks_context_parallelism_for_long_sequences() -> None:
    """One head (no head split), one row (no batch split), sequence 16384: attention is split
    along the sequence. A batch of 8 short sequences is split by the batch instead."""
    long = "llama:hidden=64,layers=1,heads=1,kv_heads=1,ffn=128,vocab=128,seq=16384"
    assert _attention_choice(long, 1) == {CP_SOURCE}
    short = "llama:hidden=64,layers=1,heads=1,kv_heads=1,ffn=128,vocab=128,seq=64"
    assert CP_SOURCE not in _attention_choice(short, 8)


def test_search_picks_data_and_context_parallelism() -> None:
    """Two rows of a long sequence with one head on 4 devices: no head split, and the batch
    splits over 2 only. The search finds DP 2 x CP 2 (its (dp, cp) seed, one micro-batch of
    one row per replica), exactly as `manual_plan` prices that layout, and faster than CP
    over all 4 devices on one-row micro-batches (the keys and values gathered from 4 devices
    twice, against from 2 once)."""
    from benchmarks.records import context_degree
    from planner.api import plan

    long = "llama:hidden=64,layers=2,heads=1,kv_heads=1,ffn=128,vocab=128,seq=16384"
    cluster = "1x4xH100-80GB"
    auto = plan(long, cluster, global_batch=2, dtype="bfloat16")
    assert [tuple(s.logical_mesh) for s in auto.stages] == [(2, 2)]
    assert context_degree(auto) == 2
    kw = {"tp": 1, "pp": 1, "global_batch": 2, "dtype": "bfloat16", "allow_oom": True}
    dp_cp = manual_plan(
        long, cluster, dp=2, context_parallel=2, num_microbatches=1, **kw
    )
    cp = manual_plan(long, cluster, dp=1, context_parallel=4, num_microbatches=2, **kw)
    assert auto.estimate.iteration_time_s == dp_cp.estimate.iteration_time_s
    assert dp_cp.estimate.iteration_time_s < cp.estimate.iteration_time_s


# ------------------------------------------------------------------ runtime


def _rows(name: str) -> int:
    """Rows per micro-batch of plan `name`."""
    return _plans()[name].global_batch // B


def _model_and_batches(
    batch: int = BATCH,
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=batch, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _train(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    """Body of every rank: `single_device.counted_adam_steps` per plan."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    return {
        name: single_device.counted_adam_steps(
            plan,
            *_model_and_batches(plan.global_batch),
            SPEC,
            LR,
            compile=name != "cp_dp",
        )
        for name, plan in plans.items()
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train, 4, args=(_plans(),), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["cp_tp", "cp_fsdp", "cp_pp", "cp_dp", "cp_dp_fsdp", "cp_dp_rc"]
)
def test_trains_like_one_device(runs: list[dict[str, Any]], name: str) -> None:
    """Losses and parameters of one device (a pipeline rank: its stage's parameters, equal
    on every rank holding them)."""
    model, batches = _model_and_batches(_plans()[name].global_batch)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    held: dict[str, torch.Tensor] = {}
    for r in runs:
        got = r[name]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for k, v in got["params"].items():
            if k in held:
                assert torch.equal(held[k], torch.from_numpy(v)), k
            held[k] = torch.from_numpy(v)
        assert not got["mismatches"], got["mismatches"][:3]
        # FSDP and recomputed stages run eagerly (and cp_dp is not compiled)
        assert got["compiled"] == (name == "cp_tp")
    single_device.assert_same_parameters(held, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp_tp", "cp_fsdp", "cp_dp", "cp_dp_fsdp"])
def test_communicates_what_was_priced(runs: list[dict[str, Any]], name: str) -> None:
    """Per site, the priced collectives once per micro-batch (FSDP's gathers and
    reduce-scatters included); bucketed parameter gradients (``bwd:sync:``, once per step)
    against the priced gradient edges' total bytes. Each attention's k and v are all-gathered
    forward and their gradients reduce-scattered backward."""
    from comm_check import compare

    from planner.intra.priced_comm import predicted_collectives
    from runtime.stages import split_stages, stage_program

    plan = _plans()[name]
    sp = plan.stages[0]
    stage = split_stages(_graph(SPEC, _rows(name)), plan)[0]
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    params = stage.graph.param_derived()
    predicted, grads = {}, {}
    for label, colls in predicted_collectives(
        stage.graph, stage_program(stage, sp), lmesh, sp.fsdp_params, sp.fsdp_axes
    ).items():
        d, edge = label.split(":", 1)
        if d == "bwd" and "->" in edge and edge.split("->")[0] in params:
            for kind, nbytes in colls:
                grads[kind] = grads.get(kind, 0.0) + nbytes
            continue
        predicted[label] = colls * B
    for r in runs:
        records = [x for x in r[name]["records"] if x.site not in UNPRICED_SITES]
        synced: dict[str, float] = {}
        for x in records:
            if x.site.startswith("bwd:sync:"):
                synced[x.kind] = synced.get(x.kind, 0.0) + x.nbytes
        measured = [x for x in records if not x.site.startswith("bwd:sync:")]
        totals, diffs = compare(predicted, measured)
        assert not diffs, "\n".join(diffs[:10])
        assert totals["all_gather"][1] > 0 and totals["reduce_scatter"][1] > 0, totals
        # a weight gathered for a split computation is priced P -> R on its gathered view (and
        # R -> S free on its own edge) and reduce-scattered by the runtime's buckets: the same
        # bytes (`planner.vocab.grads.bucketed_axes`, `runtime.grad_sync`)
        assert sum(synced.values()) == sum(grads.values())
        assert (sum(synced.values()) > 0) == (
            not sp.fsdp_params
        )  # FSDP: per micro-batch
        assert set(synced) <= {"all_reduce", "reduce_scatter"}
        for n in attention_nodes(stage.graph):
            into = {x.site: x.kind for x in measured if x.site.endswith(f"->{n}")}
            assert sorted(into.values()) == ["all_gather"] * 2 + ["reduce_scatter"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp_tp", "cp_fsdp", "cp_dp_fsdp"])
def test_holds_the_priced_bytes(runs: list[dict[str, Any]], name: str) -> None:
    """Per parameter, weights + gradients + Adam state (fp32: 4 + 4 + 8 bytes per element) on
    one device against the local shards each rank holds."""
    for r in runs:
        single_device.assert_holds_priced_bytes(
            r[name]["held"], _plans()[name], _graph(SPEC, _rows(name)), CLUSTER
        )
