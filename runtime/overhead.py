"""The runtime's fixed overheads: seconds per traced op and per parameter per micro-batch, per
parameter per step, per byte of gradient per step, per micro-batch, and per training step.

The executor (`runtime.executor.PlanExecutor`) replays each stage's compiled graphs op by op from
Python (`runtime.compiled`; eagerly it interprets the traced graph on DTensors); the pipeline runner
does some work per micro-batch (slicing the batch, the compiled call's wrapping, the loss), and
every step also runs the optimizer, the gradient buckets' bookkeeping, the loss broadcast and the
pipeline schedule's set-up. Every parameter tensor costs its own Python work too: its DTensor
gradient is wrapped and accumulated per micro-batch, and taken out of and put back into a bucket
and stepped per step (`runtime.grad_overlap`, `runtime.grad_sync`). For the small models that
train on a CPU these costs, not the FLOPs, are most of a step. The roofline in
`cost_models.compute` knows nothing of them, so the profiler measures them here and the cost
model charges ``op_overhead_s`` per op per micro-batch, ``param_overhead_s`` per parameter per
micro-batch, ``param_step_overhead_s`` per parameter per step, ``grad_byte_overhead_s`` per byte of
gradient a device holds per step, ``microbatch_overhead_s`` per stage per micro-batch and
``step_overhead_s`` once per step (`cost_models.compute.op_overhead`, ``param_overhead``,
``microbatch_overhead``, ``step_overhead``).

Why parameters apart from ops: with one slope per op, fitted on GPT blocks (0.30 parameter
tensors per op), a model with fewer parameters per op was over-priced. On 4 ranks on this
machine's 2 cores (data parallel, one micro-batch; 2026-11-29), tiny GPTs of 2 and 8 layers,
llamas of 2 and 8 layers (0.12 per op) and a Mixtral and GShard MoE of 2 layers (0.05 and 0.13)
took 32-84 ms a step; the GPT-only line put the Mixtral at 91 ms against 49 ms measured, while
``17 ms + 60 us * ops + 356 us * parameters`` fitted on the GPTs and llamas was within 6% of all
six. The per-parameter part was 215 us per micro-batch and 158 us per step in a fit over 1 and 4
micro-batches of the 2-layer GPT and the 8-layer GPT and llama.

Why bytes of gradient: each step also copies every gradient into its bucket and back, zeroes and
accumulates it and steps the parameter (`runtime.grad_overlap`, `runtime.grad_sync`, the SGD
step), work that grows with the gradient's bytes, not its count. The calibration models of
hidden size 8 have a few kilobytes of gradients, so their figures left it out: the torch profiler
found 5.8 ms of such work per step in a data-parallel GPT of hidden size 128 on 2 ranks (3.7 MB of
gradients: bucket copies 3.4 ms, accumulation 1.6, zeroing 0.5, the step 0.3), and a GPT of hidden
size 256 (6.4 MB, 2 layers, the ops and parameters of the 2-layer GPT of hidden 8) took 20.2 ms a
step where the five figures of the other runs predicted 10.2 ms (2 ranks, 2026-11-30): 1.6 ns per
byte. Its products see 8 tokens, so reading their weights (about 1 ms here) is the part of the
run's extra time that is not this work.

Measurement (`measure_op_overhead`, inside a launched group, on every rank at once as in training):
tiny GPTs, llama and Mixtral (``CALIBRATION_MODELS``, hidden 8: a few thousand FLOPs per op) are
trained by the runtime's own `runtime.train.Trainer` (pipeline runner, executor, gradient sync, SGD
step) under a data-parallel plan over all the ranks with one micro-batch, and two of them again
over ``MICROBATCHES`` (``CALIBRATION_RUNS``). The process that launches the ranks makes their
plans before the launch (`calibration_plans`: our own CLI's `meshplan manual`, in one child
process for all the plans, as `runtime.commands.run` plans, so that the runtime does not import
the planner's search) and hands them to the ranks. Each trainer is built once and takes
``warmup`` steps (the first step costs far more while the stage compiles and caches fill),
then the runs take their ``steps`` timed steps interleaved, one step of each in turn, so that
all see the same machine. Rank 0 returns, per run, the median step time, the traced graph's ops (views included) and
parameters, and the gradient bytes; the step's collectives that the cost model prices
separately (the bucketed gradient all-reduce and the all-reduce of the data-parallel partial
loss) are timed right after each step in the same way. The loss's broadcast from the last
stage, which the planner does not price, stays in the step: the per-step overhead holds it.
`overheads_from_steps` then fits the six figures to the runs' step times less their collectives
(non-negative least squares), each run's time the median of ``REPEATS`` calibrations. The ops'
own compute is negligible at these sizes (it is not subtracted; the wide GPT's, above, about 1 ms
of its 20 ms). Every rank trains at once, so on a
machine with fewer cores than ranks the figures include the ranks' time-sharing of the cores, as
in training.

The figures belong to the runtime measured: when it gets faster, re-profiling updates them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.errors import MeshplanError
from planner.vocab.plan_file import ParallelPlan
from runtime.cli import run_children

CALIBRATION_MODELS = (
    "gpt:hidden=8,layers=2,heads=2,seq=4,vocab=16",
    "gpt:hidden=8,layers=8,heads=2,seq=4,vocab=16",
    # a llama block has fewer parameter tensors per op than a GPT block (0.12 against 0.30):
    # the two ratios separate the per-parameter time from the per-op time
    "llama:hidden=8,layers=4,heads=2,kv_heads=1,ffn=8,seq=4,vocab=16",
    # and a Mixtral block still fewer (0.05): MoE models are then interpolated, not extrapolated
    # along the direction the other runs determine worst (condition number 147 without it)
    "mixtral:hidden=8,layers=2,heads=2,kv_heads=1,ffn=8,experts=2,seq=4,vocab=16,group_size=4",
    # the first GPT's ops and parameters, 6.4 MB of gradients instead of 10 KB: the time per
    # byte of gradient per step
    "gpt:hidden=256,layers=2,heads=2,seq=4,vocab=16",
)
CALIBRATION_BATCH = 2
# One calibration's line is noisy on a shared machine: five back-to-back ones on 2 ranks here gave
# 43..77 us per op and 0.6..8.7 ms per step (models timed one after the other); the profile fits
# each run's median over `REPEATS` of them. Interleaved, six back-to-back medians of three on 4 ranks gave
# 90..103 us per op, and 178 ops' worth of overhead per step within 25.4..27.7 ms; another launch
# minutes earlier drifted from 144 to 101 us per op over its three (the machine's speed moves).
REPEATS = 3
# Calibration models are also trained over this many micro-batches: what recurs per micro-batch
# (the pipeline runner's work, each parameter's gradient accumulation) is the difference.
MICROBATCHES = 4
#: The calibration runs, each trained under its own plan: (model spec, micro-batches).
CALIBRATION_RUNS = (
    (CALIBRATION_MODELS[0], 1),
    (CALIBRATION_MODELS[1], 1),
    (CALIBRATION_MODELS[2], 1),
    (CALIBRATION_MODELS[3], 1),
    (CALIBRATION_MODELS[0], MICROBATCHES),
    (CALIBRATION_MODELS[2], MICROBATCHES),
    (CALIBRATION_MODELS[4], 1),
)


def calibration_plans(world: int) -> list[ParallelPlan]:
    """The pure data-parallel plan over `world` ranks of every run of ``CALIBRATION_RUNS``, for
    `measure_op_overhead`; made before the launch by the launching process, each by our own CLI
    (`meshplan manual`), all in one child process, so that the runtime does not import the
    planner. A plan that fails raises MeshplanError with its last error line."""
    argvs, whats, outs = [], [], []
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
            argvs.append(cmd)
            whats.append(f"planning calibration model {spec}")
            outs.append(out)
        run_children(argvs, whats)
        return [ParallelPlan.load(out) for out in outs]


def measure_op_overhead(
    plans: Sequence[ParallelPlan] | None,
    steps: int = 20,
    warmup: int = 5,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """Train each calibration run data-parallel over every rank of an initialised CPU (gloo)
    group, under its plan of `plans` (`calibration_plans` for this group's size, one per run of
    ``CALIBRATION_RUNS``); rank 0's ``{"repeats": [{"runs": [{"step_s", "comm_s", "ops",
    "params", "grad_bytes", "world", "microbatches"}, ...]}, ...]}``, one run per plan in each
    of `repeats` repeats (module docstring).

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
    the step's collectives that the cost model prices, alone (the bucketed gradient all-reduce
    and the partial loss's all-reduce; module docstring) and its figures (`info`: op and
    parameter counts, gradient bytes, world, micro-batches)."""

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
        self.grads = torch.zeros(max(1, grad_bytes // 4), dtype=torch.float32)
        self.scalar = torch.zeros(1, dtype=torch.float32)
        self.info = {  # ops and parameters as the planner counts them
            "ops": float(len(graph.ops)),
            "params": float(len(graph.params)),
            "grad_bytes": float(grad_bytes),
            "world": float(world),
            "microbatches": float(microbatches),
        }

    def step(self) -> None:
        self.trainer.step(self.batch)

    def collectives(self) -> None:
        """The step's priced collectives, issued as the runtime issues them (functional
        collectives and their wait; `runtime.profile_collectives` times them the same way)."""
        import torch
        import torch.distributed as dist

        c10d = torch.ops._c10d_functional
        name = dist.group.WORLD.group_name
        c10d.wait_tensor(c10d.all_reduce_(self.grads, "sum", name))
        c10d.wait_tensor(c10d.all_reduce(self.scalar, "sum", name))


def _net(run: dict[str, float], all_reduce: Any) -> float:
    """A run's step time less its collectives: those timed in the same run (``comm_s``), or for
    records without it (older callers) priced with `all_reduce` (a `CollectiveFit` at the run's
    world size, or None). The fit is the weaker choice: a profile with few, noisy small-message
    samples can price the collectives above the whole step."""
    if "comm_s" in run:
        comm = run["comm_s"]
    elif run["world"] > 1 and all_reduce is not None:
        comm = all_reduce.predict(run["grad_bytes"]) + all_reduce.predict(4)
    else:
        comm = 0.0
    return max(0.0, run["step_s"] - comm)


@dataclass(frozen=True)
class Overheads:
    """The runtime's fixed costs in seconds (module docstring), as the cost model charges them
    (`cost_models.compute`: ``op_overhead``, ``param_overhead``, ``microbatch_overhead``,
    ``step_overhead``)."""

    op_s: float = 0.0  # per traced op per micro-batch
    param_s: float = 0.0  # per parameter tensor per micro-batch
    param_step_s: float = 0.0  # per parameter tensor per step
    grad_byte_s: float = 0.0  # per byte of gradient per step
    microbatch_s: float = 0.0  # per stage per micro-batch
    step_s: float = 0.0  # per step


#: The figures in the order of `_features`' columns.
_FIGURES = ("step_s", "microbatch_s", "op_s", "param_s", "param_step_s", "grad_byte_s")


def _features(run: dict[str, float]) -> list[float]:
    """A run's row of the fit: ``net = step + B * (microbatch + ops * op + params * param) +
    params * param_step + grad_bytes * grad_byte`` for B micro-batches."""
    b = run.get("microbatches", 1)
    return [1.0, b, b * run["ops"], b * run["params"], run["params"], run["grad_bytes"]]


def nonnegative_fit(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The least-squares x >= 0 of ``a x = y`` (a: runs x figures, of full column rank).

    Formulation: minimise ||a x - y||^2 subject to x >= 0. The optimum is the unconstrained
    least-squares fit on some set of free columns with the others 0 (the KKT conditions), so
    every set is tried and the feasible fit of least residual kept: 2^6 sets of 6 columns here.
    (scipy.optimize.nnls does this by active sets; scipy is not a dependency.)"""
    n, rank = a.shape[1], np.linalg.matrix_rank(a)
    if rank < n:
        raise MeshplanError(
            f"the calibration runs determine only {rank} of the {n} "
            "overheads: they need models of two ratios of parameters to ops, a model "
            "trained over one and over several micro-batches and two sizes of gradients "
            "(CALIBRATION_RUNS)"
        )
    best, best_res = np.zeros(n), float(np.sum(y**2))
    for mask in range(1, 2**n):
        cols = [i for i in range(n) if mask >> i & 1]
        x_cols = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if np.any(x_cols < 0):
            continue
        x = np.zeros(n)
        x[cols] = x_cols
        res = float(np.sum((a @ x - y) ** 2))
        if res < best_res - 1e-18:
            best, best_res = x, res
    return best


