"""The intra-op program handed to HiGHS (highspy) as arrays, and the planner's solver lock.

`HighsArrays` is the program of `planner.intra.ilp.ILPModel` in the form pulp's HiGHS interface
would pass it (`planner.intra.pulp_route._BulkHiGHS` on `ILPModel.pulp_problem`): columns in
pulp's order (sorted by variable name) with the objective's coefficients, bounds and
integrality, then the rows in the order they were added as a CSR matrix without zero
coefficients, the memory row last. It is built from the model's columns and rows without
making a pulp object per variable, so a program of 30,000 edge variables is passed in a few
milliseconds; `tests/test_planning_speed.py` checks the arrays against pulp's. HiGHS then runs
with the options the pulp route sets.

`solves_overlap`: the planner's threads (`planner.inter.mesh_search`) hold one lock for their
Python work and release it only while HiGHS runs (highspy releases the GIL).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from cost_models.errors import MeshplanError
from planner.native_output import fd_silenced

#: Relative optimality gap at which HiGHS stops (both routes).
GAP_REL = 1e-7
#: HiGHS's `presolve_rule_off` bit of probing (rule 15). Probing tentatively fixes each binary
#: and propagates; on these programs (one binary per strategy, tens of thousands of continuous
#: edge variables) it finds almost nothing and took about two thirds of a solve, mostly when the
#: branch-and-bound restarts after fixing columns (llama3-70b on 8x8 H100s, micro-batch 8: the
#: (8, 8) mesh's memory-limited solve took 7.6 s of CPU with it, 0.8 s without). Presolve
#: reductions do not change what is optimal: HiGHS still proves the optimum within `GAP_REL`.
HIGHS_NO_PROBING = 1 << 15
#: Options both routes give HiGHS besides the gap, the time limit and the log. Besides probing,
#: two searches that find nothing on these programs are off: the feasibility-jump heuristic (it ran
#: before the root LP, which is integral on nearly all of them) and symmetry detection (the
#: repeated-block quotient has already merged the symmetric copies). On the 8 largest programs of
#: mixtral-8x7b on 8x8 H100s at micro-batch 16 (2D meshes, 47-58K columns, 2-2.3K binaries) HiGHS
#: took 8.2 s of CPU with both, 4.8 s without, to the same optima, each proved at the root.
HIGHS_OPTIONS = {
    "threads": 1,
    "random_seed": 0,
    "presolve_rule_off": HIGHS_NO_PROBING,
    "mip_heuristic_run_feasibility_jump": False,
    "mip_detect_symmetry": False,
    # Stop on the relative gap (`GAP_REL`) alone: HiGHS's default absolute gap, 1e-6, is looser
    # than it on these programs (objectives are scaled to about 1, `planner.intra.ilp`).
    "mip_abs_gap": 0.0,
}


@dataclass
class HighsArrays:
    """A program as highspy takes it (module docstring). `position[c]`: the HiGHS column of the
    model's column c (pulp's order); `binaries`: the positions of the model's binary columns."""

    cost: np.ndarray
    upper: np.ndarray  # lower bounds are all 0
    integer: np.ndarray  # columns that are integral, ascending
    row_lower: np.ndarray
    row_upper: np.ndarray
    starts: np.ndarray
    index: np.ndarray
    value: np.ndarray
    position: np.ndarray
    binaries: np.ndarray

    def with_row(
        self, columns: list[int], coefs: list[float], lower: float, upper: float
    ) -> HighsArrays:
        """These arrays with one more row (the model's columns, their coefficients, bounds)."""
        kept = [(c, a) for c, a in zip(columns, coefs) if a != 0]
        index = self.position[np.array([c for c, _ in kept], dtype=np.int64)]
        return replace(
            self,
            row_lower=np.append(self.row_lower, lower),
            row_upper=np.append(self.row_upper, upper),
            starts=np.append(self.starts, len(self.index)).astype(np.int32),
            index=np.concatenate([self.index, index.astype(np.int32)]),
            value=np.concatenate([self.value, [a for _, a in kept]]),
        )


