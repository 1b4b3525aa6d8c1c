"""The solutions a stage table is built from: for one micro-batch size and one (submesh, logical
mesh), the intra-op program (`planner.intra.solve.solve_stage`) solved over the whole model at a
ladder of memory budgets, and with the parameters restricted to Megatron's placements (seeds,
`planner.intra.megatron.seed_filters`), all sharing one pricing of the options
(`planner.intra.solve.price_stage`); each solution attributed to layers as a
`planner.inter.stage_table.LayerProfile`, from which the stage table prices every layer range.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner.inter.stage_table import LayerProfile, profile
from planner.intra.batch_split import batch_split_options
from planner.intra.context import context_filter
from planner.intra.fsdp_prices import hybrid_axes, param_state_bytes
from planner.intra.ilp import SolveTimeLimitError
from planner.intra.megatron import (
    ParamFilter,
    Seed,
    allowed_options,
    both_filters,
    sequence_filter,
)
from planner.intra.prices import StageSettings, node_options, zero2_option
from planner.intra.solution import StageSolution
from planner.intra.solve import StagePricing, price_stage, solve_stage, with_zero2
from planner.tracing.opgraph import OpGraph

#: Relative optimality gap of the memory ladder's solves. A rung is a sample of the trade-off
#: between time and memory at a budget picked as a fraction of the time-optimal solution's
#: memory; proving it within 1e-7 (`planner.intra.highs.GAP_REL`) took most of the search where
#: the budget binds (mixtral-8x7b on 8x8 H100s: 20 rungs with a fractional relaxation, 113 s
#: of CPU, the largest 37 s). Within 3e-4 a rung's stage is at most 0.03% slower than that
#: budget's optimum. 3e-4 rather than 1e-4: a rung of moe-10b on 16 V100s (micro-batch 32) found
#: its solution at 13.5 s and spent 25 s more proving it within 1e-4 (9.8 s to 3e-4, the same
#: solution). The 108 rungs over 0.2 s of eight benchmark cases, each solved at both gaps, took
#: 217.8 s at 1e-4 and 185.4 s at 3e-4, the others alone 166.5 and 172.4 s (HiGHS's path moves
#: with the gap: mixtral-8x7b's largest rung 24.2 and 31.9 s, the same solution); no solution
#: came out more than 0.03% slower (benchmarks/planning_time_log.md, 2026-12-06 19:31).
LADDER_GAP = 3e-4

#: Seconds each HiGHS run of the search may take (`solve_time_limit`): a safety net, not a
#: budget. The longest programs measured on the benchmark cases took under 50 s on this 2-core
#: machine (a memory rung of moe-10b on 16 V100s, 39-48 s at a 1e-4 gap; of moe-70b on 8x8
#: A100s, 18.6-25 s; benchmarks/planning_time_log.md, 2026-12-05 and 06). At the limit a
#: branch-and-bound returns its best solution with a warning.
SOLVE_TIME_LIMIT_S = 300.0


def solve_time_limit() -> float:
    """`SOLVE_TIME_LIMIT_S`, or the seconds `MESHPLAN_SOLVE_TIME_LIMIT` gives."""
    env = os.environ.get("MESHPLAN_SOLVE_TIME_LIMIT")
    if env is None:
        return SOLVE_TIME_LIMIT_S
    try:
        seconds = float(env)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:
        raise MeshplanError(
            f"MESHPLAN_SOLVE_TIME_LIMIT must be a positive number of seconds, got {env!r}"
        )
    return seconds


def profiles_for(
    graph: OpGraph,
    mesh: LogicalMesh,
    layer_of: dict[str, int],
    bounds: list[list[str]],
    num_layers: int,
    *,
    num_microbatches: int,
    budget: float,
    optimizer: str,
    param_filter: ParamFilter | None = None,
    batch_axes: tuple[int, ...] = (),
    activation_filter: ParamFilter | None = None,
    ladder: tuple[float, ...] = (0.35, 0.12, 0.04),
    seeds: Sequence[Seed] = (),
    lean_layers: tuple[dict[str, int], list[list[str]], int] | None = None,
    seeds_only: bool = False,
    pricing: StagePricing | None = None,
) -> list[LayerProfile]:
    """The time-optimal solution, then solutions under shrinking whole-model memory budgets
    (`ladder`, fractions of the time-optimal solution's memory, until the layers are lean: those
    of `layer_of`, or of `lean_layers` (layer_of, bounds, count) when given), then
    the time-optimal solution with the parameters restricted to each of `seeds` (e.g. Megatron's
    placements, `planner.intra.megatron.seed_filters`: their memory often lies between the ladder's
    rungs), and for a seed with ``zero2`` its ZeRO-2 variant (`planner.intra.solve.with_zero2`,
    made from the seed's solution). A seed is not solved when the time-optimal solution already
    obeys it (its optimum then repeats that solution; the variant is made from that one) or when
    its placements put more parameter state in every layer than `budget` (no stage could use
    it; with its variant, when both do). `param_filter`, `batch_axes` and `activation_filter`
    restrict every solve
    (`planner.intra.solve.solve_stage`). `seeds_only`: the seeds' solutions alone (no
    time-optimal solution, no ladder). Every HiGHS run gets `solve_time_limit()` seconds: a
    time-optimal program with no solution by then is an error, a rung or seed with none is
    left out with a warning. `pricing`: this mesh's `price_stage`, when made already."""
    if pricing is None:
        pricing = price_stage(
            graph, mesh, num_microbatches=num_microbatches, optimizer=optimizer
        )
    kw = {
        "num_microbatches": num_microbatches,
        "optimizer": optimizer,
        "param_filter": param_filter,
        "batch_axes": batch_axes,
        "activation_filter": activation_filter,
        "pricing": pricing,
        "time_limit": solve_time_limit(),
    }
    try:
        first = None if seeds_only else solve_stage(graph, mesh, **kw)
    except SolveTimeLimitError as exc:
        raise MeshplanError(
            f"{exc} on logical mesh {mesh.shape}; MESHPLAN_SOLVE_TIME_LIMIT (seconds) "
            "sets the limit"
        ) from None
    out = [] if first is None else [profile(first, graph, layer_of, bounds, num_layers)]
    last = first
    for f in ladder if first is not None else ():
        lean = out[-1] if lean_layers is None else profile(last, graph, *lean_layers)
        if lean.params.max() + lean.acts.max() <= budget / 4:
            break  # already lean enough for several layers per stage
        try:
            last = solve_stage(
                graph, mesh, memory_budget=first.memory_bytes * f, gap=LADDER_GAP, **kw
            )
        except SolveTimeLimitError as exc:
            _skipped(exc, mesh, f"the memory rung at {f:g} of its memory")
            break
        except MeshplanError:
            break
        out.append(profile(last, graph, layer_of, bounds, num_layers))
    paths = graph.placeholder_paths
    names, rep = pricing.names, pricing.ctx.rep
    params = [n for n in names if graph.node(n).op == "param"]

    def summary(sol: StageSolution, acts: ParamFilter | None) -> tuple:
        """What tells two solutions' profiles apart (the activations only under a seed's own
        activation filter)."""
        return (
            sol.param_placements,
            sol.zero_params,
            sol.fsdp_params,
            sol.fsdp_axes,
            acts is not activation_filter and sol.activation_bytes,
        )

    for seed in seeds:
        axes = tuple(sorted(set(batch_axes) | set(seed.batch_axes)))
        acts = activation_filter
        # one row per data-parallel device under context parallelism
        rows = math.prod(mesh.shape[a] for a in seed.batch_axes)
        try:
            for make, axis in (
                (sequence_filter, seed.sequence_axis),
                (functools.partial(context_filter, rows=rows), seed.context_axis),
            ):
                if axis is not None:
                    extra = make(graph, axis, mesh.shape[axis])
                    acts = extra if acts is None else _both(acts, extra)
        except MeshplanError:
            continue  # a sequence the axis does not divide; a graph CP cannot split
        split = batch_split_options(
            graph,
            names,
            pricing.ctx.options,
            rep,
            axes,
            mesh.shape,
            memo=pricing.ctx.shared.setdefault(("batch_split",), {}),
        )
        # the time-optimal solution obeys the seed: its optimum too
        obeys = first is not None and (
            all(seed.params(paths[n], first.choice[n]) for n in params)
            and all(first.choice[n] in allowed for n, allowed in split.items())
            and (acts is None or all(acts(n, o) for n, o in first.choice.items()))
        )
        # whether the lightest layer's parameters fit a stage, under the seed and under its
        # ZeRO-2 variant
        least = functools.partial(
            _seed_params_per_layer, pricing, graph, seed.params, params, layer_of
        )
        fits = least(num_layers) <= budget
        fits_zero2 = seed.zero2 and least(num_layers, zero2=True) <= budget
        if not (fits or fits_zero2):
            continue
        if obeys:
            sol = first
        else:
            both = seed.params
            if param_filter is not None:
                both = both_filters(param_filter, seed.params)
            restrict = {
                "param_filter": both,
                "batch_axes": axes,
                "activation_filter": acts,
            }
            try:
                sol = solve_stage(graph, mesh, **kw | restrict)
            except SolveTimeLimitError as exc:
                _skipped(exc, mesh, "a Megatron seed")
                continue
            except MeshplanError:  # a parameter has no placement the seed allows
                continue
        found = [
            sol if fits and not obeys else None,
            with_zero2(pricing, sol) if fits_zero2 else None,
        ]
        known = [] if first is None else [summary(first, acts)]
        for new in found:
            if new is not None and summary(new, acts) not in known:
                known.append(summary(new, acts))
                out.append(profile(new, graph, layer_of, bounds, num_layers))
    return out


