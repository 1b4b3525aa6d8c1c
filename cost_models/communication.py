"""Collectives on one axis of a logical mesh (alpha-beta), and the logical mesh itself.

Byte convention: ``nbytes`` (B) is always the FULL, unsharded tensor of the collective's group:
the all-reduced tensor, the all-gather OUTPUT, the reduce-scatter INPUT, the tensor being
re-sharded by an all-to-all (each of the n ranks holds B / n of it); for send_recv it is the
message. With a link of latency alpha and seconds-per-byte beta, over n devices (ring algorithms)::

    all_gather(B)     = (n - 1) * alpha + (n - 1) / n * B * beta
    reduce_scatter(B) = (n - 1) * alpha + (n - 1) / n * B * beta
    all_reduce(B)     = reduce_scatter(B) + all_gather(B) = 2 (n - 1) alpha + 2 (n - 1) / n * B * beta
    all_to_all(B)     = (n - 1) * alpha + (n - 1) / n^2 * B * beta   (pairwise exchange of B / n^2 blocks)
    send_recv(B)      = alpha + B * beta

An axis of a logical mesh is a ``MeshAxis(size, per_host, hosts)``: ``size = per_host * hosts``
devices, ``per_host`` of them in each of ``hosts`` hosts. Inside one host the host's link prices it;
across hosts with one device per host the inter-host link (each device's share of its host's
NICs); an axis spanning both runs hierarchically, as NCCL does across nodes (m = per_host,
h = hosts)::

    all_gather(B)     = AG_inter(B / m over h) + AG_intra(B over m)
    reduce_scatter(B) = RS_intra(B over m) + RS_inter(B / m over h)
    all_reduce(B)     = RS_intra(B over m) + AR_inter(B / m over h) + AG_intra(B over m)
    all_to_all(B)     = (m - 1)(alpha_i + B / n^2 beta_i) + (n - m)(alpha_e + B / n^2 beta_e)

so all_reduce == reduce_scatter + all_gather holds on every kind of axis. With a measured profile on
the cluster, an axis inside one host whose size matches a fitted (op, world size) uses that fit
(``alpha_s + beta_s_per_byte * bytes``, converting to the profile's byte convention: all_to_all
fits are per rank, B / n).

Logical mesh (Alpa's mapping): a submesh of ``hosts x per_host`` devices numbered host-major,
viewed as ``(a, b)`` with device ``(i, j) = i * b + j``. The second axis is contiguous: if b divides
per_host it stays inside a host; otherwise (per_host divides b) it spans b / per_host whole hosts.
The first axis strides by b: per_host / b devices of it share a host when b < per_host, else one per
host. ``MeshAxis.stride`` records that distance (b for the first axis with several devices per host,
1 otherwise): on hosts whose GPUs are not all switch-connected (V100 NVLink cube-mesh) the link of a
collective inside a host depends on which GPUs form its group (``Cluster.group_link``). A mesh of
three axes ``(a, b, c)`` (device ``i * b * c + j * c + k``) is laid out the same way, axis by axis
from the last: each strides by the product of the sizes after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cost_models.cluster import Cluster, LinkSpec
from cost_models.errors import MeshplanError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def ring_all_gather(nbytes: float, n: int, link: LinkSpec) -> float:
    """``(n - 1) * alpha + (n - 1) / n * B * beta``; 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha + (n - 1) / n * nbytes * link.beta


def ring_reduce_scatter(nbytes: float, n: int, link: LinkSpec) -> float:
    """``(n - 1) * alpha + (n - 1) / n * B * beta`` (B = the full input); 0 for n <= 1."""
    return ring_all_gather(nbytes, n, link)


def ring_all_reduce(nbytes: float, n: int, link: LinkSpec) -> float:
    """Reduce-scatter then all-gather: ``2 (n - 1) alpha + 2 (n - 1) / n * B * beta``."""
    return ring_reduce_scatter(nbytes, n, link) + ring_all_gather(nbytes, n, link)