def highs_arrays(
    order: np.ndarray,
    num_binary: int,
    objective: np.ndarray,
    cols: np.ndarray,
    coefs: np.ndarray,
    lengths: np.ndarray,
    rhs: np.ndarray,
) -> HighsArrays:
    """The arrays of a program whose columns, in pulp's order (by name), are ``order`` (the
    first `num_binary` columns binary in [0, 1], the others continuous in [0, inf)), with
    `objective` (a coefficient per column) and equality rows given as their concatenated
    `cols` and `coefs`, each row's length (`lengths`) and right-hand side (`rhs`); zero
    coefficients are left out as pulp's interface does."""
    n = len(objective)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    cost = np.zeros(n)
    cost[pos] = objective
    upper = np.full(n, np.inf)
    binaries = pos[:num_binary]
    upper[binaries] = 1.0
    cols = np.asarray(cols, dtype=np.int64)
    coefs = np.asarray(coefs, dtype=float)
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    nonzero = coefs != 0
    counts = np.bincount(row_of[nonzero], minlength=len(lengths))
    rhs = np.asarray(rhs, dtype=float)
    return HighsArrays(
        cost,
        upper,
        np.sort(binaries).astype(np.int32),
        rhs,
        rhs.copy(),
        (np.cumsum(counts) - counts).astype(np.int32),
        pos[cols[nonzero]].astype(np.int32),
        coefs[nonzero],
        pos,
        binaries,
    )


def run_highs(
    arrays: HighsArrays,
    *,
    time_limit: float | None,
    msg: bool,
    gap: float = GAP_REL,
    presolve: bool = True,
) -> tuple[str, np.ndarray | None]:
    """Solve the program with HiGHS's branch-and-bound to the relative gap `gap`, with or without
    presolve: ("optimal" | "stopped" | "timeout" | "infeasible" | "failed",
    column values or None). "stopped": a time limit left a feasible, maybe not optimal,
    solution; "timeout": it left none."""
    if not len(arrays.cost):  # every node has one strategy: nothing to choose
        return "optimal", np.zeros(0)
    import highspy

    h = _highs(arrays, time_limit, msg)
    h.setOptionValue("mip_rel_gap", gap)
    for key, val in HIGHS_OPTIONS.items():
        h.setOptionValue(key, val)
    if not presolve:
        h.setOptionValue("presolve", "off")
    if len(arrays.integer):
        h.changeColsIntegrality(
            len(arrays.integer),
            arrays.integer,
            np.full(len(arrays.integer), highspy.HighsVarType.kInteger.value, np.uint8),
        )
    return _run(h)


#: How far from 0 or 1 a binary of the relaxation's optimum may lie and still count as integral:
#: HiGHS's primal feasibility tolerance (1e-7), the precision the branch-and-bound's integral
#: solutions have too.
INTEGRAL_TOL = 1e-7


def _fractional(x: np.ndarray) -> np.ndarray:
    """Which values of `x` lie farther than `INTEGRAL_TOL` from an integer."""
    return np.abs(x - np.round(x)) > INTEGRAL_TOL


def integral(x: np.ndarray) -> bool:
    """Whether every value of `x` lies within `INTEGRAL_TOL` of an integer."""
    return not _fractional(x).any()


def solve_relaxation(
    arrays: HighsArrays, *, time_limit: float | None = None, msg: bool = False
) -> tuple[str, np.ndarray | None]:
    """The program's LP relaxation (binaries in [0, 1]) by HiGHS's dual simplex, without presolve:
    ("optimal" | "infeasible" | "failed", column values or None). `planner.intra.ilp.ILPModel`
    solves it first: when its optimum is integral in the binaries it is the program's optimum.

    Why without presolve: on these programs (a binary per strategy, tens of
    thousands of continuous edge variables, a few thousand equality rows) the relaxation's optimum
    is nearly always integral, and presolve finds almost nothing to remove while costing several
    times the simplex itself. mixtral-8x7b on 8x8 H100s at 16 and 4 rows per micro-batch: 98 of
    102 programs had an integral relaxation; the relaxations took 7.0 s of CPU without presolve,
    where the branch-and-bound took 60.4 s to the same optima."""
    if not len(arrays.cost):  # every node has one strategy: nothing to choose
        return "optimal", np.zeros(0)
    h = _highs(arrays, time_limit, msg)
    h.setOptionValue("presolve", "off")
    state, values = _run(h)
    return ("failed", None) if state in ("stopped", "timeout") else (state, values)


NO_COLUMNS = np.zeros(0, dtype=np.int64)


