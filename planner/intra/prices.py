"""Prices of every strategy of every node, and of every edge, for the intra-op program of one stage.

All prices come from `cost_models` (principle 2) and cover forward and backward:

* node v under strategy j: compute time of the sharded op (forward + backward FLOPs and bytes divided
  by the product of the mesh axes its computation is split over: those on which any input or output
  is sharded or partial), plus the bytes it keeps on the device (parameters with their gradients and
  optimizer state; saved activations times the micro-batches in flight).
* context-parallel attention (`planner.vocab.context`): its FLOPs divided by the CP axis too
  (the most loaded rank's share), but the gathered k and v are read whole and saved for
  backward whole (`planner.intra.context.gathered_kv_bytes`, in `_sharded_bytes` and
  `activation_bytes`); the exchange itself is the edges into k and v.
* edge u -> v under (i, j): forward, redistributing u's output placement to the one v's strategy
  needs; backward, the gradient's way back. The gradient leaves v placed per axis as S(d) where v's
  input was S(d); as P (partial) where v's input was R but v's computation is split on that axis
  (e.g. a column-parallel matmul's input, or a data-parallel layer's weight); as R otherwise. u needs
  it as S(d) where u's output was S(d), else R. So Megatron's backward all-reduce and data
  parallelism's gradient all-reduce are both this edge term. For parameters the gradient is reduced
  once per iteration (gradient accumulation), so that part is divided by the number of micro-batches.
* Gradient buckets: the runtime all-reduces a stage's parameter gradients together when that is all
  their synchronisation needs (one collective per (placements, dtype) and axis), so such an edge
  carries only the bandwidth part of its all-reduce, and `grad_buckets` charges the latency once per
  bucket and stage. That latency is outside the ILP's objective (the stage table adds it per layer
  range), so an intra-op solution can be slower than the optimum by at most its buckets' latency: a
  few collectives per stage. When a plan is assembled, `planner.inter.dp_overlap` cuts a stage's
  buckets at DDP's cap (a latency per bucket and key) and hides what the runtime overlaps with
  the last micro-batch's backward.
* ZeRO-2, FSDP (ZeRO stage 3) and HSDP: their memory and collectives are priced in
  `planner.intra.fsdp_prices`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from cost_models.communication import LogicalMesh
from cost_models.compute import (
    fused_attention_time,
    measured_op_time,
    op_overhead,
    op_time,
)
from cost_models.resharding import reshard_cost, reshard_steps
from planner.intra.context import gathered_kv_bytes
from planner.intra.strategies import node_strategies
from planner.tracing.attention import FUSED_ATTENTION
from planner.tracing.opgraph import OpGraph, OpNode, TensorMeta
from planner.vocab.grads import bucketed_axes, expected_grad, grad_from_consumer
from planner.vocab.placements import norm, shards, zero_shard
from planner.vocab.strategy import Strategy, consumed_output


@dataclass(frozen=True)
class Option:
    """One choice for a node: a DTensor strategy, plus ZeRO sharding for parameters: ``zero``
    is 0 (none), 2 (gradients and optimizer state sharded) or 3 (FSDP: weights too).
    ``shard_axes`` (zero 3 only): the mesh axes sharded (HSDP: those inside a host); None: all
    that replicate the parameter (FSDP)."""

    strategy: Strategy
    zero: int = 0
    shard_axes: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.shard_axes is not None:
            return f"{self.strategy} +HSDP{list(self.shard_axes)}"
        return f"{self.strategy}{ {0: '', 2: ' +ZeRO', 3: ' +FSDP'}[self.zero] }"


@dataclass(frozen=True)
class StageSettings:
    mesh: LogicalMesh
    num_microbatches: int = 1
    in_flight: int = 1
    optimizer: str = "adam_mixed"
    cache: dict = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )  # reshard prices


def replicated_on(strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    """Whether a parameter placed as `strategy` is replicated on a mesh axis of more than one
    device: where ZeRO-2 can shard its gradients and optimizer state (`node_options`)."""
    return any(p == "R" and n > 1 for p, n in zip(strategy.output[0], mesh_shape))


def zero2_option(option: Option, mesh_shape: tuple[int, ...]) -> Option:
    """A parameter's `option` with ZeRO-2 where its placement leaves an axis to shard over
    (`replicated_on`), else `option` itself."""
    if option.zero == 0 and replicated_on(option.strategy, mesh_shape):
        return Option(option.strategy, zero=2)
    return option


def split_factor(strategy: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """Product of the mesh axes on which the op's computation is divided."""
    f = 1
    for a, size in enumerate(mesh_shape):
        places = [p[a] for p in strategy.output if p] + [
            p[a] for p in strategy.inputs if p
        ]
        if any(p != "R" for p in places):
            f *= size
    return f


