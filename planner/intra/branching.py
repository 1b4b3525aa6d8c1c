"""The branch-and-bound of an intra-op program whose LP relaxation is fractional
(`branch_and_bound`), branching on one node's strategies at a time.

Program (the arrays `planner.intra.ilp.ILPModel` builds, `planner.intra.highs.HighsArrays`):

    minimise  c x   subject to  the equality rows (each node's binaries sum to 1, the edge
              variables' marginals), the memory row when there is a budget,
              x >= 0, the binaries in {0, 1}.

Each node of the graph owns a group of binaries, one per strategy, exactly one of them 1.

Tree. A tree node is the program with a set Z of binaries fixed at 0; its bound is the optimum
of its LP relaxation, solved by HiGHS's dual simplex from the basis the last LP ended with
(HiGHS keeps it across bound changes). Tree nodes are taken best first by their parent's
bound. One whose bound is at least the best solution found less `gap` times its size is
dropped; one whose relaxation is integral in the binaries is a solution. Otherwise one group g
is split:

* by memory, when some group's fractional weights x_i lie on strategies of unequal memory
  m_i: the g of greatest spread sum_i x_i |m_i - mean_g| (mean_g = sum_i x_i m_i / sum_i x_i);
  children Z + {i in g: m_i > mean_g} and Z + {i in g: m_i <= mean_g}. Weight lies on both
  sides of the mean (a group where it does not is not split so), so each child cuts the
  relaxation's optimum off;
* else (and always without a memory row) by its heaviest strategy j (the group of largest
  fractional weight; among equal weights, as an all-halves relaxation has everywhere, the g of
  greatest cost spread sum_i x_i |c_i - cbar_g| with c the strategies' costs in the
  objective): children Z + {j} and Z + (g - {j}); x_j lies in (0, 1), so again each child cuts
  the optimum off. Ties left to the columns' order made the tree depend on it: mixtral-8x7b's
  11 captured programs took 161-539 LPs over seven shuffled orders of the groups (173 in the
  columns' order), 133-139 with the cost spread (benchmarks/planning_time_log.md, 2026-12-07).

Either way every integral choice of g is left in exactly one child, so the optimum is kept,
and the tree is finite (each child fixes more binaries). Empty, the best solution is optimal
within `gap`: no open tree node could beat it by more.

Why our own rather than HiGHS's: HiGHS branches on one binary, 0 or 1. Where the memory row
binds, the relaxation mixes one node's fast, large strategy with a slow, small one to fill the
budget exactly; fixing one binary leaves the mix to the others, and HiGHS scores candidate
binaries by strong branching until one closes the gap. A group split by memory (the SOS1 /
GUB branching of the integer-programming texts, which HiGHS does not offer) takes the mix
apart in one step. moe-70b on 8x8 A100s at 16 rows, a memory rung of its 4x8 mesh (40K
columns, two nodes split between 16 and 22 GiB strategies): HiGHS 22.8 s of CPU, one tree
node and 25K strong-branching LP iterations; here 1.2 s, 5 LPs, the same optimum
(benchmarks/planning_time_log.md, 2026-12-07).

Safety nets: `time_limit` (as HiGHS's: "stopped" with the best solution, "timeout" without),
and `NODE_LIMIT` LPs (`ONE_SPLIT_NODE_LIMIT` where the root splits one node), past which the
program goes to HiGHS's branch-and-bound after all.
"""

from __future__ import annotations

import heapq
import itertools
import time

import numpy as np

from planner.intra import highs

#: LPs after which the tree is handed to HiGHS's branch-and-bound (`highs.run_highs`, without
#: presolve): a safety net against a tree this branching does not shrink. The longest tree on the
#: programs measured took 256 LPs (moe-10b on 16 V100s, 5.5 s against HiGHS's 10.7 s).
NODE_LIMIT = 400
#: The same where the root relaxation splits a single node between two strategies (two binaries
#: fractional), and then to HiGHS with presolve: there the relaxation's remaining gap moves from
#: node to node as each is split, while HiGHS's presolve and restarts shrink such programs fast.
#: Wide-ResNet's memory rungs (wresnet-13b on 8x8 V100s, 145 nodes, gaps of 1-2%) ran past 400
#: LPs in 6 of its 13 programs (1.5-2.9 s each, 0.3-1.0 s in HiGHS) and took 86 and 273 in two
#: more; the other five took 8-39, gpt-39b's 9-30 (benchmarks/planning_time_log.md, 2026-12-07).
ONE_SPLIT_NODE_LIMIT = 40


