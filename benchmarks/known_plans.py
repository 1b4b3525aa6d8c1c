"""Plans where the answer is known, checked: llama3-8b on one host of 8 H100s.

* At global batch 1 there is no batch to split: the attention and MLP weights must be split across
  devices (Megatron's column-then-row split, or another sharding), not replicated.
* At global batch 1024 the batch is what to split: every stage must be data-parallel over all its
  devices (its data-parallel axes cover its mesh), with the weights replicated or sharded over
  those axes (FSDP-like).

    python -m benchmarks.known_plans [--only batch1|batch1024] [--json FILE]

prints each plan as `meshplan plan` does, the check and the planning time, and writes
`benchmarks/results/known-plans.json` (date, machine, load average). Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from typing import Any

from benchmarks.records import RESULTS, machine, write_results
from cost_models.memory import param_state_bytes
from planner.api import plan
from planner.commands.plan import summary
from planner.models import param_count
from planner.vocab.plan_file import ParallelPlan

MODEL, CLUSTER = "llama3-8b", "1x8xH100-80GB"
WEIGHTS = (
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.o",
    "mlp.gate",
    "mlp.up",
    "mlp.down",
)


def _block_weights(p: ParallelPlan) -> dict[str, list[str]]:
    """Placements of block 0's attention and MLP weights."""
    out: dict[str, list[str]] = {}
    for s in p.stages:
        for path, placement in s.param_placements.items():
            if path.startswith("blocks.0.") and any(w in path for w in WEIGHTS):
                out[path] = placement
    return out


def weights_split(p: ParallelPlan) -> tuple[bool, str]:
    """Whether every attention and MLP weight of block 0 is sharded on some mesh axis."""
    weights = _block_weights(p)
    replicated = [
        k for k, v in weights.items() if not any(x.startswith("S") for x in v)
    ]
    ok = bool(weights) and not replicated
    return (
        ok,
        f"{len(weights) - len(replicated)} of {len(weights)} block weights split"
        + (f"; replicated: {', '.join(replicated)}" if replicated else ""),
    )


def replicated_state_gib(p: ParallelPlan) -> float:
    """GiB per device that plain data parallelism needs before any activation: every device
    holds all weights, gradients and optimizer state (`cost_models.memory.param_state_bytes`)."""
    params = param_count(MODEL)
    return param_state_bytes(params, p.optimizer, shards=1) / 2**30


def data_parallel(p: ParallelPlan) -> tuple[bool, str]:
    """Whether every stage splits the batch over all of its devices."""
    budget = p.memory_budget_bytes / 2**30
    bound = (
        f"plain data parallelism needs {replicated_state_gib(p):.1f} GiB of weights, gradients "
        f"and {p.optimizer} state per device, {budget:.1f} GiB available"
    )
    parts = [bound]
    ok = True
    for i, s in enumerate(p.stages):
        dp = math.prod(s.logical_mesh[a] for a in s.data_parallel_axes)
        devices = math.prod(s.logical_mesh)
        ok &= dp == devices
        sharded = (
            "weights sharded over them (FSDP-like)"
            if s.zero_params
            else "weights replicated"
        )
        parts.append(
            f"stage {i}: data-parallel over {dp} of {devices} devices, {sharded}"
        )
    return ok, "; ".join(parts)


CASES = {
    "batch1": (1, weights_split),
    "batch1024": (1024, data_parallel),
}


def run_case(name: str) -> dict[str, Any]:
    batch, check = CASES[name]
    print(f"planning {MODEL} on {CLUSTER} at global batch {batch} ...", flush=True)
    p = plan(MODEL, CLUSTER, global_batch=batch)
    print(summary(p))
    ok, why = check(p)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {why}\n", flush=True)
    return {
        "case": name,
        "global_batch": batch,
        "ok": ok,
        "check": why,
        "planner_time_s": p.planner_time_s,
        "stages": [
            {"logical_mesh": list(s.logical_mesh), "dp_tp": s.dp_tp} for s in p.stages
        ],
        "block0_placements": _block_weights(p),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(CASES))
    ap.add_argument("--json", default=str(RESULTS / "known-plans.json"))
    args = ap.parse_args(argv)
    cases = [run_case(n) for n in ([args.only] if args.only else CASES)]
    write_results(
        {
            "suite": "known-plans",
            "model": MODEL,
            "cluster": CLUSTER,
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "load_average": os.getloadavg()[0],
            "cases": cases,
        },
        args.json,
    )
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
