"""Every plan of a case that a size bound must not beat: the automatic plan at each
micro-batch size, and every configuration of the manual grid (`benchmarks.manual_grid`), each
with its size (tests of `planner.size_bound` and `planner.inter.mesh_bound`)."""

from __future__ import annotations

from collections.abc import Collection

from benchmarks.manual_grid import grid, price
from cost_models.cluster import Cluster
from planner.api import plan


def size_plan_times(
    model: str, cluster: Cluster, G: int, sizes: Collection[int], suite: str
) -> dict[str, tuple[int, float]]:
    """{label: (micro-batch size, predicted iteration time)} of the plans above at `sizes`."""
    times = {}
    for b in sizes:
        p = plan(model, cluster, global_batch=G, microbatch_size=b)
        times[f"auto at {b} rows"] = (b, p.estimate.iteration_time_s)
    groups, _ = grid(model, cluster, G, "adam_mixed", suite)
    for config in (c for group in groups for c in group):
        p = price(model, cluster, config, G, "float16", "adam_mixed")
        b = G // p.num_microbatches
        if b in sizes:
            times[config.label()] = (b, p.estimate.iteration_time_s)
    return times
