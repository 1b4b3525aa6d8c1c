"""The runtime on a GPU (NCCL, one rank): training as the plan says matches single-device training.

Plans are traced on CPU or meta tensors, where attention is the CPU flash kernel; on CUDA the
runtime runs the CUDA kernels instead (`runtime.device_ops`). One NCCL launch of one rank trains a
small GPT three SGD steps under a one-device plan, compiled and eager, in float32 (the
memory-efficient attention kernel) and bfloat16 (the flash kernel), and the same model eagerly
on the same GPU. Skipped without CUDA (CI has no GPU); the CPU side of `device_targets` is tested
everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import single_device
import torch
from test_executor import _plain

from cost_models.errors import MeshplanError
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from runtime.device_ops import CPU_SDPA, device_targets
from runtime.launch import LaunchError, launch
from runtime.train import Trainer, _random_batches

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128"
STEPS = 3
LR = 0.1
# relative loss / parameter error against eager training on the same GPU
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def _train_both(dtype_name: str) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    plan = manual_plan(
        SPEC,
        "1x1xA100-80GB",
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=4,
        dtype=dtype_name,
    )
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=4, device="cpu", dtype=dtype)
    model = model.to(dev)
    batches = [
        tuple(t.to(dev) for t in x) for x in _random_batches(tuple(b), STEPS, seed=1)
    ]
    out: dict[str, Any] = {}
    for name, compile_ in (("compiled", True), ("eager", False)):
        tr = Trainer(
            plan, model, batches[0], lr=LR, device_type="cuda", compile=compile_
        )
        out[name] = {
            "losses": [float(tr.step(x)) for x in batches],
            "params": {k: _plain(v) for k, v in tr.full_params().items()},
            "ran_compiled": [e.last_run_compiled for e in tr.runner.executors.values()],
        }
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, params = single_device.train(model, batches, opt)
    out["reference"] = {
        "losses": losses,
        "params": {k: _plain(p) for k, p in params.items()},
    }
    return out


def _body() -> dict[str, Any]:
    return {d: _train_both(d) for d in TOLERANCE}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return launch(_body, 1, backend="nccl", timeout_s=600)[0]
    except LaunchError as exc:  # the rank's traceback, for whoever debugs this on a GPU
        pytest.fail(f"{exc}\n" + "\n".join(exc.tracebacks.values()))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("kind", ["compiled", "eager"])
@pytest.mark.slow
def test_cuda_training_matches_one_gpu(runs: dict, dtype: str, kind: str) -> None:
    got, ref, rel = runs[dtype][kind], runs[dtype]["reference"], TOLERANCE[dtype]
    assert got["ran_compiled"] == [kind == "compiled"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=rel)
    for k, p in ref["params"].items():
        err = np.linalg.norm(got["params"][k] - p) / max(np.linalg.norm(p), 1e-12)
        assert err < rel, (k, err)


def test_device_targets_replace_cpu_kernels_only_off_cpu() -> None:
    model, b = build_model(SPEC, batch=4, device="meta")
    gm = trace(model, b).gm
    assert any(n.target is CPU_SDPA for n in gm.graph.nodes)
    assert device_targets(gm, "cpu") == {}
    with pytest.raises(MeshplanError, match="'mps'.*'cpu' \\(gloo\\) and 'cuda'"):
        device_targets(gm, "mps")
