"""The intra-op ILP against brute-force enumeration."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.errors import MeshplanError
from planner.intra import ilp
from planner.intra.ilp import ILPModel, ILPProblem, brute_force, solve
from planner.intra.pulp_route import _BulkHiGHS


def _random_problem(rng: np.random.Generator, with_memory: bool) -> ILPProblem:
    n = int(rng.integers(2, 6))
    k = [int(rng.integers(2, 5)) for _ in range(n)]
    costs = [rng.uniform(0, 10, size=kv) for kv in k]
    edges = []
    for v in range(1, n):  # a random DAG: each node has 1-2 earlier producers
        for u in sorted(set(rng.integers(0, v, size=int(rng.integers(1, 3))).tolist())):
            r = rng.uniform(0, 10, size=(k[u], k[v])) * (
                rng.uniform(size=(k[u], k[v])) < 0.7
            )
            edges.append((u, v, r))
    memory = [rng.uniform(1, 100, size=kv) for kv in k] if with_memory else None
    budget = None
    if with_memory:
        lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
        budget = float(lo + rng.uniform(0.1, 0.9) * (hi - lo))
    return ILPProblem(costs, edges, memory, budget)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("with_memory", [False, True])
def test_ilp_matches_brute_force_on_random_graphs(
    with_memory: bool, solver: str
) -> None:
    rng = np.random.default_rng(1234 + with_memory)
    for _ in range(25):
        p = _random_problem(rng, with_memory)
        got, want = solve(p, solver=solver), brute_force(p)
        assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
        if with_memory:
            assert got.memory <= p.memory_budget + 1e-6


def test_same_input_same_choice() -> None:
    """Three tied optima (both nodes choose alike): the same one every time."""
    p = ILPProblem([np.zeros(3), np.zeros(3)], [(0, 1, np.ones((3, 3)) - np.eye(3))])
    first = solve(p).choice
    assert first[0] == first[1]
    assert all(solve(p).choice == first for _ in range(3))


def test_memory_constraint_changes_the_answer() -> None:
    # Strategy 0 is fast but big, strategy 1 slow but small.
    p = ILPProblem(
        [np.array([1.0, 5.0])] * 2,
        node_memory=[np.array([10.0, 2.0])] * 2,
        memory_budget=12.0,
    )
    assert solve(p).choice in ([0, 1], [1, 0])
    p.memory_budget = 1000.0
    assert solve(p).choice == [0, 0]


def test_infeasible_budget_names_bytes() -> None:
    p = ILPProblem(
        [np.array([1.0, 5.0])],
        node_memory=[np.array([3 * 2**30, 2 * 2**30])],
        memory_budget=2**30,
    )
    with pytest.raises(
        MeshplanError, match=r"at least 2\.0 GiB per device, 1\.0 GiB available"
    ):
        solve(p)


def test_unknown_solver() -> None:
    with pytest.raises(MeshplanError, match="expected one of highs, cbc"):
        solve(ILPProblem([np.zeros(2)]), solver="gurobi")


def test_bad_edge_shape() -> None:
    with pytest.raises(MeshplanError, match="expected"):
        ILPProblem([np.zeros(2), np.zeros(3)], [(0, 1, np.zeros((3, 2)))])


def test_one_model_solved_under_a_ladder_of_budgets_matches_brute_force() -> None:
    """`ILPModel` swaps only its memory row between solves: every budget, in any order
    (tighter, looser, none, tighter again), gives the brute-force optimum of that budget."""
    rng = np.random.default_rng(99)
    for _ in range(15):
        p = _random_problem(rng, with_memory=True)
        model = ILPModel(p)
        lo = sum(float(m.min()) for m in p.node_memory)
        hi = sum(float(m.max()) for m in p.node_memory)
        for budget in (None, lo + 0.8 * (hi - lo), lo + 0.2 * (hi - lo), None, lo):
            got = model.solve(budget)
            want = brute_force(ILPProblem(p.node_costs, p.edges, p.node_memory, budget))
            assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
            if budget is not None:
                assert got.memory <= budget + 1e-6
        with pytest.raises(MeshplanError, match="no sharding fits"):
            model.solve(0.5 * lo)


def test_bulk_highs_passes_the_model_pulp_would() -> None:
    """`_BulkHiGHS` hands highspy the same columns, bounds, integrality, rows and matrix as
    pulp's own HiGHS interface (one call per column and row)."""
    import highspy  # noqa: F401  (a required dependency: missing must fail, not skip)
    import pulp

    rng = np.random.default_rng(7)
    for _ in range(10):
        p = _random_problem(rng, with_memory=True)
        prob = ILPModel(p).pulp_problem(p.memory_budget)
        assert "memory" in prob.constraints()[-1].name
        lps = []
        for solver in (pulp.HiGHS(msg=False), _BulkHiGHS(msg=False)):
            solver.createAndConfigureSolver(prob)
            solver.buildSolverModel(prob)
            lps.append(prob.solverModel.getLp())
        a, b = lps
        for name in (
            "col_cost_",
            "col_lower_",
            "col_upper_",
            "row_lower_",
            "row_upper_",
        ):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert list(a.integrality_) == list(b.integrality_)
        for name in ("start_", "index_", "value_"):
            assert np.array_equal(
                getattr(a.a_matrix_, name), getattr(b.a_matrix_, name)
            ), name
        assert a.a_matrix_.format_ == b.a_matrix_.format_


