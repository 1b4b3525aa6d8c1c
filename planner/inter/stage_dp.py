"""Inter-operator pass: assign consecutive layer ranges to submeshes, minimising pipeline latency.

Formulation (Alpa, OSDI'22, section 5.1, eq. 2-3), for layers 0..L-1, submesh shapes m with
size |m| devices, D devices in all and B micro-batches:

Input
    cost[k, j, m, s]: per-micro-batch latency (forward + backward) of a stage that runs layers k..j
    on submesh m, when it and the stages after it are s stages (this sets the micro-batches it keeps
    in flight, hence its memory); +inf where it does not fit in memory.

Search
    For every candidate maximum stage latency t_max (the distinct finite costs, ascending):

        F(0, L, 0) = 0
        F(s, k, d) = min over j >= k and m with |m| <= d and cost[k, j, m, s] <= t_max of
                     cost[k, j, m, s] + F(s - 1, j + 1, d - |m|)

    pipeline latency(t_max) = min over s of F(s, 0, D) + (B - 1) * t_max          (1F1B / GPipe)

    The answer is the minimum over t_max. The stages use exactly D devices (they tile the cluster).

    With ``by_total`` (zero bubble: every stage keeps min(B, S) micro-batches in flight, S the
    number of stages in all, `cost_models.memory.microbatches_in_flight`), index s of ``cost``
    means "a pipeline of s stages", and the program above is solved once per S with every stage
    priced at ``cost[..., S]`` and exactly S stages: F(S, 0, D) only. The best over S is kept.
    Enumeration stops once (B - 1) * t_max alone reaches the best latency found.

`stage_dp` is exact (tests compare it with brute force); it is vectorised over d. Alpa skips the
candidates within a relative epsilon of the last one tried; that is not within epsilon of the
optimum (the next candidate tried may be far above the skipped one): with epsilon 1e-3, gpt-15b on
4x8 A100s at 32 micro-batches lost two 16-device stages (15.91 s) to one 32-device stage (18.49 s).
The exact enumeration costs at most a few tenths of a second per micro-batch size there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cost_models.errors import MeshplanError


@dataclass
class DPResult:
    latency: float  # sum of stage latencies + (B - 1) * max stage latency
    t_max: float
    stages: list[tuple[int, int, int]]  # (first layer, last layer, submesh index)


def stage_dp(
    cost: np.ndarray,
    sizes: list[int],
    num_devices: int,
    num_microbatches: int,
    *,
    by_total: bool = False,
) -> DPResult:
    """Solve the program above. `cost` has shape (L, L, len(sizes), S_max + 1); index s = 0 unused.
    `by_total`: index s is the pipeline's number of stages, not the stages from this one on.

    The same program is solved over the submeshes where some entry is finite (no other is ever
    chosen), with device counts in units of their sizes' greatest common divisor g (every sum
    of their sizes is a multiple of g): F's device axis has D / g + 1 entries instead of D + 1,
    and the candidates are compared in the same (j, m) order. The 1T GPT on 384x8 A100s at 32
    rows per micro-batch: 8 of 20 submeshes, g = 16 to 128."""
    used = np.flatnonzero(np.isfinite(cost).any(axis=(0, 1, 3)))
    g = math.gcd(*(sizes[m] for m in used)) if used.size else 1
    if not used.size or num_devices % g:
        raise MeshplanError("no assignment of layers to submeshes fits in memory")
    result = _stage_dp(
        cost[:, :, used],
        [sizes[m] // g for m in used],
        num_devices // g,
        num_microbatches,
        by_total,
    )
    result.stages = [(k, j, int(used[m])) for k, j, m in result.stages]
    return result


def _stage_dp(
    cost: np.ndarray,
    sizes: list[int],
    num_devices: int,
    num_microbatches: int,
    by_total: bool,
) -> DPResult:
    """`stage_dp` on the submeshes and device units it keeps."""
    L, _, _, s_cap = cost.shape
    s_max = min(L, num_devices, s_cap - 1)
    if by_total:
        results = []
        for S in range(1, s_max + 1):
            same = np.broadcast_to(cost[..., S : S + 1], (*cost.shape[:3], S + 1))
            try:
                results.append(
                    _search(same, sizes, num_devices, num_microbatches, S, S)
                )
            except MeshplanError:
                continue
        if not results:
            raise MeshplanError("no assignment of layers to submeshes fits in memory")
        return min(results, key=lambda r: r.latency)
    return _search(cost, sizes, num_devices, num_microbatches, s_max, None)


def _search(
    cost: np.ndarray,
    sizes: list[int],
    num_devices: int,
    B: int,
    s_max: int,
    only: int | None,
) -> DPResult:
    """The search over t_max (module docstring); `only`: exactly that many stages.

    Two cuts of the enumeration, both exact. Whether some assignment fits under t_max only
    grows with t_max, so the scan starts at the first candidate where one does, found by
    bisection. And every assignment whose longest stage is t_max has a latency of at least
    floor + (B - 1) * t_max, floor being the least sum of stage latencies of any assignment
    (the DP under the largest candidate): the scan ends at the first candidate where that
    reaches the best latency found (an assignment is found at the candidate equal to its
    longest stage, so none is lost; the factor keeps rounding on the side of scanning on)."""
    finite = np.unique(cost[np.isfinite(cost)])
    least = (
        _dp_for(cost, sizes, num_devices, s_max, float(finite[-1]), only)
        if finite.size
        else None
    )
    if least is None:
        raise MeshplanError("no assignment of layers to submeshes fits in memory")
    floor = least[0]
    lo, hi = 0, finite.size - 1  # the first feasible candidate lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if _dp_for(cost, sizes, num_devices, s_max, float(finite[mid]), only) is None:
            lo = mid + 1
        else:
            hi = mid
    best: DPResult | None = None
    for t_max in finite[lo:]:
        if best is not None and floor + (B - 1) * t_max >= best.latency * (1 + 1e-12):
            break
        result = _dp_for(cost, sizes, num_devices, s_max, float(t_max), only)
        if result is None:
            continue
        total, stages = result
        latency = total + (B - 1) * max(
            cost[k, j, m, s] for s, (k, j, m) in zip(range(len(stages), 0, -1), stages)
        )
        if best is None or latency < best.latency - 1e-15:
            best = DPResult(float(latency), float(t_max), stages)
    if best is None:
        raise MeshplanError("no assignment of layers to submeshes fits in memory")
    return best


def _dp_for(
    cost: np.ndarray,
    sizes: list[int],
    D: int,
    s_max: int,
    t_max: float,
    only: int | None = None,
) -> tuple[float, list] | None:
    """F(s, k, d) of the module docstring for one t_max, vectorised: for each s, every allowed
    choice (k, j, m) at once and every d. For each (s, k, d) the choices are compared in (j, m)
    order and the first least one wins (what updating on strictly smaller candidates in that
    order gives)."""
    L = cost.shape[0]
    size = np.asarray(sizes, dtype=int)
    src = (
        np.arange(D + 1)[None, :] - size[:, None]
    )  # [m, d]: devices left to later stages
    F = np.full((s_max + 1, L + 1, D + 1), np.inf)
    arg_j = np.full((s_max + 1, L + 1, D + 1), -1)
    arg_m = np.full((s_max + 1, L + 1, D + 1), -1)
    F[0, L, 0] = 0.0
    later = np.arange(L)[None, :] >= np.arange(L)[:, None]  # [k, j]: j >= k
    fits = (cost <= t_max) & later[:, :, None, None] & (size <= D)[None, None, :, None]
    chunk = max(1, 2**22 // (L * len(sizes) * (D + 1)))  # values of k at once (memory)
    for s in range(1, s_max + 1):
        reachable = np.isfinite(F[s - 1, 1:]).any(
            axis=1
        )  # [j]: F(s - 1, j + 1, .) < inf
        for a in range(0, L, chunk):
            allowed = fits[a : a + chunk, :, :, s] & reachable[None, :, None]
            k, j, m = np.nonzero(allowed)
            if not k.size:
                continue
            k = k + a
            # Candidates in (k, j, m) order: F(s - 1, j + 1, d - |m|) + cost (inf if d < |m|).
            cand = np.where(
                src[m] >= 0, F[s - 1][(j + 1)[:, None], np.maximum(src[m], 0)], np.inf
            )
            cand = cand + cost[k, j, m, s][:, None]
            new_k = np.r_[True, k[1:] != k[:-1]]
            starts = np.flatnonzero(new_k)  # one segment of candidates per k
            least = np.minimum.reduceat(cand, starts, axis=0)
            seg = np.cumsum(new_k) - 1  # segment of each candidate
            rows = np.where(cand == least[seg], np.arange(k.size)[:, None], k.size)
            first = np.minimum.reduceat(rows, starts, axis=0)  # first least per segment
            first = np.minimum(first, k.size - 1)
            found = least < np.inf
            ks = k[starts]
            F[s, ks] = least
            arg_j[s, ks] = np.where(found, j[first], -1)
            arg_m[s, ks] = np.where(found, m[first], -1)
    totals = [F[s, 0, D] if only in (None, s) else np.inf for s in range(1, s_max + 1)]
    if not np.isfinite(totals).any():
        return None
    s = int(np.argmin(totals)) + 1
    total = float(totals[s - 1])
    stages, k, d = [], 0, D
    while s > 0:
        j, m = int(arg_j[s, k, d]), int(arg_m[s, k, d])
        stages.append((k, j, m))
        k, d, s = j + 1, d - sizes[m], s - 1
    return total, stages