def _skipped(exc: Exception, mesh: LogicalMesh, what: str) -> None:
    """Warn that `what` of `mesh`'s program found no solution in the time limit."""
    warnings.warn(
        f"{exc} for {what} on logical mesh {mesh.shape}: searched without it "
        "(MESHPLAN_SOLVE_TIME_LIMIT, in seconds, sets the limit)",
        stacklevel=3,
    )


def _seed_params_per_layer(
    pricing: StagePricing,
    graph: OpGraph,
    seed: ParamFilter,
    params: list[str],
    layer_of: dict[str, int],
    num_layers: int,
    zero2: bool = False,
) -> float:
    """The least parameter-state bytes of any layer under a seed's placements (inf when a
    parameter has no allowed placement), with `zero2` of its ZeRO-2 variant
    (`planner.intra.solve.with_zero2`): a lower bound on every stage's memory. A copy of a
    repeated block takes its representative's least bytes, the seed read with the
    representative's path, as `planner.intra.solve.solve_stage` restricts the copies' options."""
    ctx, rep = pricing.ctx, pricing.ctx.rep
    shape = ctx.settings.mesh.shape
    least: dict[str, float] = {}
    for n in params:
        r = rep.get(n, n)
        if r in least:
            continue
        memory = pricing.node_arrays(r)[1]
        path = graph.placeholder_paths[r]
        options = ctx.options[r]
        allowed = [
            memory[options.index(zero2_option(options[i], shape)) if zero2 else i]
            for i in allowed_options(seed, path, options)
        ]
        if not allowed:
            return np.inf
        least[r] = min(allowed)
    per_layer = np.zeros(num_layers)
    for n in params:
        per_layer[layer_of.get(n, 0)] += least[rep.get(n, n)]
    return float(per_layer.min())


