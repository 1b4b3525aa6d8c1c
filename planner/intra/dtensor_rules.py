"""The DTensor side of `planner.intra.strategies`: meshes, placements and calls into DTensor's registries.

Everything here talks to private pieces of `torch.distributed.tensor` (torch 2.13); the rest of the
planner only sees placement strings. Principle 1 ("what is planned is what runs") is the reason this
module exists: a strategy is a pair (input placements -> output placements) that DTensor's own
sharding propagator produces, so the runtime reproduces it by placing the inputs and calling the op.

Meshes. Strategy functions need a `DeviceMesh` only for its shape. We build
``DeviceMesh("cpu", arange(n).view(shape), _init_backend=False, _rank=0)``, which is what DTensor
itself uses for its decomposition search: no process group, no global state, so it coexists with a
real gloo group in the same process. Measured on the development machine: 0.3-0.7 ms per mesh for
(2, 2) up to (48, 64) = 3072 devices (the fake process group route, ``init_process_group("fake")`` +
``init_device_mesh``, costs 1-5 ms but installs a global default group, so we do not use it).
Meshes are cached by shape.

Registries, in the order DTensor's ``ShardingPropagator.propagate_op_sharding_non_cached`` uses them:

1. ``op_single_dim_strategy_funcs`` (single_dim): rules for one mesh axis, with
   ``_ShardingPlaceholder`` for "any shard of dim d". We wrap the inputs exactly as the propagator
   does (``_wrap_with_op_strategy``) with one probe placement containing ``Shard(0)`` (so the
   placeholders are filled with plain ``Shard``), and call DTensor's own
   ``_expand_single_dim_strategy_to_mesh``, which takes the product of the rules over all mesh axes
   (``expand_to_full_mesh_op_strategy``). The result does not depend on the probe except for
   redistribution costs, which we ignore.
2. ``op_strategy_funcs`` (classic): functions of an ``OpSchema`` whose tensor args are
   ``OpStrategy`` objects. Some enumerate every strategy (einsum-like), others follow the input's
   strategies (views, reductions, softmax). The candidates of an input are its even placements
   (R, P(sum), S(d) on every axis). The rule is called once per candidate of each input, that
   input holding the single candidate and the others replicated, as the runtime calls it (one
   spec per input). A multi-input op is also called once with every input's ``OpStrategy``
   holding all its candidates (einsum-like rules then list the combinations of several sharded
   inputs); rules that index several inputs' strategies in lockstep (nll_loss) raise on that.
3. ``op_to_rules`` (rule): propagation rules from input specs to an output spec (only
   convolution/convolution_backward in 2.13, which also have single-dim strategies that take
   precedence). Called on every combination of candidate input placements (capped).
4. Decomposition (decomp): DTensor's ``DecompShardingStrategy`` traces the op's decomposition on a
   size-1 mesh per candidate input placement; we run the same tracing over the candidates R, P(sum)
   and S(d) of every input and expand with ``expand_to_full_mesh_op_strategy`` as it does.

When several strategies need the same input placements but give different outputs, DTensor picks
one at run time; we ask its real propagator which (`dtensor_output`) and keep only that one.

Redistribution costs. DTensor's strategy functions attach to every strategy the cost of moving
each input's current placements to the ones it needs (``generate_redistribute_costs``, one
``redistribute_cost`` per pair): most of the time of enumerating an op with many inputs or
strategies (``cat`` of two 4-D tensors on a 2 x 2 mesh: 85%; every op signature of llama3-70b
at 4 rows on its 11 meshes: 4.4-7.0 -> 2.3-2.7 s of CPU without them, the same strategies). The planner prices resharding
itself (`cost_models.resharding`) and reads only the placements, so the single-dim and classic
paths run with `without_redistribute_costs`: it returns zeros instead. Why that leaves the
placements unchanged (torch 2.13): the strategy functions and ``expand_to_full_mesh_op_strategy``
only store the costs in the ``OpSpec``; the one reader of ``OpSpec.redistribute_cost`` is the
propagator's choice among strategies (``ShardingPropagator._select_strategy``), which these paths
do not call. `dtensor_output` (that choice) and the decomposition path (which propagates) keep
the costs: the switch is per thread, and only `_single_dim` and `_classic` turn it on.

The rules PyTorch lacks (CPU flash attention) are registered in DTensor by
`planner.vocab.dtensor_ext.register_missing_rules`, which the runtime calls too; the planner calls
it before enumerating strategies.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
)

from planner.vocab.dtensor_ext import placement_to_str, register_missing_rules

aten = torch.ops.aten

# Upper bound on input placement combinations tried by the rule and decomposition paths.
MAX_COMBINATIONS = 4096

# Sources of strategies produced here (see module docstring).
SINGLE_DIM, CLASSIC, RULE, DECOMP = "single_dim", "classic", "rule", "decomp"


def propagator() -> Any:
    """DTensor's global `ShardingPropagator` (holds the registries)."""
    return DTensor._op_dispatcher.sharding_propagator


