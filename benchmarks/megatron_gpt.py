"""Predicted throughput of Megatron-LM's own GPT program, in the FLOP convention of Alpa's benchmark.

Alpa's authors measured Megatron-LM (osdi22_artifact ``megatron/benchmark_gpt.py``) and report
``compute_gpt_tflops(..., checkpoint_activations=True)``: FLOPs per iteration counted as

    F = factor * G * s * L * h^2 * (1 + s / (6 h)) + 6 * G * s * h * V,   factor 96 (recompute) or 72

(G global batch, s sequence, L layers, h hidden, V vocabulary): per layer and token 24 h^2 + 4 s h
matrix FLOPs forward, twice that backward and once more when the forward is recomputed; the LM head
forward and backward, not recomputed (``alpa_gpt_flops``). Predicted and measured TFLOP/s are both
``F / iteration time / GPUs`` here.

Megatron-LM's program is not meshplan's GPT (flash attention, no dropout, cross-entropy on fp16
logits). ``megatron_iteration_time`` prices the plan of ``planner.plans.manual.manual_plan`` (Megatron's
placements, its pipeline split and per-block checkpointing) and replaces, stage by stage, the price
of what Megatron runs differently, each from ``cost_models.compute``:

* attention (per block): the fused ``scaled_dot_product_attention`` op by Megatron's unfused
  attention with materialized scores, softmax and attention dropout (``unfused_attention_time``),
  forward + backward, and its forward again for the recomputation;
* the loss: ``log_softmax`` + ``nll_loss`` on fp16 logits by the fp32 cross-entropy
  (``fp32_cross_entropy_time``);
* layer norms and residual adds inside the blocks: Megatron-LM (before its 2022 sequence
  parallelism, which Alpa's artifact predates and which is off by default) keeps the residual
  stream replicated on the tensor-parallel ranks, so each rank runs them on the whole tensor; where
  the plan's solver sharded them on the tensor-parallel axis (reduce-scatter + all-gather in place
  of the all-reduce: the same ring bytes), their price is replaced by the unsharded one;
* hidden dropout: each residual add inside a block is Megatron's bias-dropout-add, which also
  writes a keep-mask and runs a dropout backward (``fused_dropout_time``);
* nothing for the optimizer step: the plan's stage times already hold it (each parameter's
  ``cost_models.compute.param_step_time`` on the parameters of one device, ``params / (tp * pp)``
  in all, spread over the micro-batches as the planner prices every per-step cost).
"""

from __future__ import annotations

import math

import torch

from benchmarks.reference import measured_tflops
from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.compute import (
    fp32_cross_entropy_time,
    fused_dropout_time,
    unfused_attention_time,
)
from cost_models.pipeline import iteration_time
from planner.inter.boundaries import stage_boundary_bytes
from planner.intra.prices import (
    Option,
    StageSettings,
    compute_time,
    forward_time,
)
from planner.models.gpt import GPT_CONFIGS
from planner.plans.manual import manual_plan
from planner.tracing.inputs import resolve_model
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_file import ParallelPlan
from planner.vocab.strategy import Strategy, strategy_from_json


def alpa_gpt_flops(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    *,
    recompute: bool,
) -> float:
    """FLOPs of one training iteration as Alpa's ``compute_gpt_tflops`` counts them (module
    docstring): factor 96 with recomputation, 72 without."""
    factor = 96 if recompute else 72
    return (
        factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden))
        + 6 * batch * seq * hidden * vocab
    )


