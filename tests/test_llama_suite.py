"""The llama suite: today's manual grid (torchtitan / Megatron-Core space), the published
configurations and the committed results. Single process, prediction only."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from benchmarks import suites
from benchmarks.llama_configs import PUBLISHED, price_published, unpriced_reason
from benchmarks.llama_report import llama_checks, long_context_table
from benchmarks.manual_grid import (
    ManualConfig,
    grid,
    model_facts,
    price,
    state_lower_bound,
)
from benchmarks.records import RESULTS, TIE, context_degree
from benchmarks.suites import LLAMA_LONG, run_case, suite_cases
from cost_models.cluster import Cluster
from cost_models.memory import state_bytes_per_param
from planner.plans.manual import manual_plan

TINY = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=128,vocab=512,seq=64"
TINY_MIXTRAL = (
    "mixtral:hidden=64,layers=2,heads=4,kv_heads=2,ffn=32,experts=8,vocab=128,seq=16,"
    "group_size=16"
)


def test_today_grid_enumerates_the_space() -> None:
    groups, pruned = grid(
        TINY,
        Cluster.from_spec("1x4xH100-80GB"),
        8,
        "adam_mixed",
        "llama",
        context_parallel=False,
    )
    assert pruned == 0
    got = [c for g in groups for c in g]
    # (dp, tp, pp, fsdp, virtual stages) -> micro-batch counts, written out by hand: 8 rows,
    # 1..16 rows per replica, B >= pp, B a multiple of pp when interleaved (pp * v <= 4 blocks),
    # the distributed optimizer (zero2) and FSDP only with dp > 1 (HSDP needs dp beyond one
    # host of 4: never here); every recomputation with each.
    layouts = {
        (4, 1, 1, "none", 1): [2, 1],
        (4, 1, 1, "zero2", 1): [2, 1],
        (4, 1, 1, "full", 1): [2, 1],
        (2, 1, 2, "none", 1): [4, 2],
        (2, 1, 2, "none", 2): [4, 2],
        (2, 1, 2, "zero2", 1): [4, 2],
        (2, 1, 2, "zero2", 2): [4, 2],
        (2, 1, 2, "full", 1): [4, 2],
        (2, 1, 2, "full", 2): [4, 2],
        (1, 1, 4, "none", 1): [8, 4],
        (2, 2, 1, "none", 1): [4, 2, 1],
        (2, 2, 1, "zero2", 1): [4, 2, 1],
        (2, 2, 1, "full", 1): [4, 2, 1],
        (1, 2, 2, "none", 1): [8, 4, 2],
        (1, 2, 2, "none", 2): [8, 4, 2],
        (1, 4, 1, "none", 1): [8, 4, 2, 1],
    }
    expected = [
        ManualConfig(dp, tp, pp, B, rc, False, fsdp, True if tp > 1 else None, v)
        for (dp, tp, pp, fsdp, v), counts in layouts.items()
        for B in counts
        for rc in ("none", "selective", "full")
    ]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert len(got) == 117


@pytest.mark.slow
def test_today_grid_enumerates_context_parallel_and_prices_it() -> None:
    """The grid's CP configurations, written out by hand: the devices a (dp > 1, tp, pp) gives
    to data parallelism given to CP instead (dp = 1), or with tp = 1 split between data and
    context parallelism (dp x cp), micro-batches of one row per replica (B = 8 / dp), ZeRO-2 or
    FSDP over the dp x cp devices or none, no HSDP; each priced by manual_plan as that CP
    degree."""
    cluster = Cluster.from_spec("1x4xH100-80GB")
    groups, pruned = grid(TINY, cluster, 8, "adam_mixed", "llama")
    assert pruned == 0
    got = [c for g in groups for c in g if c.context_parallel > 1]
    # (dp, cp, tp, pp, fsdp, virtual stages)
    layouts = [
        (1, 4, 1, 1, "none", 1),
        (1, 4, 1, 1, "zero2", 1),
        (1, 4, 1, 1, "full", 1),
        (2, 2, 1, 1, "none", 1),
        (2, 2, 1, 1, "zero2", 1),
        (2, 2, 1, 1, "full", 1),
        (1, 2, 1, 2, "none", 1),
        (1, 2, 1, 2, "none", 2),
        (1, 2, 1, 2, "zero2", 1),
        (1, 2, 1, 2, "zero2", 2),
        (1, 2, 1, 2, "full", 1),
        (1, 2, 1, 2, "full", 2),
        (1, 2, 2, 1, "none", 1),
        (1, 2, 2, 1, "zero2", 1),
        (1, 2, 2, 1, "full", 1),
    ]
    expected = [
        ManualConfig(
            dp, tp, pp, 8 // dp, rc, False, fsdp, True if tp > 1 else None, v, cp
        )
        for dp, cp, tp, pp, fsdp, v in layouts
        for rc in ("none", "selective", "full")
    ]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    # the rest of the grid is the grid without CP
    rest = [c for g in groups for c in g if c.context_parallel == 1]
    without, _ = grid(TINY, cluster, 8, "adam_mixed", "llama", context_parallel=False)
    assert rest == [c for g in without for c in g]
    assert ManualConfig(**expected[-1].record()) == expected[-1]
    assert expected[-1].label() == "dp1 tp2 pp1 B8 rc fsdp sp cp2"
    # each layout priced at its last rung (the most recomputation; the rungs differ by it only)
    last = {
        (c.dp, c.context_parallel, c.tp, c.pp, c.fsdp, c.virtual_stages): c
        for c in expected
    }
    plans = [
        (c, price(TINY, cluster, c, 8, "bfloat16", "adam_mixed")) for c in last.values()
    ]
    for config, p in plans:
        assert p.manual["context_parallel"] == config.context_parallel
        assert context_degree(p) == config.context_parallel, config.label()
        assert 0 < p.estimate.iteration_time_s < float("inf")
    # CP degrees divide the sequence (66: 2, not 4); none for a model with experts; none in the
    # 2021 grid
    odd = TINY.replace("seq=64", "seq=66")
    groups, _ = grid(odd, cluster, 8, "adam_mixed", "llama")
    assert {c.context_parallel for g in groups for c in g} == {1, 2}
    for model, suite in (("mixtral-tiny", "llama"), (TINY, "gpt")):
        groups, _ = grid(model, cluster, 8, "adam_mixed", suite)
        assert {c.context_parallel for g in groups for c in g} == {1}


@pytest.mark.slow
def test_long_context_record_with_and_without_cp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small Llama with a long sequence (one head: neither the batch of one nor the heads can
    be split) on 2 H100s, priced only, through the suite's `run_case`: the record carries the
    automatic plan and the grid's best with context parallelism allowed and without it; CP
    pays here, and the automatic plan with CP allowed is at least as fast as without it and as
    the grid's best with CP."""
    spec = "llama:hidden=64,layers=2,heads=1,kv_heads=1,ffn=128,vocab=128,seq=16384"
    monkeypatch.setattr(suites, "LONG_CONTEXT", (spec,))
    rec = run_case(suites.Case("llama", spec, 2, "1x2xH100-80GB", 1, "bfloat16"))
    json.dumps(rec)
    without = rec["without_cp"]
    auto, auto_1 = rec["auto"]["iteration_time_s"], without["auto"]["iteration_time_s"]
    grid_cp = rec["manual_best"]["iteration_time_s"]
    assert auto <= auto_1 * (1 + TIE) and auto <= grid_cp * (1 + TIE)
    assert rec["ratio"] == pytest.approx(grid_cp / auto)
    assert without["ratio"] == pytest.approx(
        without["manual_best"]["iteration_time_s"] / auto_1
    )
    # CP is what makes the difference: used with it, absent without
    assert rec["auto"]["context_parallel"] == 2 and auto < auto_1
    assert rec["manual_best"]["config"]["context_parallel"] == 2
    assert without["auto"]["context_parallel"] == 1
    assert "context_parallel" not in without["manual_best"]["config"]
    assert without["manual_best"]["grid_size"] < rec["manual_best"]["grid_size"]
    doc = {"suite": "llama", "cases": [rec | {"published": []}]}
    table = long_context_table(doc)
    rows = [r for r in table if r.startswith("| 2 |")]
    assert len(rows) == 4 and "| grid best | no |" in rows[-1]
    # the grid's CP configurations summarised: the fastest that fits is the best here
    cp = rec["manual_best"]["context_parallel"]
    assert cp["fitted"] >= 1 and cp["priced"] >= cp["fitted"]
    assert cp["best"]["iteration_time_s"] == grid_cp
    assert "context_parallel" not in without["manual_best"]
    assert f"The grid priced {cp['priced']} configurations with CP" in table[-1]
    assert any(
        "long context, best with and without CP" in x for x in llama_checks([doc])
    )


