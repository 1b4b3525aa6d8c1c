"""The iteration-time bound of `benchmarks.ceiling` against brute force: every configuration of the
manual grid (recomputation and expert parallelism included) and the automatic plan, on small
models and multi-host clusters, is predicted at least as slow as the bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
from profiles import cpu_profile

from benchmarks.ceiling import ceiling
from benchmarks.manual_grid import grid, price
from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner import plan

CASES = [
    ("gpt-tiny", "2x2xV100-16GB", 8, "gpt", "float16", "adam_mixed"),
    ("moe-tiny", "1x2xA100-80GB", 4, "moe", "float16", "adam_mixed"),
    ("wresnet-tiny", "1x4xH100-80GB", 8, "wresnet", "float32", "adam_fp32"),
]


@pytest.mark.parametrize("model,spec,G,suite,dtype,optimizer", CASES)
@pytest.mark.slow
def test_no_plan_beats_the_bound(model, spec, G, suite, dtype, optimizer) -> None:
    cluster = Cluster.from_spec(spec)
    bound = ceiling(model, cluster, G, dtype=dtype, optimizer=optimizer)
    t_min = bound["iteration_time_s"]
    groups, pruned = grid(model, cluster, G, optimizer, suite)
    assert pruned == 0 and groups
    times = {}
    for config in (c for group in groups for c in group):
        try:
            p = price(model, cluster, config, G, dtype, optimizer)
        # e.g. a micro-batch size the model cannot be traced at
        except MeshplanError:
            continue
        times[config.label()] = p.estimate.iteration_time_s
    assert len(times) >= 8
    auto = plan(model, cluster, global_batch=G, dtype=dtype, optimizer=optimizer)
    times["auto"] = auto.estimate.iteration_time_s
    below = {k: t for k, t in times.items() if t < t_min * (1 - 1e-9)}
    assert not below, f"faster than the bound {t_min}: {below}"
    # So max_ratio, a manual time over the bound, caps every plan's ratio against it.
    some = next(iter(times.values()))
    capped = ceiling(
        model, cluster, G, dtype=dtype, optimizer=optimizer, manual_time_s=some
    )
    assert capped["max_ratio"] == pytest.approx(some / t_min)


def test_the_bound_is_attained_on_one_device() -> None:
    """Tight where it can be: on one device, the automatic plan held to the whole batch in one
    micro-batch is priced at the bound; on 8 devices of the kind the bound is an eighth of it,
    at the same TFLOP/s per device."""
    one = ceiling("gpt-tiny", "1x1xA100-80GB", 16)
    p = plan("gpt-tiny", "1x1xA100-80GB", global_batch=16, microbatch_size=16)
    assert p.estimate.iteration_time_s == pytest.approx(
        one["iteration_time_s"], rel=1e-9
    )
    assert one["tflops_per_device"] == pytest.approx(p.estimate.tflops_per_device)
    eight = ceiling("gpt-tiny", "1x8xA100-80GB", 16)
    assert eight["iteration_time_s"] == pytest.approx(one["iteration_time_s"] / 8)
    assert eight["tflops_per_device"] == pytest.approx(one["tflops_per_device"])
    assert one["max_ratio"] is None


def test_a_profiled_cluster_is_refused() -> None:
    cluster = replace(Cluster.from_spec("1x2xA100-80GB"), profile=cpu_profile())
    with pytest.raises(MeshplanError, match="datasheet pricing only"):
        ceiling("gpt-tiny", cluster, 16)
