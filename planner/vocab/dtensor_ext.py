"""The DTensor side of the plan vocabulary: placement strings to and from DTensor's placements, and
the rules the planner and the runtime both need, registered in DTensor itself.

What PyTorch lacks: no sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward), the kernel that ``F.scaled_dot_product_attention`` uses on CPU; its
decomposition cannot be traced by DTensor when ``is_causal`` (the mask is built by factory ops).
`register_missing_rules` registers, in DTensor's own single-dim registry, the strategies PyTorch
registers for the CUDA flash kernel: batch-sharded S(0) and head-sharded S(1) q/k/v/outputs
(dropout_p == 0 only), for the functional ``bernoulli.p`` of dropout, and for transformers'
per-expert grouped product (``transformers::grouped_mm_fallback``) those of ``aten._grouped_mm``.
The planner enumerates strategies after calling it; the runtime calls it before running a plan,
so that DTensor runs these ops exactly as planned.

An op the planner could not shard (no DTensor strategy) is planned replicated ("fallback");
`register_fallback` lets DTensor run it that way, with DTensor's own ``replicate_op_strategy``,
and the ops its backward calls that have no strategy either (`backward_ops`). Registered in
DTensor, that holds for every call of those ops in the process, not only the plan's node: a
backward op another, sharded op also calls runs replicated there too (correct, and priced as
sharded). The rules for backward ops of sharded forward ops that DTensor lacks are
`planner.vocab.backward_rules`'.
`registrations()` counts the registrations made here, so that a cache of strategies can tell when
DTensor's registries changed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder,
    register_single_dim_strategy,
)
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from planner.vocab.backward_rules import BACKWARD_RULES, SHARES_ADJUSTER
from planner.vocab.placements import PARTIAL_OPS

aten = torch.ops.aten
_registered = [0]
# torch 2.13 refuses uneven single-dim shardings unless told; earlier versions (2.11) have no such
# argument and take them.
_UNEVEN = (
    {"allow_uneven_sharding": True}
    if "allow_uneven_sharding"
    in inspect.signature(register_single_dim_strategy).parameters
    else {}
)


def placement_to_str(p: Placement, strided: bool = False) -> str | None:
    """``Replicate() -> "R"``, ``Shard(d) -> "S(d)"``, ``Partial("sum") -> "P"``, ``Partial(op) -> "P(op)"``.

    Partial subclasses keep their kind: ``_MaskPartial`` is ``"P(mask)"`` and ``_NormPartial`` is
    ``"P(norm)"``. `_StridedShard` with split factor 1 lays the tensor out as ``Shard`` does:
    ``"S(d)"`` (`planner.vocab.nested_views`); any other has no string (None), unless
    ``strided=True`` (then ``"S(d)"`` too). The planner drops strategies using either
    (`planner.intra.strategies`).
    """
    if isinstance(p, _StridedShard):
        return f"S({p.dim})" if strided or p.split_factor == 1 else None
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        kind = type(p).__name__
        if kind == "_MaskPartial":
            return "P(mask)"
        if kind == "_NormPartial":
            return "P(norm)"
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return None


def str_to_placement(s: str) -> Placement:
    """Inverse of `placement_to_str` for "R", "S(d)", "P" and "P(op)" with op in `PARTIAL_OPS`."""
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial("sum")
    if s.startswith("S(") and s.endswith(")") and s[2:-1].isdigit():
        return Shard(int(s[2:-1]))
    if s.startswith("P(") and s.endswith(")") and s[2:-1] in PARTIAL_OPS:
        return Partial(s[2:-1])
    raise ValueError(f"placement {s!r} cannot be converted to a DTensor placement")


def registrations() -> int:
    """How many strategies this module has registered in DTensor so far."""
    return _registered[0]


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def _has_strategy(op: Any) -> bool:
    sp = _propagator()
    return op in sp.op_single_dim_strategy_funcs or op in sp.op_strategy_funcs


def _sdpa_cpu_rules(
    args_schema: tuple, kwargs_schema: dict, first_qkv: int, n_out: int, n_in: int
) -> list:
    """Batch (S(0)) and head (S(1)) sharding, as PyTorch registers for the CUDA flash kernel.

    Tensor inputs: forward (q, k, v), backward (grad_out, q, k, v, out, logsumexp), then the
    optional ``attn_mask`` kwarg, which broadcasts from the right: its batch/head dims are
    sharded like q's when present with size > 1, else replicated. Under grouped-query attention
    (k and v with fewer heads than q, a divisor of them: Hugging Face's Llama family hands them
    to the kernel so) the heads are split too: an even split gives each device a run of whole
    groups, the q heads ``[i * g, (i + 1) * g)`` for every k/v head ``i`` it holds (g = q heads
    / k heads), so the kernel's local grouping is the global one. Both DTensor (these rules are
    registered without uneven sharding) and the planner refuse an uneven split. Not offered:
    dropout (random ops need DTensor's RNG tracker).
    """
    dropout_p = args_schema[n_in] if len(args_schema) > n_in else 0.0
    if dropout_p:
        return []
    q, k, v = args_schema[first_qkv : first_qkv + 3]
    mask = kwargs_schema.get("attn_mask")
    rules = []
    for dim in (0, 1):
        if dim == 1 and not (k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0):
            continue
        rule: list = [_ShardingPlaceholder(dim)] * (n_out + n_in)
        if mask is not None:
            mdim = dim - (len(q.shape) - len(mask.shape))
            sharded = mdim >= 0 and mask.shape[mdim] > 1
            rule.append(_ShardingPlaceholder(mdim) if sharded else Replicate())
        rules.append(rule)
    return rules


def register_missing_rules() -> None:
    """Register in DTensor the strategies PyTorch 2.13 lacks (module docstring), and those of
    transformers' grouped product once it is imported (`_register_grouped_fallback`).
    Idempotent."""
    _register_aten_rules()
    if not _grouped_done[0]:
        _register_grouped_fallback()


@functools.cache
def _register_aten_rules() -> None:
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if not _has_strategy(fwd):
        _registered[0] += 1

        @register_single_dim_strategy(
            fwd, schema_info=RuntimeSchemaInfo(3, static_kwargkey=["scale"])
        )
        def _sdpa_cpu(op: Any, args_schema: tuple, kwargs_schema: dict) -> list:
            # [output, logsumexp, q, k, v, (attn_mask)]
            return _sdpa_cpu_rules(args_schema, kwargs_schema, 0, 2, 3)

    if not _has_strategy(bwd):
        _registered[0] += 1

        @register_single_dim_strategy(
            bwd, schema_info=RuntimeSchemaInfo(6, static_kwargkey=["scale"])
        )
        def _sdpa_cpu_backward(
            op: Any, args_schema: tuple, kwargs_schema: dict
        ) -> list:
            # [grad_q, grad_k, grad_v, grad_out, q, k, v, out, logsumexp, (attn_mask)]
            return _sdpa_cpu_rules(args_schema, kwargs_schema, 1, 3, 6)

    # A random sample shaped like its input (dropout's functional ``bernoulli.p``, PhiMoE's
    # ``exponential``): any sharding of the input, the output alike (DTensor registers this for
    # the in-place overloads, ``bernoulli_``, ``exponential_``, but not for the functional ones).
    # Its values come from `runtime.dropout`, which slices one device's sample by the planned
    # placement, so every sharding gives one device's numbers.
    for op in SHAPE_ONLY_SAMPLERS:
        if not _has_strategy(op):
            _registered[0] += 1
            register_single_dim_strategy(op, **_UNEVEN)(_like_input)
    # ``aten.copy(self, src)``, what a traced in-place ``copy_`` into a tensor becomes (Qwen3.5's
    # gated delta rule): DTensor has ``copy_`` only.
    if not _has_strategy(aten.copy.default):
        _registered[0] += 1
        register_single_dim_strategy(aten.copy.default, **_UNEVEN)(_copy_rules)
    for op, rules in BACKWARD_RULES.items():
        if not _has_strategy(op):
            _registered[0] += 1
            register_single_dim_strategy(op, **_UNEVEN)(rules)
    adjusters = _propagator().op_to_scalar_shape_adjuster
    for op, forward in SHARES_ADJUSTER.items():
        if forward in adjusters:
            adjusters.setdefault(op, adjusters[forward])


#: Samplers whose tensor input gives only a shape, dtype and layout (its values are not read):
#: `runtime.dropout` draws them ahead at the global batch, and those without a DTensor strategy
#: get `_like_input`'s.
SHAPE_ONLY_SAMPLERS = frozenset(
    {
        aten.bernoulli.p,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.randint_like.default,
        aten.randint_like.low_dtype,
        aten.uniform.default,
        aten.exponential.default,
        aten.cauchy.default,
        aten.log_normal.default,
        aten.geometric.default,
    }
)


def _like_input(op: Any, args_schema: tuple, kwargs_schema: dict) -> list:
    """Output sharded as the input, along any of its dimensions; no Partial input."""
    return [[_ShardingPlaceholder(d)] * 2 for d in range(len(args_schema[0].shape))]


def _copy_rules(op: Any, args_schema: tuple, kwargs_schema: dict) -> list:
    """[output, self, src] of ``aten.copy``: the output has self's shape and placement; `src`
    broadcasts from the right, sharded along the same dimension where it has self's size and
    replicated where it broadcasts (size 1 or absent)."""
    shape, src = args_schema[0].shape, args_schema[1].shape
    off = len(shape) - len(src)
    rules = []
    for d in range(len(shape)):
        k = d - off
        if k >= 0 and src[k] == shape[d]:
            rules.append([_ShardingPlaceholder(d)] * 2 + [_ShardingPlaceholder(k)])
        elif k < 0 or src[k] == 1:
            rules.append([_ShardingPlaceholder(d)] * 2 + [Replicate()])
    return rules


_grouped_done = [False]


def _register_grouped_fallback() -> None:
    """Strategies for ``transformers::grouped_mm_fallback(input[S, k], weight[E, k, n], offs[E])``,
    the grouped product transformers runs where ``torch._grouped_mm`` does not apply (weights not
    in bfloat16: `planner.tracing.calls.tracing_patches`), and for its ``..._backward`` (input,
    weight, offs, grad_output) -> (grad_input, grad_weight), which its autograd formula calls.
    Without them a mixture of experts' experts were planned replicated in float32 and float16.
    The forward gets the single-dim shardings DTensor gives ``aten._grouped_mm`` for a 2-D input
    and 3-D weight (`torch.distributed.tensor._ops._matrix_ops.grouped_mm_strategy`): the
    weight's columns (output S(1)) or its rows with the input's columns (output Partial), and
    one Partial input with the other replicated; `offs` is always replicated. The fallback runs
    one ``torch.mm`` per expert on the local shards, so uneven shards and any strides do.
    The backward's rules are the forward's read through ``grad_input = grad_out @ weight^T``
    and ``grad_weight = input^T @ grad_out`` per expert."""
    ops = torch.ops.transformers
    try:
        fwd, bwd = (
            ops.grouped_mm_fallback.default,
            ops.grouped_mm_fallback_backward.default,
        )
    except AttributeError:
        return  # transformers' MoE integration not imported (yet)
    _grouped_done[0] = True
    R, P, s = Replicate(), Partial(), _ShardingPlaceholder

    # [out, input, weight, offs]
    forward = [[s(1), R, s(2), R], [P, s(1), s(1), R], [P, P, R, R], [P, R, P, R]]
    # [grad_input, grad_weight, input, weight, offs, grad_output]
    backward = [
        [P, s(2), R, s(2), R, s(1)],
        [s(1), s(1), s(1), s(1), R, R],
        [P, P, R, R, R, P],
        [R, P, P, R, R, R],
        [P, R, R, P, R, R],
    ]
    for op, rules in ((fwd, forward), (bwd, backward)):
        if not _has_strategy(op):
            _registered[0] += 1
            register_single_dim_strategy(op, **_UNEVEN)(
                lambda op, args, kwargs, rules=rules: rules
            )


def register_fallback(
    op: torch._ops.OpOverload, example: tuple[tuple, dict] | None = None
) -> bool:
    """Let DTensor run `op` replicated, as a plan's fallback assumes (DTensor's own
    ``replicate_op_strategy``; not for view ops or ops returning a list), and the ops its
    backward calls that DTensor has no strategy for (`backward_ops` on `example`, the op's
    (args, kwargs) on the meta device; LSTM's ``mkldnn_rnn_layer_backward``, Unfold's
    ``col2im``): the backward of a replicated op gets replicated inputs, which DTensor cannot
    run otherwise. Returns False if DTensor already had a strategy for `op`."""
    new = _replicated(op)
    for b in backward_ops(op, *example) if example is not None else ():
        _replicated(b)
    return new


def _replicated(op: torch._ops.OpOverload) -> bool:
    from torch.distributed.tensor._ops.utils import replicate_op_strategy

    sp = _propagator()
    if (
        _has_strategy(op)
        or op in sp.op_to_rules
        or op in DTensor._op_dispatcher._custom_op_handlers
    ):
        return False
    sp.register_op_strategy(op, replicate_op_strategy)
    _registered[0] += 1
    # A custom op whose autograd formula calls a second custom op (transformers' grouped product
    # and its ``..._backward``) meets that op on DTensors in backward: replicate it too.
    if op.namespace != "aten":
        packet = getattr(
            getattr(torch.ops, op.namespace), f"{op._opname}_backward", None
        )
        for name in packet.overloads() if packet is not None else ():
            _replicated(getattr(packet, name))
    return True


class _Calls(TorchDispatchMode):
    """The ops dispatched while it is on, in order (what PyTorch lacks: a list of the ops an
    op's derivative formula calls; autograd only runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[torch._ops.OpOverload, None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] = None
        return func(*args, **(kwargs or {}))


def backward_ops(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> list[torch._ops.OpOverload]:
    """The ops `op`'s backward calls that return one tensor or a tuple of them and alias none
    of their inputs, found by running `op` on `args` (floating tensors made leaves that require
    grad; meta tensors cost nothing) and its backward once; [] where that cannot run (an op
    without a meta kernel: DTensor's own error at run time then names the op)."""
    leaves: list[torch.Tensor] = []

    def leaf(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            leaves.append(a.detach().requires_grad_())
            return leaves[-1]
        return a

    args, kwargs = tree_map(leaf, (args, kwargs))
    try:
        with torch.enable_grad():
            out = op(*args, **kwargs)
        outs = [
            o
            for o in tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.grad_fn is not None
        ]
        if not outs:
            return []
        grads = [torch.ones_like(o) for o in outs]
        with _Calls() as calls:
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    except Exception:  # noqa: BLE001 - see the docstring
        return []
    return [
        f
        for f in calls.ops
        if f is not op
        and not any(r.alias_info for r in f._schema.returns)
        and all(isinstance(r.type, torch.TensorType) for r in f._schema.returns)
    ]
