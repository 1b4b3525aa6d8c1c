"""runtime.torch_pipeline: equal-submesh plans run on torch.distributed.pipelining and train to the
same numbers as one device.

One gloo launch of 4 ranks (ranks outside a plan idle) trains, each for 3 SGD steps on the
default (``"auto"``) runner choice:

* GPT (4 layers, hidden 64), global batch 8: ``pp2`` (2 stages of 1 device, 1F1B), ``pp2_tp2``
  (Megatron tensor parallel inside each stage, 1F1B), ``pp2_dp2_gpipe`` / ``pp2_dp2_1f1b`` (data
  parallel inside each stage), ``pp2_v2`` (interleaved 1F1B, 2 chunks per device, 4
  micro-batches), ``pp2_tp2_v2`` (interleaved, tensor parallel chunks, 2 micro-batches), ``pp4``
  (1F1B with warm-up);
* MoE (2 layers, 4 experts): ``moe_pp2``, ``moe_pp2_dp2_recompute`` (every layer under activation
  checkpointing), ``moe_pp2_dp2_zero`` (ZeRO on every parameter the plan replicates on the
  data-parallel axis), ``moe_pp4`` (values read 2 and 3 stages after their producer are relayed
  by the stages between);
* ``uneven``: stage 0 on 1 device, stage 1 tensor parallel on 2: the auto choice stays on our
  runner, and forcing torch pipelining raises;
* ``pp2_tp2`` again with ``MESHPLAN_PIPELINE=ours`` set: our runner.

For each: the runner is `TorchPipelineRunner` (torch's ``PipelineStage`` objects and schedule
class exist on the rank and its ``pp`` process group spans one rank per stage), and the losses and
the parameters after 3 steps equal single-device training within 1e-5 (relative). The boundary
value of ``pp2_dp2_1f1b`` (planned ``S(0)`` on the data-parallel axis) and of ``pp2_tp2`` (planned
replicated, sent in pieces ``S(2)`` over the tensor-parallel axis) arrives as half of the value:
the local shard a rank sends is a slice of it, not all of it. ``pp2_tp2`` and
``moe_pp2_dp2_zero`` run compiled (AOTAutograd), the others eagerly (the same arithmetic;
AOTAutograd's tracing was most of this launch's time).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import single_device
import torch

from cost_models.errors import MeshplanError
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.stages import split_stages
from runtime.torch_pipeline import (
    make_runner,
    receive_buffer_bytes,
    receive_buffers_exceed_budget,
    torch_pipelining_unsupported,
)
from runtime.train import _random_batches

GPT = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
MOE = "moe:hidden=32,layers=2,experts=4,heads=4,seq=8,vocab=64,group_size=8"
LR = 0.1
STEPS = 3
KW = {"global_batch": 8, "dtype": "float32", "allow_oom": True}
#: the plans trained compiled; the others run eagerly
COMPILED = ("pp2_tp2", "moe_pp2_dp2_zero")

# name -> expected torch schedule class
SCHEDULES = {
    "pp2": "Schedule1F1B",
    "pp2_tp2": "Schedule1F1B",
    "pp2_dp2_gpipe": "ScheduleGPipe",
    "pp2_dp2_1f1b": "Schedule1F1B",
    "pp2_v2": "ScheduleInterleaved1F1B",
    "pp2_tp2_v2": "ScheduleInterleaved1F1B",
    "pp4": "Schedule1F1B",
    "moe_pp2": "Schedule1F1B",
    "moe_pp2_dp2_recompute": "Schedule1F1B",
    "moe_pp2_dp2_zero": "Schedule1F1B",
    "moe_pp4": "Schedule1F1B",
}
# boundary value -> (its planned placement in the receiving stage, the dimension its received
# local shard halves)
HALVED = {
    "pp2_dp2_1f1b": {"add_4": (("S(0)", "R"), 0)},
    "pp2_tp2": {"add_4": (("R", "R"), 2)},
}


@functools.cache
def _plans() -> dict[str, tuple[ParallelPlan, str | None]]:
    """name -> (plan, schedule override)."""
    one = "1x4xA100-80GB"

    def gpt(**kw: Any) -> ParallelPlan:
        return manual_plan(GPT, kw.pop("cluster", one), **kw, **KW)

    pp2 = gpt(cluster="1x2xA100-80GB", dp=1, tp=1, pp=2, num_microbatches=2)
    tp2 = gpt(dp=1, tp=2, pp=2, num_microbatches=2)
    dp2 = gpt(dp=2, tp=1, pp=2, num_microbatches=2)
    v2 = gpt(
        cluster="1x2xA100-80GB",
        dp=1,
        tp=1,
        pp=2,
        num_microbatches=4,
        virtual_stages=2,
    )
    tp2_v2 = gpt(dp=1, tp=2, pp=2, num_microbatches=2, virtual_stages=2)
    pp4 = gpt(dp=1, tp=1, pp=4, num_microbatches=4)
    moe2 = manual_plan(MOE, "1x2xA100-80GB", dp=1, tp=1, pp=2, num_microbatches=2, **KW)
    rec = manual_plan(
        MOE, one, dp=2, tp=1, pp=2, num_microbatches=2, recompute=True, **KW
    )
    zero = manual_plan(MOE, one, dp=2, tp=1, pp=2, num_microbatches=2, **KW)
    for st in zero.stages:
        st.zero_params = sorted(
            k for k, p in st.param_placements.items() if p[0] == "R"
        )
    moe4 = manual_plan(MOE, one, dp=1, tp=1, pp=4, num_microbatches=4, **KW)
    uneven = copy.deepcopy(tp2)
    uneven.stages[0] = copy.deepcopy(pp2.stages[0])
    uneven.stages[1].devices = [1, 2]
    return {
        "pp2": (pp2, None),
        "pp2_tp2": (tp2, None),
        "pp2_dp2_gpipe": (dp2, "gpipe"),
        "pp2_dp2_1f1b": (dp2, "1f1b"),
        "pp2_v2": (v2, None),
        "pp2_tp2_v2": (tp2_v2, None),
        "pp4": (pp4, None),
        "moe_pp2": (moe2, None),
        "moe_pp2_dp2_recompute": (rec, None),
        "moe_pp2_dp2_zero": (zero, None),
        "moe_pp4": (moe4, None),
        "uneven": (uneven, None),
    }


def _model_and_batches(spec: str) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model, b = build_model(spec, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


@functools.cache
def _reference(spec: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches(spec)
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )


def _train_all(plans: dict[str, tuple[ParallelPlan, str | None]]) -> dict[str, Any]:
    """Body of every rank: train each plan for 3 steps; losses, parameters, what ran it."""
    import logging
    import os

    import torch.distributed as dist

    import runtime.torch_pipeline as tp
    from runtime.train import Trainer

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for name, (plan, schedule) in plans.items():
        spec = MOE if name.startswith("moe") else GPT
        model, batches = _model_and_batches(spec)
        compile = name in COMPILED
        tr = single_device.trainer(
            plan, model, batches[0], spec, lr=LR, schedule=schedule, compile=compile
        )
        runner = tr.runner
        res: dict[str, Any] = {"runner": type(runner).__name__}
        if isinstance(runner, tp.TorchPipelineRunner):
            res["boundary"] = dict(runner.boundary)
            if runner.pp_group is not None:
                res["schedule"] = type(runner.pipeline_schedule).__name__
                res["stages"] = [s.stage_index for s in runner.pipeline_stages]
                res["pp_ranks"] = dist.get_process_group_ranks(runner.pp_group)
                res["recv_shapes"] = [
                    tuple(t.shape)
                    for s in runner.pipeline_stages
                    for t in s.submod.example_inputs()
                ]
        res["losses"] = [tr.step(b) for b in batches]
        res["params"] = {k: v.numpy().copy() for k, v in tr.full_params().items()}
        res["mismatches"] = [
            m for ex in runner.executors.values() for m in ex.mismatches
        ]
        res["placements"] = {k: str(p.placements) for k, p in tr.params.items()}
        out[name] = res
    model, batches = _model_and_batches(GPT)
    os.environ[tp.PIPELINE_ENV] = "ours"
    try:
        tr = Trainer(plans["pp2_tp2"][0], model, batches[0], lr=LR, compile=False)
    finally:
        del os.environ[tp.PIPELINE_ENV]
    out["env_ours"] = {
        "runner": type(tr.runner).__name__,
        "losses": [tr.step(b) for b in batches],
    }
    try:
        Trainer(plans["uneven"][0], model, batches[0], pipeline="torch")
        out["forced_uneven"] = "no error"
    except MeshplanError as exc:
        out["forced_uneven"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_train_all, 4, args=(_plans(),), timeout_s=600)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.slow
def test_torch_pipelining_matches_one_device(
    runs: list[dict[str, Any]], name: str
) -> None:
    plan, _ = _plans()[name]
    ref_losses, ref_params = _reference(MOE if name.startswith("moe") else GPT)
    p = len(plan.stages) // plan.virtual_stages
    got: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(runs):
        res = r[name]
        assert res["runner"] == "TorchPipelineRunner"
        group = next((g for g in range(p) if rank in plan.stages[g].devices), None)
        if group is not None:  # torch's schedule and stages really ran this rank
            assert res["schedule"] == SCHEDULES[name]
            assert res["stages"] == list(range(group, len(plan.stages), p))
            pos = plan.stages[group].devices.index(rank)
            assert res["pp_ranks"] == [plan.stages[g].devices[pos] for g in range(p)]
        for v, (strs, d) in HALVED.get(name, {}).items():
            assert tuple(plan.stages[1].input_placements[v]) == strs
            assert res["boundary"][v] == strs
            if rank in plan.stages[1].devices:  # the receiver gets half of the value
                want = [plan.global_batch // plan.num_microbatches, 16, 64]
                want[d] //= 2
                assert res["recv_shapes"] == [tuple(want)]
        assert res["mismatches"] == []
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got.update({k: torch.from_numpy(v) for k, v in res["params"].items()})
    single_device.assert_same_parameters(got, ref_params)


@pytest.mark.slow
def test_zero_parameters_are_sharded(runs: list[dict[str, Any]]) -> None:
    zero = runs[0]["moe_pp2_dp2_zero"]["placements"]
    plain = runs[0]["moe_pp2_dp2_recompute"]["placements"]
    assert sum("Shard" in p for p in zero.values()) > sum(
        "Shard" in p for p in plain.values()
    )


@pytest.mark.slow
def test_unequal_submeshes_stay_on_our_runner(runs: list[dict[str, Any]]) -> None:
    plan, _ = _plans()["uneven"]
    ref_losses, ref_params = _reference(GPT)
    assert torch_pipelining_unsupported(plan) is not None
    got: dict[str, torch.Tensor] = {}
    for r in runs:
        assert r["uneven"]["runner"] == "PipelineRunner"
        assert r["uneven"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        got.update({k: torch.from_numpy(v) for k, v in r["uneven"]["params"].items()})
        assert "logical meshes differ" in r["forced_uneven"]
    single_device.assert_same_parameters(got, ref_params)


@pytest.mark.slow  # ~3 s: builds the plans (cached for the launch when it runs too)
def test_unsupported_reasons() -> None:
    plans = _plans()
    assert torch_pipelining_unsupported(plans["pp2_tp2"][0]) is None
    assert torch_pipelining_unsupported(plans["pp2_v2"][0]) is None
    swapped = copy.deepcopy(plans["pp2_tp2"][0])
    swapped.stages[0].devices, swapped.stages[1].devices = [2, 3], [0, 1]
    assert "increasing" in torch_pipelining_unsupported(swapped)
    single = manual_plan(
        GPT, "1x2xA100-80GB", dp=1, tp=2, pp=1, num_microbatches=1, **KW
    )
    assert "one stage" in torch_pipelining_unsupported(single)
    # torch's Schedule1F1B refuses fewer micro-batches than stages; GPipe takes them
    one = copy.deepcopy(plans["pp2_tp2"][0])
    one.num_microbatches = 1
    assert "micro-batches" in torch_pipelining_unsupported(one)
    assert torch_pipelining_unsupported(one, "gpipe") is None


@pytest.mark.slow
def test_environment_forces_our_runner(runs: list[dict[str, Any]]) -> None:
    ref_losses, _ = _reference(GPT)
    for r in runs:
        assert r["env_ours"]["runner"] == "PipelineRunner"
        assert r["env_ours"]["losses"] == pytest.approx(ref_losses, rel=1e-5)


def test_bad_implementation_name() -> None:
    with pytest.raises(MeshplanError, match="pipeline implementation"):
        make_runner(_plans()["pp2"][0], None, impl="gpipe")  # type: ignore[arg-type]


def test_torch_receive_buffers_count_every_microbatch() -> None:
    """torch's ``PipelineStage`` keeps a receive buffer per micro-batch: the hidden state (2 rows
    x 16 x 64 float32, 8 KiB) comes into stage 1 and its gradient back into stage 0 once per
    micro-batch, a half on each rank of a tensor-parallel pair: 4 x 4 KiB per device. The auto
    choice leaves torch's pipelining for our runner (which holds the micro-batches in flight) when
    they do not fit beside the plan's predicted peak. Measured on 2 gloo ranks (a Llama of hidden
    256, 1 MiB boundaries, 1F1B): torch's runner's peak grew by 4-5 MiB from 4 to 8 micro-batches,
    ours by none."""
    plan = manual_plan(GPT, "1x4xA100-80GB", dp=1, tp=2, pp=2, num_microbatches=4, **KW)
    model, b = build_model(GPT, batch=2, device="cpu")
    graph = trace(model, tuple(b))
    assert (
        receive_buffer_bytes(plan, graph, split_stages(graph, plan)) == [4 * 4096] * 2
    )
    assert receive_buffers_exceed_budget(plan, graph) is None  # 80 GiB
    peak = max(s.memory_bytes for s in plan.stages)
    plan.memory_budget_bytes = peak + 4 * 4096
    assert receive_buffers_exceed_budget(plan, graph) is None
    plan.memory_budget_bytes = peak + 4 * 4096 - 1
    assert "receive buffers for all 4 micro-batches" in receive_buffers_exceed_budget(
        plan, graph
    )
