"""Cluster specs, presets, profiles and the `meshplan cluster` command."""

from __future__ import annotations

import json

import pytest

import cost_models.profile as profile_mod
from cost_models import Cluster, MeshplanError
from cost_models.cluster import (
    DEVICE_NAMES,
    DTYPES,
    PRESETS,
    canonical_dtype,
    dtype_bytes,
)


def make_profile(**overrides):
    """A small CPU profile: 4 gloo processes on one host."""
    fits = [
        profile_mod.CollectiveFit("all_reduce", 4, 6 * 20e-6, 6 / 4 * 1e-9),
        profile_mod.CollectiveFit("send_recv", 2, 20e-6, 1e-9),
    ]
    fields = {
        "version": 1,
        "device_name": "Test CPU",
        "backend": "gloo",
        "hosts": 1,
        "devices_per_host": 4,
        "memory_bytes": 8 << 30,
        "memory_bandwidth_bytes_per_s": 10e9,
        "peak_flops": {"float32": 50e9, "bfloat16": 20e9},
        "matmul": [],
        "collectives": fits,
        "created": "2025-01-01T00:00:00+00:00",
        "host": "testhost",
    }
    fields.update(overrides)
    return profile_mod.DeviceProfile(**fields)


def test_v100_preset_matches_published_figures():
    c = Cluster.from_spec("8x8xV100-16GB")
    assert (c.hosts, c.devices_per_host, c.num_devices) == (8, 8, 64)
    assert c.spec == "8x8xV100-16GB"
    assert c.device.peak("float16") == 125e12
    assert c.device.peak("float32") == 15.7e12
    assert c.device.memory_bytes == 16 * 2**30
    assert c.device.memory_bandwidth_bytes_per_s == 900e9
    assert c.intra_host_link.bandwidth_bytes_per_s == 150e9
    # 25 Gbps per host shared by 8 GPUs
    assert c.inter_host_link.bandwidth_bytes_per_s == pytest.approx(25e9 / 8 / 8)


@pytest.mark.parametrize(
    "name, fp16, intra, inter",
    [
        ("A100-40GB", 312e12, 300e9, 25e9),
        ("A100-80GB", 312e12, 300e9, 25e9),
        ("H100-80GB", 989.4e12, 450e9, 50e9),
        ("H200-141GB", 989.4e12, 450e9, 50e9),
    ],
)
def test_dgx_presets(name, fp16, intra, inter):
    c = Cluster.from_spec(f"2x8x{name}")
    assert c.device.peak("bfloat16") == fp16
    assert c.intra_host_link.bandwidth_bytes_per_s == intra
    assert c.inter_host_link.bandwidth_bytes_per_s == inter
    assert c.inter_host_link.latency_s > c.intra_host_link.latency_s
    assert set(DTYPES) <= set(c.device.peak_flops)


def test_every_preset_prices_every_dtype_and_is_sane():
    for name, p in PRESETS.items():
        assert p.device.name == name
        assert all(p.device.peak(dt) > 0 for dt in DTYPES)
        assert (
            p.inter_host_link.bandwidth_bytes_per_s
            < p.intra_host_link.bandwidth_bytes_per_s
        )


def test_spec_is_case_insensitive_and_canonicalised():
    c = Cluster.from_spec(" 1X4xa100-80gb ")
    assert c.spec == "1x4xA100-80GB"
    assert c.device.name == "A100-80GB"


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "8x8",
        "8x8x",
        "x8xV100-16GB",
        "0x8xV100-16GB",
        "8x0xV100-16GB",
        "-1x8xV100-16GB",
        "8x-8xV100-16GB",
        "2.5x8xV100-16GB",
        "8*8*V100-16GB",
        "8x8xTPU-v4",
        "8x8xV100",
        "1x4xCPU",  # CPU without a profile
    ],
)
def test_malformed_spec_raises_one_line_error(spec):
    with pytest.raises(MeshplanError) as info:
        Cluster.from_spec(spec)
    msg = str(info.value)
    assert "\n" not in msg
    if spec != "1x4xCPU":
        assert "HOSTSxDEVICESxDEVICE" in msg
        for name in DEVICE_NAMES:
            assert name in msg
    else:
        assert "--profile" in msg


def test_dtype_names():
    assert canonical_dtype("torch.float16") == "float16"
    assert canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype("half") == "float16"
    assert dtype_bytes("torch.bfloat16") == 2
    assert dtype_bytes("float32") == 4
    c = Cluster.from_spec("1x1xA100-40GB")
    assert c.device.peak("torch.int64") == c.device.peak("float32")


