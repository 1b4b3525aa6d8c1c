"""One training step of a pipeline x tensor plan communicates what the plan priced.

GPT (hidden 64, 4 layers), global batch 8, 2 micro-batches, 2 stages of 2 devices with Megatron
tensor parallelism inside each (one gloo launch of 4 ranks). Every rank counts the collectives of
one `Trainer.step` (`runtime.comm_count.CommCounter`). Per stage, the prediction is the stage's
intra-stage edges (`predicted_collectives` on `runtime.stages.stage_solution`) times the number
of micro-batches, except the gradients of parameters (edges leaving parameters or their views),
synchronised once per step. Stage-boundary transfers are reported separately: the planner prices
them as point-to-point sends of the boundary activation. The plan's stages have equal submeshes, so
it runs on torch.distributed.pipelining (`runtime.torch_pipeline`), which sends each rank's local
shard in the placement its reader needs (a collective ``fwd:<v>->send`` only where the producer's
placement differs); our own runner (`runtime.pipeline`) would first make the value replicated
(``fwd:<v>->send``) and the receiver's gradient replicated (``bwd:<v>->recv``), collectives the
planner does not price.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import pytest
import torch

from planner.manual import manual_plan
from planner.models import build_model
from planner.plan_format import ParallelPlan
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
CLUSTER = "1x4xA100-80GB"
# the loss all-reduce and nll_loss's total_weight (see tests/test_executor.py)
UNPRICED_SITES = ("fwd:output", "bwd:nll_loss_forward")


@functools.cache
def _plan() -> ParallelPlan:
    return manual_plan(
        SPEC,
        CLUSTER,
        dp=1,
        tp=2,
        pp=2,
        num_microbatches=2,
        global_batch=8,
        dtype="float32",
        allow_oom=True,
    )


def _count(plan: ParallelPlan) -> dict[str, Any]:
    """Body of every rank: one step under a CommCounter; the records and this rank's stage."""
    import logging

    from runtime.comm_count import CommCounter
    from runtime.train import Trainer

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=8, device="cpu")
    batch = _random_batches(tuple(b), 1, seed=1)[0]
    tr = Trainer(plan, model, batch, lr=0.1)
    tr.step(batch)  # warm-up (process groups, caches)
    with CommCounter() as counter:
        tr.step(batch)
    return {"stage": tr.runner.index, "records": counter.records}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_count, 4, args=(_plan(),), timeout_s=300)


def _predicted(stage_index: int) -> tuple[dict[str, float], float]:
    """Priced intra-stage bytes per kind for one step, and the boundary activations' bytes sent
    point-to-point by this stage (per micro-batch, forward)."""
    from cost_models.cluster import Cluster
    from cost_models.communication import LogicalMesh
    from planner.tracer import trace
    from runtime.comm_count import as_run_on, predicted_collectives
    from runtime.executor import param_derived
    from runtime.stages import split_stages, stage_solution

    plan = _plan()
    B = plan.num_microbatches
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=plan.global_batch // B, device="cpu")
    graph = trace(model, b)
    st = split_stages(graph, plan)[stage_index]
    sp = plan.stages[stage_index]
    sol = stage_solution(st, sp)
    lmesh = LogicalMesh(
        Cluster.from_spec(CLUSTER), tuple(sp.submesh), tuple(sp.logical_mesh)
    )
    params = param_derived(st.graph)
    out: dict[str, float] = defaultdict(float)
    for label, colls in predicted_collectives(st.graph, sol, lmesh).items():
        once = label.startswith("bwd:") and label[4:].split("->")[0] in params
        for kind, nbytes in colls:
            out[as_run_on(kind, "cpu")] += nbytes * (1 if once else B)
    sent = sum(st.meta(v).outputs[0].nbytes for v in st.outputs)
    return dict(out), sent


def _boundary(site: str) -> bool:
    return site.endswith(("->send", "->recv"))


@pytest.mark.parametrize("stage", [0, 1])
def test_intra_stage_bytes_match_the_plan(
    runs: list[dict[str, Any]], stage: int
) -> None:
    rank = _plan().stages[stage].devices[0]
    assert runs[rank]["stage"] == stage
    measured: dict[str, float] = defaultdict(float)
    boundary: dict[str, float] = defaultdict(float)
    for r in runs[rank]["records"]:
        if r.site in UNPRICED_SITES:
            continue
        (boundary if _boundary(r.site) else measured)[r.kind] += r.nbytes
    predicted, sent = _predicted(stage)
    print(f"stage {stage}: predicted {predicted}, measured {dict(measured)}")
    print(
        f"  boundary: priced p2p {sent * _plan().num_microbatches} B/step forward; "
        f"runtime's extra collectives {dict(boundary)}"
    )
    assert set(predicted) == set(measured)
    for kind, p in predicted.items():
        assert measured[kind] == pytest.approx(p, rel=0.1), kind
