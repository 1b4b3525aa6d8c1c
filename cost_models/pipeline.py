"""Latency of one training iteration through a pipeline of stages, per schedule.

Inputs: ``t_i`` = forward + backward time of ONE micro-batch on stage i (i = 0..S-1), ``s_i`` = the
round trip over the link from stage i to i+1 of one micro-batch (activations forward, their
gradient back: ``s_i / 2`` each way), ``B`` micro-batches. Transfers are asynchronous: they delay
the receiving task but occupy no device, and transfers of different micro-batches do not queue
behind each other (a latency model; price a link slower than the stages it joins into the stages).
The schedules follow Megatron-LM / torch.distributed.pipelining: a fixed task order per device, a
task starts when the device is free and its inputs have arrived.

GPipe (all forwards, then all backwards) -- Alpa's formula plus every send once each way::

    T_gpipe = sum_i t_i + sum_i s_i + (B - 1) * max_i t_i

Exact, not only a bound, whenever every stage splits its time between forward and backward in the
same ratio: the makespan is the longest path through the forward grid (F(i, m) after F(i-1, m) and
F(i, m-1)) then the backward grid; each grid path visits B + S - 1 tasks, crosses every link once,
and at most B tasks of any one stage, so it is at most ``sum_i f_i + (B - 1) max_i f_i + sum s / 2``
(likewise for backward; ``max f + max b = max t`` as the ratio is common), and the path that runs
all B micro-batches on the slowest stage attains it.

1F1B (Megatron's non-interleaved schedule: stage i runs ``S - i - 1`` warm-up forwards, then
alternates forward and backward)::

    T_1f1b = sum_i t_i + sum_i s_i + (B - 1) * P
    P      = max( max_i t_i,  max over windows a < b with S - a < B of
                  (t_a + ... + t_b + s_a + ... + s_{b-1}) / (b - a + 1) )

Without sends ``P = max_i t_i`` (a window's mean never exceeds its maximum) and this is Alpa's
formula, as for GPipe: 1F1B differs in memory (``cost_models.memory.microbatches_in_flight``), not in this bound. With sends the
strict 1F1B order exposes them in the steady state: stage a admits a new forward only after a
backward once it holds ``S - a`` micro-batches (if ``B > S - a``), and stages a..b then process
``b - a + 1`` micro-batches per round trip of a..b, so the period is at least that window's mean.
Exact for equal stage times without sends; with equal ``t`` and ``s`` the simulated makespan is
``sum t + sum s + (B - 1) t + floor((B - 1)(S - 1) / S) s``, less than ``T_1f1b`` by under one ``s``.
With unequal stage times ``T_1f1b`` is an upper bound (observed in randomized simulation, not
proven; 10,000 random cases): 1F1B beats GPipe when the slowest stage comes early, since faster
later stages absorb its fill and drain. Simulated makespans fell below the bound by at most 6%,
18% and 24% for stage times uniform in [0.9, 1.1], [0.7, 1.3] and [0.2, 2.0].

Interleaved 1F1B (Narayanan et al. 2021): the stages are the ``S = p v`` model chunks in order,
chunk c on device ``c % p`` (v = ``virtual_stages``); ``T_d = sum_{c % p == d} t_c`` is device d's
time per micro-batch::

    T_interleaved = B * max_d T_d + (sum_c t_c - max_d T_d) / v + sum_c s_c

With equal chunk times ``t_c = T / v`` this is ``(B + (p - 1) / v) * T + sum s``: Megatron's bubble
``(p - 1) / v`` of an iteration without interleaving; with v = 1 it is Alpa's formula. Exact for
equal chunk times without sends, and with equal sends whose one-way time ``s / 2`` is at most a
chunk's forward time (Megatron's doubled warm-up hides them beyond the fill and drain); larger sends
stall the steady state and the formula is optimistic. With unequal chunk times it is an estimate:
against simulation (chunk times uniform in [1 - x, 1 + x], p <= 8, v <= 4, B <= 6 p) the
formula was within -7%..+9% of the makespan for x = 0.1 and -17%..+16% for x = 0.3 (low when
B == p, where every forward runs before any backward, and when unequal chunks stall devices across
rounds; high, like 1F1B, when the slowest device comes early). ``v == 1`` is plain 1F1B.

Zero bubble (Qi et al. 2024, ZB-H1; torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``
with one stage per device, whose per-rank action order the runtime runs): backward is split into the
input gradient I (``b_i`` s on stage i: what the previous stage waits for) and the weight gradient W
(``w_i``: the weight-gradient matrix products, needed by nobody downstream), forward takes ``f_i``,
``t_i = f_i + b_i + w_i``. Rank r runs ``p - r - 1`` warm-up forwards, then F, I and (once it has
deferred r of them) the oldest pending W, then the remaining I and W::

    T_zb = B * max_i t_i + sum_i z_i - max_i z_i + sum_i s_i + (B - 1) * (P - max_i t_i)
    z_i  = max(f_i + b_i - w_i, f_i, b_i)

with ``P`` 1F1B's steady-state period above (``P = max t`` without sends). Derivation for equal
stages (``f, b, w``, B >= p, no sends), where it is exact: the last rank starts its first forward
after the ``p - 1`` forwards ahead of it, and thereafter is idle only while the micro-batch it
needs is one hop further back; rank r's r deferred weight gradients fill exactly the gaps 1F1B
leaves in its warm-up and cool-down, so each of the ``p - 1`` hops of fill plus drain costs
``f + b - w`` (a forward and an input gradient less the weight gradient that fills the wait)
instead of 1F1B's ``f + b + w``, but never less than the longer of ``f`` and ``b``: a hop is
a dependency chain through one forward (fill) and one input gradient (drain) that no deferred W
can shorten. The device then runs ``B t`` of work plus ``(p - 1) z``: Alpa's 1F1B formula with
``t`` replaced by ``z`` in its fill/drain term. Checked against the simulated action order of
torch's schedule (tests/test_zero_bubble.py) for p <= 5, every B >= p torch accepts and f,
b, w in a grid: equal to the simulated makespan, also when the first stage runs its whole backward
in W as torch does (nothing waits for its input gradient, and rank 0 defers no W, so its I and W
run back to back). Unequal stages generalise it as the interleaved
formula does (the bottleneck stage runs B micro-batches, every other stage adds its hop ``z_i``);
sends add their round trip once and, as 1F1B's strict order exposes them in the steady state,
the same ``(B - 1) (P - max t)``. Against simulation (stage times uniform in [1 - x, 1 + x],
``w`` 0.3..1.2 of ``b``, p <= 8, B up to 6 p) it was within -6%..+14% for x <= 0.3, and never
below the simulated makespan with equal stage times and equal sends (up to +23% for sends as
long as a forward). Since ``z_i < t_i`` whenever ``w_i > 0``, ``T_zb < T_1f1b`` for p >= 2 (the
terms differ only in ``max t + sum z - max z`` versus ``sum t``). torch's schedule needs
B >= p here (``pipeline_time`` refuses fewer) and B a multiple of its rounds ``B // p``. The
planner splits a stage's time as: ``f`` its forward compute, ``w`` its weight-gradient products
(`planner.inter.wgrad`), ``b`` the rest (input-gradient compute, recomputation, collectives and
the fixed per-micro-batch costs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from cost_models.cluster import Cluster
from cost_models.communication import boundary_send_times
from cost_models.compute import step_overhead
from cost_models.errors import MeshplanError
from cost_models.memory import SCHEDULES, canonical_schedule

__all__ = [
    "SCHEDULES",
    "iteration_time",
    "pipeline_time",
    "stage_send_times",
    "steady_state_period",
]


def _times(values: Sequence[float], what: str) -> list[float]:
    out = [float(x) for x in values]
    for i, x in enumerate(out):
        if not math.isfinite(x) or x < 0:
            raise MeshplanError(f"{what} must be finite and >= 0, got {x} at index {i}")
    return out


def steady_state_period(
    stage_times: Sequence[float],
    num_microbatches: int,
    send_times: Sequence[float] = (),
) -> float:
    """1F1B's time per micro-batch in steady state, ``P`` of the module docstring."""
    t = _times(stage_times, "stage times")
    s = _times(send_times, "send times") or [0.0] * (len(t) - 1)
    n = len(t)
    if not t or len(s) != n - 1:
        raise MeshplanError(
            f"need at least one stage time and one send time per link: {n - 1} for {n} "
            f"stages, got {len(s)}"
        )
    period = max(t)
    if not any(s):
        return period
    for a in range(n):
        if n - a >= num_microbatches:  # stage a never reaches its in-flight limit
            continue
        total = t[a]
        for b in range(a + 1, n):
            total += t[b] + s[b - 1]
            period = max(period, total / (b - a + 1))
    return period


