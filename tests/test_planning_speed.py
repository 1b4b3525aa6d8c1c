"""The planner's fast paths give what the slower ones give: the intra-op program without dominated
strategies (`planner.intra.dominance`) has the brute-force optimum of every budget; the
program handed to HiGHS as arrays is the one pulp's interface builds; node prices shared by the
copies of a repeated block are those each copy is priced at on its own; plans with and without
the pruning agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner import plan, trace
from planner.intra import dominance, ilp
from planner.intra import prices as sc
from planner.intra.ilp import ILPModel, ILPProblem, brute_force
from planner.intra.pulp_route import _BulkHiGHS
from planner.intra.solve import price_stage, solve_stage
from planner.models import build_model


def _problem(rng: np.random.Generator, budget_at: float | None) -> ILPProblem:
    """A random program whose nodes have duplicated and worsened strategies, so that some are
    dominated (a copy of a strategy, or one at least as costly everywhere) and some are not."""
    n = int(rng.integers(2, 5))
    k = [int(rng.integers(2, 4)) for _ in range(n)]
    costs = [rng.uniform(0, 10, size=kv) for kv in k]
    memory = [rng.uniform(1, 100, size=kv) for kv in k]
    edges = [
        (
            u,
            v,
            rng.uniform(0, 10, size=(k[u], k[v]))
            * (rng.uniform(size=(k[u], k[v])) < 0.7),
        )
        for v in range(1, n)
        for u in sorted(set(rng.integers(0, v, size=int(rng.integers(1, 3))).tolist()))
    ]
    # append to every node a worsened copy of its option 0 and an exact copy of its option 1
    extra = {v: [0, 1] for v in range(n)}
    costs = [np.r_[c, c[0] + rng.uniform(0, 1), c[1]] for c in costs]
    memory = [np.r_[m, m[0] + rng.choice([0.0, 5.0]), m[1]] for m in memory]
    grown = []
    for u, v, r in edges:
        r = np.vstack([r, r[extra[u]] + [[rng.uniform(0, 1)], [0.0]]])
        r = np.hstack([r, r[:, extra[v]] + [[rng.uniform(0, 1), 0.0]]])
        grown.append((u, v, r))
    budget = None
    if budget_at is not None:
        lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
        budget = float(lo + budget_at * (hi - lo))
    return ILPProblem(costs, grown, memory, budget)


def _kept(p: ILPProblem) -> list[np.ndarray]:
    """`dominance.undominated` of a program at scale 1."""
    coefs = [ilp._objective_coefs(c, 1.0) for c in p.node_costs]
    return dominance.undominated(coefs, p.node_memory, p.edges)


def test_dominated_rows() -> None:
    x = np.array([[1.0, 2.0], [1.0, 3.0], [0.5, 2.0], [1.0, 2.0], [2.0, 0.0]])
    # row 1 by row 0, row 0 by row 2, row 3 (a copy of row 0) by rows 0 and 2; row 4 stays
    assert dominance._rows_dominated(x).tolist() == [True, True, False, True, False]


def test_goldstein_drops_what_componentwise_keeps() -> None:
    """Option 1 of node 0 costs 5 more than option 0 and saves at most 2 on its edge: neither
    is componentwise below the other, but switching 1 for 0 always gains at least 3."""
    p = ILPProblem(
        [np.array([0.0, 5.0]), np.array([0.0, 0.0])],
        [(0, 1, np.array([[0.0, 2.0], [1.0, 0.0]]))],
        [np.array([1.0, 1.0]), np.array([1.0, 2.0])],
    )
    coefs = ilp._objective_coefs(p.node_costs[0], 1.0)
    edge = [p.edges[0][2]]
    assert not dominance._dominated(coefs, p.node_memory[0], edge).any()
    assert dominance._goldstein_dominated(coefs, p.node_memory[0], edge).tolist() == [
        False,
        True,
    ]
    assert _kept(p)[0].tolist() == [0]
    # with more memory, option 0 no longer dominates
    heavier = [np.array([2.0, 1.0]), p.node_memory[1]]
    assert _kept(ILPProblem(p.node_costs, p.edges, heavier))[0].tolist() == [0, 1]


@pytest.mark.parametrize("budget_at", [None, 0.2, 0.6])
def test_pruned_program_keeps_the_optimum_of_every_budget(budget_at) -> None:
    rng = np.random.default_rng(20 + int((budget_at or 0) * 10))
    dropped = 0
    for _ in range(20):
        p = _problem(rng, budget_at)
        model = ILPModel(p)
        dropped += sum(c.size - k.size for c, k in zip(p.node_costs, model.pruned.keep))
        want = brute_force(p)
        got = model.solve(p.memory_budget)
        assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
        assert got.choice == ILPModel(p, prune=False).solve(p.memory_budget).choice
        if p.memory_budget is not None:
            assert got.memory <= p.memory_budget + 1e-6

    assert dropped > 20  # the copies at least


def test_kept_strategies_are_not_dominated_and_copies_go() -> None:
    c = np.array([1.0, 1.0, 0.5])
    r = np.array([[0.0, 0.5], [0.0, 0.5], [0.0, 2.0]])
    p = ILPProblem([c, np.array([1.0, 0.0])], [(0, 1, r)])
    # node 0: option 1 is option 0 with a higher tie-break; option 2 is cheaper but costs more
    # on the edge towards node 1's option 1, which is cheaper than its option 0 unless node 0
    # takes option 2
    assert [k.tolist() for k in _kept(p)] == [[0, 2], [0, 1]]
    # memory where option 1 is lighter keeps it
    heavy = [np.array([5.0, 1.0, 5.0]), np.zeros(2)]
    assert _kept(ILPProblem(p.node_costs, p.edges, heavy))[0].tolist() == [0, 1, 2]
    # sweeps repeat: once node 1 keeps only option 0, node 0's edge costs are all 0 and its
    # option 2 (the cheapest) dominates the others
    q = ILPProblem([c, np.array([0.0, 1.0])], [(0, 1, r)])
    assert [k.tolist() for k in _kept(q)] == [[2], [0]]


def _same_as_pulps(p: ILPProblem) -> None:
    """`ILPModel.highs_arrays` of `p` equals what `_BulkHiGHS` hands highspy for
    `ILPModel.pulp_problem`, and both routes choose alike."""
    model = ILPModel(p, prune=False)
    prob = model.pulp_problem(p.memory_budget)
    bulk = _BulkHiGHS(msg=False)
    bulk.createAndConfigureSolver(prob)
    bulk.buildSolverModel(prob)
    lp = prob.solverModel.getLp()
    a = model.highs_arrays(p.memory_budget)
    assert np.array_equal(lp.col_cost_, a.cost)
    assert np.array_equal(lp.col_lower_, np.zeros_like(a.cost))
    assert np.array_equal(lp.col_upper_, a.upper)
    assert np.array_equal(lp.row_lower_, a.row_lower)
    assert np.array_equal(lp.row_upper_, a.row_upper)
    assert np.array_equal(lp.a_matrix_.start_, np.r_[a.starts, len(a.index)])
    assert np.array_equal(lp.a_matrix_.index_, a.index)
    assert np.array_equal(lp.a_matrix_.value_, a.value)
    integer = [i for i, t in enumerate(lp.integrality_) if t.value]
    assert integer == a.integer.tolist()
    direct = model.solve(p.memory_budget)
    assert direct.choice == model.solve(p.memory_budget, via_pulp=True).choice


@pytest.mark.parametrize("budget_at", [None, 0.3])
def test_highs_arrays_are_pulps_model(budget_at) -> None:
    """`ILPModel.highs_arrays` equals what `_BulkHiGHS` (checked against pulp's own HiGHS
    interface in test_ilp) hands highspy for `ILPModel.pulp_problem`, and both routes choose
    alike."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        _same_as_pulps(_problem(rng, budget_at))