def test_to_json_and_back():
    c = Cluster.from_spec("4x8xA100-40GB")
    data = json.loads(json.dumps(c.to_json()))
    assert data["num_devices"] == 32
    assert (
        data["hosts"] == 4
        and data["devices_per_host"] == 8
        and data["spec"] == "4x8xA100-40GB"
    )
    assert data["device"]["name"] == "A100-40GB"
    assert data["device"]["memory_bytes"] == 40 * 2**30
    assert data["device"]["peak_flops"]["tfloat32"] == 156e12
    assert data["device"]["memory_bandwidth_bytes_per_s"] == 1555e9
    assert data["intra_host_link"] == {
        "bandwidth_bytes_per_s": 300e9,
        "latency_s": c.intra_host_link.latency_s,
    }
    assert "inter_host_link" in data
    assert Cluster.from_json(data) == c
    with pytest.raises(MeshplanError):
        Cluster.from_json({"hosts": 1})


def test_cluster_is_hashable_and_reshapable():
    c = Cluster.from_spec("4x8xV100-16GB")
    assert hash(c) == hash(Cluster.from_spec("4x8xV100-16GB"))
    small = c.with_shape(1, 4)
    assert small.spec == "1x4xV100-16GB" and small.num_devices == 4
    assert (
        small.link(True) is small.inter_host_link
        and small.link(False) is small.intra_host_link
    )


def test_from_profile_uses_measurements():
    p = make_profile()
    c = Cluster.from_profile(p)
    assert c.spec == "1x4xCPU" and c.num_devices == 4
    assert c.device.name == "Test CPU"
    assert c.device.peak("float32") == 50e9
    assert c.device.peak("bfloat16") == 20e9
    assert c.device.peak("tfloat32") == 50e9  # not measured: float32's
    assert c.device.memory_bandwidth_bytes_per_s == 10e9
    # send_recv fit: latency alpha, bandwidth 1 / beta
    assert c.intra_host_link.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert c.intra_host_link.latency_s == pytest.approx(20e-6)
    assert c.inter_host_link == c.intra_host_link
    assert c.profile is p
    # the CPU spec with a profile is the same thing, reshaped
    c2 = Cluster.from_spec("2x2xCPU", profile=p)
    assert (c2.hosts, c2.devices_per_host, c2.spec) == (2, 2, "2x2xCPU")
    assert c2.to_json()["profile"]["backend"] == "gloo"


def test_from_profile_derives_link_from_ring_fit():
    # A ring all-reduce over n ranks with per-step latency a and per-byte cost b takes
    # 2(n-1) a + 2(n-1)/n B b, so the fit's alpha and beta give a = alpha / (2(n-1)), b = beta n / (2(n-1)).
    n, a, b = 4, 15e-6, 2e-9
    fit = profile_mod.CollectiveFit(
        "all_reduce", n, 2 * (n - 1) * a, 2 * (n - 1) / n * b
    )
    c = Cluster.from_profile(make_profile(collectives=[fit]))
    assert c.intra_host_link.latency_s == pytest.approx(a)
    assert c.intra_host_link.bandwidth_bytes_per_s == pytest.approx(1 / b)


def test_from_profile_without_collectives():
    p = make_profile(collectives=[], devices_per_host=1)
    assert Cluster.from_profile(p).num_devices == 1
    with pytest.raises(MeshplanError):
        Cluster.from_profile(p, hosts=1, devices_per_host=2)
    with pytest.raises(MeshplanError):
        Cluster.from_profile(make_profile(peak_flops={}))


def test_preset_keeps_figures_with_profile_attached():
    p = make_profile()
    c = Cluster.from_spec("1x4xV100-16GB", profile=p)
    assert c.device.name == "V100-16GB" and c.profile is p


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_prints_and_writes_json(tmp_path, capsys):
    from runtime.cli import main

    out = tmp_path / "c.json"
    assert main(["cluster", "2x8xV100-16GB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in (
        "16 devices",
        "2 hosts",
        "V100-16GB",
        "125 TFLOP/s",
        "15.7 TFLOP/s",
        "16 GiB",
        "900 GB/s",
        "150 GB/s",
    ):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert (
        data["num_devices"] == 16 and data["device"]["peak_flops"]["float16"] == 125e12
    )


def test_cli_bad_spec_exits_2(capsys):
    from runtime.cli import main

    assert main(["cluster", "8x8xNOPE"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HOSTSxDEVICESxDEVICE" in err


def test_cli_cpu_with_profile(tmp_path, capsys):
    from runtime.cli import main

    path = tmp_path / "p.json"
    profile_mod.save_profile(make_profile(), path)
    assert main(["cluster", "1x4xCPU", "--profile", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Test CPU" in text and "measured profile" in text
    assert main(["cluster", "1x4xCPU"]) == 2
    assert (
        main(["cluster", "1x4xCPU", "--profile", str(tmp_path / "missing.json")]) == 2
    )
