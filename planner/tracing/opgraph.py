"""The op graph: the planner's IR, one node per aten operator of the traced forward + loss.

Built by `planner.tracing.tracer.trace` on top of a torch.fx graph (kept in `OpGraph.gm`, which the runtime
executes); each node carries what the cost models need: shapes, FLOPs of forward and backward, bytes
moved, parameters used, bytes saved for backward and the module it came from.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: reshapes traced as one op or the other depending on the input's layout (`OpGraph.fingerprint`)
_RESHAPES = {"aten._unsafe_view.default": "aten.view.default"}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    nbytes: int

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            tuple(int(d) for d in t.shape),
            str(t.dtype).removeprefix("torch."),
            t.numel() * t.element_size(),
        )

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class OpNode:
    """One node of the op graph.

    `op` is "param", "buffer" or "input" for placeholders, "call" for an operator and "output" for the
    graph's output. `saved` names the values (node names, resolved through views to the value that
    owns the storage) this op keeps for backward; `saved_extra_bytes` counts saved tensors that are
    not graph values (e.g. layer norm's mean and rstd, attention's logsumexp).
    """

    name: str
    op: str
    target: str
    kind: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    module_path: str = ""
    fwd_flops: int = 0
    bwd_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    params: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    saved_extra_bytes: int = 0
    requires_grad: bool = False
    is_view: bool = False
    # inputs derived from parameters only (a weight or its view) that this op keeps for backward;
    # `saved` leaves them out (parameters are priced as parameter state), but where the op
    # receives one redistributed (an all-gathered weight) it keeps that copy
    # (`planner.inter.held_memory`)
    saved_params: list[str] = field(default_factory=list)

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient flows back through this value: floating and computed from
        parameters (not, e.g., rotary tables sliced from a buffer). Pipeline boundaries send
        gradients back for these values only (`runtime.boundary.needs_grad`,
        `planner.inter.boundaries.boundary_bytes`)."""
        return (
            bool(self.outputs)
            and self.requires_grad
            and getattr(torch, self.outputs[0].dtype).is_floating_point
        )

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "target": self.target,
            "kind": self.kind,
            "inputs": self.inputs,
            "outputs": [
                {"shape": list(t.shape), "dtype": t.dtype} for t in self.outputs
            ],
            "module_path": self.module_path,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "params": self.params,
            "saved": self.saved,
            "saved_extra_bytes": self.saved_extra_bytes,
        }