def test_checks_list_unfitting_published_configurations_apart() -> None:
    """A published configuration predicted faster than the automatic plan fails the check
    where it fits; where it does not fit it is named apart, with its memory."""

    def doc(fits: bool) -> dict:
        auto = {"iteration_time_s": 2.0}
        faster = {"system": "S", "label": "L", "priced": True, "vs_auto": 0.9}
        faster |= {"fits": fits, "peak_memory_bytes": 100 * 2**30}
        slower = faster | {"label": "M", "vs_auto": 1.2, "fits": True}
        case = {"model": "m", "num_devices": 8, "ratio": 1.0, "auto": auto}
        return {"suite": "llama", "cases": [case | {"published": [faster, slower]}]}

    def line(fits: bool) -> str:
        return next(x for x in llama_checks([doc(fits)]) if "published" in x)

    assert line(True).endswith("(2 of 2 priced): no: m on 8: S L (0.900)")
    assert line(False).endswith(
        "(2 of 2 priced): yes (predicted faster but not fitting: m on 8: S L (0.900, "
        "needs 100.0 GiB))"
    )


def test_today_grid_prunes_by_the_sharded_state() -> None:
    # 8 B parameters x 16 bytes: 128 GB on one H100 without FSDP, 16 GB with FSDP over 8
    groups, pruned = grid(
        "llama3-8b", Cluster.from_spec("1x8xH100-80GB"), 128, "adam_mixed", "llama"
    )
    kept = {(g[0].dp, g[0].tp, g[0].pp, g[0].fsdp) for g in groups}
    assert (8, 1, 1, "full") in kept and (8, 1, 1, "none") not in kept
    assert (4, 2, 1, "none") in kept and pruned > 0
    # the distributed optimizer: weights and gradients whole, the optimizer state over dp 8
    assert (8, 1, 1, "zero2") in kept
    s = state_bytes_per_param("adam_mixed")
    facts = model_facts("llama3-8b")
    bound = state_lower_bound(facts, 8, 1, 1, "adam_mixed", False, 8, zero2=True)
    assert bound == pytest.approx(
        facts.params * (s.param + s.grad + s.optimizer / 8), rel=1e-12
    )
    # on 64 H100s llama3-70b does not fit with it (weights and gradients stay whole), but
    # does with FSDP
    budget = Cluster.from_spec("8x8xH100-80GB").device.memory_bytes
    facts = model_facts("llama3-70b")
    zero2 = state_lower_bound(facts, 64, 1, 1, "adam_mixed", False, 64, zero2=True)
    assert zero2 > budget > state_lower_bound(facts, 64, 1, 1, "adam_mixed", False, 64)


