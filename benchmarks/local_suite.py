"""The local measured suite: plans for this machine's processes, executed, predicted against measured.

    meshplan bench --suite local [--gpus 2 4] [--json FILE]
    python -m benchmarks.local_suite [--procs 2 4] [--launches 3] [--json FILE]

For every case (a small GPT, GShard MoE or Mixtral model on N local processes, `LOCAL_CASES`):

1. profile this machine with N ranks (`runtime.profiler`, `profile_options`): matrix products and
   memory bandwidth measured on every rank at once, the collectives on 2, 4, ... N ranks, and the
   runtime's fixed overheads per op, parameter, micro-batch and step (`runtime.overhead`);
2. plan automatically (`planner.plan`) and search the Megatron grid (`benchmarks.manual_grid`) on
   the cluster of that profile (`Cluster.from_profile`), float32 and SGD as the ranks train; when
   the grid's best manual plan is the automatic plan itself (`same_plan`), search the grid again
   for the best manual plan other than it (the runner-up): two runs of one plan have no faster
   one, while the runner-up checks that the cost model ranks two different plans as they run;
3. launch N ranks once and train both plans (automatic, and the best manual or the runner-up) on
   the same seeded model and batches, in alternating blocks (`measure_rank`: `BLOCK` timed steps
   of one plan after one untimed step, then the other's) so that both see the same machine
   noise, each step timed between two barriers of the whole group; the measured step time of a
   plan is the median over its timed steps after `warmup` untimed ones. Not step by step: a
   step that follows another trainer's step finds the caches holding that trainer's model,
   gradients and graphs. Measured on 2026-11-30 (profile and steps in one launch, 20 timed steps
   after 2 warm-up): one data-parallel plan trained alone against the same plan alternating step
   by step with a second trainer of itself, the GPT of this suite on 2 processes 52.3 ms alone,
   65.0 and 64.3 ms alternating (predicted 54.9 and 53.8 ms), the Mixtral on 4 processes 39.6 ms
   alone, 51.6 and 52.1 ms alternating (predicted 40.1 and 38.5 ms). The cost model prices a
   step of one training job, as a user runs it.

4. after the timed steps, in the same launch, measure each plan's peak memory per rank in two
   dedicated untimed steps (`runtime.train.measure_peak_memory`: the bytes of live tensors the
   CPU allocator reports, under the profiler, which slows those steps) against the plan's
   predicted peak per device (`benchmarks.records.memory_record`).

Recorded per case: predicted and measured step time of both plans run (``auto``, and
``manual_best`` or ``runner_up``: `benchmarks.records.compared`), the cost model's error
(predicted / measured - 1), which plan is faster in prediction and in measurement (``agree``; None
only when no other manual plan exists, as their measured order would be noise), and the first
step's losses of both (the same model and data: they must agree). With ``--launches N`` the suite
runs N times in a row; the document holds the last run's cases and, under ``launches``, every
run's date and summary (`launch_record`): issue 22 asks its timing target of three launches in a
row.

Processes and cores. The launcher binds each rank to its share of the cores, one core per rank
round-robin when there are more ranks than cores (8 ranks on 2 cores: 4 per core). The profile is
measured under the same process count the plan runs with and with every rank computing at once
(``concurrent_compute``), so a "device" of the cluster is what one rank gets while all ranks
compute; the cost model needs no separate sharing factor. (Pipeline bubbles leave cores to the
busy ranks, which this does not model.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.records import (
    RESULTS,
    TIE,
    compared,
    machine,
    memory_record,
    stage_json,
    write_results,
)
from benchmarks.report import write_report
from cost_models.profile import OVERHEAD_FIELDS

DEVICE = "CPU"
OPTIMIZER = "sgd"
LR = 0.01
# timed steps per plan: with 5, the medians of one plan run twice (a case whose automatic plan is
# the manual one) differed by up to 9%
STEPS = 20
WARMUP = 2
# timed steps of one plan in a row (`measure_rank`): steps alternating one by one between two
# trainers measured each 24-32% slower than alone (2026-11-30, module docstring)
BLOCK = 5


@dataclass(frozen=True)
class LocalCase:
    """A model trained by `num_devices` local processes on a global batch."""

    suite: str
    model: str
    num_devices: int
    global_batch: int


GPT_SPEC = "gpt:hidden=128,layers=4,heads=4,seq=64,vocab=512"
MOE_SPEC = "moe:hidden=64,layers=2,experts=4,heads=4,seq=32,vocab=256,group_size=32"
MIXTRAL_SPEC = (
    "mixtral:hidden=64,layers=2,heads=4,kv_heads=2,ffn=128,experts=4,seq=32,vocab=256,"
    "group_size=32"
)
LOCAL_CASES = (
    LocalCase("gpt", GPT_SPEC, 2, 16),
    LocalCase("gpt", GPT_SPEC, 4, 16),
    LocalCase("gpt", GPT_SPEC, 8, 16),
    LocalCase("moe", MOE_SPEC, 2, 16),
    LocalCase("moe", MOE_SPEC, 4, 16),
    LocalCase("mixtral", MIXTRAL_SPEC, 4, 16),
)


def local_cases(procs: Sequence[int] | None = None) -> list[LocalCase]:
    """`LOCAL_CASES`, only those with a process count in `procs` when given."""
    if procs:
        known = sorted({c.num_devices for c in LOCAL_CASES})
        unknown = sorted(set(procs) - set(known))
        if unknown:
            raise ValueError(f"local: no case for {unknown} processes; cases: {known}")
        return [c for c in LOCAL_CASES if c.num_devices in procs]
    return list(LOCAL_CASES)


def profile_options(nproc: int, case: LocalCase | None = None) -> Any:
    """What the suite measures: float32 products (m x d) @ (d x d) for m in 64, 256, 1024 and d in
    64, 128, 512 (the small models' shapes), every rank at once; memory bandwidth as the copy of
    a 2 MiB tensor, the size of these models' activations (a 64 MiB copy measures DRAM streaming,
    while these tensors stay in the caches; the roofline prices their elementwise ops with it);
    collectives
    of 4 KiB .. 4 MiB on the power-of-two world sizes up to `nproc` (the submesh sizes planned)
    and `nproc`, every group of consecutive ranks at once (as a mesh axis's groups run); the
    runtime's fixed overheads; and with a `case`, the rates of its model's non-GEMM ops
    (`runtime.op_rates`) at one rank's share of its batch (a data-parallel micro-batch)."""
    from runtime.profiler import KB, MB, ProfileOptions, size_range

    worlds = sorted({w for w in (2, 4, 8) if w < nproc} | {nproc})
    return ProfileOptions(
        nproc=nproc,
        world_sizes=[w for w in worlds if w >= 2],
        sizes=size_range(4 * KB, 4 * MB, 4),
        repeats=3,
        matmul_shapes=[(m, d, d) for m in (64, 256, 1024) for d in (64, 128, 512)],
        dtypes=("float32",),
        matmul_repeats=3,
        bandwidth_bytes=2 * MB,
        progress=False,
        concurrent_compute=True,
        op_overhead=True,
        concurrent_collectives=True,
        op_models=(case.model,) if case else (),
        op_batch=max(1, case.global_batch // nproc) if case else 1,
    )


def _timed(fn: Callable[..., float], *args: Any) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    value = fn(*args)
    dist.barrier()
    return value, time.perf_counter() - t0


def measure_rank(
    plans: Sequence[Any], model: str, steps: int, warmup: int, block: int = BLOCK
) -> dict[str, list[float]]:
    """Inside a launched group: train every plan on the same seeded model and batches; per plan
    its losses and its `steps` timed step times. After `warmup` untimed steps of each plan in
    turn, the plans take turns in blocks: one untimed step (its caches warmed again after the
    other plan's block), then up to `block` timed steps (module docstring)."""
    from runtime.train import Trainer, seeded_model_and_batches

    rounds = -(-steps // block)
    n = warmup + rounds * (block + 1)
    trainers, batches = [], []
    for p in plans:
        m, batches = seeded_model_and_batches(model, p.global_batch, n, seed=0)
        trainers.append(Trainer(p, m, batches[0], optimizer=OPTIMIZER, lr=LR))
    out: dict[str, list] = {"losses": [[] for _ in plans], "times": [[] for _ in plans]}

    def run(k: int, i: int, timed: bool) -> None:
        loss, dt = _timed(trainers[k].step, batches[i])
        out["losses"][k].append(loss)
        if timed:
            out["times"][k].append(dt)

    for i in range(warmup):
        for k in range(len(plans)):
            run(k, i, False)
    i = warmup
    for r in range(rounds):
        timed = min(block, steps - r * block)
        for k in range(len(plans)):
            for j in range(timed + 1):
                run(k, i + j, j > 0)
        i += timed + 1
    return out


def memory_ranks(plans: Sequence[Any], model: str) -> list[list[dict[str, Any]]]:
    """Inside a launched group, after the timed steps: every plan's peak memory per rank
    (`runtime.train.measure_peak_memory`, on the same seeded model and batches as the steps)."""
    from runtime.train import measure_peak_memory, seeded_model_and_batches

    out = []
    for p in plans:
        m, batches = seeded_model_and_batches(model, p.global_batch, 2, seed=0)
        out.append(measure_peak_memory(p, m, batches, optimizer=OPTIMIZER, lr=LR))
    return out


def _shape(p: Any) -> dict[str, Any]:
    return {
        "num_microbatches": p.num_microbatches,
        "stages": [stage_json(s) for s in p.stages],
    }


def same_plan(a: Any, b: Any) -> bool:
    """Whether two ParallelPlans run alike: schedule, micro-batches and, per stage, its ops,
    devices, mesh, recomputation, ZeRO and every parameter's placement, and the same predicted
    iteration time. Mesh axes of size 1 are dropped first (a (1, 2) and a (2, 1) mesh of the same
    devices are one mesh), and a stage is its ops, not its layer indices (clusterings of different
    granularity). Activations' placements are not compared: where two plans with the same
    parameters differ only there at the same predicted time, the difference costs nothing (the
    ILP's choice among equal-cost placements, e.g. the labels' view replicated or sharded before
    the loss slices them, depends on the solver's tie-breaking)."""

    def key(p: Any) -> tuple:
        stages = []
        for s in p.stages:
            axes = [i for i, n in enumerate(s.logical_mesh) if n > 1]
            stages.append(
                (
                    tuple(s.devices),
                    tuple(s.logical_mesh[i] for i in axes),
                    s.recompute,
                    sorted(s.zero_params),
                    sorted(s.node_strategies),
                    {
                        k: tuple(v[i] for i in axes) if v else v
                        for k, v in s.param_placements.items()
                    },
                )
            )
        return (p.num_microbatches, p.schedule, p.virtual_stages, stages)

    ta, tb = a.estimate.iteration_time_s, b.estimate.iteration_time_s
    return key(a) == key(b) and abs(ta - tb) <= TIE * max(ta, tb)


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def _plan_case(case: LocalCase, profile: Any) -> dict[str, Any]:
    """Plan the case on the cluster of `profile`: the automatic plan, the grid's best manual
    configuration's record, the runner-up's record when the best is the automatic plan, the
    manual plan to run (the runner-up's or the best's) and the planning time."""
    from benchmarks.manual_grid import ManualConfig, best_manual, price
    from cost_models.cluster import Cluster
    from planner import plan

    cluster = Cluster.from_profile(profile, hosts=1, devices_per_host=case.num_devices)
    t0 = time.perf_counter()
    auto = plan(
        case.model,
        cluster,
        global_batch=case.global_batch,
        dtype="float32",
        optimizer=OPTIMIZER,
    )
    planner_s = time.perf_counter() - t0

    def search(**kw: Any) -> dict[str, Any]:
        return best_manual(
            case.model,
            cluster,
            case.global_batch,
            suite=case.suite,
            dtype="float32",
            optimizer=OPTIMIZER,
            **kw,
        )

    def priced(record: dict[str, Any]) -> Any:
        config = ManualConfig(**record["config"])
        return price(
            case.model, cluster, config, case.global_batch, "float32", OPTIMIZER
        )

    manual = search()
    if manual["config"] is None:
        raise RuntimeError(
            f"{case.model} on {case.num_devices} processes: no manual configuration fits"
        )
    out = {
        "cluster": cluster.spec,
        "auto": auto,
        "planner_time_s": planner_s,
        "manual": manual,
        "manual_plan": priced(manual),
    }
    if same_plan(auto, out["manual_plan"]):  # run the best other manual plan: a ranking
        other = search(skip=lambda p: same_plan(auto, p))
        if other["config"] is not None:
            out |= {"runner_up": other, "manual_plan": priced(other)}
    return out


def case_rank(
    case: LocalCase, options: Any, steps: int, warmup: int
) -> dict[str, Any] | None:
    """One rank of a case's launch: profile (every rank), plan (rank 0, the others wait), then
    train both plans (`measure_rank`). Rank 0 returns the profile, the plans and the runs."""
    import torch.distributed as dist

    from runtime.profiler import profile_from_raw, profile_worker

    t0 = time.perf_counter()
    raw = profile_worker(options)
    profile_s = time.perf_counter() - t0
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        profile = profile_from_raw(raw, options, dist.get_backend())
        box[0] = _plan_case(case, profile) | {"profile": profile}
    dist.broadcast_object_list(box, src=0)
    planned = box[0]
    t1 = time.perf_counter()
    plans = [planned["auto"], planned["manual_plan"]]
    runs = measure_rank(plans, case.model, steps, warmup)
    t2 = time.perf_counter()
    runs["memory"] = memory_ranks(plans, case.model)
    times = {
        "profile": profile_s,
        "run": t2 - t1,
        "memory": time.perf_counter() - t2,
    }
    return planned | {"runs": runs, "times_s": times} if dist.get_rank() == 0 else None


def run_local_case(
    case: LocalCase,
    steps: int = STEPS,
    warmup: int = WARMUP,
    options: Any = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Profile, plan, search the grid and execute both plans in one launch of the case's
    processes; the case's JSON record."""
    from runtime.launch import launch
    from runtime.profiler import check_options

    options = options or profile_options(case.num_devices, case)
    check_options(options)
    load_before = os.getloadavg()[0]
    if say:
        say(
            f"  one launch of {case.num_devices} processes: profile, plan, {warmup}+{steps} steps"
        )
    r = launch(
        case_rank,
        case.num_devices,
        args=(case, options, steps, warmup),
        timeout_s=1800.0,
    )[0]
    profile, auto, manual, runs = r["profile"], r["auto"], r["manual"], r["runs"]
    measured = [statistics.median(t) for t in runs["times"]]
    t_auto = auto.estimate.iteration_time_s
    runner = r.get("runner_up")
    t_man = (runner or manual)["iteration_time_s"]
    run_manual = (runner or manual) | {  # the manual plan executed
        "measured_iteration_time_s": measured[1],
        "measured_step_times_s": runs["times"][1],
        "error": _error(t_man, measured[1]),
        "memory": memory_record(r["manual_plan"], runs["memory"][1]),
    }
    return asdict(case) | {
        "cluster": r["cluster"],
        "profile": {
            "device": profile.device_name,
            "peak_float32_flops": profile.peak_flops.get("float32"),
            "memory_bandwidth_bytes_per_s": profile.memory_bandwidth_bytes_per_s,
            **{key: getattr(profile, key) for key in OVERHEAD_FIELDS},
            "op_rates": {
                r.target: [r.unit, r.forward_s, r.backward_s] for r in profile.op_rates
            },
        },
        "auto": {
            "iteration_time_s": t_auto,
            "tflops_per_device": auto.estimate.tflops_per_device,
            "planner_time_s": r["planner_time_s"],
            "measured_iteration_time_s": measured[0],
            "measured_step_times_s": runs["times"][0],
            "error": _error(t_auto, measured[0]),
            "memory": memory_record(auto, runs["memory"][0]),
            **_shape(auto),
        },
        # the grid's best; when it is the automatic plan, the best other one ran instead
        "manual_best": manual if runner else run_manual,
        "runner_up": run_manual if runner else None,
        "ratio": manual["iteration_time_s"] / t_auto,
        "measured_ratio": measured[1] / measured[0],
        "same_plan": bool(runner) or (same := same_plan(auto, r["manual_plan"])),
        # identical plans have no faster one: their measured order is noise, not a verdict
        "agree": None
        if not runner and same
        else (t_man >= t_auto) == (measured[1] >= measured[0]),
        "first_losses": [runs["losses"][0][0], runs["losses"][1][0]],
        "times_s": r["times_s"],
        # 1-minute load average before and after the case: other work sharing the cores
        # inflates and scatters the measured times (the cost model prices an idle machine's
        # share as measured by the profile)
        "load_average": [load_before, os.getloadavg()[0]],
    }


def summary(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute cost-model error over both executed plans of every case, the largest
    peak-memory error over their ranks, in how many cases the plan predicted faster is the one
    measured faster, and in how many the grid's best
    manual plan is the automatic one (`same_plan`; the runner-up was compared)."""
    errors = [abs(p["error"]) for c in cases for p in (c["auto"], compared(c))]
    memory = [
        p["memory"]["max_abs_error"]
        for c in cases
        for p in (c["auto"], compared(c))
        if p.get("memory") and p["memory"]["max_abs_error"] is not None
    ]
    return {
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        # the largest |predicted / measured - 1| of peak memory over every rank of both plans
        "memory_max_abs_error": max(memory) if memory else None,
        "agree": sum(c["agree"] is True for c in cases),
        "same_plan": sum(bool(c.get("same_plan")) for c in cases),
        "cases": len(cases),
    }


def launch_record(doc: dict[str, Any]) -> dict[str, Any]:
    """One run of the suite in a document's ``launches``: its date, duration and `summary`."""
    return {k: doc[k] for k in ("date", "total_time_s", "summary")}


def run_local_suite(
    procs: Sequence[int] | None = None,
    steps: int = STEPS,
    warmup: int = WARMUP,
    say: Callable[[str], None] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
    cases: Sequence[LocalCase] | None = None,
    options: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Run the cases (all, or those with `procs` processes, or `cases`); the results document.
    `options(n)` overrides the profile options (tests make them smaller)."""
    import torch

    t0 = time.perf_counter()
    out = []
    for case in cases if cases is not None else local_cases(procs):
        if say:
            say(f"local {case.model} on {case.num_devices} processes")
        opts = options(case.num_devices) if options else None
        out.append(run_local_case(case, steps, warmup, opts, say))
        if on_case:
            on_case(out[-1])
    return {
        "suite": "local",
        "device": DEVICE,
        "machine": machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "steps": steps,
        "warmup": warmup,
        "block": BLOCK,
        "total_time_s": time.perf_counter() - t0,
        "summary": summary(out),
        "cases": out,
    }


HEADER = (
    f"{'procs':>5} {'model':<6} {'auto pred':>9} {'measured':>9} {'err':>6}  "
    f"{'manual plan run':<18} {'pred':>7} {'measured':>9} {'err':>6} {'agree':>5}  "
    f"{'peak memory pred/measured (auto, manual)':>40}"
)


def _memory_ratio(part: dict[str, Any]) -> str:
    """Predicted / measured peak per device of the worst rank ("-" in older records)."""
    mem = part.get("memory")
    if not mem or not mem["measured_bytes"]:
        return "-"
    worst = max(mem["ranks"], key=lambda r: abs((r["ratio"] or 1) - 1))
    return f"{worst['predicted_bytes'] / 2**20:.1f}/{worst['measured_bytes'] / 2**20:.1f}MiB"


def _verdict(agree: bool | None) -> str:
    return "same" if agree is None else "yes" if agree else "no"


def format_row(c: dict[str, Any]) -> str:
    """One console line (milliseconds)."""
    a, m = c["auto"], compared(c)
    return (
        f"{c['num_devices']:>5} {c['suite']:<6} {a['iteration_time_s'] * 1e3:>9.1f} "
        f"{a['measured_iteration_time_s'] * 1e3:>9.1f} {a['error']:>+6.0%}  "
        f"{m['label']:<18} {m['iteration_time_s'] * 1e3:>7.1f} "
        f"{m['measured_iteration_time_s'] * 1e3:>9.1f} {m['error']:>+6.0%} "
        f"{_verdict(c['agree']):>5}  {_memory_ratio(a):>19} {_memory_ratio(m):>19}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line (module docstring)."""
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", help="process counts to run")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument(
        "--launches",
        type=int,
        default=1,
        help="run the suite this many times in a row, keeping every run's summary",
    )
    ap.add_argument("--json", help=f"results file (default {RESULTS}/local-CPU.json)")
    args = ap.parse_args(argv)
    if args.launches < 1:
        ap.error(f"--launches must be at least 1, got {args.launches}")
    launches = []
    for i in range(args.launches):
        print(f"launch {i + 1} of {args.launches}", flush=True)
        print(HEADER, flush=True)
        results = run_local_suite(
            args.procs,
            args.steps,
            args.warmup,
            say=lambda msg: print(msg, file=sys.stderr, flush=True),
            on_case=lambda c: print(format_row(c), flush=True),
        )
        launches.append(launch_record(results))
    results["launches"] = launches
    path = write_results(results, args.json or RESULTS / "local-CPU.json")
    print(
        f"{len(results['cases'])} cases in {results['total_time_s']:.0f} s; wrote {path}"
    )
    if args.json is None:
        print(f"wrote {write_report()}")


if __name__ == "__main__":
    main()
