"""Stage-boundary values sent in pieces: each byte of a boundary value crosses between two stages once.

The planner prices a boundary value of B bytes (one micro-batch) as ``B / n`` bytes sent by each of
the sending stage's n devices, in parallel, each way (`planner.inter.boundaries.send_times`, Alpa's
cross-mesh transfer): B bytes in total forward, and B bytes of gradient backward for the values
that need one (`needs_grad`: both runners and the planner's price follow the traced graph). The runner
(`runtime.pipeline`) makes the value replicated on the sending mesh first; sending the whole value
to each of the m receiving devices would move m * B bytes. Instead the value is cut into m equal
pieces (flattened, zero-padded to a multiple of m): the i-th receiving device (in rank order) gets
piece i from one sender, and the receivers all-gather the pieces within their stage to rebuild the
value. The gradient goes back the same way, cut into pieces for the sending stage's devices.

What PyTorch lacks: ``torch.distributed.pipelining`` sends whole local tensors between one rank per
stage; it has no transfer between meshes of several devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph

__all__ = [
    "assemble",
    "empty_piece",
    "needs_grad",
    "piece_index",
    "pieces",
    "stage_groups",
]

Groups = dict[tuple[int, ...], dist.ProcessGroup | None]


def stage_groups(device_lists: Sequence[Sequence[int]]) -> Groups:
    """One process group per distinct set of devices (of two or more ranks), created in the given
    order: collective over the world group, so every rank calls it with the same lists. The group's
    ranks are sorted, as `piece_index` numbers them. Ranks outside a group hold ``None`` for it."""
    out: Groups = {}
    for devices in device_lists:
        key = tuple(sorted(devices))
        if len(key) < 2 or key in out:
            continue
        group = dist.new_group(list(key))
        member = dist.get_rank() in key
        if member and tuple(dist.get_process_group_ranks(group)) != key:
            raise MeshplanError(f"process group over {key} has another rank order")
        out[key] = group if member else None
    return out


def needs_grad(graph: OpGraph, v: str) -> bool:
    """Whether boundary value `v` carries a gradient back: a floating value computed from
    parameters, not, e.g., rotary tables sliced from a buffer (what
    `planner.inter.boundaries.boundary_bytes` prices). Sender and receiver decide it from the
    traced graph, so neither computes, keeps nor sends one for the others."""
    return graph.node(v).carries_grad


def piece_index(devices: Sequence[int], rank: int) -> int:
    """Which piece device `rank` of a stage on `devices` receives (its rank order in the stage)."""
    return sorted(devices).index(rank)


def _piece_numel(numel: int, n: int) -> int:
    return math.ceil(numel / n) if numel else 0


def pieces(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`t` flattened, zero-padded to a multiple of `n` elements, as `n` contiguous equal pieces."""
    flat = t.detach().reshape(-1)
    size = _piece_numel(flat.numel(), n)
    if size * n != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(size * n - flat.numel())])
    return list(flat.contiguous().view(n, size).unbind(0))


def empty_piece(
    shape: Sequence[int], dtype: torch.dtype, n: int, device: torch.device
) -> torch.Tensor:
    """A receive buffer on `device` for one of the `n` pieces of a tensor of `shape`."""
    return torch.empty(_piece_numel(math.prod(shape), n), dtype=dtype, device=device)


def assemble(
    piece: torch.Tensor,
    shape: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The tensor of `shape` rebuilt from this rank's `piece`: all-gathered over `group` (the
    receiving stage's devices, in rank order), or the piece itself when the stage has one device."""
    numel = math.prod(shape)
    if group is None:
        whole = piece
    else:
        whole = funcol.all_gather_single(piece.contiguous(), 0, group)
        if isinstance(whole, funcol.AsyncCollectiveTensor):
            whole = whole.wait()
    if whole.numel() < numel:
        raise MeshplanError(
            f"boundary value of shape {tuple(shape)} rebuilt from {whole.numel()} elements"
        )
    return whole[:numel].reshape(shape).clone()
