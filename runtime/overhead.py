"""The runtime's per-op overhead: seconds per traced op per micro-batch that are not the op's compute.

The executor (`runtime.executor.PlanExecutor`) interprets the traced aten graph node by node on
DTensors, and autograd runs every op's backward through DTensor again. Each node therefore costs a
roughly fixed amount of Python and dispatch time besides its FLOPs and bytes; for the small models
that train on a CPU this is most of a step. The roofline in `cost_models.compute` knows nothing of
it, so the profiler measures it here and the cost model adds it per op
(`cost_models.compute.op_overhead`).

Measurement (`measure_op_overhead`, inside a launched group, on every rank at once as in training):
a tiny GPT (``CALIBRATION_MODEL``, hidden 8: a few thousand FLOPs per op) is trained by the
runtime's own `runtime.train.Trainer` (pipeline runner, executor, gradient sync, SGD step) under a
data-parallel plan over all the ranks with one micro-batch, ``steps`` steps after ``warmup`` (the
first step costs ~10x the rest while DTensor's propagation caches fill, and the next few still
fall). Rank 0 returns the median step time, the graph's ``call_function`` nodes (views included:
they dispatch too) and the gradient bytes; `overhead_from_step` then takes off what the cost
model prices separately - the bucketed gradient all-reduce and the two scalar collectives of the
loss (all-reduce of the data-parallel partial loss, broadcast from the last stage), timed right
after the steps in the same way - and divides by the ops. The ops' own compute is negligible
at this size (it is not subtracted). Every rank trains at once, so on a machine with fewer
cores than ranks the figure includes the ranks' time-sharing of the cores, as in training. The SGD step's per-parameter dispatch is folded in.

The figure belongs to the executor measured: when the runtime gets faster (e.g. compiled stages),
re-profiling updates it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

CALIBRATION_MODEL = "gpt:hidden=8,layers=2,heads=2,seq=4,vocab=16"
CALIBRATION_BATCH = 2


def measure_op_overhead(steps: int = 20, warmup: int = 5) -> dict[str, float]:
    """Train the calibration model data-parallel over every rank of an initialised CPU (gloo)
    group; rank 0's ``{"step_s", "comm_s", "ops", "grad_bytes", "world"}`` (module docstring)."""
    import torch
    import torch.distributed as dist

    from planner.manual import manual_plan
    from planner.models import build_model
    from planner.tracer import trace
    from runtime.train import Trainer, seeded_model_and_batches

    world = dist.get_world_size()
    batch = CALIBRATION_BATCH * world
    plan = manual_plan(
        CALIBRATION_MODEL,
        f"1x{world}xA100-80GB",  # pure data parallelism: the shardings need no prices
        dp=world,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=batch,
        dtype="float32",
        optimizer="sgd",
        allow_oom=True,
    )
    model, batches = seeded_model_and_batches(CALIBRATION_MODEL, batch, 1)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = Trainer(plan, model, batches[0], optimizer="sgd", lr=1e-3)
    meta, micro = build_model(CALIBRATION_MODEL, batch=CALIBRATION_BATCH, device="meta")
    graph = trace(meta, micro, model_name=CALIBRATION_MODEL)
    ops = sum(1 for n in graph.gm.graph.nodes if n.op == "call_function")
    grads = torch.zeros(max(1, grad_bytes // 4), dtype=torch.float32)
    scalar = torch.zeros(1, dtype=torch.float32)

    def collectives() -> (
        None
    ):  # the step's own: gradient all-reduce, loss all-reduce + broadcast
        dist.all_reduce(grads)
        dist.all_reduce(scalar)
        dist.all_reduce(scalar)

    step_times, comm_times = [], []
    for i in range(warmup + steps):
        # each step is followed by its collectives alone, timed the same way, so both see the
        # same outside load; with compiled stages the step is only a few times its collectives
        for fn, out in (
            (lambda: trainer.step(batches[0]), step_times),
            (collectives, comm_times),
        ):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    figures = torch.tensor(
        [statistics.median(step_times), statistics.median(comm_times)],
        dtype=torch.float64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {
        "step_s": float(figures[0]),
        "comm_s": float(figures[1]),
        "ops": float(ops),
        "grad_bytes": float(grad_bytes),
        "world": float(world),
    }


def overhead_from_step(raw: dict[str, float], all_reduce: Any) -> float:
    """Seconds per op per micro-batch from `measure_op_overhead`'s figures: the step time less
    its collectives, divided by the ops; at least 0. The collectives are those timed in the same
    run (``comm_s``, under the same load as the steps); a record without it (older callers) falls
    back to pricing them with `all_reduce` (the profile's all_reduce fit at the calibration's world
    size, a `CollectiveFit` or None for one rank). The fit is the weaker choice: a profile with
    few, noisy small-message samples can price the collectives above the whole step, which
    would leave no overhead at all."""
    if "comm_s" in raw:
        comm = raw["comm_s"]
    elif raw["world"] > 1 and all_reduce is not None:
        comm = all_reduce.predict(raw["grad_bytes"]) + 2 * all_reduce.predict(4)
    else:
        comm = 0.0
    return max(0.0, (raw["step_s"] - comm) / raw["ops"])
