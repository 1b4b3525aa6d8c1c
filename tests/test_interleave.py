"""planner.inter.interleave: interleaved 1F1B in the automatic search.

* `balanced_cut` is exact against brute force on small random instances (least largest chunk,
  then least sum of squares among those cuts), for every chunk count at once
  (`balanced_cuts`, one min-max DP shared by the counts) and for each alone;
* on a pipeline-bound case (a GPT with hidden 4096 on four single-device hosts, 4 micro-batches)
  interleaving wins in the cost model, and the automatic plan (schedule "auto", the default) is at
  least as fast as the manual interleaved plan of the same mesh, within that plan's memory; with
  the schedule pinned to "1f1b" it is not interleaved and slower;
* the search's bound (candidates cut in increasing order of their lower bound, stopping above
  the K-th kept) keeps exactly what cutting every candidate keeps, and cuts fewer.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cost_models.errors import MeshplanError
from planner import plan
from planner.inter import interleave, mesh_search
from planner.inter.interleave import balanced_cut, balanced_cuts
from planner.plans.manual import manual_plan


def _brute(cost: np.ndarray, C: int) -> tuple[float, float] | None:
    L = cost.shape[0]
    best = None
    for inner in itertools.combinations(range(1, L), C - 1):
        ends = [0, *inner, L]
        t = [cost[a, b - 1] for a, b in itertools.pairwise(ends)]
        if not np.isfinite(t).all():
            continue
        key = (max(t), sum(x * x for x in t))
        best = key if best is None or key < best else best
    return best


def test_balanced_cut_is_exact() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        L = int(rng.integers(1, 8))
        layer = rng.integers(1, 6, size=L).astype(float)
        prefix = np.concatenate([[0.0], np.cumsum(layer)])
        cost = prefix[None, 1:] - prefix[:-1, None] + rng.integers(0, 3, size=(L, L))
        if trial % 3 == 0:  # some ranges do not fit
            cost[rng.random((L, L)) < 0.3] = np.inf
        counts = list(range(1, L + 2))  # L + 1 chunks: none
        tops: dict[int, float] = {}
        skip = set(counts[1::2])

        def wanted(C: int, top: float, tops: dict = tops, skip: set = skip) -> bool:
            tops[C] = top
            return C not in skip

        asked = balanced_cuts(cost, counts, wanted)
        for C, cuts, got in zip(counts, balanced_cuts(cost, counts), asked):
            assert cuts == balanced_cut(cost, C)
            # `wanted` sees the least largest chunk; a count it declines gets no cut
            assert got == (None if C in skip else cuts)
            if cuts is not None:
                assert tops[C] == max(cost[k, j] for k, j in cuts)
            want = _brute(cost, C) if C <= L else None
            if want is None:
                assert cuts is None
                continue
            assert len(cuts) == C and cuts[0][0] == 0 and cuts[-1][1] == L - 1
            assert all(
                b[0] == a[1] + 1 and b[0] <= b[1] for a, b in itertools.pairwise(cuts)
            )
            t = [cost[k, j] for k, j in cuts]
            assert (max(t), sum(x * x for x in t)) == pytest.approx(want, rel=1e-12)
    assert balanced_cut(np.ones((3, 3)), 4) is None
    with pytest.raises(ValueError, match="must increase"):
        balanced_cuts(np.ones((3, 3)), [2, 1])


MODEL = "gpt:hidden=4096,layers=16,heads=32,seq=1024,vocab=16384"
CLUSTER, G, B = "4x1xA100-80GB", 8, 4


def test_auto_plan_beats_manual_interleaved() -> None:
    manual = manual_plan(
        MODEL,
        CLUSTER,
        dp=1,
        tp=1,
        pp=4,
        num_microbatches=B,
        global_batch=G,
        virtual_stages=2,
    )
    plain = manual_plan(
        MODEL, CLUSTER, dp=1, tp=1, pp=4, num_microbatches=B, global_batch=G
    )
    # interleaving wins here in the cost model
    assert manual.estimate.iteration_time_s < plain.estimate.iteration_time_s
    budget = manual.estimate.peak_memory_bytes * (1 + 1e-6)
    kw = {"global_batch": G, "microbatch_size": [G // B], "memory_budget": budget}
    auto = plan(MODEL, CLUSTER, **kw)
    assert auto.schedule == "interleaved" and auto.virtual_stages > 1
    assert len(auto.stages) % auto.virtual_stages == 0
    assert auto.estimate.peak_memory_bytes <= budget
    assert auto.estimate.iteration_time_s <= manual.estimate.iteration_time_s * (
        1 + 1e-9
    )
    pinned = plan(MODEL, CLUSTER, schedule="1f1b", **kw)
    assert pinned.schedule == "1f1b" and pinned.virtual_stages == 1
    assert auto.estimate.iteration_time_s < pinned.estimate.iteration_time_s


def test_schedule_errors() -> None:
    with pytest.raises(
        MeshplanError, match="interleaved schedule needs pipeline stages"
    ):
        plan(MODEL, CLUSTER, global_batch=G, schedule="interleaved", mode="intra-only")
    with pytest.raises(MeshplanError, match="unknown pipeline schedule"):
        plan(MODEL, CLUSTER, global_batch=G, schedule="round-robin")


def test_bounded_search_keeps_what_cutting_everything_keeps(monkeypatch) -> None:
    """`InterleavedSearch.best` cuts candidates in increasing order of their lower bound and
    stops at the first above the K-th kept time, and skips a chunk count's sum DP where B times
    its largest chunk already reaches that time: it keeps exactly the options (times, chunks,
    submeshes, v, recomputation) of cutting every candidate at every count, cuts fewer
    candidates, and runs fewer sum DPs than cutting the same candidates at every count (on
    2x8 A100s, where some count's largest chunk already loses)."""
    seen = []
    sums = [0]  # sum DPs run so far
    least_squares, cuts_of = interleave._least_squares, interleave.balanced_cuts

    def counted(*args):
        sums[0] += 1
        return least_squares(*args)

    monkeypatch.setattr(interleave, "_least_squares", counted)

    class Both(interleave.InterleavedSearch):
        def again(self, entries: list, every_count: bool) -> tuple[list, int]:
            """The search over `entries` afresh, every count cut where `every_count` (no
            `wanted`); its options and sum DPs."""
            self._pending, self._kept, start = entries, [], sums[0]
            with monkeypatch.context() as m:
                if every_count:
                    m.setattr(
                        interleave, "balanced_cuts", lambda c, n, w=None: cuts_of(c, n)
                    )
                return super().best(), sums[0] - start

        def best(self):
            entries, cut = list(self._pending), []
            self._cut = lambda e, f=self._cut: (cut.append(e), f(e))
            bounded, bounded_sums = self.again(entries, False)
            cut_bounded = len(cut)
            # the same candidates, every chunk count cut
            counts, counts_sums = self.again(entries, True)
            every, _ = self.again([e._replace(bound=-np.inf) for e in entries], True)
            seen.append(
                (bounded, counts, every, len(entries), cut_bounded)
                + (bounded_sums, counts_sums)
            )
            return bounded

    monkeypatch.setattr(mesh_search, "InterleavedSearch", Both)
    plan(
        "gpt:hidden=256,layers=16,heads=4,seq=128,vocab=1024",
        "2x8xA100-80GB",
        global_batch=64,
        microbatch_size=[4],
    )
    ((bounded, counts, every, entered, cut, bounded_sums, counts_sums),) = seen

    def key(picks: list) -> list:
        return [
            (p.seconds, p.chunks, p.submesh, p.virtual_stages, p.option.recompute)
            for p in picks
        ]

    assert len(every) == interleave.KEEP and key(bounded) == key(every)
    assert key(counts) == key(every)
    assert 0 < cut < entered
    assert 0 < bounded_sums < counts_sums