class WarmRelaxation:
    """The LP relaxation of one program without a memory row, kept in one HiGHS instance and
    solved again with some binary columns fixed at 0 (a seed's excluded strategies,
    `planner.intra.ilp.ILPModel.solve_within`; the program's own relaxation too, so that its
    seeds start from its optimum). Each solve starts from the basis the last one ended with,
    not from a slack basis: HiGHS keeps the basis across bound changes. On one of
    mixtral-8x7b's programs at 8 rows (80K columns), the relaxation took 62 ms cold and 9 ms
    solved again; the 60 seeds of that size took 2.5 s of CPU warm (a seed may still move
    every parameter: 9-175 ms each). One solve at a time."""

    def __init__(self, arrays: HighsArrays) -> None:
        self.arrays = arrays
        self._h = None
        self._lock = threading.Lock()

    def solve(
        self, zero: np.ndarray = NO_COLUMNS, *, time_limit: float | None = None
    ) -> tuple[str, np.ndarray | None]:
        """("optimal" | "infeasible" | "failed", column values or None) with the model's binary
        columns `zero` (none by default) fixed at 0, as `solve_relaxation` returns them."""
        a = self.arrays
        if not len(a.cost):
            return "optimal", np.zeros(0)
        with self._lock:
            if self._h is None:
                self._h = _highs(a, None, False)
                self._h.setOptionValue("presolve", "off")
            h = self._h
            h.setOptionValue("time_limit", np.inf if time_limit is None else time_limit)
            cols = np.unique(a.position[zero]).astype(np.int32)
            if len(cols):
                h.changeColsBounds(
                    len(cols), cols, np.zeros(len(cols)), np.zeros(len(cols))
                )
            try:
                state, values = _run(h)
            finally:
                if len(cols):
                    h.changeColsBounds(
                        len(cols), cols, np.zeros(len(cols)), a.upper[cols]
                    )
        return ("failed", None) if state in ("stopped", "timeout") else (state, values)


def _run(h) -> tuple[str, np.ndarray | None]:
    """Run `h` with the GIL released: ("optimal" | "stopped" | "timeout" | "infeasible" |
    "failed", column values or None); "stopped": the time limit left a feasible solution,
    "timeout": it left none."""
    import highspy

    with released():
        h.run()
    status = h.getModelStatus()
    states = highspy.HighsModelStatus
    if status == states.kOptimal:
        return "optimal", np.array(h.getSolution().col_value)
    if status in (states.kInfeasible, states.kUnboundedOrInfeasible):
        return "infeasible", None
    if (
        status == states.kTimeLimit
        and h.getInfo().objective_function_value < highspy.kHighsInf
    ):
        return "stopped", np.array(h.getSolution().col_value)
    if status == states.kTimeLimit:
        return "timeout", None
    return "failed", None


def _highs(arrays: HighsArrays, time_limit: float | None, msg: bool):
    """A silent (unless `msg`), single-threaded `highspy.Highs` holding the program's columns and
    rows, all continuous."""
    import highspy

    silence_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    n = len(arrays.cost)
    h.addCols(
        n,
        arrays.cost,
        np.zeros(n),
        arrays.upper,
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=float),
    )
    if len(arrays.starts):
        h.addRows(
            len(arrays.starts),
            arrays.row_lower,
            arrays.row_upper,
            len(arrays.index),
            arrays.starts,
            arrays.index,
            arrays.value,
        )
    return h


def check_highs() -> None:
    """Raise MeshplanError when highspy is missing."""
    try:
        import highspy  # noqa: F401
    except ImportError as exc:
        raise MeshplanError(
            "the HiGHS solver needs the highspy package (pip install highspy)"
        ) from exc


_banner_lock = threading.Lock()


def silence_banner() -> None:
    """Make sure HiGHS's banner never reaches the output (`_silence_highs_banner`), once per
    process, whichever thread asks first."""
    with _banner_lock:
        _silence_highs_banner()


@functools.cache
def _silence_highs_banner() -> None:
    """HiGHS prints its banner ("Running HiGHS ...: Copyright ...") on the process's standard
    output (file descriptor 1, not Python's `sys.stdout`) when the process makes its first `Highs`
    object, whatever the options say (highspy 1.16). Make that first object here, once, with
    descriptor 1 pointed at /dev/null, so that the banner never reaches a user's output."""
    import highspy

    with fd_silenced(1):
        highspy.Highs()


_python_lock = threading.Lock()
_holds = threading.local()


def _fresh_locks() -> None:
    """A forked child (`planner.size_search`'s workers) starts with this module's locks free: a
    parent's thread holding one at the fork is not in the child to release it."""
    global _python_lock, _banner_lock
    _python_lock, _banner_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)


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


@contextmanager
def released() -> Iterator[None]:
    """Release the planner's lock for the block when this thread holds it (`solves_overlap`)."""
    if not getattr(_holds, "on", False):
        yield
        return
    _python_lock.release()
    try:
        yield
    finally:
        _python_lock.acquire()
