"""The least iteration time of a size on its meshes (`planner.inter.mesh_bound`): its group
covering is exact against brute force, a unit's bound is below every solution's time for the
layers holding it, and no plan of a size (the automatic plan at that size, every manual grid
configuration) beats the size's bound (`benchmarks.mesh_bound`: over every logical mesh)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from size_plans import plans_without_and_with_skips, size_plan_times

from benchmarks.mesh_bound import size_least
from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.api import microbatch_sizes
from planner.inter import boundaries as bd
from planner.inter.layers import graph_layerings
from planner.inter.mesh_bound import (
    LeastTime,
    covers_with,
    group_bound,
    least_time,
    unit_least_time,
)
from planner.inter.mesh_shapes import logical_shapes, submesh_shapes
from planner.inter.stage_solves import profiles_for
from planner.intra.solve import price_stage
from planner.size_bound import least_iteration_time
from planner.tracing.inputs import resolve_model


def _brute(items: list[tuple[int, float]], layers: int, devices: int) -> float:
    """Every multiset of groups (mesh, layers held) with the devices and layers it needs."""
    best = math.inf

    def walk(start: int, left_devices: int, left_layers: int, worst: float) -> None:
        nonlocal best
        if left_layers <= 0:
            best = min(best, worst)
            return
        for i in range(start, len(items)):
            n, a = items[i]
            if n > left_devices:
                continue
            for k in range(1, left_layers + 1):
                walk(i, left_devices - n, left_layers - k, max(worst, k * a))

    walk(0, devices, layers, 0.0)
    return best


def _instances(seed: int, count: int = 150):
    """Random small coverings: (items (devices, a) per mesh, layers, devices)."""
    rng = random.Random(seed)
    for _ in range(count):
        devices = rng.randint(1, 8)
        items = [
            (rng.choice([1, 2, 3, 4, 8]), round(rng.uniform(0.1, 3.0), 3))
            for _ in range(rng.randint(1, 4))
        ]
        yield items, rng.randint(1, 5), devices


def test_group_bound_is_the_brute_force_optimum() -> None:
    for items, layers, devices in _instances(7):
        want = _brute(items, layers, devices)
        assert group_bound(items, layers, devices) == pytest.approx(want), (
            items,
            layers,
            devices,
        )
    # no mesh fits the devices: no plan
    assert group_bound([(4, 1.0)], 3, 2) == math.inf


def _brute_with(
    items: list[tuple[int, float]], m: int, layers: int, devices: int
) -> float:
    """`_brute` over the multisets with a group on items[m]: that group holds k layers, any
    groups on the other devices the rest."""
    n, a = items[m]
    if n > devices:
        return math.inf
    return min(
        max(k * a, _brute(items, layers - k, devices - n) if k < layers else 0.0)
        for k in range(1, layers + 1)
    )


def test_covers_with_a_mesh_is_the_brute_force_optimum() -> None:
    rng = random.Random(11)
    checked = 0
    for items, layers, devices in _instances(11):
        for m in range(len(items)):
            want = _brute_with(items, m, layers, devices)
            taus = [rng.uniform(0.05, 10.0)]
            if want < math.inf:
                taus += [want, want * (1 - 1e-6), want * (1 + 1e-6)]
                checked += 1
            for tau in taus:
                got = covers_with(items, m, layers, devices, tau)
                assert got == (want <= tau), (items, m, layers, devices, tau, want)
        # every plan has a group on some mesh: the least over the meshes is the size's bound
        assert min(
            _brute_with(items, m, layers, devices) for m in range(len(items))
        ) == pytest.approx(group_bound(items, layers, devices))
    assert checked > 200


def test_a_units_bound_is_below_every_solutions_time_for_its_layers() -> None:
    cluster = Cluster.from_spec("2x2xV100-16GB")
    _, make, _ = resolve_model("gpt-tiny", None, torch.float16, None)
    graph = make.trace(1)
    ops = [n.name for n in graph.ops]
    layers = graph_layerings(graph, None, cluster.num_devices)[0]
    layer_of = {n: k for k, (a, z) in enumerate(layers) for n in ops[a : z + 1]}
    bounds = bd.boundary_values(graph, layer_of, len(layers))
    checked = 0
    for sub, shape in [((1, 2), (1, 2)), ((2, 2), (2, 2)), ((2, 2), (1, 4))]:
        mesh = LogicalMesh(cluster, sub, shape)
        profiles = profiles_for(
            graph,
            mesh,
            layer_of,
            bounds,
            len(layers),
            num_microbatches=8,
            budget=16e9,
            optimizer="adam_mixed",
        )
        ctx = profiles[0].solution._ctx
        lbs = [unit_least_time(graph, ctx, ops[a : z + 1]) for a, z in layers]
        assert min(lbs) > 0
        for p in profiles:
            for lb, t in zip(lbs, p.time):
                assert lb <= t * (1 + 1e-9)
                checked += 1
    assert checked >= 3 * len(layers)


def test_an_ops_costs_are_its_options_values() -> None:
    """`PricedStage.costs`, which `unit_least_time` reads: each option's `values`, one array
    for the copies of a block, and a restricted node's over its kept options."""
    cluster = Cluster.from_spec("1x4xV100-16GB")
    _, make, _ = resolve_model("gpt-tiny", None, torch.float16, None)
    graph = make.trace(2)
    ctx = price_stage(
        graph, LogicalMesh(cluster, (1, 4), (2, 2)), num_microbatches=4
    ).ctx
    by_key: dict[int, object] = {}
    for v in (n.name for n in graph.ops):
        costs = ctx.costs(v)
        assert costs.tolist() == [
            ctx.values(v, i)[0] for i in range(len(ctx.options[v]))
        ]
        assert not costs.flags.writeable
        assert by_key.setdefault(ctx.price_key(v), costs) is costs
    v = next(n.name for n in graph.ops if len(ctx.options[n.name]) > 2)
    kept = ctx.options[v][1::2]
    fewer = ctx.restricted({**ctx.options, v: kept})
    assert fewer.costs(v).tolist() == [
        ctx.costs(v)[i] for i in range(1, len(ctx.options[v]), 2)
    ]


