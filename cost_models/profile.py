"""The measured-profile file: what `meshplan profile` measured on real devices, read back for costs.

The runtime's profiler (`runtime/profiler.py`) measures matrix-product throughput, memory bandwidth and
every collective on the machine it runs on and writes a `DeviceProfile` as JSON. The cost models
(`cost_models/compute.py`, `cost_models/communication.py`) read it back with `load_profile` and price
ops from it: collectives with `CollectiveFit.predict` (the fitted alpha-beta line, or its piecewise
refinement), matrix products by interpolating `MatmulSample`s.

Byte convention for `CollectiveFit.samples` and for `alpha_s + beta_s_per_byte * bytes`:

- all_reduce: the size of the tensor being reduced (the same on every rank);
- all_gather: the full, unsharded OUTPUT size (world_size x the per-rank shard);
- reduce_scatter: the full, unsharded INPUT size (world_size x the per-rank output shard);
- all_to_all: the full per-rank buffer (input size on one rank; each rank sends (w-1)/w of it);
- send_recv: the per-rank message sent from one rank to its peer.

The fit (`fit_alpha_beta`) is a non-negative fit of relative error (least squares, refined to least
absolute error for robustness to outliers), so that a 64 KB message is fitted as closely as a 64 MB
one; see its docstring. Where one line misses a sample by more
than SEGMENT_TOLERANCE, `fit_segments` adds a piecewise fit ("segments", optional in the file);
always price with `CollectiveFit.predict(nbytes)`, which uses the segments when present.

JSON layout (version 1)::

    {"version": 1, "device_name": "...", "backend": "gloo", "hosts": 1, "devices_per_host": 4,
     "memory_bytes": ..., "memory_bandwidth_bytes_per_s": ..., "peak_flops": {"float32": ...},
     "matmul": [{"m": .., "n": .., "k": .., "dtype": "float32", "seconds": ..}, ...],
     "collectives": [{"op": "all_reduce", "world_size": 2, "alpha_s": .., "beta_s_per_byte": ..,
                      "samples": [[bytes, seconds], ...],
                      "segments": [[max_bytes, alpha_s, beta_s_per_byte], ...]}, ...],
     "created": "2025-01-01T00:00:00+00:00", "host": "hostname",
     "op_overhead_s": 6e-05,                            # optional (0 when absent)
     "param_overhead_s": 2e-04,                         # optional (0 when absent)
     "param_step_overhead_s": 1.5e-04,                  # optional (0 when absent)
     "grad_byte_overhead_s": 1.6e-09,                   # optional (0 when absent)
     "microbatch_overhead_s": 0.001,                    # optional (0 when absent)
     "op_rates": [{"target": "aten.gelu.default", "unit": "byte",   # optional ([] when absent)
                   "forward_s": 1e-09, "backward_s": 2e-09}, ...],
     "step_overhead_s": 0.004}                          # optional (0 when absent)

This module is a leaf: it imports nothing from `planner` or `runtime`.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from cost_models.errors import MeshplanError

PROFILE_VERSION = 1

SEGMENT_TOLERANCE = 0.2

COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
)


@dataclass
class MatmulSample:
    """One measured matrix product: (m x k) @ (k x n) in `dtype` took `seconds` (median)."""

    m: int
    n: int
    k: int
    dtype: str
    seconds: float

    @property
    def flops(self) -> float:
        """Floating-point operations of the product (2*m*n*k)."""
        return 2.0 * self.m * self.n * self.k

    @property
    def flops_per_s(self) -> float:
        """Achieved throughput of this sample."""
        return self.flops / self.seconds if self.seconds > 0 else 0.0


#: What an `OpRate` counts: the op's forward FLOPs, or the bytes of its tensor inputs and outputs.
OP_RATE_UNITS = ("flop", "byte")


@dataclass
class OpRate:
    """Measured seconds per unit of one aten op (``target`` as the tracer names it, e.g.
    ``aten.gelu.default``) on one device: ``forward_s`` for its forward, ``backward_s`` for the
    gradients of its inputs that needed them (None when the measured calls needed none). The unit
    is the call's forward FLOPs (``"flop"``, ops that count FLOPs) or the bytes of its tensor
    inputs and outputs (``"byte"``). A call of u units is priced ``u * forward_s`` forward (see
    `cost_models.compute.measured_op_time`)."""

    target: str
    unit: str
    forward_s: float
    backward_s: float | None


@dataclass
class CollectiveFit:
    """Alpha-beta fit of one collective at one world size: time = alpha_s + beta_s_per_byte * bytes.

    `samples` are the measured (bytes, seconds) medians the fit was made from; the byte convention is
    in the module docstring (full unsharded tensor for all_reduce / all_gather / reduce_scatter /
    all_to_all, per-rank message for send_recv).

    `segments` (optional, possibly empty) is a piecewise-linear refinement written when one line
    misses a measured sample by more than `SEGMENT_TOLERANCE` (gloo over TCP changes regime with
    message size): a list of (max_bytes, alpha_s, beta_s_per_byte), ascending, continuous at each
    max_bytes (see `fit_segments`); a message uses the first segment whose max_bytes >= its size.
    `predict` applies it; the global alpha_s / beta_s_per_byte stay the single best line for
    closed-form uses (e.g. deriving a link's latency and bandwidth).
    """

    op: str
    world_size: int
    alpha_s: float
    beta_s_per_byte: float
    samples: list[tuple[int, float]] = field(default_factory=list)
    segments: list[tuple[int, float, float]] = field(default_factory=list)

    def predict(self, nbytes: float) -> float:
        """Predicted seconds for a message of `nbytes` (byte convention as in the module docstring).

        With segments: the segment whose range holds nbytes. Beyond the largest sample the last
        segment is extended, but a bigger message is never predicted faster than the largest sample;
        below the smallest sample the first one is extended, kept between the global alpha_s
        (latency) and the smallest sample's time.
        """
        x = float(nbytes)
        if not self.segments:
            return self.alpha_s + self.beta_s_per_byte * x
        for max_bytes, alpha, beta in self.segments:
            if x <= max_bytes:
                value = alpha + beta * x
                break
        else:
            max_bytes, alpha, beta = self.segments[-1]
            return max(alpha + beta * x, alpha + beta * max_bytes)
        if self.samples:
            x0, y0 = min(self.samples)
            if x < x0:
                return min(y0, max(value, self.alpha_s))
        return value


@dataclass
class DeviceProfile:
    """Everything measured about one machine (or cluster) by `meshplan profile`."""

    version: int
    device_name: str
    backend: str
    hosts: int
    devices_per_host: int
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_flops: dict[str, float]
    matmul: list[MatmulSample]
    collectives: list[CollectiveFit]
    created: str
    host: str
    #: Seconds the runtime spends per traced op per micro-batch beyond the op's own compute (the
    #: interpreter's and DTensor's dispatch in forward and backward), measured by the profiler
    #: (`runtime.overhead`); 0.0 when not measured. Optional in the file.
    op_overhead_s: float = 0.0
    #: Seconds the runtime spends per parameter tensor per micro-batch (wrapping and accumulating
    #: its DTensor gradient) and per step (bucketing, synchronising and stepping it), measured
    #: with ``op_overhead_s`` (`runtime.overhead`); 0.0 when not measured. Optional in the file.
    param_overhead_s: float = 0.0
    param_step_overhead_s: float = 0.0
    #: Seconds the runtime spends per byte of gradient a device holds, per step (copying it into
    #: its bucket and back, zeroing and accumulating it, the optimizer step), measured with
    #: ``op_overhead_s`` (`runtime.overhead`); 0.0 when not measured. Optional in the file.
    grad_byte_overhead_s: float = 0.0
    #: Seconds the runtime spends once per training step beyond its ops and their collectives
    #: (optimizer step, gradient buckets, loss broadcast, schedule set-up), measured with
    #: ``op_overhead_s`` (`runtime.overhead`); 0.0 when not measured. Optional in the file.
    step_overhead_s: float = 0.0
    #: Seconds the runtime spends per stage and micro-batch beyond its ops (the pipeline runner's
    #: work per micro-batch), measured with ``op_overhead_s``; 0.0 when not measured. Optional.
    microbatch_overhead_s: float = 0.0
    #: Measured per-unit times of the non-GEMM ops of some models (`runtime.op_rates`); the cost
    #: model prices an op listed here from it instead of the roofline. Optional in the file.
    op_rates: list[OpRate] = field(default_factory=list)

    def op_rate(self, target: str) -> OpRate | None:
        """The measured rate of op `target`, or None."""
        return self._op_rates_by_target.get(target)

    @functools.cached_property
    def _op_rates_by_target(self) -> dict[str, OpRate]:
        # the planner asks once per node and option: a dict, built on first use
        return {r.target: r for r in self.op_rates}

    def collective(self, op: str, world_size: int) -> CollectiveFit | None:
        """The fit for `op` at `world_size`, or None when that pair was not measured."""
        for fit in self.collectives:
            if fit.op == op and fit.world_size == world_size:
                return fit
        return None

    def matmul_samples(self, dtype: str) -> list[MatmulSample]:
        """The matrix-product samples measured in `dtype` (possibly empty)."""
        return [s for s in self.matmul if s.dtype == dtype]


def _weighted_fit(
    pts: list[tuple[float, float]], weights: list[float], free_alpha: bool = False
) -> tuple[float, float]:
    """(alpha, beta) minimising sum(w * ((alpha + beta*x - y) / y)^2), beta >= 0 and, unless
    `free_alpha`, alpha >= 0."""
    # work in units of the largest message, for the conditioning of the normal equations
    scale = max(x for x, _ in pts) or 1.0
    s00 = s01 = s11 = t0 = t1 = 0.0
    for (x, y), wt in zip(pts, weights):
        u, w = x / scale, wt / (y * y)
        s00 += w
        s01 += w * u
        s11 += w * u * u
        t0 += w * y
        t1 += w * u * y

    def loss(a: float, b: float) -> float:
        return sum(
            wt * ((a + b * x / scale - y) / y) ** 2 for (x, y), wt in zip(pts, weights)
        )

    det = s00 * s11 - s01 * s01
    if det > 1e-12 * s00 * s11:
        a = (t0 * s11 - t1 * s01) / det
        b = (s00 * t1 - s01 * t0) / det
        if (a >= 0 or free_alpha) and b >= 0:
            return a, b / scale
    candidates = [(t0 / s00, 0.0)]  # alpha only
    if s11 > 0 and not free_alpha:
        candidates.append((0.0, max(t1 / s11, 0.0)))  # beta only
    a, b = min(candidates, key=lambda ab: loss(*ab))
    return a, b / scale


def fit_alpha_beta(
    samples: list[tuple[int, float]], free_alpha: bool = False
) -> tuple[float, float]:
    """Fit time = alpha + beta * bytes to (bytes, seconds) samples; returns (alpha, beta), both >= 0.

    The error measured is RELATIVE, (alpha + beta*x - y) / y, so a 64 KB message counts as much as a
    64 MB one. First the least-squares fit (weights 1/y^2); then, with 3 or more samples, a robust
    refinement to least ABSOLUTE relative error by iteratively reweighted least squares (weights
    1/|error|), because CPU timings on a shared machine have outliers that would otherwise tilt the
    line; the L1 fit minimises the typical (median-like) error. Non-negativity is exact in every step
    (a 2-variable NNLS: if the unconstrained optimum has a negative coefficient, the better of the
    alpha-only and beta-only fits); if the L1 fit lands on beta = 0 (or alpha = 0) where least squares
    did not, as it does when most samples sit on a noise floor, the least-squares fit is kept, since
    a zero beta would mean infinite bandwidth. One sample gives (y, 0); no samples raise MeshplanError.
    `free_alpha` lets alpha go negative (used for the upper pieces of `fit_segments`, whose lines
    need not pass near the origin).
    """
    pts = [(float(x), float(y)) for x, y in samples if y > 0 and math.isfinite(y)]
    if not pts:
        raise MeshplanError(
            "fit_alpha_beta: no positive (bytes, seconds) samples to fit"
        )
    a0, b0 = a, b = _weighted_fit(pts, [1.0] * len(pts), free_alpha)
    if len(pts) < 3:
        return a, b
    for _ in range(50):
        weights = [1.0 / max(abs(a + b * x - y) / y, 1e-4) for x, y in pts]
        a2, b2 = _weighted_fit(pts, weights, free_alpha)
        done = abs(a2 - a) <= 1e-9 * max(abs(a), 1e-12)
        done = done and abs(b2 - b) <= 1e-9 * max(b, 1e-30)
        a, b = a2, b2
        if done:
            break
    # L1 chose a flat (or origin) line through a noise floor: keep least squares
    if (b <= 0 < b0) or (a <= 0 < a0 and not free_alpha):
        return a0, b0
    return a, b


def _rel_errors(samples: list[tuple[int, float]], a: float, b: float) -> list[float]:
    return [abs(a + b * x - y) / y for x, y in samples if y > 0]


def fit_segments(
    samples: list[tuple[int, float]],
    tolerance: float = SEGMENT_TOLERANCE,
    max_segments: int = 5,
) -> list[tuple[int, float, float]]:
    """Piecewise-linear fit, as [(max_bytes, alpha, beta), ...] ascending; [] when one line
    (`fit_alpha_beta`) is within `tolerance` of every sample.

    Otherwise: a continuous piecewise-linear curve through k + 1 of the measured points ("knots":
    always the smallest and the largest message, plus the best k - 1 in between), k = 2, 3, ...
    `max_segments`. For each k the knots minimising the worst relative error at the other samples
    (ties: the summed error) are found exactly by dynamic programming; the smallest k whose worst sample is within
    `tolerance` is returned (else the k with the smallest worst error). Segment i runs from knot i to
    knot i + 1 (max_bytes = knot i + 1). gloo needs this: on a 2-core machine its all_gather and
    reduce_scatter time grows ~4x per doubling above ~16 MiB, which no single line follows.
    """
    pts = sorted((int(x), float(y)) for x, y in samples if y > 0)
    n = len(pts)
    if n < 3:
        return []
    a, b = fit_alpha_beta(pts)
    worst = max(_rel_errors(pts, a, b))
    if worst <= tolerance:
        return []

    def line(i: int, j: int) -> tuple[int, float, float]:
        (x0, y0), (x1, y1) = pts[i], pts[j]
        beta = (y1 - y0) / (x1 - x0)
        return (x1, y0 - beta * x0, beta)

    cost: dict[
        tuple[int, int], tuple[float, float]
    ] = {}  # (sum, max) of errors strictly inside
    for i in range(n):
        for j in range(i + 1, n):
            _, alpha, beta = line(i, j)
            errs = _rel_errors(pts[i + 1 : j], alpha, beta) or [0.0]
            cost[i, j] = (sum(errs), max(errs))
    # best[k][j]: ((worst error, summed error), knots) of a curve from knot 0 to knot j in k pieces
    Score = tuple[tuple[float, float], tuple[int, ...]]
    best: list[dict[int, Score]] = [{0: ((0.0, 0.0), (0,))}]
    chosen: list[tuple[int, float, float]] = []
    for k in range(1, min(max_segments, n - 1) + 1):
        layer: dict[int, Score] = {}
        for i, ((w, total), knots) in best[k - 1].items():
            for j in range(i + 1, n):
                cand = ((max(w, cost[i, j][1]), total + cost[i, j][0]), (*knots, j))
                if j not in layer or cand[0] < layer[j][0]:
                    layer[j] = cand
        best.append(layer)
        if k == 1 or n - 1 not in layer:
            continue
        (k_worst, _), knots = layer[n - 1]
        if k_worst < worst:
            worst, chosen = k_worst, [line(i, j) for i, j in itertools.pairwise(knots)]
        if worst <= tolerance:
            break
    return chosen


# ---------------------------------------------------------------------------------------------
# JSON reading and writing


#: The runtime's overheads a profile may carry (`runtime.overhead`), each 0.0 when absent.
OVERHEAD_FIELDS = (
    "op_overhead_s",
    "param_overhead_s",
    "param_step_overhead_s",
    "grad_byte_overhead_s",
    "microbatch_overhead_s",
    "step_overhead_s",
)


def save_profile(profile: DeviceProfile, path: str | os.PathLike[str]) -> None:
    """Write `profile` to `path` as JSON (layout in the module docstring)."""
    data = asdict(profile)
    for fit in data["collectives"]:
        fit["samples"] = [[int(b), float(s)] for b, s in fit["samples"]]
        fit["segments"] = [[int(m), float(a), float(b)] for m, a, b in fit["segments"]]
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Reader:
    """Checks fields of parsed JSON and raises one-line MeshplanErrors naming file and field."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, what: str) -> MeshplanError:
        return MeshplanError(f"{self.name}: {what}")

    def get(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"missing field '{where}{key}'")
        return obj[key]

    def num(self, obj: dict[str, Any], key: str, where: str = "") -> float:
        v = self.get(obj, key, where)
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
        ):
            raise self.fail(f"field '{where}{key}' must be a number")
        return float(v)

    def int_(self, obj: dict[str, Any], key: str, where: str = "") -> int:
        v = self.get(obj, key, where)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"field '{where}{key}' must be an integer")
        return v

    def str_(self, obj: dict[str, Any], key: str, where: str = "") -> str:
        v = self.get(obj, key, where)
        if not isinstance(v, str):
            raise self.fail(f"field '{where}{key}' must be a string")
        return v

    def list_(self, obj: dict[str, Any], key: str, where: str = "") -> list[Any]:
        v = self.get(obj, key, where)
        if not isinstance(v, list):
            raise self.fail(f"field '{where}{key}' must be a list")
        return v

    def obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(f"field '{where}' must be an object")
        return v


