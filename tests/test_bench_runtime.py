"""benchmarks.bench_runtime: the hand-written reference and the runtime train the same thing.

A smoke test only (no timing assertions): one launch of 2 gloo ranks, tensor parallel tp=2 on a
tiny GPT, 2 alternating steps of each; both give the same losses, so the benchmark's step-time
comparison is apples to apples.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_runtime import CONFIGS, run_config

pytestmark = pytest.mark.slow  # launches 2 gloo ranks

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128"


def test_reference_and_runtime_agree_tp2() -> None:
    r = run_config(CONFIGS["tp2"], spec=SPEC, batch=8, steps=1, warmup=1)
    assert len(r["loss"]) == len(r["ref_loss"]) == 2
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
    assert r["loss"][1] < r["loss"][0] + 1.0  # trained, not diverged
    assert len(r["runtime"]) == len(r["reference"]) == 1
