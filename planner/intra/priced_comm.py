"""The collectives the planner prices for a stage's program, per site of the executor.

`predicted_collectives` lists, for every edge of a stage program, the collectives
`cost_models.resharding.reshard_steps` prices for its forward redistribution and its gradient's
way back, labelled with the sites the executor sets while it runs them (`runtime.comm_count`), so
that the collectives the runtime issues can be compared with what was priced.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from cost_models.communication import LogicalMesh
from cost_models.resharding import reshard_steps
from planner.intra.fsdp_prices import fsdp_edge_grad
from planner.tracing.opgraph import OpGraph
from planner.vocab.grads import expected_grad, grad_from_consumer
from planner.vocab.placements import fsdp_gradient, norm, reduce_midpoint, zero_shard
from planner.vocab.strategy import StageProgram, consumed_output


def predicted_collectives(
    graph: OpGraph,
    program: StageProgram,
    mesh: LogicalMesh,
    fsdp: Collection[str] = (),
    fsdp_axes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, list[tuple[str, float]]]:
    """What the planner prices, per site of the executor: ``"fwd:u->v"`` -> [(kind, bytes)] for the
    forward redistribution of every edge u -> v of the chosen strategies, and ``"bwd:u->v"`` for its
    gradient (`planner.intra.prices`: from ``grad_from_consumer(dst, v's strategy)`` to
    ``expected_grad(src)``), both from `cost_models.resharding.reshard_steps`. One micro-batch,
    forward + backward (the parameter-gradient part is not divided by the micro-batches);
    ``"fwd:output"`` the loss's reduction to replicated, where the program holds the loss.

    `fsdp`: paths of FSDP parameters (`planner.intra.prices`): ``"fwd:fsdp:<path>"`` their
    all-gather, ``"bwd:fsdp:<path>"`` the all-gather again and the gradient's reduce-scatter;
    on the edges leaving them or their views the gradient goes to `fsdp_gradient` of the
    value's placement (every micro-batch; no all-reduce).
    `fsdp_axes`: the HSDP parameters' shard axes (``StagePlan.fsdp_axes``): their gradient's
    reduce-scatter is followed by the all-reduce of the shard (`reduce_midpoint`)."""
    out: dict[str, list[tuple[str, float]]] = {}
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    roots = _fsdp_derived(graph, program, mesh, fsdp, fsdp_axes or {}, out)
    for fx_v in graph.gm.graph.nodes:
        if (
            fx_v.op != "call_function"
        ):  # a pipeline stage's output node has no op-graph node
            continue
        v = graph.node(fx_v.name)
        if v.op != "call":
            continue
        vs = program.strategies[v.name]
        for u in dict.fromkeys(v.inputs):
            fx_u = nodes[u]
            k = fx_v.all_input_nodes.index(fx_u)
            o = consumed_output(fx_u, fx_v)
            src, dst = program.strategies[u].output[o], vs.inputs[k]
            if not src or dst is None:
                continue
            src, dst = tuple(map(norm, src)), tuple(map(norm, dst))
            meta = graph.node(u).outputs[o]
            width = meta.nbytes / max(meta.numel(), 1)
            steps = [(f"fwd:{u}->{v.name}", src, dst)]
            if (
                graph.node(u).requires_grad
                and getattr(torch, meta.dtype).is_floating_point
            ):
                if u in roots:
                    grad = fsdp_edge_grad(dst, vs, mesh.shape, v.name in roots)
                    want = fsdp_gradient(src, mesh.shape)
                else:
                    grad = grad_from_consumer(dst, vs, mesh.shape)
                    want = expected_grad(src)
                steps.append((f"bwd:{u}->{v.name}", grad, want))
            for label, a, b in steps:
                if a == b:
                    continue
                colls = _collectives(mesh, meta.shape, width, a, b)
                if colls:
                    out[label] = colls
    loss = graph.loss_value
    if loss is not None and program.strategies.get(loss) is not None:
        # the runtime brings the loss to replicated after the forward
        # (`planner.intra.prices.loss_reduction_time`)
        src = program.strategies[loss].output[0]
        meta = graph.node(loss).outputs[0]
        if src:
            src = tuple(map(norm, src))
            width = meta.nbytes / max(meta.numel(), 1)
            colls = _collectives(mesh, meta.shape, width, src, ("R",) * len(src))
            if colls:
                out["fwd:output"] = colls
    return out


def _fsdp_derived(
    graph: OpGraph,
    program: StageProgram,
    mesh: LogicalMesh,
    fsdp: Collection[str],
    fsdp_axes: Mapping[str, Sequence[int]],
    out: dict[str, list[tuple[str, float]]],
) -> set[str]:
    """Adds the FSDP parameters' sites to `out`; returns the nodes derived from them (the
    parameters and their views), whose gradients go to `fsdp_gradient` on their edges."""
    if not fsdp:
        return set()
    derived = graph.param_derived()
    names = {p: n for n, p in graph.placeholder_paths.items()}
    found: set[str] = set()
    for path in fsdp:
        n = names[path]
        meta = graph.node(n).outputs[0]
        planned = tuple(map(norm, program.strategies[n].output[0]))
        axes = fsdp_axes.get(path)
        held = zero_shard(
            tuple(meta.shape),
            planned,
            mesh.shape,
            None if axes is None else tuple(axes),
        )
        if held == planned:
            continue
        found.add(n)
        grad = fsdp_gradient(planned, mesh.shape)
        mid = reduce_midpoint(planned, held, grad)
        width = meta.nbytes / max(meta.numel(), 1)

        gather = _collectives(mesh, meta.shape, width, held, planned)
        out[f"fwd:fsdp:{path}"] = gather
        out[f"bwd:fsdp:{path}"] = (
            gather
            + _collectives(mesh, meta.shape, width, grad, mid)
            + _collectives(mesh, meta.shape, width, mid, held)
        )
    return graph.views_of(found, derived)


def _collectives(
    mesh: LogicalMesh,
    shape: tuple[int, ...],
    width: float,
    src: tuple[str, ...],
    dst: tuple[str, ...],
) -> list[tuple[str, float]]:
    return [
        (st.collective, st.nbytes)
        for st in reshard_steps(mesh, shape, width, src, dst)
        if st.collective
    ]
