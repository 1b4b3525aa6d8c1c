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

The fit (`fit_alpha_beta`) is a non-negative least-squares fit of relative error, so that a 64 KB
message is fitted as closely as a 64 MB one; see its docstring. Where one line misses a sample by more
than SEGMENT_TOLERANCE, `fit_segments` adds a piecewise fit ("segments", optional in the file);
always price with `CollectiveFit.predict(nbytes)`, which uses the segments when present.

JSON layout (version 1)::

    {"version": 1, "device_name": "...", "backend": "gloo", "hosts": 1, "devices_per_host": 4,
     "memory_bytes": ..., "memory_bandwidth_bytes_per_s": ..., "peak_flops": {"float32": ...},
     "matmul": [{"m": .., "n": .., "k": .., "dtype": "float32", "seconds": ..}, ...],
     "collectives": [{"op": "all_reduce", "world_size": 2, "alpha_s": .., "beta_s_per_byte": ..,
                      "samples": [[bytes, seconds], ...],
                      "segments": [[max_bytes, alpha_s, beta_s_per_byte], ...]}, ...],
     "created": "2025-01-01T00:00:00+00:00", "host": "hostname"}

This module is a leaf: it imports nothing from `planner` or `runtime`.
"""

from __future__ import annotations

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


@dataclass
class CollectiveFit:
    """Alpha-beta fit of one collective at one world size: time = alpha_s + beta_s_per_byte * bytes.

    `samples` are the measured (bytes, seconds) medians the fit was made from; the byte convention is
    in the module docstring (full unsharded tensor for all_reduce / all_gather / reduce_scatter /
    all_to_all, per-rank message for send_recv).

    `segments` (optional, possibly empty) is a piecewise refinement written when one line misses a
    measured sample by more than `SEGMENT_TOLERANCE` (gloo over TCP switches algorithms and buffer
    regimes with message size): a list of (max_bytes, alpha_s, beta_s_per_byte), ascending; a message
    uses the first segment whose max_bytes >= its size, or the last one. `predict` applies it; the
    global alpha_s / beta_s_per_byte stay the single best line for closed-form uses.
    """

    op: str
    world_size: int
    alpha_s: float
    beta_s_per_byte: float
    samples: list[tuple[int, float]] = field(default_factory=list)
    segments: list[tuple[int, float, float]] = field(default_factory=list)

    def predict(self, nbytes: float) -> float:
        """Predicted seconds for a message of `nbytes` (byte convention as in the module docstring)."""
        for max_bytes, alpha, beta in self.segments:
            if nbytes <= max_bytes:
                return alpha + beta * float(nbytes)
        if self.segments:
            _, alpha, beta = self.segments[-1]
            return alpha + beta * float(nbytes)
        return self.alpha_s + self.beta_s_per_byte * float(nbytes)


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

    def collective(self, op: str, world_size: int) -> CollectiveFit | None:
        """The fit for `op` at `world_size`, or None when that pair was not measured."""
        for fit in self.collectives:
            if fit.op == op and fit.world_size == world_size:
                return fit
        return None

    def matmul_samples(self, dtype: str) -> list[MatmulSample]:
        """The matrix-product samples measured in `dtype` (possibly empty)."""
        return [s for s in self.matmul if s.dtype == dtype]


def fit_alpha_beta(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Fit time = alpha + beta * bytes to (bytes, seconds) samples; returns (alpha, beta), both >= 0.

    Minimises the sum of squared RELATIVE errors, sum(((alpha + beta*x - y) / y)^2), i.e. a weighted
    least-squares fit with weights 1/y^2, so every message size counts equally rather than the largest
    dominating. Non-negativity is enforced exactly (a 2-variable NNLS): if the unconstrained optimum
    has a negative coefficient, the better of the two one-coefficient fits (alpha only, beta only) is
    returned. One sample gives (0, y/x) (or (y, 0) for x == 0); no samples raise MeshplanError.
    """
    pts = [(float(x), float(y)) for x, y in samples if y > 0 and math.isfinite(y)]
    if not pts:
        raise MeshplanError(
            "fit_alpha_beta: no positive (bytes, seconds) samples to fit"
        )
    # Weighted normal equations with w = 1/y^2.
    s00 = s01 = s11 = t0 = t1 = 0.0
    for x, y in pts:
        w = 1.0 / (y * y)
        s00 += w
        s01 += w * x
        s11 += w * x * x
        t0 += w * y
        t1 += w * x * y

    def loss(a: float, b: float) -> float:
        return sum(((a + b * x - y) / y) ** 2 for x, y in pts)

    candidates: list[tuple[float, float]] = []
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        a = (t0 * s11 - t1 * s01) / det
        b = (s00 * t1 - s01 * t0) / det
        if a >= 0 and b >= 0:
            return a, b
    candidates.append((t0 / s00, 0.0))  # alpha only
    if s11 > 0:
        candidates.append((0.0, max(t1 / s11, 0.0)))  # beta only
    return min(candidates, key=lambda ab: loss(*ab))


def _rel_errors(samples: list[tuple[int, float]], a: float, b: float) -> list[float]:
    return [abs(a + b * x - y) / y for x, y in samples if y > 0]


def fit_segments(
    samples: list[tuple[int, float]],
    tolerance: float = SEGMENT_TOLERANCE,
    min_points: int = 3,
) -> list[tuple[int, float, float]]:
    """Piecewise alpha-beta fit: [] when one line is within `tolerance` of every sample, else the
    best split into 2 (or, if still needed, 3) contiguous size ranges of >= `min_points` samples,
    each fitted with `fit_alpha_beta`, as [(max_bytes, alpha, beta), ...].

    "Best" minimises the summed squared relative error; a split is kept only if it lowers the worst
    sample's relative error.
    """
    pts = sorted((int(x), float(y)) for x, y in samples if y > 0)
    if len(pts) < 2 * min_points:
        return []
    a, b = fit_alpha_beta(pts)
    single_worst = max(_rel_errors(pts, a, b))
    if single_worst <= tolerance:
        return []

    def piece(
        part: list[tuple[int, float]],
    ) -> tuple[tuple[int, float, float], list[float]]:
        pa, pb = fit_alpha_beta(part)
        return (part[-1][0], pa, pb), _rel_errors(part, pa, pb)

    def best_split(
        k: int,
    ) -> tuple[float, float, list[tuple[int, float, float]]] | None:
        best = None
        n = len(pts)
        cuts: list[tuple[int, ...]] = []
        if k == 2:
            cuts = [(i,) for i in range(min_points, n - min_points + 1)]
        else:
            cuts = [
                (i, j)
                for i in range(min_points, n - 2 * min_points + 1)
                for j in range(i + min_points, n - min_points + 1)
            ]
        for cut in cuts:
            bounds = (0, *cut, n)
            segs, errs = [], []
            for lo, hi in itertools.pairwise(bounds):
                seg, e = piece(pts[lo:hi])
                segs.append(seg)
                errs += e
            score = sum(e * e for e in errs)
            if best is None or score < best[0]:
                best = (score, max(errs), segs)
        return best

    chosen: list[tuple[int, float, float]] = []
    worst = single_worst
    for k in (2, 3):
        found = best_split(k)
        if found is not None and found[1] < worst:
            worst, chosen = found[1], found[2]
        if worst <= tolerance:
            break
    return chosen


# ---------------------------------------------------------------------------------------------
# JSON reading and writing


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
    )
