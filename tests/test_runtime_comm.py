"""One training step of a pipeline plan communicates what the plan priced.

GPT (hidden 64, 4 layers), global batch 8, 2 micro-batches, four plans in one gloo launch of 4
ranks: ``pp2`` (2 stages of 1 device, ranks 0 and 1; ranks 2 and 3 idle), ``pp2_tp2`` (2 stages of
2 devices with Megatron tensor parallelism inside each) and ``pp2_dp2`` (the same with data
parallelism). Every rank counts the collectives and
point-to-point transfers of one `Trainer.step` (`runtime.comm_count.CommCounter`).

* Intra-stage (``pp2_tp2`` and ``pp2_dp2``, on our runner and on torch.distributed.pipelining):
  per stage, the prediction is the stage's edges (`predicted_collectives` on
  `runtime.stages.stage_program`, whose received values are in the placement the stage's solution
  priced their edges from, ``StagePlan.input_placements``) times the number of micro-batches,
  except the gradients of parameters (edges leaving parameters or their views), synchronised once
  per step. ``pp2_dp2`` receives its boundary value as ``S(0)`` on the data-parallel axis: planned
  replicated, its consumers' gradients would be all-gathered, which the planner never priced.
* Gradient buckets (``pp2_dp2_full``: the same with full recomputation, so the stages run
  eagerly and launch their buckets during backward; buckets capped small, several per stage):
  the all-reduce bytes at every bucket's site against the priced gradients of its parameters.
* Stage boundaries (both plans): the bytes every rank sends point-to-point, forward (activations)
  and backward (their gradients), against `predicted_boundary` (the planner's price: the boundary
  values' full bytes once per direction and micro-batch), within 10%. Around the transfers the
  runtime makes the value replicated on the sender's mesh (``fwd:<v>->send``), all-gathers the
  received pieces (``fwd:<v>->recv``), makes the receiver's gradient replicated
  (``bwd:<v>->recv``) and all-gathers its pieces on the sender (``bwd:<v>->send``): collectives the
  planner does not price, reported apart.

``pp2_dp2`` runs compiled (AOTAutograd; its buckets are launched after backward), ``pp2_dp2_full``
asks for compilation and runs eagerly (recomputed), ``pp2`` and ``pp2_tp2`` run eagerly: the
compiled graphs issue the eager collectives at the same sites (`tests/test_compiled.py`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import pytest
import single_device
import torch

from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
CLUSTER = "1x4xA100-80GB"
# nll_loss's total_weight (see tests/test_executor.py)
UNPRICED_SITES = ("bwd:nll_loss_forward",)
# our runner (`runtime.pipeline`) and torch.distributed.pipelining (`runtime.torch_pipeline`)
IMPLS = ("ours", "torch")


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    kw = {"global_batch": 8, "dtype": "float32", "allow_oom": True}
    return {
        "pp2": manual_plan(
            SPEC, "1x2xA100-80GB", dp=1, tp=1, pp=2, num_microbatches=2, **kw
        ),
        "pp2_tp2": manual_plan(
            SPEC, CLUSTER, dp=1, tp=2, pp=2, num_microbatches=2, **kw
        ),
        "pp2_dp2": manual_plan(
            SPEC, CLUSTER, dp=2, tp=1, pp=2, num_microbatches=2, **kw
        ),
        # recomputed (eager) stages: gradient buckets launched during backward, capped small
        # to make several per stage (`planner.inter.dp_overlap`)
        "pp2_dp2_full": _small_buckets(
            lambda: manual_plan(
                SPEC,
                CLUSTER,
                dp=2,
                tp=1,
                pp=2,
                num_microbatches=2,
                recompute="full",
                **kw,
            )
        ),
    }


#: a bucket cap that cuts each stage's gradients into several buckets
SMALL_CAP = 20000


def _small_buckets(make: Any) -> ParallelPlan:
    """`make()` with the gradient buckets capped at `SMALL_CAP` bytes."""
    from planner.inter import dp_overlap

    cap = dp_overlap.BUCKET_CAP_BYTES
    dp_overlap.BUCKET_CAP_BYTES = SMALL_CAP
    try:
        return make()
    finally:
        dp_overlap.BUCKET_CAP_BYTES = cap


def _count(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    """Body of every rank: per plan, one step under a CommCounter; the records and this rank's
    stage (None outside the plan)."""
    import logging

    from runtime.comm_count import CommCounter

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, plan in plans.items():
        for impl in IMPLS:
            torch.manual_seed(0)
            model, b = build_model(SPEC, batch=8, device="cpu")
            batch = _random_batches(tuple(b), 1, seed=1)[0]
            compile = name.startswith(
                "pp2_dp2"
            )  # the others eagerly (module docstring)
            tr = single_device.trainer(
                plan, model, batch, SPEC, lr=0.1, pipeline=impl, compile=compile
            )
            tr.step(batch)  # warm-up (process groups, caches)
            with CommCounter() as counter:
                tr.step(batch)
            out[name, impl] = {"stage": tr.runner.index, "records": counter.records}
    return out


@pytest.fixture(scope="module")
def all_runs() -> list[dict[str, Any]]:
    return launch(_count, 4, args=(_plans(),), timeout_s=300)


def _predicted(name: str, stage_index: int) -> dict[str, float]:
    """Priced intra-stage bytes per kind for one step."""
    from comm_check import as_run_on

    from cost_models.cluster import Cluster
    from cost_models.communication import LogicalMesh
    from planner.intra.priced_comm import predicted_collectives
    from planner.tracing.tracer import trace
    from runtime.stages import split_stages, stage_program

    plan = _plans()[name]
    B = plan.num_microbatches
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=plan.global_batch // B, device="cpu")
    graph = trace(model, b)
    st = split_stages(graph, plan)[stage_index]
    sp = plan.stages[stage_index]
    program = stage_program(st, sp)
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    params = st.graph.param_derived()
    out: dict[str, float] = defaultdict(float)
    for label, colls in predicted_collectives(st.graph, program, lmesh).items():
        once = label.startswith("bwd:") and label[4:].split("->")[0] in params
        for kind, nbytes in colls:
            out[as_run_on(kind, "cpu")] += nbytes * (1 if once else B)
    return dict(out)


@pytest.mark.parametrize("name", ["pp2_tp2", "pp2_dp2"])
def test_received_values_are_planned_as_priced(name: str) -> None:
    """The second stage plans its received value in the placement the (one, manual) solution
    gave its producer, the source of the consumers' edges it priced: ``S(0)`` on the
    data-parallel axis of ``pp2_dp2``, replicated on ``pp2_tp2``."""
    plan = _plans()[name]
    produced = plan.stages[0].node_strategies["add_4"]["outputs"][0]
    assert plan.stages[1].input_placements == {"add_4": produced}
    assert produced == (["S(0)", "R"] if name == "pp2_dp2" else ["R", "R"])


def _boundary(site: str) -> bool:
    return site.endswith(("->send", "->recv"))


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["pp2_tp2", "pp2_dp2"])
@pytest.mark.slow
def test_intra_stage_bytes_match_the_plan(
    all_runs: list[dict[str, Any]], name: str, impl: str, stage: int
) -> None:
    rank = _plans()[name].stages[stage].devices[0]
    run = all_runs[rank][name, impl]
    assert run["stage"] == stage
    measured: dict[str, float] = defaultdict(float)
    boundary: dict[str, float] = defaultdict(float)
    for r in run["records"]:
        if r.site in UNPRICED_SITES or r.kind in ("send", "recv"):
            continue
        (boundary if _boundary(r.site) else measured)[r.kind] += r.nbytes
    predicted = _predicted(name, stage)
    print(f"stage {stage}: predicted {predicted}, measured {dict(measured)}")
    print(f"  boundary: runtime's unpriced collectives {dict(boundary)}")
    assert set(predicted) == set(measured)
    for kind, p in predicted.items():
        assert measured[kind] == pytest.approx(p, rel=0.1), kind


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("name", ["pp2_dp2", "pp2_dp2_full"])
@pytest.mark.slow
def test_gradient_buckets_match_the_runtime(
    all_runs: list[dict[str, Any]], name: str, stage: int, impl: str
) -> None:
    """The gradient all-reduce buckets of the data-parallel plans: ``pp2_dp2`` (compiled
    stages: one bucket per stage, launched after backward) and ``pp2_dp2_full`` (recomputed,
    eager stages: several buckets per stage under `SMALL_CAP`, launched during backward): per
    bucket site (``bwd:sync:<its first parameter>``), the all-reduces
    the runtime issued in one step (`runtime.grad_overlap`) against the planner's price of its
    parameters' gradients (`predicted_collectives` of the edges leaving them and their views),
    one all-reduce per bucket and axis, as `planner.inter.dp_overlap` charges the latency."""
    from comm_check import as_run_on

    from cost_models.cluster import Cluster
    from cost_models.communication import LogicalMesh
    from planner.intra.priced_comm import predicted_collectives
    from planner.tracing.tracer import trace
    from runtime.stages import split_stages, stage_program

    plan = _plans()[name]
    sp = plan.stages[stage]
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=plan.global_batch // plan.num_microbatches)
    st = split_stages(trace(model, b), plan)[stage]
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    roots, paths = st.graph.param_roots(), st.graph.placeholder_paths
    per_param: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for label, colls in predicted_collectives(
        st.graph, stage_program(st, sp), lmesh
    ).items():
        u = label[4:].split("->")[0]
        if label.startswith("bwd:") and u in roots:
            for kind, nbytes in colls:
                per_param[paths[roots[u]]][as_run_on(kind, "cpu")] += nbytes
    priced = {}
    for bucket in sp.grad_buckets:  # one dtype and placement per bucket here
        site = f"bwd:sync:{bucket[0]}"
        priced[site] = {
            k: sum(per_param[p].get(k, 0.0) for p in bucket)
            for k in {k for p in bucket for k in per_param[p]}
        }
    measured: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    count: dict[str, int] = defaultdict(int)
    for r in all_runs[sp.devices[0]][name, impl]["records"]:
        if r.site.startswith("bwd:sync:"):
            measured[r.site][r.kind] += r.nbytes
            count[r.site] += 1
    print(f"stage {stage}: {len(sp.grad_buckets)} buckets, sites {dict(count)}")
    if name == "pp2_dp2_full":
        assert len(sp.grad_buckets) > 2
    else:
        assert len(sp.grad_buckets) == 1
    assert {k: dict(v) for k, v in measured.items()} == priced
    assert all(count[s] == 1 for s in priced)  # one all-reduce per bucket (one dp axis)


@pytest.mark.parametrize("name", ["pp2", "pp2_tp2"])
@pytest.mark.slow
def test_boundary_point_to_point_bytes_match_the_plan(
    all_runs: list[dict[str, Any]], name: str
) -> None:
    """Every rank's sends between stages, per direction, against the planner's price (10%)."""
    from comm_check import boundary_bytes, compare_boundary, predicted_boundary

    from planner.tracing.tracer import trace

    plan = _plans()[name]
    records = [rec for r in all_runs for rec in r[name, "ours"]["records"]]
    torch.manual_seed(0)
    model, b = build_model(
        SPEC, batch=plan.global_batch // plan.num_microbatches, device="cpu"
    )
    predicted = predicted_boundary(trace(model, b), plan)
    table, diffs = compare_boundary(predicted, records, rel=0.1)
    print(f"{name}: (priced, sent) bytes per direction {table}")
    assert diffs == []
    assert all(p > 0 for p, _ in table.values())
    # every byte sent was received
    assert boundary_bytes(records, "recv") == boundary_bytes(records, "send")


@pytest.mark.parametrize(
    "shape,n", [((4, 16, 64), 2), ((3, 5), 4), ((7,), 3), ((2, 3), 1)]
)
def test_boundary_pieces_rebuild_the_value(shape: tuple[int, ...], n: int) -> None:
    """`runtime.boundary.pieces`: n equal pieces (zero-padded) whose concatenation starts with the
    flattened value; a stage of one device rebuilds it from its single piece."""
    from runtime.boundary import assemble, empty_piece, piece_index, pieces

    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    parts = pieces(t, n)
    assert len(parts) == n
    assert all(p.shape == empty_piece(shape, t.dtype, n, t.device).shape for p in parts)
    flat = torch.cat(parts)
    assert torch.equal(flat[: t.numel()], t.reshape(-1))
    assert not flat[t.numel() :].any()
    if n == 1:
        assert torch.equal(assemble(parts[0], shape, None), t)
    assert [piece_index([5, 2, 9], r) for r in (2, 5, 9)] == [0, 1, 2]


@pytest.mark.parametrize("name", ["pp2", "pp2_tp2"])
@pytest.mark.slow
def test_torch_pipelining_sends_what_the_plan_priced(
    all_runs: list[dict[str, Any]], name: str
) -> None:
    """On torch.distributed.pipelining the sends are issued by PyTorch's schedule (no site tells
    forward from backward): every rank's point-to-point bytes of one step, both directions
    together, against the planner's price (10%). pp2 x tp2 sends each value in pieces over the
    tensor axis (`runtime.torch_pipeline.wire_placements`), not one copy per rank."""
    from comm_check import predicted_boundary

    from planner.tracing.tracer import trace

    plan = _plans()[name]
    records = [rec for r in all_runs for rec in r[name, "torch"]["records"]]
    torch.manual_seed(0)
    model, b = build_model(
        SPEC, batch=plan.global_batch // plan.num_microbatches, device="cpu"
    )
    priced = sum(predicted_boundary(trace(model, b), plan).values())
    sent = sum(r.nbytes for r in records if r.kind == "send")
    received = sum(r.nbytes for r in records if r.kind == "recv")
    print(f"{name} on torch pipelining: priced {priced:.0f} B, sent {sent:.0f} B")
    assert priced > 0
    assert sent == pytest.approx(priced, rel=0.1)
    assert received == sent
