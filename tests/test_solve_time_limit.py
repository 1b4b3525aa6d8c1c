"""The search's safety net on HiGHS's time (`planner.inter.stage_solves.solve_time_limit`): each
run of every intra-op program gets the limit; a time-optimal program that finds no solution
within it stops the plan with an error naming `MESHPLAN_SOLVE_TIME_LIMIT`, a memory rung or
seed that finds none is left out with a warning, and a bad value of the variable (or of the
planner's other settings) is an error before any work."""

from __future__ import annotations

import pytest

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner.api import plan
from planner.inter import mesh_shapes, stage_solves
from planner.inter.boundaries import layer_of_nodes
from planner.inter.layers import graph_layerings
from planner.intra.ilp import SolveTimeLimitError
from planner.tracing.inputs import resolve_model

MODEL = "gpt:hidden=256,layers=4,heads=4,seq=64,vocab=256"
CLUSTER = "4x4xA100-80GB"


def test_the_limit_is_the_default_or_the_variables_seconds(monkeypatch) -> None:
    monkeypatch.delenv("MESHPLAN_SOLVE_TIME_LIMIT", raising=False)
    assert stage_solves.solve_time_limit() == stage_solves.SOLVE_TIME_LIMIT_S
    monkeypatch.setenv("MESHPLAN_SOLVE_TIME_LIMIT", "2.5")
    assert stage_solves.solve_time_limit() == 2.5
    for bad in ("soon", "0", "-3", "inf", "nan", ""):
        monkeypatch.setenv("MESHPLAN_SOLVE_TIME_LIMIT", bad)
        with pytest.raises(MeshplanError, match="must be a positive number of seconds"):
            stage_solves.solve_time_limit()


@pytest.mark.parametrize(
    "name",
    [
        "MESHPLAN_SOLVE_TIME_LIMIT",
        "MESHPLAN_PLANNER_THREADS",
        "MESHPLAN_PLANNER_PROCESSES",
    ],
)
def test_a_bad_setting_is_an_error_before_any_work(monkeypatch, name) -> None:
    """The planner's environment settings are checked before the model is built or traced."""
    import planner.api

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the settings were checked")

    monkeypatch.setattr(planner.api, "resolve_model", built)
    monkeypatch.setenv(name, "soon")
    with pytest.raises(MeshplanError, match=f"{name} must be a positive"):
        plan(MODEL, CLUSTER, global_batch=16)


def test_a_time_optimal_program_without_a_solution_in_time_stops_the_plan(
    monkeypatch,
) -> None:
    """Under a limit no solve can meet, planning stops at the first program with an error
    that names the variable (no hang, no HiGHS status)."""
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", "1")
    monkeypatch.setenv("MESHPLAN_SOLVE_TIME_LIMIT", "1e-9")
    with pytest.raises(
        MeshplanError, match="within its time limit.*MESHPLAN_SOLVE_TIME_LIMIT"
    ):
        plan(MODEL, CLUSTER, global_batch=16, microbatch_size=4)


def _profiles(monkeypatch, fail) -> tuple[list, list]:
    """profiles_for on one mesh, its solves seen (keyword arguments) and those `fail` picks
    raising SolveTimeLimitError."""
    cluster = Cluster.from_spec(CLUSTER)
    _, make, _ = resolve_model(MODEL, None, None, None)
    graph = make.trace(4)
    layers = graph_layerings(graph, None, cluster.num_devices)[0]
    mesh = LogicalMesh(cluster, (1, 4), (2, 2))
    seen = []
    real = stage_solves.solve_stage

    def solve(graph, mesh, **kw):
        seen.append(kw)
        if fail(kw):
            raise SolveTimeLimitError("HiGHS found no solution (test)")
        return real(graph, mesh, **kw)

    monkeypatch.setattr(stage_solves, "solve_stage", solve)
    profiles = stage_solves.profiles_for(
        graph,
        mesh,
        layer_of_nodes(graph, layers),
        [[] for _ in layers],
        len(layers),
        num_microbatches=8,
        budget=8e6,  # tight: the memory ladder runs, the seeds fit
        optimizer="adam_mixed",
        seeds=mesh_shapes._seeds(graph, mesh, "auto"),
    )
    return profiles, seen


def test_every_solve_gets_the_limit_and_a_rung_or_seed_out_of_time_is_left_out(
    monkeypatch,
) -> None:
    monkeypatch.setenv("MESHPLAN_SOLVE_TIME_LIMIT", "7")
    alone, seen = _profiles(monkeypatch, lambda kw: False)
    assert seen and all(kw["time_limit"] == 7.0 for kw in seen)
    rungs = sum(kw.get("memory_budget") is not None for kw in seen)
    seeds = sum(kw.get("param_filter") is not None for kw in seen)
    assert rungs and seeds
    with pytest.warns(UserWarning, match="memory rung .* searched without it"):
        out, tried = _profiles(
            monkeypatch, lambda kw: kw.get("memory_budget") is not None
        )
    # the ladder stops at the rung out of time; the time-optimal solution and seeds remain
    assert sum(kw.get("memory_budget") is not None for kw in tried) == 1
    assert 1 <= len(out) < len(alone)
    with pytest.warns(UserWarning, match="a Megatron seed .* searched without it"):
        out, _ = _profiles(monkeypatch, lambda kw: kw.get("param_filter") is not None)
    assert 1 <= len(out) < len(alone)
