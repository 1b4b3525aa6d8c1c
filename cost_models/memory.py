"""Bytes per device: parameters, gradients, optimizer state, saved activations, micro-batches in flight.

Model state per parameter (ZeRO, Rajbhandari et al. 2020, section 3.1)::

    optimizer       weights  grads  optimizer state                          total
    adam_mixed        2        2    12 (fp32 master weights, m, v: 4+4+4)     16
    adam_fp32         4        4     8 (m, v)                                 16
    sgd               4        4     0                                         8
    sgd_momentum      4        4     4 (momentum)                             12

Sharding divides each part by its shard count (``param_shards``, ``grad_shards``,
``optimizer_shards``): tensor/intra-op sharding shards all three; ZeRO stage 1 shards the optimizer
state over data parallel ranks, stage 2 also the gradients, stage 3 also the weights
(``zero_shard_factors``).

Activations: a stage keeps, per micro-batch in flight, what autograd saved for the backward pass
(``activation_footprint``; with recomputation only each layer's input, plus one layer's full set
live while it is recomputed), times the micro-batches the schedule keeps in flight
(``microbatches_in_flight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.errors import MeshplanError


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state."""

    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


OPTIMIZERS: dict[str, StateBytes] = {
    "adam_mixed": StateBytes(2, 2, 12),
    "adam_fp32": StateBytes(4, 4, 8),
    "sgd": StateBytes(4, 4, 0),
    "sgd_momentum": StateBytes(4, 4, 4),
}


def state_bytes_per_param(optimizer: str = "adam_mixed") -> StateBytes:
    """Bytes per parameter for ``optimizer`` (table in the module docstring)."""
    try:
        return OPTIMIZERS[optimizer]
    except KeyError:
        raise MeshplanError(
            f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}"
        ) from None


def zero_shard_factors(stage: int, data_parallel: int) -> tuple[int, int, int]:
    """(param, grad, optimizer) shard counts of ZeRO ``stage`` 0-3 over ``data_parallel`` ranks."""
    if stage not in (0, 1, 2, 3) or data_parallel < 1:
        raise MeshplanError(
            f"ZeRO stage must be 0-3 and data parallel >= 1, got {stage}, {data_parallel}"
        )
    dp = data_parallel
    return (dp if stage >= 3 else 1, dp if stage >= 2 else 1, dp if stage >= 1 else 1)


def model_state_bytes(
    num_params: float,
    optimizer: str = "adam_mixed",
    *,
    param_shards: float = 1,
    grad_shards: float = 1,
    optimizer_shards: float = 1,
) -> float:
    """Bytes per device of weights + gradients + optimizer state of ``num_params`` parameters.

    ``num_params * (param / param_shards + grad / grad_shards + optimizer / optimizer_shards)``.
    """
    if min(param_shards, grad_shards, optimizer_shards) <= 0:
        raise MeshplanError("shard counts must be positive")
    s = state_bytes_per_param(optimizer)
    return num_params * (
        s.param / param_shards + s.grad / grad_shards + s.optimizer / optimizer_shards
    )


@dataclass(frozen=True)
class ActivationFootprint:
    """Activation bytes of one micro-batch on a stage.

    ``kept``: held from the micro-batch's forward until its backward (multiplied by the micro-batches
    in flight). ``transient``: live only while one layer is recomputed and back-propagated (counted
    once per stage: one micro-batch is in backward at a time).
    """

    kept: float
    transient: float = 0.0

    @property
    def per_microbatch(self) -> float:
        return self.kept + self.transient


def activation_footprint(
    saved_bytes_per_layer: Sequence[float],
    input_bytes_per_layer: Sequence[float] | None = None,
    *,
    recompute: bool,
) -> ActivationFootprint:
    """Saved-activation bytes of one micro-batch through consecutive layers.

    Without recomputation: ``kept = sum(saved)``. With recomputation (each layer re-run in backward):
    ``kept = sum(inputs)`` (only each layer's input survives the forward pass) and
    ``transient = max(saved)`` (one layer's saved tensors exist while it is recomputed).
    """
    saved = [float(x) for x in saved_bytes_per_layer]
    if not recompute:
        return ActivationFootprint(sum(saved), 0.0)
    if input_bytes_per_layer is None or len(input_bytes_per_layer) != len(saved):
        raise MeshplanError(
            "recomputation needs the input bytes of every layer (one per saved-bytes entry)"
        )
    return ActivationFootprint(
        float(sum(input_bytes_per_layer)), max(saved, default=0.0)
    )


SCHEDULES = ("gpipe", "1f1b", "interleaved")
_SCHEDULE_ALIASES = {
    "gpipe": "gpipe",
    "schedulegpipe": "gpipe",
    "1f1b": "1f1b",
    "schedule1f1b": "1f1b",
    "pipedream": "1f1b",
    "interleaved": "interleaved",
    "interleaved1f1b": "interleaved",
    "scheduleinterleaved1f1b": "interleaved",
}


