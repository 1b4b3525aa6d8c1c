"""The runtime's fixed overheads: seconds per traced op per micro-batch, per micro-batch, and per
training step.

The executor (`runtime.executor.PlanExecutor`) replays each stage's compiled graphs op by op from
Python (`runtime.compiled`; eagerly it interprets the traced graph on DTensors); the pipeline runner
does some work per micro-batch (slicing the batch, the compiled call's wrapping, the loss), and
every step also runs the optimizer, the gradient buckets' bookkeeping, the loss broadcast and the
pipeline schedule's set-up. For the small models that train on a CPU these costs, not the FLOPs,
are most of a step. The roofline in `cost_models.compute` knows nothing of them, so the profiler
measures them here and the cost model charges ``op_overhead_s`` per op per micro-batch,
``microbatch_overhead_s`` per stage per micro-batch and ``step_overhead_s`` once per step
(`cost_models.compute.op_overhead`, ``microbatch_overhead``, ``step_overhead``).

Measurement (`measure_op_overhead`, inside a launched group, on every rank at once as in training):
two tiny GPTs (``CALIBRATION_MODELS``, hidden 8: a few thousand FLOPs per op, 2 and 8 layers) are
trained by the runtime's own `runtime.train.Trainer` (pipeline runner, executor, gradient sync, SGD
step) under a data-parallel plan over all the ranks with one micro-batch, and the first of them
again over ``MICROBATCHES`` (``CALIBRATION_RUNS``). The process that launches the ranks makes their
plans before the launch (`calibration_plans`: our own CLI's `meshplan manual` in a child process
per plan, as `runtime.commands.run` plans, so that the runtime does not import the planner's
search) and hands them to the ranks. Each trainer is built once and takes ``warmup`` steps (the
first step costs far more while the stage compiles and caches fill), then the three take their
``steps`` timed steps interleaved, one step of each in turn, so that all three see the same
machine. Rank 0 returns, per run, the median step time, the graph's ``call_function`` nodes (views
included) and the gradient bytes; the step's own collectives (the bucketed gradient all-reduce and
the loss's two scalar collectives), which the cost model prices separately, are timed right after
each step in the same way.
`overheads_from_steps` then fits ``step - collectives = overhead + ops * op_overhead`` through
the one-micro-batch runs: the slope is the per-op figure; the run over several micro-batches
splits the intercept into its per-micro-batch and per-step parts. The profile keeps the median of
``REPEATS`` such calibrations. The ops' own compute is negligible at this size (it is not
subtracted). Every rank trains at once, so on a machine with fewer cores than ranks the figures
include the ranks' time-sharing of the cores, as in training.

The figures belong to the runtime measured: when it gets faster, re-profiling updates them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from cost_models.errors import MeshplanError
from planner.vocab.plan_file import ParallelPlan
from runtime.cli import run_child

CALIBRATION_MODELS = (
    "gpt:hidden=8,layers=2,heads=2,seq=4,vocab=16",
    "gpt:hidden=8,layers=8,heads=2,seq=4,vocab=16",
)
CALIBRATION_BATCH = 2
# One calibration's line is noisy on a shared machine: five back-to-back ones on 2 ranks here gave
# 43..77 us per op and 0.6..8.7 ms per step (models timed one after the other); the profile takes
# the median of `REPEATS` of them. Interleaved, six back-to-back medians of three on 4 ranks gave
# 90..103 us per op, and 178 ops' worth of overhead per step within 25.4..27.7 ms; another launch
# minutes earlier drifted from 144 to 101 us per op over its three (the machine's speed moves).
REPEATS = 3
# The first calibration model is also trained over this many micro-batches: what a micro-batch
# costs beyond its ops (the pipeline runner's per-micro-batch work) is the difference.
MICROBATCHES = 4
#: The calibration runs, each trained under its own plan: (model spec, micro-batches).
CALIBRATION_RUNS = (
    (CALIBRATION_MODELS[0], 1),
    (CALIBRATION_MODELS[1], 1),
    (CALIBRATION_MODELS[0], MICROBATCHES),
)


def calibration_plans(world: int) -> list[ParallelPlan]:
    """The pure data-parallel plan over `world` ranks of every run of ``CALIBRATION_RUNS``, for
    `measure_op_overhead`; made before the launch by the launching process, each by our own CLI
    (`meshplan manual`) in a child process, so that the runtime does not import the planner. A
    child that fails raises MeshplanError with its last error line."""
    plans = []
    with tempfile.TemporaryDirectory(prefix="meshplan-calibration-") as tmp:
        for i, (spec, microbatches) in enumerate(CALIBRATION_RUNS):
            out = os.path.join(tmp, f"plan{i}.json")
            batch = CALIBRATION_BATCH * world * microbatches
            # pure data parallelism: the shardings need no prices, so no profile
            cmd = ["manual", spec, "--json", out]
            cmd += ["--cluster", f"1x{world}xA100-80GB", "--dtype", "float32"]
            cmd += ["--dp", str(world), "--tp", "1", "--pp", "1"]
            cmd += ["--microbatches", str(microbatches), "--batch", str(batch)]
            cmd += ["--optimizer", "sgd", "--allow-oom"]
            run_child(cmd, f"planning calibration model {spec}")
            plans.append(ParallelPlan.load(out))
    return plans


def measure_op_overhead(
    plans: Sequence[ParallelPlan] | None,
    steps: int = 20,
    warmup: int = 5,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """Train each calibration run data-parallel over every rank of an initialised CPU (gloo)
    group, under its plan of `plans` (`calibration_plans` for this group's size, one per run of
    ``CALIBRATION_RUNS``); rank 0's ``{"repeats": [{"runs": [{"step_s", "comm_s", "ops",
    "grad_bytes", "world", "microbatches"}, ...]}, ...]}``, one run per plan in each of `repeats`
    repeats (module docstring).

    Each model's trainer is built once; after `warmup` steps of each, every repeat takes `steps`
    rounds, a round being one step of every model in turn, each followed by its collectives
    alone. Interleaved so, the models see the same machine: the line through their step times
    is a difference of times, and a drift of the machine's speed between separately timed models
    (other load, the host's) went straight into its slope and intercept."""
    import torch
    import torch.distributed as dist

    if not plans:
        raise MeshplanError(
            "no calibration plans: make them before the launch (calibration_plans)"
        )
    runs = [_Calibration(plan) for plan in plans]
    for run in runs:
        for _ in range(warmup):
            run.step()
    out = []
    for _ in range(repeats):
        times = [([], []) for _ in runs]  # per run: step times, collective times
        for _ in range(steps):
            for run, (step_t, comm_t) in zip(runs, times):
                step_t.append(_barriered(run.step))
                comm_t.append(_barriered(run.collectives))
        figures = torch.tensor(
            [statistics.median(t) for pair in times for t in pair], dtype=torch.float64
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        out.append(
            {
                "runs": [
                    run.info | {"step_s": float(step), "comm_s": float(comm)}
                    for run, step, comm in zip(runs, figures[0::2], figures[1::2])
                ]
            }
        )
    return {"repeats": out}


def _barriered(fn: Callable[[], object]) -> float:
    """Seconds of `fn` between two barriers of the whole group."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


class _Calibration:
    """One calibration model trained over the group under its data-parallel `plan` (of
    `calibration_plans`: micro-batches of CALIBRATION_BATCH samples per rank): its training step,
    the step's own collectives alone (the bucketed gradient all-reduce and the loss's two scalar
    collectives, which the cost model prices separately) and its figures (`info`: op count,
    gradient bytes, world, micro-batches)."""

    def __init__(self, plan: ParallelPlan) -> None:
        import torch
        import torch.distributed as dist

        from planner.models import build_model
        from planner.tracing.tracer import trace
        from runtime.train import Trainer, seeded_model_and_batches

        world = dist.get_world_size()
        if plan.cluster["num_devices"] != world:
            raise MeshplanError(
                f"calibration plan for {plan.cluster['num_devices']} devices, but {world} ranks"
            )
        model_spec, batch = plan.model["name"], plan.global_batch
        microbatches = plan.num_microbatches
        model, batches = seeded_model_and_batches(model_spec, batch, 1)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.batch = batches[0]
        self.trainer = Trainer(plan, model, self.batch, optimizer="sgd", lr=1e-3)
        meta, micro = build_model(model_spec, batch=CALIBRATION_BATCH, device="meta")
        graph = trace(meta, micro, model_name=model_spec)
        ops = sum(1 for n in graph.gm.graph.nodes if n.op == "call_function")
        self.grads = torch.zeros(max(1, grad_bytes // 4), dtype=torch.float32)
        self.scalar = torch.zeros(1, dtype=torch.float32)
        self.info = {
            "ops": float(ops),
            "grad_bytes": float(grad_bytes),
            "world": float(world),
            "microbatches": float(microbatches),
        }

    def step(self) -> None:
        self.trainer.step(self.batch)

    def collectives(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self.grads)
        dist.all_reduce(self.scalar)
        dist.all_reduce(self.scalar)


def _net(run: dict[str, float], all_reduce: Any) -> float:
    """A run's step time less its collectives: those timed in the same run (``comm_s``), or for
    records without it (older callers) priced with `all_reduce` (a `CollectiveFit` at the run's
    world size, or None). The fit is the weaker choice: a profile with few, noisy small-message
    samples can price the collectives above the whole step."""
    if "comm_s" in run:
        comm = run["comm_s"]
    elif run["world"] > 1 and all_reduce is not None:
        comm = all_reduce.predict(run["grad_bytes"]) + 2 * all_reduce.predict(4)
    else:
        comm = 0.0
    return max(0.0, run["step_s"] - comm)


def overheads_from_steps(
    raw: dict[str, Any], all_reduce: Any
) -> tuple[float, float, float]:
    """(seconds per op per micro-batch, seconds per step, seconds per micro-batch) from
    `measure_op_overhead`'s figures, all at least 0. The runs over one micro-batch give the line
    ``net = overhead + ops * op_overhead`` through their net step times (`_net`) against their
    op counts (the smallest and the largest model). A run of the same model over B micro-batches adds
    (B - 1) micro-batches: ``(net_B - net_1) / (B - 1) - ops * op_overhead`` is the per-micro-batch
    figure, and the line's intercept less it the per-step one (without such a run, 0 and the
    whole intercept). A single run (a record of one calibration model: ``raw`` is the run
    itself) gives no intercept: all of its time is per op. With ``repeats``: the median of the
    repeats' figures, each taken alone."""
    if "repeats" in raw:
        lines = [overheads_from_steps(r, all_reduce) for r in raw["repeats"]]
        return tuple(statistics.median(x[i] for x in lines) for i in range(3))
    runs = raw.get("runs", [raw])
    nets = sorted(
        (r["ops"], _net(r, all_reduce)) for r in runs if r.get("microbatches", 1) == 1
    )
    (o1, n1), (o2, n2) = nets[0], nets[-1]
    if o2 == o1:
        return n1 / o1, 0.0, 0.0
    per_op = (n2 - n1) / (o2 - o1)
    if per_op <= 0:  # noise beat the ops: the smallest model's time is all per step
        return 0.0, n1, 0.0
    intercept = max(0.0, n1 - o1 * per_op)
    per_mb = 0.0
    for r in runs:
        b = r.get("microbatches", 1)
        base = [n for o, n in nets if o == r["ops"]]
        if b > 1 and base:
            extra = (_net(r, all_reduce) - base[0]) / (b - 1) - r["ops"] * per_op
            per_mb = min(max(0.0, extra), intercept)
    return per_op, intercept - per_mb, per_mb
