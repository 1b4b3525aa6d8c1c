"""The stage DP against brute-force enumeration of every layer partition and submesh assignment."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cost_models.errors import MeshplanError
from planner.inter.stage_dp import _dp_for, _search, stage_dp


def _brute(cost: np.ndarray, sizes: list[int], D: int, B: int) -> float:
    L = cost.shape[0]
    best = np.inf
    for n_cuts in range(L):
        for cuts in itertools.combinations(range(1, L), n_cuts):
            bounds = [0, *cuts, L]
            ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]
            S = len(ranges)
            if S >= cost.shape[3]:
                continue
            for subs in itertools.product(range(len(sizes)), repeat=S):
                if sum(sizes[m] for m in subs) != D:
                    continue
                times = [
                    cost[k, j, m, S - i]
                    for i, ((k, j), m) in enumerate(zip(ranges, subs))
                ]
                if not all(np.isfinite(times)):
                    continue
                best = min(best, sum(times) + (B - 1) * max(times))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 6))
    sizes = [1, 2, 4] if seed % 2 else [1, 2, 4, 8]
    D = int(rng.choice([2, 4, 8]))
    B = int(rng.integers(1, 9))
    S = min(L, D) + 1
    # Latency grows with the layers a stage runs and shrinks with its devices; some entries infeasible.
    work = rng.uniform(1, 3, size=L)
    cost = np.full((L, L, len(sizes), S), np.inf)
    for k in range(L):
        for j in range(k, L):
            for m, size in enumerate(sizes):
                for s in range(1, S):
                    base = work[k : j + 1].sum() / size ** rng.uniform(0.6, 1.0)
                    if rng.uniform() > 0.15:
                        cost[k, j, m, s] = base * (1 + 0.05 * s)
    want = _brute(cost, sizes, D, B)
    if not np.isfinite(want):
        with pytest.raises(MeshplanError):
            stage_dp(cost, sizes, D, B)
        return
    got = stage_dp(cost, sizes, D, B)
    assert got.latency == pytest.approx(want, rel=1e-12)
    # The returned stages are consistent with the latency and tile the layers and devices.
    assert got.stages[0][0] == 0 and got.stages[-1][1] == L - 1
    assert sum(sizes[m] for *_, m in got.stages) == D
    S_used = len(got.stages)
    times = [cost[k, j, m, S_used - i] for i, (k, j, m) in enumerate(got.stages)]
    assert sum(times) + (B - 1) * max(times) == pytest.approx(got.latency)


def test_near_tied_stage_latencies_are_all_tried() -> None:
    """Alpa's epsilon skipped a candidate t_max within 1e-3 of the last one tried; the next one
    tried was the single 32-device stage, 16% slower (gpt-15b on 4x8 A100s, 32 micro-batches).
    Two 16-device stages of 0.48215 and 0.4817 s must win over one of 0.5778 s."""
    # layers x layers x (16, 32 devices) x stages left
    cost = np.full((2, 2, 2, 3), np.inf)
    cost[0, 0, 0, 2] = 0.48215  # layer 0 on 16 devices, one stage after it
    cost[1, 1, 0, 1] = 0.4817  # layer 1 on 16 devices, the last stage
    cost[0, 0, 0, 1] = 0.4817  # layer 0 as a last stage: never a whole plan
    cost[0, 1, 1, 1] = 0.5778  # both layers on all 32 devices
    got = stage_dp(cost, [16, 32], 32, 32)
    assert got.stages == [(0, 0, 0), (1, 1, 0)]
    assert got.latency == pytest.approx(0.48215 + 0.4817 + 31 * 0.48215)


def test_more_microbatches_favour_more_stages() -> None:
    # Two layers: one stage on 2 devices takes 1.9 per micro-batch; two 1-device stages take 1.0 each.
    # B = 1: 1.9 < 1.0 + 1.0. B = 16: 1.9 * 16 = 30.4 > 2.0 + 15 * 1.0 = 17.
    cost = np.full((2, 2, 2, 3), np.inf)
    cost[0, 1, 1, 1] = 1.9
    cost[0, 0, 0, :] = cost[1, 1, 0, :] = 1.0
    one = stage_dp(cost, [1, 2], 2, 1)
    assert one.latency == pytest.approx(1.9) and len(one.stages) == 1
    many = stage_dp(cost, [1, 2], 2, 16)
    assert len(many.stages) == 2 and many.latency == pytest.approx(2.0 + 15 * 1.0)


def _dp_for_sequential(
    cost: np.ndarray, sizes: list[int], D: int, s_max: int, t_max: float
) -> tuple[float, list] | None:
    """F(s, k, d) choice by choice, in (j, m) order, keeping a candidate only when strictly
    smaller: the reference for which of several equally good choices `_dp_for` keeps."""
    L = cost.shape[0]
    F = np.full((s_max + 1, L + 1, D + 1), np.inf)
    arg: dict[tuple[int, int, int], tuple[int, int]] = {}
    F[0, L, 0] = 0.0
    for s in range(1, s_max + 1):
        for k in range(L):
            for d in range(D + 1):
                for j in range(k, L):
                    for m, size in enumerate(sizes):
                        c = cost[k, j, m, s]
                        if c > t_max or size > d or not np.isfinite(c):
                            continue
                        cand = F[s - 1, j + 1, d - size] + c
                        if cand < F[s, k, d]:
                            F[s, k, d] = cand
                            arg[s, k, d] = (j, m)
    totals = F[1:, 0, D]
    if not np.isfinite(totals).any():
        return None
    s = int(np.argmin(totals)) + 1
    total, stages, k, d = float(totals[s - 1]), [], 0, D
    while s > 0:
        j, m = arg[s, k, d]
        stages.append((k, j, m))
        k, d, s = j + 1, d - sizes[m], s - 1
    return total, stages


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_dp_keeps_the_first_of_equal_choices(seed: int) -> None:
    """Costs drawn from a few values make many ties: the vectorised DP must pick exactly what
    the choice-by-choice DP picks (same total and same stages) for every t_max."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(20):
        L = int(rng.integers(1, 7))
        sizes = [1, 2, 4, 8][: int(rng.integers(1, 5))]
        D = int(rng.choice([2, 4, 8]))
        S = int(rng.integers(1, L + 1)) + 1
        cost = rng.choice([0.5, 1.0, 1.5, 2.0], size=(L, L, len(sizes), S))
        cost[rng.random(cost.shape) < 0.3] = np.inf
        for k in range(L):
            cost[k, :k] = np.inf
        s_max = min(L, D, S - 1)
        for t_max in np.unique(cost[np.isfinite(cost)]):
            want = _dp_for_sequential(cost, sizes, D, s_max, float(t_max))
            assert _dp_for(cost, sizes, D, s_max, float(t_max)) == want


