"""Tensor and sequence parallelism with FSDP over the data-parallel axis (torchtitan's 2D), and an
FSDP weight planned whole while its consumer reads a slice of it: priced as they run.

One gloo launch of 4 ranks plays a 1x4xCPU cluster as a (2, 2) mesh (dp 2 x tp 2) and trains a
small Llama (hidden 64, 4 layers) under two plans, 2 micro-batches, Adam (lr 1e-3), 3 steps each:

* ``2d``: `meshplan manual --dp 2 --tp 2 --fsdp full --sp`: Megatron's placements on the tp axis,
  every weight FSDP-sharded over the dp axis;
* ``sliced``: the same with ``blocks.0.attn.q.weight`` planned whole (FSDP-sharded over both
  axes) while its consumer still reads its column-parallel slice, a program the intra-op ILP
  may pick for any weight: the slice's gradient is all-gathered on the tp axis to the
  parameter's `fsdp_gradient` before the reduce-scatter (`planner.intra.fsdp_prices`).

Checks, for each: losses and parameters against one device (1e-5); the collectives of one counted
step against the priced ones site by site (`predicted_collectives`); and those collectives'
seconds under the cluster's cost model against the plan's price of its communication (the
stage's resharding per micro-batch times the micro-batches, plus its per-iteration
synchronisation, where FSDP's collectives are), which the intra-op ILP's objective under-priced
for ``sliced`` before the solution's edges were priced as they run.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any

import pytest
import single_device
import torch
from profiles import cpu_cluster
from test_fsdp import BATCH, LR, SPEC, UNPRICED_SITES, B, _graph, _model_and_batches

from cost_models.communication import LogicalMesh
from planner.plans import manual
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch

SLICED = "blocks.0.attn.q.weight"
PLANS = ("2d", "sliced")


def _cluster() -> Any:
    return cpu_cluster(4)


def _plan(name: str) -> ParallelPlan:
    return _planned(name)[0]


@functools.cache
def _planned(name: str) -> tuple[ParallelPlan, Any]:
    """`manual_plan` of dp 2 x tp 2 with SP and FSDP, and its stage's intra-op solution; for
    ``sliced`` its parameter filter admits `SLICED` only planned whole (and FSDP-sharded over
    both axes)."""
    megatron, assemble = manual.axes_filter, manual.assemble
    solutions = []

    def kept(spec: Any) -> ParallelPlan:
        solutions.extend(s.solution for s in spec.stages)
        return assemble(spec)

    def axes_filter(*args: Any, **kw: Any) -> Any:
        allowed = megatron(*args, **kw)

        def sliced(path: str, option: Any) -> bool:
            if path != SLICED:
                return allowed(path, option)
            whole = all(p == "R" for p in option.strategy.output[0])
            return option.zero == 3 and option.shard_axes is None and whole

        return sliced

    manual.axes_filter = axes_filter if name == "sliced" else megatron
    manual.assemble = kept
    try:
        plan = manual.manual_plan(
            SPEC,
            _cluster(),
            dp=2,
            tp=2,
            pp=1,
            num_microbatches=B,
            global_batch=BATCH,
            dtype="float32",
            allow_oom=True,
            fsdp="full",
            sequence_parallel=True,
        )
    finally:
        manual.axes_filter, manual.assemble = megatron, assemble
    (solution,) = solutions
    return copy.deepcopy(plan), solution


def _train(plan: ParallelPlan) -> dict[str, Any]:
    """3 Adam steps, the second counted (with each collective's mesh axis)."""
    import logging

    from runtime.comm_count import CommCounter

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    model, batches = _model_and_batches()
    tr = single_device.trainer(plan, model, batches[0], SPEC, optimizer="adam", lr=LR)
    mesh = tr.runner.executor.mesh
    axis_of = {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}
    losses = [tr.step(batches[0])]
    with CommCounter(axis_of) as counter:
        losses.append(tr.step(batches[1]))
    losses.append(tr.step(batches[2]))
    tr.optimizer.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
        "records": counter.records,
        "axes": [axis_of.get(r.group) for r in counter.records],
    }


def _train_each(plans: dict[str, ParallelPlan]) -> dict[str, Any]:
    return {k: _train(p) for k, p in plans.items()}


@pytest.fixture(scope="module")
def launched() -> list[dict[str, Any]]:
    return launch(_train_each, 4, args=({k: _plan(k) for k in PLANS},), timeout_s=400)


@pytest.fixture(params=PLANS)
def case(request: Any, launched: list[dict[str, Any]]) -> tuple[str, list[dict]]:
    return request.param, [r[request.param] for r in launched]


def test_the_sliced_plan_reads_a_slice_of_a_whole_weight() -> None:
    """``sliced`` is what it says: its weight planned whole and FSDP-sharded, its view read as
    the column-parallel slice ``2d`` plans the weight as."""
    names = {p: n for n, p in _graph().placeholder_paths.items()}
    view = next(
        iter(
            _graph()
            .gm.graph.find_nodes(op="placeholder", target=names[SLICED])[0]
            .users
        )
    )
    whole, megatron = _plan("sliced").stages[0], _plan("2d").stages[0]
    assert whole.param_placements[SLICED] == ["R", "R"]
    assert megatron.param_placements[SLICED] == ["R", "S(0)"]
    assert SLICED in whole.fsdp_params and SLICED in megatron.fsdp_params
    reads = whole.node_strategies[view.name]["inputs"][0]
    assert reads == megatron.param_placements[SLICED]


@pytest.mark.slow
def test_trains_like_one_device(case: tuple[str, list[dict]]) -> None:
    _, runs = case
    model, batches = _model_and_batches()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    for r in runs:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got = {k: torch.from_numpy(v) for k, v in r["params"].items()}
        single_device.assert_same_parameters(got, ref_params)


@pytest.mark.slow
def test_communicates_what_was_priced(case: tuple[str, list[dict]]) -> None:
    """Site by site as test_fsdp; and the seconds of what ran, each collective priced on its
    mesh axis, equal the plan's price of its communication."""
    from comm_check import compare

    from planner.intra.priced_comm import predicted_collectives
    from runtime.stages import split_stages, stage_program

    name, runs = case
    plan = _plan(name)
    st, sp = split_stages(_graph(), plan)[0], plan.stages[0]
    lmesh = LogicalMesh(_cluster(), tuple(sp.submesh), tuple(sp.logical_mesh))
    once = predicted_collectives(st.graph, stage_program(st, sp), lmesh, sp.fsdp_params)
    predicted = {label: colls * B for label, colls in once.items()}
    if name == "sliced":  # the slice's gradient, all-gathered on the tp axis
        view_grad = [k for k in predicted if k.startswith("bwd:") and "->" in k]
        assert any(
            kind == "all_gather"
            for k in view_grad
            for kind, _ in predicted[k]
            if _graph().placeholder_paths.get(k[4:].split("->")[0]) == SLICED
        )
    sol = _planned(name)[1]
    priced = sol.comm_s * B + sol.grad_sync_s
    for r in runs:
        kept = [
            (x, axis)
            for x, axis in zip(r["records"], r["axes"])
            if x.site not in UNPRICED_SITES
        ]
        totals, diffs = compare(predicted, [x for x, _ in kept])
        assert not diffs, "\n".join(diffs[:10])
        assert totals["reduce_scatter"][0] > 0
        kinds = Counter(x.kind for x, _ in kept)
        seconds = sum(getattr(lmesh, x.kind)(x.nbytes, axis) for x, axis in kept)
        assert seconds == pytest.approx(priced, rel=1e-9), kinds
