"""benchmarks.size_landscape: every size the planner compares is recorded with its best plan's
time, and the walk down the sizes it reports on stops as described."""

from __future__ import annotations

import math

from benchmarks import size_landscape as sl
from benchmarks.suites import Case
from planner import api, plan, size_eval


def test_walk_down_stops_after_k_sizes_that_lose() -> None:
    # a plateau that loses twice, then the fastest size (gpt-2.6b on 8 V100s has this shape)
    sizes = {32: 10.0, 16: 10.1, 8: 10.2, 4: 8.0, 2: 8.5, 1: 9.0}
    first = [1, 2, 4, 8, 16, 32]
    assert sl.walk_down(sizes, first, 1) == [32, 16]
    assert sl.walk_down(sizes, first, 2) == [32, 16, 8]
    assert sl.walk_down(sizes, first, 3) == [32, 16, 8, 4, 2, 1]
    # a size where nothing fits is no loss; a size searched besides beats the first ones
    assert sl.walk_down({8: math.inf, 4: 5.0, 2: 6.0, 1: 4.0}, [1, 2, 4, 8], 1) == [
        8,
        4,
        2,
    ]
    assert sl.walk_down({4: 5.0, 2: 6.0, 1: 4.0, 64: 3.0}, [1, 2, 4], 2) == [4, 2]
    doc = {
        "cases": [
            {"model": "m", "cluster": "c", "first": first, "sizes": list(sizes.items())}
        ]
    }
    lines = sl.report(doc)
    # k = 1 stops at 16 rows: the best it finds is 32 rows', against 4 rows' over all
    assert (
        f"misses the best plan of 1 case: m on c ({sizes[32] / sizes[4]:.3f}x)"
        in lines[0]
    )
    assert lines[2].startswith(
        "k=3: skips 0 of 6 sizes; misses the best plan of 0 cases"
    )


def test_case_sizes_are_those_the_plan_compares() -> None:
    case = Case(
        "gpt", "gpt:hidden=64,layers=2,heads=2,seq=32,vocab=128", 2, "1x2xA100-80GB", 8
    )
    ranked = api._best
    sizes = sl.case_sizes(case)
    assert api._best is ranked and size_eval.SKIP_BOUNDED_SIZES
    found = dict(sizes)
    assert set(api.microbatch_sizes(8, None)) <= set(found)
    # every size searched: 1 row's least possible time is above 8 rows' plan, and the
    # planner alone leaves it out (`planner.size_eval.SKIP_BOUNDED_SIZES`)
    assert all(t is not None for t in found.values())
    auto = plan(case.model, case.cluster, global_batch=8, dtype="float16")
    assert (
        min(t for t in found.values() if t is not None)
        == auto.estimate.iteration_time_s
    )
