"""Predicted against measured step time on one GPU, and the runtime against plain PyTorch.

    python -m benchmarks.bench_gpu                      # needs a CUDA GPU; prints a table
    python -m benchmarks.bench_gpu --device H100-80GB --json benchmarks/results/gpu-H100-80GB.json
    meshplan profile --nproc 1 --op-model gpt:hidden=1024,layers=24,heads=16 --op-batch 2 --out p.json
    python -m benchmarks.bench_gpu --device H200-141GB --profile p.json --kernels --json gpu.json
    python -m benchmarks.bench_gpu --device H200-141GB --kernels --case gpt:hidden=1536,layers=12,heads=12 8

For each model (GPT shapes in bfloat16 on one GPU) the planner plans on ``1x1xDEVICE`` from the
datasheet cost models, as the suites price every case. One NCCL rank then trains two copies of
the same seeded model on the same seeded batches, steps alternating so both see the same machine:

* **runtime**: `runtime.train.Trainer` (compiled stages) on that plan;
* **reference**: the model in plain eager PyTorch, one forward and backward of the global batch.

Both use Adam (``torch.optim.Adam(fused=True)`` on the bfloat16 parameters, as
`runtime.shard_optim` runs it on CUDA: planned as ``adam_16bit``). Per
model: the predicted iteration time, each one's median over the timed steps, the prediction's
error ((predicted - measured) / measured, against the runtime) and the ratio runtime /
reference; and, before those steps, the runtime's peak memory in a training step
(`runtime.train.measure_peak_memory`: ``torch.cuda.max_memory_allocated`` over a step after one
warm step, less what was allocated before the trainer was built) against the plan's predicted
peak per device (``memory``, `benchmarks.records.memory_record`). CI has no GPU: this runs where
one is lent, and its results are committed.

With ``--profile FILE`` (`meshplan profile` of this GPU) the same configuration is also priced on
the preset carrying that profile (``predicted_profile_s``: measured matrix products, bandwidth and,
with ``--op-model``, op rates in place of the datasheet's). With ``--kernels``, one more step of
each (runtime and reference) runs under torch's profiler (`kernel_summary`): the step's wall time,
the time the GPU was busy and its kernels by name, and the device time of each matrix product by
shape, which is what the preset's efficiency terms are checked against; and at the end the step
split by kind of work, predicted against measured (``breakdown``, `benchmarks.gpu_breakdown`).
``--case MODEL BATCH`` (repeatable) measures other models than ``CASES``.
Each case is its own launch; with ``--json`` the file is rewritten after every case.

``--reprice FILE ...`` needs no GPU: it plans every case of committed results again with the
cost models as they are now (`reprice`) and prints the new prediction of step time and peak
memory against the steps those files measured, so that a change of the cost models is checked
against every GPU measurement on record.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from datetime import date
from typing import Any

import torch

from benchmarks.gpu_breakdown import kernels_by_kind, read_result
from cost_models.errors import MeshplanError

CASES = (
    ("gpt:hidden=1024,layers=24,heads=16", 8),
    ("gpt:hidden=2048,layers=8,heads=16", 8),
    ("gpt:hidden=2560,layers=8,heads=32", 16),
)
LR = 1e-4
OPTIMIZER = "adam_16bit"  # what the ranks run: torch.optim.Adam on bfloat16 parameters


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any, *args: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    fn(*args)
    _sync()
    return time.perf_counter() - t0


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy * 1e-6


_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def kernel_summary(fn: Any, *args: Any, top: int = 40) -> dict:
    """Run ``fn(*args)`` once under torch's profiler: ``wall_s``, ``kernels`` (the count),
    ``busy_s`` (the union of the kernels' intervals), ``kernel_s`` (their sum), ``by_name`` (the
    ``top`` kernel names by total time: count and seconds), ``by_kind`` (seconds of every
    kernel by kind of work, `benchmarks.gpu_breakdown.kernel_kind`) and ``products`` (each
    matrix-product op by input shapes: count and its kernels' seconds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts, record_shapes=True) as prof:
        wall = _timed(fn, *args)
    # the device timeline also holds user annotations (the optimizer's step, say) spanning kernels
    kernels = [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    ]
    names: dict[str, list[float]] = {}
    for e in kernels:
        n = names.setdefault(e.name, [0, 0.0])
        n[0] += 1
        n[1] += e.time_range.elapsed_us() * 1e-6
    products = [
        {
            "op": e.key,
            "shapes": e.input_shapes,
            "count": e.count,
            "device_s": e.device_time_total * 1e-6,
        }
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in _PRODUCTS
    ]
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_s": wall,
        "kernels": len(kernels),
        "busy_s": _busy_s([(e.time_range.start, e.time_range.end) for e in kernels]),
        "kernel_s": sum(e.time_range.elapsed_us() for e in kernels) * 1e-6,
        "by_name": [{"name": k, "count": c, "s": t} for k, (c, t) in ranked],
        "by_kind": kernels_by_kind([(k, t) for k, (_, t) in names.items()]),
        "products": sorted(products, key=lambda r: -r["device_s"]),
    }


