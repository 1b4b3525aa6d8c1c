"""Compute cost: roofline with shape-dependent efficiency, and interpolation of measured matmuls."""

from __future__ import annotations

import profiles
import pytest

import cost_models.profile as profile_mod
from cost_models import Cluster, matmul_efficiency, matmul_time, op_time
from cost_models.compute import (
    FP32_CURVE,
    KERNEL_OVERHEAD_S,
    MEMORY_EFFICIENCY,
    TENSOR_CORE_CURVE,
    fp32_cross_entropy_time,
    fused_dropout_time,
    optimizer_step_time,
    unfused_attention_time,
)
from cost_models.errors import MeshplanError

V100 = Cluster.from_spec("1x8xV100-16GB")


def cpu_profile(samples):
    return profiles.cpu_profile(
        memory_bytes=8 << 30,
        memory_bandwidth_bytes_per_s=20e9,
        matmul=[
            profile_mod.MatmulSample(m, n, k, "float32", s) for m, n, k, s in samples
        ],
        collectives=[profile_mod.CollectiveFit("send_recv", 2, 1e-5, 1e-9)],
    )


def test_efficiency_curve():
    e_max, d_half = TENSOR_CORE_CURVE
    assert matmul_efficiency("float16", 4096, 4096, 4096) == pytest.approx(
        e_max * 4096 / (4096 + d_half)
    )
    assert matmul_efficiency("float16", 64, 4096, 4096) == pytest.approx(
        e_max / 2
    )  # d_half = 64
    effs = [
        matmul_efficiency("bfloat16", 4096, d, 4096)
        for d in (1, 8, 64, 512, 4096, 65536)
    ]
    assert effs == sorted(effs) and effs[-1] < e_max
    e32, h32 = FP32_CURVE
    assert matmul_efficiency("float32", 16, 1000, 1000) == pytest.approx(e32 / 2)
    assert h32 < d_half


def test_large_matmul_is_compute_bound():
    m = n = k = 8192
    t = matmul_time(V100, m, n, k, "float16")
    flops = 2 * m * n * k
    assert t == pytest.approx(flops / (125e12 * matmul_efficiency("float16", m, n, k)))
    # fp32 is much slower on a V100 (no tensor cores)
    assert matmul_time(V100, m, n, k, "float32") > 5 * t


def test_skinny_matmul_is_memory_bound():
    m, n, k = 1, 8192, 8192  # a matrix-vector product
    t = matmul_time(V100, m, n, k, "float16")
    nbytes = (m * k + k * n + m * n) * 2
    assert t == pytest.approx(nbytes / (900e9 * MEMORY_EFFICIENCY))


def test_elementwise_op_is_memory_time():
    nbytes = 3 * 4 * 2**20
    assert op_time(V100, 2**20, nbytes, "float32") == pytest.approx(
        nbytes / (900e9 * MEMORY_EFFICIENCY)
    )
    assert op_time(V100, 0, 0, "float32") == 0.0
    assert op_time(V100, 0, 1000, "float32") > 0


def test_matmul_time_grows_and_batches():
    ts = [matmul_time(V100, d, d, d, "float16") for d in (128, 256, 512, 1024, 2048)]
    assert ts == sorted(ts)
    one = matmul_time(V100, 1024, 1024, 1024, "float16")
    four = matmul_time(V100, 1024, 1024, 1024, "float16", batch=4)
    assert 3.5 * one < four <= 4 * one  # a batch fills the device at least as well


def test_faster_devices_are_faster():
    args = (4096, 4096, 4096, "bfloat16")
    a100 = matmul_time(Cluster.from_spec("1x1xA100-80GB"), *args)
    h100 = matmul_time(Cluster.from_spec("1x1xH100-80GB"), *args)
    assert h100 < a100 < matmul_time(V100, *args)


def test_profile_interpolates_measured_matmuls():
    # measured rates: 10 GFLOP/s at 64^3, 40 GFLOP/s at 512^3, 80 GFLOP/s at 2048^3
    samples = [
        (d, d, d, 2 * d**3 / r) for d, r in ((64, 10e9), (512, 40e9), (2048, 80e9))
    ]
    c = Cluster.from_profile(cpu_profile(samples))
    # an exact hit returns the measured time
    assert matmul_time(c, 512, 512, 512, "float32") == pytest.approx(2 * 512**3 / 40e9)
    # between samples the rate lies between theirs
    t = matmul_time(c, 1024, 1024, 1024, "float32")
    rate = 2 * 1024**3 / t
    assert 40e9 < rate < 80e9
    # beyond the measured range: the nearest rates, never above the best measured
    big = 2 * 8192**3 / matmul_time(c, 8192, 8192, 8192, "float32")
    assert 40e9 < big <= 80e9
    # a dtype without samples uses the measured peak (float32's here)
    t16 = matmul_time(c, 512, 512, 512, "float16")
    assert t16 == pytest.approx(max(2 * 512**3 / 100e9, 3 * 512 * 512 * 2 / 20e9))