def least_layer_state(
    graph: OpGraph,
    mesh: LogicalMesh,
    layer_maps: Sequence[dict[str, int]],
    optimizer: str,
) -> float:
    """The least parameter-state bytes per device (weights, gradients, optimizer state) that any
    layer of any of the clusterings `layer_maps` can have on `mesh`: each parameter at the
    option (`planner.intra.prices.node_options`: DTensor's placements, ZeRO-2, FSDP, HSDP) that
    holds the least of it, summed per layer (a parameter of no layer counts in layer 0, as
    `planner.inter.stage_table.profile` attributes it). Every stage or interleaved chunk holds
    at least one layer's parameter state besides what else it keeps
    (`cost_models.memory.stage_peak_bytes`), so when this exceeds the memory budget no stage
    on `mesh` fits and its intra-op programs need not be solved (`planner.inter.mesh_search`:
    within one host a 1T GPT's layer does not fit on 8 A100s). Needs no pricing: a
    parameter's options are placements of its own shape."""
    settings = StageSettings(mesh, optimizer=optimizer)
    hybrid = hybrid_axes(mesh)
    _, samples, which = _param_shapes(graph)
    # per (shape, dtype): a block's copies alike
    least = np.array(
        [
            min(
                param_state_bytes(graph.node(n.name).outputs[0], o, settings)
                for o in node_options(n, graph.node(n.name), mesh.shape, hybrid)
            )
            for n in samples
        ],
        dtype=float,
    )[which]
    # summed per layer in the parameters' order, as adding them one by one would
    return min(
        (
            float(
                np.bincount(
                    _layer_positions(graph, m),
                    weights=least,
                    minlength=max(m.values(), default=0) + 1,
                ).min()
            )
            for m in layer_maps
        ),
        default=0.0,
    )


def _param_shapes(graph: OpGraph) -> tuple[list[str], list[torch.fx.Node], np.ndarray]:
    """The parameters of `graph` (names, in graph order), the fx node of the first of each
    (shape, dtype), and the position of each parameter's among those; made once per graph."""
    return graph.derived(("param_shapes",), lambda: _make_param_shapes(graph))


def _make_param_shapes(
    graph: OpGraph,
) -> tuple[list[str], list[torch.fx.Node], np.ndarray]:
    params = {n.name for n in graph.nodes if n.op == "param"}
    names, samples, which = [], [], []
    first: dict[tuple, int] = {}
    for n in graph.gm.graph.nodes:
        if n.name not in params:
            continue
        meta = graph.node(n.name).outputs[0]
        key = (tuple(meta.shape), meta.dtype)
        if key not in first:
            first[key] = len(samples)
            samples.append(n)
        names.append(n.name)
        which.append(first[key])
    return names, samples, np.array(which, dtype=np.int64)


def _layer_positions(graph: OpGraph, layer_of: dict[str, int]) -> np.ndarray:
    """The layer in `layer_of` of each parameter of `_param_shapes` (0 where it has none), kept
    with the graph per clustering (the entry holds `layer_of`, so its id stays its own)."""
    names = _param_shapes(graph)[0]
    return graph.derived(
        ("param_layers", id(layer_of)),
        lambda: (
            layer_of,
            np.fromiter((layer_of.get(n, 0) for n in names), np.int64, len(names)),
        ),
    )[1]


def _both(f: ParamFilter, g: ParamFilter) -> ParamFilter:
    return lambda path, option: f(path, option) and g(path, option)
