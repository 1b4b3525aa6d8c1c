"""The stage DP's cost table: latency of every (layer range, submesh, stages remaining).

For one micro-batch size and one (submesh, logical mesh), the intra-op program is solved over the
whole model (the repeated-block quotient keeps it small) at a ladder of memory budgets, and with the
parameters restricted to Megatron's placements (seeds, `planner.intra.megatron`), all sharing one pricing
of the options (`planner.inter.stage_solves.profiles_for`); each solution is a `LayerProfile`: its time and
memory attributed to layers (an edge to its consumer's layer, a parameter to its first consumer's;
one solution serves several layer clusterings). A stage's cost for layers k..j is then a difference of prefix sums
(principle 4: solved once, reused for every range). Memory of a stage holding layers k..j with s
stages from it to the end (`cost_models.memory.stage_peak_bytes`; inflight is what the schedule
keeps there, `cost_models.memory.microbatches_in_flight`: min(B, s) for 1F1B, B for GPipe):

    recompute none:      params[k..j] + inflight * activations[k..j]
    recompute selective: params[k..j] + inflight * kept[k..j] + recomputed(kept, kept + core bytes
                         of one attention core), kept = activations - core bytes
    recompute full:      params[k..j] + inflight * block_kept[k..j] + recomputed(block_kept,
                         block_held: held(l) of `planner.inter.full_recompute`)
    recompute layer:     params[k..j] + inflight * inputs[k..j] + recomputed(inputs, inputs +
                         activations)

where recomputed(kept, held)[k, j] = max(0, max over l of (kept[k..l-1] + held[l]) - kept[k..j])
is what lives while one layer l is recomputed beyond the back-propagated micro-batch's kept
bytes, held[l] including what l still keeps then (backward runs from j down, so the layers
after l are done: `planner.inter.range_costs.recomputed`),

plus, in every mode, what the backward holds besides saved activations and priced gradients
(`LayerProfile.backward_bytes`, `planner.inter.held_memory`: the largest op's activation
gradients net of the gradients not yet made when it runs, `planner.inter.grad_timeline`; ZeRO
gradients held whole until the step's sync; and a second set of fresh gradients
during later micro-batches' backward on compiled graphs, `LayerProfile.accumulate_bytes`),
and recomputation adds to the time the blocks' (full) or the layers' (layer) forward, or their
attention cores' (selective), each with half the resharding on the edges into the recomputed ops
(`planner.inter.full_recompute`, `planner.inter.selective`; full checkpoints each transformer block,
keeping the blocks' inputs and what runs outside the blocks). FSDP parameters
(`planner.intra.fsdp_prices`, ZeRO stage 3) add twice the largest FSDP unit's gathered bytes to
the transient term (the unit running and the next one gathered; a unit is a layer cut where each
transformer block begins, `planner.tracing.blocks.block_units`; with "layer" recomputation twice
the largest layer's), and their collectives count only by
the part compute does not hide (`planner.intra.fsdp_prices.fsdp_exposed`, its overlap model):
forward gathers behind the layer's forward compute, backward gathers and the next layer's
reduce-scatters behind its backward compute; the first layer's reduce-scatters and the first gather
of each pass (the first layer's in forward, the last layer's in backward) in full (range terms in
``fixed``). A recomputing stage with FSDP parameters (`runtime.fsdp`: the recomputed forward reads
the backward's gathered copies, so the collectives are the same) prices the same overlap with the
recomputed forward counted as backward compute (K_l + X_l; `LayerProfile.fsdp_recompute`), and the
same memory (a layer's gathered copies and the next one's while its backward runs). The latency of the gradient
all-reduce buckets a range holds is added once per bucket (`planner.intra.prices.grad_buckets`),
and the runtime's overhead per stage and micro-batch once. The table charges the gradient
all-reduce exposed; the assembled plan's stage time adds what capped buckets overlapping the
backward change (`planner.inter.dp_overlap`, `planner.plans.assemble.dp_sync`).
Zero bubble (`planner.inter.stage_dp` with ``by_total``: s is then the number of stages in all)
keeps min(B, s) micro-batches in flight on every stage and adds the weight products' output
gradients it defers (`planner.inter.wgrad`) times min(B, s), the most any of its stages defers
(`cost_models.memory.weight_grads_pending`: stage i defers min(B, i + 1)); the plan's own memory
(`planner.plans.assemble`) counts each stage's exact number.
A range's cost is the fastest option (logical mesh, memory level, recomputation none, selective,
full or layer; `LayerProfile.recompute_modes`) that fits the
budget, plus sending the boundary activations to the next stage and their gradient back
(`planner.inter.boundaries.send_times`); +inf if none fits (`planner.inter.range_costs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.errors import MeshplanError
from planner.inter import boundaries as bd
from planner.inter.full_recompute import layer_terms, node_terms
from planner.inter.grad_timeline import grad_timeline, net_backward_work
from planner.inter.held_memory import backward_terms, cached_on, resharded_saves
from planner.inter.ranges import range_max, range_sums
from planner.inter.selective import selective_table
from planner.inter.wgrad import wgrad_table
from planner.intra.fsdp_prices import fsdp_exposed
from planner.intra.prices import Option
from planner.intra.solution import StageSolution
from planner.tracing.attention import attention_cores
from planner.tracing.blocks import block_units, layer_ranges
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards
from planner.vocab.plan_check import RECOMPUTE_MODES, recompute_mode


@dataclass
class LayerProfile:
    solution: StageSolution
    time: np.ndarray  # per layer, seconds per micro-batch
    fwd: np.ndarray  # forward compute per layer (added when recomputing)
    params: np.ndarray  # parameter-state bytes per layer
    acts: np.ndarray  # activation bytes per layer and micro-batch
    inputs: np.ndarray  # bytes of each layer's input boundary (kept when recomputing)
    # [k, j]: seconds per micro-batch a stage of layers k..j pays once, however many layers it
    # holds: the latency of its gradient buckets (`planner.intra.prices.grad_buckets`; `time` has
    # their bandwidth only), the runtime's per-micro-batch overhead (`StageSolution.overhead_s`)
    # and what of its FSDP collectives only the range's ends decide (`fsdp_exposed`: the first
    # layer's reduce-scatter, the first gather of each pass)
    fixed: np.ndarray
    # bytes per layer of its FSDP parameters' gathered copies (`fsdp_prices.fsdp_gathered_bytes`)
    gathered: np.ndarray | None = None
    # per FSDP unit (`planner.tracing.blocks.block_units`: a layer cut where each transformer
    # block begins), rows F, K, G, R of `fsdp_exposed` (forward and backward compute, all-gathers
    # of one pass, reduce-scatters); `time` and `fixed` hide them as without recomputation,
    # `fsdp_recompute` says what recomputation changes; None without FSDP parameters
    fsdp_terms: np.ndarray | None = None
    # selective recomputation (`planner.inter.selective`), per layer: the seconds it adds, the
    # activation bytes per micro-batch it does not keep, and the largest core's (live while it
    # is recomputed); None when the model has no attention core
    core_time: np.ndarray | None = None
    core_bytes: np.ndarray | None = None
    core_peak: np.ndarray | None = None
    # per layer: the weight-gradient products of its backward (`planner.inter.wgrad`), what a
    # zero-bubble schedule defers, and the bytes of their output gradients kept until then
    wgrad: np.ndarray | None = None
    wgrad_bytes: np.ndarray | None = None
    # what the backward holds besides saved activations and priced gradients
    # (`planner.inter.held_memory`): per span of last layers, per layer its largest op's
    # activation-gradient bytes net of the layer's gradients not yet made then, and the
    # gradients of its parameters made in it (`planner.inter.grad_timeline`); per layer the
    # bytes of its parameters' fresh gradients and of those the parameter state prices
    grad_work: list[tuple[int, np.ndarray, np.ndarray]] | None = None
    grad_raw: np.ndarray | None = None  # per layer: its largest op's, not net
    fresh_grads: np.ndarray | None = None
    priced_grads: np.ndarray | None = None
    # node -> layer of the clustering the profile attributes to (`planner.inter.dp_overlap`
    # finds a stage's gradient buckets from it)
    layer_of: dict[str, int] | None = None
    # full recomputation (`planner.inter.full_recompute`), per layer: the seconds "layer" adds,
    # and "full"'s (each transformer block checkpointed) seconds, kept bytes per micro-batch and
    # bytes held while one of its blocks is recomputed (held(l)); the "full" ones None for a
    # model without blocks (it is checkpointed by layer)
    redo: np.ndarray | None = None
    block_redo: np.ndarray | None = None
    block_kept: np.ndarray | None = None
    block_held: np.ndarray | None = None
    # per layer: its largest FSDP unit's gathered bytes (a parameter counts in its first
    # consumer's unit)
    unit_gathered: np.ndarray | None = None
    # with FSDP parameters: each unit's layer, and per recomputation mode the seconds it adds
    # to each unit (`fsdp_recompute`)
    unit_layer: np.ndarray | None = None
    unit_extra: dict[str, np.ndarray] | None = None

    def backward_bytes(self) -> np.ndarray:
        """[k, j]: the backward's bytes beyond activations and parameter state for a stage of
        layers k..j (`planner.inter.held_memory`): the largest op's activation gradients net
        of the gradients not yet made when it runs (`planner.inter.grad_timeline`) and ZeRO
        gradients held whole until the step's sync (the second set of fresh gradients with
        several micro-batches: `accumulate_bytes`)."""
        L = len(self.time)
        if self.grad_work is None:
            return np.zeros((L, L))
        return self._net_work + range_sums(self.fresh_grads - self.priced_grads)

    def accumulate_bytes(self, recompute: str) -> np.ndarray:
        """[k, j]: what a later micro-batch's backward holds beyond the first's
        (`cost_models.memory.stage_peak_bytes`'s ``accumulating``): on compiled graphs (no
        recomputation, no FSDP) a second set of fresh gradients; run eagerly, the gradients
        the first's working set found not yet made (`unmade_bytes`), accumulated by then."""
        L = len(self.time)
        compiled = recompute_mode(recompute) == "none" and self.gathered is None
        if self.fresh_grads is None:
            return np.zeros((L, L))
        if not compiled:
            return self.unmade_bytes()
        return range_sums(self.fresh_grads)

    def unmade_bytes(self) -> np.ndarray:
        """[k, j]: how much less the largest backward working set is counted for the gradients
        not yet made when it runs (`planner.inter.grad_timeline`): only the first micro-batch
        of a step finds them so; a later one's backward runs next to the accumulated ones."""
        L = len(self.time)
        if self.grad_work is None:
            return np.zeros((L, L))
        return range_max(self.grad_raw) - self._net_work

    @functools.cached_property
    def _net_work(self) -> np.ndarray:
        """[k, j]: the largest backward working set net of the gradients not yet made
        (`planner.inter.grad_timeline`); asked for by every option the search prices."""
        return net_backward_work(self.grad_work, len(self.time))

    def recompute_modes(self) -> tuple[str, ...]:
        """The recomputation modes worth pricing: selective only where the model has attention
        cores (`planner.tracing.attention`), "layer" only where "full" checkpoints blocks
        (without blocks both checkpoint each layer)."""
        return tuple(
            m
            for m in RECOMPUTE_MODES
            if (m != "selective" or self.core_time is not None)
            and (m != "layer" or self.block_kept is not None)
        )

    def extra_time(self, recompute: str) -> np.ndarray | float:
        """Per layer: the seconds per micro-batch recomputation `recompute` adds (True and
        False read as full and none)."""
        recompute = recompute_mode(recompute)
        if recompute == "layer" or (recompute == "full" and self.block_redo is None):
            return self.fwd if self.redo is None else self.redo
        if recompute == "full":
            return self.block_redo
        if recompute == "selective":
            return need_cores(self.core_time)
        return 0.0

    def fsdp_recompute(self, recompute: str) -> tuple[np.ndarray, np.ndarray]:
        """(per layer, [k, j]): what recomputation `recompute` changes in the FSDP collectives
        compute does not hide (`fsdp_exposed`): the recomputed forward is backward compute
        (K_l + X_l, X_l = `extra_time`), behind which the layer's backward gathers and the next
        layer's reduce-scatters run as well (`runtime.fsdp`: the recomputed forward reads the
        backward's gathered copies; the same two all-gathers and one reduce-scatter per
        parameter and micro-batch). Zeros without FSDP or recomputation."""
        L = len(self.time)
        recompute = recompute_mode(recompute)
        if self.fsdp_terms is None or recompute == "none":
            return np.zeros(L), np.zeros((L, L))
        if recompute == "selective":
            need_cores(self.core_time)
        F, K, G, R = self.fsdp_terms
        X = self.unit_extra[recompute]
        e0, first0, last0 = fsdp_exposed(F, K, G, R)
        e1, first1, last1 = fsdp_exposed(F, K + X, G, R)
        per_layer, first, last = _by_layer(
            self.unit_layer, e1 - e0, first1 - first0, last1 - last0, L
        )
        return per_layer, first[:, None] + last[None, :]

    def range_times(self, recompute: str) -> np.ndarray:
        """[k, j]: per-micro-batch time of a stage holding layers k..j (recomputation adds its
        forward, and changes what FSDP's collectives leave exposed, `fsdp_recompute`)."""
        per_layer, fixed = self.fsdp_recompute(recompute)
        return range_sums(self.time + self.extra_time(recompute) + per_layer) + (
            self.fixed + fixed
        )

    def range_time(self, k: int, j: int, recompute: str) -> float:
        """Per-micro-batch time of a stage holding layers k..j (`range_times`)."""
        t = self.time[k : j + 1].sum() + self.fixed[k, j]
        extra = np.broadcast_to(self.extra_time(recompute), self.time.shape)
        per_layer, fixed = self.fsdp_recompute(recompute)
        return float(
            t + extra[k : j + 1].sum() + per_layer[k : j + 1].sum() + fixed[k, j]
        )


