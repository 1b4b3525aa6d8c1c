"""Aten ops whose backward does not run on DTensors, or does not exist, run through equivalents
whose backward does (`differentiable_targets`, used by `runtime.executor.PlanExecutor`).

What PyTorch lacks: the derivative formulas of the scatter ops that functionalization writes for
in-place writes into part of a tensor (``x[..., a:b] = y`` -> ``aten.slice_scatter``, ``x[:, i] =
y`` -> ``aten.select_scatter``, a diagonal -> ``aten.diagonal_scatter``) build the zeros of the
source's shape from its sizes alone, a plain tensor, and DTensor refuses to mix it with the
DTensor gradient ("got mixed torch.Tensor and DTensor"). ``aten.copy``, what a traced ``copy_``
into a whole tensor becomes, has no derivative formula at all. Hugging Face's DeepSeek-V3 writes
its rotary half of the query and key so. The equivalents compute the same values and the same
gradients as the formulas: the region's gradient for the source, the gradient with the region
zeroed (zeros made like the region of the gradient, a DTensor) for the tensor written into;
``aten.copy`` runs as the tracer measured it (`planner.tracing.op_flops.copy_with_grad`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from planner.tracing.op_flops import copy_with_grad

aten = torch.ops.aten

#: scatter op -> the view op that reads the region it writes (the same arguments after `src`)
REGION = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
}


class _Scatter(torch.autograd.Function):
    """``scatter(base, src, *where)`` with its gradients written from `region` (module
    docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        scatter: Any,
        region: Any,
        base: torch.Tensor,
        src: torch.Tensor,
        *where: Any,
    ) -> torch.Tensor:
        ctx.ops, ctx.where = (scatter, region), where
        return scatter(base, src, *where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scatter, region = ctx.ops
        part = region(grad, *ctx.where)
        base = None
        if ctx.needs_input_grad[2]:
            base = scatter(grad, torch.zeros_like(part), *ctx.where)
        src = part if ctx.needs_input_grad[3] else None
        return (None, None, base, src, *(None,) * len(ctx.where))


def _positional(op: Any, args: tuple, kwargs: dict) -> list:
    """`op`'s arguments in its schema's order, defaults filled in."""
    out = list(args)
    for a in op._schema.arguments[len(args) :]:
        out.append(kwargs.get(a.name, a.default_value))
    return out


def scatter(op: Any) -> Callable[..., Any]:
    """`op` (a key of `REGION`) with the gradients of the module docstring."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return _Scatter.apply(op, REGION[op], *_positional(op, args, kwargs))

    return run


def differentiable_targets(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Any]:
    """The nodes of `gm` to run through the equivalents above, with their callables."""
    out: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in REGION:
            out[n] = scatter(n.target)
        elif n.target is aten.copy.default:
            out[n] = copy_with_grad
    return out