def _local_shape(
    shape: tuple[int, ...], placements: list[str], mesh_shape: tuple[int, ...]
) -> list[int]:
    out = list(shape)
    for p, size in zip(placements, mesh_shape):
        if p.startswith("S("):
            dim = int(p[2:-1])
            out[dim] = max(1, out[dim] // size)
    return out


def _replicated_in_megatron(node) -> bool:
    """A layer norm or residual add inside a transformer block (module path with a block index)."""
    in_block = any(part.isdigit() for part in node.module_path.split("."))
    return in_block and (
        "native_layer_norm" in node.target or node.target.endswith("add.Tensor")
    )


def _split_on(st: dict, axis: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether the node's output is sharded or partial on mesh ``axis`` (of size > 1)."""
    out = st["outputs"][0] if st["outputs"] else None
    return bool(out) and mesh_shape[axis] > 1 and out[axis] != "R"


def _replicated(strategy: Strategy) -> Strategy:
    """``strategy`` with every placement on the tensor-parallel axis (axis 1) made ``R``."""

    def fix(p):
        return None if p is None else tuple(p[:1]) + ("R",) + tuple(p[2:])

    return Strategy(
        tuple(fix(p) if p else p for p in strategy.output),
        tuple(fix(p) for p in strategy.inputs),
        "megatron-replicated",
    )


def stage_corrections(
    plan: ParallelPlan, graph: OpGraph, cluster: Cluster
) -> list[float]:
    """Per stage: seconds per micro-batch to add to the plan's stage time for Megatron's attention
    and cross-entropy (module docstring); the recomputed forward counts when the stage recomputes."""
    out = []
    for stage in plan.stages:
        mesh = LogicalMesh(cluster, tuple(stage.submesh), tuple(stage.logical_mesh))
        settings = StageSettings(mesh=mesh, num_microbatches=plan.num_microbatches)
        delta = 0.0
        for name, st in stage.node_strategies.items():
            node = graph.node(name)
            strategy = strategy_from_json(st)
            opt = Option(strategy)
            local = _local_shape(node.outputs[0].shape, st["outputs"][0], mesh.shape)
            if "scaled_dot_product" in node.target:
                b, a, s, d = local
                fwd, bwd = unfused_attention_time(
                    cluster, b * a, s, d, node.outputs[0].dtype, dropout=True
                )
                delta += fwd + bwd - compute_time(node, opt, settings)
                if stage.recompute != "none":  # selective re-runs the core too
                    delta += fwd - forward_time(node, opt, settings)
            elif _replicated_in_megatron(node):
                whole = Option(_replicated(strategy))
                if _split_on(st, 1, mesh.shape):
                    delta += compute_time(node, whole, settings) - compute_time(
                        node, opt, settings
                    )
                    if stage.recompute == "full":
                        delta += forward_time(node, whole, settings) - forward_time(
                            node, opt, settings
                        )
                if node.target.endswith("add.Tensor"):  # Megatron's bias-dropout-add
                    elements = math.prod(
                        _local_shape(
                            node.outputs[0].shape,
                            list(whole.strategy.output[0]),
                            mesh.shape,
                        )
                    )
                    f, b = fused_dropout_time(cluster, elements, node.outputs[0].dtype)
                    delta += f + b + (f if stage.recompute == "full" else 0.0)
            elif "_log_softmax" in node.target:
                logits = float(local[0]) * local[-1]
                f, b = fp32_cross_entropy_time(cluster, logits)
                delta += f + b - compute_time(node, opt, settings)
            elif "nll_loss" in node.target:
                delta -= compute_time(node, opt, settings)
        out.append(delta)
    return out


def megatron_iteration_time(
    plan: ParallelPlan, graph: OpGraph, cluster: Cluster
) -> float:
    """Seconds of one iteration of Megatron-LM's program on ``plan``'s configuration: the 1F1B
    pipeline over the corrected stage times (the optimizer step included)."""
    times = [
        s.time_s + d
        for s, d in zip(plan.stages, stage_corrections(plan, graph, cluster))
    ]
    return iteration_time(
        cluster,
        times,
        stage_boundary_bytes(
            graph,
            plan.layer_ranges([n.name for n in graph.ops]),
            [s.layers[1] for s in plan.stages],
        ),
        [s.devices for s in plan.stages],
        plan.num_microbatches,
        plan.schedule,
        virtual_stages=plan.virtual_stages,
    )


__all__ = [
    "alpa_gpt_flops",
    "megatron_iteration_time",
    "megatron_prediction",
    "stage_corrections",
]


def megatron_prediction(
    model: str, cluster_spec: str, listed: dict, global_batch: int
) -> dict:
    """Megatron's listed configuration ``listed`` (dp, tp, pp, microbatches) of GPT ``model`` on
    ``cluster_spec``: the plan priced with our ops (``plan_*``), Megatron's program
    (``iteration_time_s``) and its TFLOP/s per GPU in Alpa's convention next to the measured ones."""
    dp, tp, pp = int(listed["dp"]), int(listed["tp"]), int(listed["pp"])
    B = int(listed["microbatches"])
    m = manual_plan(
        model,
        cluster_spec,
        dp=dp,
        tp=tp,
        pp=pp,
        num_microbatches=B,
        global_batch=global_batch,
        recompute=True,
        allow_oom=True,
        split="blocks",
    )
    graph = resolve_model(model, None, torch.float16, None)[1].trace(global_batch // B)
    cluster = Cluster.from_spec(cluster_spec)
    seconds = megatron_iteration_time(m, graph, cluster)
    config = GPT_CONFIGS[model]
    flops = alpa_gpt_flops(
        global_batch,
        config.seq,
        config.layers,
        config.hidden,
        config.vocab,
        recompute=True,
    )
    gpus = cluster.num_devices
    predicted = flops / seconds / gpus / 1e12
    measured = measured_tflops("## GPT", "Megatron-LM").get(gpus)
    return {
        "config": {"dp": dp, "tp": tp, "pp": pp, "microbatches": B},
        "plan_iteration_time_s": m.estimate.iteration_time_s,
        "plan_tflops_per_device": m.estimate.tflops_per_device,
        "iteration_time_s": seconds,
        "predicted_tflops_per_device": predicted,
        "measured_tflops_per_device": measured,
        "relative_error": predicted / measured - 1.0 if measured else None,
        "fits": m.manual["fits"],
        "peak_memory_bytes": m.estimate.peak_memory_bytes,
    }