def pipeline_time(
    stage_times: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    *,
    virtual_stages: int = 1,
    send_times: Sequence[float] = (),
    forward_times: Sequence[float] = (),
    weight_times: Sequence[float] = (),
) -> float:
    """Seconds of one iteration of ``num_microbatches`` micro-batches (formulas in the module
    docstring). ``stage_times[i]``: forward + backward of one micro-batch on stage i (for
    ``"interleaved"`` the ``p * virtual_stages`` chunks in order, chunk c on device ``c % p``);
    ``send_times[i]``: round trip of one micro-batch over the link from stage i to i + 1, or empty
    for free links. ``forward_times`` and ``weight_times`` (zero bubble only; empty: 0): the
    forward and the weight-gradient part of each stage time, the rest being the input gradient."""
    key = canonical_schedule(schedule)
    t = _times(stage_times, "stage times")
    s = _times(send_times, "send times")
    if key == "zero_bubble" or forward_times or weight_times:
        return _zero_bubble_time(
            t, num_microbatches, key, virtual_stages, s, forward_times, weight_times
        )
    b, v = num_microbatches, virtual_stages
    if not t:
        raise MeshplanError("need at least one stage time")
    if s and len(s) != len(t) - 1:
        raise MeshplanError(
            f"need one send time per link: {len(t) - 1} for {len(t)} stages, got {len(s)}"
        )
    if b < 1:
        raise MeshplanError(f"number of micro-batches must be >= 1, got {b}")
    if v < 1 or (v > 1 and key != "interleaved"):
        raise MeshplanError(
            f"virtual_stages must be 1, or >= 1 with the interleaved schedule; got {v} with {key}"
        )
    if key == "gpipe":
        return sum(t) + sum(s) + (b - 1) * max(t)
    if key == "1f1b" or v == 1:
        return sum(t) + sum(s) + (b - 1) * steady_state_period(t, b, s)
    if len(t) % v:
        raise MeshplanError(
            f"the interleaved schedule needs p * virtual_stages chunk times; got {len(t)} for "
            f"virtual_stages={v}"
        )
    p = len(t) // v
    if b % p:
        raise MeshplanError(
            f"the interleaved schedule needs micro-batches to be a multiple of the {p} pipeline "
            f"devices (Megatron-LM); got {b}"
        )
    device = max(sum(t[d::p]) for d in range(p))
    return b * device + (sum(t) - device) / v + sum(s)


