"""Where gradients go: the placement rules of backward, which the planner prices and the runtime
performs.

For an edge u -> v (u's output placed `src` on the mesh, v's input required as `dst`), v's
backward hands the gradient back placed `grad_from_consumer(dst, v's strategy)`, and u needs it
as `expected_grad(src)`; the move between the two is the edge's backward communication
(`planner.intra.prices.edge_matrices` prices it, `runtime.executor` runs it). Parameter gradients
that need only an all-reduce to get there (`bucketed_axes`) are synchronised in buckets
(`runtime.grad_sync`).
"""

from __future__ import annotations

from planner.vocab.placements import Placements
from planner.vocab.strategy import Strategy


def grad_from_consumer(
    inp: Placements, consumer: Strategy, mesh_shape: tuple[int, ...]
) -> Placements:
    """Per axis placement of the gradient a consumer's backward hands back for an input placed `inp`."""
    out = []
    for a, p in enumerate(inp):
        places = [q[a] for q in consumer.output if q] + [
            q[a] for q in consumer.inputs if q
        ]
        split = mesh_shape[a] > 1 and any(q != "R" for q in places)
        out.append(p if p.startswith("S") else "P" if (p == "R" and split) else "R")
    return tuple(out)


def expected_grad(out: Placements) -> Placements:
    return tuple(p if p.startswith("S") else "R" for p in out)


def bucketed_axes(grad: Placements, want: Placements) -> tuple[int, ...]:
    """The mesh axes on which a parameter gradient placed `grad` reaches `want` by all-reduce alone
    (P -> R there, every other axis unchanged); () when it needs anything else. The runtime
    flattens all such gradients of a stage with the same (placements, dtype) into one tensor and
    all-reduces it once per axis (`runtime.grad_sync`), so the latency of those collectives is
    paid once per bucket, not once per parameter. (A parameter sharded on the axis but gathered
    for a split computation, as FSDP does, gets P -> R on its gathered view here and R -> S for
    free on its own edge; the runtime reduce-scatters such gradients in buckets as well, so
    this prices about twice the time of its bytes and the same number of collectives.)"""
    axes = []
    for a, (g, w) in enumerate(zip(grad, want)):
        if g == w:
            continue
        if g != "P" or w != "R":
            return ()
        axes.append(a)
    return tuple(axes)
