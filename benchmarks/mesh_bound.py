"""Measurement for issue 23: per micro-batch size, the least iteration time its plans can take
on the cluster's submeshes (`planner.inter.mesh_bound`, by which the planner gives a size up)
beside one device's work over the devices (`planner.size_bound`), and what the former costs
to compute here (every logical mesh of every submesh priced afresh; the planner prices only the
meshes a layer fits on, and shares the prices with its search).

    python -m benchmarks.mesh_bound MODEL --cluster C --batch G --sizes 1,2,4 [--best S]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner.inter.interleave import interleave_layering
from planner.inter.layers import graph_layerings
from planner.inter.mesh_bound import LeastTime
from planner.inter.mesh_shapes import logical_shapes, submesh_shapes
from planner.intra.solve import price_stage
from planner.size_bound import least_iteration_time
from planner.tracing.inputs import resolve_model
from planner.tracing.opgraph import OpGraph


def size_bound(
    graph: OpGraph, cluster: Cluster, num_microbatches: int, optimizer: str
) -> float:
    """`least_time` over the planner's clusterings and every logical mesh of the cluster."""
    bound, _ = size_least(graph, cluster, num_microbatches, optimizer)
    bound.exceeds(-math.inf)
    return bound.seconds


def size_least(
    graph: OpGraph, cluster: Cluster, num_microbatches: int, optimizer: str
) -> tuple[LeastTime, list[tuple[tuple[int, int], tuple[int, ...]]]]:
    """`LeastTime` over the planner's clusterings and every logical mesh of the cluster, and
    the (submesh, logical mesh shape) of each of its meshes, in its order."""
    meshes, keys = [], []
    for sub in submesh_shapes(cluster):
        for shape in logical_shapes(sub):
            mesh = LogicalMesh(cluster, sub, shape)
            keys.append((sub, tuple(shape)))
            meshes.append(
                (
                    mesh.num_devices,
                    lambda mesh=mesh: (
                        price_stage(
                            graph,
                            mesh,
                            num_microbatches=num_microbatches,
                            optimizer=optimizer,
                        ).ctx
                    ),
                )
            )
    layerings = graph_layerings(graph, None, cluster.num_devices)
    layerings.append(interleave_layering(graph))
    bound = LeastTime(graph, layerings, meshes, num_microbatches, cluster.num_devices)
    return bound, keys


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch")
    ap.add_argument("--sizes", required=True, help="micro-batch sizes, e.g. 1,2,4")
    ap.add_argument("--optimizer", default="adam_mixed")
    ap.add_argument("--best", type=float, help="a plan's seconds, to compare with")
    args = ap.parse_args(argv)
    cluster = Cluster.from_spec(args.cluster)
    _, source, _ = resolve_model(args.model, None, torch.float16, None)
    for b in (int(x) for x in args.sizes.split(",")):
        B = args.batch // b
        graph = source.trace(b)
        t0, c0 = time.perf_counter(), time.process_time()
        bound = size_bound(graph, cluster, B, args.optimizer)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        one = least_iteration_time(
            graph, cluster, B, args.batch, args.optimizer, args.model
        )
        verdict = ""
        if args.best is not None:
            verdict = " rules the size out" if bound > args.best else " does not"
        print(
            f"micro-batch {b} ({B} micro-batches): on its meshes {bound:.4g} s{verdict}; "
            f"one device's work {one:.4g} s; {wall:.1f} s ({cpu:.1f} s of CPU)",
            flush=True,
        )


if __name__ == "__main__":
    main()
