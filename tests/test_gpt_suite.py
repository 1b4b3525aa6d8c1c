"""Alpa's GPT suite on V100s (1 to 4 GPUs here; `python -m benchmarks.gpt_suite` runs 1 to 64):
plans fit in 16 GB and beat Megatron's best configuration from the reference, as priced by our models."""

from __future__ import annotations

import pytest

from benchmarks.gpt_suite import run_case
from cost_models.cluster import Cluster

pytestmark = pytest.mark.slow  # 5 to 14 s per case


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_gpt_case_fits_and_beats_megatron(gpus: int) -> None:
    case = run_case(gpus)
    assert case["fits"]
    assert (
        case["auto"]["peak_memory_bytes"]
        <= Cluster.from_spec(case["cluster"]).device.memory_bytes
    )
    if "megatron" in case:
        assert case["ratio"] >= 1.0