def test_profile_memory_term_uses_measured_bandwidth():
    c = Cluster.from_profile(cpu_profile([(256, 256, 256, 1e-3)]))
    assert op_time(c, 10, 20e9, "float32") == pytest.approx(1.0)
    # the preset spec with the same profile attached also prices from it
    v = Cluster.from_spec("1x2xV100-16GB", profile=c.profile)
    assert op_time(v, 10, 20e9, "float32") == pytest.approx(1.0)


# ---------------------------------------------------------------- kernels, attention, loss, step
V1 = Cluster.from_spec("1x1xV100-16GB")
BW = 900e9 * MEMORY_EFFICIENCY  # V100 HBM2 at the streaming efficiency


def test_kernel_overhead_is_added_per_kernel_without_a_profile() -> None:
    base = op_time(V1, 1e9, 1e8, "float16")
    assert op_time(V1, 1e9, 1e8, "float16", kernels=3) == pytest.approx(
        base + 3 * KERNEL_OVERHEAD_S
    )
    prof = cpu_profile([(64, 64, 64, 1e-3)])
    c = Cluster.from_spec("1x2xCPU", profile=prof)
    assert op_time(c, 10, 20e9, "float32", kernels=5) == op_time(c, 10, 20e9, "float32")


def test_unfused_attention_moves_the_scores_as_derived() -> None:
    """350M GPT, micro-batch 16: bh = 256 head-batches, s = 1024, d = 64, fp16. Every kernel is
    memory-bound here (a k = 64 product runs at 0.4 of peak, 2.7 us of math per head-batch against
    3.1 us of traffic), so the times are bytes / bandwidth plus one overhead per kernel. With
    n = bh s^2 score elements and q = bh s d elements per q, k, v or output tensor (p = 2 bytes):
    forward: q k^T reads 2q writes n; softmax reads and writes n; probs v reads n + q writes q:
    4n + 4q elements, 3 kernels. Backward: dP = dC v^T reads 2q writes n; dv = P^T dC reads n + q
    writes q; softmax backward reads 2n writes n; dq = dS k and dk = dS^T q read n + q write q
    each: 7n + 8q elements, 5 kernels. Dropout adds n p + n (mask) forward and backward."""
    bh, s, d, p = 256, 1024, 64, 2
    n, q = bh * s * s, bh * s * d
    fwd, bwd = unfused_attention_time(V1, bh, s, d, "float16", dropout=False)
    assert fwd == pytest.approx((4 * n + 4 * q) * p / BW + 3 * KERNEL_OVERHEAD_S)
    assert bwd == pytest.approx((7 * n + 8 * q) * p / BW + 5 * KERNEL_OVERHEAD_S)
    fwd_d, bwd_d = unfused_attention_time(V1, bh, s, d, "float16", dropout=True)
    drop = (2 * n * p + n) / BW + KERNEL_OVERHEAD_S
    assert fwd_d - fwd == pytest.approx(drop)
    assert bwd_d - bwd == pytest.approx(drop)
    # A fused kernel moves only q, k, v and the output: over 5x less than the unfused forward here.
    assert fwd > 5 * op_time(V1, 0.0, 4 * q * p, "float16")
    with pytest.raises(MeshplanError):
        unfused_attention_time(V1, 0, s, d, "float16")


def test_fp32_cross_entropy_bytes_per_logit() -> None:
    """Megatron's loss on fp16 logits, in fp32: forward cast (2 + 4), max (4), subtract (4 + 4),
    exp (4 + 4), sum (4), divide (4 + 4); backward scale (4 + 4), cast back (4 + 2)."""
    forward = [2 + 4, 4, 4 + 4, 4 + 4, 4, 4 + 4]
    backward = [4 + 4, 4 + 2]
    logits = 16 * 1024 * 51200
    f, b = fp32_cross_entropy_time(V1, logits)
    assert f == pytest.approx(
        sum(forward) * logits / BW + len(forward) * KERNEL_OVERHEAD_S
    )
    assert b == pytest.approx(
        sum(backward) * logits / BW + len(backward) * KERNEL_OVERHEAD_S
    )


