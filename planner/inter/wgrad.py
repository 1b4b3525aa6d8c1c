"""The weight-gradient part of a solved stage's backward, per node (`planner.inter.stage_table`
sums it per layer; the zero-bubble schedule prices it, `cost_models.pipeline`).

A zero-bubble schedule splits each stage's backward into the input gradient I, which the previous
stage waits for, and the weight gradient W, which it runs later to fill its idle time. W is the
weight-gradient matrix products: for a matmul node n reading a parameter (or a view of one, such as
``t(weight)``), ``Y = X W`` has ``dW = X^T dY``, the same FLOPs and operand shapes as its forward::

    wgrad seconds(n) = [n is a matmul reading a parameter] * forward(n)
    wgrad bytes(n)   = [n is a matmul reading a parameter] * local bytes of n's output


with forward = `planner.intra.prices.forward_time` of the node under its chosen strategy. Every
other part of backward (the input-gradient products, elementwise and norm backward, the
collectives and resharding of the gradients, recomputation) is I. What torch's split runs in W
beyond the products (the autograd edges from those products to the parameters: views, a bias's
sum) is small and priced in I. The bytes are the output gradient torch keeps per micro-batch from
I to W for the product (`cost_models.memory.weight_grads_pending`): the output's size on one
device (its sharded dimensions divided).
"""

from __future__ import annotations

import numpy as np

from planner.intra import prices as sc
from planner.intra.solution import StageSolution
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import shards


def wgrad_table(sol: StageSolution, graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Per node of ``sol.node_cost_table()``'s order: (seconds of its weight-gradient product,
    bytes of its output gradient kept until then) for one micro-batch (module docstring);
    computed once per solution."""
    cached = getattr(sol, "_wgrad", None)
    if cached is not None:
        return cached
    names, _ = sol.node_cost_table()
    seconds, nbytes = np.zeros(len(names)), np.zeros(len(names))
    if sol._ctx is None:  # a solution without its pricing context: no split known
        return seconds, nbytes
    # the forward times of the solution's own graph are among its node values
    own = sol._ctx.graph is graph
    values = sol.value_table()[1] if own else None
    for i, n in _weight_products(sol, graph, names):
        node, opt = graph.node(n), sol.choice[n]
        seconds[i] = (
            values[i, 2] if own else sc.forward_time(node, opt, sol._ctx.settings)
        )
        nbytes[i] = node.outputs[0].nbytes / shards(
            opt.strategy.output[0], sol.mesh_shape
        )
    sol._wgrad = (seconds, nbytes)
    return sol._wgrad


def _weight_products(
    sol: StageSolution, graph: OpGraph, names: list[str]
) -> list[tuple[int, str]]:
    """(position, node) of the matrix products with an input derived from a parameter: the
    graph's alone, made once per pricing when `graph` is the solution's own."""

    def make() -> list[tuple[int, str]]:
        derived = graph.param_derived()
        out = []
        for i, n in enumerate(names):
            node = graph.node(n)
            if node.op != "call" or node.kind != "matmul" or not node.requires_grad:
                continue
            if any(u in derived for u in node.inputs):
                out.append((i, n))
        return out

    return sol._ctx.per_pricing(graph, ("weight_products", len(names)), make)