def test_2021_records_keep_their_form() -> None:
    c = ManualConfig(2, 4, 8, 16, True)
    assert c.record() == {
        "dp": 2,
        "tp": 4,
        "pp": 8,
        "num_microbatches": 16,
        "recompute": True,
        "expert_parallel": False,
    }
    assert ManualConfig(**c.record()) == c and c.label() == "dp2 tp4 pp8 B16 rc"
    today = ManualConfig(2, 4, 8, 16, "selective", False, "full", True, 5)
    assert ManualConfig(**today.record()) == today
    assert today.label() == "dp2 tp4 pp8 B16 sel fsdp sp v5"
    groups, _ = grid(
        "gpt-tiny", Cluster.from_spec("1x2xV100-16GB"), 8, "adam_mixed", "gpt"
    )
    old = {"dp", "tp", "pp", "num_microbatches", "recompute", "expert_parallel"}
    assert groups and all(set(c.record()) == old for g in groups for c in g)


def test_llama_cases() -> None:
    cases = suite_cases("llama", device="H100-80GB")
    assert [(c.model, c.num_devices, c.cluster, c.global_batch) for c in cases] == [
        ("llama3-8b", 8, "1x8xH100-80GB", 128),
        ("llama3-70b", 64, "8x8xH100-80GB", 128),
        ("llama3-405b", 512, "64x8xH100-80GB", 256),
        ("mixtral-8x7b", 64, "8x8xH100-80GB", 256),
        (LLAMA_LONG, 8, "1x8xH100-80GB", 1),
    ]
    assert all(c.dtype == "bfloat16" for c in cases)
    with pytest.raises(ValueError, match="no case for"):
        suite_cases("llama", [16])


