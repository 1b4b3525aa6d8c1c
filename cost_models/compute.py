"""Compute time of one op on one device: a roofline with shape-dependent efficiency, or measured data.

Roofline (no profile)::

    time = max(flops / (peak[dtype] * efficiency(dtype, shape)),  bytes / (memory_bw * MEMORY_EFFICIENCY))

``efficiency`` for a matrix product (m x k) @ (k x n) depends on its smallest dimension
``d = min(m, n, k)``::

    efficiency(d) = E_max * d / (d + d_half)

- ``E_max`` is what a large GEMM reaches: cuBLAS sustains roughly 80-90 % of the datasheet peak on
  big square products; we use 0.80 on tensor cores (tfloat32, float16, bfloat16) and 0.90 on the
  plain fp32 units, whose simpler pipeline gets closer to peak. Where a device's tensor-core
  ``E_max`` was fitted to measured training runs (``TENSOR_CORE_E_MAX``: A100-80GB), the fit
  replaces 0.80.
- ``d_half`` is the size at which half of ``E_max`` is reached. GEMM kernels tile the output in
  blocks of about 128 x 128 (tensor cores) and step through k in slices of 32-64; a dimension much
  smaller than a tile leaves most of every tile idle, and a small k is dominated by loading and
  storing the tile. We use d_half = 64 for tensor-core dtypes and 16 for fp32 (smaller tiles).
  So a 4096^3 fp16 product runs at 0.79 of peak, min-dimension 256 at 0.64, 64 at 0.40, 8 at 0.09.
  Products that skinny are usually memory-bound anyway, which the second roofline term captures.
- An op without a shape hint (elementwise, reductions, softmax, norms) is priced at ``E_max``; its
  FLOPs are few, so in practice its time is the memory term.

``MEMORY_EFFICIENCY`` = 0.85: streaming kernels reach about 85 % of the datasheet HBM bandwidth;
a device whose training-step kernels were measured has its own (``DEVICE_MEMORY_EFFICIENCY``).
Fused attention on such a device is priced by ``fused_attention_time`` (``FUSED_ATTENTION_E``)
instead of as a product.

With a measured profile attached to the cluster (``cluster.profile``), its figures replace the
datasheet ones: the memory term uses the measured bandwidth as is, ops without a shape use the
measured peak, and matrix products interpolate the measured samples (``_measured_rate``): the
achieved FLOP/s of the nearest measured shapes in the plane (log2 min-dimension, log2 FLOPs),
averaged in log space with inverse-distance weights. All functions here are pure.

Measured ops (``measured_op_time``): a profile may also carry ``op_rates``, the measured seconds
per unit (forward FLOP, or forward byte read or written for ops without FLOPs) of the non-GEMM ops
of some models, forward and backward (`runtime.op_rates`). Such an op is priced from its rate
instead of the roofline: on a CPU, GELU's erf, softmax's exp and attention's fused kernel can run
well below memory bandwidth, which the roofline has no term for (one rank of this machine: a GELU
of 2^18 float32 elements took 0.6-1.0 ms forward and backward, against the roofline's 0.25 ms).
GEMMs keep the samples above, whose rate depends on the shape a sharding gives them.

Per-op overhead (``op_overhead``): a profile may also carry ``op_overhead_s``, the runtime's
measured time per traced op per micro-batch beyond the op's compute (interpreting the graph and
DTensor's dispatch, forward and backward; see `runtime.overhead`). It is a fixed cost per op,
independent of the op's sharding, charged once per op (views included) by the planner's node
prices. Without a profile it is 0: the roofline models a device whose kernels are launched ahead of
their execution, where host overhead hides behind compute. Likewise ``step_overhead`` (the
profile's ``step_overhead_s``): the runtime's fixed time per training step, added once to a plan's
iteration time; ``microbatch_overhead`` (``microbatch_overhead_s``): its fixed time per stage
and micro-batch, added to every stage's time per micro-batch; and ``param_overhead`` (the
profile's ``param_overhead_s`` per micro-batch and ``param_step_overhead_s`` per step, and
``grad_byte_overhead_s`` per byte of the gradient a device holds per step): its time per
parameter tensor a stage holds (its DTensor gradient's accumulation, bucketing and step),
charged by the planner's price of each parameter. Without that measured per-byte figure the
optimizer's update is priced by the bytes it moves (``param_step_time``), per parameter on the
shard of its optimizer state a device holds, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cost_models.cluster import Cluster, canonical_dtype, dtype_bytes
from cost_models.errors import MeshplanError

if TYPE_CHECKING:
    from cost_models.profile import MatmulSample

TENSOR_CORE_DTYPES = frozenset({"tfloat32", "float16", "bfloat16"})
#: (E_max, d_half) per kind of unit; see the module docstring.
TENSOR_CORE_CURVE = (0.80, 64.0)
FP32_CURVE = (0.90, 16.0)
#: Tensor-core E_max of the devices where it was fitted to measured training runs (device name ->
#: E_max), replacing ``TENSOR_CORE_CURVE[0]``; a device without an entry keeps the guess above.
#: A100-80GB: 0.7378, fitted by ``python -m benchmarks.published`` (benchmarks/results/published.json)
#: to Korthikanti et al. 2022's four full-recomputation GPT runs on DGX A100-80GB (22B, 175B, 530B,
#: 1T; ../shared/reference/published-measurements.md), least squares in the relative error of
#: iteration time, every other constant at its datasheet value; leave-one-out it predicts each of
#: the four within 6.4% (mean 3.3%; refitted 2026-12-01 once plans priced the optimizer's step,
#: 0.7262 before, 0.7246 before 2026-11-26). It stands for what fp16 GEMMs sustained in those runs
#: against the 312 TFLOP/s datasheet peak, and also absorbs what the datasheet constants left at
#: their values miss there (its leave-one-out errors run from -4.7% at 175B to +6.4% at 1T;
#: benchmarks/results/REPORT.md).
TENSOR_CORE_E_MAX: dict[str, float] = {"A100-80GB": 0.7378}
MEMORY_EFFICIENCY = 0.85
#: Memory-bound efficiency of the devices where it was fitted to the kernels of measured training
#: steps (device name -> fraction of the datasheet bandwidth), replacing ``MEMORY_EFFICIENCY``.
#: H200-141GB: fitted by ``python -m benchmarks.gpu_breakdown --fit
#: benchmarks/results/gpu-H200-141GB-fit.json`` to the memory-bound kernels (every kernel neither a
#: matrix product, attention nor the optimizer's) and the fused Adam kernels of three bf16 GPT
#: training steps on one H200 (2026-11-30): their seconds against the bytes the ops move. It also
#: absorbs kernels the graph does not price as ops of their own (bias-gradient reductions, the
#: copies of concatenations, fills): 2.3 ms of the 12.5 ms of the first case. Leave-one-out it
#: moves between 0.604 and 0.624, and the fit of a second run of the same models
#: (benchmarks/results/gpu-H200-141GB.json) gives 0.6025.
#: H100-80GB (the same chip with HBM3 at 3.35 TB/s): fitted by ``python -m benchmarks.gpu_transfer``
#: (its docstring has the command) to the steps of the same three models in eager PyTorch on one
#: H100 (benchmarks/results/gpu-H100-80GB.json, 2026-11-22, the same torch as the H200's): each step
#: is the H200's with its memory-bound and optimizer kernels k = 1.455 times as long (1.433 if both
#: reached the same fraction of their datasheet bandwidth), which makes the H100's 0.6129 * 1.433 /
#: 1.455; leave-one-out 0.577 to 0.621, each step then within 3.6%.
DEVICE_MEMORY_EFFICIENCY: dict[str, float] = {"H200-141GB": 0.6129, "H100-80GB": 0.6036}
#: Fused (flash) attention on the devices where it was measured: device name -> the fraction of
#: the tensor-core peak its FLOPs run at, counted with the head dimension rounded up to a
#: multiple of ``FLASH_HEAD_DIM_STEP`` (the flash kernels are built for head dimensions 32, 64,
#: 96, ..., 256: a head of 80 runs the 96 kernel). Without an entry attention is priced as a
#: product of smallest dimension the head dimension. FLOPs count the full square of scores, as
#: PyTorch's FLOP counter does, so a causal kernel, which skips the upper half, is absorbed here.
#: H200-141GB: fitted like ``DEVICE_MEMORY_EFFICIENCY`` to the flash kernels of the same three
#: steps (heads of 64, 128 and 80; leave-one-out 0.295-0.327; the second run's fit 0.297). It
#: prices a Llama's attention at sequence 2048 38% slower than it ran (heldout file), and the
#: three held-out models (heads of 128 each) alone fit 0.376: the kernels' efficiency grows with
#: the head dimension and the sequence, which this one number does not model.
#: H100-80GB: the H200's, the same SMs at the same clocks (not measured on an H100 on its own: the
#: H100's steps were recorded without their kernels; `benchmarks.gpu_transfer` finds its eager
#: steps within 3.6%, leave-one-out, of the H200's with only the memory-bound kernels longer).
FUSED_ATTENTION_E: dict[str, float] = {"H200-141GB": 0.3044}
FUSED_ATTENTION_E["H100-80GB"] = FUSED_ATTENTION_E["H200-141GB"]
FLASH_HEAD_DIM_STEP = 32
#: Fixed seconds per GPU kernel (datasheet pricing only): a CUDA kernel launch takes about 5-10 us
#: on a V100, and each kernel ramps up and drains its waves of thread blocks; we charge the low end,
#: 5 us, per kernel a pass runs (``op_time(..., kernels=k)``). A GPT block launches some 20 kernels
#: per forward, so at small micro-batches this is a few percent of its time.
KERNEL_OVERHEAD_S = 5e-6
#: How many measured samples the interpolation averages.
NEIGHBOURS = 3

ShapeHint = tuple[int, int, int]


def max_efficiency(dtype: object, device: str | None = None) -> float:
    """``E_max`` of ``dtype``'s units on ``device``: its fitted ``TENSOR_CORE_E_MAX`` entry for
    tensor-core dtypes, else the curve's."""
    if canonical_dtype(dtype) in TENSOR_CORE_DTYPES:
        return TENSOR_CORE_E_MAX.get(device or "", TENSOR_CORE_CURVE[0])
    return FP32_CURVE[0]


