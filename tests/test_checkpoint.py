"""runtime.checkpoint: a checkpoint saved under one plan loads, bitwise, under another (DCP resharding).

One gloo launch of 2 ranks runs every distributed check on a small GPT (seeded real weights):

* tp=2 -> pp=2, dp=2 -> tp=2 and pp=2 -> tp=2: parameters placed per the saving plan take one Adam
  step (so exp_avg / exp_avg_sq are DTensors placed like their parameters, step a scalar), are saved
  with their optimizer state and step, and are loaded under the other plan. Every rank holds exactly
  its stage's parameters, in the loading plan's placements; every parameter and optimizer-state
  tensor, gathered (``full_tensor``), is identical to what was saved; the state goes back into a
  fresh Adam (`load_optimizer_state`) over the loaded parameters.
* a checkpoint of another model (different fingerprint), a missing directory, garbage metadata and a
  truncated data file each give a one-line MeshplanError on every rank.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cost_models.errors import MeshplanError
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128"
OTHER = "gpt:hidden=64,layers=1,heads=4,seq=16,vocab=128"
CLUSTER = "1x2xA100-80GB"
CASES = [("tp2", "pp2"), ("dp2", "tp2"), ("pp2", "tp2")]


def _plan(spec: str, dp: int, tp: int, pp: int) -> ParallelPlan:
    return manual_plan(
        spec, CLUSTER, dp=dp, tp=tp, pp=pp, num_microbatches=2, global_batch=4
    )


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    return {
        "tp2": _plan(SPEC, 1, 2, 1),
        "pp2": _plan(SPEC, 1, 1, 2),
        "dp2": _plan(SPEC, 2, 1, 1),
        "other": _plan(OTHER, 1, 2, 1),
    }


def _full(t: Any) -> Any:
    """The full value as a numpy array (tensors sent back from a rank would go through shared
    memory, which the rank's exit takes with it; numpy arrays go by value)."""
    if isinstance(t, torch.distributed.tensor.DTensor):
        t = t.full_tensor()
    return t.detach().numpy().copy() if isinstance(t, torch.Tensor) else t


def _error(fn: Any) -> str:
    """The message of the MeshplanError `fn()` raises ("" if none)."""
    try:
        fn()
    except MeshplanError as exc:
        return str(exc)
    return ""


def _worker(
    plans: dict[str, ParallelPlan],
    ref: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    root: str,
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from runtime.checkpoint import (
        load_checkpoint,
        load_optimizer_state,
        optimizer_state,
        own_stage_mesh,
        save_checkpoint,
        stage_placements,
    )

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for src, dst in CASES:
        path = Path(root) / f"{src}-{dst}"
        # save under `src`, after one Adam step
        plan = plans[src]
        own, mesh = own_stage_mesh(plan)
        stage = plan.stages[own]
        params = {
            p: distribute_tensor(
                ref[p], mesh, stage_placements(stage, s), src_data_rank=None
            ).requires_grad_(True)
            for p, s in stage.param_placements.items()
        }
        for p, t in params.items():
            t.grad = distribute_tensor(grads[p], mesh, t.placements, src_data_rank=None)
        opt = torch.optim.Adam(params.values(), lr=1e-2)
        opt.step()
        state = optimizer_state(opt, params)
        save_checkpoint(path, plan, params, state, step=7)
        written = sum(f.stat().st_size for f in path.glob("*.distcp"))
        saved = {p: _full(t) for p, t in params.items()}
        saved |= {f"{p}/{k}": _full(v) for p, s in state.items() for k, v in s.items()}
        # load under `dst`
        plan = plans[dst]
        stage = plan.stages[[rank in s.devices for s in plan.stages].index(True)]
        like = {p: torch.empty(t.shape, device="meta") for p, t in ref.items()}
        mesh = own_stage_mesh(plan)[1] if src == "pp2" else None  # a mesh built already
        lp, ls, step = load_checkpoint(path, plan, like, mesh=mesh)
        placed = {
            p: tuple(t.placements) == stage_placements(stage, stage.param_placements[p])
            and tuple(t.device_mesh.mesh.flatten().tolist()) == tuple(stage.devices)
            for p, t in lp.items()
        }
        opt2 = torch.optim.Adam(lp.values(), lr=1e-2)
        load_optimizer_state(opt2, lp, ls)
        restored = optimizer_state(opt2, lp)
        loaded = {p: _full(t) for p, t in lp.items()}
        loaded |= {
            f"{p}/{k}": _full(v) for p, s in restored.items() for k, v in s.items()
        }
        exp_avg_placed = all(
            ls[p]["exp_avg"].placements == t.placements for p, t in lp.items()
        )
        out[src, dst] = {
            "saved": saved,
            "loaded": loaded,
            "step": step,
            "written": written,
            "keys": sorted(lp),
            "stage_keys": sorted(stage.param_placements),
            "placed": all(placed.values()),
            "exp_avg_placed": exp_avg_placed,
        }
    # refusals
    good = Path(root) / "tp2-pp2"
    bad_md, bad_data = Path(root) / "bad-md", Path(root) / "bad-data"
    if rank == 0:
        shutil.copytree(good, bad_md)
        (bad_md / ".metadata").write_bytes(b"not a pickle")
        shutil.copytree(good, bad_data)
        for f in bad_data.glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:16])
    dist.barrier()
    out["errors"] = {
        "other": _error(lambda: load_checkpoint(good, plans["other"])),
        "missing": _error(lambda: load_checkpoint(Path(root) / "nope", plans["pp2"])),
        "bad-md": _error(lambda: load_checkpoint(bad_md, plans["pp2"])),
        "bad-data": _error(lambda: load_checkpoint(bad_data, plans["pp2"])),
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, _ = build_model(SPEC, batch=4, device="cpu")
    ref = {p: t.detach().clone() for p, t in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    grads = {p: torch.randn(t.shape, generator=gen) for p, t in ref.items()}
    root = tmp_path_factory.mktemp("ckpt")
    return launch(_worker, 2, args=(_plans(), ref, grads, str(root)), timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=[f"{a}->{b}" for a, b in CASES])
@pytest.mark.slow
def test_reshard_roundtrip(
    results: list[dict[str, Any]], case: tuple[str, str]
) -> None:
    saved: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    for r in results:
        res = r[case]
        assert res["keys"] == res["stage_keys"]  # exactly its stage's parameters
        assert res["placed"] and res["exp_avg_placed"]
        assert res["step"] == 7
        for k, v in res["saved"].items():
            if k in saved:  # replicas on both ranks agree
                assert v.dtype == saved[k].dtype and np.array_equal(saved[k], v), k
            saved[k] = v
        loaded |= res["loaded"]
    # every shard written once: the data files hold the parameters and the two Adam moments
    # (3 x 4 bytes per element) plus DCP's per-item overhead, not a copy per replica
    numel = sum(v.size for k, v in saved.items() if "/" not in k)
    assert 12 * numel <= results[0][case]["written"] < 1.3 * 12 * numel
    n_params = len(_plans()["tp2"].stages[0].param_placements)
    assert len(saved) == n_params * 4  # param, exp_avg, exp_avg_sq, step
    assert set(loaded) == set(saved)
    for k, v in saved.items():
        assert v.dtype == loaded[k].dtype and np.array_equal(v, loaded[k]), k
        if k.endswith("/exp_avg"):
            assert np.abs(v).sum() > 0


@pytest.mark.slow
def test_refusals(results: list[dict[str, Any]]) -> None:
    for r in results:
        err = r["errors"]
        for name, msg in err.items():
            assert msg and "\n" not in msg, (name, msg)
        assert (
            "fingerprint" in err["other"] and "not of the plan's model" in err["other"]
        )
        assert "is not a checkpoint" in err["missing"]
        assert err["bad-md"].startswith("corrupt checkpoint")
        assert err["bad-data"].startswith("corrupt checkpoint")


def test_missing_directory_without_process_group(tmp_path: Path) -> None:
    from runtime.checkpoint import load_checkpoint

    with pytest.raises(MeshplanError, match="is not a checkpoint"):
        load_checkpoint(tmp_path / "nothing", _plans()["tp2"])
