"""runtime.compiled: stages traced once by AOTAutograd compute and communicate as the eager executor.

One gloo launch of 4 ranks runs:

* `PlanExecutor` with ``compile=True`` on the plans of ``tests/test_executor.py`` (``megatron`` on
  (1, 4) and ``mixed_2x2``: data x tensor parallel on (2, 2)): the first forward + backward traces
  and compiles; a second one, on fresh parameter leaves, runs the cached graphs. Its loss and
  every parameter gradient equal single-device training within 1e-5 (relative), the executor
  reports that the compiled graphs ran (one trace, no fallback), and the collectives that
  `runtime.comm_count.CommCounter` records from the compiled graphs are the eager executor's, one
  for one: same kind, bytes and site (the sites travel into the graphs as node metadata).
* the ``data_parallel`` plan with ``sync_param_grads=False`` over two micro-batches and one
  `sync_grads`: the accumulated gradients of single-device training;
* `runtime.train.Trainer` on a pipeline x tensor plan (2 stages of 2 devices, 2 micro-batches):
  3 SGD steps compiled and eager give single-device training's losses and parameters (the
  compiled stages taking their parameters as local aliases, `runtime.local_leaves`, but for
  those whose gradient is split otherwise than the parameter); with
  activation recomputation the executors fall back to the eager interpreter (and still match); a
  second compiled trainer of the same plan in the same process compiles too (`runtime.meshes`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch
from test_executor import CASES, SPEC, _case, _plain, _quiet

from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from runtime.launch import launch
from runtime.train import _random_batches

PIPE_SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"
STEPS = 3
LR = 0.1


def _executor_runs(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Executor cases on this rank: compiled vs eager, gradients and collective records."""
    from runtime.comm_count import CommCounter
    from runtime.executor import PlanExecutor, make_mesh

    out: dict[str, Any] = {}
    for name in ("megatron", "mixed_2x2"):
        c = cases[name]
        model, b = build_model(SPEC, batch=len(c["batch"][0]), device="meta")
        graph = trace(model, b)
        mesh = make_mesh(c["program"])
        compiled = PlanExecutor(graph, c["program"], mesh, compile=True)
        compiled.run_plan(compiled.place_params(c["params"]), c["batch"]).backward()
        res: dict[str, Any] = {}
        for kind, ex in (
            ("eager", PlanExecutor(graph, c["program"], mesh)),
            ("compiled", compiled),
        ):
            params = ex.place_params(c["params"])
            with CommCounter() as counter:
                loss = ex.run_plan(params, c["batch"])
                loss.backward()
            res[kind] = {
                "loss": loss.to_local().item(),
                "grads": {k: _plain(p.grad.full_tensor()) for k, p in params.items()},
                "records": [(r.kind, r.nbytes, r.site) for r in counter.records],
                "ran_compiled": ex.last_run_compiled,
                "mismatches": ex.mismatches,
            }
        res["compiles"] = compiled._compiled.compiles
        res["error"] = compiled._compiled.error
        out[name] = res
    c = cases["data_parallel"]
    model, b = build_model(SPEC, batch=len(c["batch"][0]), device="meta")
    graph = trace(model, b)
    ex = PlanExecutor(
        graph,
        c["program"],
        make_mesh(c["program"]),
        sync_param_grads=False,
        compile=True,
    )
    params = ex.place_params(c["params"])
    for batch in (c["batch"], c["batch2"]):
        ex.run_plan(params, batch).backward()
    ex.sync_grads(params)
    out["accumulated"] = {
        "grads": {k: _plain(p.grad.full_tensor()) for k, p in params.items()},
        "ran_compiled": ex.last_run_compiled,
    }
    return out


