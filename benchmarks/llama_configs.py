"""The configurations torchtitan and Megatron-Core (NVIDIA NeMo / Megatron-Bridge) publish for
Llama 3 8B/70B/405B and Mixtral 8x7B on H100s, as they publish them, each with its source; and
their pricing by the cost models (`benchmarks.manual_grid.price`, i.e. `manual_plan`).

Nothing here is invented: a field a source does not give is None and said so in `note`. The
sources, read on 2026-11-26:

* TT-BENCH: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (commit b5bcd76c of
  github.com/pytorch/torchtitan; runs of 2024-12 with torchtitan 9dec370, Grand Teton hosts of 8
  H100 96 GB HBM2e at 500 W). Sequence length: the doc gives none for its 8B/70B/405B tables except
  the context-parallel ones; torchtitan's train configs of the time (TT-TOML) use 8192.
* TT-TOML: pytorch/torchtitan, torchtitan/models/llama3/train_configs/llama3_{8b,70b,405b}.toml
  at commit 4a950eaa (the last before the TOML files became Python, #2386).
  `data_parallel_shard_degree = -1` is FSDP over all the devices the other degrees leave; the
  files give no GPU count.
* TT-PP: pytorch/torchtitan, torchtitan/parallelisms/pipelining_utils.py and pipeline_llama.py
  at 9dec370 (TT-BENCH's torchtitan commit): without ``pipeline_parallel_microbatches`` a step
  runs as many micro-batches as the pipeline degree, and without split points a multi-stage
  schedule (interleaved 1F1B) gets two stages per rank.
* NEMO-CSV: NVIDIA/NeMo, scripts/performance/recommended_model_configs/model_configs_h100.csv at
  commit 8cfedd72 (2025-09-20): NVIDIA's recommended Megatron-Core pre-training configurations
  on DGX H100 (columns num_gpus, seq_len, tp, pp, cp, ep, vp, mbs, gbs, use_mcore_fsdp,
  recompute_layers; sequence parallelism is not a column).
* NEMO-OPT: NVIDIA/NeMo, nemo/collections/llm/recipes/optim/adam.py at commit 06cca550:
  `distributed_fused_adam_with_cosine_annealing`, the optimizer of NeMo's pre-training recipes,
  sets ``use_distributed_optimizer=True``.
* MB-RECIPE: NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/perf_recipes/llama/h100/llama3.py
  and llama31.py at commit 067f987d (2026-08-22): the H100 performance recipes (they set
  sequence_parallel explicitly).

Pricing: a configuration becomes a `ManualConfig` (dp = GPUs / (tp * pp * cp), micro-batches =
global batch / (dp * micro-batch size)) priced at its own global batch in bfloat16 (FP8 runs are
priced in bfloat16: the cost models have no FP8 GEMM rate; said per row). Megatron-Core's
configurations without FSDP run its distributed optimizer (NEMO-OPT): they are priced with
ZeRO-2 (`manual_plan(fsdp="zero2")`, the same collectives and memory: the optimizer state
sharded over the data-parallel replicas, each gradient whole until the step). Context
parallelism with data and tensor parallelism runs on a (dp, cp, tp) mesh per stage. A
configuration is left unpriced, with the reason recorded, when it uses context parallelism
with data parallelism at more than one row per replica per micro-batch
(`benchmarks.manual_grid`'s docstring says why), expert parallelism over a part of the
data-parallel ranks together with tensor parallelism (without it, a (dp / ep, ep) mesh,
`manual_plan(expert_parallel=ep)`), recomputation of only some blocks, or another GPU count
than the suite's case. FSDP together with activation recomputation (torchtitan's recipes) is priced as
`manual_plan` prices it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError

TT_BENCH = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76c"
TT_TOML = (
    "github.com/pytorch/torchtitan torchtitan/models/llama3/train_configs/{} @4a950eaa"
)
NEMO_CSV = (
    "github.com/NVIDIA/NeMo scripts/performance/recommended_model_configs/"
    "model_configs_h100.csv @8cfedd72"
)
TT_PP = (
    "github.com/pytorch/torchtitan torchtitan/parallelisms/pipelining_utils.py @9dec370"
)
MB_RECIPE = (
    "github.com/NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/perf_recipes/llama/h100/{} "
    "@067f987d"
)


@dataclass(frozen=True)
class PublishedConfig:
    """One published configuration. `microbatch_size`: rows per data-parallel replica per
    micro-batch (torchtitan's local batch without pipeline, Megatron's MBS); `recompute`: none,
    selective, full, or a description of what the source does when it is none of these;
    `virtual_stages`: None without a pipeline, or where the source does not give it."""

    system: str
    model: str
    gpus: int
    seq: int
    global_batch: int
    microbatch_size: int
    fsdp: str
    tp: int
    pp: int
    cp: int
    ep: int
    virtual_stages: int | None
    recompute: str
    sequence_parallel: bool | None
    precision: str
    source: str
    note: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def distributed_optimizer(self) -> bool:
        """Megatron-Core without FSDP: its distributed optimizer shards the optimizer state
        over the data-parallel replicas (NEMO-OPT)."""
        return self.system.startswith("Megatron-Core") and self.fsdp == "none"

    def label(self) -> str:
        shard = {"full": f"FSDP{self.dp}", "hybrid": f"HSDP{self.dp}"}.get(
            self.fsdp, f"DP{self.dp}"
        )
        if self.distributed_optimizer and self.dp > 1:
            shard += " (dist-opt)"
        parts = [shard, f"TP{self.tp}", f"PP{self.pp}"]
        if self.virtual_stages is None:  # None: no pipeline, or not published
            if self.pp > 1:
                parts.append("interleaved (VP not published)")
        elif self.virtual_stages > 1:
            parts.append(f"VP{self.virtual_stages}")
        elif self.pp > 1:
            parts.append("1F1B")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        return (
            f"{' '.join(parts)}, mbs {self.microbatch_size}, gbs {self.global_batch}, "
            f"recompute {self.recompute}"
        )


_TT8 = {"system": "torchtitan", "model": "llama3-8b", "precision": "bf16"}
PUBLISHED: tuple[PublishedConfig, ...] = (
    # torchtitan, TT-BENCH Table 1 (and Table 3 at 128 GPUs): FSDP, 8 GPUs, local batch 2,
    # global batch 16, selective activation checkpointing; seq 8192 from TT-TOML llama3_8b.toml.
    PublishedConfig(
        **_TT8,
        gpus=8,
        seq=8192,
        global_batch=16,
        microbatch_size=2,
        fsdp="full",
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        virtual_stages=None,
        recompute="selective",
        sequence_parallel=None,
        source=f"{TT_BENCH} Table 1",
        note="also run with torch.compile and Float8; seq 8192 from llama3_8b.toml",
    ),
    # torchtitan, TT-BENCH Table 2, the longest row: FSDP 1, CP 8 at sequence 262144, local
    # batch 1, full activation checkpointing (torch.compile + Float8).
    PublishedConfig(
        **_TT8 | {"precision": "fp8 (Float8 linears)"},
        gpus=8,
        seq=262144,
        global_batch=1,
        microbatch_size=1,
        fsdp="full",
        tp=1,
        pp=1,
        cp=8,
        ep=1,
        virtual_stages=None,
        recompute="full",
        sequence_parallel=None,
        source=f"{TT_BENCH} Table 2",
        note="global batch 1 = local batch 1 x FSDP 1",
    ),
    # torchtitan, TT-TOML llama3_70b.toml: FSDP over the rest, TP 8, local batch 8, seq 8192, full
    # AC; on the suite's 64 GPUs that is FSDP 8 x TP 8 (global batch 64).
    PublishedConfig(
        system="torchtitan",
        model="llama3-70b",
        gpus=64,
        seq=8192,
        global_batch=64,
        microbatch_size=8,
        fsdp="full",
        tp=8,
        pp=1,
        cp=1,
        ep=1,
        virtual_stages=None,
        recompute="full",
        sequence_parallel=True,
        precision="bf16",
        source=TT_TOML.format("llama3_70b.toml"),
        note="the file gives no GPU count: FSDP degree -1 is 8 on 64 GPUs; TT-BENCH's 70B run "
        "is FSDP 32 x TP 8 on 256 GPUs, local batch 16 (Table 4)",
    ),
    # torchtitan, TT-BENCH Table 5: 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32, global batch
    # 256, full AC, schedules 1F1B and interleaved 1F1B (Float8, AsyncTP, torch.compile). The
    # table gives neither the micro-batches nor the stages per rank: torchtitan's defaults at the
    # run's commit (TT-PP) are 8 micro-batches (the pipeline degree), so 4 rows each, and two
    # stages per rank for the interleaved schedule.
    *(
        PublishedConfig(
            system="torchtitan",
            model="llama3-405b",
            gpus=512,
            seq=8192,
            global_batch=256,
            microbatch_size=4,
            fsdp="full",
            tp=8,
            pp=8,
            cp=1,
            ep=1,
            virtual_stages=v,
            recompute="full",
            sequence_parallel=True,
            precision="fp8 (Float8 linears)",
            source=f"{TT_BENCH} Table 5; micro-batches and stages per rank: {TT_PP}",
            note="micro-batches and stages per rank are torchtitan's defaults (the table "
            "gives none); seq 8192 from llama3_405b.toml; measured 100 (1F1B) and 128 "
            "(interleaved) tokens/s per GPU, peak 82.5 and 72.7 GiB",
        )
        for v in (1, 2)
    ),
    # Megatron-Core, NEMO-CSV pre_train llama3 8b: bf16 TP1 PP1 CP2; fp8 TP1 PP1 CP1 with
    # use_mcore_fsdp=1; both MBS 1, GBS 128, recompute_layers 0.
    PublishedConfig(
        system="Megatron-Core (NeMo)",
        model="llama3-8b",
        gpus=8,
        seq=8192,
        global_batch=128,
        microbatch_size=1,
        fsdp="none",
        tp=1,
        pp=1,
        cp=2,
        ep=1,
        virtual_stages=1,
        recompute="none",
        sequence_parallel=False,
        precision="bf16",
        source=f"{NEMO_CSV} (and {MB_RECIPE.format('llama3.py')}, sequence_parallel=False)",
    ),
    PublishedConfig(
        system="Megatron-Core (NeMo)",
        model="llama3-8b",
        gpus=8,
        seq=8192,
        global_batch=128,
        microbatch_size=1,
        fsdp="full",
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        virtual_stages=1,
        recompute="none",
        sequence_parallel=None,
        precision="fp8 (priced in bf16)",
        source=f"{NEMO_CSV} (use_mcore_fsdp=1)",
    ),
    # Megatron-Core, NEMO-CSV pre_train llama3 70b: bf16 TP4 PP4 CP2 VP5; fp8 TP4 PP8 CP1 VP5;
    # MBS 1, GBS 128, no recompute; sequence parallel from MB-RECIPE (True for both layouts).
    PublishedConfig(
        system="Megatron-Core (NeMo)",
        model="llama3-70b",
        gpus=64,
        seq=8192,
        global_batch=128,
        microbatch_size=1,
        fsdp="none",
        tp=4,
        pp=4,
        cp=2,
        ep=1,
        virtual_stages=5,
        recompute="none",
        sequence_parallel=True,
        precision="bf16",
        source=f"{NEMO_CSV}; sequence_parallel from {MB_RECIPE.format('llama3.py')}",
    ),
    PublishedConfig(
        system="Megatron-Core (NeMo)",
        model="llama3-70b",
        gpus=64,
        seq=8192,
        global_batch=128,
        microbatch_size=1,
        fsdp="none",
        tp=4,
        pp=8,
        cp=1,
        ep=1,
        virtual_stages=5,
        recompute="none",
        sequence_parallel=True,
        precision="fp8 (priced in bf16)",
        source=f"{NEMO_CSV}; sequence_parallel from {MB_RECIPE.format('llama3.py')}",
        note="Megatron-Bridge's recipe of the same layout uses GBS 256 and an uneven "
        "layer layout; priced with meshplan's balanced split",
    ),
    # Megatron-Core, MB-RECIPE llama31_405b_pretrain_512gpu_h100_bf16_config: the 1024-GPU recipe
    # (TP8 PP8 CP2 VP8, sequence parallel, MBS 1) with global batch 768.
    PublishedConfig(
        system="Megatron-Core (Megatron-Bridge)",
        model="llama3-405b",
        gpus=512,
        seq=8192,
        global_batch=768,
        microbatch_size=1,
        fsdp="none",
        tp=8,
        pp=8,
        cp=2,
        ep=1,
        virtual_stages=8,
        recompute="none",
        sequence_parallel=True,
        precision="bf16",
        source=MB_RECIPE.format("llama31.py"),
        note="NEMO-CSV lists the same layout on 1024 GPUs with GBS 512",
    ),
    # Megatron-Core, NEMO-CSV pre_train mixtral 8x7b bf16: 64 GPUs, seq 4096, TP1 PP4 CP1 EP8 VP8,
    # MBS 1, GBS 256, no recompute.
    PublishedConfig(
        system="Megatron-Core (NeMo)",
        model="mixtral-8x7b",
        gpus=64,
        seq=4096,
        global_batch=256,
        microbatch_size=1,
        fsdp="none",
        tp=1,
        pp=4,
        cp=1,
        ep=8,
        virtual_stages=8,
        recompute="none",
        sequence_parallel=None,
        precision="bf16",
        source=NEMO_CSV,
    ),
)


def unpriced_reason(c: PublishedConfig, gpus: int) -> str | None:
    """Why `c` cannot be priced as published on a case of `gpus` GPUs, or None when it can."""
    if c.gpus != gpus:
        return f"published for {c.gpus} GPUs, the case has {gpus}"
    if c.cp > 1 and c.dp > 1 and c.microbatch_size > 1:
        return (
            f"context parallelism with data parallelism at micro-batch size "
            f"{c.microbatch_size}: manual_plan runs them with one row per replica"
        )
    if c.virtual_stages is None and c.pp > 1:
        return "interleaved, with the virtual stages per rank not published"
    if 1 < c.ep < c.dp and c.tp > 1:
        return (
            f"expert parallelism over {c.ep} of the {c.dp} data-parallel ranks with TP "
            f"{c.tp}: a (dp / ep, ep, tp) mesh, which manual_plan does not build"
        )
    if c.recompute not in ("none", "selective", "full"):
        return f"recompute {c.recompute!r} is not one of none, selective, full"
    return None


def price_published(
    c: PublishedConfig, cluster: Cluster, model: str, gpus: int
) -> dict[str, Any]:
    """The record of `c` on a case's cluster: the configuration with its source, and when it can
    be priced (`unpriced_reason`) its predicted iteration time, TFLOP/s, peak memory and whether
    it fits; `model` is the case's model name (the published sequence length)."""
    from benchmarks.manual_grid import ManualConfig, price

    out: dict[str, Any] = asdict(c) | {"label": c.label(), "priced": False}
    reason = unpriced_reason(c, gpus)
    if reason:
        return out | {"reason": reason}
    dp = c.dp
    config = ManualConfig(
        dp,
        c.tp,
        c.pp,
        c.global_batch // (dp * c.microbatch_size),
        c.recompute,
        c.ep,  # 1: none, dp: over all replicas, else over groups of ep (tp 1)
        "zero2" if c.distributed_optimizer else c.fsdp,
        c.sequence_parallel if c.tp > 1 else None,
        c.virtual_stages or 1,
        c.cp,
    )
    try:
        p = price(model, cluster, config, c.global_batch, "bfloat16", "adam_mixed")
    except MeshplanError as exc:
        return out | {"reason": f"manual_plan refused it: {exc}"}
    return out | {
        "priced": True,
        "iteration_time_s": p.estimate.iteration_time_s,
        "tflops_per_device": p.estimate.tflops_per_device,
        "peak_memory_bytes": p.estimate.peak_memory_bytes,
        "fits": bool(p.manual["fits"]),
    }
