"""The submeshes and logical meshes one micro-batch size's search solves
(`planner.inter.mesh_search`), and the Megatron-style seeds solved on each."""

from __future__ import annotations

from collections.abc import Callable

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.intra.fsdp_prices import hybrid_axes
from planner.intra.megatron import context_seeds, is_expert_weight, seed_filters
from planner.intra.prices import Option
from planner.tracing.opgraph import OpGraph


def submesh_shapes(cluster: Cluster) -> list[tuple[int, int]]:
    """(1, 1), (1, 2), (1, 4), ..., (1, M), then (n, M) for n = 2..N hosts, keeping the n that are
    powers of two or divide N: fewer shapes for the intra-op pass to solve, and any N hosts are
    still tiled (by powers of two)."""
    N, M = cluster.shape
    out = [
        (1, m) for m in range(1, M + 1) if M % m == 0 and (m & (m - 1) == 0 or m == M)
    ]
    return out + [(n, M) for n in range(2, N + 1) if N % n == 0 or n & (n - 1) == 0]


def logical_shapes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """The logical meshes tried on a submesh.

    * Inside one host: one flat axis and every a x m/a with 1 < a < m (both 2 x 4 and 4 x 2 on 8
      devices).
    * Across n hosts: n x m, one flat axis of n * m devices, and (n * m / t) x t for every t
      with 1 < t < m dividing m: data parallelism (or FSDP) over all devices with tensor
      parallelism in groups of t inside a host, as torchtitan's 2D meshes run it (llama3-405b
      on 64x8 H100s: dp256 x tp2 with FSDP + SP, 482 TFLOP/s per device, where the best of
      64 x 8 and 1 x 512 reached 387). Only their seeds are solved (`_seeds_only`), but for
      m x 2 on two hosts. The flat axis is FSDP over all of them, as torchtitan shards over a
      flat data-parallel mesh. On n x m, a parameter sharded on both
      axes is gathered inner axis first (DTensor's nested shard order), so the inter-host step
      moves (n - 1) / n of the parameter from every device; a flat collective is priced at the
      cluster's all-device bandwidth (llama3-70b on 8x8 H100s, FSDP over all 64 at 2 rows per
      device: one pass's all-gathers 2.57 s on 8 x 8, 0.65 s flat; the step 17.12 against
      16.71 s with full recomputation). On two hosts m x 2 (tensor parallelism in device pairs
      inside a host with data parallelism over the rest: the best manual configuration of
      gpt-15b on 4x8 A100s, dp8 x tp2 per 16-device stage) is solved in full. Larger
      multi-host submeshes do not get that: it is one of the costliest intra-op programs, and
      planning gpt-39b on 8x8 V100s took 48 s with it on two hosts only, 100 s with it on every
      multi-host submesh (one run each).

    A mesh and its transpose are not interchangeable: a dimension sharded on both axes nests axis 0
    outside axis 1 (DTensor's default shard order; `planner.intra.strategies` has no strided shards). On
    4 x 2 with tensor parallelism on axis 1, Megatron's dp-outer, tp-inner activation layout is
    (S(0), S(0)), and moving between it and (S(0), R) is one collective over the 2 tp devices. With
    tensor parallelism on axis 0 of 2 x 4 the same layout nests the other way round, and DTensor
    first replicates a misaligned nested shard (`cost_models.resharding`). gpt-39b on 8x8 A100s
    with micro-batch 8 plans 19.14 s per iteration without 4 x 2, 19.04 s with it."""
    n, m = submesh
    if n > 1:
        groups = [(n * m // t, t) for t in range(2, m) if m % t == 0]
        return [(n, m), *groups, (1, n * m)]
    return [(1, m)] + [(a, m // a) for a in range(2, m) if m % a == 0]


def _seeds_only(sub: tuple[int, int], shape: tuple[int, int], mode: str) -> bool:
    """Whether only the seeds are solved on this logical mesh (data parallelism, FSDP, tensor
    parallelism inside a host, context parallelism; `planner.intra.megatron.seed_filters`):
    on a submesh across hosts, every logical mesh `logical_shapes` offers but hosts x devices
    and, on two hosts, m x 2. Their free time-optimal programs with the memory ladder would be
    the costliest passes of the submesh, and tensor parallelism across hosts cannot win."""
    n, m = sub
    if mode == "inter-only" or n == 1 or shape == sub:
        return False
    return not (n == 2 and shape == (m, 2))


def _param_filter(mode: str) -> Callable[[str, Option], bool] | None:
    if mode == "inter-only":
        return lambda path, o: (
            not o.zero and all(p == "R" for p in o.strategy.output[0])
        )
    return None


def _seeds(
    graph: OpGraph, mesh: LogicalMesh, mode: str, context_parallel: bool = True
) -> list:
    """Megatron-style parameter placements solved as extra candidates (`planner.intra.megatron`);
    on a mesh spanning hosts also HSDP over the axes inside a host; context parallelism
    (`planner.intra.megatron.context_seeds`) unless `context_parallel` is False. On the
    tensor-parallel groups across hosts (`logical_shapes`' (n * m / t) x t, seeds only) only
    the tensor-parallel seeds: data parallelism, FSDP and context parallelism over all devices
    are the flat mesh's."""
    if mode == "inter-only":
        return []
    experts = any(is_expert_weight(p) for p in graph.placeholder_paths.values())
    M = mesh.cluster.devices_per_host
    tps = {t for t in range(2, M + 1) if M % t == 0}
    groups = _seeds_only(mesh.submesh, mesh.shape, mode) and mesh.shape[0] > 1
    seeds = seed_filters(mesh.shape, experts, tps, hybrid_axes(mesh), groups)
    if context_parallel and not groups:
        seeds += context_seeds(mesh.shape, experts, tps)
    return seeds