def _trainer_runs(batches: list) -> dict[str, Any]:
    """Trainer on the pipeline x tensor plan: compiled, eager, and with recomputation."""
    from runtime.train import Trainer

    out: dict[str, Any] = {}
    for name, recompute, compile_ in (
        ("compiled", False, True),
        ("eager", False, False),
        ("recompute", True, True),
        # a second trainer on the same devices: before `runtime.meshes` it got an equal but new
        # DeviceMesh, and AOTAutograd's trace of its stage failed (it then ran eagerly)
        ("compiled_again", False, True),
    ):
        plan = manual_plan(
            PIPE_SPEC,
            "1x4xA100-80GB",
            dp=1,
            tp=2,
            pp=2,
            num_microbatches=2,
            global_batch=8,
            dtype="float32",
            allow_oom=True,
            recompute=recompute,
        )
        torch.manual_seed(0)
        model, _ = build_model(PIPE_SPEC, batch=8, device="cpu")
        tr = Trainer(plan, model, batches[0], lr=LR, compile=compile_)
        losses = [tr.step(b) for b in batches]
        out[name] = {
            "losses": losses,
            "params": {k: _plain(v) for k, v in tr.full_params().items()},
            "ran_compiled": [
                ex.last_run_compiled for ex in tr.runner.executors.values()
            ],
            # per compiled callable: (leaves passed as local aliases, left DTensors)
            "leaves": [
                (len(local.indices), local.excluded)
                for ex in tr.runner.executors.values()
                if ex._compiled is not None
                for _, local in ex._compiled._fns.values()
            ],
        }
    return out


def _body(cases: dict[str, dict[str, Any]], batches: list) -> dict[str, Any]:
    _quiet()
    return {"executor": _executor_runs(cases), "trainer": _trainer_runs(batches)}


