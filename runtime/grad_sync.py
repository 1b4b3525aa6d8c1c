"""Synchronising the accumulated parameter gradients once per step, in buckets.

With gradient accumulation (`runtime.executor.PlanExecutor` with ``sync_param_grads=False``) a
parameter's ``.grad`` holds partial sums over the mesh axes its computation was split on;
`sync_grads` brings each to its parameter's placement. PyTorch buckets gradients inside its own
wrappers (DDP's Reducer, FSDP's flat parameters), not for DTensor gradients of arbitrary 2-D
placements, so the buckets are made here:

* all-reduce: gradients that need only ``Partial -> Replicate`` on some axes (the other axes
  unchanged), with the same placements and dtype, are flattened into one tensor and all-reduced
  once per axis;
* reduce-scatter: gradients that need only ``Partial -> Shard(d)`` on one axis (the other axes
  unchanged and none of them sharding d; d's local size divisible by the axis), with the same
  placements and dtype: each is cut into the axis's chunks along d, chunk r of every gradient
  goes into rank r's part of one flat tensor, and that is reduce-scattered once (FSDP's layout);
* anything else is redistributed gradient by gradient.

So a bucket pays one collective's latency however many gradients it holds, as the planner prices
it (`planner.intra.prices.grad_buckets`). The gradients a plan lists in a stage's
``grad_buckets`` are all-reduced before this, in those buckets, launched during the last
micro-batch's backward (`runtime.grad_overlap`); this synchronises the rest.

Tied parameters (`sync_tied`; ``ParallelPlan.tied_params``): a tensor read by several pipeline
stages (an input embedding and the LM head sharing its weight) has one copy per stage (per device
group) holding it, and each copy's gradient, once brought to its placement as above, holds only
its stage's share. As Megatron-LM does for its tied embeddings (an all-reduce over the embedding
group of the first and last stages) and ``torch.distributed.pipelining`` leaves to the user, the
copies' gradients are summed across the stages, so the copies take the same step and stay equal:

* copies that lie alike (`planner.vocab.strategy.tied_copies_align`: equal stage meshes,
  placements and ZeRO) hold the same shard at the same mesh position: one all-reduce of the local
  gradients, bucketed, over the group of the devices at this rank's position in every copy's
  stage (a dimension of a DeviceMesh over the copies' stages, `runtime.pipeline`);
* otherwise each copy's gradient is all-gathered within its stage, the first device of every
  stage contributes it whole and the others zeros to an all-reduce over all the copies'
  devices, and each device keeps its shard of the sum.

What PyTorch lacks: DDP and FSDP sum one module's gradients over its replicas; nothing sums the
gradients of one parameter held by two different pipeline stages on different meshes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Placement

from runtime import comm_count
from runtime.redistribute import allreduce_axes, redistribute

__all__ = ["TiedCopy", "scatter_axis", "sync_grads", "sync_tied"]


def scatter_axis(
    src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> tuple[int, int] | None:
    """(mesh axis, tensor dim) when `src` -> `dst` is one reduce-scatter: ``Partial`` of sum or
    avg -> ``Shard(dim)`` on one axis, every other axis unchanged and not sharding ``dim``."""
    found = None
    for a, (c, d) in enumerate(zip(src, dst)):
        if c == d:
            continue
        if (
            found is None
            and type(c) is Partial
            and c.reduce_op in ("sum", "avg")
            and type(d) is Shard
        ):
            found = (a, d.dim)
            continue
        return None
    if found is None:
        return None
    a, dim = found
    if any(type(p) is Shard and p.dim == dim for b, p in enumerate(dst) if b != a):
        return None
    return found


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _set_grads(
    params: dict[str, DTensor],
    paths: list[str],
    locals_: list[torch.Tensor],
    metas: list[Any],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> None:
    for k, local, meta in zip(paths, locals_, metas):
        spec = DTensorSpec(mesh, placements, tensor_meta=meta)
        params[k].grad = DTensor(local, spec, requires_grad=False)


def _take_grads(params: dict[str, DTensor], paths: list[str]) -> list[Any]:
    """Drop the parameters' gradients (the bucket holds a copy now), so the bucket does not double
    them in memory; their tensor metas, to set the synchronised ones."""
    metas = []
    for k in paths:
        metas.append(params[k].grad._spec.tensor_meta)
        params[k].grad = None
    return metas


def _all_reduce_(flat: torch.Tensor, op: str, mesh: DeviceMesh, axis: int) -> None:
    """All-reduce `flat` in place over `axis` of `mesh`: the functional collective's in-place
    form (``_c10d_functional.all_reduce_``, which `runtime.comm_count` counts), where
    ``Partial._reduce_value`` (``funcol.all_reduce``) would make a reduced copy of the bucket."""
    group = funcol._resolve_group_name((mesh, axis))
    torch.ops._c10d_functional.all_reduce_(flat, op, group)
    torch.ops._c10d_functional.wait_tensor(flat)


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes)]


def sync_grads(params: dict[str, DTensor]) -> None:
    """Bring every parameter's ``.grad`` to the parameter's placements (module docstring)."""
    reduce: dict[tuple, list[str]] = {}
    scatter: dict[tuple, list[str]] = {}
    for path, p in params.items():
        g = p.grad
        if not isinstance(g, DTensor) or g.placements == p.placements:
            continue
        key = (tuple(g.placements), tuple(p.placements), g.dtype)
        if g.device_mesh == p.device_mesh:
            axes = allreduce_axes(g.placements, p.placements)
            if axes is not None:
                reduce.setdefault(key + (axes,), []).append(path)
                continue
            found = scatter_axis(g.placements, p.placements)
            if (
                found
                and g._local_tensor.size(found[1]) % g.device_mesh.size(found[0]) == 0
            ):
                scatter.setdefault(key + (found,), []).append(path)
                continue
        with comm_count.site(f"bwd:sync:{path}"):
            p.grad = redistribute(g, p.placements)
    # Memory: a bucket is one flat copy of its gradients, which replaces them (`_take_grads`)
    # and is reduced in place, so syncing holds the gradients once, as the planner prices them
    # (`cost_models.memory`), plus a reduce-scatter's output shard.
    for (g_pl, p_pl, _, axes), paths in reduce.items():
        mesh = params[paths[0]].grad.device_mesh
        shapes = [params[k].grad._local_tensor.shape for k in paths]
        flat = torch.cat([params[k].grad._local_tensor.reshape(-1) for k in paths])
        metas = _take_grads(params, paths)
        with comm_count.site(f"bwd:sync:{paths[0]}"):
            for a in axes:
                _all_reduce_(flat, g_pl[a].reduce_op, mesh, a)
        _set_grads(params, paths, _split(flat, shapes), metas, mesh, p_pl)
    for (g_pl, p_pl, _, (a, dim)), paths in scatter.items():
        mesh = params[paths[0]].grad.device_mesh
        n = mesh.size(a)
        chunks = [params[k].grad._local_tensor.chunk(n, dim) for k in paths]
        shapes = [c[0].shape for c in chunks]
        flat = torch.cat([c[r].reshape(-1) for r in range(n) for c in chunks])
        del chunks
        metas = _take_grads(params, paths)
        with comm_count.site(f"bwd:sync:{paths[0]}"):
            flat = _wait(g_pl[a]._reduce_shard_value(flat, mesh, a, Shard(0)))
        _set_grads(params, paths, _split(flat, shapes), metas, mesh, p_pl)


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a tied parameter and how its gradient is summed with the other
    copies' (module docstring): over `group`, the devices holding the same shard in every copy's
    stage when ``aligned``, else all the copies' devices, where this rank contributes its stage's
    whole gradient when ``leader`` (the stage's first device) and zeros otherwise."""

    path: str
    group: dist.ProcessGroup
    aligned: bool
    leader: bool