def test_published_configs_price_or_say_why_not() -> None:
    reasons = {(c.model, c.label()): unpriced_reason(c, c.gpus) for c in PUBLISHED}
    assert all(c.source for c in PUBLISHED)
    tt_cp8 = next(c for c in PUBLISHED if c.cp == 8)  # FSDP + CP 8 + full recomputation
    assert (tt_cp8.fsdp, tt_cp8.recompute) == ("full", "full")
    assert reasons[("llama3-8b", tt_cp8.label())] is None
    nemo_cp2 = next(c for c in PUBLISHED if c.cp == 2 and c.model == "llama3-8b")
    assert reasons[("llama3-8b", nemo_cp2.label())] is None  # DP 4 x CP 2, TP 1
    nemo_70b = next(c for c in PUBLISHED if c.cp == 2 and c.model == "llama3-70b")
    assert reasons[("llama3-70b", nemo_70b.label())] is None  # a (dp, cp, tp) mesh
    two_rows = dataclasses.replace(nemo_cp2, microbatch_size=2)
    assert "micro-batch size 2" in unpriced_reason(two_rows, 8)
    # CP is priced as manual_plan(context_parallel=...) prices it, with and without data
    # parallelism (Megatron-Core's distributed optimizer: ZeRO-2)
    cluster = Cluster.from_spec("1x8xH100-80GB")

    def direct_plan(**kw: Any) -> Any:  # the published layout, as manual_plan prices it
        return manual_plan(
            TINY, cluster, tp=1, pp=1, dtype="bfloat16", allow_oom=True, **kw
        )

    rec = price_published(tt_cp8, cluster, TINY, 8)
    direct = direct_plan(
        dp=1,
        num_microbatches=1,
        global_batch=1,
        fsdp="full",
        recompute="full",
        context_parallel=8,
    )
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s
    rec = price_published(nemo_cp2, cluster, TINY, 8)
    direct = direct_plan(
        dp=4, num_microbatches=32, global_batch=128, fsdp="zero2", context_parallel=2
    )
    assert tuple(direct.stages[0].logical_mesh) == (4, 2)
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s
    fsdp8 = next(
        c
        for c in PUBLISHED
        if c.model == "llama3-8b" and c.fsdp == "full" and c.recompute == "none"
    )
    assert reasons[("llama3-8b", fsdp8.label())] is None
    mixtral = next(c for c in PUBLISHED if c.model == "mixtral-8x7b")
    assert (
        unpriced_reason(mixtral, 64) is None
    )  # EP 8 of DP 16 with TP 1: a (2, 8) mesh
    assert "published for 64 GPUs" in unpriced_reason(mixtral, 8)
    with_tp = dataclasses.replace(mixtral, tp=2, gpus=128)
    assert "with TP 2: a (dp / ep, ep, tp) mesh" in unpriced_reason(with_tp, 128)
    # priced as published (on a small Mixtral, one stage of 16): experts over 8 of the 16
    # replicas with Megatron-Core's distributed optimizer, the same plan as
    # manual_plan(expert_parallel=8, fsdp="zero2")'s
    one_stage = dataclasses.replace(mixtral, gpus=16, pp=1, virtual_stages=1)
    assert one_stage.distributed_optimizer
    two_hosts = Cluster.from_spec("2x8xH100-80GB")
    rec = price_published(one_stage, two_hosts, TINY_MIXTRAL, 16)
    direct = manual_plan(
        TINY_MIXTRAL, two_hosts, dp=16, tp=1, pp=1, num_microbatches=16,
        global_batch=256, expert_parallel=8, dtype="bfloat16", allow_oom=True,
        fsdp="zero2",
    )  # fmt: skip
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s
    assert rec["peak_memory_bytes"] == direct.estimate.peak_memory_bytes
    assert rec["label"].startswith("DP16 (dist-opt) TP1 PP1 EP8")
    assert direct.stages[0].param_placements["blocks.0.mlp.w_gate"] == ["R", "S(0)"]
    assert "blocks.0.mlp.w_gate" in direct.stages[0].zero_params
    # priced as published (the layout on a small Llama, so the test stays cheap): FSDP over 8,
    # MBS 1 of GBS 128 = 16 micro-batches, the same plan as manual_plan's
    rec = price_published(fsdp8, cluster, TINY, 8)
    direct = direct_plan(
        dp=8,
        num_microbatches=16,
        global_batch=128,
        fsdp="full",
    )
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s
    assert rec["fits"] == direct.manual["fits"] and rec["label"] == fsdp8.label()
    # torchtitan's FSDP 8 with selective activation checkpointing (local batch 2 of 16): priced
    tt8 = PUBLISHED[0]
    assert (tt8.fsdp, tt8.recompute) == ("full", "selective")
    assert unpriced_reason(tt8, 8) is None
    rec = price_published(tt8, cluster, TINY, 8)
    direct = direct_plan(
        dp=8,
        num_microbatches=1,
        global_batch=16,
        fsdp="full",
        recompute="selective",
    )
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s


