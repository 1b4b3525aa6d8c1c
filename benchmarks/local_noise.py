"""The noise floor under issue 22's local timing target: how far one plan's measured step time
moves between launches of the same code on this machine, against how far its prediction moves.

    python -m benchmarks.local_noise [--procs 4] [--model gpt] [--launches 6] [--json FILE]

One case of the local suite (`benchmarks.local_suite.LOCAL_CASES`, by process count and model)
and one fixed plan: pure data parallelism over every process, one micro-batch (the plan the
suite's automatic and manual searches choose for the GPT). Each launch, as the suite does it:

1. profile this machine (`local_suite.profile_options`: every figure the cost model reads);
2. price the fixed plan on that profile (`Cluster.from_profile`, rank 0);
3. train the plan as the suite measures (`local_suite.measure_rank`: the suite's warm-up and timed
   steps in blocks); its measured step time is the median of the timed steps.

The bounds. Let q_i = measured_i / predicted_i over the launches. A cost model that is ours times
any constant k predicts k * predicted_i; its largest error max_i |k / q_i - 1| is least at
k = 2 q_min q_max / (q_min + q_max), where it equals (q_max - q_min) / (q_max + q_min). So no
calibration of our prices, however fitted, keeps every one of these launches nearer than that
(``calibrated_floor``). The same with one fixed prediction (a model that ignores the profile):
(m_max - m_min) / (m_max + m_min) over the measured times (``constant_floor``); when the first is
not below the second, the profile does not see what moves the measured time. Within a launch,
``block_spread`` is the largest block median (`local_suite.BLOCK` steps) over the smallest: how
far the machine moved while the plan was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.local_suite import (
    BLOCK,
    LOCAL_CASES,
    OPTIMIZER,
    STEPS,
    WARMUP,
    LocalCase,
    measure_rank,
    profile_options,
)
from cost_models.profile import OVERHEAD_FIELDS, save_profile

#: The suite's case issue 22's misses came from: the GPT on 4 processes (2 per core here)
DEFAULT_PROCS = 4
DEFAULT_MODEL = "gpt"


def noise_rank(case: LocalCase, options: Any, steps: int, warmup: int) -> dict | None:
    """One rank of a launch: profile (every rank), price the fixed plan (rank 0), train it."""
    import torch.distributed as dist

    from benchmarks.manual_grid import ManualConfig, price
    from cost_models.cluster import Cluster
    from runtime.profiler import profile_from_raw, profile_worker

    raw = profile_worker(options)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        profile = profile_from_raw(raw, options, dist.get_backend())
        n = case.num_devices
        cluster = Cluster.from_profile(profile, hosts=1, devices_per_host=n)
        config = ManualConfig(dp=n, tp=1, pp=1, num_microbatches=1, recompute="none")
        args = (case.global_batch, "float32", OPTIMIZER)
        box[0] = price(case.model, cluster, config, *args)
    dist.broadcast_object_list(box, src=0)
    runs = measure_rank([box[0]], case.model, steps, warmup)
    if dist.get_rank() != 0:
        return None
    return {
        "predicted_s": box[0].estimate.iteration_time_s,
        "step_times_s": runs["times"][0],
        "profile": profile,
    }


def _figures(profile: Any) -> dict[str, float | None]:
    """The profile's figures that move a prediction most: the overheads, the float32 peak (the
    fastest matrix product measured) and the memory bandwidth."""
    return {
        "peak_float32_flops": profile.peak_flops.get("float32"),
        "memory_bandwidth_bytes_per_s": profile.memory_bandwidth_bytes_per_s,
        **{key: getattr(profile, key) for key in OVERHEAD_FIELDS},
    }


def floors(launches: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The module docstring's bounds over `launches` (each with ``predicted_s`` and
    ``measured_s``; ``step_times_s`` for the block spread)."""
    m = [r["measured_s"] for r in launches]
    q = [r["measured_s"] / r["predicted_s"] for r in launches]
    spreads = []
    for r in launches:
        t = r["step_times_s"]
        blocks = [statistics.median(t[i : i + BLOCK]) for i in range(0, len(t), BLOCK)]
        spreads.append(max(blocks) / min(blocks))
    return {
        "calibrated_floor": (max(q) - min(q)) / (max(q) + min(q)),
        "constant_floor": (max(m) - min(m)) / (max(m) + min(m)),
        "measured_range_s": [min(m), max(m)],
        "predicted_range_s": [
            min(r["predicted_s"] for r in launches),
            max(r["predicted_s"] for r in launches),
        ],
        "block_spread_median": statistics.median(spreads),
    }


