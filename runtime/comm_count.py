"""Count the bytes of every collective DTensor issues, attributed to the plan's edges and ops.

PyTorch's ``torch.distributed.tensor.debug.CommDebugMode`` (torch 2.13) counts collectives per op
and per module, but records no sizes for them (``input_shape`` is kept only for ops on DTensors,
and collectives run on the plain local tensors), and it knows modules, not the aten nodes of an fx
graph. `CommCounter` is the missing piece: a ``TorchDispatchMode`` that, like CommDebugMode, lets
DTensor desugar its ops first (returns ``NotImplemented`` for DTensor arguments) and then sees the
functional collectives (``torch.ops._c10d_functional.*``, the legacy ``c10d_functional`` and the
autograd ``all_to_all_single``) that DTensor's redistributions and op implementations call.

Bytes follow `cost_models.communication`'s convention: the FULL tensor of the collective's group,
so the numbers compare directly with `cost_models.resharding.reshard_steps`::

    all_reduce(x)                  -> bytes(x)                 (the all-reduced tensor)
    all_gather_into_tensor(x, n)   -> n * bytes(x)             (the gathered output)
    reduce_scatter_tensor(x, n)    -> bytes(x)                 (the full input)
    all_to_all_single(x) over n    -> n * bytes(x)             (the tensor being re-sharded)
    broadcast(x)                   -> bytes(x)
    send(x) / recv(x)              -> bytes(x)                 (point-to-point, kinds "send", "recv")

Point-to-point: the pipeline runner's sends and receives between stages (``dist.isend`` /
``dist.recv``) reach the dispatcher as ``c10d.send`` / ``c10d.recv_`` and are recorded too, with
the peer rank as their group (``"peer:<rank>"``) and the runner's site ``fwd:<value>->p2p`` (the
activation) or ``bwd:<value>->p2p`` (its gradient). `predicted_boundary` gives what the planner
prices for them and `compare_boundary` compares the two per direction.

Each record carries the "site" that was current when it ran: the executor (`runtime.executor`)
sets ``fwd:<node>`` while it runs a node, ``fwd:<u>-><v>`` / ``bwd:<u>-><v>`` while it redistributes
the value of edge u -> v or its gradient, and ``bwd:<node>`` while autograd runs that node's
backward. Sites live in a plain module-level stack (not a contextvar) because autograd may call
backward hooks from another thread.

Every rank of an SPMD program issues the same collectives, so the records of one rank are the
program's. With the fake process group (``init_process_group("fake", ...)``) collectives do nothing
but are still dispatched, so bytes can be counted for meshes larger than the machine.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.communication import LogicalMesh
from cost_models.resharding import reshard_steps
from planner.inter.stage_table import stage_boundary_bytes
from planner.intra.prices import expected_grad, grad_from_consumer, norm
from planner.intra.solve import StageSolution
from planner.intra.strategies import consumed_output
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_file import ParallelPlan

__all__ = [
    "Collective",
    "CommCounter",
    "compare_boundary",
    "current_site",
    "predicted_boundary",
    "predicted_collectives",
    "set_site",
    "site",
]

_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

# op name -> (collective kind as in cost_models.communication, multiply input bytes by group size?)
_KINDS: dict[str, tuple[str, bool]] = {
    "all_reduce": ("all_reduce", False),
    "all_reduce_": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce", False),
    "all_reduce_coalesced_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True),
    "all_gather_into_tensor_out": ("all_gather", True),
    "all_gather_into_tensor_coalesced": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", True),
    "broadcast": ("broadcast", False),
    "broadcast_": ("broadcast", False),
}

# point-to-point ops of c10d (ProcessGroup.send / recv) -> kind
_P2P = {"send": "send", "recv_": "recv"}

_SITES: list[str] = [""]


# node.meta["custom"] keys that carry a traced collective's site (see `_mirror`), one per phase:
# AOTAutograd copies every forward node's "custom" metadata onto the backward nodes of the same
# autograd node, forward keys winning (``copy_fwd_metadata_to_bw_nodes``).
SITE_META = {False: "meshplan_site_fwd", True: "meshplan_site_bwd"}


def current_site() -> str:
    """The label collectives are attributed to right now."""
    return _SITES[-1]


def _mirror() -> None:
    """While a graph is being traced (AOTAutograd traces with ``preserve_node_meta``), copy the
    current label into ``torch.fx.traceback.current_meta["custom"]``: every fx node created from
    now on carries it in ``node.meta["custom"]``, under ``SITE_META[True]`` while autograd runs a
    backward node, else ``SITE_META[False]``, so that `label_graph_sites` can attribute the
    collectives of a compiled graph (`runtime.compiled`) to the same sites as eager runs."""
    if fx_traceback.has_preserved_node_meta():
        meta = fx_traceback.current_meta
        backward = torch._C._current_autograd_node() is not None
        custom = dict(meta.get("custom") or {})
        custom.pop(SITE_META[not backward], None)
        custom[SITE_META[backward]] = _SITES[-1]
        meta["custom"] = custom


def set_site(label: str) -> None:
    """Replace the current label (used by autograd pre-hooks, which have no scope to pop)."""
    _SITES[-1] = label
    _mirror()


def push_site(label: str) -> None:
    """Make `label` current until the matching `pop_site`."""
    _SITES.append(label)
    _mirror()


def pop_site() -> None:
    """Back to the label current before the last `push_site`."""
    _SITES.pop()
    _mirror()


@contextlib.contextmanager
def site(label: str) -> Iterator[None]:
    """Attribute the collectives issued inside the block to `label`."""
    push_site(label)
    try:
        yield
    finally:
        pop_site()


def is_collective(target: Any) -> bool:
    """Whether `target` (an fx node's target) is one of the collectives `CommCounter` counts."""
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace in _NAMESPACES
        and target._opname in _KINDS
    )