def matmul_efficiency(
    dtype: object, m: int, n: int, k: int, device: str | None = None
) -> float:
    """Fraction of peak a (m x k) @ (k x n) product reaches: ``E_max * d / (d + d_half)``, d = min(m, n, k)
    (``E_max`` from ``max_efficiency(dtype, device)``)."""
    d_half = (
        TENSOR_CORE_CURVE
        if canonical_dtype(dtype) in TENSOR_CORE_DTYPES
        else FP32_CURVE
    )[1]
    d = float(max(min(m, n, k), 1))
    return max_efficiency(dtype, device) * d / (d + d_half)


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


def memory_efficiency(device: str) -> float:
    """The fraction of ``device``'s datasheet bandwidth memory-bound kernels reach: its fitted
    ``DEVICE_MEMORY_EFFICIENCY`` entry, else ``MEMORY_EFFICIENCY``."""
    return DEVICE_MEMORY_EFFICIENCY.get(device, MEMORY_EFFICIENCY)


def _memory_time(cluster: Cluster, nbytes: float) -> float:
    if cluster.profile is not None and cluster.profile.memory_bandwidth_bytes_per_s > 0:
        return nbytes / cluster.profile.memory_bandwidth_bytes_per_s
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s
    return nbytes / (bandwidth * memory_efficiency(cluster.device.name))


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
    kernels: int = 0,
) -> float:
    """Seconds one device takes for an op of ``flops`` FLOPs reading and writing ``bytes_accessed`` bytes.

    ``kernels``: how many GPU kernels the op runs; without a measured profile each adds
    ``KERNEL_OVERHEAD_S`` (a profile's measured rates already include it).

    ``shape_hint = (m, n, k)`` marks a matrix product (m x k) @ (k x n), with any batch folded into
    m (a batched product fills the device like one with a taller m; a convolution is the implicit
    GEMM m = N*H_out*W_out, n = C_out, k = C_in*kh*kw). Without a profile:
    ``max(flops / (peak * efficiency), bytes / (bw * MEMORY_EFFICIENCY))``; with one, the measured
    rate (matrix products) or measured peak (other ops) and measured bandwidth.
    """
    if flops <= 0 and bytes_accessed <= 0:
        return 0.0
    name = canonical_dtype(dtype)
    overhead = kernels * KERNEL_OVERHEAD_S if cluster.profile is None else 0.0
    memory = _memory_time(cluster, max(bytes_accessed, 0.0))
    if flops <= 0:
        return memory + overhead
    rate = 0.0
    if cluster.profile is not None:
        if shape_hint is not None:
            rate = _measured_rate(cluster.profile.matmul_samples(name), *shape_hint)
        if rate <= 0:
            rate = _measured_peak(cluster, name) or 0.0
    if rate <= 0:
        peak = cluster.device.peak(name)
        device = cluster.device.name
        if shape_hint is not None:
            rate = peak * matmul_efficiency(name, *shape_hint, device=device)
        else:
            rate = peak * max_efficiency(name, device)
    return max(flops / rate, memory) + overhead


