"""Tied parameters read by several pipeline stages: a GPT whose LM head is its token embedding
(``lm_head.weight = wte.weight``, as GPT-2 and BERT do).

The planner gives every stage whose ops read the tied weight a placement for its own copy and
lists it in the plan's ``tied_params``; a copy costs its stage what an untied head would; summing
the copies' gradients is priced as the all-reduce it is. The plan file accepts a parameter in
several stages only when ``tied_params`` lists it with exactly those stages, and the runtime only
when the model's stages really share it. On 4 gloo processes the tied model trains 3 SGD steps
under two-stage plans (data and tensor parallel inside the stages, on both pipeline runners;
copies placed alike and not, ZeRO-sharded or not; stages of different sizes; interleaved chunks)
and under the automatic plan to the losses and parameters of one device, the copies staying
bitwise equal; a checkpoint holds the tied weight once and loads into every stage holding a
copy. The runs of `COMPILED` train compiled (AOTAutograd), the others eagerly (the same
arithmetic; AOTAutograd's tracing was most of this launch's time).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import single_device
import torch
import torch.nn.functional as F
from torch import nn

from cost_models.cluster import Cluster
from cost_models.communication import ring_all_reduce
from cost_models.compute import step_overhead
from cost_models.errors import MeshplanError
from cost_models.pipeline import iteration_time
from planner import plan as auto_plan
from planner.inter.boundaries import stage_boundary_bytes
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace
from planner.vocab.plan_check import validate
from planner.vocab.plan_file import ParallelPlan
from runtime.launch import launch
from runtime.stages import check_tied, split_stages

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 128, 64, 4, 4, 16
BATCH, LR, STEPS = 8, 0.1, 3
ONE = "1x4xA100-80GB"
TIED = {"wte.weight": [0, 1]}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, HEADS, h // HEADS).transpose(1, 2)
            for t in self.qkv(x).split(h, dim=-1)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = nn.Sequential()
        self.mlp.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.mlp.act = nn.GELU()
        self.mlp.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, a final norm and an LM head whose weight
    is the token embedding's (unless `tie` is false); forward returns the mean cross-entropy."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model_and_batches(tie: bool = True) -> tuple[nn.Module, list[tuple]]:
    torch.manual_seed(0)
    model = TiedGPT(tie)
    gen = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
        for _ in range(STEPS)
    ]
    return model, batches


def _manual(tie: bool, cluster: str, **kw: Any) -> ParallelPlan:
    model, batches = _model_and_batches(tie)
    return manual_plan(
        model, cluster, batches[0], num_microbatches=2, global_batch=BATCH,
        dtype="float32", allow_oom=True, **kw,
    )  # fmt: skip


@functools.cache
def _plans() -> dict[str, ParallelPlan]:
    """Two-stage plans of the tied model on 4 devices (and one of 2 for the uneven plan), some
    with the tied weight ZeRO-sharded,
    interleaved ones (4 chunks on 2 device groups; 2 chunks on one group), and the automatic
    plan under a memory budget that one stage on all 4 devices exceeds."""
    dp2 = _manual(True, ONE, dp=2, tp=1, pp=2)
    tp2 = _manual(True, ONE, dp=1, tp=2, pp=2)
    misaligned = copy.deepcopy(
        tp2
    )  # stage 1's copy replicated, stage 0's split by vocabulary
    misaligned.stages[1].param_placements["wte.weight"] = ["R", "R"]
    zero = copy.deepcopy(
        dp2
    )  # both copies' gradients and updates ZeRO-sharded over dp2
    for stage in zero.stages:
        stage.zero_params.append("wte.weight")
    zero_one = copy.deepcopy(dp2)  # only stage 0's copy ZeRO-sharded
    zero_one.stages[0].zero_params.append("wte.weight")
    pp2 = _manual(True, "1x2xA100-80GB", dp=1, tp=1, pp=2)
    uneven = copy.deepcopy(
        tp2
    )  # stage 0 on rank 0, stage 1 tensor parallel on ranks 1, 2
    uneven.stages[0] = copy.deepcopy(pp2.stages[0])
    uneven.stages[1].devices = [1, 2]
    interleaved = _manual(True, ONE, dp=1, tp=2, pp=2, virtual_stages=2)
    one_group = _manual(True, ONE, dp=2, tp=2, pp=1, virtual_stages=2)
    model, batches = _model_and_batches()
    auto = auto_plan(
        model, ONE, batches[0], global_batch=BATCH, dtype="float32", memory_budget=3.6e6
    )
    return {
        "pp2_dp2": dp2,
        "pp2_tp2": tp2,
        "misaligned": misaligned,
        "zero": zero,
        "zero_one": zero_one,
        "uneven": uneven,
        "interleaved": interleaved,
        "one_group": one_group,
        "auto": auto,
    }


# ------------------------------------------------------------------------------- the planner


@pytest.mark.slow
def test_every_stage_reading_the_tied_weight_places_a_copy() -> None:
    """The first and last stages of every pipeline plan place wte.weight (Megatron's vocabulary
    split under tp2), the plan lists it as tied, and the stage graphs the runtime cuts share
    exactly it."""
    plans = _plans()
    assert len(plans["auto"].stages) == 2  # the budget forces a pipeline
    model, batches = _model_and_batches()
    for name, p in plans.items():
        ends = [0, len(p.stages) - 1]  # the embedding's stage and the head's
        assert p.tied_params == {"wte.weight": ends}, name
        holders = [
            i for i, s in enumerate(p.stages) if "wte.weight" in s.param_placements
        ]
        assert holders == ends, name
        graph = trace(
            model, tuple(t[: BATCH // p.num_microbatches] for t in batches[0])
        )
        check_tied(split_stages(graph, p), p)
    assert [s.param_placements["wte.weight"] for s in plans["pp2_tp2"].stages] == [
        ["R", "S(0)"],
        ["R", "S(0)"],
    ]
    single = _manual(True, ONE, dp=2, tp=2, pp=1)
    assert single.tied_params == {}


@pytest.mark.slow
def test_a_copy_costs_its_stage_what_an_untied_head_costs() -> None:
    """The tied model's stages need the memory of the untied model's: stage 1's copy of the
    embedding weighs what the untied LM head does (same shape, same Megatron placement)."""
    for kw in ({"dp": 2, "tp": 1}, {"dp": 1, "tp": 2}):
        tied = _manual(True, ONE, pp=2, **kw)
        untied = _manual(False, ONE, pp=2, **kw)
        assert untied.tied_params == {}
        for a, b in zip(tied.stages, untied.stages):
            assert a.memory_bytes == pytest.approx(b.memory_bytes, rel=1e-12), kw


@pytest.mark.slow
def test_the_gradient_sum_across_stages_is_priced() -> None:
    """The plan's iteration time is its stages' pipeline time plus one ring all-reduce of the
    embedding gradient's shard between the two devices at one mesh position of each stage
    (ranks 0 and 2, 2 apart in one host): ``2 (n - 1) alpha + 2 (n - 1) / n B beta``, n = 2,
    B = 128 x 64 x 4 bytes over the tp shards."""
    cluster = Cluster.from_spec(ONE)
    link = cluster.group_link(2, 2)
    model, batches = _model_and_batches()
    for kw, pieces in (({"dp": 2, "tp": 1}, 1), ({"dp": 1, "tp": 2}, 2)):
        p = _manual(True, ONE, pp=2, **kw)
        graph = trace(model, tuple(t[: BATCH // 2] for t in batches[0]))
        ops = [n.name for n in graph.ops]
        sent = stage_boundary_bytes(
            graph, p.layer_ranges(ops), [s.layers[1] for s in p.stages]
        )
        pipeline = iteration_time(
            cluster,
            [s.time_s for s in p.stages],
            sent,
            [s.devices for s in p.stages],
            p.num_microbatches,
            p.schedule,
            step_s=step_overhead(cluster),
        )
        B = VOCAB * HIDDEN * 4 / pieces
        closed = 2 * link.alpha + B * link.beta
        assert closed == pytest.approx(ring_all_reduce(B, 2, link))
        assert p.estimate.iteration_time_s - pipeline == pytest.approx(closed, rel=1e-9)


# ------------------------------------------------------------------------------- the plan file


def _broken(p: ParallelPlan, edit: Any) -> str:
    d = copy.deepcopy(p.to_json())
    edit(d)
    with pytest.raises(MeshplanError) as exc:
        ParallelPlan.from_json(d, "p.json")
    return str(exc.value)


@pytest.mark.slow
def test_the_plan_file_accepts_a_parameter_in_several_stages_only_when_tied() -> None:
    p = _plans()["pp2_tp2"]
    d = p.to_json()
    assert ParallelPlan.from_json(d).tied_params == TIED  # round trip
    assert ParallelPlan.from_json(_untied_file(d)).tied_params == {}

    msg = _broken(p, lambda d: d.pop("tied_params"))
    assert msg.startswith('p.json: stages[1].param_placements["wte.weight"]: also a ')
    assert 'tied_params as {"wte.weight": [0, 1]}' in msg

    def other_param(d: dict) -> None:  # an untied parameter copied into stage 1
        d["stages"][1]["param_placements"]["wpe.weight"] = ["R", "R"]

    assert 'stages[1].param_placements["wpe.weight"]' in _broken(p, other_param)
    msg = _broken(p, lambda d: d["tied_params"].update({"wte.weight": [0]}))
    assert 'tied_params["wte.weight"]: [0] is not a list of two or more' in msg
    msg = _broken(p, lambda d: d["tied_params"].update({"wpe.weight": [0, 1]}))
    assert "names stages[1], which has no placement for" in msg

    def interleaved_apart(d: dict) -> None:  # chunks of one group place the copy unlike
        d.update(virtual_stages=2, schedule="interleaved")
        d["stages"][1]["devices"] = d["stages"][0]["devices"]
        d["stages"][1]["param_placements"]["wte.weight"] = ["R", "R"]

    assert "chunks of one device group hold one copy" in _broken(p, interleaved_apart)


def _untied_file(d: dict) -> dict:
    """The plan file `d` of a tied model as written before tied parameters were planned: no
    tied_params field, and no copy of the weight in stage 1."""
    d = {k: copy.deepcopy(v) for k, v in d.items() if k != "tied_params"}
    d["stages"][1]["param_placements"].pop("wte.weight")
    return d


@pytest.mark.slow
def test_the_runtime_refuses_tied_params_the_model_does_not_share() -> None:
    """The plan file cannot know that wpe.weight is read by one stage only; the runtime checks
    the plan's tied_params against the stages it cuts from the model."""
    p = copy.deepcopy(_plans()["pp2_tp2"])
    p.stages[1].param_placements["wpe.weight"] = ["R", "R"]
    p.tied_params["wpe.weight"] = [0, 1]
    validate(p)
    model, batches = _model_and_batches()
    graph = trace(model, tuple(t[: BATCH // 2] for t in batches[0]))
    with pytest.raises(MeshplanError, match="'wpe.weight' to stages \\[0, 1\\]"):
        check_tied(split_stages(graph, p), p)
    # a plan made before tied parameters were planned: stage 1 has no copy
    old = ParallelPlan.from_json(_untied_file(_plans()["pp2_tp2"].to_json()))
    with pytest.raises(
        MeshplanError, match="do not list 'wte.weight', but .* are \\[0, 1\\]"
    ):
        check_tied(split_stages(graph, old), old)


# ------------------------------------------------------------------------------- training

# run -> (plan, pipeline runner, how the copies' gradients are summed). Runners: "torch"
# (torch.distributed.pipelining), "ours" (runtime.pipeline) or None (the default choice). Sums:
# "aligned" (copies placed alike: one all-reduce per mesh position), "gathered" (copies placed
# unlike or stages of different sizes) or "shared" (both stages are chunks of one device group,
# which hold one copy: nothing to sum).
RUNS = {
    "pp2_dp2": ("pp2_dp2", "torch", "aligned"),
    "pp2_dp2_ours": ("pp2_dp2", "ours", "aligned"),
    "pp2_tp2": ("pp2_tp2", "torch", "aligned"),
    "misaligned": ("misaligned", "torch", "gathered"),
    "zero": ("zero", "torch", "aligned"),
    "zero_one": ("zero_one", "ours", "gathered"),
    "uneven": ("uneven", "ours", "gathered"),
    "interleaved": ("interleaved", "torch", "aligned"),
    "one_group": ("one_group", "ours", "shared"),
    "auto": ("auto", None, "aligned"),
}


#: the runs trained compiled: the automatic plan and the copies ZeRO-sharded on torch's runner
COMPILED = ("auto", "zero")


def _train_all(plans: dict[str, ParallelPlan], root: str) -> dict[str, Any]:
    """Body of every rank: each run's losses and full stage parameters after 3 SGD steps; then
    the misaligned run's parameters saved and loaded under pp2_dp2."""
    import logging

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader

    from runtime.checkpoint import load_checkpoint, save_checkpoint

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    trainers = {}
    for run, (name, pipeline, _) in RUNS.items():
        model, batches = _model_and_batches()
        tr = single_device.trainer(
            plans[name],
            model,
            batches[0],
            "tied",
            lr=LR,
            pipeline=pipeline,
            compile=run in COMPILED,
        )
        losses = [tr.step(b) for b in batches]
        out[run] = {
            "losses": losses,
            "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
            "torch": getattr(tr.runner, "uses_torch_pipelining", False),
            "aligned": [c.aligned for c in tr.runner.tied],
            "sharded": any(
                x.is_shard()
                for x in getattr(tr.params.get("wte.weight"), "placements", ())
            ),
        }
        trainers[run] = tr
    tr = trainers["misaligned"]
    path = Path(root) / "misaligned"
    save_checkpoint(path, plans["misaligned"], tr.params, None, step=STEPS)
    params, _, _ = load_checkpoint(path, plans["pp2_dp2"])
    out["loaded"] = {k: v.full_tensor().numpy().copy() for k, v in params.items()}
    chunks = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out["saved_rows"] = sum(c.sizes[0] for c in chunks["model/wte.weight"].chunks)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tied")
    return launch(_train_all, 4, args=(_plans(), str(root)), timeout_s=600)


def _splits_the_copy(stage: Any) -> bool:
    """Whether the stage's copy of the weight is split over its devices: sharded by its
    placement, or by ZeRO on its replicated axes."""
    pl = stage.param_placements.get("wte.weight")
    axes = [a for a, n in enumerate(stage.logical_mesh) if n > 1]
    if pl is None:
        return False
    zero = "wte.weight" in stage.zero_params
    return any(pl[a].startswith("S") or (zero and pl[a] == "R") for a in axes)


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches()
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_trains_like_one_device(runs: list[dict[str, Any]], run: str) -> None:
    """Losses and parameters of one device within 1e-5; the copies of the tied weight (one per
    device group holding it) bitwise equal."""
    name, pipeline, how = RUNS[run]
    plan = _plans()[name]
    ref_losses, ref_params = _reference()
    assert "wte.weight" in ref_params and "lm_head.weight" not in ref_params
    got: dict[str, torch.Tensor] = {}
    firsts = {s.devices[0] for s in plan.stages if "wte.weight" in s.param_placements}
    copies = []
    for rank, r in enumerate(runs):
        res = r[run]
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
        got |= {k: torch.from_numpy(v) for k, v in res["params"].items()}
        if rank in firsts:
            copies.append(torch.from_numpy(res["params"]["wte.weight"]))
    single_device.assert_same_parameters(got, ref_params)
    assert len(copies) == (1 if how == "shared" else 2)
    assert all(torch.equal(c, copies[0]) for c in copies)
    in_plan = {d for s in plan.stages for d in s.devices}
    sharded = {d for s in plan.stages if _splits_the_copy(s) for d in s.devices}
    for rank, r in enumerate(runs):
        assert r[run]["sharded"] == (rank in sharded), rank
        expect = [] if how == "shared" or rank not in in_plan else [how == "aligned"]
        assert r[run]["aligned"] == expect, rank
        if pipeline is not None and rank in in_plan:
            assert r[run]["torch"] == (pipeline == "torch"), rank


@pytest.mark.slow
def test_checkpoint_holds_the_tied_weight_once(runs: list[dict[str, Any]]) -> None:
    """Saved under the misaligned plan (stage 0 splits the weight by vocabulary over 2 ranks,
    stage 1 replicates it): the chunks written cover its 128 rows once; loaded under pp2_dp2,
    both stages' copies equal the trained weight."""
    assert all(r["saved_rows"] == VOCAB for r in runs)
    trained = {}
    for r in runs:
        trained |= r["misaligned"]["params"]
    for r in runs:
        for k, v in r["loaded"].items():
            assert (v == trained[k]).all(), k
    assert sum("wte.weight" in r["loaded"] for r in runs) == 4
