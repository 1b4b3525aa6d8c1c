"""Hybrid sharding (HSDP): FSDP inside a host, replicated across hosts; priced
(`planner.intra.fsdp_prices`), chosen by the search where the inter-host link is slow and memory needs
sharding inside a host only, and executed as priced (`runtime.fsdp`).

One gloo launch of 4 ranks plays a 2x2xCPU cluster (2 hosts of 2; ranks host-major) and trains a
small Llama (hidden 64, 4 layers) data-parallel over all 4 with every parameter HSDP-sharded
(`meshplan manual --fsdp hybrid`: the (2, 2) mesh, axis 0 across hosts, axis 1 inside one),
2 micro-batches, Adam (lr 1e-3), 3 steps, once without recomputation and once with each
transformer block recomputed (`--recompute full`), and checks for each against one device (losses and parameters
within 1e-5), the collectives of one step against the priced ones site by site and mesh axis by
mesh axis (all-gathers and reduce-scatters inside the host, the all-reduce of the shard across
hosts), the bytes each rank holds (parameter, gradient and Adam state shards) against the price,
the shards equal across hosts, and a checkpoint round trip of the sharded parameters and state.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import tempfile
from collections import Counter
from typing import Any

import pytest
import single_device
import torch
from profiles import cpu_cluster
from test_fsdp import _watch_reduce_scatters

from cost_models.cluster import Cluster, LinkSpec
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from cost_models.resharding import reshard_steps
from planner.intra import fsdp_prices as fp
from planner.intra import prices as sc
from planner.intra.prices import Option, StageSettings
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.opgraph import TensorMeta
from planner.vocab.plan_file import ParallelPlan
from planner.vocab.strategy import Strategy
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
STEPS, LR, BATCH, B = 3, 1e-3, 8, 2
UNPRICED_SITES = ("bwd:nll_loss_forward", "bwd:embedding")  # test_fsdp's
REPLICATED = Strategy((("R", "R"),), (), "param")


def _slow_cluster(inter_bandwidth: float = 1e6, inter_latency: float = 1e-3) -> Cluster:
    """2 hosts of 2 CPU processes: inside a host 20 us + 1 ns per byte (`cpu_cluster`),
    across hosts this link."""
    return dataclasses.replace(
        cpu_cluster(2, hosts=2),
        inter_host_link=LinkSpec(inter_bandwidth, inter_latency),
    )


# ------------------------------------------------------------------ prices


def test_hsdp_price_follows_its_derivation() -> None:
    """A [64, 32] fp32 weight (8192 B) replicated on the (2, 2) mesh of 2 hosts x 2 (axis 0
    across hosts: 1 ms + 1 us per byte; axis 1 inside: 20 us + 1 ns per byte), 2 micro-batches,
    sharded inside the host only."""
    s = StageSettings(LogicalMesh(_slow_cluster(), (2, 2), (2, 2)), num_microbatches=2)
    assert fp.hybrid_axes(s.mesh) == (1,)
    assert fp.hybrid_axes(LogicalMesh(_slow_cluster(), (2, 2), (4, 1))) == ()
    meta = TensorMeta((64, 32), "float32", 8192)
    hsdp = Option(REPLICATED, zero=3, shard_axes=(1,))
    fsdp = Option(REPLICATED, zero=3)
    # the shard: dim 0 split inside the host; the gradient partial on both axes; reduced first
    # onto the shard inside the host (still partial across hosts)
    assert fp.fsdp_placements(meta, hsdp, s) == (("R", "R"), ("R", "S(0)"), ("P", "P"))
    # memory: 2048 elements / 2 devices * (2 + 2 + 12) bytes; FSDP over all 4: / 4
    assert fp.param_state_bytes(meta, hsdp, s) == 2048 / 2 * 16
    assert fp.param_state_bytes(meta, fsdp, s) == 2048 / 4 * 16
    intra = (
        20e-6 + 1e-9 * 8192
    )  # an all-gather or reduce-scatter of 8192 B inside a host
    inter_ar = (
        2 * 1e-3 + 1e-6 * 4096
    )  # ring all-reduce of the 4096 B shard over 2 hosts
    assert fp.fsdp_gather(meta, hsdp, s) == pytest.approx(2 * intra)
    assert fp.fsdp_reduce_scatter(meta, hsdp, s) == pytest.approx(intra + inter_ar)
    assert fp.fsdp_comm(meta, hsdp, s) == pytest.approx(3 * intra + inter_ar)
    # node cost: all of it; the ILP's less the gradient all-reduce's bandwidth the consumers'
    # edges charge there per micro-batch (both axes, 8192 B each: 1 us and 1 ns per byte on the
    # all-reduce lines)
    assert fp.zero_cost(meta, hsdp, s) == fp.fsdp_comm(meta, hsdp, s)
    charged = 8192 * 1e-6 + 8192 * 1e-9
    assert fp.ilp_credit(meta, hsdp, s) == pytest.approx(charged / 2)
    # FSDP on this mesh gathers across hosts too: each pass all-gathers the [32, 32] piece
    # inside the host (4096 B), then the whole 8192 B across hosts (1 ms + 1 us * 4096)
    inter_ag = 1e-3 + 1e-6 * 4096
    assert fp.fsdp_gather(meta, fsdp, s) == pytest.approx(
        2 * (inter_ag + 20e-6 + 1e-9 * 4096)
    )
    # FSDP's midpoint is its shard: its reduce-scatter is the one redistribution it was
    _, held, grad = fp.fsdp_placements(meta, fsdp, s)
    one = sum(st.seconds for st in reshard_steps(s.mesh, (64, 32), 4, grad, held))
    assert fp.fsdp_reduce_scatter(meta, fsdp, s) == pytest.approx(one)
    assert str(hsdp).endswith("+HSDP[1]")


def test_hsdp_is_offered_where_the_mesh_spans_hosts() -> None:
    """A parameter gets an HSDP option on the axes `hybrid_axes` gives: those inside a host
    when another crosses hosts; none on one host, nor where no axis stays inside one."""
    from planner.tracing.tracer import trace

    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH, device="meta", dtype=torch.float32)
    g = trace(model, b)
    name = next(
        n for n, p in g.placeholder_paths.items() if p.endswith("mlp.up.weight")
    )
    fx = next(n for n in g.gm.graph.nodes if n.name == name)
    offered = sc.node_options(fx, g.node(name), (2, 2), (1,))
    assert [o.strategy.output for o in offered if o.shard_axes == (1,)] == [
        (("R", "R"),)
    ]
    assert not any(o.shard_axes for o in sc.node_options(fx, g.node(name), (2, 2)))
    assert fp.hybrid_axes(LogicalMesh(cpu_cluster(4), (1, 4), (2, 2))) == ()
    assert fp.hybrid_axes(LogicalMesh(_slow_cluster(), (2, 2), (1, 4))) == ()
    assert fp.hybrid_axes(LogicalMesh(_slow_cluster(), (2, 2), (2, 2))) == (1,)
    # the search also solves pure data parallelism with every parameter HSDP there (a seed)
    from planner.intra.megatron import seed_filters

    seeds = seed_filters((2, 2), False, {2}, (1,))
    assert len(seeds) == len(seed_filters((2, 2), False, {2})) + 1
    hsdp = Option(REPLICATED, zero=3, shard_axes=(1,))
    assert [s.batch_axes for s in seeds if s.params("w", hsdp)] == [(0, 1)]


def test_search_picks_hsdp_where_it_should() -> None:
    """Data parallel over 2 hosts of 2 (the (2, 2) mesh), the weights' planned placement
    replicated (as test_fsdp's search test): with memory for 8.5 bytes per parameter element
    (HSDP needs 16 / 2 = 8, ZeRO-2 4 + 12 / 4 = 7, FSDP 16 / 4 = 4, replication 16) and a slow
    inter-host link the largest weights go hybrid (sharded inside a host only); with the same
    memory and the inter-host link as fast as the host's none does (ZeRO-2 and FSDP), nor
    where the data is not split on both axes; with memory to spare none is sharded; with 4.5
    bytes per element FSDP over all 4 devices."""
    from planner.intra.solve import solve_stage
    from planner.tracing.tracer import trace

    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH, device="meta", dtype=torch.float32)
    g = trace(model, b)

    def replicated(path: str, option: Option) -> bool:
        return all(p == "R" for p in option.strategy.output[0])

    numel = sum(m.numel() for m in g.params.values())
    mlp = {p for p in g.params if ".mlp." in p}
    kw = {"batch_axes": (0, 1), "param_filter": replicated, "optimizer": "adam_fp32"}
    slow = LogicalMesh(_slow_cluster(1e7), (2, 2), (2, 2))
    fast = LogicalMesh(cpu_cluster(2, hosts=2), (2, 2), (2, 2))
    free = solve_stage(g, slow, **kw)
    assert not (free.fsdp_params or free.zero_params)
    budget = free.activation_bytes + 8.5 * numel
    hybrid = solve_stage(g, slow, memory_budget=budget, **kw)
    assert hybrid.memory_bytes <= budget
    assert mlp <= set(hybrid.fsdp_axes) and set(hybrid.fsdp_axes) == set(
        hybrid.fsdp_params
    )
    assert all(a == [1] for a in hybrid.fsdp_axes.values())
    # without the data split on both axes the gradient need not be partial across hosts as
    # HSDP's price takes it: not offered (`fsdp_prices.hsdp_holds`)
    loose = solve_stage(
        g, slow, memory_budget=budget, param_filter=replicated, optimizer="adam_fp32"
    )
    assert loose.memory_bytes <= budget and not loose.fsdp_axes
    hsdp = Option(REPLICATED, zero=3, shard_axes=(1,))
    assert fp.hsdp_holds(hsdp, (2, 2), (0, 1)) and not fp.hsdp_holds(hsdp, (2, 2), (1,))
    flat = solve_stage(g, fast, memory_budget=budget, **kw)
    assert flat.memory_bytes <= budget and not flat.fsdp_axes
    assert flat.zero_params or flat.fsdp_params
    tight = free.activation_bytes + 4.5 * numel
    full = solve_stage(g, slow, memory_budget=tight, **kw)
    assert mlp <= set(full.fsdp_params) and not full.fsdp_axes


# ------------------------------------------------------------------ plan vocabulary


def test_plan_says_which_axes_and_checks_them() -> None:
    plan = _plan()
    s = plan.stages[0]
    assert s.fsdp_axes == {p: [1] for p in s.fsdp_params}
    assert len(s.fsdp_params) == len(s.param_placements)
    again = ParallelPlan.from_json(plan.to_json())
    assert again.stages[0].fsdp_axes == s.fsdp_axes
    old = plan.to_json()  # a plan file from before HSDP: no fsdp_axes, plain FSDP
    del old["stages"][0]["fsdp_axes"]
    assert ParallelPlan.from_json(old).stages[0].shard_axes("wte.weight") is None
    for bad in ([0, 1], [], [2], [1, 1], "1"):
        d = plan.to_json()
        d["stages"][0]["fsdp_axes"]["wte.weight"] = bad
        with pytest.raises(MeshplanError, match=r"fsdp_axes\[\"wte.weight\"\]"):
            ParallelPlan.from_json(d)
    d = plan.to_json()
    d["stages"][0]["fsdp_params"].remove("wte.weight")
    with pytest.raises(MeshplanError, match="listed in fsdp_params"):
        ParallelPlan.from_json(d)
    with pytest.raises(MeshplanError, match="tp=1"):
        manual_plan(
            SPEC, _cluster(), dp=2, tp=2, pp=1, num_microbatches=B,
            global_batch=BATCH, dtype="float32", fsdp="hybrid",
        )  # fmt: skip


# ------------------------------------------------------------------ runtime


def _cluster() -> Cluster:
    return cpu_cluster(2, hosts=2)


#: HSDP without recomputation, and with each transformer block recomputed (torchtitan's HSDP +
#: activation checkpointing): the recomputed forward reads the backward's gathered copies, so the
#: collectives, the bytes held and the numbers are the same as without.
RECOMPUTE = ("none", "full")


@functools.cache
def _plan(recompute: str = "none") -> ParallelPlan:
    base = manual_plan(
        SPEC,
        _cluster(),
        dp=4,
        tp=1,
        pp=1,
        num_microbatches=B,
        global_batch=BATCH,
        dtype="float32",
        allow_oom=True,
        fsdp="hybrid",
        recompute=recompute,
    )
    p = copy.deepcopy(base)
    from planner.inter.layers import layers_in

    ops = _graph().ops
    p.layer_nodes = [(ops[a].name, ops[b].name) for a, b in layers_in(_graph(), 4)]
    p.stages[0].layers = (0, 3)
    return p


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


def _train(plan: ParallelPlan, ckpt: str) -> dict[str, Any]:
    """Body of every rank: 3 Adam steps (the second counted, per mesh axis), the bytes held,
    then a checkpoint round trip."""
    import logging

    import torch.distributed as dist

    from runtime.checkpoint import load_checkpoint, optimizer_state, save_checkpoint
    from runtime.comm_count import CommCounter
    from runtime.train import split_batch

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    model, batches = _model_and_batches()
    tr = single_device.trainer(plan, model, batches[0], SPEC, optimizer="adam", lr=LR)
    mesh = tr.runner.executor.mesh
    axis_of = {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}
    losses = [tr.step(batches[0])]
    events = _watch_reduce_scatters(tr.runner.executor.fsdp)
    ex, runs = tr.runner.executor, Counter()

    def counted(n: Any, run_node: Any = ex.run_node) -> Any:
        runs[n.name] += 1
        return run_node(n)

    ex.run_node = counted
    with CommCounter(axis_of) as counter:
        losses.append(tr.step(batches[1]))
    del ex.run_node
    events = list(events)
    for watched in ("_reduce", "_end_backward"):
        del tr.runner.executor.fsdp.__dict__[watched]
    losses.append(tr.step(batches[2]))
    tr.runner.step(
        tr.params, split_batch(batches[0], plan.num_microbatches), tr.buffers
    )
    state = tr.optimizer.state

    def local(t: Any) -> torch.Tensor:
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    def nbytes(t: Any) -> int:
        return local(t).numel() * local(t).element_size()

    held = {
        k: (
            nbytes(p),
            nbytes(p.grad),
            sum(nbytes(v) for n, v in state[p].items() if n != "step"),
        )
        for k, p in tr.params.items()
    }
    shards = {k: local(p).detach().numpy().copy() for k, p in tr.params.items()}
    tr.optimizer.zero_grad(set_to_none=True)
    params = {k: v.numpy().copy() for k, v in tr.full_params().items()}
    save_checkpoint(ckpt, plan, tr.params, optimizer_state(tr.optimizer, tr.params), 3)
    dist.barrier()
    loaded, lstate, step = load_checkpoint(ckpt, plan, mesh=mesh)
    same = all(
        loaded[k].placements == p.placements
        and torch.equal(loaded[k]._local_tensor, p._local_tensor.detach())
        and torch.equal(
            lstate[k]["exp_avg"]._local_tensor, state[p]["exp_avg"]._local_tensor
        )
        for k, p in tr.params.items()
    )
    return {
        "recompute": plan.stages[0].recompute,
        "runs": runs,
        "losses": losses,
        "params": params,
        "records": counter.records,
        "axes": [
            (r.site, r.kind, axis_of.get(r.group), r.nbytes) for r in counter.records
        ],
        "held": held,
        "shards": shards,
        "checkpoint": (same, step),
        "events": events,
    }


def _train_each(plans: dict[str, ParallelPlan], ckpt: str) -> dict[str, Any]:
    """Body of every rank: `_train` for every plan (one launch), each with its own checkpoint."""
    import os

    return {k: _train(p, os.path.join(ckpt, k)) for k, p in plans.items()}


@pytest.fixture(scope="module")
def launched() -> list[dict[str, Any]]:
    plans = {mode: _plan(mode) for mode in RECOMPUTE}
    with tempfile.TemporaryDirectory() as d:
        return launch(_train_each, 4, args=(plans, d), timeout_s=400)


@pytest.fixture(params=RECOMPUTE)
def runs(request: Any, launched: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's `_train` of the plan with recomputation mode ``request.param``."""
    return [r[request.param] for r in launched]


def test_plans_recompute_as_asked() -> None:
    assert [_plan(m).stages[0].recompute for m in RECOMPUTE] == list(RECOMPUTE)


@pytest.mark.slow
def test_hsdp_recomputes_the_blocks(runs: list[dict[str, Any]]) -> None:
    """In the counted step every matrix product of a transformer block runs once per
    micro-batch, and twice with recomputation; those outside the blocks once."""
    from planner.tracing.blocks import block_of

    mms = [n for n in _graph().ops if n.name.startswith("mm")]
    assert any(block_of(n.module_path) is not None for n in mms)
    per_block = 2 if runs[0]["recompute"] == "full" else 1
    for r in runs:
        for n in mms:
            inside = block_of(n.module_path) is not None
            assert r["runs"][n.name] == B * (per_block if inside else 1), n.name


@pytest.mark.slow
def test_hsdp_trains_like_one_device(runs: list[dict[str, Any]]) -> None:
    model, batches = _model_and_batches()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    for r in runs:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got = {k: torch.from_numpy(v) for k, v in r["params"].items()}
        single_device.assert_same_parameters(got, ref_params)


def _predicted(plan: ParallelPlan) -> dict[str, list[tuple[str, float]]]:
    from planner.intra.priced_comm import predicted_collectives
    from runtime.stages import split_stages, stage_program

    st, sp = split_stages(_graph(), plan)[0], plan.stages[0]
    lmesh = LogicalMesh(_cluster(), tuple(sp.submesh), tuple(sp.logical_mesh))
    once = predicted_collectives(
        st.graph, stage_program(st, sp), lmesh, sp.fsdp_params, sp.fsdp_axes
    )
    # every collective runs once per micro-batch (FSDP reduces each micro-batch's gradient)
    return {label: colls * B for label, colls in once.items()}


@pytest.mark.slow
def test_hsdp_communicates_what_was_priced(runs: list[dict[str, Any]]) -> None:
    """Site by site as test_fsdp; and on the FSDP sites axis by axis: the all-gathers and
    reduce-scatters inside the host (axis 1), only the shards' all-reduce across hosts (axis 0,
    on half the bytes of the parameter)."""
    from comm_check import compare

    plan = _plan(runs[0]["recompute"])
    predicted = _predicted(plan)
    sp = plan.stages[0]
    assert sum(k.startswith("fwd:fsdp:") for k in predicted) == len(sp.fsdp_params)
    names = {p: n for n, p in _graph().placeholder_paths.items()}
    want: Counter = Counter()
    for path in sp.fsdp_params:
        full = _graph().node(names[path]).outputs[0].nbytes
        want["fwd", "all_gather", 1] += B * full
        want["bwd", "all_gather", 1] += B * full
        want["bwd", "reduce_scatter", 1] += B * full
        want["bwd", "all_reduce", 0] += B * full / 2
    for r in runs:
        measured = [x for x in r["records"] if x.site not in UNPRICED_SITES]
        totals, diffs = compare(predicted, measured)
        assert not diffs, "\n".join(diffs[:10])
        assert "all_reduce" in totals and totals["all_reduce"][1] > 0
        got: Counter = Counter()
        for site, kind, axis, nbytes in r["axes"]:
            if ":fsdp:" in site:
                got[site.split(":")[0], kind, axis] += nbytes
        assert got == want


@pytest.mark.slow
def test_hsdp_reduces_one_layer_later(runs: list[dict[str, Any]]) -> None:
    """Every gradient's reduction (reduce-scatter, then the shard's all-reduce) is issued as a
    functional collective (on gloo completed at once) and waited one layer later, as FSDP's
    (test_fsdp)."""
    n = len(_plan(runs[0]["recompute"]).stages[0].fsdp_params)
    for r in runs:
        issued = [e for e in r["events"] if e[0] != "end"]
        assert len(issued) == B * n and all(e[3] and e[4] for e in issued)
        for layer, before, after, *_ in issued:
            assert after == [x for x in before if x <= layer] + [layer]


@pytest.mark.slow
def test_hsdp_holds_the_priced_bytes(runs: list[dict[str, Any]]) -> None:
    """Per parameter: the planner's weights + gradients + Adam state (fp32: 4 + 4 + 8 bytes per
    element) on one device, against the local shards each rank holds: half of each tensor
    (sharded inside the host), the same half on both hosts."""
    plan, graph = _plan(runs[0]["recompute"]), _graph()
    s = StageSettings(LogicalMesh(_cluster(), (2, 2), (2, 2)), B, optimizer="adam_fp32")
    names = {p: n for n, p in graph.placeholder_paths.items()}
    sp = plan.stages[0]
    for r in runs:
        for path, (param, grad, adam) in r["held"].items():
            meta = graph.node(names[path]).outputs[0]
            strategy = Strategy((tuple(sp.param_placements[path]),), (), "param")
            option = Option(strategy, zero=3, shard_axes=sp.shard_axes(path))
            assert param + grad + adam == fp.param_state_bytes(meta, option, s), path
            assert 2 * param == meta.nbytes, path
    for path in runs[0][
        "shards"
    ]:  # ranks host-major: rank 2 is rank 0's peer on host 1
        assert (runs[0]["shards"][path] == runs[2]["shards"][path]).all()
        assert (runs[1]["shards"][path] == runs[3]["shards"][path]).all()
        assert (runs[0]["shards"][path] != runs[1]["shards"][path]).any()
    assert all(r["checkpoint"] == (True, 3) for r in runs)