def _scan_every_candidate(
    cost: np.ndarray, sizes: list[int], D: int, B: int, s_max: int, only: int | None
) -> tuple[float, float, list] | None:
    """The enumeration over t_max without `_search`'s cuts: every candidate from the least,
    stopping only where (B - 1) * t_max alone reaches the best latency."""
    best = None
    for t_max in np.unique(cost[np.isfinite(cost)]):
        if best is not None and (B - 1) * t_max >= best[0]:
            break
        result = _dp_for(cost, sizes, D, s_max, float(t_max), only)
        if result is None:
            continue
        total, stages = result
        longest = max(
            cost[k, j, m, s] for s, (k, j, m) in zip(range(len(stages), 0, -1), stages)
        )
        latency = total + (B - 1) * longest
        if best is None or latency < best[0] - 1e-15:
            best = (float(latency), float(t_max), stages)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_search_cuts_return_what_scanning_every_candidate_returns(seed: int) -> None:
    """`_search` starts at the first feasible t_max (bisection) and stops once floor + (B - 1)
    * t_max reaches the best latency: the same latency, t_max and stages as scanning every
    candidate, ties included (costs from a few values), for any number of stages and exactly S."""
    rng = np.random.default_rng(300 + seed)
    for _ in range(15):
        L = int(rng.integers(1, 7))
        sizes = [1, 2, 4, 8][: int(rng.integers(1, 5))]
        D = int(rng.choice([2, 4, 8]))
        B = int(rng.integers(1, 40))
        S = int(rng.integers(1, L + 1)) + 1
        cost = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], size=(L, L, len(sizes), S))
        cost *= rng.uniform(0.9, 1.1, size=cost.shape) if seed % 2 else 1.0
        cost[rng.random(cost.shape) < 0.4] = np.inf
        s_max = min(L, D, S - 1)
        for only in (None, *range(1, s_max + 1)):
            want = _scan_every_candidate(cost, sizes, D, B, s_max, only)
            if want is None:
                with pytest.raises(MeshplanError):
                    _search(cost, sizes, D, B, s_max, only)
                continue
            got = _search(cost, sizes, D, B, s_max, only)
            assert (got.latency, got.t_max, got.stages) == want


@pytest.mark.parametrize("seed", range(10))
def test_dp_over_the_submeshes_used_in_device_units_is_the_dp_over_all(
    seed: int,
) -> None:
    """`stage_dp` solves over the submeshes where some entry fits, counting devices in units of
    their sizes' gcd: the same stages and latency as over every submesh and device count
    (`_stage_dp` on the whole table), and the brute-force optimum; zero bubble's search alike."""
    from planner.inter.stage_dp import _stage_dp

    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(1, 5))
    sizes = [1, 2, 4, 8, 12, 16]
    D = int(rng.choice([8, 16, 24, 32]))
    B = int(rng.integers(1, 9))
    S = min(L, D) + 1
    cost = np.full((L, L, len(sizes), S), np.inf)
    # sizes 1 and 2 never fit; 12 only in some tables: the gcd of the rest is 4 or 8
    unused = {0, 1} | ({4} if seed % 2 else set())
    for k in range(L):
        for j in range(k, L):
            for m, size in enumerate(sizes):
                if m in unused:
                    continue
                for s in range(1, S):
                    if rng.uniform() > 0.2:
                        cost[k, j, m, s] = (j - k + 1) * rng.uniform(1, 2) / size**0.8
    for by_total in (False, True):
        try:
            whole = _stage_dp(cost, sizes, D, B, by_total)
        except MeshplanError:
            with pytest.raises(MeshplanError):
                stage_dp(cost, sizes, D, B, by_total=by_total)
            continue
        got = stage_dp(cost, sizes, D, B, by_total=by_total)
        assert (got.stages, got.latency, got.t_max) == (
            whole.stages,
            whole.latency,
            whole.t_max,
        )
        if not by_total:
            assert got.latency == pytest.approx(_brute(cost, sizes, D, B), rel=1e-12)
