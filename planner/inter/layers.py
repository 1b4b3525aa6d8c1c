"""Layer clustering: split a topologically ordered op sequence into L contiguous layers.

Alpa (OSDI'22, section 5.2 and its appendix on operator clustering) groups operators into layers of
balanced compute with little communication between them, so that the inter-op DP works on L layers
instead of thousands of ops.

Input: ops ``0..n-1`` with compute ``f_i >= 0`` (forward + backward FLOPs) and edges
``(producer, consumer, bytes)``, producer < consumer. Boundary k (0 <= k < n - 1) lies between op k
and op k + 1; its cut bytes are

    c_k = sum of bytes_p over the distinct producers p with p <= k < last consumer of p

(a tensor read by several later ops crosses a boundary once; a producer's bytes is the largest over
its edges, normally all equal). Integer byte counts are exact (float64 up to 2**53).

Variables: the L - 1 cut boundaries ``k_1 < ... < k_{L-1}``; layer j holds ops ``k_{j-1} + 1 .. k_j``
(``k_0 = -1``, ``k_L = n - 1``), every layer non-empty, with FLOPs ``F_j``.

Constraint: ``F_j <= cap`` for every layer, with ``cap = max((1 + imbalance) * F / L, M*)``, F the
total FLOPs and M* the smallest achievable largest-layer FLOPs over all partitions into L layers.
So the cap is ``(1 + imbalance)`` times the mean when some partition meets it, and is otherwise
relaxed to M* (one op larger than the cap, say an LM head), i.e. the largest layer is minimised
first. Comparisons allow a relative 1e-9 for rounding.

Objective, lexicographic:
  1. minimise ``max_j c_{k_j}``, the largest cut bytes among the chosen boundaries (0 when L = 1);
  2. with ``starts`` given (the ops where a transformer block begins, `op_terms`): then every
     layer beginning at one of them where some partition allows it;
  3. then minimise ``sum_j (F_j - F / L)^2`` (balance).

Algorithm. Allowing only the boundaries with ``c_k <= T``, every count of layers between the
greedy minimum (each layer extended as far as the cap allows; optimal since FLOPs are
non-negative) and the number of allowed boundaries + 1 is reachable (splitting a layer keeps it
under the cap), so feasibility of T costs O(n + L log n). Binary search over the distinct ``c_k``
gives the smallest feasible T*. Where the boundaries at T* that begin a block admit L layers
(the same greedy test), only those are kept. Then a DP over the allowed boundaries
b_0 = 0 < ... < b_{m-1} = n with prefix FLOPs P_j:
``D_l(j) = min_i D_{l-1}(i) + (P_j - P_i - F / L)^2`` over i < j with ``P_j - P_i <= cap``
gives the balance optimum. The layer cost is convex in ``P_j - P_i``, hence
satisfies the quadrangle inequality, and the admissible i form an interval whose ends never move
left as j grows, so the leftmost optimal i is monotone in j: each of the L rounds is a divide and
conquer in O(m log m) (vectorised one recursion level at a time). M* (when needed) is found by
bisection on the cap with the same greedy test. 5,000 ops into 64 layers take well under 0.1 s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cost_models.errors import MeshplanError
from planner.tracing.blocks import block_of
from planner.tracing.opgraph import OpGraph

__all__ = [
    "ALPA_MAX_LAYERS",
    "auto_num_layers",
    "boundary_cut_bytes",
    "cluster_layers",
    "layer_objective",
    "op_terms",
]

REL_TOL = 1e-9
ALPA_MAX_LAYERS = 16


def boundary_cut_bytes(n: int, edges: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """``c_k`` for k = 0..n-2 (module docstring): bytes of distinct producers crossing boundary k."""
    last: dict[int, int] = {}
    size: dict[int, float] = {}
    for p, c, nbytes in edges:
        if not (0 <= p < c < n) or not math.isfinite(nbytes) or nbytes < 0:
            raise MeshplanError(
                f"bad edge ({p}, {c}, {nbytes}): need 0 <= producer < consumer < {n} and bytes >= 0"
            )
        last[p] = max(last.get(p, c), c)
        size[p] = max(size.get(p, 0.0), float(nbytes))
    diff = np.zeros(n + 1)
    for p, c in last.items():
        diff[p] += size[p]
        diff[c] -= size[p]
    return np.cumsum(diff)[: n - 1]


def layer_objective(
    flops: Sequence[float],
    cut_bytes: Sequence[float],
    layers: Sequence[tuple[int, int]],
) -> tuple[float, float, float]:
    """(largest cut bytes among the chosen boundaries, sum of squared deviations from the mean layer
    FLOPs, largest layer FLOPs) of a clustering."""
    total = float(sum(flops))
    mean = total / len(layers)
    sizes = [float(sum(flops[a : b + 1])) for a, b in layers]
    cuts = [float(cut_bytes[b]) for _, b in layers[:-1]]
    return max(cuts, default=0.0), sum((f - mean) ** 2 for f in sizes), max(sizes)


def _reach(prefix: np.ndarray, cap: float) -> np.ndarray:
    """``lo[j]``: the first allowed boundary i with ``prefix[j] - prefix[i] <= cap``; a layer from
    boundary i to j fits iff ``i >= lo[j]`` (one test shared by the greedy and the DP)."""
    return np.searchsorted(prefix, prefix - cap, side="left")


def _feasible(prefix: np.ndarray, cap: float, num_layers: int) -> bool:
    """Can the allowed boundaries (``prefix``: the prefix FLOPs at each, first 0, last the total)
    split the ops into exactly ``num_layers`` layers of at most ``cap``? Greedy fewest layers (each
    as long as it fits) <= L <= number of segments."""
    m = len(prefix)
    if m - 1 < num_layers:
        return False
    lo = _reach(prefix, cap)
    i, count = 0, 0
    while i < m - 1:
        # the farthest boundary a layer starting at i reaches
        j = int(np.searchsorted(lo, i, side="right")) - 1
        if j <= i or count == num_layers:
            return False
        i, count = j, count + 1
    return True


def _min_max_layer(prefix: np.ndarray, num_layers: int) -> float:
    """M*: the smallest cap under which ``num_layers`` layers exist, by bisection to float
    precision (the answer is a feasible cap within a few ulps above M*)."""
    lo, hi = float(prefix[-1]) / num_layers * (1 - 1e-12), float(prefix[-1])
    for _ in range(200):
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        if _feasible(prefix, mid, num_layers):
            hi = mid
        else:
            lo = mid
    return hi


def _row_minima(
    best: np.ndarray, prefix: np.ndarray, mean: float, low: np.ndarray, high: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For every j: ``min over low[j] <= i <= high[j]`` of ``best[i] + (prefix[j] - prefix[i] -
    mean)^2`` and its leftmost argmin (inf, -1 where the range is empty).

    The cost is a convex function of ``prefix[j] - prefix[i]`` with ``prefix`` non-decreasing, so it
    satisfies the quadrangle inequality; ``low`` and ``high`` are non-decreasing, so the leftmost
    argmin is non-decreasing in j. Divide and conquer on that monotonicity (solve the middle row,
    split the i range at its argmin), one level of the recursion per vectorised step: O(m log m).
    """
    m = len(best)
    value = np.full(m, np.inf)
    arg = np.full(m, -1, dtype=np.int64)
    jlo, jhi = np.array([0]), np.array([m - 1])
    ilo, ihi = np.array([0]), np.array([m - 1])
    while jlo.size:
        mid = (jlo + jhi) // 2
        a, b = np.maximum(ilo, low[mid]), np.minimum(ihi, high[mid])
        count = np.maximum(b - a + 1, 0)
        rows = np.nonzero(count)[0]
        left_hi, right_lo = np.minimum(ihi, high[mid]), np.maximum(ilo, low[mid])
        if rows.size:
            c = count[rows]
            starts = np.cumsum(c) - c
            i = np.repeat(a[rows] - starts, c) + np.arange(int(c.sum()))
            j = np.repeat(mid[rows], c)
            cand = best[i] + (prefix[j] - prefix[i] - mean) ** 2
            mins = np.minimum.reduceat(cand, starts)
            pos = np.where(cand == np.repeat(mins, c), np.arange(cand.size), cand.size)
            opt = i[np.minimum.reduceat(pos, starts)]
            value[mid[rows]], arg[mid[rows]] = mins, opt
            left_hi[rows], right_lo[rows] = opt, opt
        go_left, go_right = jlo <= mid - 1, mid + 1 <= jhi
        jlo, jhi, ilo, ihi = (
            np.concatenate((jlo[go_left], mid[go_right] + 1)),
            np.concatenate((mid[go_left] - 1, jhi[go_right])),
            np.concatenate((ilo[go_left], right_lo[go_right])),
            np.concatenate((left_hi[go_left], ihi[go_right])),
        )
    return value, arg