def need_cores(x: np.ndarray | None) -> np.ndarray:
    """`x`, the attention cores' per-layer figures; MeshplanError when the model has none."""
    if x is None:
        raise MeshplanError(
            "selective recomputation needs an attention core (scaled_dot_product_attention, "
            "or a softmax between two matrix products of activations); this model has none"
        )
    return x


def profile(
    sol: StageSolution,
    graph: OpGraph,
    layer_of: dict[str, int],
    bounds: list[list[str]],
    L: int,
) -> LayerProfile:
    """Attribute a whole-model solution's time and memory to the L layers of one clustering (cheap:
    the per-node costs are computed once per solution, so one solution serves several clusterings)."""
    names, table = sol.node_cost_table()
    index = _layer_index(layer_of, names)
    arr = _sum_rows(index, table, L)
    inputs = np.zeros(L)
    local = _memo(sol, graph, "local_output_bytes", dict)
    for k, values in enumerate(bounds):
        for v in values:
            if v not in local:
                opt: Option = sol.choice.get(v)
                node = graph.node(v)
                local[v] = (
                    node.output_bytes
                    if opt is None
                    else node.output_bytes
                    / shards(opt.strategy.output[0], sol.mesh_shape)
                )
            inputs[k] += local[v]
    fixed = np.full((L, L), sol.overhead_s)
    columns = np.arange(L)
    for bucket in sol.buckets.values():
        # a range k..j holds the bucket when a consumer's layer lies in it: j >= the first
        # such layer from k on (L where none)
        held = np.unique([layer_of.get(n, 0) for n in bucket.consumers])
        first = np.append(held, L)[np.searchsorted(held, columns)]
        fixed += (columns[None, :] >= first[:, None]) * (
            bucket.latency_s / sol.num_microbatches
        )
    time, fwd, params, acts = arr.T.copy()
    gathered = terms = None
    unit_layer = unit = unit_gathered = None
    if sol.fsdp_params:
        # per unit: its ops' forward + backward and forward compute, its FSDP parameters'
        # all-gathers of one pass, reduce-scatters and gathered bytes (`StageSolution.fsdp_table`;
        # a parameter counts in the unit of its first consumer); `fsdp_exposed` of a range of
        # units is the sum of its per-unit terms plus its ends' (so per layer: sums, and the
        # layer's first and last unit's ends)
        unit, unit_layer = _units(graph, layer_of, names)
        sums = _sum_rows(unit, sol.fsdp_table(), len(unit_layer))
        both, F, G, R, g = sums.T
        K = both - F  # backward compute
        exposed, first, last = _by_layer(unit_layer, *fsdp_exposed(F, K, G, R), L)
        terms = np.stack([F, K, G, R])
        gathered, unit_gathered = np.zeros(L), np.zeros(L)
        np.add.at(gathered, index, sol.fsdp_table()[:, 4])
        np.maximum.at(unit_gathered, unit_layer, g)
        # `time` has the collectives in full (`fsdp_prices.zero_cost` on the node, no gradient
        # all-reduce on its edges: `PricedStage.edge_terms`)
        collectives = np.zeros(L)
        np.add.at(collectives, unit_layer, 2 * G + R)
        time -= collectives - exposed
        fixed += first[:, None] + last[None, :]
    cores = _cores(graph)
    selective: tuple[np.ndarray | None, ...] = (None, None, None)
    if cores:
        seconds, dropped, core = selective_table(sol, graph, cores)
        per_core = np.zeros(max(cores.values()) + 1)
        np.add.at(per_core, core[core >= 0], dropped[core >= 0])
        # each core's bytes at its first node's layer (the largest where several meet)
        inner = np.nonzero(core >= 0)[0]
        ids, first = np.unique(core[inner], return_index=True)
        peak = np.zeros(L)
        np.maximum.at(peak, index[inner[first]], per_core[ids])
        core_time, core_bytes = np.zeros(L), np.zeros(L)
        np.add.at(core_time, index, seconds)
        np.add.at(core_bytes, index, dropped)
        selective = (core_time, core_bytes, peak)
    wgrad = np.zeros((2, L))
    for row, per_node in zip(wgrad, wgrad_table(sol, graph)):
        np.add.at(row, index, per_node)
    resaved = resharded_saves(sol, graph)
    np.add.at(
        acts, _layer_index(layer_of, _keys(sol, graph, resaved)), _values(resaved)
    )
    full = layer_terms(node_terms(sol, graph), index, _saved(sol, graph), L)
    work, grads = backward_terms(sol, graph, layer_of)
    fresh, priced = np.zeros(L), np.zeros(L)
    param_names = _keys(sol, graph, grads)
    at = _layer_index(layer_of, param_names)
    param_fresh = np.fromiter((f for f, _ in grads.values()), float, len(grads))
    np.add.at(fresh, at, param_fresh)
    np.add.at(
        priced, at, np.fromiter((p for _, p in grads.values()), float, len(grads))
    )
    grad_raw = np.zeros(L)
    np.maximum.at(
        grad_raw, _layer_index(layer_of, _keys(sol, graph, work)), _values(work)
    )
    grad_work = grad_timeline(
        graph,
        layer_of,
        _keys(sol, graph, work),
        _values(work),
        param_names,
        param_fresh,
        L,
    )
    unit_extra = None
    if unit is not None:
        rc = node_terms(sol, graph)
        per_node = {
            "layer": rc.redo,
            "full": np.where(rc.block >= 0, rc.redo, 0.0)
            if (rc.block >= 0).any()
            else rc.redo,
        }
        if cores:
            per_node["selective"] = seconds
        unit_extra = {}
        for mode, x in per_node.items():
            unit_extra[mode] = np.zeros(len(unit_layer))
            np.add.at(unit_extra[mode], unit, x)
    return LayerProfile(
        sol,
        time,
        fwd,
        params,
        acts,
        inputs,
        fixed,
        gathered,
        terms,
        *selective,
        *wgrad,
        grad_work=grad_work,
        grad_raw=grad_raw,
        fresh_grads=fresh,
        priced_grads=priced,
        layer_of=layer_of,
        redo=full[0],
        block_redo=full[1],
        block_kept=full[2],
        block_held=full[3],
        unit_gathered=unit_gathered,
        unit_layer=unit_layer,
        unit_extra=unit_extra,
    )


