"""Trace an `nn.Module` and an example batch into an `OpGraph` of aten operators.

The model's forward (which returns the training loss) is traced with `make_fx` on fake tensors, so a
model built on the meta device - even one with a trillion parameters - is traced without allocating
weights. The graph is at the aten level that DTensor executes (principle 1): its placeholders are the
parameters (by module path), the buffers and the batch; each `call_function` node is one aten op.

Per node we record the module it came from (global forward hooks write the current module path into
fx's node metadata while tracing) and, from `planner.tracing.op_flops`, FLOPs of forward and backward and the
tensors autograd saves for backward.
"""

from __future__ import annotations

import operator
import os
import traceback
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map

from cost_models.errors import MeshplanError
from planner.tracing.op_flops import VIEW_OPS, measure_op
from planner.tracing.opgraph import OpGraph, OpNode, TensorMeta

_MATMUL = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product",
    "linear",
    "matmul",
    "einsum",
)
_NORM = ("layer_norm", "batch_norm", "group_norm")
_LOSS = ("nll_loss", "log_softmax", "cross_entropy")
_REDUCTION = (
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "cumsum",
    "topk",
    "argmax",
    "var",
    "std",
)


def op_kind(target: Any) -> str:
    """Coarse category of an op, for summaries and for merging followers in the ILP."""
    if target in VIEW_OPS:
        return "view"
    name = getattr(target, "__name__", str(target)).split(".")[0]
    for kind, names in (("matmul", _MATMUL), ("norm", _NORM), ("loss", _LOSS)):
        if any(n in name for n in names):
            return kind
    if "embedding" in name:
        return "embedding"
    if name in _REDUCTION:
        return "reduction"
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return "elementwise"
    return "other"


