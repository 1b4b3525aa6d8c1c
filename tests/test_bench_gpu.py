"""The parts of `benchmarks.bench_gpu` that need no GPU: the union of kernel intervals, and the
kernel summary's record of matrix products by shape (on the CPU, no device kernels)."""

from __future__ import annotations

import torch

from benchmarks.bench_gpu import _busy_s, kernel_summary


def test_busy_time_is_the_union_of_the_intervals():
    # microseconds: [0, 10] and [5, 20] overlap, [30, 40] apart, [32, 35] inside it
    assert abs(_busy_s([(30, 40), (0, 10), (5, 20), (32, 35)]) - 30e-6) < 1e-12
    assert _busy_s([]) == 0.0


def test_kernel_summary_records_each_product_by_shape():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    bias = torch.zeros(16)

    def step() -> None:
        for _ in range(3):
            a @ b
        torch.addmm(bias, a, b)

    s = kernel_summary(step)
    products = {(p["op"], str(p["shapes"])): p["count"] for p in s["products"]}
    assert products[("aten::mm", str([[64, 32], [32, 16]]))] == 3
    assert products[("aten::addmm", str([[16], [64, 32], [32, 16], [], []]))] == 1
    assert s["wall_s"] > 0
    if not torch.cuda.is_available():
        assert s["kernels"] == 0 and s["busy_s"] == 0.0 and s["by_name"] == []
