"""Alpa's GPT weak-scaling suite on V100 clusters: auto plans against Megatron's best configurations.

For each case of ../shared/reference/alpa-osdi22-suite.md (1 to 64 GPUs): plan automatically, check
the plan fits in the V100's 16 GB, and where the reference lists Megatron's best configuration, price
it with the same cost models (recomputation on, as measured) and compare. Prints a table; with
`--json FILE` writes the cases.

    python -m benchmarks.gpt_suite [--gpus 1 4 8] [--json benchmarks/results/gpt_suite.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from benchmarks.megatron_gpt import alpa_gpt_flops, megatron_iteration_time
from benchmarks.reference import gpt_megatron_configs, measured_tflops, scaling
from cost_models.cluster import Cluster
from planner import plan
from planner.api import _resolve_model
from planner.manual import manual_plan
from planner.models.gpt import GPT_CONFIGS
from planner.tracer import trace

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
        m = manual_plan(
            model,
            spec,
            dp=megatron["dp"],
            tp=megatron["tp"],
            pp=megatron["pp"],
            num_microbatches=megatron["microbatches"],
            global_batch=batch,
            recompute=True,
            allow_oom=True,
            split="blocks",
        )
        config = GPT_CONFIGS[model]
        micro = batch // megatron["microbatches"]
        module, example = _resolve_model(model, None, torch.float16, None)[1](micro)
        graph = trace(module, example, model_name=model)
        cluster = Cluster.from_spec(spec)
        t_meg = megatron_iteration_time(
            m, graph, cluster, tp=megatron["tp"], pp=megatron["pp"]
        )
        flops = alpa_gpt_flops(
            batch,
            config.seq,
            config.layers,
            config.hidden,
            config.vocab,
            recompute=True,
        )
        case["megatron"] = {
            "config": {k: megatron[k] for k in ("dp", "tp", "pp", "microbatches")},
            "iteration_time_s": m.estimate.iteration_time_s,
            "tflops_per_device": m.estimate.tflops_per_device,
            "megatron_program_iteration_time_s": t_meg,
            "predicted_alpa_tflops_per_device": flops / t_meg / gpus / 1e12,
            "measured_tflops_per_device": measured_tflops("## GPT", "Megatron-LM")[
                gpus
            ],
            "peak_memory_bytes": m.estimate.peak_memory_bytes,
            "fits": m.manual["fits"],
        }
        case["ratio"] = m.estimate.iteration_time_s / auto.estimate.iteration_time_s
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
            f"{mg.get('predicted_alpa_tflops_per_device', float('nan')):>14.1f} {mg.get('measured_tflops_per_device') or float('nan'):>8.1f} "
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