def overheads_from_steps(raw: dict[str, Any], all_reduce: Any) -> Overheads:
    """The runtime's overheads from `measure_op_overhead`'s figures, all at least 0: the
    non-negative least-squares fit (`nonnegative_fit`) of every run's net step time (`_net`: its
    step less its collectives) to ``step + B * (microbatch + ops * op + params * param) + params
    * param_step + grad_bytes * grad_byte`` over its op count, parameter count, gradient bytes
    and micro-batches B (`_features`). The runs of ``CALIBRATION_RUNS`` determine the six
    figures: three ratios of parameters to ops (GPT, llama and Mixtral blocks) separate the
    per-op from the per-parameter time, two models over one and several micro-batches what
    recurs per micro-batch from what comes once per step, and two GPTs of the same ops and
    parameters but 10 KB and 6.4 MB of gradients the time per byte. With ``repeats``: one fit of each run's median net time over the repeats (the
    median keeps a disturbed repeat out; a median of per-repeat fits mixed the figures of
    different solutions, which swung widely since the runs determine some directions poorly)."""
    repeats = [r["runs"] for r in raw["repeats"]] if "repeats" in raw else [raw["runs"]]
    a = np.array([_features(r) for r in repeats[0]], dtype=np.float64)
    y = np.median([[_net(r, all_reduce) for r in rs] for rs in repeats], axis=0)
    return Overheads(**dict(zip(_FIGURES, map(float, nonnegative_fit(a, y)))))
