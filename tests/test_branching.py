"""`planner.intra.branching`: the branch-and-bound of programs whose LP relaxation is fractional,
against brute-force enumeration."""

from __future__ import annotations

import numpy as np
import pytest

from planner.intra import branching, highs
from planner.intra.ilp import ILPModel, ILPProblem, brute_force


def _random_problem(rng: np.random.Generator, budget_at: float) -> ILPProblem:
    """A random DAG of 3-6 nodes with 2-5 strategies each, its budget `budget_at` of the way
    from the least memory to the most."""
    n = int(rng.integers(3, 7))
    k = [int(rng.integers(2, 6)) for _ in range(n)]
    costs = [rng.uniform(0, 10, size=kv) for kv in k]
    edges = []
    for v in range(1, n):
        for u in sorted(set(rng.integers(0, v, size=int(rng.integers(1, 3))).tolist())):
            edges.append((u, v, rng.uniform(0, 10, size=(k[u], k[v]))))
    # fast strategies need more memory, as on the real programs
    memory = [100 / (1 + c) + rng.uniform(0, 5, size=c.size) for c in costs]
    lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
    return ILPProblem(costs, edges, memory, float(lo + budget_at * (hi - lo)))


def _counting(monkeypatch) -> dict[str, int]:
    """Counts of `branch_and_bound` calls, of their LPs, and of HiGHS's branch-and-bound."""
    calls = {"trees": 0, "lps": 0, "highs": 0}
    tree, run, run_highs = branching.branch_and_bound, highs._run, highs.run_highs

    def counted_tree(*a, **kw):
        calls["trees"] += 1
        return tree(*a, **kw)

    def counted_run(h):
        calls["lps"] += 1
        return run(h)

    def counted_highs(*a, **kw):
        calls["highs"] += 1
        return run_highs(*a, **kw)

    monkeypatch.setattr(branching, "branch_and_bound", counted_tree)
    monkeypatch.setattr(highs, "_run", counted_run)
    monkeypatch.setattr(highs, "run_highs", counted_highs)
    return calls


@pytest.mark.parametrize("gap", [highs.GAP_REL, 3e-4])
def test_fractional_relaxations_are_branched_to_the_brute_force_optimum(
    monkeypatch, gap
) -> None:
    """Random programs under budgets that bind: where the relaxation is fractional the tree
    finds the brute-force optimum (within `gap`), never over the budget, and HiGHS's own
    branch-and-bound is never run."""
    calls = _counting(monkeypatch)
    rng = np.random.default_rng(2026)
    for _ in range(60):
        p = _random_problem(rng, float(rng.uniform(0.05, 0.6)))
        got, want = ILPModel(p).solve(p.memory_budget, gap=gap), brute_force(p)
        assert got.optimal
        assert got.memory <= p.memory_budget + 1e-6
        assert want.objective <= got.objective <= want.objective * (1 + gap) + 1e-9
    assert calls["trees"] >= 15, calls  # the relaxation was fractional that often
    assert calls["highs"] == 0


def test_a_relaxation_that_mixes_a_large_and_a_small_strategy_is_split_by_memory(
    monkeypatch,
) -> None:
    """Three nodes, each fast and large (cost 1, memory 10) or slow and small (3, 2), costs
    scaled by 1, 1.01 and 1.02, a budget of 23: at most two fast ones fit. The relaxation makes
    nodes 2 and 1 fast and node 0 one eighth fast; split by memory, node 0 slow is the optimum
    (5.03), node 0 fast splits node 1 (slow: 5.05), node 1 fast splits node 2 (slow: 5.07), and
    all three fast needs 30 and is cut off without an LP: 6 LPs, 7 with HiGHS's relaxation
    before the tree."""
    calls = _counting(monkeypatch)
    node = np.array([1.0, 3.0])
    p = ILPProblem(
        [node, node * 1.01, node * 1.02],
        [],
        [np.array([10.0, 2.0])] * 3,
        23.0,
    )
    got = ILPModel(p).solve(p.memory_budget)
    assert got.choice == [1, 0, 0]
    assert got.objective == pytest.approx(brute_force(p).objective)
    assert calls["trees"] == 1
    assert calls["lps"] == 7, calls


