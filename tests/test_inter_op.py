"""The stage DP against brute-force enumeration of every layer partition and submesh assignment."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cost_models.errors import MeshplanError
from planner.inter_op import stage_dp


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
