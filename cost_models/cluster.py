"""The cluster: devices, hosts x devices per host, and the links inside and between hosts.

A cluster is named by a spec string ``HOSTSxDEVICESxDEVICE`` (``8x8xV100-16GB``: 8 hosts of 8 V100s)
or built from a measured profile (``Cluster.from_profile``). Units everywhere: seconds, bytes,
bytes per second, FLOP/s.

Link convention: ``LinkSpec.bandwidth_bytes_per_s`` is what ONE device can send in one direction
while every device of its host communicates at the same time (the SPMD case: a collective on one axis
of a logical mesh runs on every group of that axis at once). Inside a host that is the device's own
NVLink bandwidth; between hosts it is the device's share of the host's network cards
(``host NIC bandwidth / GPUs per host``). ``latency_s`` is the per-step latency (alpha) of one ring
step, so a ring all-gather over n devices pays ``(n - 1) * latency_s``.

Presets use published peak figures (sources next to each); they are upper bounds, which
`cost_models.compute` discounts with a shape-dependent efficiency. A measured profile replaces them
with what was actually achieved.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cost_models.errors import MeshplanError

if TYPE_CHECKING:
    from cost_models.profile import DeviceProfile

#: The dtypes every DeviceSpec prices (names as in ``torch.float32`` without the prefix).
DTYPES = ("float32", "tfloat32", "float16", "bfloat16")

_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "f32": "float32",
    "tf32": "tfloat32",
    "half": "float16",
    "fp16": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
}

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "tfloat32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def canonical_dtype(dtype: object) -> str:
    """The dtype's name as used in peak-FLOP tables: ``torch.float16``, ``"half"``, ``"fp16"`` -> ``"float16"``."""
    name = str(dtype).strip().lower()
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype`` (4 for unknown names)."""
    return _DTYPE_BYTES.get(canonical_dtype(dtype), 4)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process): peak FLOP/s per dtype, memory and memory bandwidth."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float

    def __hash__(self) -> int:
        return hash(
            (self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes)
        )

    def peak(self, dtype: object) -> float:
        """Peak FLOP/s in ``dtype``. Dtypes without an entry (float64, integers) use float32's."""
        name = canonical_dtype(dtype)
        if name in self.peak_flops:
            return float(self.peak_flops[name])
        return float(self.peak_flops["float32"])

    def to_json(self) -> dict[str, Any]:
        """``{name, memory_bytes, memory_bandwidth_bytes_per_s, peak_flops}``."""
        return {
            "name": self.name,
            "memory_bytes": int(self.memory_bytes),
            "memory_bandwidth_bytes_per_s": float(self.memory_bandwidth_bytes_per_s),
            "peak_flops": {k: float(v) for k, v in self.peak_flops.items()},
        }


@dataclass(frozen=True)
class LinkSpec:
    """A link as one device sees it: bandwidth per device and direction, latency per message/step."""

    bandwidth_bytes_per_s: float
    latency_s: float

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / self.bandwidth_bytes_per_s

    @property
    def alpha(self) -> float:
        """Seconds per message or ring step (the latency)."""
        return self.latency_s

    def to_json(self) -> dict[str, float]:
        return {
            "bandwidth_bytes_per_s": float(self.bandwidth_bytes_per_s),
            "latency_s": float(self.latency_s),
        }


@dataclass(frozen=True)
class Preset:
    """A published machine: its device, the link inside a host and the per-device inter-host share."""

    device: DeviceSpec
    intra_host_link: LinkSpec
    inter_host_link: LinkSpec
    gpus_per_host: int  # of the real machine the figures come from
    machine: str
    #: NVLinks between each pair of GPUs of a host (``nvidia-smi topo -m``'s NV#), for machines whose
    #: GPUs are not all connected through a switch; None: every GPU reaches every other at full rate.
    nvlinks: tuple[tuple[int, ...], ...] | None = None


_GiB = 1 << 30
_GB = 1e9
_T = 1e12

# Per-step latencies: NCCL's own tuning model (src/graph/tuning.cc, hwLat, Ring/Simple protocol)
# charges 3.4 us per ring step over NVLink and 9.6 us per step over the network (InfiniBand with
# GPUDirect RDMA). Plain TCP sockets over Ethernet (p3.16xlarge has no EFA) go through the kernel's
# network stack; 30 us is our estimate for that, not a measured figure.
_NVLINK_LAT = 3.4e-6
_IB_LAT = 9.6e-6
_TCP_LAT = 30e-6


