"""Alpa's weak-scaling suites (GPT, GShard MoE, Wide-ResNet): automatic plans against manual ones.

The cases are those of ../shared/reference/alpa-osdi22-suite.md (1 to 64 GPUs, 8 per host, the model
growing with the cluster), on V100-16GB hosts as measured there, or on A100-80GB / H100-80GB hosts
(`device`). For each case: plan automatically (`planner.plan`), search the grid of manual Megatron
configurations (`benchmarks.manual_grid`), both priced by the same cost models, and record

    ratio = best manual iteration time / automatic iteration time   (> 1: the automatic plan is faster)

For GPT on V100s, the configurations Megatron's authors found best (the reference's table) are also
priced as listed, next to their measured TFLOP/s: the cost model's error on published data.
Each case also records `ceiling` (`benchmarks.ceiling`): the least iteration time any plan could be
predicted to take, and the largest ratio any plan could reach.

Settings taken from the reference: GPT global batch 1024 (128 at 1 GPU, as listed), fp16, Adam with
mixed precision; Wide-ResNet batch 1536 (1520 at 32 and 64 GPUs) in fp32 (Adam, fp32 states). The
reference gives no MoE batch: 1024 sequences, as Alpa's MoE benchmark (an assumption).

The `llama` suite (`LLAMA_CASES`, H100-80GB hosts) is today's practice instead: Llama 3 and Mixtral
at the sizes torchtitan and Megatron-Core publish configurations for, bfloat16, the global batch
of a published configuration (`benchmarks.llama_configs`), the grid of today's space as the
baseline (`benchmarks.manual_grid.TODAY_SUITES`), and the published configurations of the case's
model, sequence length and GPU count priced and listed next to it (`published`, each with
`vs_auto` = its predicted seconds per sequence / the automatic plan's, > 1: the automatic plan is
faster; given also where the configuration is predicted not to fit).

The long-context case (`LONG_CONTEXT`) is also planned and searched without context parallelism
(`planner.plan(context_parallel=False)`, `best_manual(context_parallel=False)`): its record's
`auto` and `manual_best` are the bests with CP (the whole space), `without_cp` holds the bests
without it, and each automatic plan's `context_parallel` is the largest CP degree of its stages
(1: none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.ceiling import case_ceiling
from benchmarks.llama_configs import PUBLISHED, price_published
from benchmarks.manual_grid import best_manual
from benchmarks.megatron_gpt import megatron_prediction
from benchmarks.records import context_degree, machine, stage_json
from benchmarks.reference import gpt_megatron_configs, measured_tflops, scaling
from cost_models.cluster import Cluster
from cost_models.errors import DoesNotFitError
from planner import plan
from planner.models.registry import get_config

HOST = 8  # GPUs per host (p3.16xlarge, DGX A100, DGX H100)
SUITES = ("gpt", "moe", "wresnet", "llama")
DEVICES = ("V100-16GB", "A100-80GB", "H100-80GB")
_HEADING = {"gpt": "## GPT", "moe": "## GShard MoE", "wresnet": "## Wide-ResNet"}
# Measured rows of the reference: (automatic, baseline) per suite.
_SYSTEMS = {
    "gpt": ("Alpa (auto)", "Megatron-LM"),
    "moe": ("Alpa (auto)", "DeepSpeed (ZeRO + expert parallel)"),
    "wresnet": ("Alpa (auto)", "PP-DP baseline"),
}


#: Llama 3 8B at the sequence of torchtitan's longest context-parallel run (TT-BENCH Table 2).
LLAMA_LONG = "llama:hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,seq=262144"
#: The llama suite: (model, GPUs, global batch); the batch is a published configuration's
#: (`benchmarks.llama_configs` names the sources).
LLAMA_CASES = (
    ("llama3-8b", 8, 128),  # NeMo's H100 recipe, GBS 128 (torchtitan's 8-GPU run: 16)
    ("llama3-70b", 64, 128),  # NeMo's H100 recipe, GBS 128
    ("llama3-405b", 512, 256),  # torchtitan's 512-GPU run (TT-BENCH Table 5), 256
    ("mixtral-8x7b", 64, 256),  # NeMo's H100 recipe, GBS 256 (sequence 4096)
    # torchtitan's FSDP 1 x CP 8 run, local batch 1 (TT-BENCH Table 2)
    (LLAMA_LONG, 8, 1),
)
_BASE = {LLAMA_LONG: "llama3-8b"}  # the published name of a model given as a spec
#: Cases whose record also holds the bests without context parallelism (module docstring).
LONG_CONTEXT = (LLAMA_LONG,)


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model on a cluster with a global batch."""

    suite: str
    model: str
    num_devices: int
    cluster: str
    global_batch: int
    dtype: str = "float16"
    optimizer: str = "adam_mixed"


