"""Compute cost: roofline with shape-dependent efficiency, and interpolation of measured matmuls."""

from __future__ import annotations

import pytest

from cost_models import Cluster, matmul_efficiency, matmul_time, op_time
from cost_models.compute import FP32_CURVE, MEMORY_EFFICIENCY, TENSOR_CORE_CURVE

profile_mod = pytest.importorskip("cost_models.profile")

V100 = Cluster.from_spec("1x8xV100-16GB")


def cpu_profile(samples):
    return profile_mod.DeviceProfile(
        version=1,
        device_name="Test CPU",
        backend="gloo",
        hosts=1,
        devices_per_host=2,
        memory_bytes=8 << 30,
        memory_bandwidth_bytes_per_s=20e9,
        peak_flops={"float32": 100e9},
        matmul=[
            profile_mod.MatmulSample(m, n, k, "float32", s) for m, n, k, s in samples
        ],
        collectives=[profile_mod.CollectiveFit("send_recv", 2, 1e-5, 1e-9)],
        created="2025-01-01T00:00:00+00:00",
        host="t",
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
