"""Bytes per device: parameters, gradients, optimizer state, saved activations, micro-batches in flight.

Model state per parameter (ZeRO, Rajbhandari et al. 2020, section 3.1)::

    optimizer       weights  grads  optimizer state                          total
    adam_mixed        2        2    12 (fp32 master weights, m, v: 4+4+4)     16
    adam_fp32         4        4     8 (m, v)                                 16
    adam_16bit        2        2     4 (m, v in the weights' 16-bit dtype)      8
    sgd               4        4     0                                         8
    sgd_momentum      4        4     4 (momentum)                             12

A parameter's placement divides all three by its shard count; ZeRO stage 2 divides the gradients
and optimizer state further over the devices that replicate the parameter, ZeRO stage 3 (FSDP) the
weights too (``param_state_bytes``). An FSDP parameter is gathered whole (its planned placement)
only while it is used: ``gathered_bytes`` per element of that live copy (weights, and the gradient
before it is reduce-scattered), which the stage's memory adds for its largest layer
(`planner.inter.stage_table`).

Activations: a stage keeps, per micro-batch in flight, what autograd saved for the backward pass
(with recomputation only each layer's input, plus one layer's full set live while it is
recomputed), times the micro-batches the schedule keeps in flight (``microbatches_in_flight``);
``stage_peak_bytes`` adds them up. Every plan's memory, automatic or manual, is priced there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

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
    # torch.optim.Adam on bfloat16 / float16 parameters, as `benchmarks.bench_gpu` trains
    "adam_16bit": StateBytes(2, 2, 4),
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


def param_state_bytes(
    numel: float,
    optimizer: str = "adam_mixed",
    *,
    shards: float = 1,
    zero_shards: float = 1,
    zero_stage: int = 2,
) -> float:
    """Weights + gradients + optimizer state on one device of a parameter of `numel` elements.

    ``numel / shards * (param + (grad + optimizer) / zero_shards)``: the parameter's placement
    splits all three into `shards` pieces; ZeRO (stage 2: gradients and optimizer state) splits
    the gradient and optimizer state further over the `zero_shards` devices that replicate it.
    With ``zero_stage=3`` (FSDP) the weights too: ``numel / shards / zero_shards * total``.
    """
    if zero_stage not in (2, 3):
        raise MeshplanError(f"ZeRO stage must be 2 or 3, got {zero_stage}")
    if shards <= 0 or zero_shards <= 0:
        raise MeshplanError(
            f"shard counts must be positive, got shards={shards}, zero_shards={zero_shards}"
        )
    s = state_bytes_per_param(optimizer)
    if zero_stage == 3:
        return numel / shards / zero_shards * s.total
    return numel / shards * (s.param + (s.grad + s.optimizer) / zero_shards)


def gathered_bytes(optimizer: str = "adam_mixed") -> float:
    """Bytes per element of an FSDP parameter's gathered copy while it is live: its weights and
    its unsharded gradient (before the reduce-scatter)."""
    s = state_bytes_per_param(optimizer)
    return s.param + s.grad


def stage_peak_bytes(
    param_bytes: Any,
    kept_bytes: Any,
    transient_bytes: Any,
    in_flight: Any,
    accumulating: Any = 0.0,
    num_microbatches: int | None = None,
    weight_grads: Any = 0,
) -> Any:
    """Peak bytes per device of a pipeline stage: its parameter state, the activations it keeps
    per micro-batch times the micro-batches the schedule keeps in flight
    (`microbatches_in_flight`), what lives only while one layer is recomputed and
    back-propagated (once: one micro-batch is in backward at a time), and `weight_grads`: the
    output gradients a zero-bubble schedule keeps for its deferred weight gradients
    (`weight_grads_pending` times their bytes per micro-batch). Numpy arrays broadcast.

    ``accumulating``: bytes held only during the backward of a micro-batch after the first (a
    second set of fresh gradients next to the accumulated ones, `planner.inter.held_memory`).
    Then the stage holds the activations of ``min(in_flight, B - 1)`` micro-batches (1F1B and
    GPipe: the first backward has freed one set, and 1F1B's next forward has added at most one),
    so the peak is the larger of the two moments::

        param + transient + weight_grads
            + max(in_flight * kept, min(in_flight, B - 1) * kept + accumulating)
    """
    if num_microbatches is None or num_microbatches < 2:
        return param_bytes + in_flight * kept_bytes + transient_bytes + weight_grads
    later = np.minimum(in_flight, num_microbatches - 1)
    held = np.maximum(in_flight * kept_bytes, later * kept_bytes + accumulating)
    return param_bytes + held + transient_bytes + weight_grads


def device_peak_bytes(
    param_bytes: Any,
    kept_bytes: Any,
    transient_bytes: Any,
    in_flight: Any,
    accumulating: Any = 0.0,
    num_microbatches: int | None = None,
    weight_grads: Any = 0.0,
) -> float:
    """Peak bytes of one device running several pipeline chunks (interleaved 1F1B), the
    arguments as in `stage_peak_bytes`, one entry per chunk.

    The device holds every chunk's parameter state, deferred weight gradients and activations
    in flight at once, but runs one backward at a time: what lives only during a backward (a
    recomputed layer, gathered FSDP parameters, a second set of fresh gradients: ``transient``
    and ``accumulating``) counts once, for the chunk where it is largest::

        sum_c (param_c + weight_grads_c + in_flight_c kept_c)
            + max_c (transient_c + max(0, min(in_flight_c, B - 1) kept_c + accumulating_c
                                          - in_flight_c kept_c))

    With one chunk this is `stage_peak_bytes`."""
    param, kept, transient, in_flight, acc, wg = np.broadcast_arrays(
        *(
            np.asarray(x, dtype=float)
            for x in (
                param_bytes,
                kept_bytes,
                transient_bytes,
                in_flight,
                accumulating,
                weight_grads,
            )
        )
    )
    held = in_flight * kept
    backward = transient
    if num_microbatches is not None and num_microbatches >= 2:
        later = np.minimum(in_flight, num_microbatches - 1) * kept + acc
        backward = transient + np.maximum(0.0, later - held)
    return float(np.sum(param + wg + held) + np.max(backward))


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
_SCHEDULE_ALIASES = {
    "gpipe": "gpipe",
    "schedulegpipe": "gpipe",
    "1f1b": "1f1b",
    "schedule1f1b": "1f1b",
    "pipedream": "1f1b",
    "interleaved": "interleaved",
    "interleaved1f1b": "interleaved",
    "scheduleinterleaved1f1b": "interleaved",
    "zerobubble": "zero_bubble",
    "zb": "zero_bubble",
    "zb1p": "zero_bubble",
    "scheduleinterleavedzerobubble": "zero_bubble",
}


def canonical_schedule(schedule: str) -> str:
    """``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"`` for a schedule name or alias
    (case, ``-``, ``_`` ignored; torch's class names such as ``ScheduleInterleaved1F1B`` and
    ``ScheduleInterleavedZeroBubble`` are accepted; ``zb`` and ``zb1p`` are zero bubble)."""
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
    Zero bubble (torch's ``ScheduleInterleavedZeroBubble``, one stage per device): a micro-batch
    holds its activations from its forward until its weight gradient W, not only until its input
    gradient (the W pass needs the weight products' inputs; torch keeps the autograd graph, saved
    tensors included, from the input-gradient pass to W). Rank r runs ``p - r - 1`` warm-up
    forwards, then F, I and, once r weight gradients are deferred, W of the oldest: just before
    that W it has run ``p - r + k`` forwards and ``k - r`` weight gradients at steady step k, so
    every stage holds ``min(B, p)`` micro-batches at its peak (1F1B's first-stage count on every
    stage; Qi et al. 2024, ZB-H1).
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
    if key == "zero_bubble":
        return min(num_microbatches, num_stages)
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


def weight_grads_pending(
    schedule: str, num_microbatches: int, num_stages: int, stage_index: int
) -> int:
    """Micro-batches whose weight gradient stage ``stage_index`` has deferred at its peak (zero
    bubble; 0 for the other schedules, which run backward whole).

    torch's input-gradient pass (``stage_backward_input``) keeps, for the later weight pass, the
    gradient reaching every weight product's output (its ``param_groups`` "grads"): per deferred
    micro-batch, the bytes of those outputs. At rank r's memory peak (just before the W of steady
    step k, `microbatches_in_flight`) it has run ``k + 1`` input gradients and ``k - r`` weight
    gradients: ``r + 1`` deferred (at most B). The activations of those micro-batches are counted
    in `microbatches_in_flight` (held until their W).
    """
    if canonical_schedule(schedule) != "zero_bubble":
        return 0
    return min(num_microbatches, stage_index + 1)