def fused_attention_time(
    cluster: Cluster,
    flops: float,
    bytes_accessed: float,
    dtype: object,
    head_dim: int,
    *,
    kernels: int = 0,
) -> float | None:
    """Seconds of a fused attention op of ``flops`` FLOPs on a device with a measured
    ``FUSED_ATTENTION_E`` (datasheet pricing only): ``max(flops * padded / head_dim /
    (peak * E), memory) + kernels * KERNEL_OVERHEAD_S``, ``padded`` the head dimension rounded
    up to ``FLASH_HEAD_DIM_STEP``. None where the device has no entry or a profile prices the
    cluster: price it as a product then (`op_time`)."""
    e = FUSED_ATTENTION_E.get(cluster.device.name)
    if e is None or cluster.profile is not None or head_dim < 1:
        return None
    step = FLASH_HEAD_DIM_STEP
    padded = -(-head_dim // step) * step
    rate = cluster.device.peak(canonical_dtype(dtype)) * e
    memory = _memory_time(cluster, max(bytes_accessed, 0.0))
    return max(flops * padded / head_dim / rate, memory) + kernels * KERNEL_OVERHEAD_S


def measured_op_time(
    cluster: Cluster,
    target: str,
    *,
    flops: float,
    nbytes: float,
    backward: bool,
) -> float | None:
    """Seconds of one call of op `target` doing `flops` forward FLOPs and reading and writing
    `nbytes` bytes in its forward, from the profile's measured rate (`cost_models.profile.OpRate`): forward,
    plus backward when `backward`. None when the profile has no rate for `target`, or none for
    its backward when `backward` is asked for: price the op with `op_time` then."""
    lookup = getattr(cluster.profile, "op_rate", None)
    rate = lookup(target) if lookup is not None else None
    if rate is None or (backward and rate.backward_s is None):
        return None
    units = flops if rate.unit == "flop" else nbytes
    return units * (rate.forward_s + ((rate.backward_s or 0.0) if backward else 0.0))


def op_overhead(cluster: Cluster) -> float:
    """Seconds of runtime overhead per op per micro-batch: the profile's ``op_overhead_s``, else 0."""
    return float(getattr(cluster.profile, "op_overhead_s", 0.0))


def param_overhead(
    cluster: Cluster, num_microbatches: int, grad_bytes: float = 0.0
) -> float:
    """Seconds of runtime overhead per micro-batch of a parameter tensor whose gradient has
    `grad_bytes` bytes on a device, its per-step part spread over the `num_microbatches`:
    ``param_overhead_s + (param_step_overhead_s + grad_bytes * grad_byte_overhead_s) / B`` of
    the profile, else 0."""
    profile = cluster.profile
    step = float(getattr(profile, "param_step_overhead_s", 0.0)) + grad_bytes * float(
        getattr(profile, "grad_byte_overhead_s", 0.0)
    )
    return float(getattr(profile, "param_overhead_s", 0.0)) + step / max(
        1, num_microbatches
    )


def microbatch_overhead(cluster: Cluster) -> float:
    """Seconds of runtime overhead per stage per micro-batch beyond its ops: the profile's
    ``microbatch_overhead_s``, else 0."""
    return float(getattr(cluster.profile, "microbatch_overhead_s", 0.0))


def step_overhead(cluster: Cluster) -> float:
    """Seconds of runtime overhead once per training step: the profile's ``step_overhead_s``,
    else 0."""
    return float(getattr(cluster.profile, "step_overhead_s", 0.0))


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


def unfused_attention_time(
    cluster: Cluster,
    batch_heads: int,
    seq: int,
    head_dim: int,
    dtype: object,
    *,
    dropout: bool = True,
) -> tuple[float, float]:
    """(forward, backward) seconds of attention that materializes its scores, as Megatron-LM runs it.

    ``batch_heads`` = micro-batch x heads on the device, ``s`` = ``seq``, ``d`` = ``head_dim``,
    ``p`` = bytes of ``dtype``; ``n = batch_heads * s * s`` score elements. The kernels, each priced
    with ``op_time``/``matmul_time`` (the batched products by the matmul roofline with k or n = d):

    ================================  ==================================  =========================
    kernel                            forward                             backward
    ================================  ==================================  =========================
    scores = q k^T (baddbmm)          (s x d)(d x s), writes n*p bytes    dq = dS k, dk = dS^T q
    scale + causal mask + softmax     reads n*p, writes n*p               reads 2 n*p, writes n*p
    dropout (p_drop > 0)              reads n*p, writes n*p + n (mask)    reads n*p + n, writes n*p
    context = probs v (bmm)           (s x s)(s x d)                      dP = dC v^T, dv = P^T dC
    ================================  ==================================  =========================

    Each kernel also pays ``KERNEL_OVERHEAD_S``. The softmax and dropout move ``n`` elements with no matrix FLOPs, so they are memory-bound; for
    the 350M GPT of Alpa's suite (micro-batch 16, 16 heads, s = 1024) ``n * p`` is 0.5 GB per layer.
    A fused (flash / memory-efficient) kernel never writes the scores: compare ``op_time`` of one
    op with q, k, v and the output as its only traffic.
    """
    if min(batch_heads, seq, head_dim) < 1:
        raise MeshplanError(
            f"attention sizes must be positive, got {batch_heads}, {seq}, {head_dim}"
        )
    p = dtype_bytes(dtype)
    n = float(batch_heads) * seq * seq
    s, d, bh = seq, head_dim, batch_heads
    launch = KERNEL_OVERHEAD_S if cluster.profile is None else 0.0
    scores = matmul_time(cluster, s, s, d, dtype, batch=bh) + launch
    context = matmul_time(cluster, s, d, s, dtype, batch=bh) + launch
    softmax_f = op_time(cluster, 0.0, 2 * n * p, dtype, kernels=1)
    softmax_b = op_time(cluster, 0.0, 3 * n * p, dtype, kernels=1)
    drop_f = op_time(cluster, 0.0, 2 * n * p + n, dtype, kernels=1) if dropout else 0.0
    drop_b = op_time(cluster, 0.0, 2 * n * p + n, dtype, kernels=1) if dropout else 0.0
    # Backward of C = P V: dP = dC V^T (s x d)(d x s) and dV = P^T dC (s x s)(s x d);
    # of S = Q K^T: dQ = dS K and dK = dS^T Q, both (s x s)(s x d).
    context_b = matmul_time(cluster, s, s, d, dtype, batch=bh) + matmul_time(
        cluster, s, d, s, dtype, batch=bh
    )
    context_b += 2 * launch
    scores_b = 2 * (matmul_time(cluster, s, d, s, dtype, batch=bh) + launch)
    forward = scores + softmax_f + drop_f + context
    backward = context_b + drop_b + softmax_b + scores_b
    return forward, backward


#: Bytes moved per logit by Megatron-LM's cross-entropy on fp16 logits (``output.float()`` then
#: ``vocab_parallel_cross_entropy``), forward: cast 2 + 4, max 4, subtract in place 4 + 4, exp in
#: place 4 + 4, sum 4, divide in place 4 + 4 = 38; backward: scale the saved softmax in place
#: 4 + 4, cast the gradient to fp16 4 + 2 = 14.
CROSS_ENTROPY_BYTES_PER_LOGIT = (38, 14)


def fp32_cross_entropy_time(cluster: Cluster, logits: float) -> tuple[float, float]:
    """(forward, backward) seconds of a cross-entropy over ``logits`` fp16 logits computed in fp32
    (memory-bound; bytes per logit in ``CROSS_ENTROPY_BYTES_PER_LOGIT``; 6 kernels forward, 2
    backward)."""
    if logits < 0:
        raise MeshplanError(f"number of logits must be >= 0, got {logits}")
    f, b = CROSS_ENTROPY_BYTES_PER_LOGIT
    return (
        op_time(cluster, 0.0, f * logits, "float32", kernels=6),
        op_time(cluster, 0.0, b * logits, "float32", kernels=2),
    )


#: Bytes read + written per parameter by one optimizer step (memory-bound elementwise kernels).
#: ``adam_mixed`` (Megatron-LM's fp16 optimizer): copy the fp16 gradient to an fp32 main gradient
#: 2 + 4; unscale and check for inf/nan 4 + 4; gradient norm for clipping 4; Adam reads the fp32
#: weight, gradient, m, v (16) and writes weight, m, v (12); copy the weight back to fp16 4 + 2:
#: 52 in all. ``adam_fp32``: Adam's 28. ``adam_16bit`` (Adam on 16-bit weights, its state in their
#: dtype): reads weight, gradient, m, v (8) and writes weight, m, v (6): 14. SGD reads weight and
#: gradient, writes the weight: 12; with momentum also reads and writes the buffer: 20.
OPTIMIZER_STEP_BYTES = {
    "adam_mixed": 52,
    "adam_fp32": 28,
    "adam_16bit": 14,
    "sgd": 12,
    "sgd_momentum": 20,
}


def optimizer_step_time(
    cluster: Cluster, num_params: float, optimizer: str = "adam_mixed"
) -> float:
    """Seconds of one optimizer step over ``num_params`` local parameters:
    ``op_time`` of ``OPTIMIZER_STEP_BYTES[optimizer] * num_params`` bytes."""
    if optimizer not in OPTIMIZER_STEP_BYTES:
        raise MeshplanError(
            f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STEP_BYTES)}"
        )
    if num_params < 0:
        raise MeshplanError(f"number of parameters must be >= 0, got {num_params}")
    return op_time(
        cluster, 0.0, OPTIMIZER_STEP_BYTES[optimizer] * num_params, "float32"
    )


