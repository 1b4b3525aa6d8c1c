"""The built-in Llama and Mixtral families: parameter counts against the published ones, traced
FLOPs against a closed form, Megatron's placements on their projections and experts, and plans of
small ones that train on 4 gloo processes to the same losses and parameters as one device."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import single_device
import torch

from cost_models.errors import MeshplanError
from planner import plan, trace
from planner.models import build_model, get_config, param_count
from planner.models.llama import LlamaConfig
from planner.plans.manual import manual_plan
from runtime.launch import launch
from runtime.train import _random_batches

# Meta's model cards (Llama 3 / 3.1: 8.03 B, 70.6 B, 405 B) and Mistral AI's (Mixtral 8x7B: 46.7 B,
# 8x22B: 141 B parameters).
PUBLISHED = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405e9,
    "mixtral-8x7b": 46.7e9,
    "mixtral-8x22b": 141e9,
}
SMALL = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
# group_size 32: groups of 32 tokens (a micro-batch of 2 sequences of 16 is one group)
SMALL_MIXTRAL = (
    "mixtral:hidden=64,layers=2,heads=4,kv_heads=2,ffn=32,experts=4,vocab=128,seq=16,"
    "group_size=32"
)
LR = 0.1
STEPS = 3


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name: str) -> None:
    assert param_count(name) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_module_has_the_closed_form_parameter_count() -> None:
    for name in ("llama3-8b", SMALL, "mixtral-8x7b", SMALL_MIXTRAL):
        model, _ = build_model(name, batch=1, device="meta")
        assert sum(p.numel() for p in model.parameters()) == param_count(name)


@pytest.mark.parametrize("name,batch", [(SMALL, 2), ("llama3-8b", 1)])
def test_traced_flops_equal_the_closed_form(name: str, batch: int) -> None:
    """Forward: per block the four projections (q and o: h x h; k and v: h x g d), attention's
    two products (QK^T and AV over all s x s positions: FlopCounterMode does not count the causal
    mask's savings) and the three SwiGLU products; then the head. Backward is twice the forward."""
    model, b = build_model(name, batch=batch, device="meta")
    graph = trace(model, b, model_name=name)
    c: LlamaConfig = get_config(name)
    T, h, s = batch * c.seq, c.hidden, c.seq
    kv = c.kv_heads * c.head_dim
    block = 2 * T * h * (2 * h + 2 * kv) + 4 * batch * s * s * h + 2 * T * h * c.ffn * 3
    forward = c.layers * block + 2 * T * h * c.vocab
    assert graph.fwd_flops == forward
    assert graph.bwd_flops == 2 * forward
    assert graph.num_params == param_count(name)


@pytest.mark.parametrize("batch", [2, 3])
def test_mixtral_traced_flops_equal_the_closed_form(batch: int) -> None:
    """Llama's attention and head, then per block: the router (h x E), GShard's dispatch and
    combine einsums over (G groups of S tokens) x E experts x C slots, and the experts' three
    products on E G C token slots. Backward is twice the forward but for the dispatch, whose 0/1
    mask needs no gradient (1x). At 3 sequences of 16 the 48 tokens form groups of 24."""
    model, b = build_model(SMALL_MIXTRAL, batch=batch, device="meta")
    graph = trace(model, b, model_name=SMALL_MIXTRAL)
    c = get_config(SMALL_MIXTRAL)
    T, h, s, E, f = batch * c.seq, c.hidden, c.seq, c.experts, c.ffn
    S = next(g for g in range(min(c.group_size, T), 0, -1) if T % g == 0)
    G, C = T // S, min(S, -(-2 * S * c.capacity_factor // E))
    kv = c.kv_heads * c.head_dim
    attention = 2 * T * h * (2 * h + 2 * kv) + 4 * batch * s * s * h
    dispatch = 2 * G * S * E * C * h
    experts = 2 * E * G * C * h * f * 3
    block = attention + 2 * T * h * E + dispatch + experts + dispatch
    forward = c.layers * block + 2 * T * h * c.vocab
    assert graph.fwd_flops == forward
    assert graph.bwd_flops == 2 * forward - c.layers * dispatch
    assert graph.num_params == param_count(SMALL_MIXTRAL)


def test_bad_configs_are_named() -> None:
    with pytest.raises(MeshplanError, match="kv_heads=3"):
        build_model("llama:hidden=64,layers=1,heads=4,kv_heads=3,ffn=8", device="meta")
    with pytest.raises(MeshplanError, match="even head size"):
        build_model("llama:hidden=12,layers=1,heads=4,kv_heads=2,ffn=8", device="meta")


def test_megatron_places_the_projections() -> None:
    m = manual_plan(
        SMALL, "1x4xA100-80GB", dp=2, tp=2, pp=1, num_microbatches=2, global_batch=8
    )
    pl = m.stages[0].param_placements
    for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
        assert pl[f"blocks.0.{name}.weight"] == ["R", "S(0)"], name
    for name in ("attn.o", "mlp.down"):
        assert pl[f"blocks.0.{name}.weight"] == ["R", "S(1)"], name
    assert pl["blocks.0.attn_norm.weight"] == ["R", "R"]
    m = manual_plan(
        SMALL_MIXTRAL, "1x4xA100-80GB", dp=2, tp=2, pp=1, num_microbatches=2,
        global_batch=8, expert_parallel=True,
    )  # fmt: skip
    pl = m.stages[0].param_placements
    for name in ("w_gate", "w_up"):  # experts over dp, their width over tp
        assert pl[f"blocks.0.mlp.{name}"] == ["S(0)", "S(2)"], name
    assert pl["blocks.0.mlp.w_down"] == ["S(0)", "S(1)"]
    assert pl["blocks.0.mlp.router.weight"] == ["R", "R"]


def test_experts_split_over_part_of_the_replicas(tmp_path, capsys) -> None:
    """Megatron-Core's EP smaller than DP (expert_parallel=2 of dp=4): a (2, 2) mesh, the batch
    split over both axes, the experts over axis 1 only; what cannot be expressed is named."""
    m = manual_plan(
        SMALL_MIXTRAL, "1x4xA100-80GB", dp=4, tp=1, pp=1, num_microbatches=1,
        global_batch=8, expert_parallel=2,
    )  # fmt: skip
    st = m.stages[0]
    assert tuple(st.logical_mesh) == (2, 2)
    assert st.node_strategies["embedding"]["outputs"] == [["S(0)", "S(0)"]]
    pl = st.param_placements
    for name in ("w_gate", "w_up", "w_down"):
        assert pl[f"blocks.0.mlp.{name}"] == ["R", "S(0)"], name
    assert pl["blocks.0.mlp.router.weight"] == ["R", "R"]
    assert pl["blocks.0.attn.q.weight"] == ["R", "R"]
    assert m.manual["expert_parallel_degree"] == 2
    kw = {"pp": 1, "num_microbatches": 1, "global_batch": 8}
    with pytest.raises(MeshplanError, match="dividing dp=4, got 3"):
        manual_plan(SMALL_MIXTRAL, "1x4xA100-80GB", dp=4, tp=1, expert_parallel=3, **kw)
    with pytest.raises(MeshplanError, match="needs tp=1"):
        manual_plan(SMALL_MIXTRAL, "1x8xA100-80GB", dp=4, tp=2, expert_parallel=2, **kw)
    with pytest.raises(MeshplanError, match="divide by 8, but the model has 4"):
        manual_plan(SMALL_MIXTRAL, "1x8xA100-80GB", dp=8, tp=1, expert_parallel=8, **kw)
    with pytest.raises(MeshplanError, match="splits MoE expert weights, and llama"):
        manual_plan(SMALL, "1x4xA100-80GB", dp=4, tp=1, expert_parallel=2, **kw)
    # the CLI's --ep: the same plan; a degree that does not divide dp is named
    from planner.vocab.plan_file import ParallelPlan
    from runtime.cli import main

    args = ["manual", SMALL_MIXTRAL, "--cluster", "1x4xA100-80GB", "--batch", "8"]
    args += ["--dp", "4", "--tp", "1", "--pp", "1", "--microbatches", "1"]
    out = tmp_path / "ep.json"
    assert main([*args, "--ep", "2", "--json", str(out)]) == 0
    assert ParallelPlan.load(out).estimate == m.estimate
    assert main([*args, "--ep", "3"]) == 2
    assert "dividing dp=4, got 3" in capsys.readouterr().err


@functools.cache
def _plans(spec: str) -> dict[str, Any]:
    kw = {"global_batch": 8, "dtype": "float32", "allow_oom": True}
    one = "1x4xA100-80GB"
    out = {
        "tp2_dp2": manual_plan(spec, one, dp=2, tp=2, pp=1, num_microbatches=1, **kw),
        "tp4": manual_plan(spec, one, dp=1, tp=4, pp=1, num_microbatches=2, **kw),
        "pp2_dp2": manual_plan(spec, one, dp=2, tp=1, pp=2, num_microbatches=2, **kw),
        # one micro-batch size: the search over sizes is tested in tests/test_plan.py
        "auto": plan(spec, one, global_batch=8, dtype="float32", microbatch_size=4),
    }
    if spec == SMALL:
        # the gradient all-reduce in buckets overlapping the last micro-batch's backward
        # (`runtime.grad_overlap`): recomputed stages run eagerly; buckets of ~5 KB, several
        # per stage (`planner.inter.dp_overlap`)
        out["pp2_dp2_overlap"] = _small_buckets(
            lambda: manual_plan(
                spec, one, dp=2, tp=1, pp=2, num_microbatches=2, recompute="full", **kw
            )
        )
    if spec == SMALL_MIXTRAL:
        out["ep2_tp2"] = manual_plan(
            spec, one, dp=2, tp=2, pp=1, num_microbatches=1, expert_parallel=True, **kw
        )
        # experts over 2 of the 4 replicas: a (2, 2) mesh
        out["ep2_of_dp4"] = manual_plan(
            spec, one, dp=4, tp=1, pp=1, num_microbatches=1, expert_parallel=2, **kw
        )
    return out


#: a bucket cap small enough to cut a small model's stage into several buckets
SMALL_CAP = 5000


def _small_buckets(make: Any) -> Any:
    """`make()` with the gradient buckets capped at `SMALL_CAP` bytes."""
    from planner.inter import dp_overlap

    cap = dp_overlap.BUCKET_CAP_BYTES
    dp_overlap.BUCKET_CAP_BYTES = SMALL_CAP
    try:
        return make()
    finally:
        dp_overlap.BUCKET_CAP_BYTES = cap


def _model_and_batches(spec: str) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model, b = build_model(spec, batch=8, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _train(spec: str, plans: dict[str, Any]) -> dict[str, Any]:
    """Body of every rank: each plan's losses and full parameters after `STEPS` SGD steps."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out = {}
    for name, p in plans.items():
        model, batches = _model_and_batches(spec)
        if name != "pp2_dp2_overlap":
            # the automatic plan compiled, the manual ones eager (`single_device.train_plan`)
            out[name] = single_device.train_plan(
                p, model, batches, LR, spec, compile=name == "auto"
            )
            continue

        tr = single_device.trainer(p, model, batches[0], spec, lr=LR)
        out[name] = {"losses": [tr.step(b) for b in batches]}
        out[name]["params"] = {k: v.numpy().copy() for k, v in tr.full_params().items()}
        ov = tr.runner.overlap
        out[name]["launched"] = (ov.launched_in_backward, ov.launched_at_finish)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SMALL, SMALL_MIXTRAL], ids=["llama", "mixtral"])
def test_small_models_train_like_one_device(spec: str) -> None:
    """tp2 x dp2, tp4 (grouped-query attention: 2 key/value heads on 4 devices), two pipeline
    stages of dp2 (for Llama also with recomputation and the gradient all-reduce overlapping
    backward in several buckets), the automatic plan (compiled; the others eager) and, for Mixtral, experts split over dp2 with tp2 and over 2 of dp4, on 4 gloo
    processes: 3 SGD steps give the losses and parameters of one device within 1e-5."""
    model, batches = _model_and_batches(spec)
    ref_losses, ref_params = single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )
    ranks = launch(_train, 4, args=(spec, _plans(spec)), timeout_s=600)
    for name in _plans(spec):
        params = {}  # a pipeline stage's ranks hold that stage's parameters
        for r in ranks:
            assert r[name]["losses"] == pytest.approx(ref_losses, rel=1e-5), name
            params |= {k: torch.from_numpy(v) for k, v in r[name]["params"].items()}
        single_device.assert_same_parameters(params, ref_params)
    if spec == SMALL:
        # every bucket of the last step was launched from its hooks during backward, none
        # after it (`runtime.grad_overlap`), as many as the rank's stage plans
        plan = _plans(spec)["pp2_dp2_overlap"]
        for rank, r in enumerate(ranks):
            (stage,) = [s for s in plan.stages if rank in s.devices]
            assert len(stage.grad_buckets) > 2
            assert r["pp2_dp2_overlap"]["launched"] == (len(stage.grad_buckets), 0)