# ------------------------------------------------------------------------ redistribution costs

_no_costs = threading.local()  # `without_redistribute_costs` is on in this thread


def _costs_unless_off(costs: Callable) -> Callable:
    """DTensor's ``generate_redistribute_costs``, or zeros where `without_redistribute_costs`
    is on in the calling thread (module docstring)."""

    @functools.wraps(costs)
    def generate_redistribute_costs(src_strategy: OpStrategy, dst_spec: Any) -> list:
        if getattr(_no_costs, "on", False):
            return [0.0] * len(src_strategy.strategies)
        return costs(src_strategy, dst_spec)

    generate_redistribute_costs.meshplan_original = costs  # type: ignore[attr-defined]
    return generate_redistribute_costs


def _install_cost_switch() -> None:
    """Replace ``generate_redistribute_costs`` by `_costs_unless_off` in every DTensor module
    that holds it (each ``from ... import`` is its own reference); once per process."""
    from torch.distributed.tensor._ops import utils

    original = getattr(
        utils.generate_redistribute_costs,
        "meshplan_original",
        utils.generate_redistribute_costs,
    )
    switch = _costs_unless_off(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.tensor") and (
            getattr(module, "generate_redistribute_costs", None) is original
        ):
            module.generate_redistribute_costs = switch


_install_cost_switch()


@contextlib.contextmanager
def without_redistribute_costs() -> Iterator[None]:
    """In this thread, DTensor's strategy functions attach zero redistribution costs (module
    docstring: the placements they return are the same)."""
    before = getattr(_no_costs, "on", False)
    _no_costs.on = True
    try:
        yield
    finally:
        _no_costs.on = before


# ----------------------------------------------------------------------------------- placements


def candidate_placements(
    shape: Sequence[int], mesh_shape: Sequence[int]
) -> list[tuple[Placement, ...]]:
    """Every per-axis combination of R, P(sum), S(d) that shards `shape` evenly: the input
    placements we offer to the registries (uneven ones would be dropped anyway)."""
    per_axis: list[Placement] = [Replicate(), Partial()] + [
        Shard(d) for d in range(len(shape))
    ]
    out = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        shards = [1] * len(shape)
        for p, size in zip(combo, mesh_shape):
            if isinstance(p, Shard):
                shards[p.dim] *= size
        if all(n % k == 0 for n, k in zip(shape, shards)):
            out.append(combo)
    return out


# --------------------------------------------------------------------------------------- meshes


@functools.cache
def get_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A process-group-free `DeviceMesh` of this shape (see module docstring), cached."""
    n = 1
    for s in shape:
        n *= s
    return DeviceMesh("cpu", torch.arange(n).view(*shape), _init_backend=False, _rank=0)


# ------------------------------------------------------------------------------- schema building


class TensorArg:
    """A tensor argument of an op: the index of its node in ``node.all_input_nodes`` and its meta."""

    __slots__ = ("index", "meta")

    def __init__(self, index: int, meta: TensorMeta) -> None:
        self.index = index
        self.meta = meta

    def key(self) -> tuple:
        return (
            "T",
            self.index,
            tuple(self.meta.shape),
            tuple(self.meta.stride),
            str(self.meta.dtype),
        )


def _map(obj: Any, fn: Callable[[TensorArg], Any]) -> Any:
    """Replace every TensorArg in a nested args structure by fn(arg), as DTensor wraps arguments:
    a list/tuple made only of tensors becomes a `TupleStrategy` when fn returns OpStrategies."""
    if isinstance(obj, TensorArg):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [_map(o, fn) for o in obj]
        if items and all(isinstance(i, OpStrategy) for i in items):
            return TupleStrategy(tuple(items) if isinstance(obj, tuple) else items)
        return type(obj)(items) if isinstance(obj, tuple) else items
    return obj


def _leaves(obj: Any, out: list[TensorArg]) -> list[TensorArg]:
    if isinstance(obj, TensorArg):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _leaves(o, out)
    return out


def schema_info(op: Any) -> RuntimeSchemaInfo | None:
    sp = propagator()
    return sp.op_to_schema_info.get(
        op
    ) or sp.op_to_schema_info_for_single_dim_strategy.get(op)


def tensor_leaves(op: Any, args: tuple, kwargs: dict) -> list[TensorArg]:
    """Tensor arguments in the order of DTensor's ``OpSpec.input_specs`` (args, then kwargs)."""
    info = schema_info(op)
    pytree = info is not None and info.needs_pytree
    out: list[TensorArg] = []
    for a in args:
        if isinstance(a, TensorArg) or pytree:
            _leaves(a, out)
    for v in kwargs.values():
        if isinstance(v, TensorArg) or pytree:
            _leaves(v, out)
    return out