@pytest.mark.parametrize(
    "model,spec,G,suite,sees_more",
    [
        ("gpt-tiny", "2x2xV100-16GB", 8, "gpt", True),
        ("moe-tiny", "1x2xA100-80GB", 32, "moe", False),
    ],
)
@pytest.mark.slow
def test_no_plan_of_a_size_beats_its_mesh_bound(
    model, spec, G, suite, sees_more
) -> None:
    cluster = Cluster.from_spec(spec)
    _, make, _ = resolve_model(model, None, torch.float16, None)
    bounds, one_device, least = {}, {}, {}
    for b in microbatch_sizes(G, cluster):
        graph = make.trace(b)
        least[b] = size_least(graph, cluster, G // b, "adam_mixed")
        least[b][0].exceeds(-math.inf)
        bounds[b] = least[b][0].seconds
        one_device[b] = least_iteration_time(graph, cluster, G // b, G, "adam_mixed")
    times = size_plan_times(model, cluster, G, bounds, suite)
    assert len(times) >= 8
    below = {
        k: (t, bounds[b])
        for k, (b, t, _) in times.items()
        if t < bounds[b] * (1 - 1e-9)
    }
    assert not below, f"faster than their size's mesh bound: {below}"
    # nor than the bound of the plans with a stage on one of its logical meshes
    # (a manual plan's pure data parallelism may use a mesh shape the planner's list has not)
    checked = set()
    for k, (b, t, meshes) in times.items():
        bound, keys = least[b]
        for key in meshes & set(keys):
            assert not bound.exceeds_with(keys.index(key), t * (1 - 1e-9)), (k, key)
            checked.add(k)
    assert {k for k in times if k.startswith("auto")} <= checked and len(checked) >= 8
    # across hosts: communication and pipeline depth, beyond one device's work
    if sees_more:
        assert any(bounds[b] > one_device[b] for b in bounds), (bounds, one_device)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_sizes_the_mesh_bound_gives_up_change_no_plan(monkeypatch, processes) -> None:
    """gpt-tiny on 2x4 A100s: 2 rows (and, serially, 4) are given up before their first mesh,
    on the bound of their meshes (above one device's work over the devices, which rules out
    only 1 row); the plan is the one searching every size gives."""
    monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", processes)
    model, cluster, G = "gpt-tiny", Cluster.from_spec("2x4xA100-80GB"), 16
    plans, said = plans_without_and_with_skips(monkeypatch, model, cluster, G)
    assert plans[0] == plans[1]
    best = plans[1]["estimate"]["iteration_time_s"]
    given_up = {
        int(m.split("micro-batch ")[1].split()[0]): float(
            m.split("under ")[1].split()[0]
        )
        for m in said
        if " given up: none of its plans" in m
    }
    assert 2 in given_up and (processes == "2" or 4 in given_up), said
    # serially, 8 rows is searched after 16 rows' plan: its 2x4 meshes are not solved
    skipped = [m for m in said if "skipped: no plan with a stage on it" in m]
    assert processes == "2" or len(skipped) == 3, said
    _, make, _ = resolve_model(model, None, torch.float16, None)
    for b, least in given_up.items():
        one = least_iteration_time(make.trace(b), cluster, G // b, G, "adam_mixed")
        assert one < best < least


def test_the_bound_prices_meshes_only_while_it_may_exceed() -> None:
    """Adding a mesh only lowers the bound: `exceeds(s)` stops pricing meshes once those priced
    give s or less, and goes on from there when asked a lower s."""
    cluster = Cluster.from_spec("2x4xA100-80GB")
    _, make, _ = resolve_model("gpt-tiny", None, torch.float16, None)
    graph = make.trace(2)
    priced = []

    def prices(mesh: LogicalMesh):
        priced.append(mesh.shape)
        return price_stage(graph, mesh, num_microbatches=8, optimizer="adam_mixed").ctx

    meshes = [
        (m.num_devices, lambda m=m: prices(m))
        for sub in submesh_shapes(cluster)
        for m in (LogicalMesh(cluster, sub, shape) for shape in logical_shapes(sub))
    ]
    layerings = graph_layerings(graph, None, cluster.num_devices)
    full = least_time(graph, layerings, meshes, 8, cluster.num_devices)
    assert len(priced) == len(meshes) > 4
    priced.clear()
    bound = LeastTime(graph, layerings, meshes, 8, cluster.num_devices)
    assert not bound.exceeds(math.inf) and priced == []
    assert not bound.exceeds(1e9) and len(priced) == 1 and bound.seconds <= 1e9
    assert bound.exceeds(full * 0.99) and bound.seconds == full
    assert len(priced) == len(meshes)


def test_a_meshs_bound_prices_other_meshes_only_until_a_cover_is_found() -> None:
    """`exceeds_with(m, s)` gives the answer of every mesh priced (no cover with a group on m
    within s), pricing m first and the others only while no cover is found."""
    cluster = Cluster.from_spec("2x4xA100-80GB")
    _, make, _ = resolve_model("gpt-tiny", None, torch.float16, None)
    graph = make.trace(2)
    cache: dict[tuple, object] = {}
    priced: list[int] = []

    def prices(i: int, mesh: LogicalMesh):
        priced.append(i)
        key = (mesh.submesh, mesh.shape)
        if key not in cache:
            cache[key] = price_stage(
                graph, mesh, num_microbatches=8, optimizer="adam_mixed"
            ).ctx
        return cache[key]

    logical = [
        LogicalMesh(cluster, sub, shape)
        for sub in submesh_shapes(cluster)
        for shape in logical_shapes(sub)
    ]
    meshes = [
        (m.num_devices, lambda i=i, m=m: prices(i, m)) for i, m in enumerate(logical)
    ]
    layerings = graph_layerings(graph, None, cluster.num_devices)
    full = LeastTime(graph, layerings, meshes, 8, cluster.num_devices)
    full.exceeds(-math.inf)
    answers, fewer = {True: 0, False: 0}, 0
    for seconds in [full.seconds * f for f in (0.5, 1.0, 1.2, 2.0, 4.0)]:
        for m in range(len(meshes)):
            want = not any(
                covers_with(
                    it, full.added.index(m), L, cluster.num_devices, seconds / 8
                )
                for it, L in zip(full.items, full.layers)
            )
            priced.clear()
            lazy = LeastTime(graph, layerings, meshes, 8, cluster.num_devices)
            assert lazy.exceeds_with(m, seconds) == want, (m, seconds)
            assert priced[0] == m
            assert not want or len(priced) == len(meshes)
            answers[want] += 1
            fewer += len(priced) < len(meshes)
            # asked again with every mesh priced: the same answer
            lazy.exceeds(-math.inf)
            assert lazy.exceeds_with(m, seconds) == want
            assert lazy.seconds == full.seconds
    assert answers[True] > 5 and answers[False] > 5 and fewer > 5, (answers, fewer)