def _local_grad(p: DTensor) -> torch.Tensor:
    g = p.grad
    if g is None:  # the copy's stage did not use it this step
        return torch.zeros_like(p._local_tensor)
    return g._local_tensor


def _like(
    p: DTensor, local: torch.Tensor, placements: Sequence[Placement] | None = None
) -> DTensor:
    """`local` as a DTensor of `p`'s global shape on its mesh (in `placements`, default p's)."""
    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements if placements is None else placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def sync_tied(params: dict[str, DTensor], copies: Sequence[TiedCopy]) -> None:
    """Sum the gradients of this rank's tied-parameter copies with the other copies' (module
    docstring); every gradient must already have its parameter's placements (`sync_grads`)."""
    buckets: dict[tuple, list[TiedCopy]] = {}
    for c in copies:
        if c.aligned:
            key = (id(c.group), params[c.path].dtype)
            buckets.setdefault(key, []).append(c)
            continue
        p = params[c.path]
        mesh, rep = p.device_mesh, [Replicate()] * p.device_mesh.ndim
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        with comm_count.site(f"bwd:tied:{c.path}"):
            full = redistribute(g, rep).to_local()
            mine = full.contiguous() if c.leader else torch.zeros_like(full)
            total = _wait(funcol.all_reduce(mine, "sum", c.group))
        # Replicate -> the copy's placements slices locally
        p.grad = _like(p, total, rep).redistribute(mesh, p.placements)
    for group in buckets.values():
        locals_ = [_local_grad(params[c.path]) for c in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        with comm_count.site(f"bwd:tied:{group[0].path}"):
            flat = _wait(funcol.all_reduce(flat, "sum", group[0].group))
        for c, t in zip(group, _split(flat, [t.shape for t in locals_])):
            params[c.path].grad = _like(params[c.path], t)