def test_relaxation_first_and_branch_and_bound_both_match_brute_force(
    monkeypatch,
) -> None:
    """HiGHS's route (`ILPModel.solve`): the LP relaxation, kept when integral, else the
    branch-and-bound of `planner.intra.branching` on the pruned program. Random programs under
    tight budgets take both routes; every answer is the brute-force optimum."""
    from planner.intra import branching, highs

    calls = {"relaxation": 0, "branch_and_bound": 0}
    relax, tree = highs.solve_relaxation, branching.branch_and_bound

    def counted(name, fn):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return run

    monkeypatch.setattr(highs, "solve_relaxation", counted("relaxation", relax))
    monkeypatch.setattr(
        branching, "branch_and_bound", counted("branch_and_bound", tree)
    )
    rng = np.random.default_rng(4321)
    for _ in range(30):
        p = _random_problem(rng, with_memory=True)
        got = ILPModel(p).solve(p.memory_budget)
        want = brute_force(p)
        assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
        assert got.memory <= p.memory_budget + 1e-6
    assert calls["relaxation"] == 30
    assert 0 < calls["branch_and_bound"] < 30


def test_settle_takes_the_least_memory_then_the_lowest_index_among_ties() -> None:
    """With node 0 on its option 0, node 1's options 0, 1 and 2 tie on local cost (2 = its own
    plus its edge's) and option 3 is dearer (9); of the tied ones option 2 needs least memory.
    Every starting choice among the tied settles on 2, and the objective is unchanged."""
    p = ILPProblem(
        [np.array([1.0, 3.0]), np.array([2.0, 1.0, 1.5, 0.0])],
        [(0, 1, np.array([[0.0, 1.0, 0.5, 9.0], [0.0, 0.0, 0.0, 0.0]]))],
        [np.array([1.0, 1.0]), np.array([4.0, 4.0, 3.0, 1.0])],
    )
    for start in ([0, 0], [0, 1], [0, 2]):
        settled = ilp.settle(p, start, 1e-12)
        assert settled == [0, 2]
        assert p.objective(settled) == pytest.approx(p.objective(start))
    # copies of equal memory: the lowest index
    q = ILPProblem([np.array([1.0, 1.0, 1.0])], [], [np.array([2.0, 1.0, 1.0])])
    assert ilp.settle(q, [2], 1e-12) == [1]
    # never towards more memory, even at a lower cost
    assert ilp.settle(p, [0, 3], 1e-12) == [0, 3]
    # nor to a strategy `allowed` leaves out: of 0 and 1 (2 out), the lowest index
    assert ilp.settle(p, [0, 1], 1e-12, {1: np.array([1, 1, 0, 1], bool)}) == [0, 0]


def _restricted(p: ILPProblem, allowed: dict[int, np.ndarray]) -> ILPProblem:
    keep = [allowed.get(v, np.arange(c.size)) for v, c in enumerate(p.node_costs)]
    return ILPProblem(
        [c[k] for c, k in zip(p.node_costs, keep)],
        [(u, v, r[np.ix_(keep[u], keep[v])]) for u, v, r in p.edges],
    )


