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

import contextlib
import logging
import operator
import os
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map

from cost_models.errors import MeshplanError
from planner.tracing.calls import batch_tuple, call_for_loss, tracing_patches
from planner.tracing.constants import inline_constants
from planner.tracing.op_flops import VIEW_OPS, measure_op
from planner.tracing.opgraph import OpGraph, OpNode, TensorMeta
from planner.tracing.repeat import repeated_trace

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
    example_batch = batch_tuple(example_batch)
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
    here = os.path.dirname(__file__)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, here))
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"


_TORCH_DIR = os.path.dirname(torch.__file__)
#: How torch's shape checks word a mismatch (broadcasting, matrix products, views, cat).
_SHAPE_ERRORS = (
    "must match the size",
    "must have same reduction dim",
    "shapes cannot be multiplied",
    "is invalid for input of size",
    "Sizes of tensors must match",
    "size mismatch",
    "Expected size",
)
_DATA_DEPENDENT = (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "GuardOnDataDependentSymNode",
)


def _trace_failure(label: str, exc: BaseException) -> str:
    """One message for a model that cannot be traced: the module and the op that failed, the
    Python line, and what to do."""
    kind = type(exc).__name__
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    module = getattr(exc, "meshplan_module", "")
    where = f" in module {module!r}" if module else " in the model's top-level forward"
    func = getattr(exc, "func", None)
    op = f" (op {func})" if func is not None else ""
    if kind in _DATA_DEPENDENT or "data-dependent" in first.lower():
        advice = (
            "meshplan traces with static shapes on fake tensors, so Python control flow on tensor "
            "values (`if x.sum() > 0`, `.item()`, `.tolist()`, `nonzero`, boolean-mask indexing) "
            "cannot be planned: compute both branches and pick with torch.where, or make the "
            "decision outside forward"
        )
    elif kind == "UnsupportedOperatorException" or "dtype" in first.lower():
        advice = (
            "the op has no implementation for these inputs on fake tensors; check the dtypes "
            "(e.g. grouped matrix products want bfloat16: plan with --dtype bf16) or replace the "
            "op with standard torch operations"
        )
    elif kind == "RuntimeError" and any(s in first for s in _SHAPE_ERRORS):
        advice = (
            "the model fails on these shapes as it would when run: check that its sizes agree "
            "(the heads divide the hidden size, the query heads are a multiple of the key/value "
            "heads, each layer's input features match the one before) and that the example "
            "batch has the shape forward expects"
        )
    else:
        advice = "the model must run under torch.func.functional_call on fake tensors"
    return f"cannot trace {label}{where}{op}: {kind}: {first}{_failure_site(exc)}. {advice}"


def _trace_fx(
    model: nn.Module, batch: tuple[torch.Tensor, ...]
) -> tuple[torch.fx.GraphModule, list[str]]:
    """The aten graph of `model`'s loss on `batch` and its placeholders' paths; a deep stack of
    repeated blocks is traced three units deep and repeated (`planner.tracing.repeat`)."""
    return repeated_trace(model, batch, _make_fx) or _make_fx(model, batch)


