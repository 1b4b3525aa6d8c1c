"""Interleaved 1F1B in the automatic search: equal device groups, each running v model chunks.

The stage DP (`planner.inter.stage_dp`) prices 1F1B, where a device group runs one contiguous
range of layers. Interleaved 1F1B (Narayanan et al. 2021; `cost_models.pipeline`) runs C = p v
chunks, chunk c on device group c mod p, and its time depends on each group's sum over chunks
that are not contiguous, so it is searched here, beside the DP, as follows.

Formulation. For one layer clustering of L layers (`interleave_layering`: one layer per
transformer block, so that any chunk count up to the blocks can be cut), one submesh m of which
p = D / |m| >= 2 copies tile the D devices, p dividing the B micro-batches (Megatron-LM's rule, and
the runtime's: `runtime.schedules.interleaved_order`), v in `VIRTUAL_STAGES` with p v <= L, and one
stage option for every chunk (a logical mesh with its intra-op solution's per-layer profile, and a
recomputation mode: torch's interleaved schedule runs one logical mesh on every stage,
`runtime.torch_pipeline`, and the chunks of a group share one copy of a tied parameter):

    t[k, j]  = the stage DP's cost of a stage of layers k..j (time with recomputation and fixed
               costs, plus sending its boundary to the next stage and the gradient back)
    cut      = layers split into C contiguous non-empty chunks minimising max_c t_c, and among
               the cuts attaining that, sum_c t_c^2 (`balanced_cut`: two exact DPs)
    time     = pipeline_time(t_0..t_{C-1}, B, "interleaved", v)
    memory_d = device_peak_bytes over the chunks c = d (mod p) of (params_c, kept_c,
               transient_c, microbatches_in_flight("interleaved", B, p, d, v), ...)  <= budget
               (one backward at a time: the chunks' transient bytes count once)

and the `KEEP` fastest (submesh, option, recomputation, v) per layer clustering are kept; the
search (`planner.size_search`) prices them as plans (`planner.plans.assemble`: tied copies, the
sends between the chunks' real devices) beside the stage DP's 1F1B candidates and returns the
fastest. The cut is a heuristic for the interleaved objective (B max_d T_d + ...: minimising the
largest chunk, then balancing all chunks, balances the groups' sums); the price is the plan's own.
The candidates are cut once all profiles are in, in increasing order of ``B sum_l t_l / p`` (a
lower bound of their time: the busiest group carries at least the mean), until that bound
exceeds the K-th kept time; a candidate is skipped when its parameter state alone, spread evenly
over the p groups, exceeds the budget. Cutting at the end also keeps these DPs (many small
numpy operations) off the GIL while the intra-op solves run in threads
(`planner.inter.mesh_search`): there each small operation waited for the solver threads' turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from cost_models.communication import LogicalMesh
from cost_models.memory import device_peak_bytes, microbatches_in_flight
from cost_models.pipeline import pipeline_time
from planner.inter import boundaries as bd
from planner.inter import stage_table as st
from planner.inter.layers import auto_num_layers, cluster_layers, op_terms
from planner.inter.range_costs import range_footprint
from planner.tracing.opgraph import OpGraph

#: Model chunks per device group tried: 2 to 8 (the manual grid's 2, 4, 5 and 8 among them,
#: `benchmarks.manual_grid.VIRTUAL_STAGES`).
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 8)
#: Interleaved options kept per layer clustering for the plan's own pricing. They are ranked by
#: the cut's own time, which leaves out the tied copies and the sends between the chunks' real
#: devices: gpt-39b on 8x8 H100 at 32 rows per micro-batch plans 6.117 s per iteration keeping 3,
#: 5.941 keeping 6, 5.934 keeping 12 or 24. The seeds' ZeRO-2 variants (`planner.intra.megatron.
#: Seed.zero2`) about doubled the options ranked: keeping 12, gpt-39b on 8x8 A100 at 32 rows
#: then planned 19.200 s (its 19.168 s option of before fell out of the 12), keeping 24 19.164 s.
KEEP = 24
#: Most layers of the interleaving clustering (its DPs are O(C L^2)).
MAX_LAYERS = 128


def interleave_layering(graph: OpGraph) -> list[tuple[int, int]]:
    """One layer per transformer block (at most `MAX_LAYERS`), or the automatic count
    (`planner.inter.layers.auto_num_layers`) for a model without blocks."""
    flops, edges, starts = op_terms(graph)
    compute_ops = sum(1 for f in flops if f > 0)
    n = min(len(starts), MAX_LAYERS, compute_ops) if starts else auto_num_layers(flops)
    return cluster_layers(flops, edges, max(1, n))


def balanced_cut(cost: np.ndarray, C: int) -> list[tuple[int, int]] | None:
    """Split layers 0..L-1 into C contiguous non-empty chunks minimising the largest
    ``cost[k, j]`` of a chunk k..j, and among those cuts ``sum cost^2`` (module docstring); None
    when no cut has every chunk finite. Exact: a min-max DP, then a sum DP over the chunks within
    that maximum. ``cost[k, j]`` for j < k is ignored."""
    return balanced_cuts(cost, [C])[0]


def balanced_cuts(
    cost: np.ndarray,
    counts: list[int],
    wanted: Callable[[int, float], bool] | None = None,
) -> list[list[tuple[int, int]] | None]:
    """`balanced_cut` for each chunk count of `counts` (increasing), one min-max DP for all:
    its table after C chunks is the one every larger count passes through. With `wanted`, a
    count C whose least largest chunk is `top` gets its cut only where ``wanted(C, top)``
    (None otherwise: the sum DP is skipped)."""
    if list(counts) != sorted(counts):
        raise ValueError(f"chunk counts must increase, got {counts}")
    L = cost.shape[0]
    # c[i, n]: a chunk of layers i..n-1 (n layers consumed after it)
    c = np.full((L + 1, L + 1), np.inf)
    c[:L, 1:] = np.where(np.triu(np.ones((L, L), dtype=bool)), cost, np.inf)
    G = np.full(L + 1, np.inf)
    G[0] = 0.0
    done, out = 0, []
    for C in counts:
        if not 1 <= C <= L:
            out.append(None)
            continue
        # after i chunks only G[i:] can be finite (chunks are not empty): step i reads rows
        # i.. and writes columns i+1..
        for i in range(done, C):
            G[i + 1 :] = np.min(np.maximum(G[i:L, None], c[i:L, i + 1 :]), axis=0)
            G[: i + 1] = np.inf
        done = C
        if wanted is not None and not wanted(C, float(G[L])):
            out.append(None)
            continue
        out.append(_least_squares(c, G[L], C))
    return out


def _least_squares(c: np.ndarray, top: float, C: int) -> list[tuple[int, int]] | None:
    """Among the cuts into C chunks of cost at most `top` (`c` as in `balanced_cuts`), the one
    with the least sum of squared chunk costs. Step i (chunks 0..i-1 done) reads only the rows
    a cut can be at, i..L-C+i, and writes the columns i+1..L-C+i+1 (every chunk takes a layer)."""
    if not np.isfinite(top):
        return None
    L = c.shape[0] - 1
    allowed = np.where(c <= top, c * c, np.inf)
    H = np.full(L + 1, np.inf)
    H[0] = 0.0
    back = []
    w = L - C + 1  # the positions a cut can take after each chunk
    columns = np.arange(w)
    for i in range(C):
        total = H[i : i + w, None] + allowed[i : i + w, i + 1 : i + 1 + w]
        arg = np.argmin(total, axis=0)
        back.append(arg + i)
        H = np.full(L + 1, np.inf)
        H[i + 1 : i + 1 + w] = total[arg, columns]
    if not np.isfinite(H[L]):
        return None
    cuts, n = [], L
    for i in reversed(range(C)):
        k = int(back[i][n - i - 1])
        cuts.append((k, n - 1))
        n = k
    return cuts[::-1]


@dataclass(frozen=True)
class InterleavedPick:
    """One interleaved option: chunks (layer ranges, in chunk order) on submesh `submesh`, all
    run as `option` (a `planner.inter.mesh_search.StageOption`), v chunks per device group."""

    seconds: float  # the cheap price of the module docstring (no tied copies, no step overhead)
    chunks: list[tuple[int, int]]
    submesh: tuple[int, int]
    virtual_stages: int
    option: object = field(compare=False)


class _Candidate(NamedTuple):
    """One (submesh, profile, recomputation) entered into `InterleavedSearch`."""

    bound: float  # lower bound of its time (-inf where there is none)
    index: int  # entry order: ties go to the earlier
    sub: tuple[int, int]
    p: int  # device groups
    send: np.ndarray  # boundary send times on its mesh
    prof: st.LayerProfile
    recompute: str
    make_option: Any


class InterleavedSearch:
    """The `KEEP` fastest interleaved options of one layer clustering. Profiles are entered as
    the search makes them (`add`); `best` then cuts the (submesh, profile, recomputation)
    candidates in increasing order of their lower bound (module docstring) and stops at the
    first whose bound exceeds the K-th kept time: the candidates after it cannot enter. Ties go
    to the earlier entered (candidate, v), as if every candidate had been cut, so the kept
    options do not depend on the order the bounds visit them in."""

    def __init__(
        self,
        graph: OpGraph,
        layers: list[tuple[int, int]],
        num_devices: int,
        num_microbatches: int,
        budget: float,
    ) -> None:
        self.layers = layers
        self.L = len(layers)
        self.layer_of = bd.layer_of_nodes(graph, layers)
        self.bounds = bd.boundary_values(graph, self.layer_of, self.L)
        self.boundary_bytes = bd.boundary_bytes(graph, self.bounds)
        self.grad_bytes = bd.boundary_bytes(graph, self.bounds, gradients=True)
        self.D, self.B, self.budget = num_devices, num_microbatches, budget
        self._pending: list[_Candidate] = []
        # max-heap of the kept by (seconds, order): items (-seconds, -order, pick)
        self._kept: list[tuple[float, int, InterleavedPick]] = []

    def groups(self, sub: tuple[int, int]) -> int:
        """p: the device groups of submesh `sub` tiling the cluster, 0 when they cannot be
        interleaved (p < 2, p not dividing B, or too few layers for two chunks per group)."""
        size = sub[0] * sub[1]
        p = self.D // size if self.D % size == 0 else 0
        if p < 2 or self.B % p or 2 * p > self.L:
            return 0
        return p

    def _bar(self) -> tuple[float, float]:
        """(seconds, order) of the K-th kept option; (inf, inf) while fewer are kept."""
        if len(self._kept) < KEEP:
            return (np.inf, np.inf)
        seconds, order, _ = self._kept[0]
        return (-seconds, -order)

    def add(
        self,
        sub: tuple[int, int],
        mesh: LogicalMesh,
        prof: st.LayerProfile,
        crosses_hosts: bool,
        make_option,
    ) -> None:
        """Enter one profile (attributed to this clustering) on submesh `sub` for every
        recomputation mode; `make_option(recompute)` builds the chunks' `StageOption`."""
        p = self.groups(sub)
        if not p:
            return
        send = bd.send_times(
            mesh, self.boundary_bytes, crosses_hosts, grad_bytes=self.grad_bytes
        )
        for rc in prof.recompute_modes():
            # FSDP with recomputation: the recomputed forward hides more of FSDP's collectives
            # (`LayerProfile.fsdp_recompute`, terms that can be negative), so the compute alone
            # is no lower bound there
            bound = -np.inf
            if prof.gathered is None or rc == "none":
                per_layer = prof.time + prof.extra_time(rc)
                bound = self.B * float(np.sum(per_layer)) / p
            self._pending.append(
                _Candidate(
                    bound, len(self._pending), sub, p, send, prof, rc, make_option
                )
            )

    def _cut(self, c: _Candidate) -> None:
        """Cut one candidate into p v chunks for every v and keep what beats the bar."""
        _, index, sub, p, send, prof, rc, make_option = c
        B = self.B
        params, kept, transient = range_footprint(prof, rc)
        if params[0, self.L - 1] / p > self.budget:
            return
        time = prof.range_times(rc) + send[None, :]
        acc = prof.accumulate_bytes(rc)
        chunks = [v for v in VIRTUAL_STAGES if p * v <= self.L]

        def order(v: int) -> int:
            return index * len(VIRTUAL_STAGES) + VIRTUAL_STAGES.index(v)

        def wanted(C: int, top: float) -> bool:
            # with no chunk time below 0, the group holding the largest chunk (top) carries at
            # least top per micro-batch, so the time is at least B top (`pipeline_time`:
            # B device + (sum - device) / v); less a margin for the sums' rounding
            return (B * top * (1 - 1e-9), order(C // p)) < self._bar()

        counts = [p * v for v in chunks]
        bounded = bool((np.triu(time) >= 0).all())
        for v, cuts in zip(
            chunks, balanced_cuts(time, counts, wanted if bounded else None)
        ):
            if cuts is None:
                continue
            t = [float(time[k, j]) for k, j in cuts]
            seconds = pipeline_time(t, B, "interleaved", virtual_stages=v)
            if (seconds, order(v)) >= self._bar():
                continue
            ks, js = np.array(cuts).T
            memory = max(
                device_peak_bytes(
                    params[ks[d::p], js[d::p]],
                    kept[ks[d::p], js[d::p]],
                    transient[ks[d::p], js[d::p]],
                    microbatches_in_flight("interleaved", B, p, d, virtual_stages=v),
                    acc[ks[d::p], js[d::p]],
                    B,
                )
                for d in range(p)
            )
            if memory > self.budget:
                continue
            pick = InterleavedPick(seconds, cuts, sub, v, make_option(rc))
            item = (-seconds, -order(v), pick)
            if len(self._kept) < KEEP:
                heapq.heappush(self._kept, item)
            else:
                heapq.heappushpop(self._kept, item)

    def best(self) -> list[InterleavedPick]:
        """The kept options, fastest first (cutting the entered candidates first)."""
        pending, self._pending = sorted(self._pending, key=lambda c: c[:2]), []
        for c in pending:
            if c.bound > self._bar()[0]:
                break  # every later candidate's bound is at least this one's
            self._cut(c)
        return [pick for _, _, pick in sorted(self._kept, key=lambda x: (-x[0], -x[1]))]
