"""meshplan's planner: tracing, the op graph, sharding strategies and the parallel-plan searches."""

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.api import plan
from planner.tracing.opgraph import OpGraph, OpNode, TensorMeta
from planner.tracing.tracer import trace
from planner.vocab.plan_file import ParallelPlan

__all__ = [
    "Cluster",
    "MeshplanError",
    "OpGraph",
    "OpNode",
    "ParallelPlan",
    "TensorMeta",
    "plan",
    "trace",
]
