"""`benchmarks.planning_profile`: a py-spy sample counts in the first part one of its frames
matches (a price the mesh bound computes is the bound's, one a layer profile computes is the
profile's), and imports and what is not the planner are left out."""

from __future__ import annotations

from benchmarks.planning_profile import OTHER, parts


def _line(*frames: str, count: int = 1) -> str:
    return ";".join(frames) + f" {count}"


MAIN = "_run_module_as_main (<frozen runpy>:198)"
SEARCH = "search (planner/inter/mesh_search.py:500)"
PRICE = "PricedStage.values (planner/intra/priced_stage.py:175)"


def test_each_sample_counts_in_its_first_matching_part() -> None:
    lines = [
        _line(MAIN, SEARCH, "_run (planner/intra/highs.py:252)", count=3),
        _line(
            MAIN,
            SEARCH,
            "LeastTime._add (planner/inter/mesh_bound.py:244)",
            PRICE,
            count=2,
        ),
        _line(MAIN, SEARCH, "profile (planner/inter/stage_table.py:290)", PRICE),
        _line(MAIN, SEARCH, "solve_stage (planner/intra/solve.py:292)", PRICE, count=4),
        _line(MAIN, SEARCH, "_reduce (planner/intra/solve.py:431)"),
        _line(MAIN, SEARCH, count=5),
        # left out: an import, and a thread outside the planner
        _line(MAIN, "_find_and_load (<frozen importlib._bootstrap>:1165)", SEARCH),
        _line("Thread.run (threading.py:982)", "wait (threading.py:320)", count=7),
    ]
    assert parts(lines) == {
        "HiGHS: LP relaxations and branch-and-bound": 3,
        "mesh bound, with the pricing it does first": 2,
        "layer profiles: memory, recomputation, attribution": 1,
        "pricing: options, strategies, prices": 4,
        "intra-op programs built and read back": 1,
        OTHER: 5,
    }
