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

Pricing traces the model once per micro-batch size (`shared_traces`), not once per configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from cost_models.memory import state_bytes_per_param
from planner.models import build_model
from planner.plans import manual
from planner.plans.manual import manual_plan
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_file import ParallelPlan

MICROBATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ManualConfig:
    """One Megatron configuration."""

    dp: int
    tp: int
    pp: int
    num_microbatches: int
    recompute: bool
    expert_parallel: bool = False

    def label(self) -> str:
        ep = " EP" if self.expert_parallel else ""
        rc = " rc" if self.recompute else ""
        return f"dp{self.dp} tp{self.tp} pp{self.pp} B{self.num_microbatches}{rc}{ep}"


@dataclass(frozen=True)
class ModelFacts:
    """What the pruning needs to know of a model, read once on the meta device."""

    params: int
    expert_params: int
    experts: int
    blocks: int


def model_facts(model: str) -> ModelFacts:
    """Parameter counts (all, expert weights), the number of experts and of repeated blocks."""
    module, _ = build_model(model, device="meta")
    params = expert = experts = 0
    blocks: set[str] = set()
    for path, p in module.named_parameters():
        params += p.numel()
        if path.endswith(("mlp.wi", "mlp.wo")):
            expert += p.numel()
            experts = int(p.shape[0])
        parts = path.split(".")
        if parts[0] == "blocks" and len(parts) > 1:
            blocks.add(parts[1])
    return ModelFacts(params, expert, experts, max(1, len(blocks)))


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
    facts: ModelFacts, dp: int, tp: int, pp: int, optimizer: str, expert_parallel: bool
) -> float:
    """Bytes per device of parameters, gradients and optimizer state at best (no activations)."""
    per_param = state_bytes_per_param(optimizer).total
    dense = facts.params - facts.expert_params
    experts = facts.expert_params / (dp if expert_parallel else 1)
    return per_param * (dense + experts) / (tp * pp)


def grid(
    model: str,
    cluster: Cluster,
    global_batch: int,
    optimizer: str,
    suite: str,
) -> tuple[list[list[ManualConfig]], int]:
    """Configurations to price, grouped by (dp, tp, pp, expert parallel) with micro-batch sizes in
    increasing order (one group is walked until it stops fitting), and the number pruned by the
    memory lower bound."""
    facts = model_facts(model)
    budget = cluster.device.memory_bytes
    groups: list[list[ManualConfig]] = []
    pruned = 0
    eps = (False, True) if suite in ("moe", "mixtral") else (False,)
    for dp, tp, pp in parallel_degrees(
        cluster.num_devices,
        cluster.devices_per_host,
        facts.blocks,
        tensor_parallel=suite != "wresnet",
    ):
        for ep in eps:
            if ep and (dp == 1 or facts.experts % dp):
                continue
            group = []
            for size in MICROBATCH_SIZES:
                if global_batch % (dp * size):
                    continue
                B = global_batch // (dp * size)
                if B < pp:
                    continue
                group += [ManualConfig(dp, tp, pp, B, rc, ep) for rc in (False, True)]
            if not group:
                continue
            if state_lower_bound(facts, dp, tp, pp, optimizer, ep) > budget:
                pruned += len(group)
                continue
            groups.append(group)
    return groups, pruned


@contextmanager
def shared_traces() -> Iterator[None]:
    """Within the block, `planner.plans.manual` traces a model once per (name, batch shapes) and reuses
    the OpGraph (planning reads it and never changes it): most of a configuration's pricing time is
    tracing, and a grid prices the same micro-batch size many times."""
    original = manual.trace
    graphs: dict[tuple[str, tuple], OpGraph] = {}

    def cached(module: Any, batch: Any, *, model_name: str = "") -> OpGraph:
        key = (model_name, tuple(tuple(t.shape) for t in batch))
        if key not in graphs:
            graphs[key] = original(module, batch, model_name=model_name)
        return graphs[key]

    manual.trace = cached
    try:
        yield
    finally:
        manual.trace = original


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
) -> dict[str, Any]:
    """Search the grid; return the best feasible configuration and its prediction, or
    `{"config": None, ...}` when none fits. `grid_size` counts every configuration of the grid,
    `grid_priced` those actually priced (the rest were pruned, see the module docstring). A
    configuration whose plan `skip` accepts is walked past but never the best (the local suite
    asks for the best manual plan other than the automatic one)."""
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    t0 = time.perf_counter()
    groups, pruned = grid(model, cluster, global_batch, optimizer, suite)
    best: tuple[float, ManualConfig, ParallelPlan] | None = None
    priced = 0
    with shared_traces():
        for group in groups:
            previous = float("inf")  # best time at the previous micro-batch size
            plain_fits = True  # recompute off fitted at the previous size
            for i in range(
                0, len(group), 2
            ):  # (recompute off, on) per micro-batch size
                fitted, here = False, float("inf")
                for config in group[i : i + 2] if plain_fits else group[i + 1 : i + 2]:
                    try:
                        p = price(
                            model, cluster, config, global_batch, dtype, optimizer
                        )
                    except MeshplanError as exc:  # e.g. too few ops for pp stages
                        if say:
                            say(f"  {config.label()}: skipped ({exc})")
                        continue
                    priced += 1
                    if not p.manual["fits"]:
                        plain_fits = plain_fits and config.recompute
                        continue
                    fitted = True
                    here = t = p.estimate.iteration_time_s
                    if say:
                        say(f"  {config.label()}: {t:.2f} s")
                    if (best is None or t < best[0]) and not (skip and skip(p)):
                        best = (t, config, p)
                    break  # recomputation would only be slower
                if not fitted or here > previous:
                    break
                previous = here
    out: dict[str, Any] = {
        "config": None,
        "iteration_time_s": None,
        "grid_size": pruned + sum(len(g) for g in groups),
        "grid_priced": priced,
        "search_time_s": time.perf_counter() - t0,
    }
    if best is not None:
        t, config, p = best
        out |= {
            "config": asdict(config),
            "label": config.label(),
            "iteration_time_s": t,
            "tflops_per_device": p.estimate.tflops_per_device,
            "peak_memory_bytes": p.estimate.peak_memory_bytes,
        }
    return out
