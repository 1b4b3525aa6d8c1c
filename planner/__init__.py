"""meshplan's planner: tracing, the op graph, sharding strategies and the parallel-plan searches.

The public names below load on first use (PEP 562), so that importing one subpackage (the plan
vocabulary, which the runtime reads plans with) does not import the searches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cost_models.cluster import Cluster
    from cost_models.errors import MeshplanError
    from planner.api import plan
    from planner.tracing.opgraph import OpGraph, OpNode, TensorMeta
    from planner.tracing.tracer import trace
    from planner.vocab.plan_file import ParallelPlan

_WHERE = {
    "Cluster": "cost_models.cluster",
    "MeshplanError": "cost_models.errors",
    "OpGraph": "planner.tracing.opgraph",
    "OpNode": "planner.tracing.opgraph",
    "ParallelPlan": "planner.vocab.plan_file",
    "TensorMeta": "planner.tracing.opgraph",
    "plan": "planner.api",
    "trace": "planner.tracing.tracer",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