def test_solve_within_is_the_optimum_over_the_allowed_strategies() -> None:
    """`ILPModel.solve_within`: one program solved under three random restrictions in turn (its
    relaxation warm from the last solve, the excluded strategies fixed at 0 and freed again),
    then unrestricted, then by `solve`: every answer obeys its restriction and is the
    brute-force optimum of the restricted problem, or None where the relaxation is fractional."""
    rng = np.random.default_rng(77)
    answered = asked = 0
    for _ in range(20):
        p = _random_problem(rng, with_memory=False)
        model = ILPModel(p)
        for turn in range(4):
            allowed = {}
            for v, c in enumerate(p.node_costs):
                if turn < 3 and rng.uniform() < 0.6:
                    size = int(rng.integers(1, c.size))
                    allowed[v] = np.sort(rng.choice(c.size, size=size, replace=False))
            got = model.solve_within(allowed)
            asked += 1
            if got is None:
                continue
            answered += 1
            want = brute_force(_restricted(p, allowed))
            assert all(got.choice[v] in a for v, a in allowed.items())
            assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
        want = brute_force(p).objective
        assert model.solve(None).objective == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert answered >= asked * 3 // 4, (answered, asked)


def test_edge_groups_are_numpys_unique_rows_then_columns() -> None:
    """`_groups` (an edge's distinct rows, then their distinct columns) gives what
    ``np.unique`` along each axis gives: the same groups, in the same order."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        values = rng.choice([0.0, 1.5, 2.25, 3e-6, np.inf], size=rng.integers(1, 6, 2))
        rows = rng.integers(0, values.shape[0], rng.integers(1, 40))
        cols = rng.integers(0, values.shape[1], rng.integers(1, 40))
        r = np.ascontiguousarray(values[rows][:, cols])
        distinct, row_of = np.unique(r, axis=0, return_inverse=True)
        want, col_of = np.unique(distinct, axis=1, return_inverse=True)
        grouped, got_rows, got_cols = ilp._groups.__wrapped__(r.shape, r.tobytes())
        assert np.array_equal(grouped, want)
        assert np.array_equal(got_rows, row_of.ravel())
        assert np.array_equal(got_cols, col_of.ravel())


def _chain(n: int, seed: int = 0) -> ILPProblem:
    """A chain of n nodes with 4 strategies each under a tight memory budget."""
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(0, 10, size=4) for _ in range(n)]
    edges = [(v - 1, v, rng.uniform(0, 10, size=(4, 4))) for v in range(1, n)]
    memory = [rng.uniform(1, 100, size=4) for _ in range(n)]
    lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
    return ILPProblem(costs, edges, memory, float(lo + 0.3 * (hi - lo)))


def test_a_time_limit_that_leaves_no_solution_is_an_error_naming_it() -> None:
    """HiGHS stopped by its time limit before any solution is a "timeout" (not another
    failure), and `ILPModel.solve` raises `SolveTimeLimitError` with the limit; without the
    limit the same model is solved to its optimum."""
    from planner.intra import highs

    p = _chain(40)
    model = ILPModel(p)
    arrays = model.highs_arrays(p.memory_budget)
    assert highs.run_highs(arrays, time_limit=0.0, msg=False) == ("timeout", None)
    with pytest.raises(ilp.SolveTimeLimitError, match=r"time limit \(0 s\)"):
        model.solve(p.memory_budget, time_limit=0.0)
    assert model.solve(p.memory_budget).optimal


def test_a_branch_and_bound_stopped_at_its_time_limit_returns_its_best_with_a_warning(
    monkeypatch,
) -> None:
    """A branch-and-bound that the time limit stopped with a solution in hand (here: the
    relaxation made to fail and HiGHS's answer reported as stopped) returns that solution,
    marked not optimal, with a warning naming the limit."""
    from planner.intra import highs

    p = _chain(6)
    run = highs.run_highs
    monkeypatch.setattr(highs, "solve_relaxation", lambda *a, **kw: ("failed", None))
    monkeypatch.setattr(
        highs, "run_highs", lambda *a, **kw: ("stopped", run(*a, **kw)[1])
    )
    with pytest.warns(UserWarning, match=r"stopped at its time limit \(60.0 s\)"):
        got = ILPModel(p).solve(p.memory_budget, time_limit=60.0)
    assert not got.optimal
    assert got.objective == pytest.approx(brute_force(p).objective, rel=1e-9)
    assert got.memory <= p.memory_budget
