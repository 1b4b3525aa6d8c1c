"""FSDP (ZeRO stage 3) parameters of one stage: gathered around their use, gradients
reduce-scattered (``StagePlan.fsdp_params``; priced in `planner.intra.fsdp_prices`).

The optimizer's leaf of such a parameter is its shard (`planner.vocab.placements.zero_shard`,
placed by `runtime.pipeline.PipelineRunner.place_params`). In every micro-batch:

* forward: the executor asks `FsdpParams.value` for the parameter when the first node reading it
  runs; that all-gathers the shard to the planned placement (site ``fwd:fsdp:<path>``) through
  `_Gather`, an autograd function, and starts the all-gather of the next FSDP parameter in
  first-use order (prefetch: on NCCL the functional collective runs on its own stream while this
  parameter's ops compute; waited at its first use. On gloo every collective here completes as
  it is issued, `runtime.redistribute.waits_at_once`, the bookkeeping being the same). After the last node reading it has run the
  gathered copy is no longer referenced: what autograd saves of it (a matmul keeps its weight)
  is replaced by a token (``torch.autograd.graph.saved_tensors_hooks``), so the storage is freed;
* backward: unpacking a token gathers the parameter again (site ``bwd:fsdp:<path>``, once per
  micro-batch, kept until its gradient is reduced) and starts the gather of the parameter before
  it. A parameter whose backward saved nothing of it is gathered there too, as FSDP unshards every
  parameter before its module's backward: two all-gathers and one reduce-scatter per parameter
  and micro-batch, as priced. `_Gather`'s backward receives the parameter's gradient once it is
  complete (partial on the sharded axes), drops the gathered copy and issues the gradient's
  reduce-scatter onto the shard (same site; for an HSDP parameter, ``StagePlan.fsdp_axes``,
  the reduce-scatter inside the host and then the all-reduce of the shard across hosts,
  `planner.vocab.placements.reduce_midpoint`, issued together) without waiting for it (``async_op``: a functional
  collective, an ``AsyncCollectiveTensor``); it hands autograd no gradient for the shard.
  Reduce-scatters are waited for one layer later, as FSDP2 waits for a module group's
  reduce-scatter before the next group issues its own: before the first reduce-scatter of an
  earlier unit (``layers``: the FSDP unit of the parameter's first consumer, a plan layer cut at
  each transformer block, `runtime.stages.fsdp_units`; without them
  every parameter is its own layer) is issued, and at the latest when that backward pass ends
  (a callback queued on autograd's engine, as FSDP2 queues its final callback). Waited, each is
  added into the shard's ``.grad``, as autograd would accumulate it: the gradient accumulates over
  the micro-batches on the shard. So layer l's reduce-scatters run while the rest of layer l's
  backward and the start of layer l-1's compute; the first layer's, issued last, are waited for
  at the end of the backward (as `planner.inter.stage_table` prices them).

Recomputation (the executor's ``recompute_layers``: each segment run under a non-reentrant
``torch.utils.checkpoint``), as FSDP2 runs ``fully_shard`` over checkpointed blocks:

* forward: as above; inside a checkpointed segment the checkpoint's own saved-tensor hooks
  (innermost) keep nothing the ops save, so the gathered copy is freed after its last use;
* backward: autograd reaching a segment makes the checkpoint re-run its forward
  (`recomputing`): each parameter the recomputed forward reads is gathered there (site
  ``bwd:fsdp:<path>``: the backward's one gather of it per micro-batch, none more), prefetching
  the next one in backward order (`bwd_order`: the units of the stage, a segment or an op run
  outside one, last first; a segment's parameters in their forward order); the recomputed ops
  save that copy, and the segment's backward uses it; `_Gather`'s backward finds it gathered,
  drops it and reduce-scatters the gradient as above. So a recomputed stage communicates what
  an unrecomputed one does - two all-gathers and one reduce-scatter per parameter and
  micro-batch - and holds a segment's gathered parameters (and the next one prefetched) while
  that segment's backward runs. A selective segment (an attention core) reads no parameter.

What PyTorch's own pieces lack here: FSDP2's ``fully_shard`` wraps ``nn.Module`` forward calls
(pre/post-forward hooks unshard and reshard a module's parameters), while a stage here is an fx
graph of aten ops interpreted over DTensors (`runtime.executor`), with no module calls to hook;
DTensor's redistribution (``redistribute_local_tensor``, with ``async_op`` for the prefetched
gathers and the reduce-scatters), saved-tensor hooks and autograd's ``queue_callback`` are the
pieces used. The executor runs such stages eagerly:
AOTAutograd (`runtime.compiled`) would save the gathered weights for backward inside its graphs
(where no hook replaces them).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from cost_models.errors import MeshplanError
from planner.vocab.placements import reduce_midpoint
from runtime import comm_count
from runtime.redistribute import redistribute

__all__ = ["FsdpParams"]


def _ready(x: DTensor) -> DTensor:
    """`x` with its collective waited for (a plain local tensor)."""
    local = x._local_tensor
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
        x = DTensor.from_local(
            local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride()
        )
    return x


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


@dataclass(frozen=True)
class _Reduce:
    """A gradient reduce-scatter in flight: its layer, the shard it adds into, its result."""

    layer: int
    shard: DTensor
    grad: DTensor


@dataclass(frozen=True)
class _Token:
    """A saved view of a gathered parameter, rebuilt from a new gather in backward."""

    name: str
    microbatch: int
    offset: int  # storage offset relative to the gathered local tensor's
    size: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[Placement, ...] | None  # None: a plain local tensor was saved
    shape: tuple[int, ...]
    global_stride: tuple[int, ...]


class _Gather(torch.autograd.Function):
    """Forward: the gathered copy (gathered by the caller). Backward: issue the gradient's
    reduce-scatter onto the shard (`FsdpParams._reduce`, added into ``.grad`` once waited),
    after gathering again if nothing did in this backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, shard: DTensor, full: DTensor, owner: FsdpParams, name: str, mb: int
    ) -> DTensor:
        # `shard` (requiring grad) is an input so that autograd records this node; its gradient
        # is not returned but added into ``shard.grad`` once its reduce-scatter is waited for
        ctx.owner, ctx.name, ctx.mb = owner, name, mb
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Any, None, None, None, None]:
        owner = ctx.owner
        owner._regather(ctx.name, ctx.mb)  # FSDP gathers every parameter in backward
        owner._regathered.pop((ctx.name, ctx.mb), None)
        owner._reduce(ctx.name, ctx.mb, grad)
        return None, None, None, None, None


