"""One DeviceMesh object per (ranks, shape, names) in a process: `device_mesh`.

Why not ``DeviceMesh(...)`` each time a runner is built: two meshes over the same ranks are equal
(``DeviceMesh.__eq__``) but not the same object, and torch 2.13's DTensor keeps equal-but-distinct
meshes apart only part of the time. A second `runtime.train.Trainer` in one process (the local
suite trains the automatic and the manual plan side by side; the profiler's overhead calibration
trains one before them) traced its stage with AOTAutograd and got forward outputs whose mesh was
the first trainer's: the trace then failed (``Node tangents_2 was invalid, but is output``) and
the stage silently ran on the eager interpreter, 5-10x slower per op. Handing every runner the
same mesh object for the same devices removes the mix, and builds each mesh's process groups
once instead of once per runner. PyTorch has no such registry (``init_device_mesh`` builds a new
mesh, and new groups, on every call).

Every rank must ask for the same meshes in the same order (a new mesh creates process groups,
collectively over the default group); equal requests then hit or miss the cache on every rank
alike. The cache belongs to the default process group: a new one (after
``destroy_process_group``) starts a new cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cost_models.errors import MeshplanError
from planner.vocab.placements import device_mesh_shape
from planner.vocab.plan_file import StagePlan

__all__ = ["device_mesh", "stage_mesh"]

_cache: dict[tuple, DeviceMesh] = {}
_world: list[object] = [None]


def device_mesh(
    device_type: str,
    ranks: torch.Tensor,
    names: Sequence[str] | None = None,
    sub: str | Sequence[str] | None = None,
) -> DeviceMesh:
    """The DeviceMesh over `ranks` (its shape is the mesh's) with dimension `names`; with `sub`,
    that mesh's sub-mesh of those dimension names. The same call returns the same object for the
    life of the default process group (module docstring)."""
    world = dist.group.WORLD
    if _world[0] is not world:
        _cache.clear()
        _world[0] = world
    names_key = tuple(names) if names is not None else None
    key = (device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), names_key)
    mesh = _cache.get(key)
    if mesh is None:
        if ranks.dim() > 1:
            _quiet_flatten_advice()
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names_key)
        _cache[key] = mesh
    if sub is None:
        return mesh
    dims = sub if isinstance(sub, str) else tuple(sub)
    child = _cache.get((*key, dims))
    if child is None:
        child = _cache[(*key, dims)] = mesh[dims]
    return child


def stage_mesh(stage: StagePlan, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh of a stage: its devices shaped as its logical mesh, size-1 axes dropped.
    Collective over the world group: every rank must create every stage's mesh, in the same order."""
    shape = device_mesh_shape(tuple(stage.logical_mesh))
    ranks = torch.tensor(stage.devices, dtype=torch.int64)
    if ranks.numel() != int(torch.tensor(shape).prod()):
        raise MeshplanError(
            f"stage with layers {stage.layers}: {len(stage.devices)} devices cannot form a "
            f"logical mesh {tuple(stage.logical_mesh)}"
        )
    return device_mesh(device_type, ranks.view(shape))


class _FlattenAdvice(logging.Filter):
    """Drops DTensor's advice to flatten mesh dimensions ("While redistributing from (Partial(avg),
    Partial(avg)) to (Replicate(), Replicate()), 2 sequential all_reduce operations will be
    performed ... flatten mesh dimensions"), which every rank logs at the first such
    redistribution of a multi-dimensional mesh: a data-parallel loss over dp x tp is one. A
    plan's meshes are the planner's, priced with one collective per mesh axis
    (`cost_models.resharding`), so a user of meshplan has nothing to act on there; DTensor's
    other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


def _quiet_flatten_advice() -> None:
    """Install `_FlattenAdvice` on DTensor's redistribution logger, once per process."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _FlattenAdvice) for f in logger.filters):
        logger.addFilter(_FlattenAdvice())
