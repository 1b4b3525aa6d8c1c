"""The markdown report made from the results files of the benchmark suites.

`write_report` reads every results file under `benchmarks/results/` (`benchmarks.records`) and writes
`benchmarks/results/REPORT.md`: per suite and device a table (automatic plan, best manual
configuration, ratio, measured numbers of the reference), a figure of TFLOP/s per device against
devices (automatic vs manual, predicted, and measured where the reference has them; needs matplotlib,
the `bench` extra), and for GPT the cost model's error on Megatron's listed configurations. The
local measured suite's section (predicted against measured step time) comes from
`benchmarks.local_report`. The published measured runs' section (predicted against measured, with
the fit kept apart) comes from `benchmarks.published`.

    python -m benchmarks.report [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.llama_report import llama_checks, long_context_table, published_table
from benchmarks.local_report import local_section
from benchmarks.published import section as published_section
from benchmarks.records import RESULTS, TIE, load_results


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _stages(case: dict[str, Any]) -> str:
    return " ".join(
        f"{s['layers'][0]}-{s['layers'][1]}@{s['logical_mesh'][0]}x{s['logical_mesh'][1]}"
        + {True: "rc", "full": "rc", "selective": "sel"}.get(s["recompute"], "")
        for s in case["auto"]["stages"]
    )


def _plan_shape(case: dict[str, Any]) -> str:
    if not case["auto"]["stages"]:
        return "does not fit"
    return f"B={case['auto']['num_microbatches']}; {_stages(case)}"


def suite_table(doc: dict[str, Any]) -> list[str]:
    """Markdown table of one results document."""
    measured = any("measured_tflops_per_device" in c for c in doc["cases"])
    head = (
        "| GPUs | model | auto TFLOP/s | auto plan (B; layers@mesh) | plan s | best manual | "
        "manual TFLOP/s | ratio | bound TFLOP/s | max ratio |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|---|"
    if measured:
        names = list(doc["cases"][0].get("measured_tflops_per_device", {}))
        head += "".join(f" measured {n} |" for n in names)
        rule += "---|" * len(names)
    out = [head, rule]
    for c in doc["cases"]:
        m, bound = c["manual_best"], c.get("ceiling", {})
        row = (
            f"| {c['num_devices']} | {c['model']} | {_f(c['auto']['tflops_per_device'])} | "
            f"{_plan_shape(c)} | {_f(c['auto']['planner_time_s'])} | "
            f"{m.get('label', 'none fits')} | {_f(m.get('tflops_per_device'))} | {_f(c['ratio'], '.2f')} | "
            f"{_f(bound.get('tflops_per_device'))} | {_f(bound.get('max_ratio'), '.2f')} |"
        )
        if measured:
            row += "".join(
                f" {_f(v)} |" for v in c.get("measured_tflops_per_device", {}).values()
            )
        out.append(row)
    return out


def listed_table(doc: dict[str, Any]) -> list[str]:
    """Predicted vs measured TFLOP/s of Megatron's listed configurations (GPT on V100s)."""
    rows = [c for c in doc["cases"] if c.get("megatron_listed")]
    if not rows:
        return []
    out = [
        "| GPUs | model | dp x tp x pp, micro-batches | predicted TFLOP/s | measured TFLOP/s | error | fits (predicted) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        m = c["megatron_listed"]
        k = m["config"]
        err = m["relative_error"]
        out.append(
            f"| {c['num_devices']} | {c['model']} | {k['dp']} x {k['tp']} x {k['pp']}, {k['microbatches']} | "
            f"{_f(m['predicted_tflops_per_device'])} | {_f(m['measured_tflops_per_device'])} | "
            f"{'-' if err is None else f'{err:+.0%}'} | {m['fits']} |"
        )
    return out


def figure(doc: dict[str, Any], path: Path) -> bool:
    """TFLOP/s per device against devices: auto and best manual (predicted), measured where known.
    False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = doc["cases"]
    x = [c["num_devices"] for c in cases]
    # cases of the same device count (the llama suite's two on 8 GPUs) are placed one by one
    ticks = [f"{n}" for n in x]
    if len(set(x)) < len(x):
        ticks = [
            f"{n}\n{c['model'] if ',seq=' not in c['model'] else 'seq ' + c['model'].split(',seq=')[-1]}"
            for n, c in zip(x, cases)
        ]
        x = list(range(len(cases)))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(
        x,
        [c["auto"]["tflops_per_device"] or float("nan") for c in cases],
        "o-",
        label="auto (predicted)",
    )
    ax.plot(
        x,
        [c["manual_best"].get("tflops_per_device") or float("nan") for c in cases],
        "s-",
        label="best manual (predicted)",
    )
    published = [  # the llama suite's priced published configurations that fit
        (xi, p["tflops_per_device"])
        for xi, c in zip(x, cases)
        for p in c.get("published", [])
        if p.get("priced") and p["fits"]
    ]
    if published:
        ax.plot(*zip(*published), "D", label="published config (predicted)")
    for name in cases[0].get("measured_tflops_per_device", {}):
        ys = [c["measured_tflops_per_device"].get(name) for c in cases]
        ax.plot(
            x,
            [float("nan") if y is None else y for y in ys],
            "x--",
            label=f"{name} (measured)",
        )
    if ticks == [str(v) for v in x]:
        ax.set_xscale("log", base=2)
    ax.set_xticks(x, ticks, fontsize=7)
    ax.set_xlabel("devices")
    ax.set_ylabel("TFLOP/s per device")
    ax.set_title(f"{doc['suite']} on {doc['device']}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def checks(docs: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, evaluated on the results present (nothing is tuned to them): (a) and
    (b) on every device's suites, (c) on the V100 GPT suite (the reference measured V100s)."""
    suites = [d for d in docs if d["suite"] not in ("local", "llama")]
    v100 = [d for d in suites if d["device"] == "V100-16GB"]

    def misses(cases: list[dict[str, Any]], low: float) -> str:
        # No manual configuration fits (ratio None) while the automatic plan does: target met.
        bad = [
            c
            for c in cases
            if (c["ratio"] is None and not c["auto"].get("fits", True))
            or (c["ratio"] is not None and c["ratio"] < low * (1 - TIE))
        ]
        if not cases:
            return "no case run"
        return (
            "yes"
            if not bad
            else "no: "
            + ", ".join(f"{c['num_devices']} GPUs {_f(c['ratio'], '.2f')}" for c in bad)
        )

    def unreachable(cases: list[dict[str, Any]], low: float) -> str:
        # Cases where no plan at all can reach `low` under the cost models (`benchmarks.ceiling`).
        capped = [
            c
            for c in cases
            if (c.get("ceiling") or {}).get("max_ratio") is not None
            and c["ceiling"]["max_ratio"] < low
        ]
        if not capped:
            return ""
        return f"; no plan can reach {low} at " + ", ".join(
            f"{c['num_devices']} GPUs (max {c['ceiling']['max_ratio']:.2f})"
            for c in capped
        )

    out = []
    for device in sorted({d["device"] for d in suites}):
        on = [d for d in suites if d["device"] == device]
        gpt = [c for d in on if d["suite"] == "gpt" for c in d["cases"]]
        if gpt:
            out.append(
                f"- (a) every GPT case on {device} has ratio >= 1.00: {misses(gpt, 1.0)}"
            )
        for suite in ("moe", "wresnet"):
            big = [
                c
                for d in on
                if d["suite"] == suite
                for c in d["cases"]
                if c["num_devices"] >= 16
            ]
            if big:
                out.append(
                    f"- (b) {suite} on {device} at >= 16 GPUs has ratio >= 1.3: "
                    f"{misses(big, 1.3)}{unreachable(big, 1.3)}"
                )
    gpt = [c for d in v100 if d["suite"] == "gpt" for c in d["cases"]]
    errs = [c["megatron_listed"] for c in gpt if c.get("megatron_listed")]
    if errs:
        worst = max(abs(m["relative_error"]) for m in errs)
        ok = "yes" if worst <= 0.15 else "no"
        out.append(
            f"- (c) predicted TFLOP/s of Megatron's listed configurations within 15% of measured: "
            f"{ok} (largest error {worst:.0%})"
        )
    return out


def gpu_section(directory: Path) -> list[str]:
    """Tables of `benchmarks/bench_gpu.py`'s files (``gpu-*.json``): measured on one GPU."""
    out: list[str] = []
    for f in sorted(directory.glob("gpu-*.json")):
        doc = json.loads(f.read_text())
        out += [
            f"## Measured on one GPU: {doc['gpu']} ({f.stem})",
            "",
            (
                f"File `{f.name}` (`python -m benchmarks.bench_gpu`), {doc['date']}, torch "
                f"{doc['torch']}. Planned for {doc['planned_for']} (the preset's cost models "
                "as they were that day); "
                "runtime = meshplan's compiled runtime on one NCCL rank, reference = the same "
                "model in plain eager PyTorch; medians of the timed steps, Adam, bfloat16. "
                "error = (predicted - runtime) / runtime. runtime's kernels = the time the GPU was "
                "busy in one more runtime step under torch's profiler; profile-priced = the same "
                "configuration priced with this GPU's `meshplan profile` attached."
            ),
            "",
            (
                "| model | batch | micro-batches | predicted ms | runtime ms | reference ms | error "
                "| runtime / reference | runtime's kernels ms | predicted peak / measured GiB "
                "| profile-priced ms |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in doc["cases"]:
            busy = c.get("kernels", {}).get("runtime", {}).get("busy_s")
            mem = c.get("memory")
            out.append(
                f"| {c['model']} | {c['global_batch']} | {c['num_microbatches']} | "
                f"{c['predicted_s'] * 1e3:.1f} | {c['runtime_s'] * 1e3:.1f} | "
                f"{c['reference_s'] * 1e3:.1f} | {c['prediction_error']:+.0%} | "
                f"{c['runtime_over_reference']:.2f} | "
                + (f"{busy * 1e3:.1f}" if busy else "-")
                + " | "
                + (
                    f"{mem['predicted_bytes'] / 2**30:.2f} / {mem['measured_bytes'] / 2**30:.2f} "
                    f"({mem['predicted_bytes'] / mem['measured_bytes'] - 1:+.0%})"
                    if mem
                    else "-"
                )
                + " | "
                + (
                    f"{c['predicted_profile_s'] * 1e3:.1f} ({c['profile_error']:+.0%})"
                    if "predicted_profile_s" in c
                    else "-"
                )
                + " |"
            )
        out.append("")
        if doc.get("breakdown"):
            out += _breakdown_table(doc["breakdown"])
    return out


def transfer_section(directory: Path) -> list[str]:
    """`benchmarks/gpu_transfer.py`'s fits (``transfer-*.json``): a GPU's memory-bound
    efficiency from its eager steps and the kernels of the same chip with other memory."""
    out: list[str] = []
    for f in sorted(directory.glob("transfer-*.json")):
        doc = json.loads(f.read_text())
        src, dst = doc["source"], doc["target"]
        loo = [c["efficiency_without"] for c in doc["cases"]]
        out += [
            f"## {dst}'s memory-bound efficiency from the {src}'s kernels ({f.stem})",
            "",
            (
                f"File `{f.name}` (`python -m benchmarks.gpu_transfer`): the same models' steps in "
                f"eager PyTorch on both GPUs, the {dst}'s predicted as the {src}'s with its "
                f"memory-bound and optimizer kernels (bound) k times as long. k = {doc['k']:.4f} "
                f"(their datasheet bandwidths' ratio: {doc['bandwidth_ratio']:.4f}), so {dst}'s "
                f"memory efficiency is {doc['memory_efficiency']:.4f} of its bandwidth "
                f"({src}: {doc['source_efficiency']:.4f}; leave-one-out {min(loo):.4f} to "
                f"{max(loo):.4f})."
            ),
            "",
            f"| model | {src} ms | bound ms | {dst} ms | at the bandwidth ratio | left out |",
            "|---|---|---|---|---|---|",
        ]
        for c in doc["cases"]:
            t = c["target_step_s"]
            out.append(
                f"| {c['model']} | {c['source_step_s'] * 1e3:.1f} | {c['bound_s'] * 1e3:.1f} | "
                f"{t * 1e3:.1f} | {c['at_ratio_s'] * 1e3:.1f} ({c['at_ratio_s'] / t - 1:+.1%}) | "
                f"{c['left_out_s'] * 1e3:.1f} ({c['left_out_s'] / t - 1:+.1%}) |"
            )
        out.append("")
    return out


def _breakdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """The step by kind of work, predicted / measured ms (`benchmarks.gpu_breakdown`)."""
    from benchmarks.gpu_breakdown import KINDS

    out = [
        (
            "By kind of work (`python -m benchmarks.gpu_breakdown FILE`; predicted on the presets "
            "committed with this file, optimizer included, which the plans' estimates recorded "
            "above left out: since 2026-12-01 they hold it, `python -m benchmarks.bench_gpu "
            "--reprice FILE` prices them again; host = the runtime's step less its kernels' "
            "busy time), predicted / measured ms:"
        ),
        "",
        "| model | " + " | ".join(KINDS) + " | step |",
        "|---|" + "---|" * (len(KINDS) + 1),
    ]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        cells = [f"{p[k] * 1e3:.1f} / {m[k] * 1e3:.1f}" for k in KINDS]
        step = f"{sum(p.values()) * 1e3:.1f} / {sum(m.values()) * 1e3:.1f}"
        out.append(f"| {r['model']} | " + " | ".join(cells) + f" | {step} |")
    out.append("")
    return out


def report(directory: str | Path = RESULTS) -> str:
    """The markdown report of every results document in `directory` (figures written beside it)."""
    directory = Path(directory)
    docs = load_results(directory)
    out = [
        "# Benchmark report: automatic plans vs manual Megatron configurations",
        "",
        (
            "Generated by `benchmarks/report.py` from the JSON files in this folder. All numbers are "
            "predictions of meshplan's cost models for the named clusters, except the columns marked "
            "measured, which are Alpa's authors' measurements on AWS p3.16xlarge (V100) hosts "
            "(../../../shared/reference/alpa-osdi22-suite.md). ratio = best manual iteration time / "
            "automatic iteration time (> 1: the automatic plan is faster; - when no manual configuration fits). Best manual = the fastest "
            "configuration of the grid in `benchmarks/manual_grid.py` that fits in memory. bound "
            "TFLOP/s = what the least iteration time ANY plan can be predicted to take would give "
            "(the whole model's time on one device at the whole batch, ignoring memory, divided by "
            "the devices; `benchmarks/ceiling.py` derives it); max ratio = best manual time / that "
            "least time, so no planner using these cost models can beat the best manual "
            "configuration by more than max ratio. The local "
            "suite's section is measured on this machine's processes (predicted against measured "
            "step time)."
        ),
        "",
    ]
    out += ["## Targets", "", *checks(docs), *llama_checks(docs), ""]
    for doc in docs:
        if doc["suite"] == "local":
            out += local_section(doc, directory)
            continue
        out += [
            f"## {doc['suite']} on {doc['device']}",
            "",
            (
                f"File `{doc['file']}`; planned on {doc.get('machine', '?')}, {doc.get('date', '?')}, "
                f"torch {doc.get('torch', '?')}; the suite took {_f(doc.get('total_time_s'), '.0f')} s."
                + (f" {doc['note']}." if doc.get("note") else "")
                + "".join(
                    f" Re-run on {r['date']} (torch {r['torch']}, {_f(r['total_time_s'], '.0f')} s): "
                    f"{', '.join(map(str, r['num_devices']))} GPUs."
                    for r in doc.get("reruns", [])
                )
            ),
            "",
            *suite_table(doc),
            "",
        ]
        name = f"{Path(doc['file']).stem}.png"
        if figure(doc, directory / name):
            out += [f"![{doc['suite']} on {doc['device']}]({name})", ""]
        published = published_table(doc)
        if published:
            out += [*published, ""]
        long = long_context_table(doc)
        if long:
            out += [*long, ""]
        listed = listed_table(doc)
        if listed:
            out += [
                "Megatron-LM's listed best configurations (recomputation on), predicted vs measured:",
                "",
                *listed,
                "",
            ]
    out += published_section(directory)
    out += gpu_section(directory)
    out += transfer_section(directory)
    return "\n".join(out)


def write_report(directory: str | Path = RESULTS) -> Path:
    """Write `REPORT.md` in `directory`; returns its path."""
    path = Path(directory) / "REPORT.md"
    path.write_text(report(directory))
    return path


if __name__ == "__main__":
    print(write_report(sys.argv[1] if len(sys.argv) > 1 else RESULTS))