def param_step_time(cluster: Cluster, numel: float, optimizer: str) -> float:
    """Seconds per step of the optimizer's update of one parameter whose optimizer state holds
    `numel` elements on a device (its shard, under ZeRO or FSDP): `optimizer_step_time`, or 0
    when the cluster's profile measured the runtime's gradient work per byte and step
    (``grad_byte_overhead_s``, which includes the update: `param_overhead` charges it).

    Measured on one H200 (`benchmarks.gpu_breakdown`, eight GPTs and Llamas of 0.1-0.8B
    parameters, Adam on 16-bit weights): the optimizer's kernels took 1.25-5.42 ms per step,
    this price 1.17-4.85 ms (-6.7% to -11.1%)."""
    if float(getattr(cluster.profile, "grad_byte_overhead_s", 0.0)) > 0:
        return 0.0
    return optimizer_step_time(cluster, numel, optimizer)


def fused_dropout_time(
    cluster: Cluster, elements: float, dtype: object
) -> tuple[float, float]:
    """(forward, backward) seconds that dropout adds when fused into an elementwise kernel, as in
    Megatron-LM's bias-dropout-add: the forward kernel also writes a 1-byte keep-mask per element;
    the backward is one more kernel that reads the gradient and the mask and writes the gradient
    (``2 p + 1`` bytes per element for ``p``-byte ``dtype``)."""
    if elements < 0:
        raise MeshplanError(f"number of elements must be >= 0, got {elements}")
    p = dtype_bytes(dtype)
    return (
        op_time(cluster, 0.0, elements, dtype),
        op_time(cluster, 0.0, (2 * p + 1) * elements, dtype, kernels=1),
    )
