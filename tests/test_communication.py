"""Collective costs, the logical-mesh mapping, and resharding for every pair of 2D placements."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import cost_models.profile as profile_mod
from cost_models import (
    Cluster,
    LogicalMesh,
    MeshAxis,
    MeshplanError,
    Placement,
    collective_time,
    format_placements,
    local_bytes,
    parse_placement,
    parse_placements,
    reshard_cost,
    reshard_steps,
)
from cost_models.resharding import backward_placements

A100x2 = Cluster.from_spec(
    "2x4xA100-80GB"
)  # 2 hosts of 4: a (2, 4) mesh, axis 0 across hosts
V100x4 = Cluster.from_spec("4x8xV100-16GB")
MB = 2**20

# ---------------------------------------------------------------------------------------------
# formulas, written out independently of the implementation


def expected_ring(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-gather / reduce-scatter: n - 1 steps, each moving one B / n chunk."""
    if n == 1:
        return 0.0
    one_pass = sum(alpha + nbytes / n * beta for _ in range(n - 1))
    return {
        "all_gather": one_pass,
        "reduce_scatter": one_pass,
        "all_reduce": 2 * one_pass,
    }[op]


def expected_all_to_all(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Each rank holds B / n and sends one B / n^2 block to each of the n - 1 others."""
    return (n - 1) * (alpha + nbytes / n / n * beta) if n > 1 else 0.0


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ring_formulas_inside_a_host(op, n):
    link = V100x4.group_link(n)
    got = collective_time(V100x4, op, 64 * MB, MeshAxis(n, n, 1))
    assert got == pytest.approx(
        expected_ring(op, 64 * MB, n, link.latency_s, 1 / link.bandwidth_bytes_per_s)
    )


@pytest.mark.parametrize("n", [2, 4])
def test_ring_formulas_across_hosts(n):
    link = V100x4.inter_host_link
    got = collective_time(V100x4, "all_gather", 64 * MB, MeshAxis(n, 1, n))
    assert got == pytest.approx(
        expected_ring(
            "all_gather", 64 * MB, n, link.latency_s, 1 / link.bandwidth_bytes_per_s
        )
    )


def test_all_to_all_and_send_recv_formulas():
    link = V100x4.intra_host_link
    a, b = link.latency_s, 1 / link.bandwidth_bytes_per_s
    assert collective_time(
        V100x4, "all_to_all", 64 * MB, MeshAxis(8, 8, 1)
    ) == pytest.approx(expected_all_to_all(64 * MB, 8, a, b))
    pair = V100x4.group_link(2)
    assert collective_time(V100x4, "send_recv", MB, MeshAxis(2, 2, 1)) == pytest.approx(
        pair.latency_s + MB / pair.bandwidth_bytes_per_s
    )


def test_v100_group_links_follow_the_nvlink_topology():
    """p3.16xlarge (`nvidia-smi topo -m`): GPUs 0-1 share one NVLink (NV1), 2-3 two (NV2); a quad
    0-3 has 4 links per GPU inside it; all 8 have 6. 25 GB/s per link and direction (150 / 6)."""
    GB = 1e9
    link = 150 * GB / 6
    rows = V100x4.nvlinks
    assert all(rows[i][j] == rows[j][i] for i in range(8) for j in range(8))
    assert all(sum(r) == 6 for r in rows)
    assert V100x4.group_link(2).bandwidth_bytes_per_s == pytest.approx(1 * link)
    assert V100x4.group_link(4).bandwidth_bytes_per_s == pytest.approx(4 * link)
    assert V100x4.group_link(8) == V100x4.intra_host_link
    # The first axis of a 2 x 4 mesh pairs GPUs 4 apart: 0-4 and 1-5 have NV2, 2-6 and 3-7 NV1.
    assert V100x4.group_link(2, 4).bandwidth_bytes_per_s == pytest.approx(1 * link)
    # {0, 2, 4, 6}: GPU 2 reaches 0 and 6 over one link each and 4 not at all.
    assert V100x4.group_link(4, 2).bandwidth_bytes_per_s == pytest.approx(2 * link)
    mesh = LogicalMesh(V100x4, (1, 8), (2, 4))
    assert mesh.axis(0).stride == 4 and mesh.axis(1).stride == 1
    assert Cluster.from_json(V100x4.to_json()).nvlinks == V100x4.nvlinks
    # NVSwitch machines: every group gets the full per-GPU bandwidth.
    a100 = Cluster.from_spec("1x8xA100-40GB")
    assert a100.group_link(2) == a100.intra_host_link


AXES = [
    MeshAxis(8, 8, 1),
    MeshAxis(4, 1, 4),
    MeshAxis(16, 4, 4),
    MeshAxis(32, 8, 4),
    MeshAxis(2, 2, 1),
]


@pytest.mark.parametrize("axis", AXES, ids=lambda a: a.kind + str(a.size))
def test_all_reduce_is_reduce_scatter_plus_all_gather(axis):
    for nbytes in (1e3, 1e6, 1e9):
        ar = collective_time(V100x4, "all_reduce", nbytes, axis)
        rs = collective_time(V100x4, "reduce_scatter", nbytes, axis)
        ag = collective_time(V100x4, "all_gather", nbytes, axis)
        assert ar == pytest.approx(rs + ag)


def test_hierarchical_all_reduce_derivation():
    # 2 devices per host x 4 hosts: reduce-scatter inside (B over 2), all-reduce of the B/2 shard
    # between hosts (over 4), all-gather inside.
    i, e = V100x4.group_link(2), V100x4.inter_host_link
    B = 128 * MB
    want = (
        expected_ring("reduce_scatter", B, 2, i.latency_s, i.beta)
        + expected_ring("all_reduce", B / 2, 4, e.latency_s, e.beta)
        + expected_ring("all_gather", B, 2, i.latency_s, i.beta)
    )
    assert collective_time(V100x4, "all_reduce", B, MeshAxis(8, 2, 4)) == pytest.approx(
        want
    )


@pytest.mark.parametrize(
    "op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
)
def test_cost_grows_with_size_and_devices(op):
    sizes = [
        collective_time(V100x4, op, s, MeshAxis(8, 8, 1)) for s in (1e3, 1e5, 1e7, 1e9)
    ]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    # all-to-all moves (n-1)/n^2 of the full tensor per device: it grows with devices at a fixed
    # per-device buffer; the others at a fixed full tensor
    per = (lambda n: 1e8 * n) if op == "all_to_all" else (lambda n: 1e8)
    # On NVSwitch hosts (A100) every group gets the same per-GPU link; on a V100 host a pair of
    # GPUs has one NVLink and a quad four per GPU, so there a bigger group can be faster.
    devices = [
        collective_time(A100x2, op, per(n), MeshAxis(n, n, 1)) for n in (1, 2, 4, 8)
    ]
    assert devices[0] == 0.0
    assert devices == sorted(devices) and devices[1] < devices[-1]
    hosts = [collective_time(V100x4, op, per(n), MeshAxis(n, 1, n)) for n in (1, 2, 4)]
    assert hosts == sorted(hosts) and hosts[1] < hosts[-1]


@pytest.mark.parametrize(
    "op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"]
)
@pytest.mark.parametrize("cluster", [V100x4, A100x2], ids=lambda c: c.spec)
def test_across_hosts_is_slower_than_inside(op, cluster):
    inside = collective_time(cluster, op, 1e8, MeshAxis(2, 2, 1))
    across = collective_time(cluster, op, 1e8, MeshAxis(2, 1, 2))
    assert across > inside > 0


def test_unknown_collective():
    with pytest.raises(MeshplanError):
        collective_time(V100x4, "broadcast", 1, MeshAxis(2, 2, 1))


def test_profile_fit_is_used_inside_a_host():
    fits = [
        profile_mod.CollectiveFit("all_reduce", 4, 1e-3, 1e-8),
        profile_mod.CollectiveFit("all_to_all", 4, 2e-3, 3e-8),
        profile_mod.CollectiveFit("send_recv", 2, 5e-5, 1e-9),
    ]
    p = profile_mod.DeviceProfile(
        1, "cpu", "gloo", 1, 4, 1 << 33, 1e10, {"float32": 1e11}, [], fits, "", "h"
    )
    c = Cluster.from_profile(p, hosts=2, devices_per_host=4)
    assert collective_time(c, "all_reduce", 1e6, MeshAxis(4, 4, 1)) == pytest.approx(
        1e-3 + 1e-8 * 1e6
    )
    # all_to_all fits are per rank (B / n)
    assert collective_time(c, "all_to_all", 1e6, MeshAxis(4, 4, 1)) == pytest.approx(
        2e-3 + 3e-8 * 1e6 / 4
    )
    # no fit at this world size: alpha-beta from the derived link
    link = c.intra_host_link
    assert collective_time(c, "all_reduce", 1e6, MeshAxis(2, 2, 1)) == pytest.approx(
        expected_ring("all_reduce", 1e6, 2, link.latency_s, link.beta)
    )


# ---------------------------------------------------------------------------------------------
# logical mesh mapping: compare with a brute-force enumeration of device ids


def brute_force_axes(
    hosts: int, per_host: int, *shape: int
) -> list[tuple[int, int, int]] | None:
    """Each axis's (size, devices per host, hosts) read off the devices of every group along
    it (row-major device numbering, host-major hosts); None when some group has different
    counts in different hosts, or groups differ."""
    ids = np.arange(hosts * per_host).reshape(shape)
    out = []
    for axis in range(len(shape)):
        seen = set()
        for group in np.moveaxis(ids, axis, -1).reshape(-1, shape[axis]):
            per = {}
            for d in group:
                per[d // per_host] = per.get(d // per_host, 0) + 1
            if len(set(per.values())) != 1:
                return None
            seen.add((len(group), next(iter(per.values())), len(per)))
        if len(seen) != 1:
            return None
        out.append(seen.pop())
    return out


def _shapes(n: int, axes: int) -> list[tuple[int, ...]]:
    if axes == 1:
        return [(n,)]
    return [
        (a, *rest)
        for a in range(1, n + 1)
        if n % a == 0
        for rest in _shapes(n // a, axes - 1)
    ]


@pytest.mark.parametrize("axes", [2, 3])
@pytest.mark.parametrize("submesh", [(1, 1), (1, 2), (1, 8), (2, 8), (4, 8), (2, 6)])
def test_logical_mesh_axes_match_device_numbering(submesh, axes):
    """Every two- and three-axis shape of the submesh: laid out as its devices' numbering
    says, and refused exactly where some group along an axis is spread unevenly over hosts."""
    for shape in _shapes(submesh[0] * submesh[1], axes):
        want = brute_force_axes(*submesh, *shape)
        try:
            mesh = LogicalMesh(V100x4, submesh, shape)
        except MeshplanError:
            assert want is None, shape
            continue
        assert [(ax.size, ax.per_host, ax.hosts) for ax in mesh.axes] == want, shape


def test_logical_mesh_examples_and_errors():
    m = LogicalMesh(V100x4, (2, 8), (4, 4))
    assert m.axis(1).kind == "intra" and m.axis(0).kind == "hierarchical"
    assert LogicalMesh.of(V100x4).axes == (MeshAxis(4, 1, 4), MeshAxis(8, 8, 1))
    assert LogicalMesh(V100x4, (1, 8), (2, 4)).axes == (
        MeshAxis(2, 2, 1, 4),
        MeshAxis(4, 4, 1),
    )
    assert m.flat_axis() == MeshAxis(16, 8, 2)
    # data x context x tensor parallelism on two hosts: dp across them, cp and tp inside
    m3 = LogicalMesh(V100x4, (2, 8), (2, 2, 4))
    assert m3.axes == (MeshAxis(2, 1, 2), MeshAxis(2, 2, 1, 4), MeshAxis(4, 4, 1))
    assert m3.num_devices == 16 and m3.flat_axis() == MeshAxis(16, 8, 2)
    with pytest.raises(MeshplanError, match="two or three axes"):
        LogicalMesh(V100x4, (2, 8), (2, 2, 2, 2))
    assert m.all_reduce(1e6, None) > m.all_reduce(1e6, 1)
    for submesh, shape in [
        ((5, 8), (5, 8)),
        ((1, 9), (1, 9)),
        ((2, 8), (3, 5)),
        ((2, 6), (3, 4)),
        ((0, 8), (0, 8)),
    ]:
        with pytest.raises(MeshplanError):
            LogicalMesh(V100x4, submesh, shape)


# ---------------------------------------------------------------------------------------------
# placements


def test_parse_and_format_placements():
    assert parse_placement("R") == Placement("R")
    assert (
        parse_placement("S(1)")
        == parse_placement("Shard(dim=1)")
        == parse_placement("s1")
        == Placement("S", 1)
    )
    assert parse_placement("Partial(sum)") == parse_placement("P") == Placement("P")
    assert parse_placements("(S(0), R)") == (Placement("S", 0), Placement("R"))
    assert parse_placements(["P", "S(1)"]) == (Placement("P"), Placement("S", 1))
    assert format_placements("S(0),P") == "(S(0), P)"
    for bad in ("X", "S()", "S(a)", "Shard"):
        with pytest.raises(MeshplanError):
            parse_placement(bad)


def test_local_bytes():
    assert local_bytes(A100x2, (1024, 4096), 2, "S(0),S(1)") == 1024 * 4096 * 2 / 8
    assert local_bytes(A100x2, (1024, 4096), 2, "P,S(0)") == 1024 * 4096 * 2 / 4
    with pytest.raises(MeshplanError):
        local_bytes(A100x2, (1024,), 2, "S(1),R")
    with pytest.raises(MeshplanError):
        local_bytes(A100x2, (1024,), 2, "R")


# ---------------------------------------------------------------------------------------------
# resharding: every pair of placements over {R, S(0), S(1), P}^2 on a (2, 4) mesh

SHAPE = (1024, 4096)
DTYPE_BYTES = 2
FULL = SHAPE[0] * SHAPE[1] * DTYPE_BYTES
PLACEMENTS = ["R", "S(0)", "S(1)", "P"]
PAIRS = [
    (src, dst)
    for src in itertools.product(PLACEMENTS, repeat=2)
    for dst in itertools.product(PLACEMENTS, repeat=2)
]
SIZES = (2, 4)


def owned(
    placements: tuple[str, ...], device: tuple[int, int], shape=(8, 8)
) -> set[tuple[int, int]]:
    """Element indices a device holds (partial sums and replicas both hold the full extent)."""
    ranges = [range(n) for n in shape]
    for axis, p in enumerate(placements):  # mesh axes in order: nested sharding
        if p.startswith("S"):
            d = int(p[2])
            r = ranges[d]
            chunk = len(r) // SIZES[axis]
            ranges[d] = r[device[axis] * chunk : (device[axis] + 1) * chunk]
    return set(itertools.product(*ranges))


def is_local(src, dst) -> bool:
    """No data need move: every partial axis stays partial, and each device already holds its target."""
    if any(s == "P" and d != "P" for s, d in zip(src, dst)):
        return False
    return all(
        owned(dst, dev) <= owned(src, dev)
        for dev in itertools.product(range(2), range(4))
    )


@pytest.mark.parametrize("src, dst", PAIRS, ids=lambda p: ",".join(p))
def test_reshard_zero_exactly_when_local(src, dst):
    cost = reshard_cost(A100x2, SHAPE, DTYPE_BYTES, src, dst)
    assert cost >= 0
    assert (cost == 0) == is_local(src, dst)
    if src == dst:
        assert reshard_steps(A100x2, SHAPE, DTYPE_BYTES, src, dst) == []
    # same answer through an explicit LogicalMesh, and on a single host it is cheaper
    assert reshard_cost(LogicalMesh.of(A100x2), SHAPE, DTYPE_BYTES, src, dst) == cost
    one_host = LogicalMesh(Cluster.from_spec("1x8xA100-80GB"), (1, 8), (2, 4))
    assert reshard_cost(one_host, SHAPE, DTYPE_BYTES, src, dst) <= cost


def expected_step(axis: int, src: str, dst: str, current: list[str]) -> float:
    """Price one step with the textbook formulas; B = full bytes / sizes of OTHER sharded axes."""
    other = 1 - axis
    B = FULL / (SIZES[other] if current[other].startswith("S") else 1)
    n = SIZES[axis]
    link = (
        A100x2.inter_host_link if axis == 0 else A100x2.intra_host_link
    )  # 2 hosts x 4
    a, b = link.latency_s, 1 / link.bandwidth_bytes_per_s
    s_kind, d_kind = src[0], dst[0]
    if src == dst or s_kind == "R":
        return 0.0  # nothing, or a local slice / local partition
    if s_kind == "S" and d_kind == "R":
        return expected_ring("all_gather", B, n, a, b)
    if s_kind == "S" and d_kind == "P":
        return expected_ring("all_gather", B, n, a, b)  # S -> R -> P
    if s_kind == "S" and d_kind == "S":
        return expected_all_to_all(B, n, a, b)
    if s_kind == "P" and d_kind == "R":
        return expected_ring("all_reduce", B, n, a, b)
    if s_kind == "P" and d_kind == "S":
        return expected_ring("reduce_scatter", B, n, a, b)
    raise AssertionError((src, dst))


@pytest.fixture(scope="module")
def dtensor_order():
    """DTensor's own redistribution order (its greedy planner), on a fake 8-rank process group."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh default process group")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = DeviceMesh("cpu", torch.arange(8).reshape(SIZES))
        meta = TensorMeta(torch.Size(SHAPE), (SHAPE[1], 1), torch.float16)
        obj = {"R": Replicate(), "S(0)": Shard(0), "S(1)": Shard(1), "P": Partial()}
        name = {v: k for k, v in obj.items()}
        order = {}
        for src, dst in PAIRS:
            infos = _gen_transform_infos_non_cached(
                DTensorSpec(mesh, tuple(obj[p] for p in src), tensor_meta=meta),
                DTensorSpec(mesh, tuple(obj[p] for p in dst), tensor_meta=meta),
            )
            order[src, dst] = [
                (
                    t.mesh_dim,
                    name[t.src_dst_placements[0]],
                    name[t.src_dst_placements[1]],
                )
                for t in infos
            ]
    finally:
        dist.destroy_process_group()
    return order


@pytest.mark.parametrize("src, dst", PAIRS, ids=lambda p: ",".join(p))
def test_reshard_matches_dtensor_steps_and_formulas(src, dst, dtensor_order):
    want, current = 0.0, list(src)
    for axis, s, d in dtensor_order[src, dst]:
        want += expected_step(axis, s, d, current)
        current[axis] = d
    assert current == list(dst)
    got = reshard_cost(A100x2, SHAPE, DTYPE_BYTES, src, dst)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    # our steps are DTensor's, with S -> P split into S -> R -> P
    ours = [
        (st.axis, str(st.src), str(st.dst))
        for st in reshard_steps(A100x2, SHAPE, DTYPE_BYTES, src, dst)
    ]
    theirs = []
    for axis, s, d in dtensor_order[src, dst]:
        theirs += (
            [(axis, s, "R"), (axis, "R", d)]
            if s.startswith("S") and d == "P"
            else [(axis, s, d)]
        )
    assert ours == theirs


def test_reshard_hand_examples():
    inter, intra = A100x2.inter_host_link, A100x2.intra_host_link
    ag0 = inter.latency_s + FULL / 2 * inter.beta  # all-gather over the 2 hosts
    # S(0) on axis 0 -> replicated: one all-gather of the whole tensor across hosts
    assert reshard_cost(A100x2, SHAPE, 2, "S(0),R", "R,R") == pytest.approx(ag0)
    # (S(0), S(1)) -> (R, R): DTensor gathers axis 1 first (a quarter... of the half each host holds),
    # then axis 0 on the full tensor
    ag1 = 3 * (intra.latency_s + (FULL / 2) / 4 * intra.beta)
    assert reshard_cost(A100x2, SHAPE, 2, "S(0),S(1)", "R,R") == pytest.approx(
        ag1 + ag0
    )
    # (P, P) -> (R, R): all-reduce across hosts, then inside
    ar0 = 2 * (inter.latency_s + FULL / 2 * inter.beta)
    ar1 = 6 * (intra.latency_s + FULL / 4 * intra.beta)
    assert reshard_cost(A100x2, SHAPE, 2, "P,P", "R,R") == pytest.approx(ar0 + ar1)
    # P -> S is a reduce-scatter, half an all-reduce
    assert reshard_cost(A100x2, SHAPE, 2, "R,P", "R,S(1)") == pytest.approx(ar1 / 2)
    # S(0) -> P goes through R: the same all-gather
    assert reshard_cost(A100x2, SHAPE, 2, "S(0),R", "P,R") == pytest.approx(ag0)
    assert reshard_cost(A100x2, SHAPE, 2, "R,R", "S(0),S(1)") == 0.0
    assert reshard_cost(A100x2, SHAPE, 2, "R,R", "P,P") == 0.0


def test_reshard_backward():
    assert backward_placements("P,R", "R,R") == (
        parse_placements("R,R"),
        parse_placements("R,R"),
    )
    assert backward_placements("S(0),R", "R,P") == (
        parse_placements("R,R"),
        parse_placements("S(0),R"),
    )
    fwd = reshard_cost(A100x2, SHAPE, 2, "R,R", "S(0),R")
    both = reshard_cost(A100x2, SHAPE, 2, "R,R", "S(0),R", include_backward=True)
    assert fwd == 0 and both == pytest.approx(
        reshard_cost(A100x2, SHAPE, 2, "S(0),R", "R,R")
    )
    ar = reshard_cost(A100x2, SHAPE, 2, "P,R", "R,R")
    assert reshard_cost(A100x2, SHAPE, 2, "P,R", "R,R", include_backward=True) == ar


def test_reshard_errors():
    with pytest.raises(MeshplanError):
        reshard_cost(A100x2, SHAPE, 2, "S(2),R", "R,R")
    with pytest.raises(MeshplanError):
        reshard_cost(A100x2, SHAPE, 2, "R", "R,R")
    assert math.isclose(
        reshard_cost(A100x2, SHAPE, 2, "S(-1),R", "R,R"),
        reshard_cost(A100x2, SHAPE, 2, "S(1),R", "R,R"),
    )