def test_optimizer_step_and_fused_dropout_bytes() -> None:
    """Megatron's mixed-precision Adam step per parameter: fp16 grad -> fp32 (2 + 4), unscale and
    inf check (4 + 4), clip norm (4), Adam reads w, g, m, v and writes w, m, v (16 + 12), fp32 ->
    fp16 weight (4 + 2)."""
    per_param = (2 + 4) + (4 + 4) + 4 + (16 + 12) + (4 + 2)
    assert optimizer_step_time(V1, 1e9) == pytest.approx(per_param * 1e9 / BW)
    assert optimizer_step_time(V1, 1e9, "adam_fp32") == pytest.approx(28e9 / BW)
    with pytest.raises(MeshplanError):
        optimizer_step_time(V1, 1e9, "lamb")
    f, b = fused_dropout_time(V1, 1e6, "float16")
    assert f == pytest.approx(1e6 / BW)  # the 1-byte mask
    assert b == pytest.approx(
        5e6 / BW + KERNEL_OVERHEAD_S
    )  # read grad + mask, write grad


def test_a_measured_device_prices_memory_at_its_fitted_efficiency() -> None:
    from cost_models.compute import (
        DEVICE_MEMORY_EFFICIENCY,
        OPTIMIZER_STEP_BYTES,
        memory_efficiency,
    )

    h200 = Cluster.from_spec("1x1xH200-141GB")
    fitted = DEVICE_MEMORY_EFFICIENCY["H200-141GB"]
    assert 0 < fitted < 1 and memory_efficiency("A100-80GB") == MEMORY_EFFICIENCY
    bandwidth = h200.device.memory_bandwidth_bytes_per_s
    nbytes = 1e9
    assert op_time(h200, 0.0, nbytes, "bfloat16") == pytest.approx(
        nbytes / (bandwidth * fitted)
    )
    # the optimizer step is memory-bound too
    assert optimizer_step_time(h200, 1e6, "adam_16bit") == pytest.approx(
        OPTIMIZER_STEP_BYTES["adam_16bit"] * 1e6 / (bandwidth * fitted)
    )


def test_fused_attention_runs_the_head_dimension_its_kernel_pads_to() -> None:
    from cost_models.compute import FUSED_ATTENTION_E, fused_attention_time

    h200 = Cluster.from_spec("1x1xH200-141GB")
    e = FUSED_ATTENTION_E["H200-141GB"]
    peak = h200.device.peak("bfloat16")
    flops = 1e12
    for head, padded in ((64, 64), (80, 96), (96, 96), (100, 128), (128, 128)):
        got = fused_attention_time(h200, flops, 1.0, "bfloat16", head, kernels=3)
        want = flops * padded / head / (peak * e) + 3 * KERNEL_OVERHEAD_S
        assert got == pytest.approx(want), head
    # memory-bound when it moves far more than it computes
    slow = fused_attention_time(h200, 1.0, 1e12, "bfloat16", 64)
    assert slow == pytest.approx(op_time(h200, 0.0, 1e12, "bfloat16"))
    # no measured kernels (A100), or a profile: priced as a product instead
    a100 = Cluster.from_spec("1x1xA100-80GB")
    assert fused_attention_time(a100, flops, 1.0, "bfloat16", 64) is None
    profiled = Cluster.from_spec("1x1xH200-141GB", cpu_profile([]))
    assert fused_attention_time(profiled, flops, 1.0, "bfloat16", 64) is None


def test_the_planner_prices_sdpa_by_the_fused_attention_formula() -> None:
    from cost_models.communication import LogicalMesh
    from cost_models.compute import fused_attention_time
    from planner.intra.prices import Option, StageSettings, compute_time, forward_time
    from planner.models import build_model
    from planner.tracing.tracer import trace
    from planner.vocab.strategy import Strategy

    model, batch = build_model(
        "gpt:hidden=64,layers=1,heads=2,seq=32,vocab=64", device="meta"
    )
    graph = trace(model, batch)
    (node,) = [n for n in graph.nodes if "scaled_dot_product" in n.target]
    opt = Option(Strategy(tuple(("R", "R") for _ in node.outputs), (), "test"))
    for device, fused in (("H200-141GB", True), ("A100-80GB", False)):
        cluster = Cluster.from_spec(f"1x1x{device}")
        s = StageSettings(LogicalMesh(cluster, (1, 1), (1, 1)))
        nbytes = node.bytes_read + node.bytes_written
        want = fused_attention_time(
            cluster,
            node.fwd_flops + node.bwd_flops,
            3 * nbytes,
            node.outputs[0].dtype,
            32,
            kernels=3,
        )
        assert (want is not None) == fused
        if fused:
            assert compute_time(node, opt, s) == pytest.approx(want)
            assert forward_time(node, opt, s) == pytest.approx(
                fused_attention_time(
                    cluster,
                    node.fwd_flops,
                    nbytes,
                    node.outputs[0].dtype,
                    32,
                    kernels=1,
                )
            )
