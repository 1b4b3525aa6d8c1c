"""FLOPs and saved-for-backward tensors of one aten op, measured by running it on fake tensors.

For every distinct (op, input shapes, arguments) we run the op once forward and once backward with
autograd on fake tensors: `FlopCounterMode` counts FLOPs, and `saved_tensors_hooks` sees exactly which
tensors autograd keeps for backward. Results are cached, so a 48-layer transformer costs a few dozen
runs. Nothing is allocated: the tensors are fake.

What PyTorch lacks: FlopCounterMode has no formula for the CPU flash-attention kernel
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), which is what
`F.scaled_dot_product_attention` dispatches to on CPU tensors. We register PyTorch's own SDPA
formulas for it. The backward formula is PyTorch's minus the kernel's recomputation of the score
matrix: we count model FLOPs (forward + backward, no recomputation), so attention's backward is
twice its forward, as for every other matrix product.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter as fc
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# Ops that return a view of (alias) their first input: no FLOPs, no bytes moved, no saved storage.
VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.chunk.default,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.unflatten.int,
    aten.flatten.using_ints,
    aten.diagonal.default,
    aten.narrow.default,
    operator.getitem,
}


def _sdpa_cpu_fwd(
    query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return fc.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_bwd(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    b, h, s_q, d_q = query_shape
    s_k = key_shape[2]
    recompute_scores = fc.bmm_flop((b * h, s_q, d_q), (b * h, d_q, s_k))
    return (
        fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
        - recompute_scores
    )


def _grouped_mm_fwd(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """``input[S, k] @ weight[E, k, n]`` by groups of rows: each row meets one expert's matrix."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _grouped_mm_bwd(input_shape, weight_shape, offs_shape, grad_shape, **kwargs) -> int:
    """The input's and the weight's gradient: two grouped products of the forward's size."""
    return 2 * _grouped_mm_fwd(input_shape, weight_shape)


CUSTOM_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
    aten._grouped_mm: _grouped_mm_fwd,
}


def _custom_flops() -> dict:
    """CUSTOM_FLOPS plus the grouped product that Hugging Face ``transformers`` registers
    (``transformers::grouped_mm_fallback``) once it is imported. What PyTorch lacks: a FLOP
    formula for grouped matrix products."""
    ops = getattr(torch.ops, "transformers", None)
    try:
        fwd, bwd = ops.grouped_mm_fallback, ops.grouped_mm_fallback_backward
    except AttributeError:
        return CUSTOM_FLOPS
    return {**CUSTOM_FLOPS, fwd: _grouped_mm_fwd, bwd: _grouped_mm_bwd}


@dataclass(frozen=True)
class OpCost:
    """Measured facts of one op call.

    `saved_inputs` / `saved_outputs` are indices of the op's tensor inputs (flattened args order) and
    outputs that autograd keeps for backward; `saved_extra_bytes` covers other saved tensors.
    """

    fwd_flops: int
    bwd_flops: int
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    saved_extra_bytes: int


def _signature(
    target: Any, args: tuple, kwargs: dict, grad_mask: tuple[bool, ...]
) -> tuple:
    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(key(y) for y in x)
        if isinstance(x, dict):
            return tuple(sorted((k, key(v)) for k, v in x.items()))
        return repr(x)

    return (target, key(args), key(kwargs), grad_mask)


_cache: dict[tuple, OpCost] = {}


def copy_with_grad(
    base: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """``aten.copy(base, src)`` with a gradient: `base`'s shape, dtype and placement, `src`'s
    values. ``aten.copy``, what a traced in-place ``copy_`` into a tensor becomes (Hugging Face's
    DeepSeek-V3 writes its rotary part so), has no derivative formula in torch; this one's are
    ``copy_``'s: the incoming gradient for `src` (summed over broadcast dimensions), none for
    `base`, whose values are all overwritten. Measured so here, run so by the runtime
    (`runtime.differentiable`)."""
    return base.detach().clone().copy_(src, non_blocking)


#: Ops measured through a differentiable equivalent (`copy_with_grad`).
_MEASURED_AS = {torch.ops.aten.copy.default: copy_with_grad}


def measure_op(
    target: Any, args: tuple, kwargs: dict, grad_mask: tuple[bool, ...]
) -> OpCost:
    """FLOPs and saved tensors of `target(*args, **kwargs)`; `args` hold example (fake) tensors.

    `grad_mask[i]` says whether the i-th tensor input (in flattened order) requires grad; backward
    FLOPs are those of computing the gradients of exactly those inputs.
    """
    sig = _signature(target, args, kwargs, grad_mask)
    if sig not in _cache:
        _cache[sig] = _measure(target, args, kwargs, grad_mask)
    return _cache[sig]


def _measure(
    target: Any, args: tuple, kwargs: dict, grad_mask: tuple[bool, ...]
) -> OpCost:
    if target in VIEW_OPS:
        return OpCost(0, 0, (), (), 0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs: list[torch.Tensor] = []

        def fresh(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
            if grad_mask[len(inputs)]:
                t.requires_grad_(True)
            inputs.append(t)
            return t

        f_args, f_kwargs = tree_map(fresh, (args, kwargs))
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not any(t is s for s in saved):
                saved.append(t)
            return t

        fwd = fc.FlopCounterMode(display=False, custom_mapping=_custom_flops())
        with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _MEASURED_AS.get(target, target)(*f_args, **f_kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        diff_outs = [o for o in outs if o.requires_grad]
        grad_inputs = [t for t in inputs if t.requires_grad]
        bwd_flops = 0
        if diff_outs and grad_inputs:
            bwd = fc.FlopCounterMode(display=False, custom_mapping=_custom_flops())
            with bwd:
                torch.autograd.grad(
                    diff_outs,
                    grad_inputs,
                    [torch.empty_like(o) for o in diff_outs],
                    allow_unused=True,
                )
            bwd_flops = bwd.get_total_flops()
        del mode
    saved_in: set[int] = set()
    saved_out: set[int] = set()
    extra = 0
    for s in saved:
        base = s._base if s._is_view() else s
        hit = next((i for i, t in enumerate(inputs) if t is s or t is base), None)
        if hit is not None:
            saved_in.add(hit)
            continue
        hit = next((i for i, o in enumerate(outs) if o is s or o is base), None)
        if hit is not None:
            saved_out.add(hit)
            continue
        extra += s.numel() * s.element_size()
    return OpCost(
        fwd.get_total_flops(),
        bwd_flops,
        tuple(sorted(saved_in)),
        tuple(sorted(saved_out)),
        extra,
    )