def test_highs_arrays_order_columns_as_pulp_past_ten() -> None:
    """Columns in pulp's order (by name) where node, strategy, edge and group numbers pass 9
    (``e_10_...`` sorts before ``e_1_...``; `planner.intra.ilp._name_order` makes that order
    without the names), with fixed nodes, dropped strategies and all-zero edges among them."""
    rng = np.random.default_rng(7)
    n = 14
    k = [1, 3] + [int(rng.integers(11, 15)) for _ in range(n - 2)]
    costs = [rng.integers(0, 5, size=kv).astype(float) for kv in k]
    memory = [rng.uniform(1, 9, size=kv) for kv in k]
    edges = [
        (u, v, rng.integers(0, 12, size=(k[u], k[v])) * float(v % 5 != 0))
        for v in range(1, n)
        for u in sorted({v - 1, int(rng.integers(0, v))})
    ]
    lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
    _same_as_pulps(ILPProblem(costs, edges, memory, float(lo + 0.4 * (hi - lo))))


def test_copies_of_a_block_are_priced_as_each_alone() -> None:
    """`PricedStage.values` shares prices between nodes with equal `price_key` (the copies of a
    transformer block): every node's cost, memory and forward time equal its own pricing."""
    model, batch = build_model("llama-tiny", batch=2, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    sol = solve_stage(
        graph, LogicalMesh(cluster, cluster.shape, (2, 2)), num_microbatches=2
    )
    ctx = sol._ctx
    shared = 0
    for n, opt in sol.choice.items():
        i = ctx.options[n].index(opt)
        node = graph.node(n)
        alone = (
            ctx.node_cost(n, opt),
            ctx.node_memory(n, opt),
            sc.forward_time(node, opt, ctx.settings),
        )
        assert ctx.values(n, i, forward=True) == alone
        shared += ctx.rep.get(n, n) != n
    assert shared > 10  # the second block's nodes, priced as the first's


@pytest.mark.slow
def test_plans_with_and_without_pruning_agree(monkeypatch) -> None:
    """A whole plan (every mesh, memory ladder, seeds, stage DP) is the same with the pruned
    programs as with the full ones."""
    kw = {"global_batch": 8, "microbatch_size": [2, 4]}
    fast = plan("llama-tiny", "2x2xA100-80GB", **kw)
    monkeypatch.setattr(
        dominance,
        "undominated",
        lambda coefs, memory, edges: [np.arange(c.size) for c in coefs],
    )
    full = plan("llama-tiny", "2x2xA100-80GB", **kw)
    a, b = fast.to_json(), full.to_json()
    a.pop("planner_time_s"), b.pop("planner_time_s")
    assert a == b


def _sharded_or_fsdp(path: str, o) -> bool:
    """A parameter filter: every weight stored sharded or fully sharded (FSDP)."""
    return o.zero == 3 or any(p.startswith("S") for p in o.strategy.output[0])


def test_held_memory_kept_per_solution_matches_fresh() -> None:
    """What `planner.inter.held_memory` keeps per solution (it is attributed to several layer
    clusterings) gives, clustering after clustering, what a fresh solution gives."""
    from dataclasses import replace

    from planner.inter import held_memory as hm
    from planner.inter.boundaries import layer_of_nodes

    model, batch = build_model("llama-tiny", batch=2, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    mesh = LogicalMesh(cluster, cluster.shape, (2, 2))
    # every weight stored sharded or fully sharded (FSDP): gathered copies to count
    sol = solve_stage(
        graph,
        mesh,
        num_microbatches=2,
        param_filter=_sharded_or_fsdp,
    )
    n = len(graph.ops)
    clusterings = [[(0, n - 1)], [(0, n // 3), (n // 3 + 1, n - 1)], [(0, n - 1)]]
    copies = hm._weight_copies(sol, graph, 2.0)
    assert copies  # the filter's point: some op reads a weight redistributed
    for layers in clusterings:
        layer_of = layer_of_nodes(graph, layers)
        fresh = replace(sol, _derived={})
        assert hm.backward_terms(sol, graph, layer_of) == hm.backward_terms(
            fresh, graph, layer_of
        )
        assert hm.resharded_saves(sol, graph) == hm.resharded_saves(fresh, graph)
        assert fresh._derived  # it keeps them too
    assert hm._weight_copies(sol, graph, 2.0) is copies


def test_value_table_per_class_equals_per_node() -> None:
    """`PricedStage.value_table` looks up one node per class of block copies when each class
    chooses one option (as `solve_stage`'s solutions do) and every node otherwise: both equal
    `values` node by node, and the per-node path is taken where a copy chooses otherwise. The
    classes are made on the first mesh and kept for the graph: on each mesh they are the nodes
    of one `price_key` and representative."""
    model, batch = build_model("llama-tiny", batch=2, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    for shape in ((2, 2), (1, 4)):
        mesh = LogicalMesh(cluster, cluster.shape, shape)
        sol = solve_stage(
            graph, mesh, num_microbatches=2, param_filter=_sharded_or_fsdp
        )
        ctx, index = sol._ctx, sol._chosen()
        # a copy choosing an option priced otherwise than its representative's
        copy, other = next(
            (n, j)
            for n, r in ctx.rep.items()
            if n != r
            for j in range(len(ctx.options[n]))
            if ctx.values(n, j) != ctx.values(n, index[n])
        )
        for chosen in (index, index | {copy: other}):
            names, table = ctx.value_table(chosen)
            assert names == list(chosen)
            alone = [ctx.values(n, i, forward=True) for n, i in chosen.items()]
            assert table.tolist() == [list(v) for v in alone]
        cls, _ = ctx._value_classes(tuple(names))
        keys = [(ctx.price_key(n), ctx.rep.get(n, n)) for n in names]
        first = {}
        for c, k in zip(cls.tolist(), keys):
            assert first.setdefault(c, k) == k  # one key per class
        assert len(set(first.values())) == len(first)  # one class per key


def test_parameter_filters_solved_within_the_free_program_as_alone(monkeypatch) -> None:
    """A filter of parameters alone (the seeds of a model with experts, whose activations stay
    free) is solved on the unfiltered program with the excluded strategies fixed out
    (`planner.intra.solve._within`, its relaxation warm from the time-optimal solve): the same
    optima as the program of the filtered options built and solved alone."""
    from planner.intra.megatron import seed_filters
    from planner.intra.solve import ILPModel

    model, batch = build_model(
        "mixtral:hidden=32,layers=3,heads=2,kv_heads=1,ffn=32,experts=2,seq=16,vocab=64",
        batch=4,
        dtype=torch.float16,
    )
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    mesh = LogicalMesh(cluster, cluster.shape, (2, 2))
    seeds = seed_filters(mesh.shape, True, {2, 4})
    assert len(seeds) >= 3 and not any(s.batch_axes for s in seeds)

    def solutions() -> list:
        pricing = price_stage(graph, mesh, num_microbatches=2)
        solve_stage(graph, mesh, pricing=pricing, num_microbatches=2)
        return [
            solve_stage(
                graph, mesh, pricing=pricing, num_microbatches=2, param_filter=s.params
            )
            for s in seeds
        ]

    within = ILPModel.solve_within
    answered = []

    def counted(self, *a, **kw):
        out = within(self, *a, **kw)
        answered.append(out is not None)
        return out

    monkeypatch.setattr(ILPModel, "solve_within", counted)
    warm = solutions()
    assert len(answered) == len(seeds) and all(answered)
    monkeypatch.setattr(ILPModel, "solve_within", lambda self, *a, **kw: None)
    alone = solutions()
    # the same optima, up to ties below HiGHS's tolerances (an add whose output costs 1e-9 of
    # the stage's time more replicated than partial)
    for a, b in zip(warm, alone):
        assert a.time_s == pytest.approx(b.time_s, rel=1e-6)
        assert a.memory_bytes == pytest.approx(b.memory_bytes, rel=1e-6)
    assert len({tuple(sorted(map(str, s.param_placements.items()))) for s in warm}) > 1


def test_zero2_copies_choose_their_representatives_objects() -> None:
    """`with_zero2` takes each ZeRO-2 option from the node's own option list, so the copies of
    a block choose their representative's object (`held_memory` classes them by identity)."""
    from planner.inter import held_memory as hm
    from planner.intra.solve import with_zero2

    model, batch = build_model("llama-tiny", batch=4, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    mesh = LogicalMesh(cluster, cluster.shape, (2, 2))
    pricing = price_stage(graph, mesh, num_microbatches=2)
    plain = solve_stage(
        graph, mesh, pricing=pricing, num_microbatches=2, batch_axes=(0, 1)
    )
    made = with_zero2(pricing, plain)
    assert made is not None and made.zero_params
    rep = pricing.ctx.rep
    copies = [n for n in made.choice if rep.get(n, n) != n]
    assert any(graph.node(n).op == "param" for n in copies)
    assert all(made.choice[n] is made.choice[rep[n]] for n in copies)
    assert all(o in pricing.ctx.options[n] for n, o in made.choice.items())
    assert hm._classes(made, graph)  # not the per-node fallback


@pytest.mark.parametrize(
    "spec",
    [
        "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32",
        "mixtral:hidden=32,layers=3,heads=2,kv_heads=1,ffn=32,experts=2,seq=16,vocab=64",
        "gpt:hidden=64,layers=3,heads=4,seq=32,vocab=256",
    ],
)
def test_held_memory_per_class_equals_per_node(spec: str, monkeypatch) -> None:
    """`held_memory` prices one node per class of block copies (`_classes`) and gives every
    copy its leader's terms: equal, term for term, to pricing every node, for the time-optimal
    solution, one with weights sharded or FSDP (gathered copies), one under a memory budget and
    one data-parallel on the first axis; a solution whose copies choose otherwise than their
    representative has no classes. The solutions' gradient buckets (looked up per pair of
    options) are those of pricing every edge alone."""
    from dataclasses import replace

    from planner.inter import held_memory as hm

    model, batch = build_model(spec, batch=4, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    mesh = LogicalMesh(cluster, cluster.shape, (2, 2))
    pricing = price_stage(graph, mesh, num_microbatches=2)
    kw = {"num_microbatches": 2, "pricing": pricing}
    fast = solve_stage(graph, mesh, **kw)
    sharded = solve_stage(graph, mesh, param_filter=_sharded_or_fsdp, **kw)
    tight = solve_stage(graph, mesh, memory_budget=0.5 * fast.memory_bytes, **kw)
    data = solve_stage(graph, mesh, batch_axes=(0,), **kw)  # gradient buckets
    assert data.buckets

    def terms(sol) -> tuple:
        fresh = replace(sol, _derived={})
        return (
            hm.backward_terms(fresh, graph),
            hm.resharded_saves(fresh, graph),
            hm._weight_copies(fresh, graph, 2.0),
        )

    for sol in (fast, sharded, tight, data):
        # the gradient buckets, looked up per pair of options (`grad_buckets`' memo, kept
        # with the pricing): those of every edge priced alone
        ctx = sol._ctx
        derived = ctx.param_derived - ctx.fsdp_derived(sol._index)
        edges = ctx.param_grad_edges
        assert sol.buckets == sc.grad_buckets(graph, sol.choice, mesh, derived, edges)
        leaders = hm._classes(sol, graph)
        assert len(set(leaders.values())) < len(leaders)  # copies share a leader
        per_class = terms(sol)
        with monkeypatch.context() as m:
            m.setattr(hm, "_classes", lambda sol, graph: {})
            assert terms(sol) == per_class
    # a copy choosing another option than its representative: no classes
    rep = sharded._ctx.rep
    copy = next(
        n for n, r in rep.items() if n != r and len(sharded._ctx.options[n]) > 1
    )
    other = next(o for o in sharded._ctx.options[copy] if o is not sharded.choice[copy])
    odd = replace(sharded, choice=sharded.choice | {copy: other}, _derived={})
    assert hm._classes(odd, graph) == {}


def test_reshard_plans_kept_per_placements_price_every_size_alike() -> None:
    """`cost_models.resharding.reshard_steps` keeps its steps per (mesh, tensor dims, source,
    target) and prices each tensor's bytes on them: a plan made for one tensor prices another of
    the same dims as a fresh computation does."""
    import itertools

    from cost_models import resharding as rs

    cluster = Cluster.from_spec("2x4xA100-80GB")
    placements = ["R", "P", "S(0)", "S(1)", "S(-1)"]
    for sub, shape in [((1, 4), (2, 2)), ((2, 4), (2, 4)), ((2, 4), (4, 2))]:
        mesh = LogicalMesh(cluster, sub, shape)
        for src, dst in itertools.product(
            itertools.product(placements, repeat=2), repeat=2
        ):
            rs._PLANS.clear()
            try:
                rs.reshard_steps(mesh, (8, 64, 4), 2.0, src, dst)  # makes the plan
            except Exception as e:  # noqa: BLE001 - the fresh computation must raise alike
                rs._PLANS.clear()
                with pytest.raises(type(e)):
                    rs.reshard_steps(mesh, (16, 32, 2), 4.0, src, dst)
                continue
            kept = rs.reshard_steps(mesh, (16, 32, 2), 4.0, src, dst)
            rs._PLANS.clear()
            fresh = rs.reshard_steps(mesh, (16, 32, 2), 4.0, src, dst)
            assert kept == fresh


def test_stages_priced_from_a_memo_equal_those_priced_alone() -> None:
    """`stage_from_profile` with a memo of each (profile, recompute)'s arrays, shared by the
    stages of two solutions' profiles in every recomputation mode, prices every stage as it is
    priced alone."""
    from planner.inter.boundaries import boundary_values, layer_of_nodes
    from planner.inter.stage_table import profile
    from planner.plans.assemble import stage_from_profile

    model, batch = build_model("llama-tiny", batch=2, dtype=torch.float16)
    graph = trace(model, batch)
    cluster = Cluster.from_spec("1x4xA100-80GB")
    mesh = LogicalMesh(cluster, cluster.shape, (2, 2))
    n = len(graph.ops)
    layers = [(0, n // 3), (n // 3 + 1, 2 * n // 3), (2 * n // 3 + 1, n - 1)]
    layer_of = layer_of_nodes(graph, layers)
    bounds = boundary_values(graph, layer_of, len(layers))
    profiles = [
        profile(
            solve_stage(graph, mesh, num_microbatches=2, **kw),
            graph,
            layer_of,
            bounds,
            len(layers),
        )
        for kw in ({}, {"param_filter": _sharded_or_fsdp})
    ]
    memo: dict = {}
    priced = set()
    for prof in profiles:
        for rc in prof.recompute_modes():
            for r in [(0, 0), (0, 2), (1, 2), (2, 2)]:
                shared = stage_from_profile(r, (1, 4), prof, rc, memo)
                alone = stage_from_profile(r, (1, 4), prof, rc)
                assert (shared.cost, shared.grad_buckets) == (
                    alone.cost,
                    alone.grad_buckets,
                )
                priced.add(alone.cost)
    assert len(memo) == sum(len(p.recompute_modes()) for p in profiles)
    # the stages differ: a memo keyed too coarsely would show
    assert len(priced) > len(memo)