def least_layer_params(sol: StageSolution, layer_of: dict[str, int], L: int) -> float:
    """The least parameter-state bytes of any of the L layers of `layer_of` under `sol`: the
    `params` of its `profile`, made without the rest. A stage (or interleaved chunk) holds at
    least one layer, so where this exceeds the memory budget no range of that clustering fits
    and the solution need not be profiled for it (`planner.inter.mesh_search`)."""
    names, table = sol.node_cost_table()
    index = _layer_index(layer_of, names)
    return float(np.bincount(index, weights=table[:, 2], minlength=L).min())


def _memo(sol: StageSolution, graph: OpGraph, key: str, make) -> Any:
    """``make()``, kept with the solution under `key` when `graph` is its own (`held_memory`)."""
    return cached_on(sol, graph, (key,), make)


def _keys(sol: StageSolution, graph: OpGraph, terms: dict) -> list[str]:
    """The node names of a per-node dict derived from the solution, as one list object per
    key set (so that `_layer_index` finds it again for the next clustering)."""
    lists = _memo(sol, graph, "name_lists", dict)
    names = list(terms)
    return lists.setdefault(tuple(names), names)


def _values(terms: dict[str, float]) -> np.ndarray:
    return np.fromiter(terms.values(), float, len(terms))


def _saved(sol: StageSolution, graph: OpGraph) -> np.ndarray:
    """Each node's saved bytes per micro-batch, in `node_cost_table`'s order: its priced
    activations and the redistributed inputs it saves (`held_memory.resharded_saves`)."""

    def make() -> np.ndarray:
        names, table = sol.node_cost_table()
        saved = table[:, 3].copy()
        position = {n: i for i, n in enumerate(names)}
        for n, b in resharded_saves(sol, graph).items():
            saved[position[n]] += b
        return saved

    return _memo(sol, graph, "saved_bytes", make)