def _make_fx(
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
        return call_for_loss(
            model, inputs, lambda m, a, k: functional_call(m, {**p, **b}, a, k)
        )

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        with fx_traceback.preserve_node_meta(), tracing_patches(model):
            gm = make_fx(loss_fn)(fake_params, fake_buffers, fake_batch)
    except Exception as exc:
        exc.meshplan_module = stack[-1] if stack else ""  # type: ignore[attr-defined]
        raise
    finally:
        h1.remove()
        h2.remove()
    _training_kernels(gm)
    if any(_mutates(n) for n in gm.graph.nodes):
        gm = _functionalized(gm)
    paths = list(params) + list(buffers) + [f"batch[{i}]" for i in range(len(batch))]
    _drop_input_writes(gm, paths, len(params))
    inline_constants(gm)
    return gm, paths


#: Inference-only kernel -> the training kernel of the same schema and outputs. The parameters are
#: traced as fake tensors that do not require grad, so an op that picks a kernel by whether its
#: weight requires grad traces to the one that saves nothing for backward and has no autograd
#: formula (``nn.EmbeddingBag``: then measuring its FLOPs failed with "Autograd not support
#: dtype: Long"). The runtime trains: the graph gets the training kernel.
TRAINING_KERNELS = {
    torch.ops.aten._embedding_bag_forward_only.default: torch.ops.aten._embedding_bag.default,
}


def _training_kernels(gm: torch.fx.GraphModule) -> None:
    """Replace `TRAINING_KERNELS`' inference-only kernels in `gm` by their training ones."""
    replaced = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in TRAINING_KERNELS:
            node.target = TRAINING_KERNELS[node.target]
            replaced = True
    if replaced:
        gm.recompile()


def _mutates(node: torch.fx.Node) -> bool:
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def _functionalized(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` re-traced with its in-place ops (``relu_``, ``h += x``, ``masked_fill_``) replaced by
    their out-of-place forms, so every node is a value the planner can place and autograd can
    differentiate on the runtime's DTensors. The graph is re-traced, not the model: the model's
    Python (which may test whether it runs on fake tensors) ran once, in the first trace, and each
    node keeps the module path of the node it came from."""
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]

    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():
        return make_fx(functionalize(run, remove="mutations"))(*inputs)


def _drop_input_writes(
    gm: torch.fx.GraphModule, paths: list[str], num_params: int
) -> None:
    """Remove the ``copy_`` into graph inputs that functionalization appends for a forward that
    writes its buffers (BatchNorm's ``num_batches_tracked``): the planner and the runtime treat
    buffers as read-only inputs. A write to a parameter is an error; dropped buffer writes warn."""
    position = {
        n: j for j, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
    }
    dropped = []
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.aten.copy_.default:
            continue
        dst = node.args[0]
        if dst not in position:
            continue
        path = paths[position[dst]]
        if position[dst] < num_params:
            raise MeshplanError(
                f"the model's forward writes its parameter {path!r} in place; meshplan trains "
                "parameters only through the optimizer: compute a new tensor instead"
            )
        dropped.append(path)
        gm.graph.erase_node(node)
    if dropped:
        warnings.warn(
            f"the model's forward updates {', '.join(sorted(dropped))} in place (e.g. BatchNorm "
            "running statistics); meshplan's runtime does not write buffers back, so they keep "
            "their initial values (training losses are unaffected)",
            stacklevel=3,
        )
    gm.recompile()


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
        with _fake_tensor_log_held():
            gm, paths = _trace_fx(model, batch)
    except MeshplanError:
        raise
    except Exception as exc:
        raise MeshplanError(_trace_failure(label, exc)) from exc
    num_params = sum(1 for _ in model.named_parameters())
    num_buffers = sum(1 for _ in model.named_buffers())
    return _build_graph(gm, paths, num_params, num_buffers, label)


@contextlib.contextmanager
def _fake_tensor_log_held() -> Iterator[None]:
    """Hold back FakeTensorMode's log while tracing: when an op's shape check fails it logs
    the whole traceback from inside torch ("failed while attempting to run meta for ...")
    before raising, and `trace` reports that error itself in one line (`_trace_failure`)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


_SAMPLERS = (
    "bernoulli",
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "normal",
    "uniform",
    "exponential",  # PhiMoE's sparse mixer samples its routing in training
    "cauchy",
    "log_normal",
    "geometric",
    "multinomial",
)


def is_random(target: Any) -> bool:
    """Whether an aten op is a random sample (dropout's ``bernoulli`` mask, ``rand_like``): its
    output depends on the random generator and carries no gradient."""
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace == "aten"
        and target._opname.rstrip("_") in _SAMPLERS
    )


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
            _check_attention_mask(fx_node, by_name, path, label)
            node = _op_node(fx_node, outs, path, by_name, root, param_of)
        nodes.append(node)
        by_name[node.name] = node
    return OpGraph(nodes, params, buffers, placeholder_paths, gm=gm, model_name=label)


_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _check_attention_mask(
    fx_node: torch.fx.Node, by_name: dict[str, OpNode], path: str, label: str | None
) -> None:
    """Refuse CPU flash attention given a mask that needs a gradient (one computed from
    parameters, as Doge's dynamic mask is). The trace runs without gradients, so
    ``scaled_dot_product_attention`` picks the CPU flash kernel. That kernel has no gradient for
    its mask; in training, PyTorch picks the math kernel for such a mask instead."""
    mask = fx_node.kwargs.get("attn_mask")
    if not (
        fx_node.target is _SDPA_CPU
        and isinstance(mask, torch.fx.Node)
        and by_name[mask.name].requires_grad
    ):
        return
    raise MeshplanError(
        f"cannot trace {label or 'the model'} in module {path!r}: its "
        "scaled_dot_product_attention gets a mask computed from parameters, which needs a "
        "gradient, and the fused attention kernel meshplan traces has none for a mask; build "
        "the model with eager attention (add attn=eager to an hf: spec, or pass "
        "attn_implementation='eager' to transformers)"
    )


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
    # A random sample (dropout's bernoulli mask) carries no gradient to the tensor it is shaped like.
    node.requires_grad = (
        is_float
        and not is_random(target)
        and any(by_name[a.name].requires_grad for a in tin)
    )
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
        not is_random(target)
        and by_name[a.name].requires_grad
        and a.meta["val"].is_floating_point()
        for a in tin
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
        elif tin[i].name not in node.saved_params:
            node.saved_params.append(tin[i].name)
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