def _pipe_model_and_batches() -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model, b = build_model(PIPE_SPEC, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


@functools.cache
def _pipe_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _pipe_model_and_batches()
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    cases = {n: {k: _case(n)[k] for k in ("program", "params", "batch")} for n in CASES}
    cases["data_parallel"]["batch2"] = _case("data_parallel")["batch2"]
    _, batches = _pipe_model_and_batches()
    return launch(_body, 4, args=(cases, batches), timeout_s=600)


def _assert_grads(got: dict[str, Any], ref: dict[str, torch.Tensor]) -> None:
    single_device.assert_same_parameters(
        {k: torch.from_numpy(v) for k, v in got.items()}, ref
    )


@pytest.mark.parametrize("name", ["megatron", "mixed_2x2"])
@pytest.mark.slow
def test_compiled_executor_matches_one_device_and_runs_compiled(
    runs: list, name: str
) -> None:
    ref = _case(name)
    for r in runs:
        res = r["executor"][name]
        assert res["error"] is None
        assert res["compiles"] == 1  # traced once, the second run used the cache
        assert res["compiled"]["ran_compiled"] and not res["eager"]["ran_compiled"]
        assert res["compiled"]["mismatches"] == []
        for kind in ("eager", "compiled"):
            assert res[kind]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    _assert_grads(runs[0]["executor"][name]["compiled"]["grads"], ref["grads"])


@pytest.mark.parametrize("name", ["megatron", "mixed_2x2"])
@pytest.mark.slow
def test_compiled_graphs_issue_the_eager_collectives_at_the_same_sites(
    runs: list, name: str
) -> None:
    for r in runs:
        eager = r["executor"][name]["eager"]["records"]
        compiled = r["executor"][name]["compiled"]["records"]
        assert eager, "the plan communicates"
        assert all(site for _, _, site in compiled)
        assert sorted(compiled) == sorted(eager)


@pytest.mark.slow
def test_compiled_gradient_accumulation(runs: list) -> None:
    acc = runs[0]["executor"]["accumulated"]
    assert acc["ran_compiled"]
    _assert_grads(acc["grads"], _case("data_parallel")["grads_accumulated"])


@pytest.mark.slow
def test_trainer_compiled_eager_and_recomputed_match_one_device(runs: list) -> None:
    ref_losses, ref_params = _pipe_reference()
    for r in runs:
        t = r["trainer"]
        assert t["compiled"]["ran_compiled"] == [True]
        assert t["compiled_again"]["ran_compiled"] == [True]
        assert t["eager"]["ran_compiled"] == [False]
        assert t["recompute"]["ran_compiled"] == [
            False
        ]  # checkpointed layers run eagerly
        for name in ("compiled", "eager", "recompute", "compiled_again"):
            assert t[name]["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        # the parameters went in as local aliases (`runtime.local_leaves`), except weights
        # whose gradient arrives split otherwise (this small model's plan gathers its
        # tensor-parallel weights before use: their gradients arrive replicated)
        assert t["compiled"]["leaves"] and all(
            n > 0 for n, _ in t["compiled"]["leaves"]
        )
        assert any(x > 0 for _, x in t["compiled"]["leaves"])
    for rank in (0, 2):  # the first device of each stage holds the stage's parameters
        for name in ("compiled", "eager", "recompute"):
            got = {
                k: torch.from_numpy(v)
                for k, v in runs[rank]["trainer"][name]["params"].items()
            }
            single_device.assert_same_parameters(got, {k: ref_params[k] for k in got})


def test_prune_drops_dead_ops_and_keeps_collectives() -> None:
    """The backward graph AOTAutograd's default partitioner hands us re-runs every attention
    forward and drops the result; `_prune` removes such dead nodes, keeps unread collectives."""
    from runtime.compiled import _prune

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    q = g.placeholder("q")
    g.call_function(
        aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True)
    )
    g.call_function(c10d.all_reduce.default, (q, "sum", "0"))
    g.output(g.call_function(aten.sin.default, (q,)))
    pruned = _prune(torch.fx.GraphModule(torch.nn.Module(), g))
    assert [str(n.target) for n in pruned.graph.nodes] == [
        "q",
        "_c10d_functional.all_reduce.default",
        "aten.sin.default",
        "output",
    ]


def test_views_survive_strides_the_fake_trace_did_not_see() -> None:
    """``softplus_backward`` makes its output in the gradient's layout on the CPU and in
    ``self``'s on fake tensors (torch 2.13): the backward graph's view of it, valid when traced,
    cannot be made at run time (Qwen3.5's gated delta rule under a compiled stage). The
    compiled stage then reshapes, and its gradients equal eager autograd's."""
    from runtime.compiled import CompiledStage

    def run(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.softplus(a.view(2, 16, 32))
        return (y.transpose(1, 2) * w).sum()

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 32, generator=gen, requires_grad=True)
    w = torch.randn(2, 32, 16, generator=gen)
    stage = CompiledStage(run)
    loss = stage([a, w])
    loss.backward()
    assert stage.error is None and stage.compiles == 1
    got, a.grad = a.grad, None
    run(a, w).backward()
    assert torch.equal(got, a.grad)


def _view_of_a_local_layout_the_dtensor_does_not_claim() -> list[bool]:
    """In a rank: a DTensor whose local tensor is laid out otherwise than its global strides
    say (as CPU flash attention lays its output out by its inputs' strides, which differ under
    DTensor from the trace's), viewed by the trace's ``aten.view``."""
    from torch.distributed.tensor import DTensor, Replicate

    from planner.vocab.strategy import StageProgram
    from runtime.compiled import tolerant_view
    from runtime.executor import make_mesh

    mesh = make_mesh(StageProgram((1,), {}))
    local = torch.arange(32.0).view(4, 8).t()  # (8, 4), strides (1, 8)
    x = DTensor.from_local(local, mesh, [Replicate()], shape=(8, 4), stride=(4, 1))
    out = []
    for view in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        try:
            view(x, [32])
            out.append(True)
        except RuntimeError:
            out.append(False)
    got = tolerant_view(x, [32]).to_local()
    return [*out, torch.equal(got, local.reshape(32))]


@pytest.mark.slow
def test_a_view_the_local_layout_does_not_allow_is_a_copy() -> None:
    """FlexOLMo's attention output, viewed after a transpose, under a data-parallel plan: the
    trace's view fails on the local tensor, and so does ``aten.reshape`` (it decides on the
    DTensor's global strides); the executor's and the compiled stage's views copy then."""
    assert launch(_view_of_a_local_layout_the_dtensor_does_not_claim, 1)[0] == [
        False,
        False,
        True,
    ]