def _zero_bubble_time(
    t: list[float],
    b: int,
    key: str,
    v: int,
    s: list[float],
    forward_times: Sequence[float],
    weight_times: Sequence[float],
) -> float:
    """``T_zb`` of the module docstring, after checking its inputs."""
    if key != "zero_bubble":
        raise MeshplanError(
            f"forward and weight-gradient times split a stage only for the zero_bubble "
            f"schedule, not {key}"
        )
    if v != 1:
        raise MeshplanError(
            f"the zero_bubble schedule runs one stage per device: virtual_stages must be 1, got {v}"
        )
    p = len(t)
    f = _times(forward_times, "forward times") or [0.0] * p
    w = _times(weight_times, "weight-gradient times") or [0.0] * p
    if len(f) != p or len(w) != p:
        raise MeshplanError(
            f"need one forward and one weight-gradient time per stage ({p}), got {len(f)} and "
            f"{len(w)}"
        )
    if not t or (s and len(s) != p - 1):
        raise MeshplanError(
            f"need at least one stage time and one send time per link: {p - 1} for {p} "
            f"stages, got {len(s)}"
        )
    if b < p:
        raise MeshplanError(
            f"the zero_bubble schedule needs at least as many micro-batches ({b}) as stages ({p})"
        )
    if b % (b // p):
        raise MeshplanError(
            f"the zero_bubble schedule (torch's) needs the {b} micro-batches to be a multiple "
            f"of its rounds ({b // p})"
        )
    z = []
    for i, (ti, fi, wi) in enumerate(zip(t, f, w)):
        bi = ti - fi - wi
        if bi < -1e-12 * max(ti, 1.0):
            raise MeshplanError(
                f"stage {i}: forward {fi} + weight gradient {wi} exceed its time {ti}"
            )
        bi = max(bi, 0.0)
        z.append(max(fi + bi - wi, fi, bi))
    top = max(t)
    period = steady_state_period(t, b, s) if s else top
    return b * top + sum(z) - max(z) + sum(s) + (b - 1) * (period - top)


def stage_send_times(
    cluster: Cluster,
    boundary_bytes: Sequence[float],
    devices: Sequence[Sequence[int]],
    grad_bytes: Sequence[float] | None = None,
) -> list[float]:
    """`boundary_send_times` between consecutive stages placed on `devices` (global ranks,
    host-major): stage i's devices send ``boundary_bytes[i]`` in parallel and receive
    ``grad_bytes[i]`` (default the same) back, over the inter-host link when the two stages'
    devices lie in different hosts, where a host's network is shared by the stage's devices in
    that host."""
    M = cluster.devices_per_host
    hosts = [{d // M for d in group} for group in devices]
    return boundary_send_times(
        cluster,
        boundary_bytes,
        [len(group) for group in devices[:-1]],
        [hosts[i] != hosts[i + 1] for i in range(len(devices) - 1)],
        [max(Counter(d // M for d in group).values()) for group in devices[:-1]],
        grad_bytes,
    )


def iteration_time(
    cluster: Cluster,
    stage_times: Sequence[float],
    boundary_bytes: Sequence[float],
    devices: Sequence[Sequence[int]],
    num_microbatches: int,
    schedule: str = "1f1b",
    *,
    virtual_stages: int = 1,
    step_s: float | None = None,
    forward_times: Sequence[float] = (),
    weight_times: Sequence[float] = (),
    grad_bytes: Sequence[float] | None = None,
) -> float:
    """Predicted seconds of one training iteration of a plan: `pipeline_time` of its stages
    (``stage_times[i]``: forward + backward of one micro-batch on stage i, recomputation and its
    share of gradient synchronisation included), with the values crossing each stage boundary
    (``boundary_bytes[i]``: full bytes of one micro-batch from stage i to i + 1; ``grad_bytes[i]``
    those of their gradients, default the same) sent between the stages' ``devices``
    (`stage_send_times`), plus a fixed time per step: `step_s`, by default the
    runtime's (`step_overhead`). ``forward_times`` / ``weight_times``: each stage time's forward and
    weight-gradient parts, for the zero-bubble schedule. Every plan, automatic or manual, is priced
    by this function."""
    return pipeline_time(
        stage_times,
        num_microbatches,
        schedule,
        virtual_stages=virtual_stages,
        send_times=stage_send_times(cluster, boundary_bytes, devices, grad_bytes),
        forward_times=forward_times,
        weight_times=weight_times,
    ) + (step_overhead(cluster) if step_s is None else step_s)
