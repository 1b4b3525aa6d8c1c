"""Sequence parallelism (Megatron-SP) and selective recomputation: priced, chosen, executed.

Planner: the attention cores are found in the graph (fused and explicit attention); the bytes
selective recomputation keeps, derived here from the graph's saved values, equal the stage
table's, and lie between full recomputation's and none's; the stage DP picks selective when the
memory budget admits it but not "none"; Megatron-SP's placements split the norms and residual
adds along the sequence on the tensor-parallel axis.

Runtime: one gloo launch of 2 ranks trains a small Llama (hidden 64, 4 layers) under two plans,
tp2 with sequence parallelism (``sp``), tp2 with sequence parallelism and selective
recomputation (``sel``), and two pipeline stages with selective recomputation (``sel_pp2``),
2 micro-batches, Adam (lr 1e-3), 3 steps each, against one device
(losses and parameters within 1e-5); the collectives of one counted step against the priced ones
site by site; the bytes of parameters, gradients and Adam state each rank holds against the
price (``sp``, ``sel``); and, under ``sel`` and ``sel_pp2``, every attention-core op run twice
per micro-batch (forward and recomputation), every other op once.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import single_device
import torch
from torch import nn

from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner.inter import boundaries as bd
from planner.inter import range_costs as rc
from planner.inter import stage_table as st
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.attention import attention_cores, storage_owner
from planner.tracing.tracer import trace
from planner.vocab.plan_file import ParallelPlan, StagePlan
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
CLUSTER = "1x2xA100-80GB"
STEPS, LR, BATCH, B = 3, 1e-3, 8, 2
# nll_loss's total_weight and the embedding's scalar (tests/test_fsdp.py)
UNPRICED_SITES = ("bwd:nll_loss_forward", "bwd:embedding")


class _Attention(nn.Module):
    """Explicit attention as Megatron-LM 2022 computed it: QK^T, scale, causal mask, softmax,
    dropout, times V."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.1)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(16, -1)
        a = q @ k.transpose(-1, -2) / 4.0
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        a = a.masked_fill(mask, float("-inf"))
        return self.proj(self.drop(a.softmax(-1)) @ v)


