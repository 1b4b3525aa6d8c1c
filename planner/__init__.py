"""meshplan's planner: tracing, the op graph, sharding strategies and the parallel-plan searches."""

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.api import plan
from planner.opgraph import OpGraph, OpNode, TensorMeta
from planner.plan_format import ParallelPlan
from planner.tracer import trace

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
