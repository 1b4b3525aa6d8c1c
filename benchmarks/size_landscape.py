"""Benchmark: the best predicted iteration time of each micro-batch size the planner compares,
for every case of the suites (issue 23: could fewer sizes be searched?).

`planner.plan` searches every size of `planner.api.microbatch_sizes` (1 to 32 rows, more on one
host) and walks the larger ones only while they pay off (`planner.api.next_size_step`). Each size
costs about as much CPU as the others (about 20 s for the 1T GPT on this machine), so a walk down
from the largest size that stopped early would plan faster. This records the best plan's time of
every size each case compares (read where `plan` ranks them, `planner.api._best`; no size
left out for its least possible time, `planner.size_eval.SKIP_BOUNDED_SIZES`), and reports
for a walk down that stops after `k` sizes in a row that do not beat the best so far (k = 1 to 3,
the sizes above the first ones kept as searched) the sizes it skips and the cases where it
misses the best plan. The plans are not changed.

    python -m benchmarks.size_landscape [--suite SUITE:DEVICE ...] [--json FILE]
    python -m benchmarks.size_landscape --report [--json FILE]

Without `--suite`: every suite on V100, A100 and H100 and the llama suite on H100 (about 30
minutes on this machine). Results: ``benchmarks/results/size-landscape.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.records import RESULTS, machine, write_results
from benchmarks.suites import suite_cases
from cost_models.cluster import Cluster
from cost_models.errors import DoesNotFitError
from planner import api, size_eval

DEFAULT_JSON = RESULTS / "size-landscape.json"
ALL = [
    f"{s}:{d}"
    for s in ("gpt", "moe", "wresnet")
    for d in ("V100-16GB", "A100-80GB", "H100-80GB")
]
ALL.append("llama:H100-80GB")


def case_sizes(case: Any) -> list[tuple[int, float | None]]:
    """(size, seconds of its best plan) of every size `plan` compares for `case`, in its order
    (None where nothing fits)."""
    seen: list[list[tuple[int, float | None]]] = []
    ranked = api._best

    def best(results: list) -> Any:
        seen.append(
            [(r.size, r.seconds if math.isfinite(r.seconds) else None) for r in results]
        )
        return ranked(results)

    api._best = best
    # every size searched: none left out for its bound (`planner.size_bound`)
    skip, size_eval.SKIP_BOUNDED_SIZES = size_eval.SKIP_BOUNDED_SIZES, False
    try:
        api.plan(
            case.model,
            case.cluster,
            global_batch=case.global_batch,
            dtype=case.dtype,
            optimizer=case.optimizer,
        )
    except DoesNotFitError:
        pass
    finally:
        api._best = ranked
        size_eval.SKIP_BOUNDED_SIZES = skip
    return seen[-1] if seen else []


def walk_down(sizes: dict[int, float], first: list[int], k: int) -> list[int]:
    """The sizes of `first` a walk down from the largest searches, stopping after `k` in a row
    that do not beat the best so far (a size where nothing fits does not count: smaller ones
    need less memory; the other sizes of `sizes` counted as searched)."""
    best = min((t for b, t in sizes.items() if b not in first), default=math.inf)
    searched, losses = [], 0
    for b in sorted(first, reverse=True):
        searched.append(b)
        if math.isinf(sizes[b]):
            continue
        losses = 0 if sizes[b] < best else losses + 1
        best = min(best, sizes[b])
        if losses >= k:
            break
    return searched


def report(doc: dict[str, Any]) -> list[str]:
    """Per k: sizes skipped, and the cases whose best plan the walk down misses."""
    lines = []
    for k in (1, 2, 3):
        skipped = total = 0
        misses = []
        for c in doc["cases"]:
            sizes = {b: math.inf if t is None else t for b, t in c["sizes"]}
            best = min(sizes.values(), default=math.inf)
            if not math.isfinite(best):
                continue
            searched = walk_down(sizes, c["first"], k)
            kept = [t for b, t in sizes.items() if b not in c["first"] or b in searched]
            skipped += len(c["first"]) - len(searched)
            total += len(c["first"])
            if min(kept) > best:
                misses.append(
                    f"{c['model']} on {c['cluster']} ({min(kept) / best:.3f}x)"
                )
        lines.append(
            f"k={k}: skips {skipped} of {total} sizes; misses the best plan of "
            f"{len(misses)} case{'' if len(misses) == 1 else 's'}"
            f"{': ' if misses else ''}{', '.join(misses)}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", nargs="*", default=ALL, help="SUITE:DEVICE pairs")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument(
        "--report", action="store_true", help="report the file, plan nothing"
    )
    args = ap.parse_args(argv)
    if not args.report:
        cases = []
        for pair in args.suite:
            suite, _, device = pair.partition(":")
            for case in suite_cases(suite, None, device or "V100-16GB"):
                sizes = case_sizes(case)
                first = api.microbatch_sizes(
                    case.global_batch, Cluster.from_spec(case.cluster)
                )
                cases.append(
                    {
                        "suite": suite,
                        "model": case.model,
                        "cluster": case.cluster,
                        "global_batch": case.global_batch,
                        "first": first,
                        "sizes": sizes,
                    }
                )
                print(f"{case.model} on {case.cluster}: {sizes}", flush=True)
        write_results(
            {
                "benchmark": "size_landscape",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
                "machine": machine(),
                "torch": torch.__version__,
                "cases": cases,
            },
            args.json,
        )
    print("\n".join(report(json.loads(args.json.read_text()))))


if __name__ == "__main__":
    main()
