"""Checkpoints that any plan can load (principle 6: ``torch.distributed.checkpoint``).

    save_checkpoint(path, plan, params, optimizer_state, step)       # every rank, collectively
    params, optimizer_state, step = load_checkpoint(path, new_plan)  # every rank, any other plan

Saving: every rank hands DCP the parameters of its own stage as DTensors (or plain full tensors),
and DCP writes each distinct shard once (replicas are deduplicated), with the global shape and offset
of every chunk. Loading: every rank builds empty DTensors with the TARGET plan's placements on its
stage's mesh (`torch.distributed.tensor.empty`, only the local shard is allocated) for the
parameters of its own stage and lets DCP read into them: DCP finds the saved chunks that overlap each
local shard (resharding), so a checkpoint saved under tp=2 loads under pp=2, dp=2 under tp=2, etc.
A parameter that the rank's stage does not hold is not in its state dict and is not read.

Tied parameters (``plan.tied_params``): their copies are equal, so only the device group of the
first stage holding one writes it (and its optimizer state: the copies took the same steps),
under its one path; every stage holding a copy reads it on load.

Stage membership: a rank belongs to the stage whose ``devices`` contains it; the stage's mesh is its
``devices`` laid out as its ``logical_mesh`` without the axes of size 1 (as `runtime.executor`
squeezes them), and a parameter's placements are its ``param_placements`` strings on those axes.

Layout inside the DCP checkpoint (flat keys; parameter paths contain dots, so no nesting):

* ``model/<path>``: the parameter;
* ``optim/<path>/<name>``: per-parameter optimizer state (``exp_avg``, ``momentum_buffer``, ``step``,
  ...). On load a tensor of the parameter's shape gets the parameter's target placements, any other
  tensor (a scalar ``step``) is loaded whole, and non-tensors come back as they were saved;
* ``meshplan``: a JSON string with the model's fingerprint and name, the step and the saving plan
  (for inspection). Loading reads it first and refuses a checkpoint of another model.

Optimizer hyperparameters (lr, betas) are not saved: they come from the training configuration.
`optimizer_state` / `load_optimizer_state` convert between a ``torch.optim.Optimizer`` over the
stage's DTensors and the path-keyed state used here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor.placement_types import Placement

from cost_models.errors import MeshplanError
from planner.vocab.dtensor_ext import str_to_placement
from planner.vocab.placements import mesh_axes, norm, zero_shard
from planner.vocab.plan_file import ParallelPlan, StagePlan
from runtime.meshes import device_mesh

__all__ = [
    "load_checkpoint",
    "load_optimizer_state",
    "optimizer_state",
    "own_stage_mesh",
    "save_checkpoint",
    "stage_of",
    "stage_placements",
]

_INFO = "meshplan"
_CHECKPOINT_VERSION = 1


# ---------------------------------------------------------------------------------- stages


def stage_of(plan: ParallelPlan, rank: int | None = None) -> int:
    """Index of the stage whose ``devices`` contain `rank` (default: this process's rank)."""
    rank = dist.get_rank() if rank is None else rank
    for i, stage in enumerate(plan.stages):
        if rank in stage.devices:
            return i
    raise MeshplanError(
        f"rank {rank} is in no stage of the plan (its stages use devices "
        f"{sorted(d for s in plan.stages for d in s.devices)})"
    )


def _squeezed(stage: StagePlan) -> list[int]:
    """The logical-mesh axes the stage's DeviceMesh has."""
    return mesh_axes(tuple(stage.logical_mesh))


def own_stage_mesh(
    plan: ParallelPlan, device_type: str = "cpu"
) -> tuple[int, DeviceMesh]:
    """This rank's stage index and the DeviceMesh of that stage (the meshes are those of
    `runtime.meshes.stage_mesh`; pass a runner's mesh to `load_checkpoint` to reuse it).

    Collective: every rank of the default group must call it (DeviceMesh creates its process groups
    with ``new_group``), so the meshes of all stages are built here, in plan order, on every rank.
    """
    own = stage_of(plan)
    mine: DeviceMesh | None = None
    for i, stage in enumerate(plan.stages):
        shape = [stage.logical_mesh[a] for a in _squeezed(stage)] or [1]
        if len(stage.devices) != int(torch.tensor(shape).prod()):
            raise MeshplanError(
                f"stage {i}: {len(stage.devices)} devices cannot form the logical mesh "
                f"{tuple(stage.logical_mesh)}"
            )
        ranks = torch.tensor(stage.devices, dtype=torch.int64).reshape(shape)
        mesh = device_mesh(device_type, ranks)
        if i == own:
            mine = mesh
    assert mine is not None
    return own, mine


def stage_placements(stage: StagePlan, strs: list[str]) -> tuple[Placement, ...]:
    """Plan strings (one per logical-mesh axis) -> placements on the stage's squeezed mesh."""
    axes = _squeezed(stage)
    if not axes:
        return (Replicate(),)
    return tuple(str_to_placement(strs[a]) for a in axes)


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(
    path: str | Path,
    plan: ParallelPlan,
    params: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Mapping[str, Any]] | None,
    step: int,
) -> None:
    """Write this rank's shards of its stage's parameters and optimizer state to directory `path`.

    Collective over the default group. `params` maps the paths of this rank's stage (exactly
    the keys of its ``param_placements``) to DTensors on the stage mesh, or to full tensors (the
    same on every rank of the stage). `optimizer_state` maps parameter paths to their per-parameter
    state (`optimizer_state` builds it from a ``torch.optim.Optimizer``).
    """
    own, groups = stage_of(plan), len(plan.stages) // plan.virtual_stages
    stage = plan.stages[own]
    want = set(stage.param_placements)
    if set(params) != want:
        missing, extra = sorted(want - set(params)), sorted(set(params) - want)
        raise MeshplanError(
            f"rank {dist.get_rank()} must save the parameters of its stage: "
            f"missing {missing[:5]}, not in its stage {extra[:5]}"
        )
    # a tied parameter's copies are equal: the first holding stage's group writes it
    skip = {p for p, st in plan.tied_params.items() if st[0] % groups != own % groups}
    sd: dict[str, Any] = {
        f"model/{k}": v.detach() for k, v in params.items() if k not in skip
    }
    for p, state in (optimizer_state or {}).items():
        if p not in want:
            raise MeshplanError(
                f"optimizer state for {p!r}, not a parameter of this stage"
            )
        if p in skip:
            continue
        for name, value in state.items():
            if "/" in name:
                raise MeshplanError(f"optimizer state name {name!r} contains '/'")
            sd[f"optim/{p}/{name}"] = (
                value.detach() if isinstance(value, torch.Tensor) else value
            )
    sd[_INFO] = json.dumps(
        {
            "version": _CHECKPOINT_VERSION,
            "fingerprint": plan.model.get("fingerprint"),
            "model": plan.model.get("name"),
            "step": int(step),
            "plan": plan.to_json(),
        }
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(path))


