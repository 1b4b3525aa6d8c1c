"""Re-plan committed cases of the predicted suites and compare them with their records.

    python -m benchmarks.replan --suite gpt --gpus 2 4 8 [--device V100-16GB]

For each case, `benchmarks.suites.run_case` plans it again (automatic plan and manual grid) and
`benchmarks.records.record_differences` lists what differs from the committed record in
`benchmarks/results/SUITE-DEVICE.json` (planning times aside). A refactoring of the planner or the
cost models that should not change any plan is checked this way; exits 1 when a case differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.records import RESULTS, record_differences
from benchmarks.suites import DEVICES, SUITES, run_case, suite_cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=SUITES, required=True)
    ap.add_argument("--gpus", type=int, nargs="+", required=True)
    ap.add_argument("--device", choices=DEVICES, default="V100-16GB")
    args = ap.parse_args(argv)
    doc = json.loads((RESULTS / f"{args.suite}-{args.device}.json").read_text())
    committed = {c["num_devices"]: c for c in doc["cases"]}
    differs = 0
    for case in suite_cases(args.suite, args.gpus, args.device):
        old = committed.get(case.num_devices)
        if old is None:
            print(f"{case.model} on {case.cluster}: no committed record", flush=True)
            continue
        t0 = time.perf_counter()
        diffs = record_differences(run_case(case), old)
        differs += bool(diffs)
        verdict = "same plans and prices" if not diffs else "; ".join(diffs)
        print(
            f"{case.model} on {case.cluster}: {verdict} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
