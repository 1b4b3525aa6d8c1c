"""Cost models: the cluster, and every price in seconds and bytes. Imports nothing from planner/runtime."""

from cost_models.errors import MeshplanError

__all__ = ["MeshplanError"]
