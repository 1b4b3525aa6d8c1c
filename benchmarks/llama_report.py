"""The llama suite's part of the report (`benchmarks.report`): the published torchtitan and
Megatron-Core configurations of each case next to the automatic plan and the grid's best, and the
suite's targets (issue 21): the automatic plan predicted at least as fast as the best
configuration of today's grid in every case, and no published configuration predicted faster
(one predicted not to fit in the device's memory is listed apart: the runtime could not run it);
and for the long-context case (`benchmarks.suites.LONG_CONTEXT`) the best plans with and
without context parallelism."""

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
            "configuration is predicted not to fit. Megatron-Core's runs without FSDP shard the "
            "optimizer state (its distributed optimizer, marked dist-opt): priced with "
            '`manual_plan(fsdp="zero2")`, the same collectives and memory.'
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
    # a configuration predicted not to fit is no plan the runtime could run: listed apart
    faster, unfit = [], []
    for c in cases:
        for p in c.get("published", []):
            if p.get("vs_auto") is not None and p["vs_auto"] < 1 - TIE:
                line = f"{name(c)}: {p['system']} {p['label']} ({p['vs_auto']:.3f}"
                if p.get("fits", True):
                    faster.append(line + ")")
                else:
                    gib = p["peak_memory_bytes"] / 2**30
                    unfit.append(line + f", needs {gib:.1f} GiB)")
    long = [
        f"{name(c)}: automatic {_f(c['auto']['iteration_time_s'])} s "
        f"with CP allowed (CP {c['auto'].get('context_parallel', '-')}), "
        f"{_f(c['without_cp']['auto']['iteration_time_s'])} s without; grid best "
        f"{_f(c['manual_best']['iteration_time_s'])} s with CP allowed "
        f"({c['manual_best'].get('label', 'none fits')}), "
        f"{_f(c['without_cp']['manual_best']['iteration_time_s'])} s without"
        for c in cases
        if "without_cp" in c
    ]
    priced = sum(p.get("priced", False) for c in cases for p in c.get("published", []))
    listed = sum(len(c.get("published", [])) for c in cases)
    return [
        "- (llama) auto ratio >= 1.00 against the best of today's grid in every case: "
        + ("yes" if not slow else "no: " + ", ".join(slow))
        + (f" (no automatic plan fits: {', '.join(none)})" if none else ""),
        f"- (llama) no published configuration that fits predicted faster than the automatic "
        f"plan ({priced} of {listed} priced): "
        + ("yes" if not faster else "no: " + "; ".join(faster))
        + (f" (predicted faster but not fitting: {'; '.join(unfit)})" if unfit else ""),
        *(f"- (llama) long context, best with and without CP: {x}" for x in long),
    ]


def _auto_plan(a: dict[str, Any]) -> str:
    """An automatic plan in one line: its stages (layers @ logical mesh, recomputation)."""
    if a["iteration_time_s"] is None:
        return "none fits"
    stages = " ".join(
        f"{s['layers'][0]}-{s['layers'][1]}@{s['logical_mesh'][0]}x{s['logical_mesh'][1]}"
        + ("" if s["recompute"] == "none" else f" rc {s['recompute']}")
        for s in a["stages"]
    )
    return f"B={a['num_microbatches']} {stages}"


def long_context_table(doc: dict[str, Any]) -> list[str]:
    """For each long-context case (a record with `without_cp`): the automatic plan and the grid's
    best, each with context parallelism allowed and without it."""
    cases = [c for c in doc["cases"] if "without_cp" in c]
    if not cases:
        return []
    out = [
        (
            "Long context: the best plans with and without context parallelism (CP). Automatic "
            "without CP = `plan(context_parallel=False)` (no attention split along the sequence); "
            "grid without CP = today's grid less its CP configurations. CP = the largest CP "
            "degree the plan uses (1: none)."
        ),
        "",
        "| GPUs | model | search | CP allowed | plan | CP | predicted s | TFLOP/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        for allowed, r in (("yes", c), ("no", c["without_cp"])):
            a, m = r["auto"], r["manual_best"]
            mem = a.get("peak_memory_bytes")
            out.append(
                f"| {c['num_devices']} | {c['model']} | automatic | {allowed} | {_auto_plan(a)} | "
                f"{a.get('context_parallel', '-')} | {_f(a['iteration_time_s'])} | "
                f"{_f(a['tflops_per_device'], '.1f')} | "
                f"{'-' if mem is None else f'{mem / 2**30:.1f}'} |"
            )
            mem = m.get("peak_memory_bytes")
            cp = (m["config"] or {}).get("context_parallel", 1) if m["config"] else "-"
            out.append(
                f"| {c['num_devices']} | {c['model']} | grid best | {allowed} | "
                f"{m.get('label', 'none fits')} | {cp} | {_f(m['iteration_time_s'])} | "
                f"{_f(m.get('tflops_per_device'), '.1f')} | "
                f"{'-' if mem is None else f'{mem / 2**30:.1f}'} |"
            )
        cp = c["manual_best"].get("context_parallel")
        if cp:
            lean = cp["leanest"]
            out += [
                "",
                f"The grid priced {cp['priced']} configurations with CP for this case; "
                f"{cp['fitted']} fit"
                + (
                    f", the fastest {cp['best']['label']} ({_f(cp['best']['iteration_time_s'])} s)"
                    if cp["best"]
                    else ""
                )
                + (
                    f"; the one predicted to need the least memory is {lean['label']} "
                    f"({lean['peak_memory_bytes'] / 2**30:.1f} GiB per device, "
                    f"{_f(lean['iteration_time_s'])} s)"
                    if lean
                    else ""
                )
                + ".",
            ]
    return out