def _spec_schema(
    op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, placements: Sequence
) -> OpSchema:
    """An OpSchema of DTensorSpecs, the i-th tensor leaf placed as ``placements[i]``."""
    it = iter(placements)

    def spec(t: TensorArg) -> DTensorSpec:
        return DTensorSpec(mesh, tuple(next(it)), tensor_meta=t.meta)

    def walk(o: Any) -> Any:
        if isinstance(o, TensorArg):
            return spec(o)
        if isinstance(o, (list, tuple)):
            items = [walk(i) for i in o]
            return tuple(items) if isinstance(o, tuple) else items
        return o

    return OpSchema(
        op,
        tuple(walk(a) for a in args),
        {k: walk(v) for k, v in kwargs.items()},
        schema_info=schema_info(op),
    )


# ---------------------------------------------------------------------------------- enumeration

Pair = tuple[
    tuple[tuple[Placement, ...] | None, ...], Any
]  # (input placements per leaf, output_specs)


def _pairs(strategy: Any, n_leaves: int) -> list[Pair]:
    if not isinstance(strategy, OpStrategy):
        raise NotImplementedError(
            f"strategy of type {type(strategy).__name__} (foreach/tuple ops are not planned)"
        )
    pairs = []
    for spec in strategy.strategies:
        if spec.input_specs is None:
            ins = tuple(spec.output_spec.placements for _ in range(n_leaves))
        else:
            ins = tuple(
                None if s is None else tuple(s.placements) for s in spec.input_specs
            )
        if len(ins) != n_leaves:
            raise NotImplementedError(
                f"rule gave {len(ins)} input specs for {n_leaves} tensor inputs"
            )
        pairs.append((ins, spec.output_specs))
    return pairs


def _probe(t: TensorArg, mesh: DeviceMesh) -> tuple[Placement, ...]:
    first = Shard(0) if len(t.meta.shape) > 0 else Replicate()
    return (first,) + (Replicate(),) * (mesh.ndim - 1)


def _single_dim(
    op: Any, args: tuple, kwargs: dict, out_meta: Any, mesh: DeviceMesh, leaves: list
) -> list[Pair]:
    sp = propagator()
    specs = _spec_schema(op, args, kwargs, mesh, [_probe(t, mesh) for t in leaves])
    strategy_schema = sp._wrap_with_op_strategy(specs)
    info = sp.op_single_dim_strategy_funcs[op]
    expand = _expand_single_dim_strategy_to_mesh(mesh, strategy_schema, info, out_meta)
    return _pairs(
        expand(op, strategy_schema.args_meta, strategy_schema.kwargs_meta), len(leaves)
    )


def _classic(
    op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, leaves: list
) -> list[Pair]:
    sp = propagator()
    func = sp.op_strategy_funcs[op]
    info = schema_info(op)

    def with_candidates(choose: Callable[[TensorArg], list]) -> list[Pair]:
        def strat(t: TensorArg) -> OpStrategy:
            return OpStrategy(
                [OpSpec(DTensorSpec(mesh, p, tensor_meta=t.meta)) for p in choose(t)]
            )

        schema = OpSchema(
            op,
            tuple(_map(a, strat) for a in args),
            {k: _map(v, strat) for k, v in kwargs.items()},
            schema_info=info,
        )
        return _pairs(func(schema), len(leaves))

    def all_candidates(t: TensorArg) -> list:
        return candidate_placements(t.meta.shape, mesh.shape)

    pairs: list[Pair] = []
    if len(leaves) > 1:
        # one call sees every combination for enumerating rules; rules that follow one input
        # return few, and rules that zip inputs' strategies raise: the loop below covers both
        with contextlib.suppress(Exception):
            pairs += with_candidates(all_candidates)
    replicate = (Replicate(),) * mesh.ndim
    errors = []
    for leaf in leaves:
        for cand in all_candidates(leaf):
            try:
                pairs += with_candidates(
                    lambda t, leaf=leaf, cand=cand: [cand] if t is leaf else [replicate]
                )
            except Exception as e:  # noqa: BLE001 - the rule rejects this placement: skip it
                errors.append(e)
    if not pairs and errors:
        raise errors[0]
    return pairs


def _rule(
    op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, leaves: list
) -> list[Pair]:
    rule = propagator().op_to_rules[op]
    cands = [candidate_placements(t.meta.shape, mesh.shape) for t in leaves]
    pairs = []
    for combo in itertools.islice(itertools.product(*cands), MAX_COMBINATIONS):
        with contextlib.suppress(Exception):  # the rule rejects this combination
            out = rule(_spec_schema(op, args, kwargs, mesh, combo))
            if out.output_spec is not None and out.redistribute_schema is None:
                pairs.append((tuple(combo), out.output_spec))
    return pairs


