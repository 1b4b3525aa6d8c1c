"""Sharding rules, in DTensor's single-dim form, for backward ops that DTensor (torch 2.13) can
neither run by a rule nor propagate through a decomposition, while it runs their forward ops
sharded: before these, a plan that sharded one failed at its first backward. The planner prices a
backward from its forward op and never meets these ops; the rules only let DTensor run them as
planned. `planner.vocab.dtensor_ext.register_missing_rules` registers them (`BACKWARD_RULES`).

Each rule lists [outputs..., tensor inputs...] placements per mesh axis: `_ShardingPlaceholder(d)`
for a shard of dim d, and a Partial gradient wherever the backward is linear in grad_output (every
op here is: grad_input = grad_output times something of the forward's input)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import Partial, Replicate

aten = torch.ops.aten


def _linear_in_grad(outputs: int, others: int) -> list:
    """The rule every op here has: its `outputs` Partial from grad_output Partial, its `others`
    tensor inputs replicated."""
    return [Partial()] * (outputs + 1) + [Replicate()] * others


#: Elementwise activations: ReLU6 and Hardtanh, Hardswish, Hardsigmoid, LogSigmoid (xLSTM's
#: gates), Softshrink, Hardshrink.
ELEMENTWISE_BACKWARD = (
    aten.hardtanh_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.log_sigmoid_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
)


def _elementwise_backward_rules(
    op: Any, args_schema: tuple, kwargs_schema: dict
) -> list:
    """[grad_input, grad_output, self, (buffer)] of an `ELEMENTWISE_BACKWARD` op: all sharded
    alike along any dimension (each output element reads the same element of every input),
    or grad_output Partial with the rest replicated (grad_input = grad_output * f'(self) is
    linear in grad_output). A tensor of another shape (log_sigmoid_backward's ``buffer``,
    empty on CUDA) is replicated."""
    shape = args_schema[0].shape
    tensors = [a for a in args_schema if hasattr(a, "shape")]
    rules = [
        [_ShardingPlaceholder(d)]
        + [
            _ShardingPlaceholder(d) if t.shape == shape else Replicate()
            for t in tensors
        ]
        for d in range(len(shape))
    ]
    return [*rules, _linear_in_grad(1, len(tensors) - 1)]


#: Pooling with no backward rule: AvgPool (and LocalResponseNorm, which pools), AdaptiveMaxPool;
#: value -> the number of pooled (trailing) dimensions.
POOL_BACKWARD = {
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d_backward.default: 3,
}


def _pool_backward_rules(op: Any, args_schema: tuple, kwargs_schema: dict) -> list:
    """[grad_input, grad_output, self, (indices)]: all sharded alike along a dimension that is
    not pooled (batch or channels), as DTensor's rule for ``max_pool2d_with_indices_backward``;
    or grad_output Partial, the rest replicated (the backward is linear in grad_output)."""
    tensors = sum(hasattr(a, "shape") for a in args_schema)
    kept = len(args_schema[0].shape) - POOL_BACKWARD[op]
    rules = [[_ShardingPlaceholder(d)] * (tensors + 1) for d in range(kept)]
    return [*rules, _linear_in_grad(1, tensors - 1)]


def _prelu_backward_rules(op: Any, args_schema: tuple, kwargs_schema: dict) -> list:
    """[grad_input, grad_weight, grad_output, self, weight] of PReLU's backward: grad_output and
    self sharded alike along a dimension the weight does not run along (all but the channels,
    dim 1, unless one weight serves all), the weight replicated and its gradient Partial; or
    grad_output Partial, self and weight replicated, both gradients Partial."""
    shape, weight = args_schema[1].shape, args_schema[2].shape
    s, R, P = _ShardingPlaceholder, Replicate(), Partial()
    dims = [d for d in range(len(shape)) if d != 1 or math.prod(weight) == 1]
    return [[s(d), P, s(d), s(d), R] for d in dims] + [_linear_in_grad(2, 2)]


def _group_norm_backward_rules(
    op: Any, args_schema: tuple, kwargs_schema: dict
) -> list:
    """``native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group,
    output_mask) -> (grad_input, grad_weight, grad_bias)``: grad_out, input, mean and rstd
    sharded along the batch (dim 0), as DTensor's rule for the forward, the weight replicated and
    its gradients Partial; or grad_out Partial, the rest replicated. An output the mask leaves
    out is None. The batch size and HxW given as numbers are made local by DTensor's adjuster of
    the forward's (`SHARES_ADJUSTER`)."""
    weight, mask = args_schema[4], args_schema[-1]
    s, R, P = _ShardingPlaceholder(0), Replicate(), Partial()
    rows = [([s, P, P], [s] * 4), ([P, P, P], [P, R, R, R])]  # (outputs, tensor inputs)
    extra = [R] if weight is not None else []
    return [
        [o if m else None for o, m in zip(out, mask)] + ins + extra for out, ins in rows
    ]


#: backward op -> the forward op whose adjuster of numbers given for shapes (DTensor's
#: ``op_to_scalar_shape_adjuster``) it needs too: GroupNorm's batch size N and HxW, which must be
#: the local ones when sharded (DTensor adjusts them for the forward only)
SHARES_ADJUSTER = {
    aten.native_group_norm_backward.default: aten.native_group_norm.default,
}

#: op -> its rule
BACKWARD_RULES = (
    dict.fromkeys(ELEMENTWISE_BACKWARD, _elementwise_backward_rules)
    | dict.fromkeys(POOL_BACKWARD, _pool_backward_rules)
    | {
        aten._prelu_kernel_backward.default: _prelu_backward_rules,
        aten.native_group_norm_backward.default: _group_norm_backward_rules,
    }
)
