"""Cost models: the cluster, and every price in seconds and bytes. Imports nothing from planner/runtime."""

from cost_models.cluster import (
    DEVICE_NAMES,
    DTYPES,
    PRESETS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    canonical_dtype,
    dtype_bytes,
)
from cost_models.communication import (
    COLLECTIVES,
    LogicalMesh,
    MeshAxis,
    collective_time,
    p2p_time,
)
from cost_models.compute import matmul_efficiency, matmul_time, op_time
from cost_models.errors import MeshplanError
from cost_models.memory import (
    OPTIMIZERS,
    StateBytes,
    device_peak_bytes,
    microbatches_in_flight,
    param_state_bytes,
    stage_peak_bytes,
    state_bytes_per_param,
)
from cost_models.resharding import (
    Placement,
    ReshardStep,
    format_placements,
    local_bytes,
    parse_placement,
    parse_placements,
    reshard_cost,
    reshard_steps,
)

__all__ = [
    "COLLECTIVES",
    "DEVICE_NAMES",
    "DTYPES",
    "OPTIMIZERS",
    "PRESETS",
    "Cluster",
    "DeviceSpec",
    "LinkSpec",
    "LogicalMesh",
    "MeshAxis",
    "MeshplanError",
    "Placement",
    "ReshardStep",
    "StateBytes",
    "canonical_dtype",
    "collective_time",
    "device_peak_bytes",
    "dtype_bytes",
    "format_placements",
    "local_bytes",
    "matmul_efficiency",
    "matmul_time",
    "microbatches_in_flight",
    "op_time",
    "p2p_time",
    "param_state_bytes",
    "parse_placement",
    "parse_placements",
    "reshard_cost",
    "reshard_steps",
    "stage_peak_bytes",
    "state_bytes_per_param",
]
