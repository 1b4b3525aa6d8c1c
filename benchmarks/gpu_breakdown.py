"""Where one GPU's training step goes, predicted against measured, by kind of work.

    python -m benchmarks.gpu_breakdown benchmarks/results/gpu-H200-141GB.json

Reads a `benchmarks.bench_gpu` result recorded with ``--kernels`` (no GPU needed) and, for each
case, prices the plan it ran (the same configuration re-planned by `planner.plans.manual` on the
preset it was planned for) op by op (`planner.intra.prices.compute_time`, every node under the
plan's strategy, times the micro-batches), and sorts the runtime's measured kernels by name into
the same kinds:

========== ================================================= ==================================
kind       predicted                                         measured (kernel names)
========== ================================================= ==================================
products   matrix products (``kind == "matmul"``)            cuBLAS/cuBLASLt GEMMs (``nvjet``,
                                                             ``gemm``, ``xmma``)
attention  fused attention (``scaled_dot_product``)          ``flash``, ``fmha``, ``attention``
memory     every other op (elementwise, norms, softmax,      every other kernel
           loss, embedding): the memory roofline
optimizer  `cost_models.compute.optimizer_step_time` on the  ``multi_tensor_apply``, ``fused_adam``,
           plan's parameters                                 ``fused_sgd``
host       0: the roofline assumes the host queues kernels   the runtime's median step less the
           ahead of the device                               profiled step's GPU busy time
========== ================================================= ==================================

So the prediction's error splits into the kinds that carry it. Results recorded before
``by_kind`` existed (`benchmarks.bench_gpu.kernel_summary`) are sorted from their ``by_name`` list
(the 40 longest kernels); what it leaves out counts as memory.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

KINDS = ("products", "attention", "memory", "optimizer", "host")
_KERNEL_WORDS = (
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "fusedadam", "fused_sgd")),
    ("products", ("nvjet", "gemm", "xmma")),
)


def kernel_kind(name: str) -> str:
    """The kind of work a CUDA kernel of this name does (module docstring's table)."""
    low = name.lower()
    for kind, words in _KERNEL_WORDS:
        if any(w in low for w in words):
            return kind
    return "memory"


def kernels_by_kind(names: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Seconds per kind (not host) of (kernel name, seconds) pairs."""
    out = dict.fromkeys(KINDS[:-1], 0.0)
    for name, s in names:
        out[kernel_kind(name)] += s
    return out


def read_result(path: str, tool: str) -> dict[str, Any]:
    """The `benchmarks.bench_gpu` result (``--json FILE``) at `path`, or an exit that names the
    file and what is wrong with it, prefixed by `tool`."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"{tool}: cannot read {path} ({exc}); give a JSON file "
            "`python -m benchmarks.bench_gpu --json FILE` wrote"
        ) from None
    if not isinstance(result, dict) or not {"cases", "planned_for"} <= result.keys():
        raise SystemExit(f"{tool}: {path} is not a bench_gpu result")
    return result


def measured(case: dict[str, Any]) -> dict[str, float]:
    """Seconds per kind the runtime's profiled step spent (module docstring)."""
    k = case["kernels"]["runtime"]
    if "by_kind" in k:
        out = dict(k["by_kind"])
    else:
        out = kernels_by_kind([(e["name"], e["s"]) for e in k["by_name"]])
        out["memory"] += k["kernel_s"] - sum(out.values())
    out["host"] = max(case["runtime_s"] - k["busy_s"], 0.0)
    return out


def predicted(case: dict[str, Any], planned_for: str) -> dict[str, float]:
    """Seconds per kind of the case's configuration (on one device, as bench_gpu runs it)
    priced op by op on the preset."""
    import torch

    from cost_models.cluster import Cluster
    from cost_models.communication import LogicalMesh
    from cost_models.compute import optimizer_step_time
    from planner.intra.prices import Option, StageSettings, compute_time
    from planner.plans.manual import manual_plan
    from planner.tracing.attention import FUSED_ATTENTION
    from planner.tracing.inputs import resolve_model
    from planner.vocab.strategy import strategy_from_json

    cluster = Cluster.from_spec(planned_for)
    B = case["num_microbatches"]
    p = manual_plan(
        case["model"],
        cluster,
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=B,
        global_batch=case["global_batch"],
        dtype=torch.bfloat16,
        optimizer=case.get("optimizer", "adam_16bit"),
        allow_oom=True,
    )
    _, source, _ = resolve_model(case["model"], None, torch.bfloat16, None)
    graph = source.trace(case["global_batch"] // B)
    out = dict.fromkeys(KINDS, 0.0)
    for stage in p.stages:
        mesh = LogicalMesh(cluster, tuple(stage.submesh), tuple(stage.logical_mesh))
        settings = StageSettings(mesh=mesh, num_microbatches=B, optimizer=p.optimizer)
        for name, st in stage.node_strategies.items():
            node = graph.node(name)
            if node.op != "call":
                continue
            strategy = strategy_from_json(st)
            kind = (
                "attention"
                if node.target.startswith(FUSED_ATTENTION)
                else "products"
                if node.kind == "matmul"
                else "memory"
            )
            out[kind] += B * compute_time(node, Option(strategy), settings)
    out["optimizer"] = optimizer_step_time(cluster, graph.num_params, p.optimizer)
    return out


def breakdown(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case of a bench_gpu result: model, and per kind predicted and measured seconds."""
    return [
        {
            "model": c["model"],
            "predicted": predicted(c, result["planned_for"]),
            "measured": measured(c),
        }
        for c in result["cases"]
        if "kernels" in c
    ]


def _current(device: str) -> dict[str, float]:
    """`device`'s memory-bound and fused-attention efficiencies as `cost_models.compute` has
    them (the names `fit` returns)."""
    from cost_models.compute import FUSED_ATTENTION_E, memory_efficiency

    if device not in FUSED_ATTENTION_E:
        raise SystemExit(
            f"gpu_breakdown --fit: {device} has no FUSED_ATTENTION_E entry in "
            "cost_models/compute.py; give it a provisional one, fit, and fit again"
        )
    return {
        "memory_efficiency": memory_efficiency(device),
        "fused_attention_e": FUSED_ATTENTION_E[device],
    }


def fit(rows: list[dict[str, Any]], device: str) -> dict[str, float]:
    """The memory-bound efficiency and the fused-attention efficiency of `device` that make the
    predicted seconds of those kinds over `rows` equal the measured ones: each constant's
    current value times predicted / measured (the optimizer's kernels count as memory-bound;
    both kinds' prices are inversely proportional to their constant, so the fit is a fixed
    point: run again on the fitted constants, it returns them)."""
    current = _current(device)

    def total(kinds: tuple[str, ...], side: str) -> float:
        return sum(r[side][k] for r in rows for k in kinds)

    memory = ("memory", "optimizer")
    return {
        "memory_efficiency": current["memory_efficiency"]
        * total(memory, "predicted")
        / total(memory, "measured"),
        "fused_attention_e": current["fused_attention_e"]
        * total(("attention",), "predicted")
        / total(("attention",), "measured"),
    }


def leave_one_out(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """Per row: the constants fitted to the other rows, and the row's predicted step (every
    kind, the host's 0 included; its prices scaled from the device's current constants to
    those) against its measured step."""
    current = _current(device)
    out = []
    for i, r in enumerate(rows):
        loo = fit(rows[:i] + rows[i + 1 :], device)
        p = dict(r["predicted"])
        for k in ("memory", "optimizer"):
            p[k] *= current["memory_efficiency"] / loo["memory_efficiency"]
        p["attention"] *= current["fused_attention_e"] / loo["fused_attention_e"]
        step, measured_step = sum(p.values()), sum(r["measured"].values())
        out.append(
            {
                "model": r["model"],
                **loo,
                "predicted_s": step,
                "measured_s": measured_step,
                "error": step / measured_step - 1,
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'model':<37} {'kind':<10} {'predicted':>10} {'measured':>10}  error"
    lines = [head, "-" * len(head)]
    for r in rows:
        for kind in (*KINDS, "total"):
            if kind == "total":
                p, m = sum(r["predicted"].values()), sum(r["measured"].values())
            else:
                p, m = r["predicted"][kind], r["measured"][kind]
            err = f"{p / m - 1:+.0%}" if m > 0 else "-"
            lines.append(
                f"{r['model'] if kind == 'products' else '':<37} {kind:<10} "
                f"{p * 1e3:>7.2f} ms {m * 1e3:>7.2f} ms  {err}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench_gpu --json result recorded with --kernels")
    ap.add_argument(
        "--fit",
        action="store_true",
        help="also fit the device's memory-bound and fused-attention efficiencies, leave-one-out",
    )
    args = ap.parse_args(argv)
    result = read_result(args.result, "gpu_breakdown")
    rows = breakdown(result)
    if not rows:
        raise SystemExit(
            f"gpu_breakdown: {args.result} has no case recorded with --kernels"
        )
    print(f"{result.get('gpu', '?')}, planned for {result['planned_for']}")
    print(table(rows))
    if args.fit:
        device = result["planned_for"].split("x", 2)[2]
        got = fit(rows, device)
        print(
            f"fitted on all {len(rows)}: memory efficiency {got['memory_efficiency']:.4f}, "
            f"fused attention {got['fused_attention_e']:.4f} of peak"
        )
        for r in leave_one_out(rows, device):
            print(
                f"  without {r['model']}: memory {r['memory_efficiency']:.4f}, attention "
                f"{r['fused_attention_e']:.4f}; its step {r['predicted_s'] * 1e3:.1f} ms "
                f"against {r['measured_s'] * 1e3:.1f} ms measured ({r['error']:+.1%})"
            )


if __name__ == "__main__":
    main()