def load_profile(path: str | os.PathLike[str]) -> DeviceProfile:
    """Read a profile written by `save_profile`; any problem raises a one-line MeshplanError."""
    name = os.fspath(path)
    r = _Reader(name)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise r.fail(
            "no such profile file (write one with `meshplan profile --out FILE`)"
        ) from None
    except OSError as exc:
        raise r.fail(f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise r.fail(
            f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    data = r.obj(data, "<top level>")
    version = r.int_(data, "version")
    if version != PROFILE_VERSION:
        raise r.fail(
            f"profile version {version} is not supported (expected {PROFILE_VERSION}); re-run `meshplan profile`"
        )

    peak_raw = r.obj(r.get(data, "peak_flops", ""), "peak_flops")
    peak: dict[str, float] = {}
    for dtype in peak_raw:
        peak[str(dtype)] = r.num(peak_raw, dtype, "peak_flops.")

    matmul: list[MatmulSample] = []
    for i, raw in enumerate(r.list_(data, "matmul")):
        w = f"matmul[{i}]."
        item = r.obj(raw, w[:-1])
        matmul.append(
            MatmulSample(
                m=r.int_(item, "m", w),
                n=r.int_(item, "n", w),
                k=r.int_(item, "k", w),
                dtype=r.str_(item, "dtype", w),
                seconds=r.num(item, "seconds", w),
            )
        )

    op_rates: list[OpRate] = []
    for i, raw in enumerate(r.list_(data, "op_rates") if "op_rates" in data else []):
        w = f"op_rates[{i}]."
        item = r.obj(raw, w[:-1])
        unit = r.str_(item, "unit", w)
        if unit not in OP_RATE_UNITS:
            raise r.fail(
                f"field '{w}unit' is {unit!r}; expected one of {', '.join(OP_RATE_UNITS)}"
            )
        backward = item.get("backward_s")
        op_rates.append(
            OpRate(
                target=r.str_(item, "target", w),
                unit=unit,
                forward_s=r.num(item, "forward_s", w),
                backward_s=None if backward is None else r.num(item, "backward_s", w),
            )
        )

    collectives: list[CollectiveFit] = []
    for i, raw in enumerate(r.list_(data, "collectives")):
        w = f"collectives[{i}]."
        item = r.obj(raw, w[:-1])
        op = r.str_(item, "op", w)
        if op not in COLLECTIVE_OPS:
            raise r.fail(
                f"field '{w}op' is {op!r}; expected one of {', '.join(COLLECTIVE_OPS)}"
            )
        samples: list[tuple[int, float]] = []
        for j, pair in enumerate(r.list_(item, "samples", w)):
            ok = (
                isinstance(pair, list)
                and len(pair) == 2
                and all(_is_number(v) for v in pair)
            )
            if not ok:
                raise r.fail(
                    f"field '{w}samples[{j}]' must be a [bytes, seconds] pair of numbers"
                )
            samples.append((int(pair[0]), float(pair[1])))
        segments: list[tuple[int, float, float]] = []
        raw_segments = item.get("segments", [])  # optional; absent means []
        if not isinstance(raw_segments, list):
            raise r.fail(f"field '{w}segments' must be a list")
        for j, seg in enumerate(raw_segments):
            ok = (
                isinstance(seg, list)
                and len(seg) == 3
                and all(_is_number(v) for v in seg)
            )
            if not ok:
                raise r.fail(
                    f"field '{w}segments[{j}]' must be a [max_bytes, alpha_s, beta_s_per_byte] list"
                )
            segments.append((int(seg[0]), float(seg[1]), float(seg[2])))
        collectives.append(
            CollectiveFit(
                op=op,
                world_size=r.int_(item, "world_size", w),
                alpha_s=r.num(item, "alpha_s", w),
                beta_s_per_byte=r.num(item, "beta_s_per_byte", w),
                samples=samples,
                segments=segments,
            )
        )

    return DeviceProfile(
        version=version,
        device_name=r.str_(data, "device_name"),
        backend=r.str_(data, "backend"),
        hosts=r.int_(data, "hosts"),
        devices_per_host=r.int_(data, "devices_per_host"),
        memory_bytes=r.int_(data, "memory_bytes"),
        memory_bandwidth_bytes_per_s=r.num(data, "memory_bandwidth_bytes_per_s"),
        peak_flops=peak,
        matmul=matmul,
        collectives=collectives,
        created=r.str_(data, "created"),
        host=r.str_(data, "host"),
        **{key: r.num(data, key) if key in data else 0.0 for key in OVERHEAD_FIELDS},
        op_rates=op_rates,
    )
