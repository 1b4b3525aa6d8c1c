"""The zero-bubble pipeline schedule: priced (`cost_models.pipeline`, `cost_models.memory`,
`planner.inter.wgrad`) and run on torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``
(`runtime.torch_pipeline`).

Single process: the closed form against a simulation of the per-rank action order torch's
schedule itself emits (built with stand-in stage objects: the schedule computes every rank's order
from the group size and micro-batches alone), the micro-batches held against that order, and
zero bubble never slower than 1F1B in the model when weight gradients take time.

One gloo launch of 4 ranks trains a small Llama (hidden 64, 4 layers) under
``meshplan manual --dp 2 --pp 2 --schedule zero_bubble`` (4 micro-batches, Adam, 3 steps):
losses and parameters as one device (1e-5), torch's weight-gradient pass run once per micro-batch
on the second stage (the first runs its whole backward there: nothing waits for its input
gradient), and one step's communication as priced: every stage's collectives site by site
(`predicted_collectives`, the gradients' all-reduce once per step) and the point-to-point bytes
between the stages (`predicted_boundary`, 10%). As tests/test_runtime_comm.py, the collectives
that rebuild a boundary value from its pieces (``->send`` / ``->recv`` sites) are left out; the
stage programs priced are the plan's (`stage_program`: a received value in the placement the
stage's solution priced its edges from, ``StagePlan.input_placements``).
"""

from __future__ import annotations

import functools
import itertools
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import single_device
import torch
from profiles import cpu_cluster
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from cost_models.errors import MeshplanError
from cost_models.memory import microbatches_in_flight, weight_grads_pending
from cost_models.pipeline import pipeline_time
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.train import _random_batches

SPEC = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
STEPS, LR, BATCH, B = 3, 1e-3, 8, 4
UNPRICED_SITES = ("bwd:nll_loss_forward", "bwd:embedding")  # test_fsdp's


# ------------------------------------------------------------------ the price


def _torch_orders(p: int, n: int) -> dict[int, list[tuple[str, int]]]:
    """Every rank's (kind, micro-batch) compute actions in torch's zero-bubble schedule of p
    stages (one per rank) and n micro-batches: kind F, I (input gradient) or W."""
    stage = SimpleNamespace(
        num_stages=p,
        group_size=p,
        group_rank=0,
        stage_index=0,
        submod=torch.nn.Module(),
    )
    sched = ScheduleInterleavedZeroBubble([stage], n, loss_fn=lambda y, t: y)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    return {
        r: [(kinds[a.computation_type.name], a.microbatch_index) for a in acts if a]
        for r, acts in sched.pipeline_order.items()
    }