def _decomp(
    op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, leaves: list
) -> list[Pair]:
    """DTensor's DecompShardingStrategy.propagate_strategy with candidates R, P(sum), S(d) for every
    input (DTensor takes its candidates from the placements the inputs happen to have)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    from torch.utils._pytree import tree_flatten

    sp = propagator()
    dec = sp.decomp_strategy
    fake_mesh = dec._get_fake_mesh(mesh.device_type)
    schema = _spec_schema(
        op, args, kwargs, mesh, [(Replicate(),) * mesh.ndim] * len(leaves)
    )
    flat, _ = tree_flatten(
        list(schema.args_schema + tuple(schema.kwargs_schema.values()))
    )
    per_leaf = [
        [None]
        if not isinstance(s, DTensorSpec)
        else [p[0] for p in candidate_placements(s.shape, (1,))]
        for s in flat
    ]
    rows = []
    for combo in itertools.islice(itertools.product(*per_leaf), MAX_COMBINATIONS):
        try:
            out = dec._propagate_through_decomp(schema, combo, fake_mesh)
        except (NotImplementedError, GuardOnDataDependentSymNode) as e:
            raise NotImplementedError(f"decomposition not traceable: {e}") from e
        except (RuntimeError, KeyError, IndexError, AssertionError):
            continue
        outs = [out] if not isinstance(out, tuple) else list(out)
        rows.append(outs + list(combo))
        n_out = len(outs)
    if not rows:
        raise NotImplementedError("decomposition gave no strategy")
    strategy = expand_to_full_mesh_op_strategy(
        mesh, sp._wrap_with_op_strategy(schema), rows, input_index=n_out
    )
    return _pairs(strategy, len(leaves))


def registry_of(op: Any) -> str | None:
    """Which DTensor path would handle this op at run time (None: DTensor cannot run it)."""
    register_missing_rules()
    sp = propagator()
    if op in sp.op_single_dim_strategy_funcs:
        return SINGLE_DIM
    if op in sp.op_strategy_funcs:
        return CLASSIC
    if op in sp.op_to_rules:
        return RULE
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    if isinstance(op, torch._ops.OpOverload) and DecompShardingStrategy.has_decomp(op):
        return DECOMP
    return None


def enumerate_pairs(
    op: Any, args: tuple, kwargs: dict, out_meta: Any, mesh: DeviceMesh
) -> tuple[str, list[Pair]]:
    """All (input placements, output specs) pairs DTensor's registry for `op` yields on `mesh`.

    `args`/`kwargs` are the node's arguments with tensors replaced by `TensorArg`. Raises
    NotImplementedError when no registry applies, or the registry's error.
    """
    source = registry_of(op)
    leaves = tensor_leaves(op, args, kwargs)
    if source is None:
        raise NotImplementedError(
            "no DTensor strategy, rule or traceable decomposition"
        )
    if source == SINGLE_DIM:
        with without_redistribute_costs():
            return source, _single_dim(op, args, kwargs, out_meta, mesh, leaves)
    if source == CLASSIC:
        with without_redistribute_costs():
            return source, _classic(op, args, kwargs, mesh, leaves)
    if source == RULE:
        return source, _rule(op, args, kwargs, mesh, leaves)
    return source, _decomp(op, args, kwargs, mesh, leaves)


def dtensor_output(
    op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, placements: Sequence
) -> Any | None:
    """Ask DTensor's real propagator what it does with inputs placed as `placements` (one tuple per
    tensor leaf): the output specs if it runs the op without redistributing any input, else None."""
    schema = _spec_schema(op, args, kwargs, mesh, placements)
    try:
        out = propagator().propagate_op_sharding_non_cached(schema)
    except Exception:  # noqa: BLE001 - DTensor cannot run these placements
        return None
    if out.redistribute_schema is not None:
        # view ops rewrite shape arguments (needs_redistribute without moving data), and
        # Replicate -> _MaskPartial (vocabulary-parallel embedding indices) is a local mask
        # computation: neither communicates.
        for have, want in zip(schema.args_spec, out.redistribute_schema.args_spec):
            for a, b in zip(have.placements, want.placements):
                if a != b and not (
                    isinstance(a, Replicate) and placement_to_str(b) == "P(mask)"
                ):
                    return None
    return out.output_spec


# Ops DTensor runs through its own handler (``_tp_conv``), which builds a ``dim_map`` and so
# rejects a tensor dim sharded on two mesh axes although the registry lists such strategies.
NO_NESTED_SHARDING = frozenset(
    {aten.convolution.default, aten.convolution_backward.default}
)

CUSTOM_OPS = frozenset(
    {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
)