def _balance(prefix: np.ndarray, cap: float, num_layers: int, mean: float) -> list[int]:
    """Indices into ``prefix`` (allowed boundaries) of the L - 1 cuts minimising the sum of squared
    deviations, every layer <= cap: ``D_l(j) = min_i D_{l-1}(i) + (P_j - P_i - mean)^2`` over
    ``lo[j] <= i <= j - 1`` with i reachable by l - 1 layers (an interval of boundaries)."""
    m = len(prefix)
    lo = _reach(prefix, cap)
    index = np.arange(m)
    best = np.where(lo == 0, (prefix - mean) ** 2, np.inf)
    best[0] = np.inf  # a layer is non-empty
    parents = []
    for _ in range(1, num_layers):
        reachable = np.nonzero(np.isfinite(best))[0]
        low = np.maximum(lo, reachable[0])
        high = np.minimum(index - 1, reachable[-1])
        best, arg = _row_minima(best, prefix, mean, low, high)
        parents.append(arg)
    if not math.isfinite(best[-1]):
        raise AssertionError(
            "balancing DP found no partition a feasibility check accepted"
        )
    cuts, j = [], m - 1
    for arg in reversed(parents):
        j = int(arg[j])
        cuts.append(j)
    return cuts[::-1]


def cluster_layers(
    flops: Sequence[float],
    edges: Sequence[tuple[int, int, float]],
    num_layers: int,
    *,
    imbalance: float = 0.25,
    starts: Sequence[int] = (),
) -> list[tuple[int, int]]:
    """Split ops ``0..n-1`` into ``num_layers`` contiguous layers, returned as inclusive
    ``(first, last)`` ranges: fewest bytes on the worst chosen boundary, then (given `starts`)
    every layer beginning at one of those ops where possible, then best balanced, each layer's
    FLOPs within ``(1 + imbalance)`` of the mean where possible (module docstring)."""
    n, L = len(flops), num_layers
    if L < 1 or L > n:
        raise MeshplanError(
            f"number of layers must be between 1 and the {n} ops, got {L}"
        )
    if imbalance < 0 or not math.isfinite(imbalance):
        raise MeshplanError(f"imbalance must be a finite number >= 0, got {imbalance}")
    f = np.asarray(flops, dtype=np.float64)
    if not np.all(np.isfinite(f)) or np.any(f < 0):
        raise MeshplanError("op FLOPs must be finite and >= 0")
    cut = boundary_cut_bytes(n, edges)
    if L == 1:
        return [(0, n - 1)]
    prefix = np.concatenate(([0.0], np.cumsum(f)))
    total = float(prefix[-1])
    cap = (1 + imbalance) * total / L
    if not _feasible(prefix, cap * (1 + REL_TOL), L):
        cap = max(cap, _min_max_layer(prefix, L))
    cap *= 1 + REL_TOL

    def allowed(threshold: float) -> np.ndarray:
        return np.concatenate(([0], np.nonzero(cut <= threshold)[0] + 1, [n]))

    levels = np.unique(cut)
    lo, hi = 0, len(levels) - 1  # the largest level allows every boundary: feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(prefix[allowed(levels[mid])], cap, L):
            hi = mid
        else:
            lo = mid + 1
    bounds = allowed(levels[lo])
    if len(starts):
        begins = np.zeros(n + 1, dtype=bool)
        begins[[0, n]] = True
        begins[[i for i in starts if 0 < i < n]] = True
        preferred = bounds[begins[bounds]]
        if _feasible(prefix[preferred], cap, L):
            bounds = preferred
    picks = _balance(prefix[bounds], cap, L, total / L)
    edges_at = [0] + [int(bounds[i]) for i in picks] + [n]
    return [(edges_at[j], edges_at[j + 1] - 1) for j in range(L)]


