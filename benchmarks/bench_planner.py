"""Benchmark: planner speed.

Targets:
- intra-op: one GPT-1.3B stage (24 layers) on a (2, 4) mesh in at most 5 s; GPT-39B as one stage on
  an (8, 8) mesh in at most 30 s (issue "Intra-op pass").
- plan(): gpt-39b on 8x8xV100-16GB in at most 60 s (Alpa: about 40 minutes); a 1-trillion-parameter
  GPT on 384x8xA100-80GB in at most 10 minutes (issue "Inter-op pass").

Each case runs `--repeats` times in this process (tracing included for the intra-op cases) and
reports the median wall time.

    python -m benchmarks.bench_planner [--cases intra-1.3b intra-39b plan-39b plan-1t] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner import plan, trace
from planner.intra.solve import solve_stage
from planner.models import build_model

GPT_1T = "gpt:hidden=25600,layers=128,heads=160,seq=2048,vocab=51200"


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


def whole(model: str, spec: str, batch: int) -> str:
    p = plan(model, spec, global_batch=batch)
    shape = ", ".join(
        f"{s.layers[0]}-{s.layers[1]}@{s.submesh[0]}x{s.submesh[1]}->{s.logical_mesh[0]}x{s.logical_mesh[1]}"
        for s in p.stages
    )
    return f"{p.estimate.tflops_per_device:.1f} TFLOP/s per device, B={p.num_microbatches}, stages {shape}"


CASES = {
    "intra-1.3b": (lambda: intra("gpt-1.3b", "1x8xA100-80GB", (2, 4), 16, 8), 5.0),
    "intra-39b": (lambda: intra("gpt-39b", "8x8xV100-16GB", (8, 8), 16, 64), 30.0),
    "plan-39b": (lambda: whole("gpt-39b", "8x8xV100-16GB", 1024), 60.0),
    "plan-1t": (lambda: whole(GPT_1T, "384x8xA100-80GB", 3072), 600.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="planner speed benchmark")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    ok = True
    for name in args.cases:
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