def node_options(
    fx_node: torch.fx.Node,
    node: OpNode,
    mesh_shape: tuple[int, ...],
    hybrid: tuple[int, ...] = (),
) -> list[Option]:
    """The DTensor strategies of a node; for a parameter also ZeRO-2, FSDP, and HSDP over the
    axes of `hybrid` that replicate it (`hybrid_axes`) where that leaves an axis replicated."""
    strategies = node_strategies(fx_node, mesh_shape)
    opts = [Option(s) for s in strategies]
    if node.op == "param":
        for s in strategies:
            if replicated_on(s, mesh_shape):
                opts.append(Option(s, zero=2))
        for s in strategies:
            planned = tuple(map(norm, s.output[0]))
            full = zero_shard(node.outputs[0].shape, planned, mesh_shape)
            if full != planned:
                opts.append(Option(s, zero=3))
            axes = tuple(a for a in hybrid if planned[a] == "R")
            if axes:
                held = zero_shard(node.outputs[0].shape, planned, mesh_shape, axes)
                if held != planned and held != full:
                    opts.append(Option(s, zero=3, shard_axes=axes))
    return opts


def _matmul_hint(
    node: OpNode, strategy: Strategy, mesh_shape: tuple[int, ...]
) -> tuple[int, int, int] | None:
    if node.kind != "matmul" or node.fwd_flops <= 0 or not node.outputs:
        return None
    out = node.outputs[0].shape
    n = out[1] if "convolution" in node.target and len(out) > 1 else out[-1]
    m = max(1, node.outputs[0].numel() // max(n, 1))
    k = max(1, node.fwd_flops // max(2 * m * n, 1))
    for a, size in enumerate(mesh_shape):
        p = strategy.output[0][a] if strategy.output and strategy.output[0] else "R"
        if p.startswith("P"):
            k = max(1, k // size)
        elif p.startswith("S"):
            dim = int(p[2:-1])
            if dim == len(out) - 1 and "convolution" not in node.target:
                n = max(1, n // size)
            else:
                m = max(1, m // size)
    return (m, n, k)


def compute_time(node: OpNode, option: Option, s: StageSettings) -> float:
    """Forward + backward compute of a call node under `option`, plus the runtime's fixed
    per-op overhead (`cost_models.compute.op_overhead`, 0 without a measured profile), which
    views pay too. An op the profile measured is priced from its rate (`_measured_time`)."""
    if node.op != "call":
        return 0.0
    if node.is_view:
        return op_overhead(s.mesh.cluster)
    f = split_factor(option.strategy, s.mesh.shape)
    measured = _measured_time(node, option, f, s, backward=node.requires_grad)
    if measured is not None:
        return op_overhead(s.mesh.cluster) + measured
    flops = (node.fwd_flops + node.bwd_flops) / f
    passes = (
        3 if node.requires_grad else 1
    )  # backward reads and writes about twice what forward does
    nbytes = _sharded_bytes(node, option, f, s) * passes
    # forward, and the input- and weight-gradient kernels of backward
    return op_overhead(s.mesh.cluster) + _op_time(
        node, option, s, flops, nbytes, passes
    )


def loss_reduction_time(node: OpNode, option: Option, s: StageSettings) -> float:
    """Seconds per micro-batch of bringing the loss `node` (`OpGraph.loss_value`) from its
    placement under `option` to replicated, as the runtime does after every micro-batch's
    forward (`runtime.executor.PlanExecutor.run_plan`): the all-reduce of a partial loss over
    the axes that split the batch. No consumer's input prices it (the graph's output is not an
    op), and on a CPU's gloo ranks a 4-byte all-reduce takes milliseconds."""
    if not node.outputs or not option.strategy.output or not option.strategy.output[0]:
        return 0.0
    src = tuple(map(norm, option.strategy.output[0]))
    meta = node.outputs[0]
    return _reshard(s, meta.shape, _element_bytes(meta), src, ("R",) * len(src))


def _op_time(
    node: OpNode,
    option: Option,
    s: StageSettings,
    flops: float,
    nbytes: float,
    kernels: int,
) -> float:
    """`cost_models.compute.op_time` of the node's share; a fused attention on a device whose
    flash kernels were measured by `cost_models.compute.fused_attention_time`."""
    dtype = node.outputs[0].dtype if node.outputs else "float32"
    if node.target.startswith(FUSED_ATTENTION) and node.outputs:
        t = fused_attention_time(
            s.mesh.cluster,
            flops,
            nbytes,
            dtype,
            node.outputs[0].shape[-1],
            kernels=kernels,
        )
        if t is not None:
            return t
    return op_time(
        s.mesh.cluster,
        flops,
        nbytes,
        dtype,
        shape_hint=_matmul_hint(node, option.strategy, s.mesh.shape),
        kernels=kernels,
    )


def forward_time(node: OpNode, option: Option, s: StageSettings) -> float:
    """Seconds of the op's forward pass alone: what recomputation runs again.

    ``op_time`` of the forward FLOPs and ONE pass over the bytes the forward reads and writes (the
    full price in ``compute_time`` charges three passes to ops that need a gradient). A memory-bound
    op (layer norm, GELU, softmax, residual add: no FLOPs counted) thus recomputes at a third of its
    forward + backward price, not for free.
    """
    if node.op != "call" or node.is_view:
        return 0.0
    f = split_factor(option.strategy, s.mesh.shape)
    measured = _measured_time(node, option, f, s, backward=False)
    if measured is not None:
        return measured
    return _op_time(
        node, option, s, node.fwd_flops / f, _sharded_bytes(node, option, f, s), 1
    )


def _measured_time(
    node: OpNode, option: Option, f: int, s: StageSettings, *, backward: bool
) -> float | None:
    """`cost_models.compute.measured_op_time` of the node's share on one device (its forward
    FLOPs divided by the split factor `f`, its bytes `_sharded_bytes`), or None without a
    measured rate."""
    return measured_op_time(
        s.mesh.cluster,
        node.target,
        flops=node.fwd_flops / f,
        nbytes=_sharded_bytes(node, option, f, s),
        backward=backward,
    )


def _sharded_bytes(node: OpNode, option: Option, f: int, s: StageSettings) -> float:
    """Bytes one device's share of the op reads and writes in forward: the op's divided by the
    split factor `f`; a context-parallel attention also reads the gathered k and v whole
    (`planner.intra.context.gathered_kv_bytes`)."""
    extra = gathered_kv_bytes(node, option.strategy, s.mesh.shape)
    return (node.bytes_read + node.bytes_written) / f + extra


def _element_bytes(meta: TensorMeta) -> float:
    """Bytes of one element of `meta` (what `_reshard` takes)."""
    return meta.nbytes / max(meta.numel(), 1)


def _reshard(
    s: StageSettings,
    shape: tuple[int, ...],
    dtype_bytes: float,
    src: tuple[str, ...],
    dst: tuple[str, ...],
) -> float:
    if src == dst:
        return 0.0
    key = (_size_key(shape, dtype_bytes), src, dst)
    if key not in s.cache:
        s.cache[key] = reshard_cost(s.mesh, shape, dtype_bytes, src, dst)
    return s.cache[key]


def _size_key(shape: tuple[int, ...], dtype_bytes: float) -> tuple[int, float]:
    """What `cost_models.resharding.reshard_steps` reads of a tensor: its number of dims (for
    the placements' dims) and its bytes (the product of the dims times the element's bytes,
    exact in floating point for integer sizes below 2**53, whatever the order of the factors).
    Tensors of equal keys (a value and its views, say) reshard at equal prices."""
    return len(shape), float(dtype_bytes) * math.prod(shape)


def _unique(items: list) -> tuple[list, np.ndarray]:
    first: dict = {}
    index = np.array([first.setdefault(x, len(first)) for x in items], dtype=int)
    return list(first), index


def edge_matrices(
    value: OpNode,
    consumer_fx: torch.fx.Node,
    producer_fx: torch.fx.Node,
    u_opts: list[Option],
    v_opts: list[Option],
    s: StageSettings,
    param_derived: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """(forward + activation-gradient seconds, parameter-gradient seconds) for every (i, j).

    Priced once per distinct (u's output placement, v's input placement and gradient placement),
    and the matrices of those once per pricing for every edge with the same tensor size
    (`_size_key`), placements and gradient kind.
    """
    k = consumer_fx.all_input_nodes.index(producer_fx)
    o = consumed_output(producer_fx, consumer_fx)
    meta = value.outputs[o] if o < len(value.outputs) else value.outputs[0]
    dtype_bytes = _element_bytes(meta)
    with_grad = value.requires_grad and getattr(torch, meta.dtype).is_floating_point
    srcs, src_of = _unique(
        [tuple(norm(p) for p in uo.strategy.output[o]) or None for uo in u_opts]
    )
    dsts, dst_of = _unique(
        [
            None
            if vo.strategy.inputs[k] is None
            else (
                d := tuple(norm(p) for p in vo.strategy.inputs[k]),
                grad_from_consumer(d, vo.strategy, s.mesh.shape),
            )
            for vo in v_opts
        ]
    )
    key = (
        "edge",
        _size_key(meta.shape, dtype_bytes),
        with_grad,
        param_derived,
        tuple(srcs),
        tuple(dsts),
    )
    if key not in s.cache:
        s.cache[key] = _placement_matrices(
            s, meta.shape, dtype_bytes, srcs, dsts, with_grad, param_derived
        )
    act, grad = s.cache[key]
    return act[np.ix_(src_of, dst_of)], grad[np.ix_(src_of, dst_of)]


def _placement_matrices(
    s: StageSettings,
    shape: tuple[int, ...],
    dtype_bytes: float,
    srcs: list,
    dsts: list,
    with_grad: bool,
    param_derived: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """`edge_matrices` per distinct source placement (rows) and distinct (input placement,
    gradient placement) of the consumer (columns); None: no placement (no tensor). Each entry
    is `_reshard`'s (looked up in the same cache, the tensor's size key made once)."""
    act = np.zeros((len(srcs), len(dsts)))
    grad = np.zeros_like(act)
    size, cache = _size_key(shape, dtype_bytes), s.cache

    def price(src: tuple[str, ...], dst: tuple[str, ...]) -> float:
        if src == dst:
            return 0.0
        key = (size, src, dst)
        seconds = cache.get(key)
        if seconds is None:
            seconds = cache[key] = reshard_cost(s.mesh, shape, dtype_bytes, src, dst)
        return seconds

    rows = [a for a, src in enumerate(srcs) if src is not None]
    cols = [b for b, dst in enumerate(dsts) if dst is not None]
    if not rows or not cols:
        return act, grad
    # priced per distinct pair: the forward per (source, input placement), the gradient per
    # (gradient placement, the source's expected gradient), fewer than sources x columns
    ins, in_of = _unique([dsts[b][0] for b in cols])
    block = np.array([[price(srcs[a], d) for d in ins] for a in rows])[:, in_of]
    if with_grad:
        wants, want_of = _unique([expected_grad(srcs[a]) for a in rows])
        grads, grad_of = _unique([dsts[b][1] for b in cols])
        back = np.array([[price(g, w) for g in grads] for w in wants])
        if param_derived:
            for i, w in enumerate(wants):
                for j, g in enumerate(grads):
                    if bucketed_axes(g, w):
                        # bandwidth only: the latency is charged per bucket (`grad_buckets`)
                        back[i, j] = _bucket_bandwidth(s, shape, dtype_bytes, g, w)
            grad[np.ix_(rows, cols)] = (
                back[np.ix_(want_of, grad_of)] / s.num_microbatches
            )
        else:
            block = block + back[np.ix_(want_of, grad_of)]
    act[np.ix_(rows, cols)] = block
    return act, grad


# A bucket's all-reduce is priced on the line through its prices at 1 byte and at this size: the
# alpha-beta formulas are linear in the bytes (the line is exact), a measured profile's fit is
# piecewise linear (the line is its chord up to the largest message the local suite measures).
CHORD_BYTES = 4 * 2**20


def bucket_line(mesh: LogicalMesh, axis: int) -> tuple[float, float]:
    """(latency seconds, seconds per byte) of an all-reduce on one axis, as buckets price it."""
    latency = mesh.all_reduce(1.0, axis)
    return latency, (mesh.all_reduce(CHORD_BYTES, axis) - latency) / (CHORD_BYTES - 1)


def bucket_latency(mesh: LogicalMesh, axes: tuple[int, ...]) -> float:
    """The part of a bucket's all-reduces that does not grow with its bytes, one per axis."""
    return sum(bucket_line(mesh, a)[0] for a in axes)


def _bucket_bandwidth(
    s: StageSettings,
    shape: tuple[int, ...],
    dtype_bytes: float,
    grad: tuple[str, ...],
    want: tuple[str, ...],
) -> float:
    """A bucketed gradient's share of its bucket's all-reduces: their seconds per byte times the
    bytes each axis's all-reduce moves for it (`cost_models.resharding.reshard_steps`)."""
    key = ("bucket", _size_key(shape, dtype_bytes), grad, want)
    if key not in s.cache:
        steps = reshard_steps(s.mesh, shape, dtype_bytes, grad, want)
        s.cache[key] = sum(
            bucket_line(s.mesh, st.axis)[1] * st.nbytes for st in steps if st.collective
        )
    return s.cache[key]


@dataclass
class Bucket:
    """Parameter gradients all-reduced together: seconds of latency per iteration, and the
    consumers whose edges carry them (a stage pays the latency once if it holds any of them)."""

    latency_s: float
    consumers: list[str]


def param_grad_edges(
    graph: OpGraph, param_derived: set[str]
) -> list[tuple[str, str, int, int, TensorMeta]]:
    """(u, v, u's output index, v's input index, value) of every edge from a parameter or a view
    of one (`param_derived`) to a call whose gradient goes back to it (a floating value)."""
    out = []
    fx = {n.name: n for n in graph.gm.graph.nodes}
    for u in (n.name for n in graph.nodes if n.name in param_derived):
        if not graph.node(u).requires_grad:
            continue
        for fx_v in fx[u].users:
            if fx_v.op != "call_function":
                continue
            o = consumed_output(fx[u], fx_v)
            meta = graph.node(u).outputs[o]
            if getattr(torch, meta.dtype).is_floating_point:
                k = fx_v.all_input_nodes.index(fx[u])
                out.append((u, fx_v.name, o, k, meta))
    return out


def grad_buckets(
    graph: OpGraph,
    choice: dict[str, Option],
    mesh: LogicalMesh,
    param_derived: set[str],
    edges: list[tuple[str, str, int, int, TensorMeta]] | None = None,
    memo: dict | None = None,
) -> dict[tuple, Bucket]:
    """The gradient buckets of a solution, keyed (axes, parameter placement, bytes per element) as
    the runtime keys them: one per distinct key among the edges leaving parameters (and their
    views) whose gradient `bucketed_axes` all-reduces. `edge_matrices` prices those edges'
    bandwidth only; the latency here is added per stage (`planner.inter.stage_table.LayerProfile.fixed`).
    `edges`: `param_grad_edges` of the graph, when the caller keeps them (those leaving values
    outside `param_derived` are left out: an FSDP parameter's gradient is not all-reduced).
    `memo`: each edge's bucket key per (u's option, v's option, positions, bytes per element),
    kept by a caller between calls on one mesh (a pricing's solutions: the copies of a block,
    and the solutions choosing alike, look it up)."""
    out: dict[tuple, Bucket] = {}
    if edges is None:
        edges = param_grad_edges(graph, param_derived)
    if memo is None:
        memo = {}
    for u, v, o, k, meta in edges:
        if u not in choice or v not in choice or u not in param_derived:
            continue
        cu, cv = choice[u], choice[v]
        at = (id(cu), id(cv), o, k, _element_bytes(meta))
        if at not in memo:  # the options kept with it: their ids stay theirs
            memo[at] = (_bucket_key(cu.strategy, cv.strategy, o, k, meta, mesh), cu, cv)
        key = memo[at][0]
        if key is None:
            continue
        if key not in out:
            out[key] = Bucket(bucket_latency(mesh, key[0]), [])
        out[key].consumers.append(v)
    return out


def _bucket_key(
    us: Strategy, vs: Strategy, o: int, k: int, meta: TensorMeta, mesh: LogicalMesh
) -> tuple | None:
    """The bucket (axes, parameter placement, bytes per element) of the gradient on an edge from
    output o of a parameter (or view) run as `us` to input k of an op run as `vs`; None when
    no all-reduce alone brings it back (`grad_buckets`)."""
    src, dst = us.output[o], vs.inputs[k]
    if not src or dst is None:
        return None
    want = expected_grad(tuple(map(norm, src)))
    axes = bucketed_axes(
        grad_from_consumer(tuple(map(norm, dst)), vs, mesh.shape), want
    )
    return (axes, want, _element_bytes(meta)) if axes else None


def saved_values(graph: OpGraph, names: list[str]) -> set[str]:
    return {v for n in names for v in graph.node(n).saved}


def activation_bytes(
    node: OpNode, option: Option, saved: bool, s: StageSettings
) -> float:
    """Saved-for-backward bytes this node's strategy leaves on one device, for all in-flight micro-batches."""
    total = 0.0
    strategy = option.strategy
    if saved and node.outputs and strategy.output and strategy.output[0]:
        total += node.outputs[0].nbytes / shards(strategy.output[0], s.mesh.shape)
    if node.saved_extra_bytes:
        total += node.saved_extra_bytes / split_factor(strategy, s.mesh.shape)
    total += gathered_kv_bytes(node, strategy, s.mesh.shape)
    return total * s.in_flight
