"""Grid search over manual (Megatron-LM style) configurations: the baseline for the benchmark suites.

For a case (model, cluster, global batch) the grid is every

    dp x tp x pp = devices     tp a power of two within a host (Megatron keeps tensor parallelism on
                               NVLink), pp at most the model's number of blocks;
    micro-batch count B        per-rank micro-batch sizes 1, 2, 4, 8, 16 (B = G / (dp * size)),
                               B >= pp (fewer micro-batches than stages is mostly pipeline bubble);
    recompute                  off, then on;
    expert parallel            for MoE, off and (when E divides by dp > 1) on.

Wide-ResNet's baseline is PP-DP (the paper's): Megatron's tensor-parallel rules cover no convolution
weight, so tp = 1 there. Every configuration is priced by `planner.plans.manual.manual_plan`, the same cost
models as the automatic plans; the best feasible one (least predicted iteration time, fits in memory)
is the baseline.

Pruning, so the grid stays fast (each pruned configuration cannot be the best feasible one):

* a memory lower bound: parameters, gradients and optimizer state of the model split over tp * pp
  devices (expert weights over dp * tp * pp with expert parallelism), with no activation at all,
  must fit in the device's memory;
* within one (dp, tp, pp, expert parallel), micro-batch sizes are tried smallest first; predicted
  memory grows with the size, so once a size does not fit even with recomputation, larger ones are
  skipped;
* the time is taken as unimodal in the micro-batch size (larger micro-batches run more efficiently
  until the pipeline bubble of fewer micro-batches dominates): a group stops at the first size that
  is slower than the one before (a heuristic; it can miss a second minimum);
* recomputation is priced only when the same configuration without it does not fit (without
  recomputation the time is never larger and the memory never smaller), and once recompute-off has
  not fitted at one micro-batch size it is not tried at larger ones.

Pricing traces the model once per micro-batch size (`planner.tracing.inputs.ModelSource`), not
once per configuration.

Today's space (the suites of `TODAY_SUITES`: Llama 3 and Mixtral, as torchtitan and Megatron-Core
configure them by hand) is larger; every configuration is still one `manual_plan` call:

    dp x tp x pp = devices     as above (tp a power of two within a host, pp <= blocks);
    parameter sharding         fsdp "none" (Megatron's DDP), "zero2" (the optimizer state
                               sharded over the dp replicas: Megatron-Core's distributed
                               optimizer, on in its published recipes), "full" (FSDP2 / ZeRO-3
                               over the dp replicas, torchtitan's default) or "hybrid" (HSDP:
                               sharded inside a host, replicated across hosts; tp = 1, no expert
                               parallelism, dp spans several hosts), `manual_plan(fsdp=...)`;
    sequence parallelism       on whenever tp > 1 (Megatron-Core and torchtitan always pair them);
    pipeline schedule          1F1B, and interleaved 1F1B with v = `VIRTUAL_STAGES` model chunks
                               per device when pp > 1, pp * v <= blocks and the micro-batch count is
                               a multiple of pp (Megatron-LM's requirement);
    expert parallel            for MoE, off and on (when E divides by dp > 1); expert parallelism
                               over part of the replicas (`manual_plan(expert_parallel=ep)`, a
                               (dp / ep, ep) mesh with tp = 1) prices Megatron-Core's published
                               Mixtral layout (`benchmarks.llama_configs`) but is not in the grid;
    recompute                  none, selective (the attention cores) or full, with or without
                               FSDP (torchtitan's default is FSDP2 with activation checkpointing;
                               `runtime.fsdp` gathers again for the recomputed forward);
    micro-batch size           1, 2, 4, 8, 16 rows per replica, B >= pp;
    context parallelism        cp x tp x pp = devices with cp > 1 dividing the model's sequence
                               (`manual_plan(context_parallel=cp)`: every attention on its own
                               queries against all-gathered keys and values, the sequence split
                               over cp devices), and also dp x cp x tp x pp with dp > 1 (a
                               (dp, cp) mesh with tp = 1, else (dp, cp, tp): Megatron's
                               --context-parallel-size with data and tensor parallelism), with
                               fsdp "none", "zero2" or "full" (sharded over
                               the dp x cp devices; FSDP as torchtitan combines them), 1F1B or
                               interleaved as above, the same recomputation ladder, micro-batches
                               of one row per replica (B = G / dp).

Context-parallel configurations the grid skips, and why (what `manual_plan` can price today):
CP with
micro-batches of more than one row per replica (the sequence split then cannot pass the
`[rows, s, h] -> [rows * s, h]` views around the matrix products without gathering:
`planner.vocab.nested_views`); CP with HSDP or expert parallelism (`manual_plan` refuses both),
and CP for models with experts at all (the automatic search seeds none either,
`planner.intra.megatron.context_seeds`); cp that does not divide the sequence.
`best_manual(context_parallel=False)` searches the grid without CP. The same pruning applies, with the recomputation ladder none -> selective -> full (each step slower and smaller),
the memory lower bound dividing the state by the FSDP shard group too (with "zero2" the optimizer
state only), and one more heuristic: the
interleaved groups of a (dp, tp, pp, expert parallel, fsdp) are walked only when its 1F1B group had
a configuration that fits (interleaving keeps more micro-batches in flight than 1F1B,
`cost_models.memory.microbatches_in_flight`, so it needs at least as much activation memory; the
layer split into pp * v chunks can move a little of the state between devices, so this is a
heuristic, not a bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.grid_walk import Priced, Walk, layout_runs, walk_all
from cost_models.cluster import Cluster
from cost_models.memory import state_bytes_per_param
from planner.intra.megatron import is_expert_weight
from planner.models import build_model
from planner.models.registry import get_config
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan

MICROBATCH_SIZES = (1, 2, 4, 8, 16)
#: Suites whose baseline is today's space (torchtitan / Megatron-Core; module docstring).
TODAY_SUITES = ("llama",)
#: Model chunks per device of the interleaved schedule in today's space: 2 and 4 (Narayanan et
#: al.'s sweep), 5 and 8 (Megatron-Core's published Llama 3 70B and Mixtral 8x7B recipes).
VIRTUAL_STAGES = (2, 4, 5, 8)
#: Recomputation ladders, least memory-saving (fastest) first.
_LADDER_2021 = (False, True)
_LADDER = ("none", "selective", "full")


@dataclass(frozen=True)
class ManualConfig:
    """One manual configuration: Megatron-LM's of 2021 (recompute True/False), or today's space
    with the fields after `expert_parallel` (recompute "none", "selective" or "full")."""

    dp: int
    tp: int
    pp: int
    num_microbatches: int
    recompute: bool | str
    # True: experts over all dp replicas; an int: over groups of that many (tp 1, `manual_plan`)
    expert_parallel: bool | int = False
    fsdp: str = "none"
    sequence_parallel: bool | None = None
    virtual_stages: int = 1
    context_parallel: int = 1

    def label(self) -> str:
        ep = self.expert_parallel
        ep = " EP" if ep is True else f" EP{ep}" if ep and ep > 1 else ""
        rc = {True: " rc", "full": " rc", "selective": " sel"}.get(self.recompute, "")
        shard = {"zero2": " zero2", "full": " fsdp", "hybrid": " hsdp"}.get(
            self.fsdp, ""
        )
        sp = " sp" if self.sequence_parallel else ""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        cp = f" cp{self.context_parallel}" if self.context_parallel > 1 else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} B{self.num_microbatches}"
            f"{rc}{ep}{shard}{sp}{v}{cp}"
        )

    def record(self) -> dict[str, Any]:
        """The configuration as recorded in a case: today's fields only where they differ from
        their defaults, so records of the 2021 grid keep their form (`ManualConfig(**record)`
        reads either)."""
        out = asdict(self)
        for f in ("fsdp", "sequence_parallel", "virtual_stages", "context_parallel"):
            if out[f] == ManualConfig.__dataclass_fields__[f].default:
                del out[f]
        return out


@dataclass(frozen=True)
class ModelFacts:
    """What the pruning needs to know of a model, read once on the meta device."""

    params: int
    expert_params: int
    experts: int
    blocks: int
    seq: int | None = (
        None  # the training sequence length, where the model's config has one
    )


def model_facts(model: str) -> ModelFacts:
    """Parameter counts (all, expert weights), the number of experts and of repeated blocks,
    and the sequence length of the model's config (None where it has none)."""
    module, _ = build_model(model, device="meta")
    params = expert = experts = 0
    blocks: set[str] = set()
    for path, p in module.named_parameters():
        params += p.numel()
        if is_expert_weight(path):
            expert += p.numel()
            experts = int(p.shape[0])
        parts = path.split(".")
        if parts[0] == "blocks" and len(parts) > 1:
            blocks.add(parts[1])
    return ModelFacts(
        params,
        expert,
        experts,
        max(1, len(blocks)),
        getattr(get_config(model), "seq", None),
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parallel_degrees(
    devices: int, per_host: int, max_pp: int, tensor_parallel: bool = True
) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp * tp * pp = devices, tp a power of two dividing the host, pp <= max_pp."""
    out = []
    for tp in range(1, per_host + 1):
        if (
            per_host % tp
            or not _pow2(tp)
            or devices % tp
            or (tp > 1 and not tensor_parallel)
        ):
            continue
        for pp in range(1, min(devices // tp, max_pp) + 1):
            if (devices // tp) % pp == 0:
                out.append((devices // (tp * pp), tp, pp))
    return out


def state_lower_bound(
    facts: ModelFacts,
    dp: int,
    tp: int,
    pp: int,
    optimizer: str,
    expert_parallel: bool,
    shard: int = 1,
    zero2: bool = False,
) -> float:
    """Bytes per device of parameters, gradients and optimizer state at best (no activations);
    `shard`: the FSDP shard group every weight is also split over (1 without FSDP, dp with full
    FSDP, the devices of a host with HSDP; expert weights split by expert parallelism are not
    split again); with `zero2`, only the optimizer state of the weights it replicates is split
    over `shard` (the weights and the gradients are held whole until the step,
    `manual_plan(fsdp="zero2")`)."""
    s = state_bytes_per_param(optimizer)
    dense = facts.params - facts.expert_params
    if zero2:  # expert weights split by expert parallelism keep their state whole
        replicated = dense + (0 if expert_parallel else facts.expert_params)
        split = facts.expert_params / dp if expert_parallel else 0.0
        per_device = (
            (s.param + s.grad) * replicated
            + s.optimizer * replicated / shard
            + s.total * split
        )
        return per_device / (tp * pp)
    experts = facts.expert_params / (dp if expert_parallel else shard)
    return s.total * (dense / shard + experts) / (tp * pp)


def grid(
    model: str,
    cluster: Cluster,
    global_batch: int,
    optimizer: str,
    suite: str,
    context_parallel: bool = True,
) -> tuple[list[list[ManualConfig]], int]:
    """Configurations to price, grouped by (dp, tp, pp, expert parallel) and, in today's space
    (`TODAY_SUITES`), parameter sharding, virtual stages and context parallelism (none when
    `context_parallel` is False); in a group, by micro-batch size in increasing order and at each
    size by recomputation, least first (one group is walked until it stops fitting). Also the
    number pruned by the memory lower bound."""
    facts = model_facts(model)
    today = suite in TODAY_SUITES
    budget = cluster.device.memory_bytes
    M = cluster.devices_per_host
    groups: list[list[ManualConfig]] = []
    pruned = 0
    eps = (False, True) if facts.experts else (False,)
    for dp, cp, tp, pp in _with_context(
        parallel_degrees(
            cluster.num_devices, M, facts.blocks, tensor_parallel=suite != "wresnet"
        ),
        facts if today and context_parallel else None,
    ):
        for ep in eps:
            if ep and (dp == 1 or facts.experts % dp):
                continue
            for fsdp, v in (
                _layouts(dp, tp, pp, ep, M, facts.blocks, cp)
                if today
                else [("none", 1)]
            ):
                group = []
                for size in MICROBATCH_SIZES if cp == 1 else (1,):
                    if global_batch % (dp * size):
                        continue
                    B = global_batch // (dp * size)
                    if B < pp or (v > 1 and B % pp):
                        continue
                    if not today:
                        group += [
                            ManualConfig(dp, tp, pp, B, rc, ep) for rc in _LADDER_2021
                        ]
                        continue
                    sp = True if tp > 1 else None
                    group += [
                        ManualConfig(dp, tp, pp, B, rc, ep, fsdp, sp, v, cp)
                        for rc in _LADDER
                    ]
                if not group:
                    continue
                shard = {"none": 1, "zero2": dp * cp, "full": dp * cp, "hybrid": M}[
                    fsdp
                ]
                bound = state_lower_bound(
                    facts, dp, tp, pp, optimizer, ep, shard, zero2=fsdp == "zero2"
                )
                if bound > budget:
                    pruned += len(group)
                    continue
                groups.append(group)
    return groups, pruned


def _with_context(
    degrees: list[tuple[int, int, int]], facts: ModelFacts | None
) -> list[tuple[int, int, int, int]]:
    """(dp, cp, tp, pp): each (dp, tp, pp) without context parallelism (cp = 1), followed, when
    `facts` is given (today's space with CP) and the model has no experts, by the same devices
    given to CP instead of data parallelism, (1, dp, tp, pp), and split between them, (d, c, tp,
    pp) for d x c = dp, where cp divides the model's sequence (module docstring: what the grid
    skips and why)."""
    out = []
    for dp, tp, pp in degrees:
        out.append((dp, 1, tp, pp))
        if facts is None or facts.experts or facts.seq is None:
            continue
        for cp in range(2, dp + 1):
            if dp % cp == 0 and facts.seq % cp == 0:
                out.append((dp // cp, cp, tp, pp))
    return out


def _layouts(
    dp: int, tp: int, pp: int, ep: bool, per_host: int, blocks: int, cp: int = 1
) -> list[tuple[str, int]]:
    """(fsdp, virtual stages) of today's space for one (dp, cp, tp, pp, expert parallel), each
    fsdp's 1F1B first (`best_manual` walks the interleaved ones only when it fitted); with
    context parallelism FSDP shards over the cp devices, and HSDP is not offered."""
    shards = ["none"]
    if dp * cp > 1:
        shards += ["zero2", "full"]
    if tp == 1 and not ep and dp > per_host:
        shards.append("hybrid")
    vs = [1] + [v for v in VIRTUAL_STAGES if pp > 1 and pp * v <= blocks]
    return [(f, v) for f in shards for v in vs]


def price(
    model: str,
    cluster: Cluster,
    config: ManualConfig,
    global_batch: int,
    dtype: str,
    optimizer: str,
) -> ParallelPlan:
    """The manual plan of one configuration (allowed to exceed memory; see `plan.manual["fits"]`)."""
    return manual_plan(
        model,
        cluster,
        dp=config.dp,
        tp=config.tp,
        pp=config.pp,
        num_microbatches=config.num_microbatches,
        global_batch=global_batch,
        recompute=config.recompute,
        expert_parallel=config.expert_parallel,
        fsdp=config.fsdp,
        sequence_parallel=config.sequence_parallel,
        virtual_stages=config.virtual_stages,
        context_parallel=config.context_parallel,
        dtype=dtype,
        optimizer=optimizer,
        allow_oom=True,
    )


def best_manual(
    model: str,
    cluster: Cluster | str,
    global_batch: int,
    *,
    suite: str,
    dtype: str = "float16",
    optimizer: str = "adam_mixed",
    say: Callable[[str], None] | None = None,
    skip: Callable[[ParallelPlan], bool] | None = None,
    context_parallel: bool = True,
) -> dict[str, Any]:
    """Search the grid; return the best feasible configuration and its prediction, or
    `{"config": None, ...}` when none fits. `grid_size` counts every configuration of the grid,
    `grid_priced` those actually priced (the rest were pruned, see the module docstring). A
    configuration whose plan `skip` accepts is walked past but never the best (the local suite
    asks for the best manual plan other than the automatic one). `context_parallel=False`
    leaves context parallelism out of today's grid; where the grid has CP configurations,
    `context_parallel` records how many were priced and fitted, the fastest that fits and the
    one predicted to need the least memory (fitting or not).

    Each layout's groups (`_layouts`) are walked on their own, in worker processes where
    `planner.size_search` would use them (`MESHPLAN_PLANNER_PROCESSES`, forked); the result is
    the serial walk's: ties go to the configuration the serial walk priced first."""
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    t0 = time.perf_counter()
    groups, pruned = grid(
        model, cluster, global_batch, optimizer, suite, context_parallel
    )
    walk = Walk(price, model, cluster, global_batch, dtype, optimizer, say, skip)
    priced = sorted(p for run in walk_all(walk, layout_runs(groups)) for p in run)
    fitting = [p for p in priced if p.fits]
    best = min(
        (p for p in fitting if not p.skipped),
        key=lambda p: (p.time_s, p.index),
        default=None,
    )
    out: dict[str, Any] = {
        "config": None,
        "iteration_time_s": None,
        "grid_size": pruned + sum(len(g) for g in groups),
        "grid_priced": len(priced),
        "search_time_s": time.perf_counter() - t0,
    }
    if best is not None:
        out |= {
            "config": best.config.record(),
            "label": best.config.label(),
            "iteration_time_s": best.time_s,
            "tflops_per_device": best.tflops,
            "peak_memory_bytes": best.peak,
        }
    if any(g[0].context_parallel > 1 for g in groups):
        cp = [p for p in priced if p.config.context_parallel > 1]
        cp_fitting = [p for p in cp if p.fits]
        out["context_parallel"] = {
            "priced": len(cp),
            "fitted": len(cp_fitting),
            "best": _summary(
                min(cp_fitting, key=lambda p: (p.time_s, p.index), default=None)
            ),
            "leanest": _summary(min(cp, key=lambda p: (p.peak, p.index), default=None)),
        }
    return out


def _summary(priced: Priced | None) -> dict[str, Any] | None:
    """A priced configuration as recorded beside the grid's best: label, time, memory, fit."""
    if priced is None:
        return None
    return {
        "label": priced.config.label(),
        "iteration_time_s": priced.time_s,
        "peak_memory_bytes": priced.peak,
        "fits": priced.fits,
    }
