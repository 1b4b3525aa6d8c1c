"""Intra-operator pass: choose a sharding strategy for every node of one stage on a 2D logical mesh.

Steps (DESIGN, "The two searches"; Alpa section 4.2):

1. Options per node: DTensor's strategies (`planner.intra.strategies`), plus ZeRO variants of parameters.
2. Repeated blocks: nodes whose module path has an index (``blocks.7.attn.qkv``) belong to block
   ``blocks.7``; blocks with identical structure share one strategy per position, so only the first
   copy gets ILP variables (`planner.intra.cost_graph.quotient`: exact among such plans). Prices are
   computed once per distinct (representative) node and edge and multiplied by their count.
3. Followers (views, getitem, single-input elementwise ops) merge into their producer
   (`planner.intra.cost_graph.merge_followers`).
4. The ILP (`planner.intra.ilp`): minimise per-micro-batch time = compute + activation resharding forward
   and backward + gradient synchronisation / micro-batches (its bandwidth part: the latency of
   the runtime's gradient buckets is charged per stage, `planner.intra.prices.grad_buckets`),
   subject to per-device memory. Solves of one pricing (`price_stage`) with the same options
   kept share the program; only the memory budget differs between them. A filter of
   parameters alone (the seeds of a model with experts, whose activations stay free) is solved
   on the unfiltered program with the other strategies fixed out (`_within`).

Prices: `planner.intra.prices`. The result, `StageSolution` (`planner.intra.solution`), holds the
strategy of every node, the placement of every parameter, the cost broken down, and
`explain(node)` for debugging.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cost_models.communication import LogicalMesh
from cost_models.compute import microbatch_overhead
from cost_models.errors import MeshplanError
from planner.intra import fsdp_prices as fp
from planner.intra import prices as sc
from planner.intra.batch_split import batch_split_options
from planner.intra.cost_graph import CostGraph, Reduction, identity, merge_followers
from planner.intra.highs import GAP_REL
from planner.intra.ilp import ILPModel, ILPSolution
from planner.intra.megatron import allowed_options
from planner.intra.priced_stage import PricedStage
from planner.intra.prices import Option, StageSettings
from planner.intra.solution import StageSolution
from planner.intra.strategies import leaf_strategies
from planner.tracing.blocks import block_of, representatives
from planner.tracing.opgraph import OpGraph

# Not dtype casts (`_to_copy`, kind "other"): a widening cast's input moves half the bytes of its
# output, so resharding before it can beat following it (merging them cost llama3-70b's plan on
# 8x8 H100s 0.17%).
FOLLOWER_KINDS = ("view", "elementwise")


@dataclass
class StagePricing:
    """The options and prices of one stage on one mesh (`price_stage`), reusable by several solves
    of it: other memory budgets, other parameter filters (prices are computed lazily and kept)."""

    ctx: PricedStage
    ops: list[str]
    names: list[str]
    nodes: list[str] | None
    _node_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False
    )
    _programs: dict[tuple, tuple[Reduction, ILPModel]] = field(
        default_factory=dict, repr=False
    )  # per set of options kept (`solve_stage`)
    _summaries: dict[tuple, StageSolution] = field(
        default_factory=dict, repr=False
    )  # per set of options kept and choice of the program (`solve_stage`)

    def node_arrays(self, n: str) -> tuple[np.ndarray, np.ndarray]:
        """(the ILP's cost, memory) of every option of representative n, over all its options
        (`PricedStage.ilp_node_cost`)."""
        if n not in self._node_arrays:
            ctx = self.ctx
            self._node_arrays[n] = (
                np.array([ctx.ilp_node_cost(n, o) for o in ctx.options[n]]),
                np.array([ctx.node_memory(n, o) for o in ctx.options[n]]),
            )
        return self._node_arrays[n]


@dataclass(frozen=True)
class _StageScope:
    """What a pricing of a node set reads of the graph alone, the same on every logical mesh:
    made once per graph and node set (`OpGraph.derived`), with the memo of
    `PricedStage.per_pricing` that its pricings share. Read only."""

    fx: dict[str, torch.fx.Node]
    ops: list[str]
    names: list[str]  # the ops and the values they read from outside, in graph order
    in_scope: frozenset[str]
    rep: dict[str, str]
    edges: list[tuple[str, str]]
    param_derived: set[str]
    saved: set[str]
    memo: dict = field(default_factory=dict)


def _stage_scope(graph: OpGraph, nodes: list[str] | None) -> _StageScope:
    fx = {n.name: n for n in graph.gm.graph.nodes}
    ops = [n.name for n in graph.ops] if nodes is None else list(nodes)
    in_scope = frozenset(ops)
    boundary = {u for n in ops for u in graph.node(n).inputs if u not in in_scope}
    names = [n.name for n in graph.nodes if n.name in in_scope or n.name in boundary]
    known = set(names)
    edges = [
        (u, v) for v in names for u in dict.fromkeys(graph.node(v).inputs) if u in known
    ]
    return _StageScope(
        fx,
        ops,
        names,
        in_scope,
        representatives(graph, names),
        edges,
        graph.param_derived(names),
        sc.saved_values(graph, ops),
    )


def price_stage(
    graph: OpGraph,
    mesh: LogicalMesh,
    *,
    nodes: list[str] | None = None,
    num_microbatches: int = 1,
    in_flight: int = 1,
    optimizer: str = "adam_mixed",
) -> StagePricing:
    """Options of every node of `nodes` (default: the whole graph) on `mesh`; prices on demand."""
    settings = StageSettings(mesh, num_microbatches, in_flight, optimizer)
    scope = graph.derived(
        ("stage_scope", None if nodes is None else tuple(nodes)),
        lambda: _stage_scope(graph, nodes),
    )
    fx, ops, names, rep, in_scope = (
        scope.fx,
        scope.ops,
        scope.names,
        scope.rep,
        scope.in_scope,
    )
    options: dict[str, list[Option]] = {}
    hybrid = fp.hybrid_axes(mesh)  # HSDP's axes (none unless the mesh spans hosts)
    for n in names:
        node = graph.node(n)
        if (
            rep.get(n, n) != n
        ):  # a copy of a repeated block: the same options as its representative
            options[n] = options[rep[n]]
        elif n in in_scope or node.op in ("param", "buffer", "input"):
            options[n] = sc.node_options(fx[n], node, mesh.shape, hybrid)
        else:  # produced by an earlier stage: arrives in whatever placement we choose
            options[n] = [
                Option(s) for s in leaf_strategies(node.outputs[0].shape, mesh.shape)
            ]
    ctx = PricedStage(
        graph,
        settings,
        fx,
        options,
        scope.edges,
        scope.param_derived,
        scope.saved,
        rep,
        scope=scope.memo,
    )
    return StagePricing(ctx, ops, names, None if nodes is None else list(nodes))


def solve_stage(
    graph: OpGraph,
    mesh: LogicalMesh,
    *,
    nodes: list[str] | None = None,
    param_filter: Callable[[str, Option], bool] | None = None,
    batch_axes: tuple[int, ...] = (),
    activation_filter: Callable[[str, Option], bool] | None = None,
    num_microbatches: int = 1,
    in_flight: int = 1,
    optimizer: str = "adam_mixed",
    memory_budget: float | None = None,
    time_limit: float | None = None,
    pricing: StagePricing | None = None,
    gap: float = GAP_REL,
) -> StageSolution:
    """Solve the intra-op program for `nodes` (default: the whole graph) on `mesh`.

    `param_filter(path, option)` restricts the options of parameters (e.g. to price a manual
    Megatron configuration, or pure data parallelism); every parameter must keep at least one.
    `batch_axes` are mesh axes on which every value computed from the data is split by its
    first (batch) dimension, as data parallelism in Megatron-LM and DDP runs
    (`planner.intra.batch_split.batch_split_options`).
    `activation_filter(node, option)` restricts the options of ops (e.g. Megatron's sequence
    parallelism, `planner.intra.megatron.sequence_filter`); every op must keep at least one.
    `pricing` (from `price_stage` with the same graph, mesh, nodes and settings) reuses prices
    computed by earlier solves of this stage. `gap`: the relative optimality gap of the
    branch-and-bound when the relaxation is fractional (`planner.intra.ilp.ILPModel.solve`).
    """
    t0 = time.perf_counter()
    settings = StageSettings(mesh, num_microbatches, in_flight, optimizer)
    if pricing is None:
        pricing = price_stage(
            graph,
            mesh,
            nodes=nodes,
            num_microbatches=num_microbatches,
            in_flight=in_flight,
            optimizer=optimizer,
        )
    elif (
        pricing.ctx.graph is not graph
        or pricing.ctx.settings != settings
        or pricing.nodes != (None if nodes is None else list(nodes))
    ):
        raise MeshplanError("the pricing given was made for another stage or mesh")
    base, names, rep = pricing.ctx, pricing.names, pricing.ctx.rep
    options = dict(base.options)
    hsdp_dropped = False
    for n in names:
        if rep.get(n, n) == n and graph.node(n).op == "param":
            kept = [o for o in options[n] if fp.hsdp_holds(o, mesh.shape, batch_axes)]
            hsdp_dropped |= len(kept) < len(options[n])
            options[n] = kept
    # before the parameter filter; a copy of a repeated block with its representative's list
    plain = {n: options[rep.get(n, n)] for n in options}
    if param_filter is not None:
        for n in names:
            if rep.get(n, n) == n and graph.node(n).op == "param":
                path = graph.placeholder_paths[n]
                kept = allowed_options(param_filter, path, options[n])
                options[n] = [options[n][i] for i in kept]
                if not options[n]:
                    raise MeshplanError(
                        f"no allowed placement for parameter {path} {graph.node(n).outputs[0].shape} on mesh {mesh.shape}"
                    )
    if activation_filter is not None:
        for n in names:
            if rep.get(n, n) == n and graph.node(n).op == "call":
                options[n] = [o for o in options[n] if activation_filter(n, o)]
                if not options[n]:
                    raise MeshplanError(
                        f"no allowed strategy for op {n} {graph.node(n).outputs[0].shape} "
                        f"on mesh {mesh.shape}"
                    )
    split = batch_split_options(
        graph,
        names,
        options,
        rep,
        batch_axes,
        mesh.shape,
        memo=base.shared.setdefault(("batch_split",), {}),
    )
    options.update(split)
    # Under a filter of parameters alone the followers are the unfiltered program's (a
    # parameter the filter leaves one placement keeps its views as followers), so that the
    # program is the unfiltered one with some strategies excluded (`_within`).
    params_only = param_filter is not None and activation_filter is None and not split
    reps = [n for n in names if rep.get(n, n) == n]
    leaders = _leaders(graph, reps, plain if params_only else options, rep)
    if params_only and memory_budget is None:
        out = _within(
            graph, pricing, plain, options, leaders, hsdp_dropped, time_limit, t0
        )
        if out is not None:
            return out
    if (
        param_filter is not None
        or split
        or activation_filter is not None
        or hsdp_dropped
    ):
        for n in names:
            if rep.get(n, n) != n:
                options[n] = options[rep[n]]
        ctx = base.restricted(options)
    else:
        ctx = base
    # The program depends on the options kept (ctx.keep), not on the budget: a memory ladder
    # builds it once (`planner.intra.ilp.ILPModel`) and only changes its memory row.
    red, program, key = _program(graph, pricing, ctx, options, leaders)
    sol = program.solve(memory_budget, time_limit=time_limit, gap=gap)
    return _summary(pricing, ctx, options, red, key, sol, t0)


def with_zero2(pricing: StagePricing, sol: StageSolution) -> StageSolution | None:
    """`sol` (a solve of `pricing`) with every parameter replicated on a mesh axis of more than
    one device also ZeRO-2 (`planner.intra.prices.zero2_option`: its optimizer state, and its
    gradient between steps, sharded there; Megatron-Core's distributed optimizer), placed as
    before; None when no parameter changes. With the parameters' placements given, as a seed
    gives them (`planner.intra.megatron.axes_filter`), this is what solving under that
    restriction returns up to ties: ZeRO-2 changes a parameter's own cost and memory
    (`planner.intra.fsdp_prices.zero_cost`), not the prices of its edges, so the activations'
    optimum stays. Made without a solve (the program and HiGHS are most of a seed's cost)."""
    ctx, rep = pricing.ctx, pricing.ctx.rep
    index: dict[str, int] = {}
    changed = False
    for n, o in sol.choice.items():
        r = rep.get(n, n)
        if r in index and r != n:  # a copy of a block chooses as its representative
            index[n] = index[r]
            continue
        if ctx.graph.node(n).op == "param":
            z = sc.zero2_option(o, sol.mesh_shape)
            changed |= z is not o
            o = z
        index[n] = option_position(ctx, n, o)
    if not changed:
        return None
    # the options' own objects (the ZeRO-2 variant the list holds, not a new equal one), so
    # that the copies of a block keep choosing their representative's object
    # (`planner.inter.held_memory` classes them by identity)
    choice = {n: ctx.options[n][i] for n, i in index.items()}
    return _summarise(ctx, choice, index, pricing.ops, sol.ilp_nodes, sol.optimal, 0.0)


def _program(
    graph: OpGraph,
    pricing: StagePricing,
    ctx: PricedStage,
    options: dict[str, list[Option]],
    leaders: dict[str, str],
) -> tuple[Reduction, ILPModel, tuple]:
    """The reduced cost graph and program of ctx's options (made once per pricing), and its key.
    The key reads the representatives' kept options alone: a copy of a repeated block keeps its
    representative's (`solve_stage`, `_within`), and the program is built on the
    representatives (`_reduce`)."""
    rep = ctx.rep
    key = (
        tuple(
            sorted((n, k.tobytes()) for n, k in ctx.keep.items() if rep.get(n, n) == n)
        ),
        tuple(sorted(leaders.items())),
    )
    if key not in pricing._programs:
        red = _reduce(graph, pricing, ctx, options, leaders)
        pricing._programs[key] = (red, ILPModel(red.graph.problem(None)))
    return (*pricing._programs[key], key)


def _within(
    graph: OpGraph,
    pricing: StagePricing,
    plain: dict[str, list[Option]],
    options: dict[str, list[Option]],
    leaders: dict[str, str],
    hsdp_dropped: bool,
    time_limit: float | None,
    t0: float,
) -> StageSolution | None:
    """The solve of a filter of parameters alone (`options` of the parameters within `plain`'s)
    on the unfiltered program (`plain`'s) with the excluded strategies fixed out
    (`planner.intra.ilp.ILPModel.solve_within`: its relaxation warm from the program's last
    solve), the program of the filtered options not built; None when that relaxation is
    fractional."""
    base, rep = pricing.ctx, pricing.ctx.rep
    ctx = base.restricted(plain) if hsdp_dropped else base
    red, program, key = _program(graph, pricing, ctx, plain, leaders)
    allowed = {  # a parameter is its own reduced node (never a follower)
        red.target[n]: np.array([option_position(ctx, n, o) for o in opts], dtype=int)
        for n, opts in options.items()
        if opts is not plain[n] and rep.get(n, n) == n
    }
    sol = program.solve_within(allowed, time_limit=time_limit)
    if sol is None:
        return None
    return _summary(pricing, ctx, plain, red, key, sol, t0)


def _summary(
    pricing: StagePricing,
    ctx: PricedStage,
    options: dict[str, list[Option]],
    red: Reduction,
    key: tuple,
    sol: ILPSolution,
    t0: float,
) -> StageSolution:
    """The StageSolution of the program's solution `sol`; made once per program and choice (a
    memory ladder's rungs often land on the same one), with what later passes derive from it
    (`StageSolution._derived`)."""
    same = pricing._summaries.get((key, tuple(sol.choice)))
    if same is not None:
        return _again(same, sol.optimal, time.perf_counter() - t0)
    rep = ctx.rep
    picked = red.expand(sol.choice)
    index = {n: picked[rep.get(n, n)] for n in pricing.names}
    choice = {n: options[n][index[n]] for n in pricing.names}
    out = pricing._summaries[key, tuple(sol.choice)] = _summarise(
        ctx,
        choice,
        index,
        pricing.ops,
        len(red.graph.names),
        sol.optimal,
        time.perf_counter() - t0,
    )
    return out


def option_position(ctx: PricedStage, name: str, option: Option) -> int:
    """The position of `option` in ``ctx.options[name]``: found by identity (a solution's
    options are the pricing's objects; a list's positions kept once per list), by equality for
    an option made since (`zero2_option`'s)."""
    lists = ctx.shared.setdefault(("option_positions",), {})
    options = ctx.options[name]
    if id(options) not in lists:  # the list kept with its map: its id stays its own
        lists[id(options)] = (options, {id(o): i for i, o in enumerate(options)})
    i = lists[id(options)][1].get(id(option))
    return options.index(option) if i is None else i


def _again(sol: StageSolution, optimal: bool, seconds: float) -> StageSolution:
    """`sol` as another solve returned it, sharing what was derived from its choice."""
    out = dataclasses.replace(sol, optimal=optimal, solve_time_s=seconds)
    for name in ("_selective", "_wgrad"):  # set by later passes, not fields
        if hasattr(sol, name):
            setattr(out, name, getattr(sol, name))
    return out


def _reduce(
    graph: OpGraph,
    pricing: StagePricing,
    ctx: PricedStage,
    options: dict[str, list[Option]],
    leaders: dict[str, str],
) -> Reduction:
    """The cost graph of the stage's representatives under ctx's options (repeated blocks
    counted, `representatives`), with `leaders`' followers merged into their leaders."""
    names, rep = pricing.names, ctx.rep
    reps = [n for n in names if rep.get(n, n) == n]
    count = Counter(rep.get(n, n) for n in names)
    index = {n: i for i, n in enumerate(reps)}
    costs, memories = [], []
    for n in reps:
        c, m = pricing.node_arrays(n)
        if n in ctx.keep:
            c, m = c[ctx.keep[n]], m[ctx.keep[n]]
        costs.append(c * count[n])
        memories.append(m * count[n])
    cg = CostGraph(reps, costs, memories)
    for key, (edge, c) in _edge_classes(ctx).items():
        act, grad = ctx.edge(*edge)
        cg.add_edge(index[key[0]], index[key[1]], (act + grad) * c)
    return merge_followers(identity(cg), leaders)


def _edge_classes(ctx: PricedStage) -> dict[tuple, tuple[tuple[str, str], int]]:
    """Per edge key (`PricedStage.edge_key`: the copies of an edge in repeated blocks), in the
    order of first appearance: its first edge and its number of edges. The same for every
    program of a pricing: made once."""

    def make() -> dict[tuple, tuple[tuple[str, str], int]]:
        grouped = Counter(ctx.edge_key(u, v) for u, v in ctx.edges)
        sample = {ctx.edge_key(u, v): (u, v) for u, v in reversed(ctx.edges)}
        return {k: (sample[k], c) for k, c in grouped.items()}

    return ctx.per_pricing(ctx.graph, ("edge_classes",), make)


def _leaders(
    graph: OpGraph,
    reps: list[str],
    options: dict[str, list[Option]],
    rep: dict[str, str],
) -> dict[str, str]:
    """follower -> leader for representatives that only follow their single choosing input."""
    out = {}
    rep_set = set(reps)
    for n in reps:
        node = graph.node(n)
        if node.op != "call" or node.kind not in FOLLOWER_KINDS:
            continue
        choosing = [
            u for u in dict.fromkeys(node.inputs) if len(options.get(u, [])) > 1
        ]
        if len(choosing) != 1 or choosing[0] not in rep_set:
            continue
        u = choosing[0]
        if block_of(graph.node(u).module_path) != block_of(node.module_path):
            continue  # leader in another block copy: its producer differs between copies
        out[n] = u
    return out


def _summarise(
    ctx: PricedStage,
    choice: dict[str, Option],
    index: dict[str, int],
    op_names: list[str],
    ilp_nodes: int,
    optimal: bool,
    seconds: float,
) -> StageSolution:
    """The StageSolution of `choice` (option `index[n]` of every node n in ctx.options)."""
    g, s = ctx.graph, ctx.settings
    # (cost, memory, forward time) of each node, kept for `StageSolution.node_cost_table`
    names, table = ctx.value_table({n: index[n] for n in choice})
    is_param = _params(ctx, names)
    ops, params = table[~is_param], table[is_param]
    param_names = [n for n, p in zip(names, is_param.tolist()) if p]
    # sums in the nodes' order, one after the other (Python's `sum` over lists): the figures
    # do not depend on how the values were gathered
    compute = sum(ops[:, 0].tolist())
    # a parameter's price less its optimizer step: its collectives and runtime overhead
    steps = [ctx.optimizer_cost(n, choice[n]) for n in param_names]
    step = sum(steps)
    zero = sum(max(0.0, c - t) for c, t in zip(params[:, 0].tolist(), steps))
    comm, grad_sync = 0.0, zero * s.num_microbatches
    edge_terms = ctx.edge_terms(index)
    for act, grad in zip(*edge_terms):
        comm += act
        grad_sync += grad * s.num_microbatches
    loss = g.loss_value
    if loss in choice:  # the loss's all-reduce: in its node's price, communication here
        reduction = sc.loss_reduction_time(g.node(loss), choice[loss], s)
        compute, comm = compute - reduction, comm + reduction
    buckets = sc.grad_buckets(
        g,
        choice,
        s.mesh,
        ctx.param_derived - ctx.fsdp_derived(index),
        ctx.param_grad_edges,
        memo=ctx.shared.setdefault(("grad_bucket_keys",), {}),
    )
    grad_sync += sum(b.latency_s for b in buckets.values())
    placed = {g.placeholder_paths[n]: choice[n] for n in param_names}
    param_mem = sum(params[:, 1].tolist())
    act_mem = sum(ops[:, 1].tolist())
    fallbacks = [
        f"{n}: {g.node(n).target}"
        for n in (op_names if _may_fall_back(ctx, op_names) else ())
        if choice[n].strategy.source == "fallback"
    ]
    return StageSolution(
        mesh_shape=s.mesh.shape,
        choice=choice,
        param_placements={p: o.strategy.output[0] for p, o in placed.items()},
        zero_params=[p for p, o in placed.items() if o.zero == 2],
        fsdp_params=[p for p, o in placed.items() if o.zero == 3],
        compute_s=compute,
        comm_s=comm,
        grad_sync_s=grad_sync,
        optimizer_s=step * s.num_microbatches,
        param_state_bytes=param_mem,
        activation_bytes=act_mem,
        fallback_ops=fallbacks,
        num_microbatches=s.num_microbatches,
        optimal=optimal,
        ilp_nodes=ilp_nodes,
        solve_time_s=seconds,
        buckets=buckets,
        overhead_s=microbatch_overhead(s.mesh.cluster),
        _ctx=ctx,
        _index=index,
        _edge_terms=edge_terms,
        _value_table=(names, table),
    )


def _params(ctx: PricedStage, names: list[str]) -> np.ndarray:
    """Whether each of `names` is a parameter; made once per pricing and list of names."""
    return ctx.per_pricing(
        ctx.graph,
        ("is_param", tuple(names)),
        lambda: np.array([ctx.graph.node(n).op == "param" for n in names], dtype=bool),
    )


def _may_fall_back(ctx: PricedStage, op_names: list[str]) -> bool:
    """Whether some op of `op_names` has a fallback option (replicated where no sharding rule
    exists) to choose; made once per pricing (per list of options: the copies share one)."""

    key = ("may_fall_back", len(op_names))
    if (
        key not in ctx.shared
    ):  # over the options before any restriction: all it may choose
        full = ctx.full_options or ctx.options
        lists = {id(full[n]): full[n] for n in op_names}
        ctx.shared[key] = any(
            o.strategy.source == "fallback" for opts in lists.values() for o in opts
        )
    return ctx.shared[key]
