"""A small measured CPU profile for tests that need a cluster with a profile attached."""

from __future__ import annotations

from typing import Any

from cost_models.cluster import Cluster
from cost_models.profile import (
    PROFILE_VERSION,
    CollectiveFit,
    DeviceProfile,
    MatmulSample,
)


def cpu_profile(**overrides: Any) -> DeviceProfile:
    """Two gloo processes on one host, one matmul sample and no collective fits, unless
    `overrides` (DeviceProfile fields) say otherwise."""
    fields: dict[str, Any] = {
        "version": PROFILE_VERSION,
        "device_name": "test cpu",
        "backend": "gloo",
        "hosts": 1,
        "devices_per_host": 2,
        "memory_bytes": 1 << 30,
        "memory_bandwidth_bytes_per_s": 1e10,
        "peak_flops": {"float32": 1e11},
        "matmul": [MatmulSample(64, 64, 64, "float32", 1e-5)],
        "collectives": [],
        "created": "2025-01-01T00:00:00+00:00",
        "host": "testhost",
    }
    return DeviceProfile(**(fields | overrides))


def cpu_cluster(devices: int = 4, hosts: int = 1) -> Cluster:
    """`hosts` hosts of `devices` CPU processes each with `cpu_profile`, collectives inside a
    host priced 20 us + 1 ns per byte (across hosts: the link those fits give)."""
    fits = [
        CollectiveFit(op, w, 20e-6, 1e-9)
        for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
        for w in (2, 4, 8, 16)
        if w <= devices
    ]
    return Cluster.from_spec(
        f"{hosts}x{devices}xCPU",
        profile=cpu_profile(devices_per_host=devices, collectives=fits),
    )
