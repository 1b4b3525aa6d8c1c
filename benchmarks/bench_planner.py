"""Benchmark: planner speed (issue 23).

Targets:
- intra-op: one GPT-1.3B stage (24 layers) on a (2, 4) mesh in at most 5 s; GPT-39B as one stage on
  an (8, 8) mesh in at most 30 s (issue "Intra-op pass"). Each runs `--repeats` times in this
  process (tracing included) and reports the median wall time.
- whole plans, each run in a fresh `meshplan plan` process (`benchmarks.planning_time`, which
  writes `benchmarks/results/planning-time.json` with the date, the machine and the load
  averages): gpt-39b on 8x8xV100-16GB in at most 20 s (Alpa: about 40 minutes), a
  1-trillion-parameter GPT on 384x8xA100-80GB in at most 60 s, the slowest committed case of
  the GPT, MoE and Wide-ResNet suites in at most 60 s each, llama3-70b in 60 s, llama3-405b on
  128x8xH100-80GB in 180 s, mixtral-8x7b in 90 s (issue 20).

    python -m benchmarks.bench_planner [--cases intra-1.3b gpt-39b slowest-moe ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks import planning_time
from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner import trace
from planner.intra.solve import solve_stage
from planner.models import build_model


def intra(
    model: str, spec: str, shape: tuple[int, int], batch: int, microbatches: int
) -> str:
    m, b = build_model(model, batch=batch, dtype=torch.float16)
    graph = trace(m, b)
    cluster = Cluster.from_spec(spec)
    sol = solve_stage(
        graph,
        LogicalMesh(cluster, cluster.shape, shape),
        num_microbatches=microbatches,
        memory_budget=cluster.device.memory_bytes,
    )
    return f"{sol.time_s * 1e3:.1f} ms per micro-batch, {sol.memory_bytes / 2**30:.1f} GiB, {sol.ilp_nodes} ILP nodes"


CASES = {
    "intra-1.3b": (lambda: intra("gpt-1.3b", "1x8xA100-80GB", (2, 4), 16, 8), 5.0),
    "intra-39b": (lambda: intra("gpt-39b", "8x8xV100-16GB", (8, 8), 16, 64), 30.0),
}


def main(argv: list[str] | None = None) -> int:
    whole = list(planning_time.all_cases())
    ap = argparse.ArgumentParser(description="planner speed benchmark")
    ap.add_argument(
        "--cases", nargs="+", default=list(CASES) + whole, choices=list(CASES) + whole
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    ok = True
    plans = [n for n in args.cases if n in whole]
    for name in [n for n in args.cases if n in CASES]:
        fn, target = CASES[name]
        times, what = [], ""
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            what = fn()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        met = med <= target
        ok &= met
        print(
            f"{name:<11} median {med:7.1f} s over {len(times)} (target <= {target:.0f} s: {'met' if met else 'MISSED'})  {what}",
            flush=True,
        )
    if plans:
        ok &= planning_time.run_cases(plans, args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