def _dgx(
    name: str,
    tflops: tuple[float, float, float],
    memory_gib: int,
    bandwidth_gb_s: float,
    nvlink_gb_s: float,
    nic_gbit_s: float,
    machine: str,
) -> Preset:
    """A DGX host of 8 GPUs behind NVSwitch, one InfiniBand NIC per GPU: ``tflops`` = dense
    (float32, tfloat32, float16 = bfloat16) TFLOP/s; memory in GiB and its bandwidth in GB/s;
    NVLink GB/s per GPU per direction; the NIC's Gbit/s."""
    fp32, tf32, half = tflops
    return Preset(
        device=DeviceSpec(
            name=name,
            peak_flops={
                "float32": fp32 * _T,
                "tfloat32": tf32 * _T,
                "float16": half * _T,
                "bfloat16": half * _T,
            },
            memory_bytes=memory_gib * _GiB,
            memory_bandwidth_bytes_per_s=bandwidth_gb_s * _GB,
        ),
        intra_host_link=LinkSpec(nvlink_gb_s * _GB, _NVLINK_LAT),
        inter_host_link=LinkSpec(nic_gbit_s * 1e9 / 8, _IB_LAT),
        gpus_per_host=8,
        machine=machine,
    )


_A100 = (19.5, 156, 312)
_HOPPER = (66.9, 494.7, 989.4)


PRESETS: dict[str, Preset] = {
    # AWS p3.16xlarge, 8 x V100-SXM2 16 GB (the hardware of Alpa's OSDI'22 measurements).
    # NVIDIA V100 datasheet: 125 TFLOP/s fp16 tensor core, 15.7 TFLOP/s fp32, 900 GB/s HBM2, 16 GB.
    # V100 has neither TF32 nor bf16 tensor cores: we price tfloat32 and bfloat16 at the fp32 rate.
    # NVLink 2.0: 6 links x 25 GB/s per direction = 150 GB/s per GPU per direction (the datasheet's
    # "300 GB/s" counts both directions). The hybrid cube-mesh does not connect every GPU pair, but
    # NCCL builds its rings so that every GPU drives all six links, so 150 GB/s is the per-GPU ring
    # bandwidth this topology can reach (measured bus bandwidth is somewhat lower; a profile says how
    # much). Between hosts: 25 Gbps Ethernet per instance (AWS p3 instance page) = 3.125 GB/s shared
    # by 8 GPUs -> 0.39 GB/s per GPU.
    "V100-16GB": Preset(
        device=DeviceSpec(
            name="V100-16GB",
            peak_flops={
                "float32": 15.7 * _T,
                "tfloat32": 15.7 * _T,
                "float16": 125 * _T,
                "bfloat16": 15.7 * _T,
            },
            memory_bytes=16 * _GiB,
            memory_bandwidth_bytes_per_s=900 * _GB,
        ),
        intra_host_link=LinkSpec(150 * _GB, _NVLINK_LAT),
        inter_host_link=LinkSpec(25e9 / 8 / 8, _TCP_LAT),
        gpus_per_host=8,
        machine="AWS p3.16xlarge",
        # Hybrid cube-mesh of an 8-GPU V100 NVLink server (p3.16xlarge, DGX-1V): `nvidia-smi topo -m`
        # shows NV1 / NV2 (one or two bonded links) between these pairs and none (SYS) elsewhere;
        # every GPU has 6 links (the 150 GB/s above). See `Cluster.group_link`.
        nvlinks=(
            (0, 1, 1, 2, 2, 0, 0, 0),
            (1, 0, 2, 1, 0, 2, 0, 0),
            (1, 2, 0, 2, 0, 0, 1, 0),
            (2, 1, 2, 0, 0, 0, 0, 1),
            (2, 0, 0, 0, 0, 1, 1, 2),
            (0, 2, 0, 0, 1, 0, 2, 1),
            (0, 0, 1, 0, 1, 2, 0, 2),
            (0, 0, 0, 1, 2, 1, 2, 0),
        ),
    ),
    # DGX A100, 8 x A100-SXM4. NVIDIA A100 datasheet / Ampere whitepaper: 19.5 TFLOP/s fp32,
    # 156 TFLOP/s TF32, 312 TFLOP/s fp16 and bf16 tensor core (dense); 40 GB HBM2 at 1555 GB/s,
    # 80 GB HBM2e at 2039 GB/s. NVLink 3: 12 links x 25 GB/s = 300 GB/s per GPU per direction, all
    # GPUs through NVSwitch. Between hosts: 8 x Mellanox HDR 200 Gb/s InfiniBand per DGX A100 (one per
    # GPU) = 25 GB/s per GPU.
    "A100-40GB": _dgx(
        "A100-40GB", _A100, 40, 1555, 300, 200, "NVIDIA DGX A100 (40 GB)"
    ),
    "A100-80GB": _dgx(
        "A100-80GB", _A100, 80, 2039, 300, 200, "NVIDIA DGX A100 (80 GB)"
    ),
    # DGX H100, 8 x H100-SXM5 80 GB. NVIDIA H100 whitepaper (SXM5, dense, i.e. half the "with
    # sparsity" datasheet figures): 66.9 TFLOP/s fp32, 494.7 TFLOP/s TF32, 989.4 TFLOP/s fp16/bf16;
    # 80 GB HBM3 at 3.35 TB/s. NVLink 4: 18 links x 25 GB/s = 450 GB/s per GPU per direction through
    # NVSwitch. Between hosts: 8 x ConnectX-7 NDR 400 Gb/s InfiniBand (one per GPU) = 50 GB/s per GPU.
    "H100-80GB": _dgx("H100-80GB", _HOPPER, 80, 3350, 450, 400, "NVIDIA DGX H100"),
    # DGX H200, 8 x H200-SXM 141 GB: the H100's chip (GH100, 132 SMs, the same clocks and so the
    # same FLOP/s; NVIDIA H200 datasheet) with 141 GB of HBM3e at 4.8 TB/s, and the DGX H100's
    # NVLink 4 switches and ConnectX-7 NICs.
    "H200-141GB": _dgx("H200-141GB", _HOPPER, 141, 4800, 450, 400, "NVIDIA DGX H200"),
}