def cluster_spec(gpus: int, device: str = "V100-16GB") -> str:
    """`HxDxDEVICE` with up to 8 devices per host."""
    return f"{max(1, gpus // HOST)}x{min(gpus, HOST)}x{device}"


def suite_cases(
    suite: str, gpus: list[int] | None = None, device: str = "V100-16GB"
) -> list[Case]:
    """The weak-scaling cases of `suite` (all of the reference's GPU counts unless `gpus`)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected one of {SUITES}")
    if suite == "llama":
        counts = sorted({g for _, g, _ in LLAMA_CASES})
        unknown = sorted(set(gpus or []) - set(counts))
        if unknown:
            raise ValueError(f"llama: no case for {unknown} GPUs; cases: {counts}")
        return [
            Case(suite, m, g, cluster_spec(g, device), G, "bfloat16")
            for m, g, G in LLAMA_CASES
            if not gpus or g in gpus
        ]
    sizes = scaling(_HEADING[suite])
    unknown = sorted(set(gpus or []) - set(sizes))
    if unknown:
        raise ValueError(f"{suite}: no case for {unknown} GPUs; cases: {sorted(sizes)}")
    listed = {c["gpus"]: c["global_batch"] for c in gpt_megatron_configs()}
    out = []
    for g in gpus or sorted(sizes):
        model = f"{suite}-{sizes[g].lower()}"
        spec = cluster_spec(g, device)
        if suite == "gpt":
            out.append(Case(suite, model, g, spec, int(listed.get(g, 1024))))
        elif suite == "moe":
            out.append(Case(suite, model, g, spec, 1024))
        else:
            batch = 1520 if g >= 32 else 1536
            out.append(Case(suite, model, g, spec, batch, "float32", "adam_fp32"))
    return out


def listed_megatron(case: Case) -> dict[str, Any] | None:
    """Megatron's listed best configuration of a GPT case, priced, next to its measured TFLOP/s."""
    if case.suite != "gpt":
        return None
    listed = {c["gpus"]: c for c in gpt_megatron_configs()}.get(case.num_devices)
    if listed is None:
        return None
    return megatron_prediction(case.model, case.cluster, listed, case.global_batch)


def published_configs(case: Case) -> list[dict[str, Any]]:
    """The published configurations of the case's model and sequence length, each priced on the
    case's cluster where it can be (`benchmarks.llama_configs.price_published`)."""
    base, seq = _BASE.get(case.model, case.model), get_config(case.model).seq
    cluster = Cluster.from_spec(case.cluster)
    return [
        price_published(c, cluster, case.model, case.num_devices)
        for c in PUBLISHED
        if c.model == base and c.seq == seq
    ]


def _vs_auto(published: dict[str, Any], case: dict[str, Any]) -> float | None:
    """Seconds per sequence of a priced published configuration / the automatic plan's (its
    global batch can differ from the case's); given whether or not it is predicted to fit."""
    t = case["auto"]["iteration_time_s"]
    if not (published.get("priced") and t):
        return None
    return (published["iteration_time_s"] / published["global_batch"]) / (
        t / case["global_batch"]
    )


def _auto_record(case: Case, context_parallel: bool = True) -> dict[str, Any]:
    """The automatic plan of `case` as recorded (`planner.plan`; without context parallelism
    when `context_parallel` is False), or why none fits."""
    t0 = time.perf_counter()
    try:
        auto = plan(
            case.model,
            case.cluster,
            global_batch=case.global_batch,
            dtype=case.dtype,
            optimizer=case.optimizer,
            context_parallel=context_parallel,
        )
    except DoesNotFitError as exc:  # recorded, and the suite goes on
        return {
            "iteration_time_s": None,
            "tflops_per_device": None,
            "fits": False,
            "error": str(exc),
            "num_microbatches": None,
            "stages": [],
            "planner_time_s": time.perf_counter() - t0,
        }
    record = {
        "iteration_time_s": auto.estimate.iteration_time_s,
        "tflops_per_device": auto.estimate.tflops_per_device,
        "peak_memory_bytes": auto.estimate.peak_memory_bytes,
        "fits": auto.estimate.peak_memory_bytes <= auto.memory_budget_bytes,
        "num_microbatches": auto.num_microbatches,
        "schedule": auto.schedule,
        "virtual_stages": auto.virtual_stages,
        "stages": [stage_json(s) for s in auto.stages],
        "planner_time_s": time.perf_counter() - t0,
    }
    if case.model in LONG_CONTEXT:
        record["context_parallel"] = context_degree(auto)
    return record


