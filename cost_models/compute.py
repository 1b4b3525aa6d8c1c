"""Compute time of one op on one device: a roofline with shape-dependent efficiency, or measured data.

Roofline (no profile)::

    time = max(flops / (peak[dtype] * efficiency(dtype, shape)),  bytes / (memory_bw * MEMORY_EFFICIENCY))

``efficiency`` for a matrix product (m x k) @ (k x n) depends on its smallest dimension
``d = min(m, n, k)``::

    efficiency(d) = E_max * d / (d + d_half)

- ``E_max`` is what a large GEMM reaches: cuBLAS sustains roughly 80-90 % of the datasheet peak on
  big square products; we use 0.80 on tensor cores (tfloat32, float16, bfloat16) and 0.90 on the
  plain fp32 units, whose simpler pipeline gets closer to peak.
- ``d_half`` is the size at which half of ``E_max`` is reached. GEMM kernels tile the output in
  blocks of about 128 x 128 (tensor cores) and step through k in slices of 32-64; a dimension much
  smaller than a tile leaves most of every tile idle, and a small k is dominated by loading and
  storing the tile. We use d_half = 64 for tensor-core dtypes and 16 for fp32 (smaller tiles).
  So a 4096^3 fp16 product runs at 0.79 of peak, min-dimension 256 at 0.64, 64 at 0.40, 8 at 0.09.
  Products that skinny are usually memory-bound anyway, which the second roofline term captures.
- An op without a shape hint (elementwise, reductions, softmax, norms) is priced at ``E_max``; its
  FLOPs are few, so in practice its time is the memory term.

``MEMORY_EFFICIENCY`` = 0.85: streaming kernels reach about 85 % of the datasheet HBM bandwidth.

With a measured profile attached to the cluster (``cluster.profile``), its figures replace the
datasheet ones: the memory term uses the measured bandwidth as is, ops without a shape use the
measured peak, and matrix products interpolate the measured samples (``_measured_rate``): the
achieved FLOP/s of the nearest measured shapes in the plane (log2 min-dimension, log2 FLOPs),
averaged in log space with inverse-distance weights. All functions here are pure.

Per-op overhead (``op_overhead``): a profile may also carry ``op_overhead_s``, the runtime's
measured time per traced op per micro-batch beyond the op's compute (interpreting the graph and
DTensor's dispatch, forward and backward; see `runtime.overhead`). It is a fixed cost per op,
independent of the op's sharding, charged once per op (views included) by the planner's node
prices. Without a profile it is 0: the roofline models a device whose kernels are launched ahead of
their execution, where host overhead hides behind compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cost_models.cluster import Cluster, canonical_dtype, dtype_bytes

if TYPE_CHECKING:
    from cost_models.profile import MatmulSample

TENSOR_CORE_DTYPES = frozenset({"tfloat32", "float16", "bfloat16"})
#: (E_max, d_half) per kind of unit; see the module docstring.
TENSOR_CORE_CURVE = (0.80, 64.0)
FP32_CURVE = (0.90, 16.0)
MEMORY_EFFICIENCY = 0.85
#: How many measured samples the interpolation averages.
NEIGHBOURS = 3

ShapeHint = tuple[int, int, int]


def matmul_efficiency(dtype: object, m: int, n: int, k: int) -> float:
    """Fraction of peak a (m x k) @ (k x n) product reaches: ``E_max * d / (d + d_half)``, d = min(m, n, k)."""
    e_max, d_half = (
        TENSOR_CORE_CURVE
        if canonical_dtype(dtype) in TENSOR_CORE_DTYPES
        else FP32_CURVE
    )
    d = float(max(min(m, n, k), 1))
    return e_max * d / (d + d_half)


def _sample_point(m: float, n: float, k: float) -> tuple[float, float]:
    return (math.log2(max(min(m, n, k), 1.0)), math.log2(max(2.0 * m * n * k, 1.0)))


def _measured_rate(
    samples: Sequence[MatmulSample], m: float, n: float, k: float
) -> float:
    """Achieved FLOP/s for (m, n, k) interpolated from measured samples.

    Each sample is a point (log2 min(m, n, k), log2 FLOPs) with value log(FLOP/s). The query takes
    the inverse-distance-weighted mean of the ``NEIGHBOURS`` nearest values (an exact hit returns that
    sample's rate). Outside the measured range this extrapolates flat: the nearest samples' rates.
    """
    q = _sample_point(m, n, k)
    scored = []
    for s in samples:
        rate = s.flops_per_s
        if rate <= 0:
            continue
        p = _sample_point(s.m, s.n, s.k)
        scored.append((math.dist(p, q), math.log(rate)))
    if not scored:
        return 0.0
    scored.sort(key=lambda t: t[0])
    nearest = scored[:NEIGHBOURS]
    if nearest[0][0] < 1e-9:
        return math.exp(nearest[0][1])
    weights = [1.0 / d for d, _ in nearest]
    return math.exp(sum(w * v for w, (_, v) in zip(weights, nearest)) / sum(weights))


def _memory_time(cluster: Cluster, nbytes: float) -> float:
    if cluster.profile is not None and cluster.profile.memory_bandwidth_bytes_per_s > 0:
        return nbytes / cluster.profile.memory_bandwidth_bytes_per_s
    return nbytes / (cluster.device.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)


def _measured_peak(cluster: Cluster, dtype: str) -> float | None:
    profile = cluster.profile
    if profile is None:
        return None
    peaks = {canonical_dtype(k): v for k, v in profile.peak_flops.items() if v > 0}
    return peaks.get(dtype) or peaks.get("float32")


def op_time(
    cluster: Cluster,
    flops: float,
    bytes_accessed: float,
    dtype: object,
    *,
    shape_hint: ShapeHint | None = None,
) -> float:
    """Seconds one device takes for an op of ``flops`` FLOPs reading and writing ``bytes_accessed`` bytes.

    ``shape_hint = (m, n, k)`` marks a matrix product (m x k) @ (k x n), with any batch folded into
    m (a batched product fills the device like one with a taller m; a convolution is the implicit
    GEMM m = N*H_out*W_out, n = C_out, k = C_in*kh*kw). Without a profile:
    ``max(flops / (peak * efficiency), bytes / (bw * MEMORY_EFFICIENCY))``; with one, the measured
    rate (matrix products) or measured peak (other ops) and measured bandwidth.
    """
    if flops <= 0 and bytes_accessed <= 0:
        return 0.0
    name = canonical_dtype(dtype)
    memory = _memory_time(cluster, max(bytes_accessed, 0.0))
    if flops <= 0:
        return memory
    rate = 0.0
    if cluster.profile is not None:
        if shape_hint is not None:
            rate = _measured_rate(cluster.profile.matmul_samples(name), *shape_hint)
        if rate <= 0:
            rate = _measured_peak(cluster, name) or 0.0
    if rate <= 0:
        peak = cluster.device.peak(name)
        if shape_hint is not None:
            rate = peak * matmul_efficiency(name, *shape_hint)
        else:
            rate = (
                peak
                * (TENSOR_CORE_CURVE if name in TENSOR_CORE_DTYPES else FP32_CURVE)[0]
            )
    return max(flops / rate, memory)


def op_overhead(cluster: Cluster) -> float:
    """Seconds of runtime overhead per op per micro-batch: the profile's ``op_overhead_s``, else 0."""
    profile = cluster.profile
    return float(getattr(profile, "op_overhead_s", 0.0)) if profile is not None else 0.0


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products (m x k) @ (k x n): ``2 * batch * m * n * k``."""
    return 2.0 * batch * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype: object, batch: int = 1) -> float:
    """Bytes a product reads and writes: ``batch * (m*k + k*n + m*n) * dtype_bytes``."""
    return float(batch) * (m * k + k * n + m * n) * dtype_bytes(dtype)


def matmul_time(
    cluster: Cluster, m: int, n: int, k: int, dtype: object, batch: int = 1
) -> float:
    """Seconds for ``batch`` products (m x k) @ (k x n) in ``dtype`` (``op_time`` with the shape hint
    ``(batch * m, n, k)``)."""
    return op_time(
        cluster,
        matmul_flops(m, n, k, batch),
        matmul_bytes(m, n, k, dtype, batch),
        dtype,
        shape_hint=(batch * m, n, k),
    )
