"""A GPU's memory-bound efficiency fitted from its steps and the kernels of the same chip with other memory.

    python -m benchmarks.gpu_transfer benchmarks/results/gpu-H100-80GB.json \\
        --source benchmarks/results/gpu-H200-141GB.json benchmarks/results/gpu-H200-141GB-fit.json

The H100-80GB and the H200-141GB are one chip (GH100: 132 SMs at the same clocks, so the same
FLOP/s) with different memory: 80 GB of HBM3 at 3.35 TB/s against 141 GB of HBM3e at 4.8 TB/s
(`cost_models.cluster.PRESETS`). The source GPU's steps were recorded kernel by kernel
(`benchmarks.bench_gpu --kernels`, sorted into kinds by `benchmarks.gpu_breakdown`); the target's
only step by step, on the same models under the same torch. The target's steps then say how much
longer its bandwidth-bound kernels take. For model ``m``:

    target_step(m) = source_step(m) + (k - 1) * bound(m)

``bound(m)``: the source step's memory-bound and optimizer kernels (those `gpu_breakdown` prices
by bytes moved); the matrix products and attention, which run on the same SMs at the same clocks,
and the host's time are taken as the same on both. ``k`` is the one unknown: least squares in the
relative error of the target's steps, in closed form

    k - 1 = sum_m (b_m (1 - s_m)) / sum_m b_m^2,   s_m = source_step / target_step,
                                                    b_m = bound / target_step,

and leave-one-out (each model predicted by the ``k`` of the others). Kernels that reach the same
fraction of either GPU's datasheet bandwidth give ``k = BW_source / BW_target``; so the target's
memory-bound efficiency (`cost_models.compute.DEVICE_MEMORY_EFFICIENCY`, a fraction of its
datasheet bandwidth) is ``source_efficiency * (BW_source / BW_target) / k``.

The steps compared are the plain eager PyTorch reference's (``reference_s``), not the runtime's: the
reference ran the same code on both GPUs, where the runtime changed between the two measurements
(`bench_gpu`'s H100 run came before the runtime stopped waiting for each loss).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from benchmarks.gpu_breakdown import kernels_by_kind, read_result
from cost_models.cluster import Cluster, DeviceSpec
from cost_models.compute import memory_efficiency
from cost_models.errors import MeshplanError


def _device(result: dict[str, Any]) -> DeviceSpec:
    """The preset device `result` was planned for."""
    try:
        return Cluster.from_spec(result["planned_for"]).device
    except MeshplanError as exc:
        raise SystemExit(f"gpu_transfer: {exc}") from None


def source_rows(
    sources: Sequence[dict[str, Any]], side: str = "reference"
) -> dict[str, tuple[float, float]]:
    """Per model, the mean over `sources` of its `side` step (``reference`` or ``runtime``) and
    of that step's memory-bound and optimizer kernels (seconds)."""
    seen: dict[str, list[tuple[float, float]]] = {}
    for result in sources:
        for c in result["cases"]:
            k = c.get("kernels", {}).get(side)
            if not k:
                continue
            kinds = k.get("by_kind") or kernels_by_kind(
                [(e["name"], e["s"]) for e in k["by_name"]]
            )
            bound = kinds["memory"] + kinds["optimizer"]
            # a result recorded before by_kind names only its 40 longest kernels: the rest
            # counts as memory-bound, as in `gpu_breakdown.measured`
            if "by_kind" not in k:
                bound += k["kernel_s"] - sum(kinds.values())
            seen.setdefault(c["model"], []).append((c[f"{side}_s"], bound))
    return {
        m: (sum(s for s, _ in v) / len(v), sum(b for _, b in v) / len(v))
        for m, v in seen.items()
    }


def fit_k(rows: Sequence[tuple[float, float, float]]) -> float:
    """``k`` of (source step, bound, target step) rows (module docstring's closed form)."""
    num = sum(b / t * (1 - s / t) for s, b, t in rows)
    den = sum((b / t) ** 2 for s, b, t in rows)
    if den <= 0:
        raise SystemExit("gpu_transfer: no bandwidth-bound kernels to scale")
    return 1 + num / den


