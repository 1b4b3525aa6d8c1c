"""The parallel plan: dataclasses and their versioned JSON file (principle 5: plans are data).

A plan says which devices run which layers (stages on submeshes, each with a 2D logical mesh), how
every parameter is placed on its stage's mesh, the strategy of every op (for the runtime), the
micro-batches and schedule, and the predicted time and memory. It carries the model's fingerprint:
the runtime refuses a plan made for another model (`check_model`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cost_models.errors import MeshplanError

FORMAT_VERSION = 1


@dataclass
class StagePlan:
    layers: tuple[int, int]  # first and last layer, inclusive
    devices: list[int]  # global device ranks, host-major
    submesh: tuple[int, int]  # hosts, devices per host
    logical_mesh: tuple[int, int]
    recompute: bool
    param_placements: dict[str, list[str]]  # parameter path -> placement per mesh axis
    time_s: (
        float  # forward + backward of one micro-batch, including gradient sync share
    )
    memory_bytes: float  # peak per device
    compute_s: float = 0.0
    comm_s: float = 0.0
    grad_sync_s: float = 0.0  # per iteration
    zero_params: list[str] = field(default_factory=list)
    node_strategies: dict[str, dict[str, list]] = field(
        default_factory=dict
    )  # node -> {"inputs", "outputs"}
    # Mesh axes that replicate most of the stage's parameter bytes (data parallel); the other axes
    # split the model (tensor parallel, or fully sharded weights).
    data_parallel_axes: list[int] = field(default_factory=list)

    @property
    def dp_tp(self) -> str:
        """Data x tensor parallel degrees (see `data_parallel_axes`)."""
        dp = tp = 1
        for a, size in enumerate(self.logical_mesh):
            if a in self.data_parallel_axes:
                dp *= size
            else:
                tp *= size
        return f"{dp}x{tp}"


@dataclass
class Estimate:
    iteration_time_s: float
    tflops_per_device: float
    peak_memory_bytes: float


@dataclass
class ParallelPlan:
    model: dict[str, Any]  # name, fingerprint, params, flops_per_iteration
    cluster: dict[str, Any]  # Cluster.to_json(): spec, num_devices, ...
    global_batch: int
    num_microbatches: int
    schedule: str
    stages: list[StagePlan]
    estimate: Estimate
    planner_time_s: float
    layer_nodes: list[tuple[str, str]]  # first and last op node of every layer
    dtype: str = "float16"
    optimizer: str = "adam_mixed"
    virtual_stages: int = 1
    kind: str = "auto"  # auto | manual | intra-only | inter-only
    manual: dict[str, Any] | None = None
    fallback_ops: list[str] = field(default_factory=list)
    memory_budget_bytes: float | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [asdict(s) | {"dp_tp": s.dp_tp} for s in self.stages]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "plan") -> ParallelPlan:
        if not isinstance(d, dict):
            raise MeshplanError(f"{source}: expected a JSON object")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise MeshplanError(
                f"{source}: plan format version {version!r} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            stages = [
                StagePlan(
                    **{
                        k: (
                            tuple(v)
                            if k in ("layers", "submesh", "logical_mesh")
                            else v
                        )
                        for k, v in s.items()
                        if k != "dp_tp"
                    }
                )
                for s in d["stages"]
            ]
            fields = {
                k: v
                for k, v in d.items()
                if k not in ("stages", "estimate", "layer_nodes")
            }
            return cls(
                **fields,
                stages=stages,
                estimate=Estimate(**d["estimate"]),
                layer_nodes=[tuple(x) for x in d["layer_nodes"]],
            )
        except (KeyError, TypeError) as exc:
            raise MeshplanError(
                f"{source}: malformed plan ({type(exc).__name__}: {exc})"
            ) from None

    @classmethod
    def load(cls, path: str | Path) -> ParallelPlan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise MeshplanError(f"cannot read plan {path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MeshplanError(
                f"{path}: not a JSON plan ({exc.msg} at line {exc.lineno})"
            ) from None
        return cls.from_json(data, str(path))

    def check_model(self, fingerprint: str, name: str = "") -> None:
        """Refuse to run a plan made for another model."""
        if self.model.get("fingerprint") != fingerprint:
            raise MeshplanError(
                f"plan was made for model {self.model.get('name')!r} (fingerprint {self.model.get('fingerprint')}), "
                f"not for {name or 'this model'} (fingerprint {fingerprint}); plan it again with `meshplan plan`"
            )