#: The device name for "the local CPU, as described by a measured profile".
CPU = "CPU"

DEVICE_NAMES = (*PRESETS, CPU)

_SPEC_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\S.*?)\s*$")


def _spec_error(spec: str, reason: str) -> MeshplanError:
    return MeshplanError(
        f"cluster spec {spec!r}: {reason}; expected HOSTSxDEVICESxDEVICE with positive counts "
        f"(e.g. 8x8xV100-16GB), DEVICE one of {', '.join(DEVICE_NAMES)} (CPU needs --profile)"
    )


def _lookup_device(name: str) -> str | None:
    for known in DEVICE_NAMES:
        if known.lower() == name.lower():
            return known
    return None


def _link_from_profile(profile: DeviceProfile) -> LinkSpec | None:
    """A per-device ring link from the profile's fits: send_recv directly, else derived from a ring fit.

    send_recv: ``t = alpha + beta * B`` is one message, so latency = alpha, bandwidth = 1 / beta.
    all_reduce over n ranks: ``t = 2(n-1) a + 2(n-1)/n * B * b`` (ring), so a = alpha / (2(n-1)) and
    b = beta * n / (2(n-1)); all_gather / reduce_scatter likewise with (n - 1) steps.
    """
    fits = {(f.op, f.world_size): f for f in profile.collectives if f.world_size >= 2}

    def make(alpha: float, beta: float) -> LinkSpec:
        return LinkSpec(1.0 / max(beta, 1e-18), max(alpha, 0.0))

    send = [f for (op, _), f in sorted(fits.items()) if op == "send_recv"]
    if send:
        return make(send[0].alpha_s, send[0].beta_s_per_byte)
    for op, steps_per_rank in (
        ("all_reduce", 2),
        ("all_gather", 1),
        ("reduce_scatter", 1),
    ):
        ring = [f for (o, _), f in sorted(fits.items()) if o == op]
        if ring:
            f = ring[-1]  # the largest world size measured
            n = f.world_size
            steps = steps_per_rank * (n - 1)
            return make(f.alpha_s / steps, f.beta_s_per_byte * n / steps)
    return None