def transfer(
    target: dict[str, Any], sources: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The fit (module docstring) of `target`'s reference steps on `sources`' kernels: ``k``, the
    bandwidth ratio, the target's fitted memory efficiency, and per model the steps and the
    predictions at the bandwidth ratio and leave-one-out."""
    devices = {d.name: d for d in map(_device, sources)}
    if len(devices) != 1:
        raise SystemExit(
            f"gpu_transfer: the sources are of several GPUs: {sorted(devices)}"
        )
    (source,) = devices.values()
    target_device = _device(target)
    src, dst = source.name, target_device.name
    torches = {r.get("torch") for r in (target, *sources)}
    if len(torches) != 1:
        raise SystemExit(
            f"gpu_transfer: the results ran different torch builds ({sorted(map(str, torches))});"
            " the reference's kernels differ between them"
        )
    per_model = source_rows(sources)
    missing = [c["model"] for c in target["cases"] if c["model"] not in per_model]
    if missing:
        raise SystemExit(
            f"gpu_transfer: no source case recorded with --kernels for {missing}; "
            f"the sources have {sorted(per_model)}"
        )
    runtime = source_rows(sources, "runtime")
    rows = [(*per_model[c["model"]], c["reference_s"]) for c in target["cases"]]
    ratio = (
        source.memory_bandwidth_bytes_per_s / target_device.memory_bandwidth_bytes_per_s
    )
    k = fit_k(rows)
    efficiency = memory_efficiency(src) * ratio
    cases = []
    for i, (c, (s, b, t)) in enumerate(zip(target["cases"], rows)):
        k_loo = fit_k(rows[:i] + rows[i + 1 :]) if len(rows) > 1 else float("nan")
        rs, rb = runtime.get(c["model"], (float("nan"), float("nan")))
        cases.append(
            {
                "model": c["model"],
                "source_step_s": s,
                "bound_s": b,
                "target_step_s": t,
                "at_ratio_s": s + (ratio - 1) * b,
                "k_without": k_loo,
                "efficiency_without": efficiency / k_loo,
                "left_out_s": s + (k_loo - 1) * b,
                # the source's runtime step carried over the same way: what the runtime as the
                # source measured it would take on the target (a projection, not a measurement)
                "target_runtime_s": c.get("runtime_s", float("nan")),
                "runtime_projected_s": rs + (k - 1) * rb,
            }
        )
    return {
        "source": src,
        "target": dst,
        "bandwidth_ratio": ratio,
        "k": k,
        "source_efficiency": memory_efficiency(src),
        "memory_efficiency": efficiency / k,
        "cases": cases,
    }


def table(got: dict[str, Any]) -> str:
    head = (
        f"{'model':<37} {got['source']:>10} {'bound':>8} {got['target']:>10}"
        f" {'at ratio':>15} {'left out':>15}"
    )
    lines = ["eager PyTorch's step (ms)", head, "-" * len(head)]
    for c in got["cases"]:
        t = c["target_step_s"]
        at, out = (
            f"{x * 1e3:6.1f} ({x / t - 1:+.1%})"
            for x in (c["at_ratio_s"], c["left_out_s"])
        )
        lines.append(
            f"{c['model']:<37} {c['source_step_s'] * 1e3:10.1f} {c['bound_s'] * 1e3:8.1f}"
            f" {t * 1e3:10.1f} {at:>15} {out:>15}"
        )
    lines.append(
        f"the runtime's step on the {got['target']} as measured there, and the "
        f"{got['source']}'s carried over by k (projected), ms: "
        + ", ".join(
            f"{c['target_runtime_s'] * 1e3:.1f} / {c['runtime_projected_s'] * 1e3:.1f}"
            for c in got["cases"]
        )
    )
    loo = [c["efficiency_without"] for c in got["cases"]]
    lines.append(
        f"k = {got['k']:.4f} (bandwidth ratio {got['bandwidth_ratio']:.4f}); "
        f"{got['target']} memory efficiency {got['memory_efficiency']:.4f} of its datasheet "
        f"bandwidth ({got['source']}: {got['source_efficiency']:.4f}); leave-one-out "
        f"{min(loo):.4f} to {max(loo):.4f}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "target", help="bench_gpu result of the GPU to fit (step times only)"
    )
    ap.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="bench_gpu results recorded with --kernels on the same chip with other memory",
    )
    ap.add_argument("--json", help="write the fit here")
    args = ap.parse_args(argv)
    got = transfer(
        read_result(args.target, "gpu_transfer"),
        [read_result(p, "gpu_transfer") for p in args.source],
    )
    print(table(got))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
    return got


if __name__ == "__main__":
    main()
