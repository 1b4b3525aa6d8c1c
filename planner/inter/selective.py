"""What selective recomputation changes in a solved stage, per node (`planner.inter.stage_table`
sums it per layer, where a stage's time and memory are priced).

Selective recomputation (`planner.tracing.attention`) runs every attention core under an
activation checkpoint: the core's inputs are kept, its ops' saved tensors are not, and backward
re-runs the core's forward first. With S the values the stage saves for backward (every op's
``saved``) and S' those still saved - the values saved by an op outside every core, and the
storage owners of the cores' inputs - a node n of the solution changes, per micro-batch, by

    dropped bytes(n) = act(n, n in S) - act(n, n in S') - [n in a core] * extra(n)
    added seconds(n) = [n in a core] * (forward(n) + 1/2 * sum of the resharding on edges into n)

where act is `planner.intra.prices.activation_bytes` (its output if saved, plus its saved tensors
that are no graph values, ``extra``), forward is `planner.intra.prices.forward_time`, and half an
edge's price is its forward redistribution (the price covers it and its gradient, of equal size;
the same convention as Megatron's per-block recomputation, `planner.plans.recompute`). While one
core is recomputed and back-propagated its dropped bytes are live again (the stage's transient
term: the largest core's).
"""

from __future__ import annotations

import numpy as np

from planner.inter.full_recompute import node_terms
from planner.intra import prices as sc
from planner.intra.solution import StageSolution
from planner.tracing.attention import storage_owner
from planner.tracing.opgraph import OpGraph


def selective_table(
    sol: StageSolution, graph: OpGraph, cores: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node of ``sol.node_cost_table()``'s order: (added seconds, dropped bytes, core index or
    -1) of selective recomputation (module docstring), one micro-batch; computed once per
    solution."""
    cached = getattr(sol, "_selective", None)
    if cached is not None:
        return cached
    ctx = sol._ctx
    s = ctx.settings
    names, _ = sol.node_cost_table()
    seconds = np.zeros(len(names))
    dropped = np.zeros(len(names))
    core = np.full(len(names), -1)
    own = ctx.graph is graph  # then its node values hold these prices
    values = sol.value_table()[1] if own else None
    # a core op's forward and half the resharding into it, as full recomputation re-runs it
    redo = node_terms(sol, graph).redo
    for i, n, inner, keeps in _changed(sol, graph, cores, names):
        node, opt = graph.node(n), sol.choice[n]
        # `PricedStage.values`: (cost, memory = `sc.activation_bytes` saved as priced, forward)
        was = (
            float(values[i, 1])
            if own
            else sc.activation_bytes(node, opt, n in ctx.saved, s)
        )
        now = sc.activation_bytes(node, opt, keeps, s)
        if inner:
            now -= sc.activation_bytes(node, opt, False, s)  # its extra saved tensors
            seconds[i] = redo[i]
            core[i] = cores[n]
        dropped[i] = (was - now) / s.in_flight
    sol._selective = (seconds, dropped, core)
    return sol._selective


def _changed(
    sol: StageSolution, graph: OpGraph, cores: dict[str, int], names: list[str]
) -> list[tuple[int, str, bool, bool]]:
    """(position, node, in a core, still saved) of the ops selective recomputation changes:
    those in a core, and those the stage saves that are saved no more (in S, not in S'). They
    depend on the graph alone: made once per pricing when `graph` is the solution's own."""
    ctx = sol._ctx
    return ctx.per_pricing(
        graph,
        ("selective_changed", id(cores), len(names)),
        lambda: _make_changed(graph, cores, names, ctx.saved),
    )


def _make_changed(
    graph: OpGraph, cores: dict[str, int], names: list[str], saved: set[str]
) -> list[tuple[int, str, bool, bool]]:
    kept: set[str] = set()  # S'
    for n in names:
        node = graph.node(n)
        if node.op != "call":
            continue
        if n in cores:
            kept.update(
                storage_owner(graph, u)
                for u in node.inputs
                if u not in cores and graph.node(u).op != "param"
            )
        else:
            kept.update(node.saved)
    out = []
    for i, n in enumerate(names):
        if graph.node(n).op != "call":
            continue
        inner = n in cores
        if not inner and (n not in saved or n in kept):
            continue
        out.append((i, n, inner, n in kept))
    return out
