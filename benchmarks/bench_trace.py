"""Benchmark: tracing time and peak memory of the built-in GPT models.

Target (issue "Foundation"): tracing gpt-39b takes at most 20 s and at most 2 GB of memory.
Each trace runs in a fresh process so that its peak resident memory is its own; we report the
median of `--repeats` runs.

    python -m benchmarks.bench_trace [--models gpt-1.3b gpt-39b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from planner import trace
from planner.models import build_model
t1 = time.perf_counter()
model, batch = build_model(sys.argv[1], batch=int(sys.argv[2]), device="meta")
graph = trace(model, batch, model_name=sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "trace_s": t2 - t1, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "nodes": len(graph.nodes), "params": graph.num_params}))
"""

TARGETS = {"gpt-39b": (20.0, 2 * 10**9)}


def measure(model: str, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model, str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-1.3b", "gpt-15b", "gpt-39b"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    ok = True
    print(
        f"{'model':<10} {'nodes':>6} {'params':>14} {'trace s (median)':>17} {'peak RSS GB (median)':>21}  target"
    )
    for model in args.models:
        runs = [measure(model, args.batch) for _ in range(args.repeats)]
        t = statistics.median(r["trace_s"] + r["import_s"] for r in runs)
        mem = statistics.median(r["peak_rss_bytes"] for r in runs)
        target = ""
        if model in TARGETS:
            t_max, m_max = TARGETS[model]
            met = t <= t_max and mem <= m_max
            ok &= met
            target = f"<= {t_max:.0f} s, <= {m_max / 1e9:.0f} GB: {'met' if met else 'MISSED'}"
        print(
            f"{model:<10} {runs[0]['nodes']:>6} {runs[0]['params']:>14,} {t:>17.2f} {mem / 1e9:>21.2f}  {target}"
        )
    print(
        "(time includes importing torch and meshplan; memory is the whole process's peak)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
