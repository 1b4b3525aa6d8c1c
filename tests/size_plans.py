"""For the tests of the size bounds (`planner.size_bound`, `planner.inter.mesh_bound`): every
plan of a case a size's bound must not beat, and the plans with and without the sizes they
rule out."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from benchmarks.manual_grid import grid, price
from cost_models.cluster import Cluster
from planner import size_eval
from planner.api import plan
from planner.vocab.plan_file import ParallelPlan


def size_plan_times(
    model: str, cluster: Cluster, G: int, sizes: Collection[int], suite: str
) -> dict[str, tuple[int, float, set[tuple]]]:
    """{label: (micro-batch size, predicted iteration time, its stages' (submesh, logical
    mesh))} of the plans above at `sizes`."""
    times = {}

    def add(label: str, p: ParallelPlan) -> None:
        meshes = {(tuple(s.submesh), tuple(s.logical_mesh)) for s in p.stages}
        times[label] = (G // p.num_microbatches, p.estimate.iteration_time_s, meshes)

    for b in sizes:
        add(
            f"auto at {b} rows", plan(model, cluster, global_batch=G, microbatch_size=b)
        )
    groups, _ = grid(model, cluster, G, "adam_mixed", suite)
    for config in (c for group in groups for c in group):
        p = price(model, cluster, config, G, "float16", "adam_mixed")
        if G // p.num_microbatches in sizes:
            add(config.label(), p)
    return times


def plans_without_and_with_skips(
    monkeypatch: pytest.MonkeyPatch, model: str, cluster: Cluster | str, G: int
) -> tuple[list[dict], list[str]]:
    """The plan JSON (planner time aside) searching every size, then skipping and giving up the
    sizes the bounds rule out (`planner.size_eval.SKIP_BOUNDED_SIZES`), and the progress of
    the second."""
    plans, said = [], []
    for skip in (False, True):
        monkeypatch.setattr(size_eval, "SKIP_BOUNDED_SIZES", skip)
        said.clear()
        p = plan(model, cluster, global_batch=G, progress=said.append)
        plans.append({k: v for k, v in p.to_json().items() if k != "planner_time_s"})
    return plans, said
