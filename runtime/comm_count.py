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
activation) or ``bwd:<value>->p2p`` (its gradient).

Each record carries the "site" that was current when it ran: the executor (`runtime.executor`)
sets ``fwd:<node>`` while it runs a node, ``fwd:<u>-><v>`` / ``bwd:<u>-><v>`` while it redistributes
the value of edge u -> v or its gradient, and ``bwd:<node>`` while autograd runs that node's
backward. Sites live in a plain module-level stack (not a contextvar) because autograd may call
backward hooks from another thread.

Every rank of an SPMD program issues the same collectives, so the records of one rank are the
program's. What the planner priced for the same sites is
`planner.intra.priced_comm.predicted_collectives`. With the fake process group (``init_process_group("fake", ...)``) collectives do nothing
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

__all__ = [
    "Collective",
    "CommCounter",
    "current_site",
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