def _simulate(orders: dict, f: list, b: list, w: list, s: list | None = None) -> float:
    """Makespan of the orders: each rank runs its actions in order, an action starting when its
    rank is free and its input has arrived (F after the previous stage's F, I after the next
    stage's I - the last stage's after its own F - plus half the link's round trip)."""
    p = len(orders)
    s = s or [0.0] * (p - 1)
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * p, [0.0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                k, m = orders[r][pos[r]]
                if k == "F":
                    dep = [] if r == 0 else [(("F", r - 1, m), s[r - 1] / 2)]
                elif k == "I":
                    last = r == p - 1
                    dep = (
                        [(("F", r, m), 0.0)] if last else [(("I", r + 1, m), s[r] / 2)]
                    )
                else:
                    dep = [(("I", r, m), 0.0)]
                if not all(a in done for a, _ in dep):
                    break
                start = max([free[r]] + [done[a] + d for a, d in dep])
                free[r] = start + {"F": f, "I": b, "W": w}[k][r]
                done[k, r, m] = free[r]
                pos[r] += 1
                moved = True
        assert moved, "the orders deadlock"
    return max(free)


def _valid(p: int, n: int) -> bool:
    return n >= p and n % (n // p) == 0


def test_closed_form_equals_torchs_order_for_equal_stages() -> None:
    """Equal stages, no sends: `pipeline_time` is the simulated makespan of torch's own order,
    also when the first stage runs its whole backward in W as torch does (nothing waits for its
    input gradient; it defers no W, so I and W run back to back)."""
    for p, n in itertools.product(range(2, 6), range(2, 13)):
        if not _valid(p, n):
            continue
        orders = _torch_orders(p, n)
        for f, b, w in itertools.product((1.0, 2.0), (1.0, 3.0), (0.0, 0.5, 1.0, 2.5)):
            priced = pipeline_time(
                [f + b + w] * p, n, "zero_bubble",
                forward_times=[f] * p, weight_times=[w] * p,
            )  # fmt: skip
            assert priced == pytest.approx(_simulate(orders, [f] * p, [b] * p, [w] * p))
            torch_split = _simulate(
                orders, [f] * p, [0.0] + [b] * (p - 1), [b + w] + [w] * (p - 1)
            )
            assert priced == pytest.approx(torch_split)


def test_closed_form_against_simulation_of_unequal_stages() -> None:
    """Unequal stages and sends: within the docstring's -6%..+14% of the simulated makespan,
    never below it with equal stages and equal sends."""
    rng = random.Random(0)
    for _ in range(150):
        p = rng.choice((2, 3, 4, 6))
        n = p * rng.choice((1, 2, 3, 4))
        f = [rng.uniform(0.7, 1.3) for _ in range(p)]
        b = [rng.uniform(0.7, 1.3) * rng.choice((1, 2)) for _ in range(p)]
        w = [rng.uniform(0.3, 1.2) * x for x in b]
        s = [rng.uniform(0.0, 0.4) for _ in range(p - 1)]
        t = [x + y + z for x, y, z in zip(f, b, w)]
        priced = pipeline_time(
            t, n, "zb", send_times=s, forward_times=f, weight_times=w
        )
        ratio = priced / _simulate(_torch_orders(p, n), f, b, w, s)
        assert 0.94 <= ratio <= 1.14
        eq = pipeline_time(
            [t[0]] * p, n, "zero_bubble", send_times=[s[0]] * (p - 1),
            forward_times=[f[0]] * p, weight_times=[w[0]] * p,
        )  # fmt: skip
        sim = _simulate(
            _torch_orders(p, n), [f[0]] * p, [b[0]] * p, [w[0]] * p, [s[0]] * (p - 1)
        )
        assert eq >= sim - 1e-9


def test_zero_bubble_is_faster_than_1f1b_when_w_takes_time() -> None:
    rng = random.Random(1)
    for _ in range(200):
        p = rng.choice((2, 3, 4, 8))
        n = p * rng.choice((1, 2, 4))
        f = [rng.uniform(0.2, 2.0) for _ in range(p)]
        w = [rng.uniform(0.01, 2.0) for _ in range(p)]
        t = [x + y + rng.uniform(0.0, 2.0) for x, y in zip(f, w)]
        s = [rng.uniform(0.0, 1.0) for _ in range(p - 1)] if rng.random() < 0.5 else []
        zb = pipeline_time(
            t, n, "zero_bubble", send_times=s, forward_times=f, weight_times=w
        )
        assert zb < pipeline_time(t, n, "1f1b", send_times=s)
    # without a weight gradient the hop costs a whole stage: 1F1B's price
    assert pipeline_time([3.0, 3.0], 4, "zero_bubble", forward_times=[1.0, 1.0]) == 15.0


def test_micro_batches_held_follow_torchs_order() -> None:
    """A micro-batch's activations (a bytes) live from its F to its W, the output gradients its
    I keeps for W (d bytes) from its I to its W: the peak of what a rank holds along torch's
    order is `microbatches_in_flight` activation sets and `weight_grads_pending` gradient sets,
    on every rank, for activations much larger than the gradients and for the reverse."""
    for p, n in itertools.product(range(2, 6), range(2, 13)):
        if not _valid(p, n):
            continue
        for r, order in _torch_orders(p, n).items():
            for a, d in ((1.0, 0.01), (0.01, 1.0)):
                acts = grads = peak = 0
                for k, _ in order:
                    acts += k == "F"
                    grads += k == "I"
                    if k == "W":
                        peak = max(peak, acts * a + grads * d)
                        acts, grads = acts - 1, grads - 1
                    peak = max(peak, acts * a + grads * d)
                want = (
                    microbatches_in_flight("zero_bubble", n, p, r) * a
                    + weight_grads_pending("zero_bubble", n, p, r) * d
                )
                assert peak == pytest.approx(want)
                assert microbatches_in_flight("zero_bubble", n, p, r) == min(n, p)
    assert weight_grads_pending("1f1b", 8, 4, 3) == 0


def test_bad_input_is_named() -> None:
    with pytest.raises(MeshplanError, match="at least as many micro-batches"):
        pipeline_time([1.0] * 4, 2, "zero_bubble")
    with pytest.raises(MeshplanError, match="rounds"):
        pipeline_time([1.0] * 4, 9, "zero_bubble")
    with pytest.raises(MeshplanError, match="exceed its time"):
        pipeline_time(
            [1.0, 1.0], 2, "zb", forward_times=[0.6, 0.6], weight_times=[0.6, 0.1]
        )
    with pytest.raises(MeshplanError, match="only for the zero_bubble"):
        pipeline_time([1.0, 1.0], 2, "1f1b", weight_times=[0.1, 0.1])
    with pytest.raises(MeshplanError, match="without recomputation and FSDP"):
        manual_plan(
            SPEC, cpu_cluster(2), dp=1, tp=1, pp=2, num_microbatches=2, global_batch=4,
            dtype="float32", recompute="full", schedule="zero_bubble",
        )  # fmt: skip


def _brute(cost: np.ndarray, sizes: list[int], D: int, B: int) -> float:
    """Every layer partition and submesh assignment, each stage of an S-stage pipeline priced at
    ``cost[..., S]`` (zero bubble's in-flight count depends on S only)."""
    L, best = cost.shape[0], np.inf
    for n in range(min(L, cost.shape[3] - 1)):
        for cuts in itertools.combinations(range(1, L), n):
            bounds = [0, *cuts, L]
            ranges = list(zip(bounds[:-1], (b - 1 for b in bounds[1:])))
            for subs in itertools.product(range(len(sizes)), repeat=len(ranges)):
                if sum(sizes[m] for m in subs) == D:
                    t = [cost[k, j, m, len(ranges)] for (k, j), m in zip(ranges, subs)]
                    best = min(best, sum(t) + (B - 1) * max(t))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_stage_dp_by_total_matches_brute_force(seed: int) -> None:
    """The stage DP of a zero-bubble search (`stage_dp(by_total=True)`) against brute force."""
    from planner.inter.stage_dp import stage_dp

    rng = np.random.default_rng(seed)
    L, sizes, D, B = int(rng.integers(2, 6)), [1, 2, 4], int(rng.choice([2, 4])), 6
    cost = np.full((L, L, 3, min(L, D) + 1), np.inf)
    for k, j, m, n in itertools.product(
        range(L), range(L), range(3), range(1, cost.shape[3])
    ):
        if (
            j >= k and rng.uniform() > 0.2
        ):  # the larger n, the more memory: some do not fit
            cost[k, j, m, n] = (j - k + 1) * rng.uniform(1, 2) / sizes[m] ** 0.8
    want = _brute(cost, sizes, D, B)
    got = stage_dp(cost, sizes, D, B, by_total=True)
    assert got.latency == pytest.approx(want, rel=1e-12)
    S = len(got.stages)
    t = [cost[k, j, m, S] for k, j, m in got.stages]
    assert sum(t) + (B - 1) * max(t) == pytest.approx(got.latency)


def test_manual_plan_prices_the_split() -> None:
    """The stages' weight-gradient products come from the traced matmuls reading a weight, and
    zero bubble is priced below 1F1B with the same stages."""
    zb, one = _plan(), _plan("1f1b")
    assert zb.schedule == "zero_bubble"
    assert zb.estimate.iteration_time_s < one.estimate.iteration_time_s
    assert [s.layers for s in zb.stages] == [s.layers for s in one.stages]
    # the second stage holds 2 activation sets (1F1B: 1) and 2 deferred output gradients
    assert zb.estimate.peak_memory_bytes > one.estimate.peak_memory_bytes


# ------------------------------------------------------------------ runtime


@functools.cache
def _plan(schedule: str = "zero_bubble") -> ParallelPlan:
    return manual_plan(
        SPEC, cpu_cluster(4), dp=2, tp=1, pp=2, num_microbatches=B,
        global_batch=BATCH, dtype="float32", allow_oom=True, schedule=schedule,
    )  # fmt: skip


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


def _train(plan: ParallelPlan) -> dict[str, Any]:
    """Body of every rank: 3 Adam steps (the second counted), torch's weight passes counted."""
    import logging

    import torch.distributed.pipelining.stage as pstage

    from runtime.comm_count import CommCounter
    from runtime.train import Trainer

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    weight_passes = []
    real = pstage.stage_backward_weight

    def counted(*args: Any, **kw: Any) -> Any:
        weight_passes.append(1)
        return real(*args, **kw)

    pstage.stage_backward_weight = counted
    model, batches = _model_and_batches()
    tr = Trainer(plan, model, batches[0], optimizer="adam", lr=LR)
    runner = tr.runner
    losses = [tr.step(batches[0])]
    with CommCounter() as counter:
        losses.append(tr.step(batches[1]))
    losses.append(tr.step(batches[2]))
    pstage.stage_backward_weight = real
    return {
        "schedule": type(runner.pipeline_schedule).__name__,
        "stage": runner.index,
        "compiled": [ex.last_run_compiled for ex in runner.executors.values()],
        "weight_passes": len(weight_passes),
        "losses": losses,
        "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
        "records": counter.records,
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train, 4, args=(_plan(),), timeout_s=400)


@pytest.mark.slow
def test_zero_bubble_trains_like_one_device(runs: list[dict[str, Any]]) -> None:
    model, batches = _model_and_batches()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    ref_losses, ref_params = single_device.train(model, batches, opt)
    union: dict[str, torch.Tensor] = {}
    for r in runs:
        assert r["schedule"] == "ScheduleInterleavedZeroBubble"
        assert not any(r["compiled"])  # eager: one autograd node per op, split by torch
        # the second stage splits its backward: one weight pass per micro-batch and step
        assert r["weight_passes"] == (STEPS * B if r["stage"] == 1 else 0)
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got = {k: torch.from_numpy(v) for k, v in r["params"].items()}
        single_device.assert_same_parameters(got, {k: ref_params[k] for k in got})
        union.update(got)
    single_device.assert_same_parameters(union, ref_params)


@pytest.mark.slow
def test_zero_bubble_communicates_what_was_priced(runs: list[dict[str, Any]]) -> None:
    """Per stage: every priced collective of the micro-batches site by site (`compare`); the
    parameters' gradient all-reduces, priced per edge once per step, against the runtime's
    bucketed synchronisation (``bwd:sync:*``): the same bytes in as many all-reduces as
    `grad_buckets` prices. Between the stages: the point-to-point bytes torch's schedule sends
    against `predicted_boundary` (10%, as tests/test_runtime_comm.py)."""
    from comm_check import as_run_on, compare, predicted_boundary

    from cost_models.communication import LogicalMesh
    from planner.intra.priced_comm import predicted_collectives
    from planner.intra.prices import Option, grad_buckets
    from runtime.stages import split_stages, stage_program

    plan, graph = _plan(), _graph()
    for st, sp in zip(split_stages(graph, plan), plan.stages):
        lmesh = LogicalMesh(cpu_cluster(4), tuple(sp.submesh), tuple(sp.logical_mesh))
        params = st.graph.param_derived()
        program = stage_program(st, sp)
        per_mb, synced = {}, 0.0
        for label, colls in predicted_collectives(st.graph, program, lmesh).items():
            if label.startswith("bwd:") and label[4:].split("->")[0] in params:
                synced += sum(
                    b for k, b in colls if as_run_on(k, "cpu") == "all_reduce"
                )
            else:
                per_mb[label] = colls * B
        choice = {n: Option(s) for n, s in program.strategies.items()}
        buckets = grad_buckets(st.graph, choice, lmesh, params)
        for r in (r for r in runs if r["stage"] == st.index):
            measured = [
                x for x in r["records"]
                if x.site not in UNPRICED_SITES and x.kind not in ("send", "recv")
                and not x.site.endswith(("->send", "->recv"))
            ]  # fmt: skip
            sync = [x for x in measured if x.site.startswith("bwd:sync:")]
            rest = [x for x in measured if not x.site.startswith("bwd:sync:")]
            _, diffs = compare(per_mb, rest)
            assert not diffs, "\n".join(diffs[:10])
            assert synced > 0 and {x.kind for x in sync} == {"all_reduce"}
            assert sum(x.nbytes for x in sync) == pytest.approx(synced)
            assert len(sync) == sum(len(axes) for axes, _, _ in buckets)
    priced = sum(predicted_boundary(graph, plan).values())
    records = [x for r in runs for x in r["records"]]
    sent = sum(x.nbytes for x in records if x.kind == "send")
    assert priced > 0 and sent == pytest.approx(priced, rel=0.1)
    assert sum(x.nbytes for x in records if x.kind == "recv") == sent
