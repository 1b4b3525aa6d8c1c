"""Predicted against measured step time on one GPU, and the runtime against plain PyTorch.

    python -m benchmarks.bench_gpu                      # needs a CUDA GPU; prints a table
    python -m benchmarks.bench_gpu --device H100-80GB --json benchmarks/results/gpu-H100-80GB.json

For each model (GPT shapes in bfloat16 on one GPU) the planner plans on ``1x1xDEVICE`` from the
datasheet cost models, as the suites price every case. One NCCL rank then trains two copies of
the same seeded model on the same seeded batches, steps alternating so both see the same machine:

* **runtime**: `runtime.train.Trainer` (compiled stages) on that plan;
* **reference**: the model in plain eager PyTorch, one forward and backward of the global batch.

Both use Adam (``torch.optim.Adam`` on the bfloat16 parameters: planned as ``adam_16bit``). Per
model: the predicted iteration time, each one's median over the timed steps, the prediction's
error ((predicted - measured) / measured, against the runtime) and the ratio runtime /
reference; and, before those steps, the runtime's peak memory in a training step
(`runtime.train.measure_peak_memory`: ``torch.cuda.max_memory_allocated`` over a step after one
warm step, less what was allocated before the trainer was built) against the plan's predicted
peak per device (``memory``, `benchmarks.records.memory_record`). CI has no GPU: this runs where
one is lent, and its results are committed.
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

from cost_models.errors import MeshplanError

CASES = (
    ("gpt:hidden=1024,layers=24,heads=16", 8),
    ("gpt:hidden=2048,layers=8,heads=16", 8),
    ("gpt:hidden=2560,layers=8,heads=32", 16),
)
LR = 1e-4
OPTIMIZER = "adam_16bit"  # what the ranks run: torch.optim.Adam on bfloat16 parameters


def _timed(fn: Any, *args: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _case(spec: str, batch: int, device: str, steps: int, warmup: int) -> dict:
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
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=True)

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
    return {
        "model": spec,
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
    }


def _rank(
    device: str, steps: int, warmup: int, cases: Sequence[tuple[str, int]]
) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": [_case(s, b, device, steps, warmup) for s, b in cases],
    }


def _memory(mem: dict | None) -> str:
    if not mem:
        return "-"
    p, m = mem["predicted_bytes"], mem["measured_bytes"]
    return f"{p / 2**30:.2f}/{m / 2**30:.2f} ({p / m - 1:+.0%})"


def _table(res: dict) -> str:
    head = (
        "model                                 batch  mb  predicted  runtime  reference  error   "
        "rt/ref  memory pred/measured GiB"
    )
    rows = [head, "-" * len(head)]
    for c in res["cases"]:
        rows.append(
            f"{c['model']:<37} {c['global_batch']:>5}  {c['num_microbatches']:>2}  "
            f"{c['predicted_s'] * 1e3:>7.1f} ms {c['runtime_s'] * 1e3:>6.1f} ms "
            f"{c['reference_s'] * 1e3:>7.1f} ms {c['prediction_error']:>+6.0%}  "
            f"{c['runtime_over_reference']:>5.2f}  {_memory(c.get('memory'))}"
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
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("bench_gpu: --steps and --warmup must be at least 1")
    from runtime.launch import launch

    try:
        res = launch(
            _rank, 1, args=(args.device, args.steps, args.warmup, CASES), backend="nccl"
        )[0]
    except MeshplanError as exc:
        raise SystemExit(f"bench_gpu: {exc}") from exc
    res.update(
        planned_for=f"1x1x{args.device}",
        date=date.today().isoformat(),
        machine=f"{platform.node()} ({platform.machine()})",
    )
    print(f"{res['gpu']}, torch {res['torch']}, planned for {res['planned_for']}")
    print(_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