def pairwise_all_to_all(nbytes: float, n: int, link: LinkSpec) -> float:
    """``(n - 1) * alpha + (n - 1) / n^2 * B * beta``: every rank sends a B / n^2 block to each peer."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.alpha + nbytes / (n * n) * link.beta)


def send_recv(nbytes: float, link: LinkSpec) -> float:
    """One message of ``nbytes``: ``alpha + B * beta``."""
    return link.alpha + nbytes * link.beta


_FLAT = {
    "all_gather": ring_all_gather,
    "reduce_scatter": ring_reduce_scatter,
    "all_reduce": ring_all_reduce,
    "all_to_all": pairwise_all_to_all,
}


@dataclass(frozen=True)
class MeshAxis:
    """One axis of a logical mesh: ``size`` devices, ``per_host`` in each of ``hosts`` hosts."""

    size: int
    per_host: int
    hosts: int
    #: Distance between consecutive devices of a group inside a host (``Cluster.group_link``).
    stride: int = 1

    def __post_init__(self) -> None:
        if (
            self.size != self.per_host * self.hosts
            or self.per_host < 1
            or self.hosts < 1
        ):
            raise MeshplanError(
                f"mesh axis of {self.size} devices cannot be {self.per_host} per host x {self.hosts} hosts"
            )

    @property
    def kind(self) -> str:
        """``"single"`` (one device), ``"intra"`` (inside a host), ``"inter"`` (one device per host) or ``"hierarchical"``."""
        if self.size == 1:
            return "single"
        if self.hosts == 1:
            return "intra"
        return "inter" if self.per_host == 1 else "hierarchical"


def _check(op: str, nbytes: float) -> None:
    if op not in COLLECTIVES:
        raise MeshplanError(
            f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}"
        )
    if nbytes < 0:
        raise MeshplanError(f"{op}: negative size {nbytes} bytes")


def collective_time(cluster: Cluster, op: str, nbytes: float, axis: MeshAxis) -> float:
    """Seconds for collective ``op`` of ``nbytes`` (module byte convention) along ``axis`` of ``cluster``."""
    _check(op, nbytes)
    n = axis.size
    if n == 1 or nbytes == 0:
        return 0.0
    intra, inter = (
        cluster.group_link(axis.per_host, axis.stride),
        cluster.inter_host_link,
    )
    if op == "send_recv":
        return send_recv(nbytes, inter if axis.hosts > 1 else intra)
    if axis.hosts == 1 and cluster.profile is not None:
        fit = cluster.profile.collective(op, n)
        if fit is not None:
            return fit.predict(nbytes / n if op == "all_to_all" else nbytes)
    if axis.hosts == 1:
        return _FLAT[op](nbytes, n, intra)
    if axis.per_host == 1:
        return _FLAT[op](nbytes, n, inter)
    m, h = axis.per_host, axis.hosts
    if op == "all_gather":
        return ring_all_gather(nbytes / m, h, inter) + ring_all_gather(nbytes, m, intra)
    if op == "reduce_scatter":
        return ring_reduce_scatter(nbytes, m, intra) + ring_reduce_scatter(
            nbytes / m, h, inter
        )
    if op == "all_reduce":
        return (
            ring_reduce_scatter(nbytes, m, intra)
            + ring_all_reduce(nbytes / m, h, inter)
            + ring_all_gather(nbytes, m, intra)
        )
    block = nbytes / (n * n)  # all_to_all
    return (m - 1) * (intra.alpha + block * intra.beta) + (n - m) * (
        inter.alpha + block * inter.beta
    )


def all_reduce_time(cluster: Cluster, nbytes: float, axis: MeshAxis) -> float:
    """``collective_time(cluster, "all_reduce", nbytes, axis)``."""
    return collective_time(cluster, "all_reduce", nbytes, axis)


def all_gather_time(cluster: Cluster, nbytes: float, axis: MeshAxis) -> float:
    """``collective_time(cluster, "all_gather", nbytes, axis)`` (nbytes = gathered output)."""
    return collective_time(cluster, "all_gather", nbytes, axis)


def reduce_scatter_time(cluster: Cluster, nbytes: float, axis: MeshAxis) -> float:
    """``collective_time(cluster, "reduce_scatter", nbytes, axis)`` (nbytes = full input)."""
    return collective_time(cluster, "reduce_scatter", nbytes, axis)


def all_to_all_time(cluster: Cluster, nbytes: float, axis: MeshAxis) -> float:
    """``collective_time(cluster, "all_to_all", nbytes, axis)`` (nbytes = full tensor)."""
    return collective_time(cluster, "all_to_all", nbytes, axis)


def p2p_time(
    cluster: Cluster,
    nbytes: float,
    *,
    crosses_hosts: bool,
    senders_per_host: int | None = None,
) -> float:
    """One point-to-point message (e.g. activations between pipeline stages): ``alpha + B * beta``.

    Between hosts the link is a device's share of its host's network (module `cost_models.cluster`:
    NIC bandwidth / devices per host, every device sending at once). When only
    `senders_per_host` of a host's devices send at once (a pipeline stage on part of a host),
    each gets NIC bandwidth / senders_per_host: the share scaled by devices per host /
    senders_per_host. Default: every device of the host sends."""
    link = cluster.link(crosses_hosts)
    if crosses_hosts and senders_per_host is not None:
        M = cluster.devices_per_host
        if not 1 <= senders_per_host <= M:
            raise ValueError(
                f"senders_per_host must be in 1..{M}, got {senders_per_host}"
            )
        link = LinkSpec(
            link.bandwidth_bytes_per_s * M / senders_per_host, link.latency_s
        )
    return send_recv(nbytes, link)


def boundary_send_times(
    cluster: Cluster,
    nbytes: Sequence[float],
    senders: Sequence[int],
    crosses_hosts: Sequence[bool],
    senders_per_host: Sequence[int | None] | None = None,
    grad_nbytes: Sequence[float] | None = None,
) -> list[float]:
    """Round trip of one micro-batch's boundary values from pipeline stage i to stage i + 1: the
    activations forward, ``nbytes[i]`` bytes in full, and their gradients back,
    ``grad_nbytes[i]`` (default ``nbytes[i]``; values that need no gradient, rotary tables say,
    get none), each device of stage i sending its ``1 / senders[i]`` share in parallel
    (`p2p_time`), over the inter-host link when ``crosses_hosts[i]``, with
    ``senders_per_host[i]`` of a host's devices sharing its network (None: all of them). 0 where
    nothing crosses. The stage DP prices its candidate boundaries and a finished plan its actual
    ones with this one function."""
    per_host = senders_per_host or [None] * len(nbytes)
    grads = nbytes if grad_nbytes is None else grad_nbytes
    return [
        sum(
            p2p_time(cluster, x / n, crosses_hosts=c, senders_per_host=h)
            for x in (b, g)
            if x > 0
        )
        for b, g, n, c, h in zip(nbytes, grads, senders, crosses_hosts, per_host)
    ]


def _axis_layout(
    hosts: int, per_host: int, shape: Sequence[int]
) -> tuple[MeshAxis, ...]:
    """Each axis of the logical mesh `shape` (row-major over the submesh's devices, numbered
    host-major): axis i strides by the product of the later axes' sizes. An axis whose stride is
    a multiple of `per_host` has one device per host; otherwise the stride divides `per_host` and
    ``per_host / stride`` of its devices share a host (all of them when it has no more).
    ValueError when the shape cannot be laid out so."""
    axes, stride = [], 1
    for n in reversed(shape):
        if stride >= per_host:
            if stride % per_host:
                raise ValueError
            axes.append(MeshAxis(n, 1, n))
        else:
            if per_host % stride:
                raise ValueError
            m = min(n, per_host // stride)
            if n % m:
                raise ValueError
            axes.append(MeshAxis(n, m, n // m, stride if m > 1 else 1))
        stride *= n
    return tuple(reversed(axes))


@dataclass(frozen=True)
class LogicalMesh:
    """A ``submesh = (hosts, per_host)`` of ``cluster`` viewed as a logical mesh of two axes
    ``shape = (a, b)``, or three ``(a, b, c)`` (data x context x tensor parallelism in one stage).

    ``axes[i]`` says how many devices axis i has per host and how many hosts it spans (mapping in the
    module docstring). ``LogicalMesh(cluster, (2, 8), (4, 4))``: axis 1 inside a host, axis 0 two
    devices per host in two hosts (hierarchical).
    """

    cluster: Cluster
    submesh: tuple[int, int]
    shape: tuple[int, ...]
    # `collective`'s answers, (op, bytes, axis) -> seconds: the planner prices the same few
    # collectives for thousands of redistributions of one mesh
    _seconds: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _axes: tuple[MeshAxis, ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        hosts, per_host = self.submesh
        object.__setattr__(self, "submesh", (int(hosts), int(per_host)))
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        shape = "x".join(map(str, self.shape))
        if len(self.shape) not in (2, 3):
            raise MeshplanError(
                f"a logical mesh has two or three axes, got {len(self.shape)} ({shape})"
            )
        if min(hosts, per_host, *self.shape) < 1:
            raise MeshplanError(
                f"submesh {self.submesh} and logical mesh {self.shape} need positive sizes"
            )
        if hosts > self.cluster.hosts or per_host > self.cluster.devices_per_host:
            raise MeshplanError(
                f"submesh {hosts}x{per_host} does not fit in cluster {self.cluster.spec} "
                f"({self.cluster.hosts} hosts x {self.cluster.devices_per_host} devices)"
            )
        if self.num_devices != hosts * per_host:
            raise MeshplanError(
                f"logical mesh {shape} does not have the {hosts * per_host} devices of submesh {hosts}x{per_host}"
            )
        try:
            object.__setattr__(self, "_axes", _axis_layout(hosts, per_host, self.shape))
        except ValueError:
            raise MeshplanError(
                f"logical mesh {shape} cannot be laid on submesh {hosts}x{per_host}: each axis "
                f"must divide, or be a multiple of, the {per_host} devices per host left by the "
                "axes after it"
            ) from None

    @classmethod
    def of(cls, cluster: Cluster, shape: tuple[int, ...] | None = None) -> LogicalMesh:
        """The whole cluster as a logical mesh (default shape: hosts x devices per host)."""
        return cls(cluster, cluster.shape, cluster.shape if shape is None else shape)

    @property
    def axes(self) -> tuple[MeshAxis, ...]:
        """The axes' layouts."""
        return self._axes

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis(self, i: int) -> MeshAxis:
        """Layout of axis ``i``."""
        return self.axes[i]

    def flat_axis(self) -> MeshAxis:
        """Both axes as one (a collective over every device of the mesh)."""
        hosts, per_host = self.submesh
        return MeshAxis(hosts * per_host, per_host, hosts)

    def collective(self, op: str, nbytes: float, axis: int | None) -> float:
        """Seconds for ``op`` of ``nbytes`` along mesh axis ``axis`` (None: over the whole mesh)."""
        key = (op, nbytes, axis)
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = self._seconds[key] = collective_time(
                self.cluster,
                op,
                nbytes,
                self.flat_axis() if axis is None else self.axis(axis),
            )
        return seconds

    def all_reduce(self, nbytes: float, axis: int | None) -> float:
        return self.collective("all_reduce", nbytes, axis)

    def all_gather(self, nbytes: float, axis: int | None) -> float:
        return self.collective("all_gather", nbytes, axis)

    def reduce_scatter(self, nbytes: float, axis: int | None) -> float:
        return self.collective("reduce_scatter", nbytes, axis)

    def all_to_all(self, nbytes: float, axis: int | None) -> float:
        return self.collective("all_to_all", nbytes, axis)
