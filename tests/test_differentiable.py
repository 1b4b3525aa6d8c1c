"""runtime.differentiable and planner.tracing.op_flops.copy_with_grad: the scatters' and copy's
equivalents give aten's values and the gradients of aten's own derivative formulas (ground truth
on plain tensors, where those formulas run; on DTensors they do not, tests/test_hf.py trains
DeepSeek-V3 through them)."""

from __future__ import annotations

import pytest
import torch

from planner.tracing.op_flops import copy_with_grad
from runtime.differentiable import REGION, scatter

aten = torch.ops.aten

CASES = [
    (aten.slice_scatter.default, (4, 6), (4, 2), (1, 4, 6), {}),
    (aten.slice_scatter.default, (6, 4), (2, 4), (), {"start": 1, "end": 5, "step": 2}),
    (aten.select_scatter.default, (4, 6), (4,), (1, 2), {}),
    (aten.diagonal_scatter.default, (5, 5), (4,), (1,), {}),
]


@pytest.mark.parametrize("op, base_shape, src_shape, args, kwargs", CASES)
def test_scatter_gradients_are_atens(op, base_shape, src_shape, args, kwargs) -> None:
    gen = torch.Generator().manual_seed(0)
    base0 = torch.randn(base_shape, generator=gen, dtype=torch.float64)
    src0 = torch.randn(src_shape, generator=gen, dtype=torch.float64)
    weight = torch.randn(base_shape, generator=gen, dtype=torch.float64)
    outs, grads = [], []
    for f in (op, scatter(op)):
        base, src = base0.clone().requires_grad_(), src0.clone().requires_grad_()
        out = f(base, src, *args, **kwargs)
        (out * weight).sum().backward()
        outs.append(out.detach())
        grads.append((base.grad, src.grad))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(
        grads[0][1], grads[1][1]
    )
    # the region written gets no gradient for the base: the gradient is not simply passed on
    assert not torch.equal(grads[1][0], weight)


def test_scatter_without_source_gradient() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    out = scatter(aten.slice_scatter.default)(base, torch.zeros(4, 2), 1, 0, 2)
    out.sum().backward()
    assert torch.equal(base.grad[:, :2], torch.zeros(4, 2))
    assert torch.equal(base.grad[:, 2:], torch.ones(4, 4))


def test_copy_takes_the_sources_values_and_gradient() -> None:
    """aten.copy broadcasts and casts the source into the base's shape and dtype; its
    gradient, as copy_'s, goes to the source (summed over broadcast rows), none to the base."""
    base = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    src = torch.randn(4, dtype=torch.float32, requires_grad=True)
    out = copy_with_grad(base, src)
    assert out.dtype == torch.float64 and torch.equal(out, aten.copy.default(base, src))
    weight = torch.randn(3, 4, dtype=torch.float64)
    (out * weight).sum().backward()
    assert base.grad is None
    # float32's rounding: the gradient may sum the rows in float32, the reference sums them in
    # float64 and rounds once (unseeded, the default atol of 1e-8 failed 4 draws in 2000 where a
    # row sum lay near 0: 2.4e-7 apart)
    assert torch.allclose(src.grad, weight.sum(0).float(), atol=1e-6)


def test_regions_match_their_scatters() -> None:
    """Each scatter's region op reads exactly the elements the scatter writes."""
    for op, base_shape, src_shape, args, kwargs in CASES:
        base = torch.zeros(base_shape)
        written = op(base, torch.ones(src_shape), *args, **kwargs)
        region = REGION[op](written, *args, **kwargs)
        assert torch.equal(region, torch.ones(src_shape))
        assert written.sum() == region.numel()