def auto_num_layers(
    flops: Sequence[float],
    *,
    blocks: int | None = None,
    max_layers: int = ALPA_MAX_LAYERS,
) -> int:
    """Number of layers to cluster into when the user gives none.

    With ``blocks`` repeated blocks (transformer layers): ``blocks`` if at most ``max_layers``, else
    the largest divisor of ``blocks`` in ``[max_layers / 2, max_layers]`` so every layer holds the
    same number of blocks, else ``max_layers``. Without: ``max_layers``. Never more than the ops with
    FLOPs > 0, never less than 1. ``max_layers = 16`` follows Alpa's GPT benchmark suite
    (``benchmark/alpa/suite_auto_gpt.py``), which clusters 24-layer GPTs into 6 or 12 layers,
    32-layer ones into 8 or 16 and 48-layer ones into 8 or 16, never more than 16: more layers
    enlarge the inter-op DP (O(L^3) stage ranges x submeshes) for little gain. This rule gives 12,
    16 and 16 for those models.
    """
    if max_layers < 1:
        raise MeshplanError(f"max_layers must be >= 1, got {max_layers}")
    if blocks is not None and blocks < 1:
        raise MeshplanError(f"number of blocks must be >= 1, got {blocks}")
    compute_ops = sum(1 for x in flops if x > 0)
    if blocks is None:
        layers = max_layers
    elif blocks <= max_layers:
        layers = blocks
    else:
        fits = [
            d
            for d in range(max_layers, 0, -1)
            if blocks % d == 0 and 2 * d >= max_layers
        ]
        layers = fits[0] if fits else max_layers
    return max(1, min(layers, compute_ops))