def _case(
    spec: str,
    batch: int,
    device: str,
    steps: int,
    warmup: int,
    profile: str | None = None,
    kernels: bool = False,
) -> dict:
    """One model on this rank's GPU: plan, then train runtime and reference side by side."""
    from benchmarks.records import memory_record
    from planner.api import plan as make_plan
    from runtime.train import Trainer, measure_peak_memory, seeded_model_and_batches

    t0 = time.perf_counter()
    p = make_plan(
        spec,
        f"1x1x{device}",
        global_batch=batch,
        dtype=torch.bfloat16,
        optimizer=OPTIMIZER,
    )
    planned_s = time.perf_counter() - t0
    dev = torch.device("cuda", torch.cuda.current_device())
    model, batches = seeded_model_and_batches(
        spec, batch, warmup + steps, dtype=torch.bfloat16
    )
    model = model.to(dev)
    batches = [tuple(t.to(dev) for t in b) for b in batches]
    memory = memory_record(
        p,
        measure_peak_memory(
            p, model, batches, device_type="cuda", optimizer="adam", lr=LR
        ),
    )
    trainer = Trainer(p, model, batches[0], optimizer="adam", lr=LR, device_type="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)

    def reference(b: tuple[torch.Tensor, ...]) -> None:
        model(*b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"runtime": [], "reference": []}
    for i, b in enumerate(batches):
        rt, ref = _timed(trainer.step, b), _timed(reference, b)
        if i >= warmup:
            times["runtime"].append(rt)
            times["reference"].append(ref)
    runtime_s = statistics.median(times["runtime"])
    reference_s = statistics.median(times["reference"])
    predicted_s = p.estimate.iteration_time_s
    extra: dict[str, Any] = {}
    if profile:
        extra["predicted_profile_s"] = _priced_on_profile(
            p, spec, device, batch, profile
        )
        extra["profile_error"] = (extra["predicted_profile_s"] - runtime_s) / runtime_s
    if kernels:
        extra["kernels"] = {
            "runtime": kernel_summary(trainer.step, batches[0]),
            "reference": kernel_summary(reference, batches[0]),
        }
    return {
        "model": spec,
        "optimizer": OPTIMIZER,
        "global_batch": batch,
        "num_microbatches": p.num_microbatches,
        "planner_time_s": planned_s,
        "predicted_s": predicted_s,
        "runtime_s": runtime_s,
        "reference_s": reference_s,
        "prediction_error": (predicted_s - runtime_s) / runtime_s,
        "runtime_over_reference": runtime_s / reference_s,
        "ran_compiled": all(
            e.last_run_compiled for e in trainer.runner.executors.values()
        ),
        "step_times_s": times,
        "memory": memory,
        **extra,
    }


def _priced_on_profile(p: Any, spec: str, device: str, batch: int, path: str) -> float:
    """The predicted iteration time of `p`'s configuration on the preset carrying the profile."""
    from cost_models.cluster import Cluster
    from cost_models.profile import load_profile
    from planner.plans.manual import manual_plan

    cluster = Cluster.from_spec(f"1x1x{device}", load_profile(path))
    q = manual_plan(
        spec,
        cluster,
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=p.num_microbatches,
        global_batch=batch,
        dtype=torch.bfloat16,
        optimizer=OPTIMIZER,
        allow_oom=True,
    )
    return q.estimate.iteration_time_s


def reprice(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case of a committed bench_gpu `result`: its configuration planned again on the preset
    it was planned for, as `_case` plans it, with the step time and peak memory it measured."""
    from planner.api import plan as make_plan

    out = []
    for c in result["cases"]:
        p = make_plan(
            c["model"],
            result["planned_for"],
            global_batch=c["global_batch"],
            dtype=torch.bfloat16,
            optimizer=OPTIMIZER,
        )
        predicted = p.estimate.iteration_time_s
        memory = max(s.memory_bytes for s in p.stages)
        measured_memory = (c.get("memory") or {}).get("measured_bytes")
        out.append(
            {
                "model": c["model"],
                "predicted_s": predicted,
                "recorded_predicted_s": c["predicted_s"],
                "runtime_s": c["runtime_s"],
                "error": predicted / c["runtime_s"] - 1,
                "predicted_bytes": memory,
                "measured_bytes": measured_memory,
                "memory_error": memory / measured_memory - 1
                if measured_memory
                else None,
            }
        )
    return out


def _repriced_table(rows: list[dict[str, Any]]) -> str:
    w = max(len("model"), *(len(r["model"]) for r in rows))
    head = (
        f"{'model':<{w}} {'predicted':>10} {'recorded':>9} {'runtime':>9}  error  "
        "memory pred/measured GiB"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        memory = (
            f"{r['predicted_bytes'] / 2**30:.2f}/{r['measured_bytes'] / 2**30:.2f} "
            f"({r['memory_error']:+.1%})"
            if r["measured_bytes"]
            else "-"
        )
        lines.append(
            f"{r['model']:<{w}} {r['predicted_s'] * 1e3:>7.1f} ms "
            f"{r['recorded_predicted_s'] * 1e3:>6.1f} ms {r['runtime_s'] * 1e3:>6.1f} ms "
            f"{r['error']:>+6.1%}  {memory}"
        )
    return "\n".join(lines)


def _rank(*case_args: Any) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "case": _case(*case_args),
    }


def _memory(mem: dict | None) -> str:
    if not mem:
        return "-"
    p, m = mem["predicted_bytes"], mem["measured_bytes"]
    return f"{p / 2**30:.2f}/{m / 2**30:.2f} ({p / m - 1:+.0%})"


def _table(res: dict) -> str:
    head = (
        "model                                 batch  mb  predicted  runtime  reference  error   "
        "rt/ref  memory pred/measured GiB  profile-priced error"
    )
    rows = [head, "-" * len(head)]
    for c in res["cases"]:
        rows.append(
            f"{c['model']:<37} {c['global_batch']:>5}  {c['num_microbatches']:>2}  "
            f"{c['predicted_s'] * 1e3:>7.1f} ms {c['runtime_s'] * 1e3:>6.1f} ms "
            f"{c['reference_s'] * 1e3:>7.1f} ms {c['prediction_error']:>+6.0%}  "
            f"{c['runtime_over_reference']:>5.2f}  {_memory(c.get('memory'))}"
            + (
                f"  {c['predicted_profile_s'] * 1e3:.1f} ms {c['profile_error']:+.0%}"
                if "predicted_profile_s" in c
                else ""
            )
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", default="H100-80GB", help="datasheet device to plan for"
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--case",
        nargs=2,
        action="append",
        metavar=("MODEL", "BATCH"),
        help="a model spec and its global batch instead of the built-in cases (repeatable)",
    )
    ap.add_argument(
        "--profile", help="also price each case on the preset carrying this profile"
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also record one step of each under torch's profiler",
    )
    ap.add_argument(
        "--reprice",
        nargs="+",
        metavar="FILE",
        help="no GPU: plan the cases of these committed results again and compare",
    )
    args = ap.parse_args(argv)
    if args.reprice:
        for path in args.reprice:
            result = read_result(path, "bench_gpu --reprice")
            print(
                f"{path}: {result.get('gpu', '?')}, planned for {result['planned_for']}"
            )
            print(_repriced_table(reprice(result)))
        return
    cases = CASES
    if args.case:
        try:
            cases = tuple((spec, int(batch)) for spec, batch in args.case)
        except ValueError as exc:
            raise SystemExit(
                f"bench_gpu: --case MODEL BATCH needs a whole batch: {exc}"
            )
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("bench_gpu: --steps and --warmup must be at least 1")
    from runtime.launch import launch

    res: dict[str, Any] = {
        "planned_for": f"1x1x{args.device}",
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()})",
        "profile": args.profile,
        "cases": [],
    }
    for spec, batch in cases:
        case = (spec, batch, args.device, args.steps, args.warmup)
        try:
            r = launch(
                _rank, 1, args=(*case, args.profile, args.kernels), backend="nccl"
            )[0]
        except MeshplanError as exc:
            raise SystemExit(f"bench_gpu: {exc}") from exc
        res.update(gpu=r["gpu"], torch=r["torch"])
        res["cases"].append(r["case"])
        print(_table(res).splitlines()[-1], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    print(f"{res['gpu']}, torch {res['torch']}, planned for {res['planned_for']}")
    print(_table(res))
    if args.kernels:
        from benchmarks.gpu_breakdown import breakdown, table

        res["breakdown"] = breakdown(res)
        print(table(res["breakdown"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
