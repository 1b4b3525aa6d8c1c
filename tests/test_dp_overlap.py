"""The data-parallel gradient all-reduce overlapping backward (`planner.inter.dp_overlap`).

* the exposed-time formula against an explicit timeline: backward ops running one after another
  on the compute stream, each bucket launched when the op that completes its last gradient
  ends, the all-reduces one after another on the communication stream (integer durations, so
  the simulation is exact), random cases;
* the buckets follow DDP's rule: the same cuts as torch's own
  ``torch.distributed._compute_bucket_assignment_by_size``;
* a small Llama under data parallelism (dp4, recomputation: eager stages): the buckets cover
  every gradient the stage all-reduces, in readiness order, and the overlap lowers the plan's
  predicted iteration time exactly by the hidden part; compiled stages (no recomputation) hide
  nothing. Manual and automatic plans price it in one place (`planner.plans.assemble.dp_sync`);
  the automatic plan of tests/test_llama.py trains with the buckets its plan records.

The runtime's side (buckets launched during backward, counted against the price per site,
single-device numerics) is in tests/test_runtime_comm.py and tests/test_llama.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from planner.inter import dp_overlap
from planner.inter.dp_overlap import GradItem, exposed_seconds, form_buckets
from planner.plans.manual import manual_plan

SPEC = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
CLUSTER = "1x4xA100-80GB"


def _simulate(ops: list[int], ready: list[int], comm: list[int]) -> tuple[int, int]:
    """Tick by tick: the backward runs `ops` (durations, in backward order) on the compute
    stream; bucket b is launched when op ``ready[b]`` (an index into `ops`, ascending) has
    ended; the communication stream runs the launched buckets in order, one at a time.
    Returns (end of backward, end of the last all-reduce)."""
    op_end, t = [], 0
    for d in ops:
        t += d
        op_end.append(t)
    launch = [op_end[r] for r in ready]
    tick, nxt, current, left, finish = 0, 0, None, 0, 0
    while nxt < len(comm) or current is not None:
        # during [tick, tick + 1): an idle stream starts the next bucket if it was launched
        if current is None and launch[nxt] <= tick:
            current, left, nxt = nxt, comm[nxt], nxt + 1
        if current is not None:
            left -= 1
            if left == 0:
                current, finish = None, tick + 1
        tick += 1
    return op_end[-1], finish


def test_exposed_time_matches_a_simulated_timeline() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n_ops = rng.randint(1, 12)
        ops = [rng.randint(0, 9) for _ in range(n_ops)]
        if sum(ops) == 0:
            ops[-1] = 1
        n = rng.randint(1, 6)
        ready = sorted(rng.randrange(n_ops) for _ in range(n - 1)) + [n_ops - 1]
        comm = [rng.randint(1, 15) for _ in range(n)]
        end, last = _simulate(ops, ready, comm)
        launch = [sum(ops[: r + 1]) for r in ready]
        want = max(0, last - end)
        assert exposed_seconds(launch, comm, end) == want, (ops, ready, comm)
    # everything launched at the end: nothing hidden
    assert exposed_seconds([5.0, 5.0], [2.0, 3.0], 5.0) == 5.0
    # a bucket launched early hides behind the rest of the backward
    assert exposed_seconds([1.0, 5.0], [3.0, 1.0], 5.0) == 1.0


def test_buckets_are_cut_as_ddp_cuts_them() -> None:
    rng = random.Random(1)
    for _ in range(50):
        sizes = [rng.randint(1, 400) for _ in range(rng.randint(1, 20))]
        cap = rng.choice([256, 1000, 4096])
        items = [GradItem(str(i), 0, 4.0 * s, (), 0.0) for i, s in enumerate(sizes)]
        ours = [[int(it.path) for it in b] for b in form_buckets(items, cap)]
        theirs, _ = dist._compute_bucket_assignment_by_size(
            [torch.empty(s) for s in sizes], [cap]
        )
        assert ours == theirs


def _plan_and_syncs(recompute: str, monkeypatch: pytest.MonkeyPatch, **kw):
    """A dp4 manual plan of the small Llama and the `DpSync` of each of its stages."""
    syncs = []
    real = dp_overlap.stage_dp_sync

    def recording(*a, **k):
        syncs.append(real(*a, **k))
        return syncs[-1]

    monkeypatch.setattr("planner.plans.assemble.stage_dp_sync", recording)
    plan = manual_plan(
        SPEC,
        CLUSTER,
        dp=4,
        tp=1,
        pp=1,
        num_microbatches=2,
        global_batch=8,
        dtype="float32",
        allow_oom=True,
        recompute=recompute,
        **kw,
    )
    return plan, syncs


def test_overlap_lowers_the_predicted_time_by_the_hidden_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dp_overlap, "BUCKET_CAP_BYTES", 20000)
    plan, syncs = _plan_and_syncs("full", monkeypatch)
    (sync,) = syncs[-1:]  # the manual stage's (recorded last: its time is re-priced)
    assert sync.overlapped and len(sync.buckets) > 2
    assert list(sync.buckets) == [tuple(b) for b in plan.stages[0].grad_buckets]
    # every bucketed gradient once, latest-ready first
    bucketed = [p for b in sync.buckets for p in b]
    assert len(bucketed) == len(set(bucketed)) == len(plan.stages[0].param_placements)
    assert bucketed[0] == "lm_head.weight" and bucketed[-1] == "wte.weight"
    assert list(sync.launch_s) == sorted(sync.launch_s)
    assert sync.launch_s[-1] == pytest.approx(sync.backward_s)
    assert sync.exposed_s >= sync.comm_s[-1] > 0
    assert 0 < sync.hidden_s < sum(sync.comm_s)
    assert sync.hidden_s + sync.exposed_s == pytest.approx(sum(sync.comm_s))

    # the same buckets, all exposed: one stage of B micro-batches runs B stage times, each
    # lowered by hidden / B
    monkeypatch.setattr(dp_overlap, "exposed_seconds", lambda t, comm, T: sum(comm))
    exposed, syncs = _plan_and_syncs("full", monkeypatch)
    assert syncs[-1].hidden_s == 0.0 and syncs[-1].buckets == sync.buckets
    saved = exposed.estimate.iteration_time_s - plan.estimate.iteration_time_s
    assert saved == pytest.approx(sync.hidden_s, rel=1e-9)
    # against the stage table's price (one bucket, exposed): the hidden part less the latency
    # of the extra buckets
    monkeypatch.setattr(dp_overlap, "overlaps", lambda *a: False)
    table, syncs = _plan_and_syncs("full", monkeypatch)
    assert len(syncs[-1].buckets) == 1 and syncs[-1].adjust_s == 0.0
    saved = table.estimate.iteration_time_s - plan.estimate.iteration_time_s
    assert saved == pytest.approx(sync.hidden_s - sync.extra_latency_s, rel=1e-9)
    assert saved > 0


def test_compiled_stages_hide_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without recomputation the runtime compiles the stage (`runtime.compiled`): its gradients
    are all complete after the backward, so they make one bucket whatever the cap, exposed in
    full, priced as the stage table already prices it."""
    monkeypatch.setattr(dp_overlap, "BUCKET_CAP_BYTES", 20000)
    plan, syncs = _plan_and_syncs("none", monkeypatch)
    sync = syncs[-1]
    assert not sync.overlapped and sync.hidden_s == 0.0
    assert sync.exposed_s == pytest.approx(sum(sync.comm_s))
    assert len(sync.buckets) == 1 and sync.adjust_s == 0.0
    assert plan.stages[0].grad_buckets == [list(sync.buckets[0])]
