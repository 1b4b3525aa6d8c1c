"""Meshes where no layer's parameter state fits are not solved (`planner.inter.mesh_search`,
`planner.inter.stage_solves.least_layer_state`), nor is a solution profiled for a clustering
none of whose layers its parameter state fits (`planner.inter.stage_table.least_layer_params`):
the search's stage tables and interleaved options are exactly those of solving and profiling
everything, and the bound is below every solution's."""

from __future__ import annotations

import numpy as np

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.api import plan
from planner.inter import interleave, mesh_search, mesh_shapes, stage_solves
from planner.inter.boundaries import layer_of_nodes
from planner.inter.layers import graph_layerings
from planner.inter.stage_solves import least_layer_state, profiles_for
from planner.intra.fsdp_prices import hybrid_axes, param_state_bytes
from planner.intra.prices import StageSettings, node_options
from planner.tracing.inputs import resolve_model

MODEL = "gpt:hidden=256,layers=4,heads=4,seq=64,vocab=256"
CLUSTER = "4x4xA100-80GB"
# between the least layer state on 2 devices (6.3 MB) and on 4 (3.2 MB; the whole model's on
# 16: 3.3 MB): the 1- and 2-device submeshes are left out, the others fit
BUDGET = 5e6


def _search(monkeypatch, prune: bool) -> tuple[list, list, list, list]:
    """(every stage DP cost table, the interleaved options, the bounds computed, the solutions
    left unprofiled for a clustering) of one plan; `prune` False: every mesh solved, every
    solution profiled for every clustering."""
    tables, inter, bounds, unprofiled = [], [], [], []
    fits_nowhere = mesh_search._fits_nowhere

    def bound(graph, mesh, maps, optimizer):
        least = least_layer_state(graph, mesh, maps, optimizer)
        bounds.append((mesh.submesh, least))
        return least if prune else 0.0

    def nowhere(prof, layering, budget):
        skip = fits_nowhere(prof, layering, budget)
        unprofiled.extend([prof] if skip else [])
        return skip and prune

    def dp(cost, *args, **kw):
        tables.append(cost.copy())
        return stage_dp(cost, *args, **kw)

    class Kept(interleave.InterleavedSearch):
        def best(self):
            picks = super().best()
            inter.extend(
                (p.seconds, p.chunks, p.submesh, p.virtual_stages, p.option.recompute)
                for p in picks
            )
            return picks

    stage_dp = mesh_search.stage_dp
    with monkeypatch.context() as m:
        m.setattr(stage_solves, "least_layer_state", bound)
        m.setattr(mesh_search, "_fits_nowhere", nowhere)
        m.setattr(mesh_search, "stage_dp", dp)
        m.setattr(mesh_search, "InterleavedSearch", Kept)
        plan(MODEL, CLUSTER, global_batch=32, microbatch_size=[4], memory_budget=BUDGET)
    return tables, inter, bounds, unprofiled


def test_skipped_meshes_and_profiles_change_nothing(monkeypatch) -> None:
    """Ground truth: the same search solving every mesh and profiling every solution for every
    clustering."""
    pruned, inter_pruned, bounds, unprofiled = _search(monkeypatch, prune=True)
    every, inter_every, _, _ = _search(monkeypatch, prune=False)
    skipped = {sub for sub, least in bounds if least > BUDGET}
    assert skipped == {(1, 1), (1, 2)}
    # the coarser clusterings' layers hold too much on 4 devices
    assert unprofiled
    assert len(pruned) == len(every) > 0
    for a, b in zip(pruned, every):
        np.testing.assert_array_equal(a, b)
    assert inter_pruned == inter_every and inter_every
    # the skipped submeshes' entries: none fits when they are solved either
    subs = mesh_shapes.submesh_shapes(Cluster.from_spec(CLUSTER))
    for table in every:
        for sub in skipped:
            assert np.isinf(table[:, :, subs.index(sub), :]).all()


def test_bound_is_below_every_solution() -> None:
    """Every layer of every solution (time-optimal, memory ladder, seeds) holds at least the
    bound's parameter state, on every mesh, for each clustering."""
    cluster = Cluster.from_spec(CLUSTER)
    _, make, _ = resolve_model(MODEL, None, None, None)
    graph = make.trace(4)
    layerings = graph_layerings(graph, None, cluster.num_devices)
    maps = [layer_of_nodes(graph, layers) for layers in layerings]
    for layers, layer_of in zip(layerings, maps):
        for sub, shape in (((1, 2), (1, 2)), ((1, 4), (2, 2)), ((2, 4), (2, 4))):
            mesh = LogicalMesh(cluster, sub, shape)
            least = least_layer_state(graph, mesh, [layer_of], "adam_mixed")
            assert least == _least_by_hand(graph, mesh, layer_of)
            assert least_layer_state(graph, mesh, maps, "adam_mixed") == min(
                _least_by_hand(graph, mesh, m) for m in maps
            )
            profiles = profiles_for(
                graph,
                mesh,
                layer_of,
                [[] for _ in layers],
                len(layers),
                num_microbatches=8,
                budget=cluster.device.memory_bytes,
                optimizer="adam_mixed",
                seeds=mesh_shapes._seeds(graph, mesh, "auto"),
            )
            assert len(profiles) > 1
            lightest = min(float(p.params.min()) for p in profiles)
            assert least <= lightest * (1 + 1e-12)


def _least_by_hand(graph, mesh: LogicalMesh, layer_of: dict[str, int]) -> float:
    """`least_layer_state` of one clustering, parameter by parameter: each at its lightest
    option, added to its layer's bytes in graph order."""
    settings = StageSettings(mesh, optimizer="adam_mixed")
    per_layer = [0.0] * (max(layer_of.values()) + 1)
    for n in graph.gm.graph.nodes:
        if graph.node(n.name).op != "param":
            continue
        meta = graph.node(n.name).outputs[0]
        options = node_options(n, graph.node(n.name), mesh.shape, hybrid_axes(mesh))
        per_layer[layer_of.get(n.name, 0)] += min(
            param_state_bytes(meta, o, settings) for o in options
        )
    return min(per_layer)