def label_graph_sites(gm: torch.fx.GraphModule, backward: bool) -> int:
    """Wrap every collective of a traced forward (or `backward`) graph whose node carries a site
    (``_mirror``) in ``push_site(label)`` / ``pop_site()`` calls, so that a `CommCounter`
    attributes the collectives the compiled graph issues to the sites the eager executor would.
    Returns how many were labelled."""
    graph, count = gm.graph, 0
    for n in list(graph.nodes):
        if n.op != "call_function" or not is_collective(n.target):
            continue
        label = (n.meta.get("custom") or {}).get(SITE_META[backward])
        if label is None:
            continue
        with graph.inserting_before(n):
            graph.call_function(push_site, (label,))
        with graph.inserting_after(n):
            graph.call_function(pop_site, ())
        count += 1
    if count:
        gm.recompile()
    return count


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it; `nbytes` per the module's byte convention."""

    kind: str
    nbytes: int
    group_size: int
    group: str
    site: str


def _group(arg: Any) -> tuple[str, int]:
    if isinstance(arg, dist.ProcessGroup):
        return arg.group_name, arg.size()
    pg = dist.distributed_c10d._resolve_process_group(arg)
    return str(arg), pg.size()


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Record every functional collective dispatched while active (see module docstring).

    ``axis_of`` maps process-group names to a label (e.g. the mesh axis), so that records can be
    grouped per mesh axis: ``{mesh.get_group(i).group_name: i for i in range(mesh.ndim)}``.
    """

    def __init__(self, axis_of: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.records: list[Collective] = []
        self.axis_of = dict(axis_of or {})

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        ns = getattr(func, "namespace", "")
        name = getattr(func, "_opname", "")
        if ns == "c10d" and name in _P2P:
            nbytes = _tensor_bytes(args[0])
            self.records.append(
                Collective(_P2P[name], nbytes, 2, f"peer:{args[2]}", current_site())
            )
        elif ns in _NAMESPACES and name in _KINDS:
            kind, gathered = _KINDS[name]
            group_arg = args[-1] if "group_name" not in kwargs else kwargs["group_name"]
            group, size = _group(group_arg)
            nbytes = _tensor_bytes(args[0]) * (size if gathered else 1)
            self.records.append(Collective(kind, nbytes, size, group, current_site()))
        return func(*args, **kwargs)

    def bytes_by_kind(self) -> dict[str, int]:
        """Total bytes per collective kind."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.kind] += r.nbytes
        return dict(out)

    def bytes_by_site(self) -> dict[str, dict[str, int]]:
        """site -> kind -> bytes."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[r.site][r.kind] += r.nbytes
        return {s: dict(k) for s, k in out.items()}

    def bytes_by_axis(self) -> dict[tuple[str, Any], int]:
        """(kind, axis label or group name) -> bytes."""
        out: dict[tuple[str, Any], int] = defaultdict(int)
        for r in self.records:
            out[(r.kind, self.axis_of.get(r.group, r.group))] += r.nbytes
        return dict(out)


def predicted_collectives(
    graph: OpGraph, solution: StageSolution, mesh: LogicalMesh
) -> dict[str, list[tuple[str, float]]]:
    """What the planner prices, per site of the executor: ``"fwd:u->v"`` -> [(kind, bytes)] for the
    forward redistribution of every edge u -> v of the chosen strategies, and ``"bwd:u->v"`` for its
    gradient (`planner.intra.prices`: from ``grad_from_consumer(dst, v's strategy)`` to
    ``expected_grad(src)``), both from `cost_models.resharding.reshard_steps`. One micro-batch,
    forward + backward (the parameter-gradient part is not divided by the micro-batches)."""
    out: dict[str, list[tuple[str, float]]] = {}
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for fx_v in graph.gm.graph.nodes:
        if (
            fx_v.op != "call_function"
        ):  # a pipeline stage's output node has no op-graph node
            continue
        v = graph.node(fx_v.name)
        if v.op != "call":
            continue
        vs = solution.choice[v.name].strategy
        for u in dict.fromkeys(v.inputs):
            fx_u = nodes[u]
            k = fx_v.all_input_nodes.index(fx_u)
            o = consumed_output(fx_u, fx_v)
            src, dst = solution.choice[u].strategy.output[o], vs.inputs[k]
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
                grad = grad_from_consumer(dst, vs, mesh.shape)
                steps.append((f"bwd:{u}->{v.name}", grad, expected_grad(src)))
            for label, a, b in steps:
                if a == b:
                    continue
                colls = [
                    (st.collective, st.nbytes)
                    for st in reshard_steps(mesh, meta.shape, width, a, b)
                    if st.collective
                ]
                if colls:
                    out[label] = colls
    return out


def as_run_on(kind: str, device_type: str) -> str:
    """The collective DTensor really issues for a priced one: on CPU meshes (gloo has no
    all-to-all) DTensor 2.13 re-shards S(i) -> S(j) by all-gather + local chunk
    (``shard_dim_alltoall``), so a priced all_to_all of B bytes runs as an all_gather of B bytes."""
    return "all_gather" if kind == "all_to_all" and device_type == "cpu" else kind


def compare(
    predicted: dict[str, list[tuple[str, float]]],
    measured: list[Collective],
    device_type: str = "cpu",
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Predicted vs measured bytes: ``{kind: (predicted, measured)}`` (predicted kinds mapped with
    `as_run_on`) and one line per site whose collectives differ."""
    pred_site: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for label, colls in predicted.items():
        for kind, nbytes in colls:
            pred_site[label][as_run_on(kind, device_type)] += nbytes
    meas_site: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in measured:
        meas_site[r.site][r.kind] += r.nbytes
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    diffs = []
    for label in sorted(set(pred_site) | set(meas_site)):
        p, m = dict(pred_site.get(label, {})), dict(meas_site.get(label, {}))
        for kind, b in p.items():
            totals[kind][0] += b
        for kind, b in m.items():
            totals[kind][1] += b
        if p != m:
            diffs.append(f"{label}: predicted {p or '{}'}, measured {m or '{}'}")
    return {k: (v[0], v[1]) for k, v in sorted(totals.items())}, diffs


DIRECTIONS = ("fwd", "bwd")


def predicted_boundary(graph: OpGraph, plan: ParallelPlan) -> dict[str, float]:
    """Point-to-point bytes of one step between stages as the planner prices them, per direction:
    ``{"fwd": activations, "bwd": their gradients}``. For every stage boundary, the full values
    crossing it (`planner.inter.stage_table.stage_boundary_bytes`; the planner's send time is that many
    bytes split over the sending stage's devices, once each way) times the micro-batches. `graph`:
    the model traced on one micro-batch."""
    per_mb = stage_boundary_bytes(
        graph, plan.layer_nodes, [s.layers[0] for s in plan.stages]
    )
    total = sum(per_mb) * plan.num_microbatches
    return {d: total for d in DIRECTIONS}


def boundary_bytes(records: list[Collective], kind: str = "send") -> dict[str, float]:
    """Bytes of the point-to-point records of `kind` ("send" or "recv") per direction, from the
    runner's sites ``fwd:<value>->p2p`` / ``bwd:<value>->p2p``. Pass the records of every rank: a
    rank records only what it sends or receives itself."""
    out = dict.fromkeys(DIRECTIONS, 0.0)
    for r in records:
        if r.kind == kind and r.site.endswith("->p2p"):
            out[r.site.split(":", 1)[0]] += r.nbytes
    return out


def compare_boundary(
    predicted: dict[str, float], records: list[Collective], rel: float = 0.1
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Priced vs sent point-to-point bytes per direction: ``{direction: (predicted, measured)}``
    and one line per direction where they differ by more than `rel` of the prediction (measured
    from every rank's "send" records)."""
    sent = boundary_bytes(records)
    table = {d: (predicted[d], sent[d]) for d in DIRECTIONS}
    diffs = [
        f"{d}: priced {p:.0f} B, sent {m:.0f} B"
        for d, (p, m) in table.items()
        if abs(m - p) > rel * max(p, 1.0)
    ]
    return table, diffs