def canonical_schedule(schedule: str) -> str:
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` for a schedule name or alias (case, ``-``, ``_``
    ignored; torch's class names such as ``ScheduleInterleaved1F1B`` are accepted)."""
    key = _SCHEDULE_ALIASES.get(schedule.replace("-", "").replace("_", "").lower())
    if key is None:
        raise MeshplanError(
            f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}"
        )
    return key


def microbatches_in_flight(
    schedule: str,
    num_microbatches: int,
    num_stages: int,
    stage_index: int,
    *,
    virtual_stages: int = 1,
) -> float:
    """Micro-batches whose activations stage ``stage_index`` (0-based) holds at its peak.

    GPipe runs every forward before any backward: all ``B`` micro-batches. 1F1B starts backward as
    soon as the last stage has a micro-batch, so stage i holds at most ``min(B, S - i)``.

    Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM's schedule): ``num_stages`` = p devices,
    ``stage_index`` = device d, each running v = ``virtual_stages`` model chunks. Device d first runs
    ``w = 2 (p - d - 1) + (v - 1) p`` chunk forwards (all ``B v`` when ``B == p``), then alternates one
    forward and one backward, so it holds ``w + 1`` (micro-batch, chunk) activation sets at its peak
    (``B v`` when ``B == p``). Returned in units of a whole micro-batch through all v chunks of the
    device, ``(w + 1) / v``, assuming equal chunks; device 0 holds ``p + (p - 1) / v`` (Korthikanti
    et al. 2022, section 4.2.3). Megatron requires ``B`` to be a multiple of p; with ``v == 1`` the
    schedule is 1F1B.
    """
    key = canonical_schedule(schedule)
    if num_microbatches < 1 or num_stages < 1 or not 0 <= stage_index < num_stages:
        raise MeshplanError(
            f"need micro-batches >= 1, stages >= 1 and 0 <= stage < stages, got {num_microbatches}, "
            f"{num_stages}, {stage_index}"
        )
    if virtual_stages < 1 or (virtual_stages > 1 and key != "interleaved"):
        raise MeshplanError(
            f"virtual_stages must be 1, or >= 1 with the interleaved schedule; got {virtual_stages} "
            f"with {key}"
        )
    if key == "gpipe":
        return num_microbatches
    if key == "1f1b" or virtual_stages == 1:
        return min(num_microbatches, num_stages - stage_index)
    p, v, b = num_stages, virtual_stages, num_microbatches
    if b % p:
        raise MeshplanError(
            f"the interleaved schedule needs micro-batches to be a multiple of the {p} pipeline "
            f"devices (Megatron-LM); got {b}"
        )
    if b == p:
        return float(b)
    return (2 * (p - stage_index - 1) + (v - 1) * p + 1) / v


def stage_activation_bytes(
    footprint: ActivationFootprint,
    schedule: str,
    num_microbatches: int,
    num_stages: int,
    stage_index: int,
) -> float:
    """Peak activation bytes of a stage: ``in_flight * kept + transient``."""
    n = microbatches_in_flight(schedule, num_microbatches, num_stages, stage_index)
    return n * footprint.kept + footprint.transient


def gpt_layer_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    dtype_bytes: int,
    recompute: bool,
    *,
    flash_attention: bool = True,
) -> int:
    """Bytes one GPT block (``planner.models.gpt.Block``) saves for backward, per device, unsharded.

    The block: ``x1 = x + proj(sdpa(qkv(ln_1(x))))``, ``out = x1 + mlp.proj(gelu(mlp.fc(ln_2(x1))))``;
    no dropout. With s = seq, b = batch, h = hidden, a = heads, p = dtype_bytes, the saved tensors:

    ================================  =====================  ==================================
    tensor                            saved by               bytes
    ================================  =====================  ==================================
    x (block input)                   ln_1                   p * s*b*h
    ln_1 mean, rstd (fp32)            ln_1                   8 * s*b
    ln_1(x)                           qkv (Linear input)     p * s*b*h
    q, k, v (one qkv output)          attention              p * 3*s*b*h
    attention output                  attention, proj input  p * s*b*h  (one tensor, saved once)
    logsumexp (fp32, flash only)      attention              4 * a*s*b
    softmax probs (explicit only)     softmax, probs @ v     p * a*s*s*b
    x1 (residual)                     ln_2                   p * s*b*h
    ln_2 mean, rstd (fp32)            ln_2                   8 * s*b
    ln_2(x1)                          mlp.fc                 p * s*b*h
    fc output                         gelu                   p * 4*s*b*h
    gelu output                       mlp.proj               p * 4*s*b*h
    ================================  =====================  ==================================

    Total: ``p*16*s*b*h + 16*s*b + 4*a*s*b`` with fused (flash) attention, as
    ``F.scaled_dot_product_attention`` runs; ``p*(16*s*b*h + a*s^2*b) + 16*s*b`` with explicit
    softmax attention. For comparison, Korthikanti et al. 2022 count ``s*b*h*(34 + 5*a*s/h)`` for fp16
    Megatron blocks with explicit attention and dropout: their extra ``2*s*b*h + 3*a*s^2*b`` bytes are
    the dropout masks and dropout outputs we do not have (and they ignore the small fp32 terms).
    With full recomputation only the block input is kept: ``p * s*b*h`` (``2*s*b*h`` in fp16).
    """
    s, b, h, a, p = seq, batch, hidden, heads, dtype_bytes
    if recompute:
        return p * s * b * h
    core = p * 16 * s * b * h + 16 * s * b
    if flash_attention:
        return core + 4 * a * s * b
    return core + p * a * s * s * b
