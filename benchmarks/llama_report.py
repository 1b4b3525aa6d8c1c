"""The llama suite's part of the report (`benchmarks.report`): the published torchtitan and
Megatron-Core configurations of each case next to the automatic plan and the grid's best, and the
suite's targets (issue 21): the automatic plan predicted at least as fast as the best
configuration of today's grid in every case, and no published configuration predicted faster."""

from __future__ import annotations

from typing import Any

from benchmarks.records import TIE


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def published_table(doc: dict[str, Any]) -> list[str]:
    """One row per published configuration of the suite's cases: priced (predicted time,
    TFLOP/s, memory, vs auto) or the reason it is not."""
    rows = [(c, p) for c in doc["cases"] for p in c.get("published", [])]
    if not rows:
        return []
    out = [
        (
            "Published configurations (`benchmarks/llama_configs.py` gives each source), priced as "
            "published at their own global batch in bfloat16; vs auto = their predicted seconds per "
            "sequence / the automatic plan's (> 1: the automatic plan is faster), also where the "
            "configuration is predicted not to fit. Megatron-Core's runs shard the optimizer "
            "state (distributed optimizer), which manual_plan does not: their memory is overstated."
        ),
        "",
        (
            "| GPUs | model | system | configuration | precision run | predicted s | TFLOP/s | "
            "peak GiB | fits | vs auto | not priced because |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, p in rows:
        mem = p.get("peak_memory_bytes")
        out.append(
            f"| {c['num_devices']} | {p['model']} (seq {p['seq']}) | {p['system']} | {p['label']} | "
            f"{p['precision']} | {_f(p.get('iteration_time_s'))} | "
            f"{_f(p.get('tflops_per_device'), '.1f')} | "
            f"{'-' if mem is None else f'{mem / 2**30:.1f}'} | {p.get('fits', '-')} | "
            f"{_f(p.get('vs_auto'))} | {p.get('reason', '')} |"
        )
    return out


def llama_checks(docs: list[dict[str, Any]]) -> list[str]:
    """The targets on the llama suite's results, as found (nothing is tuned to them)."""
    cases = [c for d in docs if d["suite"] == "llama" for c in d["cases"]]
    if not cases:
        return []

    def name(c: dict[str, Any]) -> str:
        return f"{c['model']} on {c['num_devices']}"

    slow = [
        f"{name(c)} {c['ratio']:.3f}"
        for c in cases
        if c["ratio"] is not None and c["ratio"] < 1 - TIE
    ]
    none = [name(c) for c in cases if c["auto"]["iteration_time_s"] is None]
    faster = [
        f"{name(c)}: {p['system']} {p['label']} ({p['vs_auto']:.3f})"
        for c in cases
        for p in c.get("published", [])
        if p.get("vs_auto") is not None and p["vs_auto"] < 1 - TIE
    ]
    priced = sum(p.get("priced", False) for c in cases for p in c.get("published", []))
    listed = sum(len(c.get("published", [])) for c in cases)
    return [
        "- (llama) auto ratio >= 1.00 against the best of today's grid in every case: "
        + ("yes" if not slow else "no: " + ", ".join(slow))
        + (f" (no automatic plan fits: {', '.join(none)})" if none else ""),
        f"- (llama) no published configuration predicted faster than the automatic plan "
        f"({priced} of {listed} priced): "
        + ("yes" if not faster else "no: " + "; ".join(faster)),
    ]