class _Explicit(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attention() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return x.square().mean()


def _profile(graph: Any, layers: int) -> st.LayerProfile:
    from cost_models.cluster import Cluster
    from planner.inter.layers import layers_in
    from planner.intra.solve import solve_stage

    mesh = LogicalMesh(Cluster.from_spec("1x1xA100-80GB"), (1, 1), (1, 1))
    sol = solve_stage(graph, mesh)
    layer_of = bd.layer_of_nodes(graph, layers_in(graph, layers))
    return st.profile(
        sol, graph, layer_of, bd.boundary_values(graph, layer_of, layers), layers
    )


def _derived_kept(graph: Any) -> tuple[float, float, float]:
    """From the graph alone, one device: (bytes kept with no recomputation, bytes kept with the
    attention cores recomputed, the largest core's dropped bytes): every saved value once and
    every op's extra saved bytes; selective keeps the values saved outside the cores and the
    cores' inputs, and no core op's extra bytes."""
    cores = attention_cores(graph)
    saved = {v for n in graph.ops for v in n.saved}
    kept = {v for n in graph.ops if n.name not in cores for v in n.saved}
    for n in graph.ops:
        if n.name in cores:
            kept |= {
                storage_owner(graph, u)
                for u in n.inputs
                if u not in cores and graph.node(u).op != "param"
            }
    size = {v: graph.node(v).output_bytes for v in saved}
    extra = {n.name: n.saved_extra_bytes for n in graph.ops}
    none = sum(size.values()) + sum(extra.values())
    sel = sum(size[v] for v in saved & kept) + sum(
        e for n, e in extra.items() if n not in cores
    )
    per_core: dict[int, float] = {}
    for n, c in cores.items():
        drop = (size.get(n, 0) if n not in kept else 0) + extra[n]
        per_core[c] = per_core.get(c, 0) + drop
    return none, sel, max(per_core.values())


def test_attention_cores_of_fused_and_explicit_attention() -> None:
    model, b = build_model(SPEC, batch=4, device="meta")
    g = trace(model, b)
    cores = attention_cores(g)
    assert len(set(cores.values())) == 4  # one per block
    assert all(
        g.node(n).target.startswith("aten._scaled_dot_product_")
        or g.node(n).target == "getitem"
        for n in cores
    )
    assert sum(g.node(n).target != "getitem" for n in cores) == 4
    g = trace(_Explicit(), (torch.randn(2, 8, 16),))
    cores = attention_cores(g)
    assert len(set(cores.values())) == 3
    kinds = {g.node(n).target.split(".")[1] for n in cores}
    assert {"bmm", "_softmax", "masked_fill", "bernoulli"} <= kinds
    assert not any(g.node(n).module_path.endswith(("qkv", "proj")) for n in cores)
    # a model without attention: no core, and selective recomputation is refused
    mlp, mb = build_model("mlp", batch=4, device="meta")
    gm = trace(mlp, mb)
    assert attention_cores(gm) == {}
    with pytest.raises(MeshplanError, match="attention core"):
        rc.range_footprint(_profile(gm, 2), "selective")


@pytest.mark.parametrize("which", ["explicit", "llama"])
def test_selective_keeps_what_the_graph_says(which: str) -> None:
    if which == "explicit":
        g = trace(_Explicit(), (torch.randn(2, 8, 16),))
    else:
        model, b = build_model(SPEC, batch=4, device="meta", dtype=torch.float32)
        g = trace(model, b)
    L = 3
    prof = _profile(g, L)
    none, sel, peak = _derived_kept(g)
    total = {}
    for mode in ("none", "selective", "full"):
        _, kept, transient = rc.range_footprint(prof, mode)
        total[mode] = kept[0, L - 1] + transient[0, L - 1]
        if mode == "none":
            assert kept[0, L - 1] == pytest.approx(none)
        if mode == "selective":
            assert kept[0, L - 1] == pytest.approx(sel)
            # the largest core, live while recomputed, and what every mode's backward holds
            # (`planner.inter.held_memory`)
            backward = prof.backward_bytes()[0, L - 1]
            assert transient[0, L - 1] == pytest.approx(peak + backward)
    assert total["full"] < total["selective"] < total["none"]
    # time: selective adds the cores' forward, less than full recomputation's
    t = {m: prof.range_time(0, L - 1, m) for m in ("none", "selective", "full")}
    assert t["none"] < t["selective"] < t["full"]


def test_stage_dp_picks_selective_between_budgets() -> None:
    """One device: with memory for no recomputation the plan recomputes nothing; with less (half
    way to what selective recomputation needs) it recomputes the attention cores; with less than
    that, everything."""
    from planner.api import plan

    model, b = build_model(SPEC, batch=BATCH, device="meta", dtype=torch.float32)
    g = trace(model, b)
    prof = _profile(g, 2)
    peak = {}
    for mode in ("none", "selective", "full"):
        params, kept, transient = rc.range_footprint(prof, mode)
        peak[mode] = params[0, 1] + kept[0, 1] + transient[0, 1]
    assert peak["full"] < peak["selective"] < peak["none"]
    kw = {"global_batch": BATCH, "microbatch_size": BATCH, "dtype": "float32"}
    picks = {}
    for name, budget in (
        ("none", peak["none"] * 1.01),
        ("selective", (peak["selective"] + peak["none"]) / 2),
        ("full", (peak["full"] + peak["selective"]) / 2),
    ):
        p = plan(SPEC, "1x1xA100-80GB", memory_budget=budget, **kw)
        picks[name] = {s.recompute for s in p.stages}
        assert p.estimate.peak_memory_bytes <= budget
    assert picks == {"none": {"none"}, "selective": {"selective"}, "full": {"full"}}


def test_plan_files_read_true_and_false_as_full_and_none() -> None:
    p = _plans()["sel"]
    d = p.to_json()
    assert d["stages"][0]["recompute"] == "selective"
    for old, new in ((True, "full"), (False, "none")):
        d["stages"][0]["recompute"] = old
        assert ParallelPlan.from_json(d).stages[0].recompute == new
    d["stages"][0]["recompute"] = "some"
    with pytest.raises(MeshplanError, match="recompute.*none, selective, full"):
        ParallelPlan.from_json(d)
    assert StagePlan.__dataclass_fields__["recompute"].type == "str"


def test_manual_sequence_parallel_placements() -> None:
    """Megatron-SP: every norm and residual add split along the sequence on the tp axis; the
    row-parallel outputs partial (their reduce-scatter is the edge), the norms' outputs
    all-gathered into the column-parallel matmuls."""
    from planner.intra.megatron import sequence_parallel_nodes

    p = _plans()["sp"]
    s = p.stages[0]
    g = _graph()
    region = sequence_parallel_nodes(g)
    targets = {g.node(n).target for n in region}
    assert {
        "aten.pow.Tensor_Scalar",
        "aten.rsqrt.default",
        "aten.add.Tensor",
    } <= targets
    # both residual adds of every block and the final norm's ops
    assert sum(g.node(n).module_path.count(".") == 1 for n in region) == 8
    for n in region:
        assert s.node_strategies[n]["outputs"][0][1] == "S(1)", n
    # without sequence parallelism (sequence_parallel=False) Megatron replicates them
    plain = manual_plan(
        SPEC,
        CLUSTER,
        dp=1,
        tp=2,
        pp=1,
        num_microbatches=B,
        global_batch=BATCH,
        dtype="float32",
        allow_oom=True,
        sequence_parallel=False,
    )
    for n in region:
        assert plain.stages[0].node_strategies[n]["outputs"][0][1] == "R", n
    with pytest.raises(MeshplanError, match="tensor-parallel"):
        manual_plan(
            SPEC, CLUSTER, dp=2, tp=1, pp=1, num_microbatches=1, sequence_parallel=True
        )
    assert p.manual["sequence_parallel"] is True


# ------------------------------------------------------------------ runtime


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    kw = {
        "dp": 1,
        "tp": 2,
        "pp": 1,
        "num_microbatches": B,
        "global_batch": BATCH,
        "dtype": "float32",
        "optimizer": "adam_fp32",
        "allow_oom": True,
        "sequence_parallel": True,
    }
    pp2 = kw | {"tp": 1, "pp": 2, "sequence_parallel": None}
    return {
        "sp": manual_plan(SPEC, CLUSTER, **kw),
        "sel": manual_plan(SPEC, CLUSTER, recompute="selective", **kw),
        "sel_pp2": manual_plan(SPEC, CLUSTER, recompute="selective", **pp2),
    }


@functools.cache
def _graph() -> Any:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH // B, device="cpu")
    return trace(model, b)


def _model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=BATCH, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _train(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    """Body of every rank, per plan: 3 Adam steps (the second counted, op runs counted too),
    then the bytes held before an update."""
    import logging

    from runtime.comm_count import CommCounter
    from runtime.train import split_batch

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, plan in plans.items():
        model, batches = _model_and_batches()
        tr = single_device.trainer(
            plan, model, batches[0], SPEC, optimizer="adam", lr=LR
        )
        losses = [tr.step(batches[0])]
        executors = list(tr.runner.executors.values())
        runs: dict[str, int] = {}
        for ex in executors:

            def counted(n: Any, run_node: Any = ex.run_node, runs: dict = runs) -> Any:
                runs[n.name] = runs.get(n.name, 0) + 1
                return run_node(n)

            ex.run_node = counted
        with CommCounter() as counter:
            losses.append(tr.step(batches[1]))
        for ex in executors:
            del ex.run_node
        losses.append(tr.step(batches[2]))
        tr.runner.step(tr.params, split_batch(batches[0], B), tr.buffers)
        state = tr.optimizer.state

        held = single_device.held_state_bytes(tr.params, state)
        tr.optimizer.zero_grad(set_to_none=True)
        out[name] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "records": counter.records,
            "held": held,
            "runs": runs,
            "stage": tr.runner.index,
            "mismatches": [m for ex in executors for m in ex.mismatches],
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train, 2, args=(_plans(),), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp", "sel", "sel_pp2"])
def test_trains_like_one_device(runs: list[dict[str, Any]], name: str) -> None:
    model, batches = _model_and_batches()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    held: dict[str, torch.Tensor] = {}  # a pipeline rank has its stage's parameters
    for r in runs:
        got = r[name]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for k, v in got["params"].items():
            if k in held:
                assert torch.equal(held[k], torch.from_numpy(v)), k
            held[k] = torch.from_numpy(v)
        assert not got["mismatches"], got["mismatches"][:3]
    single_device.assert_same_parameters(held, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp", "sel"])
def test_communicates_what_was_priced(runs: list[dict[str, Any]], name: str) -> None:
    """Per site, the priced collectives of every edge (`predicted_collectives`) once per
    micro-batch; under selective recomputation the forward redistributions into attention-core
    ops run once more in backward, as priced (`planner.inter.selective`). The parameters'
    gradients are synchronised once per step in buckets (``bwd:sync:``, `runtime.grad_sync`):
    their bytes per kind against the priced gradient edges' total. Sequence parallelism issues
    reduce-scatters."""
    from comm_check import compare

    from cost_models.cluster import Cluster
    from planner.intra.priced_comm import predicted_collectives
    from runtime.stages import split_stages, stage_program

    plan = _plans()[name]
    stage = split_stages(_graph(), plan)[0]
    sp = plan.stages[0]
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    params = stage.graph.param_derived()
    cores = attention_cores(stage.graph) if sp.recompute == "selective" else {}
    predicted, grads = {}, {}
    for label, colls in predicted_collectives(
        stage.graph, stage_program(stage, sp), lmesh
    ).items():
        d, edge = label.split(":", 1)
        u, v = edge.split("->")
        if d == "bwd" and u in params:
            for kind, nbytes in colls:
                grads[kind] = grads.get(kind, 0.0) + nbytes
            continue
        predicted[label] = colls * (2 * B if d == "fwd" and v in cores else B)
    assert grads
    for r in runs:
        records = [x for x in r[name]["records"] if x.site not in UNPRICED_SITES]
        synced: dict[str, float] = {}
        for x in records:
            if x.site.startswith("bwd:sync:"):
                synced[x.kind] = synced.get(x.kind, 0.0) + x.nbytes
        measured = [x for x in records if not x.site.startswith("bwd:sync:")]
        totals, diffs = compare(predicted, measured)
        assert not diffs, "\n".join(diffs[:10])
        assert synced == grads
        assert totals["reduce_scatter"][0] > 0, totals


@pytest.mark.slow
def test_selective_recomputes_only_the_attention_cores(
    runs: list[dict[str, Any]],
) -> None:
    """Under ``sel`` (run eagerly: recomputed stages are not compiled) every op runs once per
    micro-batch, the attention cores' twice (forward, and again in backward; a view picking an
    output of the fused op may not be recomputed: torch's non-reentrant checkpoint stops once
    the saved tensors backward needs are back)."""
    g = _graph()
    cores = attention_cores(g)
    plan = _plans()["sel_pp2"]
    for r in runs:
        for name in ("sel", "sel_pp2"):
            counts = r[name]["runs"]
            if name == "sel":
                assert set(cores) <= set(counts)
            for n, c in counts.items():
                if n in cores and g.node(n).is_view:
                    assert c in (B, 2 * B), (n, c)
                else:
                    assert c == (2 * B if n in cores else B), (name, n, c)
            # the fused attentions this rank runs (2 per pipeline stage)
            want = 4 if name == "sel" else 2
            assert sum(c == 2 * B for c in counts.values()) >= want
    # each pipeline stage holds two of the four attention cores
    assert {r["sel_pp2"]["stage"] for r in runs} == {0, 1}
    assert all(s.recompute == "selective" for s in plan.stages)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp", "sel"])
def test_holds_the_priced_bytes(runs: list[dict[str, Any]], name: str) -> None:
    """Per parameter, weights + gradients + Adam state (fp32: 4 + 4 + 8 bytes per element) on
    one device against the local shards each rank holds."""
    plan = _plans()[name]
    for r in runs:
        single_device.assert_holds_priced_bytes(
            r[name]["held"], plan, _graph(), CLUSTER
        )
    assert np.isfinite(plan.estimate.peak_memory_bytes)


def test_manual_command_flags(tmp_path: Any) -> None:
    """`meshplan manual --recompute selective --sp` writes what `manual_plan` prices;
    `--recompute` alone still means full; `--no-sp` replicates the norms on the tp axis, and
    without either flag they are left to the least cost."""
    from runtime.cli import main

    args = ["manual", SPEC, "--cluster", CLUSTER, "--dp", "1", "--tp", "2", "--pp", "1"]
    args += ["--microbatches", str(B), "--batch", str(BATCH), "--dtype", "float32"]
    args += ["--allow-oom", "--optimizer", "adam_fp32"]
    for flags, mode, sp in (
        (["--recompute", "selective", "--sp"], "selective", True),
        (["--recompute", "--no-sp"], "full", False),
        ([], "none", None),
    ):
        out = tmp_path / f"{mode}.json"
        assert main([*args, *flags, "--json", str(out)]) == 0
        p = ParallelPlan.load(out)
        assert p.stages[0].recompute == mode
        assert p.manual["sequence_parallel"] is sp
    assert ParallelPlan.load(tmp_path / "selective.json").estimate == (
        _plans()["sel"].estimate
    )