@pytest.mark.slow
def test_committed_llama_results_reproduce() -> None:
    """The committed suite: ratios as recorded, and the 8-GPU case's best manual configuration
    and priced published configurations re-priced to the recorded times (planning aside)."""
    doc = json.loads((RESULTS / "llama-H100-80GB.json").read_text())
    assert [(c["model"], c["num_devices"]) for c in doc["cases"]] == [
        (c.model, c.num_devices) for c in suite_cases("llama", device="H100-80GB")
    ]
    for c in doc["cases"]:
        m, t = c["manual_best"], c["auto"]["iteration_time_s"]
        if m["config"] and t:
            assert c["ratio"] == pytest.approx(m["iteration_time_s"] / t, rel=1e-12)
        for p in c["published"]:
            assert p["priced"] or p["reason"]
    case = doc["cases"][0]
    cluster = Cluster.from_spec(case["cluster"])
    best = price(
        "llama3-8b",
        cluster,
        ManualConfig(**case["manual_best"]["config"]),
        128,
        "bfloat16",
        "adam_mixed",
    )
    assert best.estimate.iteration_time_s == pytest.approx(
        case["manual_best"]["iteration_time_s"], rel=1e-9
    )
    for p in case["published"]:
        if p["priced"]:
            c = next(
                x
                for x in PUBLISHED
                if x.label() == p["label"] and x.model == p["model"]
            )
            again = price_published(c, cluster, "llama3-8b", 8)
            assert again["iteration_time_s"] == pytest.approx(
                p["iteration_time_s"], rel=1e-9
            )
    lines = llama_checks([doc])
    long = sum("without_cp" in c for c in doc["cases"])  # a line each
    assert len(lines) == 2 + long and lines[0].startswith(
        "- (llama) auto ratio >= 1.00"
    )