def run_noise(
    case: LocalCase,
    launches: int,
    steps: int = STEPS,
    warmup: int = WARMUP,
    profiles: str | None = None,
) -> dict[str, Any]:
    """`launches` launches of the case's fixed plan (module docstring), each printed as it ends;
    each launch's profile written into the directory `profiles` when given (launch-N.json)."""
    from runtime.launch import launch
    from runtime.profiler import check_options

    options = profile_options(case.num_devices, case)
    check_options(options)  # the calibration plans, made once for every launch
    out = []
    for i in range(launches):
        load, t0 = os.getloadavg()[0], time.perf_counter()
        r = launch(
            noise_rank,
            case.num_devices,
            args=(case, options, steps, warmup),
            timeout_s=1800.0,
        )[0]
        profile = r.pop("profile")
        if profiles:
            os.makedirs(profiles, exist_ok=True)
            save_profile(profile, os.path.join(profiles, f"launch-{i + 1}.json"))
        r |= {
            "profile": _figures(profile),
            "measured_s": statistics.median(r["step_times_s"]),
            "load_average": [load, os.getloadavg()[0]],
            "wall_s": time.perf_counter() - t0,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        out.append(r)
        print(
            f"launch {i + 1}/{launches}: predicted {r['predicted_s'] * 1e3:.1f} ms, measured "
            f"{r['measured_s'] * 1e3:.1f} ms ({r['error']:+.0%}), load "
            f"{r['load_average'][0]:.2f} -> {r['load_average'][1]:.2f}",
            flush=True,
        )
    return {
        "case": {"model": case.model, "num_devices": case.num_devices},
        "plan": f"dp{case.num_devices} tp1 pp1 B1",
        "steps": steps,
        "warmup": warmup,
        "block": BLOCK,
        "launches": out,
        **floors(out),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=DEFAULT_PROCS)
    ap.add_argument(
        "--model", default=DEFAULT_MODEL, help="a local-suite model: gpt, moe"
    )
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--json", help="write the launches and the floors to this file")
    ap.add_argument(
        "--profiles", help="write each launch's profile into this directory"
    )
    args = ap.parse_args(argv)
    cases = [
        c for c in LOCAL_CASES if c.num_devices == args.procs and c.suite == args.model
    ]
    if not cases:
        known = sorted({(c.suite, c.num_devices) for c in LOCAL_CASES})
        ap.error(f"no local-suite case {args.model} on {args.procs}; cases: {known}")
    if args.launches < 2:
        ap.error("--launches must be at least 2: the floors compare launches")
    doc = run_noise(cases[0], args.launches, profiles=args.profiles)
    print(
        f"measured {doc['measured_range_s'][0] * 1e3:.1f}..{doc['measured_range_s'][1] * 1e3:.1f}"
        f" ms, predicted {doc['predicted_range_s'][0] * 1e3:.1f}.."
        f"{doc['predicted_range_s'][1] * 1e3:.1f} ms; no calibration of these prices keeps "
        f"every launch within {doc['calibrated_floor']:.0%} (one fixed prediction: "
        f"{doc['constant_floor']:.0%}); median block spread within a launch "
        f"{doc['block_spread_median']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