def op_terms(
    graph: OpGraph,
) -> tuple[list[float], list[tuple[int, int, float]], list[int]]:
    """What `cluster_layers` reads of a graph: each op's forward + backward FLOPs, the edges
    between ops (producer index, consumer index, bytes), and the index of the first op of each
    transformer block (`planner.tracing.blocks.block_of`; none without blocks)."""
    ops = graph.ops
    index = {n.name: i for i, n in enumerate(ops)}
    edges = [
        (index[u], i, graph.node(u).output_bytes)
        for i, n in enumerate(ops)
        for u in dict.fromkeys(n.inputs)
        if u in index
    ]
    flops = [n.fwd_flops + n.bwd_flops for n in ops]
    first: dict[str, int] = {}
    for i, n in enumerate(ops):
        key = block_of(n.module_path)
        if key is not None:
            first.setdefault(key, i)
    return flops, edges, sorted(first.values())


def graph_layerings(
    graph: OpGraph, num_layers: int | None, num_devices: int
) -> list[list[tuple[int, int]]]:
    """Layer clusterings to search: `num_layers` when given; else the automatic count L
    (`auto_num_layers`) first, then every divisor p of the device count with 2 <= p < L, clustered
    into exactly p layers. A manual configuration with p pipeline stages splits the model into p
    balanced layers; with that clustering among the candidates, its stage split is in the search
    space (an L-layer clustering's boundaries need not fall where the p-layer one's do: with an LM
    head, say, the last of 12 equal layers is heavier than an even split of the model in two).

    Second, where it differs from the first, the L layers with every layer beginning at a
    transformer block (`cluster_layers`' ``starts``). Balance may cut a layer after an
    attention's residual add, as cheap as between blocks; FSDP's units are then not the blocks
    (`planner.tracing.blocks.block_units`), as a manual configuration's are (llama3-405b on 512
    H100s, one stage FSDP over dp256 x tp2: 22.37 s per step on the 14 balanced layers, 22.30 s
    on 14 block-aligned ones), while the balanced cut can be the better pipeline split
    (llama3-70b on 8x8 H100s at batch 512: 63.3 s on the balanced layers, 65.7 s with only
    block-aligned ones)."""
    flops, edges, starts = op_terms(graph)
    if num_layers:
        return [cluster_layers(flops, edges, num_layers)]
    L = auto_num_layers(flops, blocks=len(starts) or None)
    extra = [p for p in range(2, min(L, num_devices + 1)) if num_devices % p == 0]
    out = [cluster_layers(flops, edges, n) for n in (L, *extra)]
    if starts:
        aligned = cluster_layers(flops, edges, L, starts=starts)
        if aligned != out[0]:
            out.insert(1, aligned)
        if L < len(starts) <= MAX_BLOCK_LAYERS and uneven_blocks(graph):
            out.append(cluster_layers(flops, edges, len(starts), starts=starts))
    return out


#: Most blocks `graph_layerings` gives one layer each (the stage DP grows as L^3: 48 layers are
#: 27 times the work of 16).
MAX_BLOCK_LAYERS = 48
#: Blocks whose parameter bytes differ by more than this factor are "uneven" (`uneven_blocks`).
UNEVEN_BLOCKS = 2.0


def uneven_blocks(graph: OpGraph) -> bool:
    """Whether the parameter bytes of the blocks (`planner.tracing.blocks.block_of`; a
    parameter counts in the block of its first reader) differ by more than `UNEVEN_BLOCKS`
    times. Layers balanced by FLOPs then hold very unequal parameter state: Wide-ResNet's last
    blocks have 4x the channels of the ones before and a quarter of the pixels, so a layer of
    its three last blocks held the most state of all, and wresnet-13b on 8x8 V100-16GB planned
    1856 s per iteration on 11 layers (the last one fits only on 4 x 8 devices with full
    recomputation), 38.1 s with one layer per block among the clusterings."""
    per_block: dict[str, float] = {}
    seen: set[str] = set()
    for n in graph.ops:
        key = block_of(n.module_path)
        if key is None:
            continue
        per_block.setdefault(key, 0.0)
        for u in n.inputs:
            if u not in seen and graph.node(u).op == "param":
                seen.add(u)
                per_block[key] += graph.node(u).output_bytes
    if not per_block:
        return False
    return max(per_block.values()) > UNEVEN_BLOCKS * min(per_block.values())


def layers_in(graph: OpGraph, num_layers: int) -> list[tuple[int, int]]:
    """The op index ranges of `num_layers` layers of balanced compute (`cluster_layers`)."""
    return graph_layerings(graph, num_layers, 1)[0]
