"""Moving DTensors between placements, as the planner priced it.

DTensor's `redistribute` refuses conversions between partial kinds (P(mask), P(avg), P(sum)) and
from Shard to Partial, and records no backward when source and target already match (so a
replicated weight's gradient would stay Partial and the data-parallel all-reduce would never run).
What PyTorch lacks is written here: local partial-kind conversions (`_repartial`), S -> P through R
(as `cost_models` prices it), and `Edge`, an autograd function whose backward moves the gradient
to the placement `planner.vocab.grads.expected_grad` prices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import (
    Placement,
    _MaskPartial,
    _StridedShard,
)

from cost_models.errors import MeshplanError
from runtime import comm_count


def _repartial(x: DTensor, dst: tuple[Placement, ...]) -> DTensor:
    """Change the kind of a partial placement locally, on the axes where `dst` asks for another.

    The planner treats every partial as "P" (`planner.vocab.placements.norm`), so a producer's partial
    may meet a consumer that wants another kind; DTensor refuses to convert between partial types
    ("one partial type to another is unsupported"), which would cost an all-reduce. The
    conversions that the planner's strategies need are local (PyTorch lacks them):

    * ``_MaskPartial`` (a vocabulary-parallel embedding's output) -> ``Partial("sum")``: zero the
      rows whose indices lie outside the local shard, which DTensor does only when it reduces, and
      release the mask as DTensor's reduction does (`unmask` says why this matters);
    * ``Partial("sum")`` <-> ``Partial("avg")``: multiply / divide the local value by the axis size
      (the full value is the sum, resp. the mean, of the local ones).
    """
    places = list(x.placements)
    local = x._local_tensor
    for i, (c, d) in enumerate(zip(places, dst)):
        if not (c.is_partial() and d.is_partial()) or c == d:
            continue
        if isinstance(c, _MaskPartial) and c.reduce_op == "sum":
            mask = c.mask_buffer.data
            if mask is None:
                raise MeshplanError(
                    "a vocabulary-sharded (P(mask)) value was converted after its mask was "
                    "released: it must be unmasked once, where it is produced (`unmask`)"
                )
            m = mask if local.ndim == mask.ndim else mask.unsqueeze(-1)
            local = local.masked_fill(m, 0.0)
            # the mask is used up, as DTensor's own reduction (`_MaskPartial._reduce_value`)
            # releases it: the buffer lives in DTensor's cached sharding strategy, and a mask
            # left materialised is compared with the next batch's (and would hold a traced
            # tensor after `runtime.compiled` traces the stage)
            c.mask_buffer.release_mask()
            c = places[i] = Partial("sum")
        ops = (c.reduce_op, d.reduce_op)
        if type(c) is Partial and type(d) is Partial and ops in _REPARTIAL:
            local = local * _REPARTIAL[ops](x.device_mesh.size(i))
            places[i] = d
    if places == list(x.placements):
        return x
    spec = DTensorSpec(x._spec.mesh, tuple(places), tensor_meta=x._spec.tensor_meta)
    return DTensor(local, spec, requires_grad=False)


_REPARTIAL = {
    ("sum", "sum"): lambda n: 1.0,
    ("sum", "avg"): lambda n: float(n),
    ("avg", "sum"): lambda n: 1.0 / n,
}


def redistribute(
    x: DTensor, dst: Sequence[Placement], *, async_op: bool = False
) -> DTensor:
    """`x` redistributed to `dst`, without autograd (callers are `Edge`'s forward and backward, and
    tensors that need no gradient). Like ``DTensor.redistribute`` (DTensor's greedy plan,
    ``redistribute_local_tensor``) but also to Partial, which the public method reserves for
    DTensor's internal use: R -> P is local; S -> P, which DTensor refuses, goes S -> R -> P (as
    `cost_models.resharding.reshard_steps` prices it); partials of another kind are converted
    locally where possible (`_repartial`), else through R. With ``async_op`` the last collective
    is left in flight: the local tensor is an ``AsyncCollectiveTensor``, waited by its first use
    or its ``wait()`` (on gloo it has already completed when it is returned: `waits_at_once`)."""
    dst = tuple(dst)
    if tuple(x.placements) == dst:
        return x
    canonical = tuple(map(_layout, x.placements))
    if canonical == tuple(map(_layout, dst)):  # one layout written two ways
        return relabel(x, dst)
    if canonical != tuple(x.placements):  # DTensor redistributes from plain shards
        x = relabel(x, canonical)
    x = _repartial(x, dst)
    via = tuple(
        Replicate() if d.is_partial() and not c.is_replicate() and c != d else d
        for c, d in zip(x.placements, dst)
    )
    spec, local = x._spec, x._local_tensor
    for target in (via, dst) if via != dst else (dst,):
        if target == spec.placements:
            continue
        new = DTensorSpec(spec.mesh, target, tensor_meta=spec.tensor_meta)
        local = redistribute_local_tensor(local, spec, new, async_op=async_op)
        spec = new
    if async_op and isinstance(local, AsyncCollectiveTensor) and waits_at_once():
        local.trigger_wait()  # still an AsyncCollectiveTensor, completed
    return DTensor(local, spec, requires_grad=False)


def _layout(p: Placement) -> Placement:
    return Shard(p.dim) if isinstance(p, _StridedShard) and p.split_factor == 1 else p


def same_layout(a: Sequence[Placement], b: Sequence[Placement]) -> bool:
    """Whether placements `a` and `b` lay a tensor out alike: equal, or differing only where one
    writes ``Shard(d)`` as ``_StridedShard(d, split_factor=1)`` (`planner.vocab.nested_views`)."""
    return tuple(map(_layout, a)) == tuple(map(_layout, b))


def relabel(x: DTensor, dst: Sequence[Placement]) -> DTensor:
    """`x` written with the placements `dst` of the same layout (`same_layout`): the same local
    tensor, no communication, no autograd."""
    spec = DTensorSpec(x._spec.mesh, tuple(dst), tensor_meta=x._spec.tensor_meta)
    return DTensor(x._local_tensor, spec, requires_grad=False)


def strided_writing(
    placements: Sequence[Placement], axis: int
) -> tuple[Placement, ...]:
    """`placements` with the ``Shard(d)`` of DeviceMesh dimension `axis` written as
    ``_StridedShard(d, split_factor=1)``: the same layout, in the writing DTensor's view rule
    unflattens a dimension sharded on two axes from (`planner.vocab.nested_views`)."""
    return tuple(
        _StridedShard(p.dim, split_factor=1) if a == axis else p
        for a, p in enumerate(placements)
    )


def waits_at_once() -> bool:
    """Whether a collective issued with ``async_op`` is waited for at once: on gloo.

    Gloo's TCP transport can hang both ranks when several collectives of one group are in
    flight at once (its two worker threads run two of them together): launches of 2 ranks
    each issuing 30000 random DTensor all-gathers and reduce-scatters with `async_op` and
    waiting for random subsets of them, as FSDP's prefetches and reduce-scatters are, hung in
    3 of 78 launches on this machine (2026-11-29, `python -m benchmarks.gloo_inflight` and two
    variants), every rank waiting for a collective that never completed (gdb: one rank's
    all-gather waiting for its send to complete beside its all-reduce waiting to receive, the
    other rank's all-gather spinning in gloo's ``UnboundBuffer`` destructor);
    `runtime.fsdp`'s test hung so once in three CI runs. Waited at once, one collective is in
    flight at a time, as with DTensor's synchronous redistributions. Torch passes no options
    to gloo groups (one worker thread might do), so the runtime waits. On NCCL the collective stays in flight on its own stream, as
    `planner.intra.fsdp_prices` prices it. The gradient buckets' all-reduces
    (`runtime.grad_overlap`) stay in flight on gloo too, priced so for CPU clusters; no hang
    was seen there."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def allreduce_axes(
    src: Sequence[Placement], dst: Sequence[Placement]
) -> tuple[int, ...] | None:
    """The mesh axes on which `src` -> `dst` is a plain all-reduce (``Partial`` of sum or avg ->
    ``Replicate``), if every other axis keeps its placement; else None."""
    axes = []
    for a, (c, d) in enumerate(zip(src, dst)):
        if c == d:
            continue
        if type(c) is Partial and c.reduce_op in ("sum", "avg") and d.is_replicate():
            axes.append(a)
            continue
        return None
    return tuple(axes) if axes else None


