"""Alpa's GPT weak-scaling suite on V100 clusters: auto plans against Megatron's best configurations.

For each case of ../shared/reference/alpa-osdi22-suite.md (1 to 64 GPUs): plan automatically, check
the plan fits in the V100's 16 GB, and where the reference lists Megatron's best configuration, price
it with the same cost models (recomputation on, as measured; `benchmarks.megatron_gpt`): "Megatron
pred." is Megatron-LM's program on that configuration in Alpa's FLOP convention (factor 96), the
convention of the "measured" column; "ratio" compares the configuration priced with our ops
(Megatron's block split, `plan_iteration_time_s`) with the automatic plan. Prints a table; with
`--json FILE` writes the cases.

    python -m benchmarks.gpt_suite [--gpus 1 4 8] [--json benchmarks/results/gpt_suite.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.megatron_gpt import megatron_prediction
from benchmarks.reference import gpt_megatron_configs, scaling
from planner import plan

HOST = 8  # V100s per p3.16xlarge host


def cluster_spec(gpus: int) -> str:
    return f"{max(1, gpus // HOST)}x{min(gpus, HOST)}xV100-16GB"


def run_case(gpus: int) -> dict[str, Any]:
    model = "gpt-" + scaling("## GPT")[gpus].lower()
    megatron = {c["gpus"]: c for c in gpt_megatron_configs()}.get(gpus)
    batch = megatron["global_batch"] if megatron else 1024
    spec = cluster_spec(gpus)
    t0 = time.perf_counter()
    auto = plan(model, spec, global_batch=batch)
    case: dict[str, Any] = {
        "suite": "gpt",
        "model": model,
        "num_devices": gpus,
        "cluster": spec,
        "global_batch": batch,
        "auto": {
            "iteration_time_s": auto.estimate.iteration_time_s,
            "tflops_per_device": auto.estimate.tflops_per_device,
            "peak_memory_bytes": auto.estimate.peak_memory_bytes,
            "planner_time_s": time.perf_counter() - t0,
            "num_microbatches": auto.num_microbatches,
            "stages": [
                {
                    "layers": s.layers,
                    "submesh": s.submesh,
                    "logical_mesh": s.logical_mesh,
                    "recompute": s.recompute,
                }
                for s in auto.stages
            ],
        },
        "fits": auto.estimate.peak_memory_bytes <= auto.memory_budget_bytes,
    }
    if megatron:
        listed = megatron_prediction(model, spec, megatron, batch)
        case["megatron"] = listed
        case["ratio"] = listed["plan_iteration_time_s"] / auto.estimate.iteration_time_s
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Alpa GPT suite: auto plans vs Megatron's best configurations"
    )
    ap.add_argument("--gpus", type=int, nargs="+", default=sorted(scaling("## GPT")))
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    cases, ok = [], True
    print(
        f"{'GPUs':>4} {'model':<9} {'auto TFLOP/s':>12} {'fits':>5} {'Megatron pred.':>14} {'measured':>8} {'ratio':>6} {'plan s':>7}  stages"
    )
    for g in args.gpus:
        c = run_case(g)
        cases.append(c)
        mg = c.get("megatron", {})
        ok &= c["fits"] and c.get("ratio", 1.0) >= 1.0
        stages = " ".join(
            f"{s['layers'][0]}-{s['layers'][1]}@{s['logical_mesh'][0]}x{s['logical_mesh'][1]}"
            for s in c["auto"]["stages"]
        )
        print(
            f"{g:>4} {c['model']:<9} {c['auto']['tflops_per_device']:>12.1f} {c['fits']!s:>5} "
            f"{mg.get('predicted_tflops_per_device', float('nan')):>14.1f} {mg.get('measured_tflops_per_device') or float('nan'):>8.1f} "
            f"{c.get('ratio', float('nan')):>6.2f} {c['auto']['planner_time_s']:>7.1f}  B={c['auto']['num_microbatches']} {stages}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": cases}, f, indent=1)
    print(
        "all plans fit and auto >= Megatron where listed"
        if ok
        else "SOME CASE MISSED (fit or ratio < 1)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
