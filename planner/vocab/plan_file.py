"""The parallel plan: dataclasses and their versioned JSON file (principle 5: plans are data).

A plan says which devices run which layers (stages on submeshes, each with a 2D logical mesh), how
every parameter is placed on its stage's mesh, the strategy of every op (for the runtime), the
micro-batches and schedule, and the predicted time and memory. It carries the model's fingerprint:
the runtime refuses a plan made for another model (`check_model`).

Reading a plan (`ParallelPlan.from_json`, so `load` too) checks it completely, once (`validate`,
its rules in `_RULES`): every command that reads a plan file gets a plan it can use, or one line
``<file>: <field path>: <what is wrong and what would be valid>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cost_models.errors import MeshplanError
from planner.vocab.plan_check import (
    FORMAT_VERSION,
    Invalid,
    as_list,
    check_version,
    fields_of,
    recompute_mode,
    show,
    validate,
)


@dataclass
class StagePlan:
    layers: tuple[int, int]  # first and last layer, inclusive
    devices: list[int]  # global device ranks, host-major
    submesh: tuple[int, int]  # hosts, devices per host
    logical_mesh: tuple[int, ...]  # two or three axes
    recompute: (
        str  # none | selective | full (`planner.vocab.plan_check.RECOMPUTE_MODES`)
    )
    param_placements: dict[str, list[str]]  # parameter path -> placement per mesh axis
    time_s: (
        float  # forward + backward of one micro-batch, including gradient sync share
    )
    memory_bytes: float  # peak per device
    compute_s: float = 0.0
    comm_s: float = 0.0
    grad_sync_s: float = 0.0  # per iteration
    optimizer_s: float = 0.0  # the optimizer's step, per iteration
    zero_params: list[str] = field(default_factory=list)
    # parameters fully sharded (FSDP, ZeRO stage 3) over the axes that replicate them
    fsdp_params: list[str] = field(default_factory=list)
    # hybrid sharding (HSDP): FSDP parameters sharded over these logical mesh axes only (those
    # inside a host) and replicated over the others; one of fsdp_params not listed here is
    # sharded over every axis that replicates it
    fsdp_axes: dict[str, list[int]] = field(default_factory=dict)
    # the data-parallel gradient all-reduce buckets, parameter paths in launch order, launched
    # as each completes in the last micro-batch's backward (`planner.inter.dp_overlap`,
    # `runtime.grad_overlap`); the stage's other gradients are synchronised after backward
    grad_buckets: list[list[str]] = field(default_factory=list)
    node_strategies: dict[str, dict[str, list]] = field(
        default_factory=dict
    )  # node -> {"inputs", "outputs"}
    # Mesh axes that replicate most of the stage's parameter bytes (data parallel); the other axes
    # split the model (tensor parallel, or fully sharded weights).
    data_parallel_axes: list[int] = field(default_factory=list)
    # Values this stage receives from earlier stages (producer node -> placement per mesh axis):
    # the placement the stage's intra-op solution gave the value, whose edges to the stage's ops
    # (and their gradients) the planner priced; a Partial axis there is "R" (the value arrives
    # reduced). The runtime plans the received value in it; a value not listed arrives replicated.
    input_placements: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.recompute = recompute_mode(self.recompute)  # true/false: full/none

    def shard_axes(self, path: str) -> tuple[int, ...] | None:
        """The mesh axes FSDP parameter `path` is sharded over (`fsdp_axes`); None: all that
        replicate it (`planner.vocab.placements.zero_shard`'s `axes`)."""
        axes = self.fsdp_axes.get(path)
        return None if axes is None else tuple(axes)

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
    # Tied parameters: path -> the stages (ascending) whose ops read this one tensor (an input
    # embedding and the LM head sharing its weight). Each of them holds its own copy, placed as
    # its param_placements say; the copies start equal, their gradients are summed across these
    # stages after every step, and a checkpoint saves the first stage's copy.
    tied_params: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [asdict(s) | {"dp_tp": s.dp_tp} for s in self.stages]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def from_json(cls, d: Any, source: str = "plan") -> ParallelPlan:
        """Read a plan from its JSON form and check it (`validate`). A broken plan raises
        MeshplanError with one line: ``<source>: <field path>: <what is wrong and what is valid>``."""
        if not isinstance(d, dict):
            raise MeshplanError(f"{source}: {show(d)} is not a plan (a JSON object)")
        try:
            check_version(d.get("format_version"))
            kw = fields_of(cls, d, "")
            kw["stages"] = [
                StagePlan(**fields_of(StagePlan, s, f"stages[{i}]"))
                for i, s in enumerate(as_list(kw["stages"], "stages", "stages"))
            ]
            kw["estimate"] = Estimate(**fields_of(Estimate, kw["estimate"], "estimate"))
            kw["layer_nodes"] = [
                tuple(x) if isinstance(x, list) else x
                for x in as_list(kw["layer_nodes"], "layer_nodes", "layers")
            ]
        except Invalid as exc:
            raise MeshplanError(f"{source}: {exc}") from None
        plan = cls(**kw)
        validate(plan, source)
        return plan

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

    def layer_ranges(self, ops: Sequence[str]) -> list[tuple[int, int]]:
        """Op index ranges of the plan's layers (``layer_nodes``: first and last op of each) in a
        traced graph whose ops, in order, are named `ops`."""
        index = {name: i for i, name in enumerate(ops)}
        try:
            return [(index[a], index[b]) for a, b in self.layer_nodes]
        except KeyError as exc:
            raise MeshplanError(
                f"plan names op {exc.args[0]} that the traced model does not have"
            ) from None

    def check_model(
        self, fingerprint: str, name: str = "", dtype: str | None = None
    ) -> None:
        """Refuse to run a plan made for another model. `dtype`: the model's parameters' dtype,
        named in the refusal when the plan was made for the same model in another dtype."""
        if self.model.get("fingerprint") == fingerprint:
            return
        if dtype is not None and dtype != self.dtype and name == self.model.get("name"):
            how = (
                f" (`meshplan plan ... --dtype {dtype}`)"
                if dtype in ("float16", "bfloat16", "float32")
                else ""
            )
            raise MeshplanError(
                f"plan was made for model {name!r} in {self.dtype}, and this model's "
                f"parameters are {dtype}: build the model in {self.dtype}, or plan it again "
                f"in {dtype}{how}"
            )
        if name and name == self.model.get("name"):
            # the same spec traced to other ops: other library versions, or a forward whose op
            # order follows a set of strings (transformers' MiMoV2Flash builds its attention masks
            # in the order of `set(config.layer_types)`), which changes with each process's
            # string hashing
            raise MeshplanError(
                f"plan was made for model {name!r} (fingerprint "
                f"{self.model.get('fingerprint')}), and it traces to other ops here (fingerprint "
                f"{fingerprint}): its code or the versions of torch or transformers differ, "
                "and plan it again where it runs; or its forward iterates over a Python set, "
                "whose order changes with each process, and set PYTHONHASHSEED=0 both where you "
                "plan and where you run"
            )
        raise MeshplanError(
            f"plan was made for model {self.model.get('name')!r} (fingerprint {self.model.get('fingerprint')}), "
            f"not for {name or 'this model'} (fingerprint {fingerprint}); plan it again with `meshplan plan`"
        )
