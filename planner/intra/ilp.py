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
Strategies another strategy of the same node dominates get no variable
(`planner.intra.dominance`: exact, the optimum of every budget is kept).
Solved with HiGHS when `highspy` is installed, CBC otherwise; a time limit returns the best
solution found with a warning. HiGHS first solves the LP relaxation (s[v, i] in [0, 1]): on
these programs its optimum is nearly always integral, and then it is the program's optimum
(`ILPModel`); otherwise the branch-and-bound stops within a relative gap of 1e-7. Ties: the
objective carries a tiny preference for lower strategy indices (`TIE`), below the solvers'
tolerances, so `settle` breaks ties after the solve, the same way on every route: least memory,
then lowest index.

`ILPModel` builds the program once (its columns and rows, no solver objects) and solves it under
any budget: only the memory row changes, so the solves of a memory ladder share the build. HiGHS
gets it as arrays (`planner.intra.highs`); CBC through pulp (`ILPModel.pulp_problem`, which
`planner.intra.pulp_route._BulkHiGHS` can also hand to HiGHS: the same arrays, tested).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import dataclass, field

import numpy as np
import pulp

from cost_models.errors import MeshplanError, gib
from planner.intra import branching, dominance, highs
from planner.intra.highs import solves_overlap
from planner.intra.pulp_route import _solver, _solver_name, _variable_factory

__all__ = [
    "ILPModel",
    "ILPProblem",
    "ILPSolution",
    "SolveTimeLimitError",
    "brute_force",
    "min_memory",
    "solve",
    "solves_overlap",
]


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


