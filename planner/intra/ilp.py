"""The intra-operator integer linear program, as a pure function of costs (no torch, no graphs).

Formulation (Alpa, OSDI'22, section 4.2), for nodes v = 1..N with strategies i = 1..k_v:

Variables
    s[v, i] in {0, 1}      node v runs strategy i
    e[u, v, g, h] in [0, 1] for every edge (u, v): u runs a strategy of row group g and v one of
                           column group h, where a row (column) group gathers u's (v's) strategies
                           whose rows (columns) of R are equal; integral once s is, so continuous

Objective
    minimise  sum_v sum_i c[v, i] * s[v, i]  +  sum_(u,v) sum_g sum_h R[u, v, g, h] * e[u, v, g, h]

    c[v, i]: compute + communication + gradient synchronisation of node v under strategy i (seconds)
    R[u, v, i, j]: resharding the value on edge (u, v) from u's output placement under i to the
    input placement v needs under j, forward and backward (seconds)

Constraints
    sum_i s[v, i] = 1                         for every v          (one strategy per node)
    sum_h e[u, v, g, h] = sum_(i in g) s[u, i]   for every edge, g  (edge choice agrees with u)
    sum_g e[u, v, g, h] = sum_(j in h) s[v, j]   for every edge, h  (edge choice agrees with v)
    sum_v sum_i m[v, i] * s[v, i] <= budget                        (per-device memory, bytes)

Edges whose cost matrix is all zero add no variables. Nodes with one strategy are constants.
Solved with HiGHS when `highspy` is installed, CBC otherwise; a time limit returns the best
solution found with a warning. Ties are broken deterministically by a tiny preference for lower
strategy indices, so the same input always gives the same answer.

`ILPModel` builds the pulp model once (one dict per expression rather than term by term) and
solves it under any budget: only the memory row changes, so the solves of a memory ladder share
the build; `_BulkHiGHS` passes the model to highspy as arrays.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pulp

from cost_models.errors import MeshplanError, gib


@dataclass
class ILPProblem:
    """Costs of one intra-op problem. `edges` holds (u, v, R) with R of shape (k_u, k_v)."""

    node_costs: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    node_memory: list[np.ndarray] | None = None
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        self.node_costs = [np.asarray(c, dtype=float) for c in self.node_costs]
        for v, c in enumerate(self.node_costs):
            if c.ndim != 1 or c.size == 0:
                raise MeshplanError(
                    f"node {v} needs at least one strategy cost, got shape {c.shape}"
                )
        if self.node_memory is not None:
            self.node_memory = [np.asarray(m, dtype=float) for m in self.node_memory]
        for u, v, r in self.edges:
            shape = (self.node_costs[u].size, self.node_costs[v].size)
            if np.shape(r) != shape:
                raise MeshplanError(
                    f"edge ({u}, {v}) cost matrix has shape {np.shape(r)}, expected {shape}"
                )

    def objective(self, choice: list[int]) -> float:
        total = sum(float(c[choice[v]]) for v, c in enumerate(self.node_costs))
        return total + sum(float(r[choice[u], choice[v]]) for u, v, r in self.edges)

    def memory(self, choice: list[int]) -> float:
        if self.node_memory is None:
            return 0.0
        return sum(float(m[choice[v]]) for v, m in enumerate(self.node_memory))


@dataclass
class ILPSolution:
    choice: list[int]
    objective: float
    memory: float
    optimal: bool


def min_memory(problem: ILPProblem) -> float:
    """The smallest memory any choice can reach (each node at its cheapest-memory strategy)."""
    return sum(float(m.min()) for m in problem.node_memory or [])


def solve(
    problem: ILPProblem,
    *,
    time_limit: float | None = None,
    msg: bool = False,
    solver: str | None = None,
) -> ILPSolution:
    """Solve the program above. Raises MeshplanError if no choice fits the memory budget.

    `solver`: "highs" or "cbc" (default: HiGHS when `highspy` is installed, CBC otherwise).
    """
    _check_fits(problem, problem.memory_budget)
    return ILPModel(problem).solve(
        problem.memory_budget, time_limit=time_limit, msg=msg, solver=solver
    )


def _check_fits(problem: ILPProblem, budget: float | None) -> None:
    """Raise MeshplanError when even the least-memory choice exceeds `budget` (None: no limit)."""
    if (
        budget is not None
        and problem.node_memory is not None
        and min_memory(problem) > budget
    ):
        raise MeshplanError(
            "no sharding fits in memory: needs at least {} per device, {} available".format(
                *gib(min_memory(problem), budget)
            )
        )


class ILPModel:
    """The program of one `ILPProblem` as a pulp model, built once and solved under any memory
    budget (the problem's own `memory_budget` is ignored: `solve` takes the budget). The memory
    row is the model's last row, replaced for each budget, so a memory ladder builds the model
    once.

    The model is exactly the one a term-by-term build (``prob += lpSum(terms)``) gives: the same
    variables and names (pulp orders the columns by name), the same rows in the same order, and
    every coefficient summed from the same terms in the same order. Only the Python objects made
    along the way are fewer: each expression is one `LpAffineExpression` built from a dict.
    """

    def __init__(self, problem: ILPProblem) -> None:
        self.problem = problem
        prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
        self.scale = max(
            [float(np.abs(c).max()) for c in problem.node_costs]
            + [float(np.abs(r).max()) for *_, r in problem.edges]
            + [1e-30]
        )
        tie = 1e-9  # relative tie-break towards lower strategy indices
        new_var = _variable_factory(prob)
        s = [
            [new_var(f"s_{v}_{i}", cat="Binary") for i in range(c.size)]
            if c.size > 1
            else None
            for v, c in enumerate(problem.node_costs)
        ]
        self.s = s
        objective: dict[pulp.LpVariable, float] = {}

        def add(variables: list[pulp.LpVariable], coefs: np.ndarray) -> None:
            # lpSum skips a zero term (its variable stays out of the objective), and accumulates
            # the rest in order.
            for x, a in zip(variables, coefs.tolist()):
                if a:
                    objective[x] = objective[x] + a if x in objective else a

        eq = pulp.LpConstraintEQ
        for v, c in enumerate(problem.node_costs):
            if s[v] is not None:
                prob.addConstraint(
                    pulp.LpConstraint(
                        pulp.LpAffineExpression(dict.fromkeys(s[v], 1)), eq, rhs=1
                    ),
                    f"one_{v}",
                )
                add(s[v], c / self.scale + tie * np.arange(c.size))
        for n, (u, v, r) in enumerate(problem.edges):
            r = r / self.scale
            if not r.any():
                continue
            if s[u] is None or s[v] is None:
                # one side fixed: the edge is linear in the other side
                if s[u] is None and s[v] is not None:
                    add(s[v], r[0, :])
                elif s[u] is not None:
                    add(s[u], r[:, 0])
                continue
            # Rows (columns) that are equal give the same cost whichever of them is chosen, so the
            # edge variables range over groups of equal rows g and columns h; their marginals are
            # the sums of the node variables in the group. Exact, and far smaller: a cost usually
            # depends only on the producer's output placement and the consumer's input placement.
            rows, row_of = np.unique(r, axis=0, return_inverse=True)
            grouped, col_of = np.unique(rows, axis=1, return_inverse=True)
            row_of, col_of = row_of.ravel(), col_of.ravel()
            n_g, n_h = grouped.shape
            e = [
                [new_var(f"e_{n}_{g}_{h}", lowBound=0) for h in range(n_h)]
                for g in range(n_g)
            ]
            for g in range(n_g):
                row = dict.fromkeys(e[g], 1)
                row.update((s[u][i], -1) for i in np.flatnonzero(row_of == g))
                prob.addConstraint(
                    pulp.LpConstraint(pulp.LpAffineExpression(row), eq), f"eu_{n}_{g}"
                )
            for h in range(n_h):
                col = dict.fromkeys((e[g][h] for g in range(n_g)), 1)
                col.update((s[v][j], -1) for j in np.flatnonzero(col_of == h))
                prob.addConstraint(
                    pulp.LpConstraint(pulp.LpAffineExpression(col), eq), f"ev_{n}_{h}"
                )
            add([x for row in e for x in row], grouped.ravel())
        prob.setObjective(pulp.LpAffineExpression(objective))
        self.prob = prob
        # The memory row in MiB: fixed nodes add constants, the others their variables.
        self.memory_row: dict[pulp.LpVariable, float] = {}
        self.memory_constant = 0.0
        for v, m in enumerate(problem.node_memory or []):
            mib = (m / 2**20).tolist()
            if s[v] is None:
                self.memory_constant += mib[0]
            else:
                self.memory_row.update((x, a) for x, a in zip(s[v], mib) if a)

    def pulp_problem(self, budget: float | None) -> pulp.LpProblem:
        """The model with the memory row for `budget` bytes per device last (a copy sharing the
        expressions), or without one when `budget` is None or there is no memory."""
        if budget is None or self.problem.node_memory is None:
            return self.prob
        prob = self.prob.copy()
        row = pulp.LpAffineExpression(self.memory_row, self.memory_constant)
        prob.addConstraint(
            pulp.LpConstraint(row, pulp.LpConstraintLE, rhs=budget / 2**20), "memory"
        )
        return prob

    def solve(
        self,
        budget: float | None,
        *,
        time_limit: float | None = None,
        msg: bool = False,
        solver: str | None = None,
    ) -> ILPSolution:
        """The best choice within `budget` bytes per device (None: no memory row). Raises
        MeshplanError if no choice fits."""
        problem, s = self.problem, self.s
        _check_fits(problem, budget)
        prob = self.pulp_problem(budget)
        status = prob.solve(_solver(time_limit, msg, solver))
        state = pulp.LpStatus[status]
        if state == "Infeasible":
            raise MeshplanError(
                f"no sharding fits in memory: budget {budget / 2**30:.2f} GiB per device is below what any "
                f"consistent choice needs (at least {min_memory(problem) / 2**30:.2f} GiB)"
            )
        choice = [
            0 if s[v] is None else int(np.argmax([x.value() or 0 for x in s[v]]))
            for v in range(len(s))
        ]
        optimal = state == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal
        if not optimal:
            warnings.warn(
                f"intra-op ILP stopped at its time limit ({time_limit} s): returning the best solution found"
            )
        return ILPSolution(
            choice, problem.objective(choice), problem.memory(choice), optimal
        )


def _variable_factory(prob: pulp.LpProblem):
    """PuLP >= 3.3 attaches variables to the model (`add_variable`); older PuLP builds them directly."""
    if hasattr(prob, "add_variable"):
        return lambda name, **kw: prob.add_variable(name, **kw)
    return lambda name, **kw: pulp.LpVariable(name, **kw)


SOLVERS = ("highs", "cbc")


def _solver(time_limit: float | None, msg: bool, name: str | None) -> pulp.LpSolver:
    kwargs = {"msg": msg, "timeLimit": time_limit, "gapRel": 1e-7}
    has_highs = "HiGHS" in _available_solvers()
    if name not in (None, *SOLVERS):
        raise MeshplanError(
            f"unknown ILP solver {name!r}; expected one of {', '.join(SOLVERS)}"
        )
    if name == "highs" and not has_highs:
        raise MeshplanError(
            "the HiGHS solver needs the highspy package (pip install highspy)"
        )
    if name == "highs" or (name is None and has_highs):
        with _banner_lock:
            _silence_highs_banner()
        return _BulkHiGHS(threads=1, random_seed=0, **kwargs)
    return pulp.PULP_CBC_CMD(threads=1, options=["randomSeed 0"], **kwargs)


_banner_lock = threading.Lock()


@functools.cache
def _silence_highs_banner() -> None:
    """HiGHS prints its banner ("Running HiGHS ...: Copyright ...") on the process's standard
    output (file descriptor 1, not Python's `sys.stdout`) when the process makes its first `Highs`
    object, whatever the options say (highspy 1.16). Make that first object here, once, with
    descriptor 1 pointed at /dev/null, so that the banner never reaches a user's output."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@functools.cache
def _available_solvers() -> tuple[str, ...]:
    return tuple(pulp.listSolvers(onlyAvailable=True))


_python_lock = threading.Lock()
_holds = threading.local()


@contextmanager
def solves_overlap() -> Iterator[None]:
    """Run the block holding the planner's lock except while HiGHS solves.

    Threads that each run an intra-op pass inside this block overlap one thread's solve with
    another's Python work (pricing, building the program), and their Python work never
    interleaves: it runs as it would on one thread (the strategy enumeration traces DTensor's
    decompositions with torch.fx, which patches module globals while it traces)."""
    _python_lock.acquire()
    _holds.on = True
    try:
        yield
    finally:
        _holds.on = False
        _python_lock.release()


class _BulkHiGHS(pulp.HiGHS):
    """pulp's HiGHS interface, passing the model to highspy in three calls (all columns, their
    integrality, all rows as CSR arrays) instead of one to three calls per column and one per
    row. The model is the same as pulp's own `buildSolverModel` makes: columns in
    `lp.variables()` order with the objective's coefficients and the variables' bounds, rows in
    `lp.constraints` order with their zero coefficients left out."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        # highspy releases the GIL while it solves; let the other planner threads run meanwhile
        if not getattr(_holds, "on", False):
            return super().callSolver(lp)
        _python_lock.release()
        try:
            return super().callSolver(lp)
        finally:
            _python_lock.acquire()

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:
        import highspy

        inf = highspy.kHighsInf
        sign = -1 if lp.sense == pulp.LpMaximize else 1
        variables = lp.variables()
        objective = lp.objective
        cost, lower, upper, integer = [], [], [], []
        for i, var in enumerate(variables):
            var.index = i
            cost.append(sign * objective.get(var, 0.0))
            lower.append(-inf if var.lowBound is None else var.lowBound)
            upper.append(inf if var.upBound is None else var.upBound)
            if var.cat == pulp.LpInteger and self.mip:
                integer.append(i)
        model = lp.solverModel
        model.addCols(
            len(variables),
            np.array(cost, dtype=float),
            np.array(lower, dtype=float),
            np.array(upper, dtype=float),
            0,
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=float),
        )
        if integer:
            model.changeColsIntegrality(
                len(integer),
                np.array(integer, dtype=np.int32),
                np.full(len(integer), highspy.HighsVarType.kInteger.value, np.uint8),
            )
        starts, index, value, row_lower, row_upper = [], [], [], [], []
        for i, constraint in enumerate(lp._constraints.values()):
            constraint.index = i
            starts.append(len(index))
            for var, coefficient in constraint.items():
                if coefficient != 0:
                    index.append(var.index)
                    value.append(coefficient)
            lb, ub = constraint.getLb(), constraint.getUb()
            row_lower.append(-inf if lb is None else lb)
            row_upper.append(inf if ub is None else ub)
        if starts:
            model.addRows(
                len(starts),
                np.array(row_lower, dtype=float),
                np.array(row_upper, dtype=float),
                len(index),
                np.array(starts, dtype=np.int32),
                np.array(index, dtype=np.int32),
                np.array(value, dtype=float),
            )


def brute_force(problem: ILPProblem) -> ILPSolution:
    """Enumerate every choice (for tests on small problems)."""
    best: ILPSolution | None = None
    for choice in itertools.product(*(range(c.size) for c in problem.node_costs)):
        choice = list(choice)
        mem = problem.memory(choice)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        obj = problem.objective(choice)
        if best is None or obj < best.objective - 1e-12:
            best = ILPSolution(choice, obj, mem, True)
    if best is None:
        raise MeshplanError("no choice fits the memory budget")
    return best
