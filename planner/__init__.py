"""meshplan's planner: tracing, the op graph, sharding strategies and the parallel-plan searches."""

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.opgraph import OpGraph, OpNode, TensorMeta
from planner.tracer import trace

__all__ = ["Cluster", "MeshplanError", "OpGraph", "OpNode", "TensorMeta", "trace"]