# the last few (layer_of, node names, layer of each name): the search attributes many
# solutions of one graph, whose node names come in one order, to each of a few clusterings
_LAYER_INDEX: list[tuple[dict[str, int], list[str], np.ndarray]] = []


def _layer_index(layer_of: dict[str, int], names: list[str]) -> np.ndarray:
    """The layer of each of `names` (0 where `layer_of` has none); kept for the last few."""
    for known, known_names, index in _LAYER_INDEX:
        if known is layer_of and (known_names is names or known_names == names):
            return index
    index = np.fromiter(
        (layer_of.get(n, 0) for n in names), dtype=int, count=len(names)
    )
    _LAYER_INDEX.insert(0, (layer_of, names, index))
    del _LAYER_INDEX[64:]
    return index


def _by_layer(
    unit_layer: np.ndarray, e: np.ndarray, first: np.ndarray, last: np.ndarray, L: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`fsdp_exposed`'s (e, first, last) of units as those of their layers: e summed, first of a
    layer its first unit's, last its last unit's."""
    out = np.zeros(L)
    np.add.at(out, unit_layer, e)
    starts = np.searchsorted(unit_layer, np.arange(L))
    ends = np.searchsorted(unit_layer, np.arange(L), side="right") - 1
    return out, first[starts], last[ends]


# the last few (layer_of, node names): each node's FSDP unit and each unit's layer
_UNITS: list[tuple[dict[str, int], list[str], tuple[np.ndarray, np.ndarray]]] = []


def _units(
    graph: OpGraph, layer_of: dict[str, int], names: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The FSDP unit of each of `names` (`planner.tracing.blocks.block_units` of the layers)
    and each unit's layer; kept for the last few clusterings."""
    for known, known_names, out in _UNITS:
        if known is layer_of and (known_names is names or known_names == names):
            return out
    units, ranges = block_units(graph, layer_ranges(graph, layer_of))
    unit_of = bd.layer_of_nodes(graph, units)
    unit_layer = np.zeros(len(units), dtype=int)
    for k, (a, b) in enumerate(ranges):
        unit_layer[a : b + 1] = k
    out = (np.fromiter((unit_of.get(n, 0) for n in names), int, len(names)), unit_layer)
    _UNITS.insert(0, (layer_of, names, out))
    del _UNITS[8:]
    return out


# the last few graphs' attention cores: the search profiles many solutions of one graph
_CORES: list[tuple[OpGraph, dict[str, int]]] = []


def _cores(graph: OpGraph) -> dict[str, int]:
    for g, cores in _CORES:
        if g is graph:
            return cores
    _CORES.insert(0, (graph, attention_cores(graph)))
    del _CORES[4:]
    return _CORES[0][1]


def _sum_rows(index: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """``np.add.at(np.zeros((n, k)), index, rows)`` (row i of `rows` added into row index[i]),
    one `np.bincount` per column: the same sums in the same order, several times faster than
    ``add.at`` on 2-D arrays (numpy 2.4; on 1-D they are alike)."""
    return np.stack(
        [np.bincount(index, weights=col, minlength=n) for col in rows.T], axis=1
    ).reshape(n, rows.shape[1])