class FsdpParams:
    """The FSDP parameters of one executor: placeholder name -> the placements of its shard
    (module docstring). `value` and `done` are called by the executor around every node.
    ``layers``: op node name -> its FSDP unit (a parameter's is its first consumer's).
    ``segments``: the executor's ``recompute_layers`` (op node name -> its checkpointed
    segment; None: nothing recomputed), which orders the backward's gathers (`bwd_order`)."""

    def __init__(
        self,
        executor: Any,
        shards: dict[str, tuple[Placement, ...]],
        layers: dict[str, int] | None = None,
        segments: dict[str, int] | None = None,
    ) -> None:
        self.ex, self.shards = executor, shards
        graph = executor.opgraph
        self.paths = {n: graph.placeholder_paths[n] for n in shards}
        self.planned = {
            n: executor.placements(executor._planned_output(n)) for n in shards
        }
        order: list[str] = []
        self.uses: dict[str, int] = dict.fromkeys(shards, 0)
        # name -> its layer: reduce-scatters are waited one layer later (module docstring)
        self.layer: dict[str, int] = {}
        for node in graph.gm.graph.nodes:
            if node.op != "call_function":
                continue
            for u in dict.fromkeys(node.all_input_nodes):
                if u.name in shards:
                    self.uses[u.name] += 1
                    if u.name not in order:
                        order.append(u.name)
                    if layers is None:
                        self.layer.setdefault(u.name, len(order) - 1)
                    elif node.name in layers:
                        self.layer.setdefault(u.name, layers[node.name])
        self.next = dict(itertools.pairwise(order))
        # the backward's gathers, each prefetching the one after it in `bwd_order`
        self.bwd_order = (
            order[::-1] if segments is None else _bwd_order(graph, shards, segments)
        )
        self.bwd_next = dict(itertools.pairwise(self.bwd_order))
        self._mb: int | None = None
        self._recompute_mb: int | None = None  # the micro-batch being recomputed
        self._shard_values: dict[str, DTensor] = {}
        self._live: dict[str, DTensor] = {}
        self._left: dict[str, int] = {}
        self._fetched: dict[str, DTensor] = {}  # forward prefetches
        self._saved: dict[int, tuple[str, Any, int, tuple[int, ...]]] = {}
        self._regathered: dict[tuple[str, int], DTensor] = {}  # (name, mb) -> copy
        self._reduced: set[tuple[str, int]] = set()  # (name, mb) reduce-scattered
        self._shards_of: dict[int, dict[str, DTensor]] = {}  # mb -> its shards
        self._pending: list[_Reduce] = []  # reduce-scatters in flight
        self._callback_queued = False

    def _gather(self, name: str, shard: DTensor, phase: str) -> DTensor:
        """Start the all-gather of `name` (waited by `_ready` where it is used)."""
        with comm_count.site(f"{phase}:fsdp:{self.paths[name]}"):
            return redistribute(shard.detach(), self.planned[name], async_op=True)

    def _reduce(self, name: str, mb: int, grad: DTensor) -> None:
        """Issue the reduce-scatter of `name`'s complete gradient of micro-batch `mb` onto its
        shard, after waiting for those of later layers (module docstring)."""
        layer = self.layer.get(name, 0)
        self._reduced.add((name, mb))
        self._wait(lambda r: r.layer > layer)
        shard = self._shards_of[mb][name]
        if not shard.is_leaf:
            raise MeshplanError(
                f"the FSDP shard of {self.paths[name]} is not a leaf: its gradient has no home"
            )
        held = self.shards[name]
        mid = reduce_midpoint(self.planned[name], held, tuple(grad.placements))
        with comm_count.site(f"bwd:fsdp:{self.paths[name]}"):
            # HSDP: reduce-scatter inside the host, then all-reduce the shard across hosts
            # (issued at once: the second waits for the first on its stream, not here)
            out = redistribute(grad, mid, async_op=True)
            if tuple(mid) != tuple(held):
                out = redistribute(out, held, async_op=True)
        self._pending.append(_Reduce(layer, shard, out))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _wait(self, which: Callable[[_Reduce], bool] | None = None) -> None:
        """Wait for the reduce-scatters in flight that `which` selects (all when None) and add
        each into its shard's ``.grad``, in the order they were issued."""
        keep = []
        for r in self._pending:
            if which is not None and not which(r):
                keep.append(r)
                continue
            with torch.no_grad():
                grad = _ready(r.grad)
                if r.shard.grad is None:
                    r.shard.grad = grad
                else:
                    r.shard.grad += grad
        self._pending = keep

    def _end_backward(self) -> None:
        """Queued on autograd's engine: the backward pass ended; wait for what is in flight."""
        self._callback_queued = False
        self._wait()

    @contextlib.contextmanager
    def forward(self, microbatch: int, env: dict[Any, Any]) -> Iterator[None]:
        """The forward of one micro-batch: gathered copies are tracked and saved as tokens.
        `env` holds the shards (placeholder nodes -> DTensor)."""
        if self._mb is not None:
            raise MeshplanError("an FSDP forward is already running on this executor")
        shards = {
            n.name: v for n, v in env.items() if getattr(n, "name", None) in self.shards
        }
        self._mb, self._shard_values = microbatch, shards
        self._shards_of[microbatch] = shards
        self._left = dict(self.uses)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._mb, self._live, self._fetched, self._saved = None, {}, {}, {}

    @property
    def in_forward(self) -> bool:
        """Whether a micro-batch's forward is running (`forward`)."""
        return self._mb is not None

    @contextlib.contextmanager
    def recomputing(self, microbatch: int) -> Iterator[None]:
        """A checkpointed segment of micro-batch `microbatch` re-runs its forward in backward:
        `value` hands out the backward's gathered copies (module docstring)."""
        self._recompute_mb = microbatch
        try:
            yield
        finally:
            self._recompute_mb = None

    def value(self, name: str) -> DTensor:
        """The gathered copy of FSDP parameter `name` in the current forward (or recomputed
        forward, `recomputing`)."""
        mb = self._recompute_mb
        if mb is not None:
            # through `_Gather` as in the forward, so that the recomputed ops save what the
            # forward's did (their weight requires grad); this graph itself is discarded
            full = self._regather(name, mb)
            return _Gather.apply(self._shards_of[mb][name], full, self, name, mb)
        if name in self._live:
            return self._live[name]
        shard = self._shard_values[name]
        full = self._fetched.pop(name, None)
        if full is None:
            full = self._gather(name, shard, "fwd")
        nxt = self.next.get(name)
        if nxt is not None and nxt not in self._fetched and nxt not in self._live:
            self._fetched[nxt] = self._gather(nxt, self._shard_values[nxt], "fwd")
        full = _ready(full)
        y = _Gather.apply(shard, full, self, name, self._mb)
        root = _root(y._local_tensor)
        self._saved[root.untyped_storage().data_ptr()] = (
            name,
            weakref.ref(root),
            root.storage_offset(),
            tuple(root.stride()),
        )
        self._live[name] = y
        return y

    def done(self, name: str) -> None:
        """A node reading `name` has run; after the last one the copy is no longer held."""
        if self._recompute_mb is not None:
            return  # the backward's copy is dropped by `_Gather.backward`
        self._left[name] -= 1
        if self._left[name] == 0:
            self._live.pop(name, None)

    def _pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if type(local) is not torch.Tensor or local.layout != torch.strided:
            return t
        try:
            ptr = local.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self._saved.get(ptr)
        if entry is None or entry[1]() is None:
            return t
        name, _, base_offset, _ = entry
        is_d = isinstance(t, DTensor)
        return _Token(
            name,
            self._mb,
            local.storage_offset() - base_offset,
            tuple(local.size()),
            tuple(local.stride()),
            tuple(t.placements) if is_d else None,
            tuple(t.shape),
            tuple(t.stride()),
        )

    def _regather(self, name: str, mb: int) -> DTensor:
        key = (name, mb)
        if key not in self._regathered:
            shard = self._shards_of[mb][name]
            self._regathered[key] = self._gather(name, shard, "bwd")
            nxt = self.bwd_next.get(name)
            if (
                nxt is not None
                and (nxt, mb) not in self._regathered
                and (nxt, mb) not in self._reduced
            ):
                self._regathered[nxt, mb] = self._gather(
                    nxt, self._shards_of[mb][nxt], "bwd"
                )
        full = self._regathered[key] = _ready(self._regathered[key])
        return full

    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Token):
            return saved
        full = self._regather(saved.name, saved.microbatch)
        base = _root(full._local_tensor)
        local = base.as_strided(
            saved.size, saved.stride, base.storage_offset() + saved.offset
        )
        if saved.placements is None:
            return local
        return DTensor.from_local(
            local,
            full.device_mesh,
            saved.placements,
            run_check=False,
            shape=torch.Size(saved.shape),
            stride=saved.global_stride,
        )

    def finish(self) -> None:
        """After the step's last backward: forget the micro-batches' shards (and wait for any
        reduce-scatter left in flight by a backward whose callback did not run)."""
        self._wait()
        self._callback_queued = False
        self._shards_of.clear()
        self._regathered.clear()
        self._reduced.clear()


def _bwd_order(
    graph: Any, shards: dict[str, tuple[Placement, ...]], segments: dict[str, int]
) -> list[str]:
    """The order in which a recomputing stage's backward first needs its FSDP parameters: the
    stage's units (a run of consecutive ops of one checkpointed segment, as the executor cuts
    them, or one op outside every segment) last first; within a segment its parameters in
    forward order (the recomputed forward reads them so), within an op in argument order."""
    units: list[tuple[Any, list[str]]] = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        key = segments.get(node.name)
        reads = [
            u.name for u in dict.fromkeys(node.all_input_nodes) if u.name in shards
        ]
        if key is not None and units and units[-1][0] == key:
            units[-1][1].extend(reads)
        else:
            units.append((key, reads))
    return list(dict.fromkeys(n for _, reads in reversed(units) for n in reads))