@dataclass
class OpGraph:
    """A traced model: nodes in topological order plus the fx graph they describe."""

    nodes: list[OpNode]
    params: dict[str, TensorMeta]  # parameter path -> meta, in module order
    buffers: dict[str, TensorMeta]
    placeholder_paths: dict[
        str, str
    ]  # placeholder node name -> parameter/buffer path or "batch[i]"
    gm: torch.fx.GraphModule | None = field(default=None, repr=False, compare=False)
    model_name: str = ""

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}
        self._all_derived: frozenset[str] | None = None  # `param_derived()`, made once
        self._ops: list[OpNode] | None = None  # `ops`, made once
        self._derived: dict[str, Any] = {}  # `derived`

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, made once per graph under `key`: what the planner reads of the graph
        alone for every logical mesh and solve (the graph is not modified after tracing).
        Do not modify what it returns."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def node(self, name: str) -> OpNode:
        return self._by_name[name]

    @property
    def loss_value(self) -> str | None:
        """The value the runtime takes as the loss: the graph output's first value
        (`runtime.executor.PlanExecutor.run_plan`); None without one."""

        def make() -> str | None:
            out = [n for n in self.nodes if n.op == "output"]
            return out[-1].inputs[0] if out and out[-1].inputs else None

        return self.derived(("loss_value",), make)

    @property
    def ops(self) -> list[OpNode]:
        """The op nodes (``op == "call"``) in graph order: one list, made once, which the
        planner's inner loops read (do not modify it)."""
        if self._ops is None:
            self._ops = [n for n in self.nodes if n.op == "call"]
        return self._ops

    def param_derived(self, names: Sequence[str] | None = None) -> set[str]:
        """Among `names` (in graph order; default every node): parameters, and views of
        parameters only (``t(weight)``): the values whose gradients are synchronised once per
        iteration (the planner prices that divided by the micro-batches, the runtime does it
        after the last one). Those of every node are computed once (a frozen set)."""
        if names is None:
            if self._all_derived is None:
                self._all_derived = frozenset(self.param_derived(list(self._by_name)))
            return self._all_derived
        out: set[str] = set()
        for name in names:
            node = self._by_name[name]
            if node.op == "param" or (
                node.is_view
                and node.inputs
                and all(self._by_name[i].op == "param" or i in out for i in node.inputs)
            ):
                out.add(name)
        return out

    def param_roots(self, derived: set[str] | None = None) -> dict[str, str]:
        """Each of `derived` (default `param_derived()`) -> its parameter (a view of a view of
        p -> p; a view of several parameters -> its first input's)."""
        if derived is None:
            derived = self.param_derived()
        out: dict[str, str] = {}
        for node in self.nodes:  # topological: a view after what it views
            if node.name not in derived:
                continue
            if node.op == "param":
                out[node.name] = node.name
            elif ins := [i for i in node.inputs if i in out]:
                out[node.name] = out[ins[0]]
        return out

    def views_of(self, roots: set[str], derived: set[str] | None = None) -> set[str]:
        """`roots` (parameters) and the views of them among `derived` (`param_roots`): the
        values whose gradient is a root's gradient, as FSDP's runtime and prices treat them."""
        if not roots:
            return set()
        return {n for n, r in self.param_roots(derived).items() if r in roots}

    @property
    def num_params(self) -> int:
        return sum(m.numel() for m in self.params.values())

    @property
    def param_bytes(self) -> int:
        return sum(m.nbytes for m in self.params.values())

    @property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes)

    @property
    def flops_per_iteration(self) -> int:
        """Forward + backward FLOPs of one training iteration, without recomputation."""
        return self.fwd_flops + self.bwd_flops

    def saved_activation_bytes(self, nodes: list[OpNode] | None = None) -> int:
        """Bytes kept for backward by `nodes` (default: all), each saved value counted once."""
        nodes = self.nodes if nodes is None else nodes
        values = {v for n in nodes for v in n.saved}
        return sum(self._by_name[v].output_bytes for v in values) + sum(
            n.saved_extra_bytes for n in nodes
        )

    def kinds(self) -> Counter[str]:
        return Counter(n.kind for n in self.ops)

    def fingerprint(self) -> str:
        """Hash of the model's structure: parameter paths, shapes and dtypes, and the op sequence.

        Independent of the batch size (copies made only for memory layout are left out), so a plan made for one global batch is recognised as made
        for this model (principle 5: the runtime refuses a plan made for another model).
        """
        h = hashlib.sha256()
        for path, m in self.params.items():
            h.update(f"{path}:{m.shape}:{m.dtype};".encode())
        for n in self.ops:
            # A copy for layout only (``.contiguous()``) is traced or not depending on the shape:
            # a slice of a batch of one row is already contiguous; a reshape is then a view
            # where it read the copy as ``_unsafe_view`` (Falcon's attention).
            if n.target != "aten.clone.default":
                target = _RESHAPES.get(n.target, n.target)
                h.update(f"{target}|{n.module_path};".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "fingerprint": self.fingerprint(),
            "params": self.num_params,
            "param_bytes": self.param_bytes,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "flops_per_iteration": self.flops_per_iteration,
            "saved_activation_bytes": self.saved_activation_bytes(),
            "nodes_by_kind": dict(sorted(self.kinds().items())),
            "nodes": [n.to_json() for n in self.nodes],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)
