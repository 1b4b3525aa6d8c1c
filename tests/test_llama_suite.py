"""The llama suite: today's manual grid (torchtitan / Megatron-Core space), the published
configurations and the committed results. Single process, prediction only."""

from __future__ import annotations

import json

import pytest

from benchmarks.llama_configs import PUBLISHED, price_published, unpriced_reason
from benchmarks.llama_report import llama_checks
from benchmarks.manual_grid import ManualConfig, grid, price
from benchmarks.records import RESULTS
from benchmarks.suites import LLAMA_LONG, suite_cases
from cost_models.cluster import Cluster
from planner.plans.manual import manual_plan

TINY = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=128,vocab=512,seq=64"


def test_today_grid_enumerates_the_space() -> None:
    groups, pruned = grid(
        TINY, Cluster.from_spec("1x4xH100-80GB"), 8, "adam_mixed", "llama"
    )
    assert pruned == 0
    got = [c for g in groups for c in g]
    # (dp, tp, pp, fsdp, virtual stages) -> micro-batch counts, written out by hand: 8 rows,
    # 1..16 rows per replica, B >= pp, B a multiple of pp when interleaved (pp * v <= 4 blocks),
    # FSDP only with dp > 1 (HSDP needs dp beyond one host of 4: never here); every
    # recomputation with and without FSDP.
    layouts = {
        (4, 1, 1, "none", 1): [2, 1],
        (4, 1, 1, "full", 1): [2, 1],
        (2, 1, 2, "none", 1): [4, 2],
        (2, 1, 2, "none", 2): [4, 2],
        (2, 1, 2, "full", 1): [4, 2],
        (2, 1, 2, "full", 2): [4, 2],
        (1, 1, 4, "none", 1): [8, 4],
        (2, 2, 1, "none", 1): [4, 2, 1],
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
    assert len(got) == 90


def test_today_grid_prunes_by_the_sharded_state() -> None:
    # 8 B parameters x 16 bytes: 128 GB on one H100 without FSDP, 16 GB with FSDP over 8
    groups, pruned = grid(
        "llama3-8b", Cluster.from_spec("1x8xH100-80GB"), 128, "adam_mixed", "llama"
    )
    kept = {(g[0].dp, g[0].tp, g[0].pp, g[0].fsdp) for g in groups}
    assert (8, 1, 1, "full") in kept and (8, 1, 1, "none") not in kept
    assert (4, 2, 1, "none") in kept and pruned > 0


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
    assert (
        "context parallelism"
        in reasons[("llama3-8b", next(c.label() for c in PUBLISHED if c.cp == 8))]
    )
    fsdp8 = next(
        c
        for c in PUBLISHED
        if c.model == "llama3-8b" and c.fsdp == "full" and c.recompute == "none"
    )
    assert reasons[("llama3-8b", fsdp8.label())] is None
    mixtral = next(c for c in PUBLISHED if c.model == "mixtral-8x7b")
    assert "expert parallelism over 8 of the 16" in unpriced_reason(mixtral, 64)
    assert "published for 64 GPUs" in unpriced_reason(mixtral, 8)
    # priced as published (the layout on a small Llama, so the test stays cheap): FSDP over 8,
    # MBS 1 of GBS 128 = 16 micro-batches, the same plan as manual_plan's
    cluster = Cluster.from_spec("1x8xH100-80GB")
    rec = price_published(fsdp8, cluster, TINY, 8)
    direct = manual_plan(
        TINY,
        cluster,
        dp=8,
        tp=1,
        pp=1,
        num_microbatches=16,
        global_batch=128,
        fsdp="full",
        dtype="bfloat16",
        allow_oom=True,
    )
    assert rec["priced"] and rec["iteration_time_s"] == direct.estimate.iteration_time_s
    assert rec["fits"] == direct.manual["fits"] and rec["label"] == fsdp8.label()
    # torchtitan's FSDP 8 with selective activation checkpointing (local batch 2 of 16): priced
    tt8 = PUBLISHED[0]
    assert (tt8.fsdp, tt8.recompute) == ("full", "selective")
    assert unpriced_reason(tt8, 8) is None
    rec = price_published(tt8, cluster, TINY, 8)
    direct = manual_plan(
        TINY,
        cluster,
        dp=8,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=16,
        fsdp="full",
        recompute="selective",
        dtype="bfloat16",
        allow_oom=True,
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
    assert len(lines) == 2 and lines[0].startswith("- (llama) auto ratio >= 1.00")