@dataclass(frozen=True)
class Cluster:
    """``hosts`` x ``devices_per_host`` identical devices with an intra-host and an inter-host link.

    ``profile`` (a ``cost_models.profile.DeviceProfile``) is optional; when present, compute and
    communication costs use its measurements where they apply.
    """

    hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host_link: LinkSpec
    inter_host_link: LinkSpec
    spec: str
    profile: DeviceProfile | None = field(default=None, hash=False, repr=False)
    nvlinks: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise MeshplanError(
                f"a cluster needs at least one host and one device per host, got {self.hosts}x{self.devices_per_host}"
            )

    @property
    def num_devices(self) -> int:
        """``hosts * devices_per_host``."""
        return self.hosts * self.devices_per_host

    @property
    def shape(self) -> tuple[int, int]:
        """The physical mesh ``(hosts, devices_per_host)``."""
        return (self.hosts, self.devices_per_host)

    def link(self, crosses_hosts: bool) -> LinkSpec:
        """The inter-host link if ``crosses_hosts`` else the intra-host one."""
        return self.inter_host_link if crosses_hosts else self.intra_host_link

    def group_link(self, size: int, stride: int = 1) -> LinkSpec:
        """The link of a ring collective among ``size`` GPUs of one host, ``stride`` apart.

        Without a link matrix (``nvlinks``; NVSwitch machines, profiles) every group gets
        ``intra_host_link``. With one, the mesh axis's groups are the aligned sets
        ``{base + j + i * stride}``; NCCL runs one ring per free link (a ring uses one direction
        of a link on each hop), so a GPU can send at ``(its links to the rest of its group) x
        per-link bandwidth``, per-link = ``intra_host_link`` / the most links any GPU has (150 / 6 =
        25 GB/s on V100). The group's rate is its worst member's, the axis's its worst group's
        (the slowest group sets the pace; the planner does not know where a submesh is placed).
        On a p3.16xlarge: 2 GPUs side by side 25 GB/s (GPUs 0 and 1 share one NVLink), 4 GPUs
        (a fully connected quad) 100 GB/s, all 8 150 GB/s. An upper bound: it assumes the
        link-disjoint rings exist (they do for these groups) and every link runs at full rate.
        """
        if (
            self.nvlinks is None
            or self.profile is not None
            or size <= 1
            or size * stride > min(self.devices_per_host, len(self.nvlinks))
        ):
            return self.intra_host_link
        bandwidth = _group_bandwidth(
            self.nvlinks,
            self.devices_per_host,
            self.intra_host_link.bandwidth_bytes_per_s,
            size,
            stride,
        )
        return LinkSpec(bandwidth, self.intra_host_link.latency_s)

    @classmethod
    def from_spec(cls, spec: str, profile: DeviceProfile | None = None) -> Cluster:
        """Parse ``HOSTSxDEVICESxDEVICE`` (e.g. ``8x8xV100-16GB``, ``1x4xCPU``).

        A preset device keeps its published figures and carries ``profile`` (if given) for the cost
        models to use where it applies. ``CPU`` is the local CPU and needs ``profile``: it is
        ``Cluster.from_profile(profile, hosts, devices_per_host)``.
        """
        if not isinstance(spec, str):
            raise _spec_error(str(spec), "not a string")
        m = _SPEC_RE.match(spec)
        if m is None:
            raise _spec_error(spec, "malformed")
        hosts, per_host, raw_name = int(m.group(1)), int(m.group(2)), m.group(3)
        if hosts < 1 or per_host < 1:
            raise _spec_error(spec, "host and device counts must be at least 1")
        name = _lookup_device(raw_name)
        if name is None:
            raise _spec_error(spec, f"unknown device {raw_name!r}")
        canonical = f"{hosts}x{per_host}x{name}"
        if name == CPU:
            if profile is None:
                raise MeshplanError(
                    f"cluster spec {spec!r}: device CPU is described by a measured profile; pass --profile FILE "
                    "(written by `meshplan profile`)"
                )
            return cls.from_profile(profile, hosts=hosts, devices_per_host=per_host)
        p = PRESETS[name]
        return cls(
            hosts,
            per_host,
            p.device,
            p.intra_host_link,
            p.inter_host_link,
            canonical,
            profile,
            p.nvlinks,
        )

    @classmethod
    def from_profile(
        cls,
        profile: DeviceProfile,
        hosts: int | None = None,
        devices_per_host: int | None = None,
    ) -> Cluster:
        """A cluster of the profiled device: measured peaks, memory, bandwidth and links.

        Peaks: the profile's best measured FLOP/s per dtype; a dtype it did not measure uses float32's
        (tfloat32 on a CPU is float32). Links: from the fitted send_recv line, else derived from the
        ring all_reduce / all_gather / reduce_scatter fits (see ``_link_from_profile``). A profile
        measures one kind of connection, so both links get its figures. Counts default to the
        profile's own ``hosts`` and ``devices_per_host``.
        """
        hosts = profile.hosts if hosts is None else hosts
        per_host = (
            profile.devices_per_host if devices_per_host is None else devices_per_host
        )
        if hosts < 1 or per_host < 1:
            raise MeshplanError(
                f"cluster from profile: counts must be at least 1, got {hosts}x{per_host}"
            )
        peaks = {
            canonical_dtype(k): float(v) for k, v in profile.peak_flops.items() if v > 0
        }
        if not peaks:
            raise MeshplanError(
                f"profile of {profile.device_name!r} has no measured peak FLOP/s"
            )
        base = peaks.get("float32", max(peaks.values()))
        for dtype in DTYPES:
            peaks.setdefault(dtype, base)
        device = DeviceSpec(
            name=profile.device_name,
            peak_flops=peaks,
            memory_bytes=int(profile.memory_bytes),
            memory_bandwidth_bytes_per_s=float(profile.memory_bandwidth_bytes_per_s),
        )
        link = _link_from_profile(profile)
        if link is None:
            if hosts * per_host > 1:
                raise MeshplanError(
                    f"profile of {profile.device_name!r} measured no collectives; cannot price communication "
                    f"between {hosts * per_host} devices (re-run `meshplan profile` with several processes)"
                )
            link = LinkSpec(
                device.memory_bandwidth_bytes_per_s, 0.0
            )  # never used by one device
        is_cpu = profile.backend.lower() == "gloo"
        spec = f"{hosts}x{per_host}x{CPU if is_cpu else profile.device_name}"
        return cls(hosts, per_host, device, link, link, spec, profile)

    def with_shape(self, hosts: int, devices_per_host: int) -> Cluster:
        """The same machines, ``hosts`` x ``devices_per_host`` of them (spec string updated)."""
        name = (
            self.spec.split("x", 2)[2]
            if self.spec.count("x") >= 2
            else self.device.name
        )
        return Cluster(
            hosts,
            devices_per_host,
            self.device,
            self.intra_host_link,
            self.inter_host_link,
            f"{hosts}x{devices_per_host}x{name}",
            self.profile,
            self.nvlinks,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description (``from_json`` reads it back; the profile itself is summarised only)."""
        out: dict[str, Any] = {
            "spec": self.spec,
            "num_devices": self.num_devices,
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "device": self.device.to_json(),
            "intra_host_link": self.intra_host_link.to_json(),
            "inter_host_link": self.inter_host_link.to_json(),
            "profile": None,
        }
        if self.nvlinks is not None:
            out["nvlinks"] = [list(row) for row in self.nvlinks]
        if self.profile is not None:
            p = self.profile
            out["profile"] = {
                "device_name": p.device_name,
                "backend": p.backend,
                "hosts": p.hosts,
                "devices_per_host": p.devices_per_host,
                "matmul_samples": len(p.matmul),
                "collectives": sorted(
                    {f"{f.op}@{f.world_size}" for f in p.collectives}
                ),
            }
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cluster:
        """Rebuild a cluster from ``to_json()`` (figures as written; without the profile)."""
        try:
            d = data["device"]
            device = DeviceSpec(
                name=str(d["name"]),
                peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
                memory_bytes=int(d["memory_bytes"]),
                memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
            )
            links = [
                LinkSpec(
                    float(data[k]["bandwidth_bytes_per_s"]), float(data[k]["latency_s"])
                )
                for k in ("intra_host_link", "inter_host_link")
            ]
            return cls(
                int(data["hosts"]),
                int(data["devices_per_host"]),
                device,
                *links,
                str(data["spec"]),
                None,
                tuple(tuple(int(x) for x in row) for row in data["nvlinks"])
                if data.get("nvlinks")
                else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MeshplanError(
                f"cluster JSON is missing or has a bad field ({exc})"
            ) from None


@functools.cache
def _group_bandwidth(
    nvlinks: tuple[tuple[int, ...], ...],
    per_host: int,
    full: float,
    size: int,
    stride: int,
) -> float:
    """Per-GPU ring bandwidth of the worst group of ``size`` GPUs ``stride`` apart (``group_link``)."""
    per_link = full / max(sum(row) for row in nvlinks)
    worst = None
    for base in range(0, per_host - size * stride + 1, size * stride):
        for j in range(stride):
            group = [base + j + i * stride for i in range(size)]
            links = min(sum(nvlinks[d][e] for e in group if e != d) for d in group)
            worst = links if worst is None else min(worst, links)
    # A group with no NVLink between some members still rings through a neighbour: one link.
    return max(worst or 0, 1) * per_link
