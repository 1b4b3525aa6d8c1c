"""The results documents of the benchmark suites: the pieces of a case record the suites share, and
the results files under `benchmarks/results/` (written, merged and read).

A results document is a JSON object with `suite`, `device`, `machine`, `date` and `cases`
(`benchmarks.suites.run_suite`, `benchmarks.local_suite.run_local_suite`); `benchmarks.report`
makes the markdown report from the files.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from cost_models.errors import MeshplanError
from planner.vocab.context import SDPA, context_axis
from planner.vocab.plan_check import recompute_mode
from planner.vocab.strategy import Strategy

RESULTS = Path(__file__).resolve().parent / "results"
#: Relative difference below which two predicted times are a tie: the same plan priced along two
#: code paths differs by float summation order (~1e-15), e.g. on 1 GPU, where auto and manual agree.
TIE = 1e-9
SDPA_NAME = SDPA._opname  # the attention kernel's node names: this, then _1, _2, ...


def machine() -> str:
    """The machine a suite ran on (the planner's own run; predictions do not depend on it)."""
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()})"


def stage_json(s: Any) -> dict[str, Any]:
    """A plan's stage (`planner.vocab.plan_file`) as recorded in a case: layers and meshes."""
    return {
        "layers": list(s.layers),
        "submesh": list(s.submesh),
        "logical_mesh": list(s.logical_mesh),
        "dp_tp": s.dp_tp,
        "recompute": s.recompute,
    }


def context_degree(plan: Any) -> int:
    """The largest context-parallel degree of a plan's stages: the size of the mesh axis some
    attention node (named after the op `planner.vocab.context.SDPA`, as the tracer names nodes)
    splits along the sequence (`planner.vocab.context.context_axis`); 1 where none does."""
    out = 1
    for s in plan.stages:
        for name, st in s.node_strategies.items():
            if not name.startswith(SDPA_NAME):
                continue
            strategy = Strategy(
                tuple(map(tuple, st["outputs"])), tuple(map(tuple, st["inputs"])), ""
            )
            axis = context_axis(strategy)
            if axis is not None:
                out = max(out, s.logical_mesh[axis])
    return out


def compared(case: dict[str, Any]) -> dict[str, Any]:
    """The manual plan a local case record executed: the runner-up when the grid's best manual
    plan is the automatic plan, else the best."""
    return case.get("runner_up") or case["manual_best"]


def write_results(results: dict[str, Any], path: str | Path) -> Path:
    """Write a suite's results document as JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def order_cases(
    cases: list[dict[str, Any]], order: list[tuple[str, int]] | None = None
) -> list[dict[str, Any]]:
    """`cases` in the suite's order: by position of (model, GPU count) in `order` (the suite's
    `suite_cases`), else by GPU count; ties keep their order."""
    if order is None:
        return sorted(cases, key=lambda c: c["num_devices"])
    rank = {key: i for i, key in enumerate(order)}
    return sorted(
        cases,
        key=lambda c: (rank.get((c.get("model"), c["num_devices"]), len(rank)),),
    )


def merge_results(
    old: dict[str, Any],
    new: dict[str, Any],
    order: list[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """`old` with the cases of `new` (a run of some of the same suite's cases on the same device)
    in place of its cases of the same GPU counts, in the suite's `order` (`order_cases`); the
    run is listed under `reruns` (its date, machine, torch, time and GPU counts), the rest of
    `old` is kept."""
    key = ("suite", "device")
    if [old.get(k) for k in key] != [new.get(k) for k in key]:
        raise MeshplanError(
            f"cannot merge {new.get('suite')} on {new.get('device')} into a results file of "
            f"{old.get('suite')} on {old.get('device')}; give another --json FILE"
        )
    counts = sorted({c["num_devices"] for c in new["cases"]})
    cases = [c for c in old["cases"] if c["num_devices"] not in counts] + new["cases"]
    rerun = {k: new.get(k) for k in ("date", "machine", "torch", "total_time_s")}
    return old | {
        "cases": order_cases(cases, order),
        "reruns": [*old.get("reruns", []), rerun | {"num_devices": counts}],
    }


def load_results(directory: str | Path = RESULTS) -> list[dict[str, Any]]:
    """Every results document (a JSON object with `suite`, `device` and `cases`) in `directory`;
    other JSON files there are ignored."""
    docs = []
    for f in sorted(Path(directory).glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (
            isinstance(doc, dict)
            and isinstance(doc.get("cases"), list)
            and {"suite", "device"} <= set(doc)
        ):
            docs.append(doc | {"file": f.name})
    return docs


#: Fields of a case record that measure the machine that planned it, not the plan.
TIMINGS = ("planner_time_s", "search_time_s")


def record_differences(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """The fields of a case's automatic plan and best manual configuration that differ between two
    records of the case (floats beyond a relative 1e-9), planning times aside: ``[]`` when a
    re-planned case reproduces its committed record."""
    out = []
    for side in ("auto", "manual_best"):
        a, b = new.get(side) or {}, old.get(side) or {}
        for key in sorted((set(a) | set(b)) - set(TIMINGS)):
            x, y = a.get(key), b.get(key)
            if key == "stages":  # records before 2026-11-26 say recompute true/false
                x, y = _modes(x), _modes(y)
            same = (
                abs(x - y) <= 1e-9 * abs(y)
                if isinstance(x, float) and isinstance(y, float)
                else x == y
            )
            if not same:
                out.append(f"{side}.{key}: {y!r} -> {x!r}")
    return out


def _modes(stages: Any) -> Any:
    """Recorded stages with ``recompute`` as a mode (`planner.vocab.plan_check.recompute_mode`:
    true and false are full and none)."""
    if not isinstance(stages, list):
        return stages
    return [
        {**s, "recompute": recompute_mode(s["recompute"])}
        if isinstance(s, dict) and "recompute" in s
        else s
        for s in stages
    ]


def memory_record(plan: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A plan's predicted against measured peak memory in a case record, from every rank's
    `runtime.train.measure_peak_memory`: per rank and per stage (`runtime.train.stage_peaks`),
    the largest predicted and measured peak per device, and ``max_abs_error``, the largest
    |predicted / measured - 1| over the ranks (each against its own stage's prediction)."""
    from runtime.train import stage_peaks

    errors = [abs(r["ratio"] - 1) for r in ranks if r["ratio"] is not None]
    return {
        "predicted_bytes": max(r["predicted_bytes"] for r in ranks),
        "measured_bytes": max(r["measured_bytes"] for r in ranks),
        "max_abs_error": max(errors) if errors else None,
        "stages": stage_peaks(plan, ranks),
        "ranks": ranks,
    }
