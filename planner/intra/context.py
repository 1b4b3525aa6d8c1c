"""Context parallelism as a restriction of the intra-op pass (`planner.intra.solve`'s
``activation_filter``), for manual plans (``manual_plan(context_parallel=N)``) and as seeds of the
automatic search (`planner.intra.megatron.seed_filters`).

Every attention node takes its context-parallel strategy on the CP axis (`planner.vocab.context`:
q split along the sequence, k and v all-gathered); every other op is left to the least cost, which
splits the position-wise ops around attention (norms, projections, rotary products, MLP, the
loss) along the sequence as DTensor's own strategies allow, the rotary tables and the tokens
sliced locally from their replicated copies.

Micro-batches of one row per data-parallel device: the traced graph flattens ``[rows, s, h]``
to ``[rows * s, h]`` around every matrix product. With one row the sequence split passes through;
with data parallelism on an earlier axis and one row per device there, the merged dimension is
split on both axes (`planner.vocab.nested_views`: ``manual_plan(dp=d, context_parallel=c)`` with
tp = 1, and the automatic search's (dp, cp) seeds); with more rows per device it would be a
strided shard, which the planner does not plan (`planner.intra.strategies`). That is how
long-context training runs (torchtitan's and Megatron's CP run one sequence per rank and
micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph, OpNode
from planner.vocab.context import SDPA, SEQ_DIM, context_axis, eligible
from planner.vocab.placements import shards
from planner.vocab.strategy import Strategy

__all__ = [
    "attention_nodes",
    "context_filter",
    "gathered_kv_bytes",
    "without_context",
]

_SDPA = str(SDPA)  # the op graph's target string


def attention_nodes(graph: OpGraph) -> list[str]:
    """The graph's attention kernels that context parallelism splits (`planner.vocab.context`)."""
    return [n.name for n in graph.ops if n.target == _SDPA]


def context_filter(
    graph: OpGraph, axis: int, size: int, rows: int = 1
) -> Callable[[str, Any], bool]:
    """Options restricted to context parallelism on mesh axis `axis` of `size` devices: every
    attention node context-parallel there, every other op free. `rows`: the data-parallel
    devices of an earlier axis, one row of the micro-batch each (module docstring). Raises
    MeshplanError when the graph has no fused attention, when a micro-batch has another number
    of rows, or when the sequence does not divide by `size`."""
    nodes = attention_nodes(graph)
    if not nodes:
        raise MeshplanError(
            "context parallelism splits F.scaled_dot_product_attention; the model has none "
            "(explicit attention, or no attention)"
        )
    fx = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
    for name in nodes:
        if name in fx and not eligible(fx[name]):
            raise MeshplanError(
                f"context parallelism needs self-attention without dropout or an explicit "
                f"mask; attention {name} has {fx[name].args[3:]} {fx[name].kwargs}"
            )
        shape = graph.node(name).outputs[0].shape
        if shape[0] != rows:
            raise MeshplanError(
                f"context parallelism runs micro-batches of one row per data-parallel device "
                f"({rows}); attention {name} has {shape[0]} (use a micro-batch size of {rows})"
            )
        if shape[SEQ_DIM] % size:
            raise MeshplanError(
                f"context parallelism splits the sequence {shape[SEQ_DIM]} of attention {name} "
                f"over {size} devices; it does not divide"
            )
    wanted = set(nodes)

    def allowed(name: str, option: Any) -> bool:
        return name not in wanted or context_axis(option.strategy) == axis

    return allowed


def without_context(graph: OpGraph) -> Callable[[str, Any], bool]:
    """Options with no context parallelism: every attention node's context-parallel strategies
    left out, every other op free (the automatic search with context parallelism switched off,
    `planner.plan(context_parallel=False)`)."""
    wanted = set(attention_nodes(graph))

    def allowed(name: str, option: Any) -> bool:
        return name not in wanted or context_axis(option.strategy) is None

    return allowed


def gathered_kv_bytes(
    node: OpNode, strategy: Strategy, mesh_shape: tuple[int, ...]
) -> float:
    """Bytes of k and v one device holds beyond its split copies under a context-parallel
    `strategy` of an attention `node` (0 otherwise): the all-gathered k and v, less the
    ``1 / C`` of them the producers' prices count. The kernel reads them (the last rank every
    key) and saves them for backward (`runtime.context`; a rank's slice keeps the whole
    gathered storage); `planner.intra.prices` charges both. With ``out`` shaped as v
    (the kernel's output: q's rows, v's head size) and q as k, ``k + v = (q + k + v + out) / 2``
    of the node's bytes read and its output."""
    axis = context_axis(strategy) if node.target == _SDPA else None
    if axis is None:
        return 0.0
    kv = (node.bytes_read + node.outputs[0].nbytes) / 2
    gathered = kv / shards(strategy.inputs[1], mesh_shape)
    return gathered * (1 - 1 / mesh_shape[axis])
