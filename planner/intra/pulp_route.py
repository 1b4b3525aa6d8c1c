"""The pulp route of the intra-op ILP (`planner.intra.ilp`): which solver runs a program
(HiGHS when highspy is installed, else CBC, or the one asked for), the pulp solver object with
the options of the array route, and `_BulkHiGHS`, which hands a pulp model to HiGHS in bulk.
"""

from __future__ import annotations

import functools

import numpy as np
import pulp

from cost_models.errors import MeshplanError
from planner.intra import highs


def _variable_factory(prob: pulp.LpProblem):
    """PuLP >= 3.3 attaches variables to the model (`add_variable`); older PuLP builds them directly."""
    if hasattr(prob, "add_variable"):
        return lambda name, **kw: prob.add_variable(name, **kw)
    return lambda name, **kw: pulp.LpVariable(name, **kw)


SOLVERS = ("highs", "cbc")


def _solver_name(name: str | None) -> str:
    """ "highs" or "cbc": the one asked for (checked), else HiGHS when highspy is installed."""
    if name not in (None, *SOLVERS):
        raise MeshplanError(
            f"unknown ILP solver {name!r}; expected one of {', '.join(SOLVERS)}"
        )
    if name == "highs":
        highs.check_highs()
        return name
    if name is None:
        return "highs" if "HiGHS" in _available_solvers() else "cbc"
    return name


def _solver(time_limit: float | None, msg: bool, name: str) -> pulp.LpSolver:
    """The pulp solver of the pulp route, with the options of the array route."""
    kwargs = {"msg": msg, "timeLimit": time_limit, "gapRel": highs.GAP_REL}
    if name == "highs":
        highs.silence_banner()
        return _BulkHiGHS(**highs.HIGHS_OPTIONS, **kwargs)
    return pulp.PULP_CBC_CMD(threads=1, options=["randomSeed 0"], **kwargs)


@functools.cache
def _available_solvers() -> tuple[str, ...]:
    return tuple(pulp.listSolvers(onlyAvailable=True))


class _BulkHiGHS(pulp.HiGHS):
    """pulp's HiGHS interface, passing the model to highspy in three calls (all columns, their
    integrality, all rows as CSR arrays) instead of one to three calls per column and one per
    row. The model is the same as pulp's own `buildSolverModel` makes: columns in
    `lp.variables()` order with the objective's coefficients and the variables' bounds, rows in
    `lp.constraints` order with their zero coefficients left out."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        # highspy releases the GIL while it solves; let the other planner threads run meanwhile
        with highs.released():
            return super().callSolver(lp)

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