def _as_batch(example_batch: Any) -> tuple[torch.Tensor, ...]:
    batch = (
        tuple(example_batch)
        if isinstance(example_batch, (tuple, list))
        else (example_batch,)
    )
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise MeshplanError(
                f"example batch item {i} is a {type(t).__name__}; expected tensors (a tensor or a tuple of tensors)"
            )
    return batch


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    # Values never matter: the model is traced with static shapes. Meta tensors become fake CPU tensors
    # so that ops dispatch to the kernels (e.g. CPU flash attention) the runtime will execute.
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _failure_site(exc: BaseException) -> str:
    """The innermost Python line outside torch and meshplan's tracer that was running when tracing failed."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(torch_dir) and f.filename != __file__
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"


def _trace_fx(
    model: nn.Module, batch: tuple[torch.Tensor, ...]
) -> tuple[torch.fx.GraphModule, list[str]]:
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def set_path() -> None:
        fx_traceback.current_meta["custom"] = {
            "module_path": stack[-1] if stack else ""
        }

    def pre(mod: nn.Module, args: Any) -> None:
        stack.append(names.get(id(mod), stack[-1] if stack else ""))
        set_path()

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        stack.pop()
        set_path()

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_params = {k: _fake_like(v) for k, v in params.items()}
        fake_buffers = {k: _fake_like(v) for k, v in buffers.items()}
        fake_batch = tuple(_fake_like(t) for t in batch)

    def loss_fn(p: dict, b: dict, inputs: tuple) -> Any:
        return functional_call(model, {**p, **b}, inputs)

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        with fx_traceback.preserve_node_meta():
            gm = make_fx(loss_fn)(fake_params, fake_buffers, fake_batch)
    finally:
        h1.remove()
        h2.remove()
    paths = list(params) + list(buffers) + [f"batch[{i}]" for i in range(len(batch))]
    return gm, paths


def trace(model: nn.Module, example_batch: Any, *, model_name: str = "") -> OpGraph:
    """Trace `model(*example_batch)` (which must return the loss) into an OpGraph.

    The model's tensors may be real, meta or fake; nothing the size of a parameter is allocated.
    Raises MeshplanError with the op or Python line that failed if the model cannot be traced.
    """
    if not isinstance(model, nn.Module):
        raise MeshplanError(
            f"expected an nn.Module to trace, got {type(model).__name__}"
        )
    batch = _as_batch(example_batch)
    label = model_name or type(model).__name__
    try:
        gm, paths = _trace_fx(model, batch)
    except MeshplanError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise MeshplanError(
            f"cannot trace {label}: {type(exc).__name__}: {first}{_failure_site(exc)}"
        ) from exc
    num_params = sum(1 for _ in model.named_parameters())
    num_buffers = sum(1 for _ in model.named_buffers())
    return _build_graph(gm, paths, num_params, num_buffers, label)


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [
        a
        for a in flat
        if isinstance(a, torch.fx.Node) and _has_tensor(a.meta.get("val"))
    ]


def _has_tensor(val: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(val)[0])


def _build_graph(
    gm: torch.fx.GraphModule,
    paths: list[str],
    num_params: int,
    num_buffers: int,
    label: str,
) -> OpGraph:
    nodes: list[OpNode] = []
    by_name: dict[str, OpNode] = {}
    root: dict[str, str] = {}  # value -> value owning its storage (through views)
    param_of: dict[str, list[str]] = {}  # param-derived value -> parameter paths
    placeholder_paths: dict[str, str] = {}
    params: dict[str, TensorMeta] = {}
    buffers: dict[str, TensorMeta] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(paths):
        raise MeshplanError(
            f"internal error: {len(placeholders)} graph inputs for {len(paths)} model tensors"
        )
    position = {n: j for j, n in enumerate(placeholders)}
    for fx_node in gm.graph.nodes:
        val = fx_node.meta.get("val")
        outs = [
            TensorMeta.of(t)
            for t in tree_flatten(val)[0]
            if isinstance(t, torch.Tensor)
        ]
        path = fx_node.meta.get("custom", {}).get("module_path", "")
        if fx_node.op == "placeholder":
            j = position[fx_node]
            kind = (
                "param"
                if j < num_params
                else "buffer"
                if j < num_params + num_buffers
                else "input"
            )
            placeholder_paths[fx_node.name] = paths[j]
            node = OpNode(
                fx_node.name,
                kind,
                kind,
                kind,
                outputs=outs,
                module_path=paths[j].rpartition(".")[0],
            )
            node.requires_grad = kind == "param"
            (params if kind == "param" else buffers if kind == "buffer" else {})[
                paths[j]
            ] = outs[0]
            if kind == "param":
                param_of[fx_node.name] = [paths[j]]
            root[fx_node.name] = fx_node.name
        elif fx_node.op == "output":
            ins = [
                a.name
                for a in tree_flatten(fx_node.args)[0]
                if isinstance(a, torch.fx.Node)
            ]
            node = OpNode(
                fx_node.name, "output", "output", "output", inputs=ins, module_path=path
            )
        else:
            node = _op_node(fx_node, outs, path, by_name, root, param_of)
        nodes.append(node)
        by_name[node.name] = node
    return OpGraph(nodes, params, buffers, placeholder_paths, gm=gm, model_name=label)


def _op_node(
    fx_node: torch.fx.Node,
    outs: list[TensorMeta],
    path: str,
    by_name: dict[str, OpNode],
    root: dict[str, str],
    param_of: dict[str, list[str]],
) -> OpNode:
    target = fx_node.target
    tin = _tensor_inputs(fx_node)
    name = fx_node.name
    node = OpNode(
        name,
        "call",
        _target_name(target),
        op_kind(target),
        inputs=[a.name for a in tin],
        outputs=outs,
    )
    node.module_path = path
    node.is_view = target in VIEW_OPS
    is_float = any(getattr(torch, o.dtype).is_floating_point for o in outs)
    node.requires_grad = is_float and any(by_name[a.name].requires_grad for a in tin)
    used = sorted({p for a in tin for p in param_of.get(a.name, [])})
    node.params = used
    if node.is_view:
        # A getitem of a multi-output op (e.g. layer norm's output) owns its storage; other views alias.
        owns = target is operator.getitem and not by_name[tin[0].name].is_view
        root[name] = name if owns or not tin else root[tin[0].name]
        if tin and all(a.name in param_of for a in tin):
            param_of[name] = used
        return node
    root[name] = name
    grad_mask = tuple(
        by_name[a.name].requires_grad and a.meta["val"].is_floating_point() for a in tin
    )
    args, kwargs = tree_map(
        lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a,
        (fx_node.args, fx_node.kwargs),
    )
    cost = measure_op(target, args, kwargs, grad_mask)
    node.fwd_flops, node.bwd_flops = cost.fwd_flops, cost.bwd_flops
    node.bytes_read = sum(
        a.meta["val"].numel() * a.meta["val"].element_size() for a in tin
    )
    node.bytes_written = sum(o.nbytes for o in outs)
    saved: set[str] = set()
    for i in cost.saved_inputs:
        r = root[tin[i].name]
        if r not in param_of:
            saved.add(r)
    for j in cost.saved_outputs:
        if len(outs) == 1:
            saved.add(name)
            continue
        picker = next(
            (
                u
                for u in fx_node.users
                if u.target is operator.getitem and u.args[1] == j
            ),
            None,
        )
        if picker is None:
            node.saved_extra_bytes += outs[j].nbytes
        else:
            saved.add(picker.name)
    node.saved = sorted(saved)
    node.saved_extra_bytes += cost.saved_extra_bytes
    return node


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return (
            f"aten.{target._opname}.{target._overloadname}"
            if target.namespace == "aten"
            else str(target)
        )
    return getattr(target, "__name__", str(target))
