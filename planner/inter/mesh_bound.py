"""The least iteration time of one micro-batch size's plans as the submeshes see it: each device
group runs its layers' communication and compute for every micro-batch, and a model of L
layers has at most L groups. `planner.size_eval` gives a size up with it when a plan found
already is faster (issue 23's pruning of micro-batch candidates), where the one-device bound of
`planner.size_bound` does not: the 1T GPT on 384x8 A100s at 8 rows and fewer
(benchmarks/planning_time_log.md, 2026-12-06 14:00-15:30).

Bound. For a logical mesh m (n_m devices) and a unit U of the model (a run of consecutive ops;
the units are the common refinement of every layer clustering's cuts), lb(U, m)
(`unit_least_time`) is the optimum of the intra-op program restricted to U's ops, its edges
dropped but one activation input per op:

    minimise  sum_(v in U) c[v, s_v] + sum_(v in U) R[p(v), v, s_p(v), s_v]

with c the ops' time (`PricedStage.values`: compute, the loss's reduction), R their activation
resharding, forward and backward (`PricedStage.edge`), and p(v) one input of v inside U that
is neither a parameter nor a view of one (none: no edge term). Each op keeping one edge makes
the program a forest, solved exactly from the leaves (a min-sum pass per edge); taken with
p(v) the first such input and again with the last, the larger value counts. Every term dropped
from a solution's time for U on m is non-negative: the parameters' own costs (gradient
synchronisation, optimizer step, ZeRO / FSDP collectives), the edges leaving a parameter or a
view of one, the edges entering U from outside (a stage boundary's sends are priced apart) and
the other edges. So a stage on m holding the units of a set S runs at least their sum of
lb(U, m) per micro-batch.

Every candidate plan of the size comes from one layer clustering c (the stage DP's table, or
the interleaved chunks); its device groups are disjoint, each on one logical mesh, each holding
at least one whole layer of c, and each schedule's iteration (`cost_models.pipeline`: GPipe,
1F1B, interleaved) takes at least B times any group's time per micro-batch. With a_m(c) the
least over the layers of c of their units' summed lb on m, a plan of c takes at least B times

    tau_c = the least tau such that groups with at most N devices in all, group g on mesh m_g
            holding k_g = floor(tau / a_(m_g)(c)) layers, hold all L_c layers   (`group_bound`)

and the size's bound is B times the least tau_c (`least_time`). Memory is ignored. Zero bubble
splits the backward across its schedule, so no bound is claimed for it.

The same bound for the plans with a device group on one logical mesh m: tau_c^m, the least tau
of the covers with a group on m (`covers_with`). When B tau_c^m exceeds a plan found already for
every c (`LeastTime.exceeds_with`), no stage of m can be in a faster plan, and
`planner.inter.mesh_search` does not solve m's programs (issue 23's pruning of logical-mesh
candidates; the 1T GPT on 384x8 A100s at 32 rows: 9.2 of the 19.2 s of its meshes' solves
against the plan of 70.06 s found at 16 rows, benchmarks/planning_time_log.md, 2026-12-06).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from planner.intra.priced_stage import PricedStage
from planner.tracing.opgraph import OpGraph


def unit_least_time(graph: OpGraph, ctx: PricedStage, ops: Sequence[str]) -> float:
    """lb(U, m) of the module docstring for the ops `ops` priced by `ctx` (one logical mesh)."""
    inside = set(ops)
    inputs = {
        v: [
            u
            for u in dict.fromkeys(graph.node(v).inputs)
            if u in inside and u not in ctx.param_derived
        ]
        for v in ops
    }
    own = {v: ctx.costs(v) for v in ops}
    best = 0.0
    for pick in (0, -1):
        parent = {v: ins[pick] for v, ins in inputs.items() if ins}
        f = dict(own)
        # consumers after producers, so a child is done before its parent
        for v in reversed(ops):
            u = parent.get(v)
            if u is not None:
                act, grad = ctx.edge(u, v)
                f[u] = f[u] + np.min(act + grad + f[v][None, :], axis=1)
        best = max(best, sum(float(f[v].min()) for v in ops if v not in parent))
    return best


def group_bound(items: Sequence[tuple[int, float]], layers: int, devices: int) -> float:
    """tau_c of the module docstring: `items` are (devices n_m, least time a_m of a layer) per
    logical mesh. Exact: tau is one of the values k * a_m (k = 1..layers), the least of them
    whose cover (an unbounded knapsack over the devices, `_cover`) holds every layer; inf when
    no mesh fits the devices."""
    least = _least_per_count(items, devices)
    if not least:
        return math.inf
    if min(least.values()) <= 0:
        return 0.0
    taus = np.unique([k * a for a in least.values() for k in range(1, layers + 1)])
    lo, hi = 0, len(taus) - 1
    if _cover(least, taus[hi], layers, devices) < layers:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if _cover(least, taus[mid], layers, devices) >= layers:
            hi = mid
        else:
            lo = mid + 1
    return float(taus[lo])


def covers_with(
    items: Sequence[tuple[int, float]], m: int, layers: int, devices: int, tau: float
) -> bool:
    """Whether groups of at most `devices` devices in all, one of them on the mesh `items[m]`
    = (n_m, a_m), each within `tau`, hold every layer: tau_c^m <= tau. The group on m holds
    floor(tau / a_m) layers (at least one), the other devices the rest (`_cover`, any mesh)."""
    n_m, a_m = items[m]
    if n_m > devices:
        return False
    least = _least_per_count(items, devices)
    if min(least.values()) <= 0:
        return True  # a bound of 0: it never rules a mesh out
    if tau < a_m:
        return False
    rest = layers - min(layers, math.floor(tau / a_m * (1 + 1e-12)))
    return rest <= 0 or _cover(least, tau, rest, devices - n_m) >= rest


def _least_per_count(
    items: Sequence[tuple[int, float]], devices: int
) -> dict[int, float]:
    """The least a of the meshes of each device count n <= `devices` (a group of n devices
    takes the fastest of them)."""
    least: dict[int, float] = {}
    for n, a in items:
        if n <= devices and a < least.get(n, math.inf):
            least[n] = a
    return least


def _cover(least: dict[int, float], tau: float, layers: int, devices: int) -> int:
    """The most layers groups of at most `devices` devices in all hold within `tau` each: an
    unbounded knapsack, item n (a group of n devices) worth min(layers, floor(tau / least[n]))
    layers. Item by item; within one, held[c] = max over j of held_before[c - j n] + j k, on the
    capacities of one residue mod n at once (a running maximum of held - index * k)."""
    held = np.zeros(devices + 1)
    for n, a in least.items():
        k = min(layers, math.floor(tau / a * (1 + 1e-12)))
        if k == 0:
            continue
        rows = -(-(devices + 1) // n)
        grid = np.full(rows * n, -np.inf)
        grid[: devices + 1] = held
        grid = grid.reshape(rows, n)
        step = (np.arange(rows) * k)[:, None]
        grid = np.maximum.accumulate(grid - step, axis=0) + step
        held = grid.reshape(-1)[: devices + 1]
    return int(held[devices])


class LeastTime:
    """B times the least tau_c over `clusterings` (each a list of (first, last) op indices per
    layer) on `meshes` ((devices, its prices, made when called) per logical mesh a plan may
    use), computed only as far as `exceeds` (and `exceeds_with`) needs: adding a mesh can only
    lower the bound, so once the meshes priced so far give `seconds` or less, so do all of them,
    and the rest are left unpriced (until a lower `seconds` is asked)."""

    def __init__(
        self,
        graph: OpGraph,
        clusterings: Sequence[Sequence[tuple[int, int]]],
        meshes: Sequence[tuple[int, Callable[[], PricedStage]]],
        num_microbatches: int,
        devices: int,
    ) -> None:
        self.graph, self.meshes = graph, meshes
        self.B, self.devices = num_microbatches, devices
        self.layers = [len(c) for c in clusterings]
        self.ops = [n.name for n in graph.ops]
        cuts = sorted({a for c in clusterings for a, _ in c} | {len(self.ops)})
        self.units = list(itertools.pairwise(cuts))
        # per clustering: the units each layer begins at and ends before (prefix-sum indices)
        self.spans = [
            (
                np.searchsorted(cuts, [a for a, _ in c]),
                np.searchsorted(cuts, [z + 1 for _, z in c]),
            )
            for c in clusterings
        ]
        # per clustering, (devices, a) of each mesh added so far, in the order added (`added`)
        self.items: list[list[tuple[int, float]]] = [[] for _ in clusterings]
        self.added: list[int] = []
        self.left = list(range(len(meshes)))  # the meshes not added, in their order
        # the bound on the meshes added so far (when not `_stale`)
        self.seconds = math.inf
        self._stale = False

    def exceeds(self, seconds: float) -> bool:
        """Whether the bound on every mesh exceeds `seconds`; meshes are added (and the bound
        taken again after 1, 2, 4, ... of them and the last) while it may."""
        while self.seconds > seconds and self.left:
            self._add(self.left[0])
            added = len(self.added)
            if added & (added - 1) == 0 or not self.left:
                self._refresh()
        if not self.left and self._stale:
            self._refresh()
        return self.seconds > seconds

    def exceeds_with(self, m: int, seconds: float) -> bool:
        """Whether every plan with a device group on mesh m (its index in `meshes`) takes more
        than `seconds`: B tau_c^m > seconds for every clustering c. Covers on some of the meshes
        are covers on all of them, so m is priced first and the rest (1, 2, 4, ... more at a
        time) only until a cover within `seconds` is found; every mesh when none is."""
        if m in self.left:
            self._add(m)
        step, tau = 1, seconds / self.B
        while True:
            k = self.added.index(m)
            if any(
                covers_with(it, k, L, self.devices, tau)
                for it, L in zip(self.items, self.layers)
            ):
                return False
            if not self.left:
                return True
            for i in self.left[:step]:
                self._add(i)
            step *= 2

    def _refresh(self) -> None:
        self.seconds = self.B * min(
            group_bound(it, L, self.devices) for it, L in zip(self.items, self.layers)
        )
        self._stale = False

    def _add(self, i: int) -> None:
        devices, prices = self.meshes[i]
        ctx, ops = prices(), self.ops
        memo: dict[tuple, float] = {}  # the copies of a repeated block price alike
        sums = np.zeros(len(self.units) + 1)
        for u, (a, z) in enumerate(self.units):
            key = tuple(ctx.rep.get(v, v) for v in ops[a:z])
            if key not in memo:
                memo[key] = unit_least_time(self.graph, ctx, ops[a:z])
            sums[u + 1] = sums[u] + memo[key]
        for c, (first, after) in enumerate(self.spans):
            self.items[c].append((devices, float(np.min(sums[after] - sums[first]))))
        self.added.append(i)
        self.left.remove(i)
        self._stale = True


def least_time(
    graph: OpGraph,
    clusterings: Sequence[Sequence[tuple[int, int]]],
    meshes: Sequence[tuple[int, Callable[[], PricedStage]]],
    num_microbatches: int,
    devices: int,
) -> float:
    """`LeastTime`'s bound on every mesh."""
    bound = LeastTime(graph, clusterings, meshes, num_microbatches, devices)
    bound.exceeds(-math.inf)
    return bound.seconds
