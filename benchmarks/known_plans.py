"""Plans where the answer is known, checked: llama3-8b on one host of 8 H100s.

* At global batch 1 there is no batch to split: the attention and MLP weights must be split across
  devices, not replicated: no device holds one whole, either in the planned placement
  (Megatron's column-then-row split, or another sharding) or in storage (FSDP: each device keeps
  a shard and the weight is gathered only while its layer runs), and every matrix product of the
  stage is split over all its devices (by the weights, or along the sequence).
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
from planner.models import build_model, param_count
from planner.vocab.placements import zero_shard
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


def _stored(p: ParallelPlan) -> dict[str, tuple[str, ...]]:
    """Where block 0's attention and MLP weights are kept: the planned placement, or for an FSDP
    parameter the shard each device stores (`planner.vocab.placements.zero_shard`)."""
    module, _ = build_model(MODEL, batch=1, device="meta")
    shapes = {k: tuple(v.shape) for k, v in module.named_parameters()}
    weights, out = _block_weights(p), {}
    for s in p.stages:
        for path, placement in s.param_placements.items():
            if path in weights:
                out[path] = (
                    zero_shard(
                        shapes[path],
                        tuple(placement),
                        tuple(s.logical_mesh),
                        s.shard_axes(path),
                    )
                    if path in s.fsdp_params
                    else tuple(placement)
                )
    return out


def weights_split(p: ParallelPlan) -> tuple[bool, str]:
    """Whether every attention and MLP weight of block 0 is sharded on some mesh axis where it is
    kept (`_stored`), and every matrix product splits its output over every mesh axis (sharded
    or partial: no axis repeats the computation)."""
    weights = _stored(p)
    whole = [k for k, v in weights.items() if not any(x.startswith("S") for x in v)]
    fsdp = [k for s in p.stages for k in weights if k in s.fsdp_params]
    repeated = [
        n
        for s in p.stages
        for n, st in s.node_strategies.items()
        if n.split("_")[0] in ("mm", "bmm", "addmm")
        and any(
            x == "R" and size > 1 for x, size in zip(st["outputs"][0], s.logical_mesh)
        )
    ]
    ok = bool(weights) and not whole and not repeated
    return (
        ok,
        f"{len(weights) - len(whole)} of {len(weights)} block weights split"
        + (f" ({len(fsdp)} stored sharded with FSDP)" if fsdp else "")
        + (f"; held whole: {', '.join(whole)}" if whole else "")
        + (
            f"; {len(repeated)} matrix products repeated on some mesh axis"
            if repeated
            else "; every matrix product split over all devices"
        ),
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
            f"{len(s.fsdp_params)} of {len(s.param_placements)} parameters stored sharded "
            "over them (FSDP)"
            if s.fsdp_params
            else "gradients and optimizer state sharded over them (ZeRO-2)"
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