class SolveTimeLimitError(MeshplanError):
    """HiGHS reached its time limit before any solution of the program."""


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
    """The program of one `ILPProblem`, built once and solved under any memory budget (the
    problem's own `memory_budget` is ignored: `solve` takes the budget). The memory row is the
    program's last row, replaced for each budget, so a memory ladder builds the program once.

    The program is held as columns (the binaries first, in the order of the nodes and their
    strategies, then the edge variables; each labelled by its numbers, `names` made from them
    only for pulp), objective coefficients and equality rows (as arrays, a block of rows per
    node and per edge side), each coefficient summed from the same terms in the same order as
    a term-by-term pulp build (``prob += lpSum(terms)``) would. `pulp_problem` makes that pulp
    model (for CBC); HiGHS gets the same program as arrays (`planner.intra.highs.highs_arrays`,
    columns in pulp's order by name: `_name_order`), without a pulp object per variable and
    without a Python step per variable or row. `keep[v]` are the strategies of node v that get a variable (original indices;
    names and tie-breaks keep the original indices too; default: all), and `solve` returns
    original indices.

    How `solve` runs HiGHS: first the LP relaxation of this program
    (`planner.intra.highs.solve_relaxation`); when its optimum is integral in the binaries, no
    integral choice can beat it and it is the optimum. Otherwise (on these programs mostly
    when the memory row binds) a branch-and-bound solves `pruned`: with `prune` (the default)
    the program of the strategies `planner.intra.dominance.undominated` keeps, built then, else
    this one. It is `planner.intra.branching`'s, which splits one node's strategies at a time,
    where the relaxation was solved; HiGHS's own where it was not (its time limit) or with
    `msg` (HiGHS's log). CBC always gets `pruned`. `settle` then breaks ties the same way on
    every route.
    """

    def __init__(
        self,
        problem: ILPProblem,
        *,
        prune: bool = True,
        keep: list[np.ndarray] | None = None,
    ) -> None:
        self.problem = problem
        self.prune = prune
        self.scale = max(
            [float(np.abs(c).max()) for c in problem.node_costs]
            + [float(np.abs(r).max()) for *_, r in problem.edges]
            + [1e-30]
        )
        self.keep = keep or [np.arange(c.size) for c in problem.node_costs]
        keep = self.keep
        # the binary columns of each node (None: one strategy left, a constant), labelled
        # (v, i): column "s_{v}_{i}" with i the original index
        s: list[np.ndarray | None] = []
        labels_v, labels_i = [], []
        count = 0
        for v, k in enumerate(keep):
            if k.size > 1:
                s.append(np.arange(count, count + k.size))
                labels_v.append(np.full(k.size, v))
                labels_i.append(k)
                count += k.size
            else:
                s.append(None)
        self.s = s
        self.num_binary = count
        # objective coefficient per binary column, then per edge variable column (in chunks)
        binary_coefs = np.zeros(self.num_binary)
        edge_coefs: list[np.ndarray] = []
        # the equality rows, in order, as blocks of rows: (label, columns, coefficients, row
        # lengths, right-hand side); label ("one", v, 1), ("eu", n, rows) or ("ev", n, rows)
        blocks: list[tuple[tuple, np.ndarray, np.ndarray, np.ndarray, float]] = []
        for v, c in enumerate(problem.node_costs):
            if s[v] is not None:
                size = np.array([len(s[v])])
                blocks.append((("one", v, 1), s[v], np.ones(len(s[v])), size, 1.0))
                binary_coefs[s[v]] += _objective_coefs(c, self.scale)[keep[v]]
        # edge variable columns, labelled (n, g, h): column "e_{n}_{g}_{h}"
        labels_n, labels_g, labels_h = [], [], []
        for n, (u, v, r) in enumerate(problem.edges):
            r = r[np.ix_(keep[u], keep[v])] / self.scale
            if not r.any():
                continue
            if s[u] is None or s[v] is None:
                # one side fixed: the edge is linear in the other side (terms added in order,
                # as lpSum accumulates them)
                if s[u] is None and s[v] is not None:
                    binary_coefs[s[v]] += r[0, :]
                elif s[u] is not None:
                    binary_coefs[s[u]] += r[:, 0]
                continue
            # Rows (columns) that are equal give the same cost whichever of them is chosen, so the
            # edge variables range over groups of equal rows g and columns h; their marginals are
            # the sums of the node variables in the group. Exact, and far smaller: a cost usually
            # depends only on the producer's output placement and the consumer's input placement.
            grouped, row_of, col_of = _groups(r.shape, r.tobytes())
            n_g, n_h = grouped.shape
            first = count
            count += n_g * n_h
            e = np.arange(first, count).reshape(n_g, n_h)
            labels_n.append(np.full(n_g * n_h, n))
            labels_g.append(np.repeat(np.arange(n_g), n_h))
            labels_h.append(np.tile(np.arange(n_h), n_g))
            # row g: sum_h e[g, h] - sum_(i in g) s[u, i] = 0; row h likewise
            blocks.append((("eu", n, n_g), *_marginal_rows(e, s[u], row_of), 0.0))
            blocks.append((("ev", n, n_h), *_marginal_rows(e.T, s[v], col_of), 0.0))
            edge_coefs.append(grouped.ravel())
        self.objective = np.concatenate([binary_coefs, *edge_coefs])
        self._blocks = blocks
        self._labels = (
            _cat(labels_v, labels_i),
            _cat(labels_n, labels_g, labels_h),
        )
        # The memory row in MiB: fixed nodes add constants, the others their variables.
        self.memory_row: dict[int, float] = {}
        self.memory_constant = 0.0
        for v, m in enumerate(problem.node_memory or []):
            mib = (m[keep[v]] / 2**20).tolist()
            if s[v] is None:
                self.memory_constant += mib[0]
            else:
                self.memory_row.update((x, a) for x, a in zip(s[v].tolist(), mib) if a)
        self._pulp: pulp.LpProblem | None = None
        self._pulp_vars: list[pulp.LpVariable] = []

    @functools.cached_property
    def pruned(self) -> ILPModel:
        """The program of the strategies no other dominates (`planner.intra.dominance`: the
        optimum of every budget is kept), or this one without `prune`."""
        if not self.prune:
            return self
        keep = dominance.undominated(
            [_objective_coefs(c, self.scale) for c in self.problem.node_costs],
            self.problem.node_memory,
            [(u, v, r / self.scale) for u, v, r in self.problem.edges],
        )
        return ILPModel(self.problem, prune=False, keep=keep)

    @functools.cached_property
    def names(self) -> list[str]:
        """The columns' names: "s_{v}_{i}" (node v's original strategy i), then "e_{n}_{g}_{h}"
        (edge n of the problem, its row group g and column group h)."""
        (v, i), (n, g, h) = self._labels
        return [f"s_{a}_{b}" for a, b in zip(v.tolist(), i.tolist())] + [
            f"e_{a}_{b}_{c}" for a, b, c in zip(n.tolist(), g.tolist(), h.tolist())
        ]

    @functools.cached_property
    def rows(self) -> list[tuple[str, np.ndarray, np.ndarray, float]]:
        """(name, columns, coefficients, right-hand side) of each equality row, in order."""
        out = []
        for (kind, n, count), cols, coefs, lengths, rhs in self._blocks:
            ends = np.cumsum(lengths).tolist()
            for k, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
                name = f"one_{n}" if kind == "one" else f"{kind}_{n}_{k}"
                out.append((name, cols[a:b], coefs[a:b], rhs))
        return out

    @functools.cached_property
    def _arrays(self) -> highs.HighsArrays:
        blocks = self._blocks
        lengths = [b[3] for b in blocks]
        return highs.highs_arrays(
            _name_order(*self._labels),
            self.num_binary,
            self.objective,
            _cat([b[1] for b in blocks]),
            _cat([b[2] for b in blocks], dtype=float),
            _cat(lengths),
            np.repeat([b[4] for b in blocks], [len(x) for x in lengths]).astype(float),
        )

    def highs_arrays(self, budget: float | None) -> highs.HighsArrays:
        """The program under `budget` bytes per device (None: no memory row) as HiGHS takes it:
        the arrays `planner.intra.pulp_route._BulkHiGHS` makes of `pulp_problem(budget)`."""
        limit = self._memory_limit(budget)
        if limit is None:
            return self._arrays
        return self._arrays.with_row(
            list(self.memory_row), list(self.memory_row.values()), -np.inf, limit
        )

    def _memory_limit(self, budget: float | None) -> float | None:
        """The upper bound of the memory row under `budget` bytes per device (None: no row)."""
        if budget is None or self.problem.node_memory is None:
            return None
        # pulp keeps the expression's constant on the left: upper bound -(constant - budget)
        return -(self.memory_constant - budget / 2**20)

    def pulp_problem(self, budget: float | None) -> pulp.LpProblem:
        """The program as a pulp model, with the memory row for `budget` bytes per device last (a
        copy sharing the expressions), or without one when `budget` is None or there is no
        memory. The model without the memory row is built on the first call."""
        if self._pulp is None:
            prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
            new_var = _variable_factory(prob)
            x = [
                new_var(name, cat="Binary")
                if k < self.num_binary
                else new_var(name, lowBound=0)
                for k, name in enumerate(self.names)
            ]
            for name, cols, coefs, rhs in self.rows:
                terms = zip((x[c] for c in cols.tolist()), coefs.tolist())
                row = pulp.LpAffineExpression(dict(terms))
                prob.addConstraint(
                    pulp.LpConstraint(row, pulp.LpConstraintEQ, rhs=rhs or None), name
                )
            prob.setObjective(
                pulp.LpAffineExpression(
                    {x[c]: a for c, a in enumerate(self.objective.tolist()) if a}
                )
            )
            self._pulp, self._pulp_vars = prob, x
        if budget is None or self.problem.node_memory is None:
            return self._pulp
        prob = self._pulp.copy()
        x = self._pulp_vars
        row = pulp.LpAffineExpression(
            {x[c]: a for c, a in self.memory_row.items()}, self.memory_constant
        )
        prob.addConstraint(
            pulp.LpConstraint(row, pulp.LpConstraintLE, rhs=budget / 2**20), "memory"
        )
        return prob

    @functools.cached_property
    def _branching(self) -> tuple[list[np.ndarray], np.ndarray]:
        """`branching.branch_and_bound`'s groups (each node's binary columns, in HiGHS's
        order) and memory (each HiGHS column's coefficient in the memory row, 0 off it)."""
        position = self._arrays.position
        memory = np.zeros(len(position))
        cols = np.array(list(self.memory_row), dtype=np.int64)
        memory[position[cols]] = list(self.memory_row.values())
        return [position[s] for s in self.s if s is not None], memory

    @functools.cached_property
    def _warm(self) -> highs.WarmRelaxation:
        return highs.WarmRelaxation(self._arrays)

    def solve_within(
        self, allowed: dict[int, np.ndarray], *, time_limit: float | None = None
    ) -> ILPSolution | None:
        """The best choice without a memory row when node v may take only the strategies
        ``allowed[v]`` (original indices; every strategy of the nodes not given), found on this
        program's LP relaxation with the other strategies' binaries fixed at 0
        (`planner.intra.highs.WarmRelaxation`: warm from this program's last such solve). When
        that relaxation's optimum is integral no integral choice beats it, and `settle` breaks
        its ties among the allowed strategies. None when it is fractional (or not solved): the
        caller then solves the program of the allowed strategies alone."""
        problem, masks, zero = self.problem, {}, []
        for v, ok in allowed.items():
            mask = np.zeros(problem.node_costs[v].size, dtype=bool)
            mask[ok] = True
            masks[v] = mask
            kept = mask[self.keep[v]]
            if not kept.any():
                return None
            if self.s[v] is not None:
                zero.append(self.s[v][~kept])
        state, values = self._warm.solve(
            np.concatenate(zero) if zero else highs.NO_COLUMNS, time_limit=time_limit
        )
        if state != "optimal" or not highs.integral(values[self._arrays.integer]):
            return None
        choice = self._settled(np.round(values[self._arrays.binaries]), masks)
        return ILPSolution(
            choice, problem.objective(choice), problem.memory(choice), True
        )

    def _settled(
        self, binaries: np.ndarray, allowed: dict[int, np.ndarray] | None = None
    ) -> list[int]:
        """Every node's original strategy from the values of this program's binary columns,
        its ties broken by `settle`."""
        choice = [
            int(k[0 if cols is None else np.argmax(binaries[cols])])
            for k, cols in zip(self.keep, self.s)
        ]
        return settle(self.problem, choice, SETTLE_TOL * self.scale, allowed)

    def solve(
        self,
        budget: float | None,
        *,
        time_limit: float | None = None,
        msg: bool = False,
        solver: str | None = None,
        via_pulp: bool = False,
        gap: float = highs.GAP_REL,
    ) -> ILPSolution:
        """The best choice within `budget` bytes per device (None: no memory row). Raises
        MeshplanError if no choice fits. `via_pulp` hands HiGHS the pulp model (`_BulkHiGHS`)
        instead of the arrays: the same program, a slower route (for tests). `gap`: the relative
        gap at which the branch-and-bound stops (the relaxation, when integral, is exact)."""
        problem = self.problem
        _check_fits(problem, budget)
        name = _solver_name(solver)
        model = self
        if name == "highs" and not via_pulp:
            if budget is None and not msg:  # seeds of this program start from its basis
                state, values = self._warm.solve(time_limit=time_limit)
            else:
                state, values = highs.solve_relaxation(
                    self.highs_arrays(budget), time_limit=time_limit, msg=msg
                )
            if state == "optimal" and highs.integral(values[self._arrays.integer]):
                binaries = np.round(values[self._arrays.binaries])
            elif state == "infeasible":  # no integral choice fits either
                binaries = None
            else:
                model = self.pruned
                if state == "optimal" and not msg:
                    state, values = branching.branch_and_bound(
                        model.highs_arrays(budget),
                        *model._branching,
                        model._memory_limit(budget),
                        gap=gap,
                        time_limit=time_limit,
                    )
                else:
                    state, values = highs.run_highs(
                        model.highs_arrays(budget),
                        time_limit=time_limit,
                        msg=msg,
                        gap=gap,
                    )
                if state == "timeout":
                    raise SolveTimeLimitError(
                        "HiGHS found no solution of the intra-op program within its time "
                        f"limit ({time_limit:g} s)"
                    )
                if state == "failed":
                    raise MeshplanError(
                        "HiGHS found no solution of the intra-op program"
                    )
                binaries = None if values is None else values[model._arrays.binaries]
        else:
            model = self.pruned
            prob = model.pulp_problem(budget)
            status = prob.solve(_solver(time_limit, msg, name))
            state = {
                "Optimal": "optimal"
                if prob.sol_status == pulp.LpSolutionOptimal
                else "stopped",
                "Infeasible": "infeasible",
            }.get(pulp.LpStatus[status], "failed")
            if state == "failed":
                raise MeshplanError(
                    f"the ILP solver found no solution ({pulp.LpStatus[status]})"
                )
            binaries = np.array(
                [model._pulp_vars[c].value() or 0 for c in range(model.num_binary)]
            )
        if state == "infeasible":
            raise MeshplanError(
                f"no sharding fits in memory: budget {budget / 2**30:.2f} GiB per device is below what any "
                f"consistent choice needs (at least {min_memory(problem) / 2**30:.2f} GiB)"
            )
        choice = model._settled(binaries)
        optimal = state == "optimal"
        if not optimal:
            warnings.warn(
                f"intra-op ILP stopped at its time limit ({time_limit} s): returning the best solution found"
            )
        return ILPSolution(
            choice, problem.objective(choice), problem.memory(choice), optimal
        )