def branch_and_bound(
    arrays: highs.HighsArrays,
    groups: list[np.ndarray],
    memory: np.ndarray,
    limit: float | None,
    *,
    gap: float,
    time_limit: float | None,
) -> tuple[str, np.ndarray | None]:
    """The program `arrays` solved as the module docstring says: ("optimal" | "stopped" |
    "timeout" | "infeasible" | "failed", column values or None), as `highs.run_highs` returns.
    `groups`: per node with more than one strategy, its binaries' columns (HiGHS's order);
    `memory[c]`: column c's coefficient in the memory row, `limit` the row's upper bound (None:
    no memory row; `memory` is then ignored)."""
    start = time.perf_counter()
    h = highs._highs(arrays, None, False)
    h.setOptionValue("presolve", "off")
    upper = arrays.upper
    binaries = arrays.integer
    if limit is None:
        memory = np.zeros(len(arrays.cost))
    group_of = np.full(len(arrays.cost), -1)
    for g, cols in enumerate(groups):
        group_of[cols] = g
    flat = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    firsts = np.cumsum([0] + [len(c) for c in groups[:-1]])

    def fits(zero: frozenset[int]) -> bool:
        """Whether each group's least memory left sums within the limit: a child that fails
        it has no solution, and HiGHS's dual simplex, warm, may end such a child "unknown"."""
        if limit is None or not len(flat):
            return True
        m = memory.copy()
        m[list(zero)] = np.inf
        least = float(np.minimum.reduceat(m[flat], firsts).sum())
        return least <= limit + 1e-9 * max(1.0, abs(limit))

    fixed: frozenset[int] = frozenset()  # the columns fixed at 0 in `h` now
    best, best_x = np.inf, None
    order = itertools.count()
    tree: list[tuple[float, int, frozenset[int]]] = [(-np.inf, next(order), fixed)]
    lps, node_limit, presolve = 0, NODE_LIMIT, False
    while tree:
        bound, _, zero = heapq.heappop(tree)
        if bound >= best - abs(best) * gap:
            continue
        left = _left(start, time_limit)
        if left is not None and left <= 0:
            return ("timeout", None) if best_x is None else ("stopped", best_x)
        if lps >= node_limit:
            return _highs(arrays, start, time_limit, gap, presolve)
        lps += 1
        _fix(h, fixed, zero, upper)
        fixed = zero
        h.setOptionValue("time_limit", np.inf if left is None else left)
        state, x = highs._run(h)
        if state == "failed":
            # warm from another tree node's basis, HiGHS's dual simplex ends some infeasible
            # children "unknown" (gpt-39b's memory rungs on 64 V100s); from no basis it decides
            h.clearSolver()
            state, x = highs._run(h)
        if state == "failed":
            return _highs(arrays, start, time_limit, gap, presolve)
        if state in ("stopped", "timeout"):
            return ("timeout", None) if best_x is None else ("stopped", best_x)
        if state == "infeasible":
            continue
        value = float(arrays.cost @ x)
        if value >= best - abs(best) * gap:
            continue
        frac = highs._fractional(x[binaries])
        if lps == 1 and frac.sum() <= 2:
            node_limit, presolve = ONE_SPLIT_NODE_LIMIT, True
        if not frac.any():
            best, best_x = value, x
            continue
        for child in _split(x, binaries[frac], group_of, groups, memory, arrays.cost):
            if fits(zero | child):
                heapq.heappush(tree, (value, next(order), zero | child))
    return ("infeasible", None) if best_x is None else ("optimal", best_x)


def _split(
    x: np.ndarray,
    fractional: np.ndarray,
    group_of: np.ndarray,
    groups: list[np.ndarray],
    memory: np.ndarray,
    cost: np.ndarray,
) -> tuple[frozenset[int], frozenset[int]]:
    """The two sets of columns the children fix at 0 (module docstring)."""
    best_g, spread, mean = -1, 0.0, 0.0
    heaviest, weight = -1, (-1.0, -1.0)
    for g in dict.fromkeys(group_of[fractional].tolist()):
        cols = groups[g]
        w, m = x[cols], memory[cols]
        centre, s = _spread(w, m)
        high = m > centre
        # weight on both sides (not so where memories differ only by rounding)
        if s > spread and min(w[high].sum(), w[~high].sum()) > highs.INTEGRAL_TOL:
            best_g, spread, mean = g, s, centre
        # ties of fractional weight broken by the cost spread
        part = (float(w[highs._fractional(w)].sum()), _spread(w, cost[cols])[1])
        if part > weight:
            heaviest, weight = g, part
    if best_g >= 0:
        cols = groups[best_g]
        high = memory[cols] > mean
        return frozenset(cols[high].tolist()), frozenset(cols[~high].tolist())
    cols = groups[heaviest]
    j = int(cols[np.argmax(x[cols])])
    return frozenset([j]), frozenset(c for c in cols.tolist() if c != j)


def _spread(w: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """The weighted mean of `values` under weights `w` and their spread about it,
    sum_i w_i |values_i - mean| (module docstring)."""
    centre = float(w @ values / w.sum())
    return centre, float(w @ np.abs(values - centre))


def _fix(h, was: frozenset[int], now: frozenset[int], upper: np.ndarray) -> None:
    """Move `h` from the columns `was` fixed at 0 to `now`."""
    free = np.array(sorted(was - now), dtype=np.int32)
    if len(free):
        h.changeColsBounds(len(free), free, np.zeros(len(free)), upper[free])
    zero = np.array(sorted(now - was), dtype=np.int32)
    if len(zero):
        h.changeColsBounds(len(zero), zero, np.zeros(len(zero)), np.zeros(len(zero)))


def _highs(
    arrays: highs.HighsArrays,
    start: float,
    time_limit: float | None,
    gap: float,
    presolve: bool,
) -> tuple[str, np.ndarray | None]:
    """HiGHS's own branch-and-bound on the program, in the time left; presolved only where the
    root splits one node (where many binaries are fractional presolve cost more than it saved,
    benchmarks/planning_time_log.md, 2026-12-01)."""
    return highs.run_highs(
        arrays,
        time_limit=_left(start, time_limit),
        msg=False,
        gap=gap,
        presolve=presolve,
    )


def _left(start: float, time_limit: float | None) -> float | None:
    return None if time_limit is None else time_limit - (time.perf_counter() - start)