# ---------------------------------------------------------------------------------- loading


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:240] + "...") if len(text) > 240 else text or type(exc).__name__


def _read_metadata(path: Path) -> Metadata:
    if not (path / ".metadata").is_file():
        raise MeshplanError(
            f"{path} is not a checkpoint (no {path / '.metadata'}); "
            "give the directory that save_checkpoint wrote"
        )
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
        raise MeshplanError(
            f"corrupt checkpoint {path}: cannot read its metadata "
            f"({type(exc).__name__}: {_one_line(exc)})"
        ) from None


def _dcp_load(sd: dict[str, Any], path: Path) -> None:
    """``dcp.load``; a failure on any rank (DCP gathers them: every rank raises) -> one line."""
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        if isinstance(exc, CheckpointException) and exc.failures:
            rank, (exc, _) = min(exc.failures.items())
            where = f" (rank {rank})"
        else:
            where = ""
        raise MeshplanError(
            f"corrupt checkpoint {path}: cannot read it{where}: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from None


def _check_info(path: Path, md: Metadata, plan: ParallelPlan) -> dict[str, Any]:
    """The checkpoint's meshplan record; refuses a checkpoint of another model."""
    if not isinstance(md.state_dict_metadata.get(_INFO), BytesStorageMetadata):
        raise MeshplanError(
            f"{path} is not a meshplan checkpoint (no {_INFO!r} record)"
        )
    sd: dict[str, Any] = {_INFO: ""}
    _dcp_load(sd, path)
    try:
        info = json.loads(sd[_INFO])
        fingerprint = info["fingerprint"]
    except (TypeError, ValueError, KeyError):
        raise MeshplanError(
            f"corrupt checkpoint {path}: unreadable meshplan record"
        ) from None
    want = plan.model.get("fingerprint")
    if fingerprint != want:
        raise MeshplanError(
            f"checkpoint {path} is of model {info.get('model')!r} (fingerprint {fingerprint}), "
            f"not of the plan's model {plan.model.get('name')!r} (fingerprint {want})"
        )
    return info


def load_checkpoint(
    path: str | Path,
    plan: ParallelPlan,
    like: Mapping[str, torch.Tensor] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    device_type: str = "cpu",
) -> tuple[dict[str, DTensor], dict[str, dict[str, Any]], int]:
    """Load this rank's stage of `plan` from a checkpoint saved under any plan of the same model.

    Collective over the default group. Returns (parameters of this rank's stage as DTensors with
    the plan's placements on the stage mesh (an FSDP parameter's: its shard,
    `planner.vocab.placements.zero_shard`), their optimizer state as saved (param-shaped tensors
    as DTensors placed like the parameter), step). `like` (optional: parameter path -> tensor,
    meta tensors will do) gives the dtype to load into and checks the shapes; by default the saved
    shapes and dtypes are used. `mesh`: this rank's stage mesh when the caller has built it
    already (default: `own_stage_mesh` builds the meshes of all stages, collectively). Raises a
    one-line MeshplanError for a missing or corrupt checkpoint or one of another model.
    """
    path = Path(path)
    md = _read_metadata(path)
    info = _check_info(path, md, plan)
    if mesh is None:
        own, mesh = own_stage_mesh(plan, device_type)
    else:
        own = stage_of(plan)
    stage = plan.stages[own]
    items = md.state_dict_metadata
    sd: dict[str, Any] = {}
    shapes: dict[str, torch.Size] = {}
    for p, strs in stage.param_placements.items():
        meta = items.get(f"model/{p}")
        if not isinstance(meta, TensorStorageMetadata):
            raise MeshplanError(f"checkpoint {path} has no parameter {p!r}")
        dtype = meta.properties.dtype
        if like is not None and p in like:
            if tuple(like[p].shape) != tuple(meta.size):
                raise MeshplanError(
                    f"checkpoint {path}: {p} has shape {tuple(meta.size)}, "
                    f"the model's is {tuple(like[p].shape)}"
                )
            dtype = like[p].dtype
        shapes[p] = meta.size
        if p in stage.fsdp_params:  # held as its shard, as the runtime keeps it
            strs = list(
                zero_shard(
                    tuple(meta.size),
                    tuple(norm(x) for x in strs),
                    tuple(stage.logical_mesh),
                    stage.shard_axes(p),
                )
            )
        sd[f"model/{p}"] = dtensor_empty(
            meta.size,
            dtype=dtype,
            device_mesh=mesh,
            placements=stage_placements(stage, strs),
        )
    for key, meta in items.items():
        if not key.startswith("optim/"):
            continue
        p, _name = key[len("optim/") :].rsplit("/", 1)
        if p not in shapes:
            continue
        if isinstance(meta, BytesStorageMetadata):
            sd[key] = ""
        elif meta.size == shapes[p]:
            sd[key] = dtensor_empty(
                meta.size,
                dtype=meta.properties.dtype,
                device_mesh=mesh,
                placements=sd[f"model/{p}"].placements,
            )
        else:
            sd[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    _dcp_load(sd, path)
    params = {p: sd[f"model/{p}"] for p in stage.param_placements}
    state: dict[str, dict[str, Any]] = {}
    for key, value in sd.items():
        if key.startswith("optim/"):
            p, name = key[len("optim/") :].rsplit("/", 1)
            state.setdefault(p, {})[name] = value
    return params, state, int(info["step"])


# ---------------------------------------------------------------------------------- optimizers


def optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """The per-parameter state of `optimizer` keyed by parameter path (`params` names them)."""
    out: dict[str, dict[str, Any]] = {}
    for p, t in params.items():
        if optimizer.state.get(t):
            out[p] = dict(optimizer.state[t])
    return out


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    state: Mapping[str, Mapping[str, Any]],
) -> None:
    """Put path-keyed `state` (from `load_checkpoint`) into `optimizer`, whose parameters are the
    tensors of `params`; keeps the optimizer's hyperparameters (``load_state_dict``)."""
    index = {
        id(t): i
        for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])
    }
    sd = optimizer.state_dict()
    sd["state"] = {}
    for p, s in state.items():
        if p not in params or id(params[p]) not in index:
            raise MeshplanError(
                f"optimizer state for {p!r}, a parameter the optimizer lacks"
            )
        sd["state"][index[id(params[p])]] = dict(s)
    optimizer.load_state_dict(sd)
