"""Where one planning process's CPU goes, by part of the search (issue 23), from a py-spy profile.

    MESHPLAN_PLANNER_PROCESSES=1 py-spy record -r 100 -f raw -o plan.raw -- \\
        python -m runtime.cli plan gpt-39b --cluster 8x8xV100-16GB --batch 1024 --quiet
    python -m benchmarks.planning_profile plan.raw [--other]

One process (`MESHPLAN_PLANNER_PROCESSES=1`) so that every sample is the search's. Each sample
(a stack, innermost frame last) goes to the first part of `PARTS` that one of its frames
matches (function and file): a price computed while a layer profile is made counts as the
profile's, one computed by the mesh bound as the bound's (its meshes' solves reuse it). Imports
and what runs outside the planner are left out. py-spy sees no C frames: the garbage
collector's time counts where it was triggered, and HiGHS's where the planner called it.
`--other` lists the planner frames of the samples no part matched.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable

#: (part, [(function regex, file regex), ...]) in the order a sample is tried against them
PARTS: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "HiGHS: LP relaxations and branch-and-bound",
        [("", r"intra/highs\.py"), ("", r"intra/branching\.py")],
    ),
    (
        "intra-op programs built and read back",
        [
            (r"^(_reduce|_program)$", r"intra/solve\.py"),
            ("", r"intra/ilp\.py"),
            ("", r"intra/cost_graph\.py"),
            ("", r"intra/dominance\.py"),
        ],
    ),
    ("intra-op solutions summarised", [(r"^_summar", r"intra/solve\.py")]),
    (
        "layer profiles: memory, recomputation, attribution",
        [
            (r"^profile$", r"inter/stage_table\.py"),
            ("", r"inter/held_memory\.py"),
            ("", r"inter/full_recompute\.py"),
            ("", r"inter/grad_timeline\.py"),
            ("", r"inter/selective\.py"),
            ("", r"inter/wgrad\.py"),
            (r"attribute", r"inter/mesh_search\.py"),
        ],
    ),
    ("mesh bound, with the pricing it does first", [("", r"inter/mesh_bound\.py")]),
    (
        "pricing: options, strategies, prices",
        [
            ("", r"intra/priced_stage\.py"),
            ("", r"intra/prices\.py"),
            ("", r"intra/strategies\.py"),
            ("", r"intra/fsdp_prices\.py"),
            ("", r"intra/dtensor_rules\.py"),
            (r"price_stage", r"intra/solve\.py"),
            ("", r"cost_models/resharding\.py"),
            ("", r"intra/batch_split\.py"),
        ],
    ),
    (
        "stage tables, stage DP, interleaving",
        [
            ("", r"inter/stage_table\.py"),
            ("", r"inter/stage_dp\.py"),
            ("", r"inter/interleave\.py"),
            ("", r"inter/range_costs\.py"),
            ("", r"inter/dp_overlap\.py"),
            ("", r"cost_models/memory\.py"),
            (r"enter|result", r"inter/mesh_search\.py"),
        ],
    ),
    (
        "tracing",
        [
            ("", r"planner/tracing/"),
            ("", r"proxy_tensor\.py"),
            ("", r"fake_tensor\.py"),
        ],
    ),
    ("plan assembly", [("", r"plans/assemble\.py")]),
]
OTHER = "other: the search's driver"

_FRAME = re.compile(r"(.*) \((.*?):\d+\)$")


def samples(lines: Iterable[str]) -> Iterable[tuple[list[tuple[str, str]], int]]:
    """(frames as (function, file), count) of each line of a py-spy raw profile."""
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = []
        for f in stack.split(";"):
            m = _FRAME.match(f)
            frames.append((m.group(1), m.group(2)) if m else (f, ""))
        yield frames, int(count)


def part_of(frames: list[tuple[str, str]]) -> str | None:
    """The part a sample counts in; None for one outside the search (imports, not the
    planner)."""
    if not any("planner/" in path for _, path in frames) or any(
        "_find_and_load" in fn for fn, _ in frames
    ):
        return None
    for name, patterns in PARTS:
        if any(
            re.search(fr, fn) and re.search(pr, path)
            for fn, path in frames
            for fr, pr in patterns
        ):
            return name
    return OTHER


def parts(lines: Iterable[str]) -> Counter[str]:
    """Samples per part."""
    out: Counter[str] = Counter()
    for frames, count in samples(lines):
        part = part_of(frames)
        if part is not None:
            out[part] += count
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy record -f raw output of one planning process")
    ap.add_argument("--other", action="store_true", help="list what no part matched")
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        lines = f.readlines()
    counts = parts(lines)
    total = sum(counts.values())
    if not total:
        print(f"{args.raw}: no sample of the planner's search")
        return 1
    for name, n in counts.most_common():
        print(f"{100 * n / total:5.1f}%  {name}")
    print(f"{total} samples")
    if args.other:
        rest: Counter[str] = Counter()
        for frames, count in samples(lines):
            if part_of(frames) == OTHER:
                ours = [f"{fn} ({p})" for fn, p in frames if "planner/" in p]
                rest[" <- ".join(ours[::-1][:2])] += count
        for what, n in rest.most_common(15):
            print(f"{n:6d}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