def test_without_a_memory_row_the_heaviest_strategy_is_split_off() -> None:
    """A frustrated triangle (each edge costs 0 where its ends differ, 1 where they agree, over
    two strategies): its relaxation is all halves, no strategy spreads memory, so the tree
    splits a node's heaviest strategy off; the optimum is the brute-force one (1: two nodes
    must agree)."""
    agree = np.eye(2)
    p = ILPProblem(
        [np.zeros(2), np.zeros(2), np.zeros(2)],
        [(0, 1, agree), (1, 2, agree), (0, 2, agree)],
    )
    model = ILPModel(p, prune=False)
    arrays = model.highs_arrays(None)
    state, values = highs.solve_relaxation(arrays)
    assert state == "optimal" and not highs.integral(values[arrays.integer])
    state, values = branching.branch_and_bound(
        arrays, *model._branching, None, gap=highs.GAP_REL, time_limit=None
    )
    assert state == "optimal"
    assert float(arrays.cost @ values) * model.scale == pytest.approx(
        brute_force(p).objective, abs=1e-6
    )
    assert model.solve(None).objective == pytest.approx(1.0)


def test_equal_weights_are_split_by_cost_spread_whatever_the_order() -> None:
    """Two groups at halves, no memory to split by: the one whose strategies' costs differ is
    split (its heaviest strategy, the first of the two), in either order of the columns."""
    groups = [np.array([0, 1]), np.array([2, 3])]
    group_of = np.array([0, 0, 1, 1])
    x, memory, cost = np.full(4, 0.5), np.zeros(4), np.array([1.0, 1.0, 0.0, 4.0])
    for fractional in (np.arange(4), np.arange(4)[::-1]):
        children = branching._split(x, fractional, group_of, groups, memory, cost)
        assert children == (frozenset([2]), frozenset([3]))


def test_past_its_node_limit_the_tree_goes_to_highs(monkeypatch) -> None:
    """With node limits of one LP every fractional program goes on to HiGHS's
    branch-and-bound, which still finds the brute-force optimum; presolved exactly where the
    root relaxation split one node (two binaries fractional)."""
    monkeypatch.setattr(branching, "NODE_LIMIT", 1)
    monkeypatch.setattr(branching, "ONE_SPLIT_NODE_LIMIT", 1)
    handed: list[bool] = []
    run_highs = highs.run_highs

    def seen(*a, presolve, **kw):
        handed.append(presolve)
        return run_highs(*a, presolve=presolve, **kw)

    monkeypatch.setattr(highs, "run_highs", seen)
    rng = np.random.default_rng(5)
    split_one = []
    for _ in range(40):
        p = _random_problem(rng, 0.2)
        pruned = ILPModel(p).pruned
        arrays = pruned.highs_arrays(p.memory_budget)
        _, values = highs.solve_relaxation(arrays)
        fractional = int(highs._fractional(values[arrays.integer]).sum())
        before = len(handed)
        got = ILPModel(p).solve(p.memory_budget)
        assert got.objective == pytest.approx(brute_force(p).objective, rel=1e-6)
        assert len(handed) == before + (fractional > 0)
        if fractional:
            split_one.append(fractional <= 2)
            assert handed[-1] == (fractional <= 2)
    assert True in split_one and False in split_one, split_one


def test_a_time_limit_stops_the_tree_with_its_best_or_nothing(monkeypatch) -> None:
    """The time limit, checked before each LP: spent before the first solution, "timeout";
    spent after one, "stopped" with it (within the budget, and no better than the optimum);
    never spent, "optimal". Random fractional programs, each stopped after every number of its
    LPs, until one has stopped with a solution."""
    lps = []
    run = highs._run

    def counted(h):
        lps.append(1)
        return run(h)

    monkeypatch.setattr(highs, "_run", counted)
    rng = np.random.default_rng(11)
    seen = set()
    for _ in range(100):
        p = _random_problem(rng, 0.1)
        model = ILPModel(p).pruned
        arrays = model.highs_arrays(p.memory_budget)
        state, values = highs.solve_relaxation(arrays)
        if highs.integral(values[arrays.integer]):
            continue
        limit = model._memory_limit(p.memory_budget)
        lps.clear()
        tree = branching.branch_and_bound(
            arrays, *model._branching, limit, gap=highs.GAP_REL, time_limit=None
        )
        assert tree[0] == "optimal"
        total, best = len(lps), brute_force(p).objective
        for spent in range(total + 1):
            left = iter([1.0] * spent + [0.0] * (total + 1))
            monkeypatch.setattr(branching, "_left", lambda *a, left=left: next(left))
            state, values = branching.branch_and_bound(
                arrays, *model._branching, limit, gap=highs.GAP_REL, time_limit=1.0
            )
            seen.add(state)
            if state == "timeout":
                assert values is None
                continue
            assert state == ("optimal" if spent == total else "stopped")
            choice = model._settled(values[model._arrays.binaries])
            assert p.memory(choice) <= p.memory_budget + 1e-6
            assert p.objective(choice) >= best - 1e-9
        monkeypatch.undo()
        monkeypatch.setattr(highs, "_run", counted)
        if "stopped" in seen:
            break
    assert seen == {"timeout", "stopped", "optimal"}, seen