class Edge(torch.autograd.Function):
    """Forward: redistribute to the consumer's placement. Backward: redistribute the gradient to
    the placement the planner prices for the producer, written as the producer wrote its output
    where the two lay out alike (DTensor's backward of a view of a doubly sharded dimension
    needs the strided writing its forward produced: `planner.vocab.nested_views`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: DTensor,
        dst: tuple[Placement, ...],
        grad_dst: tuple[Placement, ...],
        label: str,
    ) -> DTensor:
        ctx.grad_dst, ctx.label = (
            grad_dst,
            label,
        )  # grad_dst None: leave the gradient as it is
        ctx.src = tuple(x.placements)
        with comm_count.site(f"fwd:{label}"):
            y = redistribute(x, dst)
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Any, None, None, None]:
        with comm_count.site(f"bwd:{ctx.label}"):
            if isinstance(grad, DTensor) and ctx.grad_dst is not None:
                grad = redistribute(grad, ctx.grad_dst)
        if (
            isinstance(grad, DTensor)
            and tuple(grad.placements) != ctx.src
            and same_layout(grad.placements, ctx.src)
        ):
            grad = relabel(grad, ctx.src)
        return grad, None, None, None


def unmask(x: Any) -> Any:
    """`x` with every ``_MaskPartial`` placement made ``Partial("sum")`` (`_repartial`: the rows
    outside the local vocabulary shard zeroed, the mask released); anything else as it is.

    Why at once, where the value is produced: DTensor keeps the mask of a vocabulary-sharded
    embedding in the ``MaskBuffer`` of the output's placement object, and that object is shared by
    every later call of the op with the same input specs (DTensor's sharding propagation caches the
    output spec). The mask is materialised when the embedding runs and must be released, exactly
    once, before the op runs again with other indices: DTensor releases it when it reduces the
    value (P(mask) -> R or S). A planned P(mask) -> P edge (the residual stream kept partial)
    converts locally instead; without a release, the next micro-batch's embedding finds the buffer
    still holding the previous indices' mask and fails ("MaskBuffer has been materialized with
    conflicting data"). A value read by several consumers would also need the mask more than once.
    As a plain ``Partial("sum")`` the value is the same full tensor (the gradient passes through
    unchanged) and every later redistribution costs what the planner priced for "P".
    """
    if not isinstance(x, DTensor) or not any(
        isinstance(p, _MaskPartial) for p in x.placements
    ):
        return x
    dst = tuple(
        Partial("sum") if isinstance(p, _MaskPartial) else p for p in x.placements
    )
    if x.requires_grad:
        return Edge.apply(x, dst, None, "unmask")
    return redistribute(x, dst)