def _ratio(manual: dict[str, Any], auto: dict[str, Any]) -> float | None:
    t_auto = auto["iteration_time_s"]
    return manual["iteration_time_s"] / t_auto if manual["config"] and t_auto else None


def run_case(case: Case, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan `case` automatically and search its manual grid; the JSON record of the case (for a
    long-context case also both without context parallelism, module docstring)."""
    grid = {
        "suite": case.suite,
        "dtype": case.dtype,
        "optimizer": case.optimizer,
        "say": say,
    }
    record = _auto_record(case)
    manual = best_manual(case.model, case.cluster, case.global_batch, **grid)
    out: dict[str, Any] = asdict(case) | {
        "auto": record,
        "manual_best": manual,
        "ratio": _ratio(manual, record),
    }
    if case.model in LONG_CONTEXT:
        if say:
            say("without context parallelism")
        auto_1 = _auto_record(case, context_parallel=False)
        manual_1 = best_manual(
            case.model,
            case.cluster,
            case.global_batch,
            **grid,
            context_parallel=False,
        )
        out["without_cp"] = {
            "auto": auto_1,
            "manual_best": manual_1,
            "ratio": _ratio(manual_1, auto_1),
        }
    out["ceiling"] = case_ceiling(out)
    if case.suite == "llama":
        out["published"] = [
            p | {"vs_auto": _vs_auto(p, out)} for p in published_configs(case)
        ]
    if case.cluster.endswith("V100-16GB"):
        auto_sys, base_sys = _SYSTEMS[case.suite]
        heading = _HEADING[case.suite]
        out["measured_tflops_per_device"] = {
            auto_sys: measured_tflops(heading, auto_sys).get(case.num_devices),
            base_sys: measured_tflops(heading, base_sys).get(case.num_devices),
        }
        listed = listed_megatron(case)
        if listed:
            out["megatron_listed"] = listed
    return out


def run_suite(
    suite: str,
    gpus: list[int] | None = None,
    device: str = "V100-16GB",
    say: Callable[[str], None] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every case of a suite; the results document (`benchmarks.report` writes and reads it).
    `say` gets progress lines, `on_case` each case's record when it is done."""
    import datetime

    import torch

    t0 = time.perf_counter()
    cases = []
    for case in suite_cases(suite, gpus, device):
        if say:
            say(f"{case.suite} {case.model} on {case.cluster}")
        cases.append(run_case(case, say))
        if on_case:
            on_case(cases[-1])
    return {
        "suite": suite,
        "device": device,
        "machine": machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "total_time_s": time.perf_counter() - t0,
        "cases": cases,
    }


HEADER = (
    f"{'GPUs':>4} {'model':<13} {'auto TFLOP/s':>12} {'manual best':>26} {'TFLOP/s':>7} "
    f"{'ratio':>6} {'max':>6} {'plan s':>7} {'grid s':>7}  auto stages"
)


def format_row(c: dict[str, Any]) -> str:
    """One line of the console table."""
    m = c["manual_best"]
    stages = " ".join(
        f"{s['layers'][0]}-{s['layers'][1]}@{s['logical_mesh'][0]}x{s['logical_mesh'][1]}"
        for s in c["auto"]["stages"]
    )
    ratio = f"{c['ratio']:.2f}" if c["ratio"] else "-"
    most = (c.get("ceiling") or {}).get("max_ratio")
    cap = f"{most:.2f}" if most else "-"
    auto = c["auto"]["tflops_per_device"]
    return (
        f"{c['num_devices']:>4} {c['model']:<13} {'none fits' if auto is None else f'{auto:.1f}':>12} "
        f"{m.get('label', 'none fits'):>26} {m.get('tflops_per_device') or 0:>7.1f} {ratio:>6} {cap:>6} "
        f"{c['auto']['planner_time_s']:>7.1f} {m['search_time_s']:>7.1f}  "
        + (
            f"B={c['auto']['num_microbatches']}"
            + (
                f" v{c['auto'].get('virtual_stages', 1)}"
                if c["auto"].get("virtual_stages", 1) > 1
                else ""
            )
            + f" {stages}"
            if stages
            else "does not fit"
        )
    )