def _cat(*parts: list[np.ndarray], dtype: type = np.int64) -> np.ndarray | tuple:
    """Each list of arrays concatenated (empty: an empty array of `dtype`); one array for one list."""
    out = tuple(np.concatenate(p) if p else np.zeros(0, dtype=dtype) for p in parts)
    return out[0] if len(out) == 1 else out


def _marginal_rows(
    e: np.ndarray, members: np.ndarray, group_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows g of an edge's marginals as (columns, coefficients, row lengths), concatenated: row
    g holds the edge variables e[g, :] (coefficient 1), then the node variables ``members[i]``
    of the strategies i of group g (``group_of[i] == g``, ascending; coefficient -1)."""
    n_g, width = e.shape
    count = np.bincount(group_of, minlength=n_g)
    lengths = width + count
    starts = np.cumsum(lengths) - lengths
    cols = np.empty(int(lengths.sum()), dtype=np.int64)
    coefs = np.empty(len(cols))
    at = (starts[:, None] + np.arange(width)).ravel()
    cols[at], coefs[at] = e.ravel(), 1.0
    order = np.argsort(group_of, kind="stable")
    g = group_of[order]
    at = starts[g] + width + np.arange(len(order)) - (np.cumsum(count) - count)[g]
    cols[at], coefs[at] = members[order], -1.0
    return cols, coefs, lengths


@functools.lru_cache(maxsize=8)
def _digit_ranks(size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank of str(x) + "_", rank of str(x)) among x = 0..size-1, in string order."""
    out = []
    for suffix in ("_", ""):
        order = sorted(range(size), key=lambda x: f"{x}{suffix}")
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.arange(size)
        out.append(rank)
    return out[0], out[1]


def _name_order(
    binaries: tuple[np.ndarray, np.ndarray],
    edges: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """The columns in order of their names (`ILPModel.names`, the order pulp sorts variables
    in), from their labels, without making the names: "e_..." before "s_...", and names whose
    numbers end in "_" compare number by number as decimal strings, where a number followed by
    "_" sorts after any longer one it begins (the digits come before "_")."""
    (v, i), (n, g, h) = binaries, edges
    top = max([1, *(int(x.max()) + 1 for x in (v, i, n, g, h) if x.size)])
    mid, last = _digit_ranks(1 << (top - 1).bit_length())
    by_edge = np.lexsort((last[h], mid[g], mid[n]))
    by_binary = np.lexsort((last[i], mid[v]))
    return np.concatenate([len(v) + by_edge, by_binary])


@functools.lru_cache(maxsize=4096)
def _groups(
    shape: tuple[int, int], data: bytes
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grouped costs, row group of each row, column group of each column) of the edge cost
    matrix `data` (float64 bytes of `shape`): its distinct rows, then their distinct columns.
    Cached by content: the programs of one stage (time-optimal, seeds) share most edges."""
    r = np.frombuffer(data).reshape(shape)
    row_of, distinct = _distinct_rows(r)
    col_of, grouped = _distinct_rows(distinct.T)
    return grouped.T, row_of, col_of


def _distinct_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's group, the distinct rows in ascending lexicographic order): what
    ``np.unique(a, axis=0, return_inverse=True)`` returns (reversed), for rows of numbers that
    are not NaN. Why not that: it sorts the rows as records of one field per column, which took
    3.5% of mixtral-8x7b's planning CPU; a lexicographic argsort of the columns is 5 times
    faster on these matrices."""
    n = a.shape[0]
    order = np.lexsort(a.T[::-1])  # by the first column, then the second, ...
    ranked = a[order]
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.any(ranked[1:] != ranked[:-1], axis=1, out=new[1:])
    group = np.empty(n, dtype=np.intp)
    group[order] = np.cumsum(new) - 1
    return group, ranked[new]


#: Local costs within this much (relative to the largest cost) count as tied in `settle`: far
#: below any difference of prices, above the rounding of sums of a few of them.
SETTLE_TOL = 1e-12


def settle(
    problem: ILPProblem,
    choice: list[int],
    tol: float,
    allowed: dict[int, np.ndarray] | None = None,
) -> list[int]:
    """The same optimum with ties broken the same way whatever the solver's path: each node in
    turn takes, among its strategies whose local cost (its own plus its edges' under the
    neighbours' current choices) is within `tol` of its current one's, the one of least memory,
    then of lowest index, never more memory than it had; repeated until nothing changes.

    Why: the relaxation's optimal vertex (`planner.intra.highs.run_highs`) is one of several when
    strategies tie (copies that pruning removes in one program and keeps in another, or a view
    whose output may be replicated or split at the same price), and the tie-break in the
    objective (`TIE`) lies below the solvers' tolerances. A change keeps the objective (within
    `tol`) and lowers (memory, index) at one node, so the passes end, and the budget still holds.
    `allowed[v]` (a mask over node v's strategies) limits node v's moves to those."""
    choice = list(choice)
    n = len(problem.node_costs)
    memory = problem.node_memory or [np.zeros(c.size) for c in problem.node_costs]
    incident: list[list[tuple[np.ndarray, int, bool]]] = [[] for _ in range(n)]
    for u, v, r in problem.edges:
        incident[u].append((r, v, True))
        incident[v].append((r, u, False))
    changed = True
    while changed:
        changed = False
        for v in range(n):
            c = problem.node_costs[v]
            if c.size == 1:
                continue
            local = c.copy()
            for r, w, out in incident[v]:
                local += r[:, choice[w]] if out else r[choice[w]]
            cur, m = choice[v], memory[v]
            ok = (local <= local[cur] + tol) & (m <= m[cur])
            if allowed is not None and v in allowed:
                ok &= allowed[v]
            tied = np.flatnonzero(ok)
            best = int(tied[np.lexsort((tied, m[tied]))[0]])
            if best != cur and (m[best], best) < (m[cur], cur):
                choice[v] = best
                changed = True
    return choice


#: Relative tie-break towards lower strategy indices, added to each node's objective coefficients.
#: A preference, not a guarantee: it lies below HiGHS's tolerances (1e-7 on reduced costs), so
#: HiGHS may return any of several tied optima; it returns the same one for the same program
#: (one thread, a fixed seed).
TIE = 1e-9


def _objective_coefs(c: np.ndarray, scale: float) -> np.ndarray:
    """A node's objective coefficients in the model: its costs over `scale`, plus the tie-break."""
    return c / scale + TIE * np.arange(c.size)


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
