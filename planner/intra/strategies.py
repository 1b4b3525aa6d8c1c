"""Per-node sharding strategies on a 2D logical mesh, derived from DTensor's strategy registries.

A `Strategy` of a node says, for each mesh axis, how every output of the node is placed and how
every input must be placed for DTensor to run the op with no communication of its own. Placements
are strings: ``"R"`` (replicate), ``"S(d)"`` (shard tensor dim d), ``"P"`` (partial sum) and
``"P(op)"`` for other pending reductions DTensor produces (``P(avg)`` from mean-reduced losses,
``P(max)``/``P(min)``, ``P(mask)`` from a vocabulary-sharded embedding, ``P(norm)``); anything
starting with ``"P"`` is a partial value that an all-reduce (or reduce-scatter) completes.

How strategies are derived (principle 1, "what is planned is what runs"): `planner.intra.dtensor_rules`
asks the registry DTensor itself would use at run time (single-dim, classic, propagation rule or
decomposition, in DTensor's order) for every strategy on the mesh, keeps for every set of input
placements the output DTensor's propagator actually picks, and converts to strings. Then:

* Axes of size 1 are left out of the DTensor mesh and get ``"R"`` (on one device every placement
  is the whole tensor), so a (1, 4) mesh has exactly the strategies of a 1D mesh of 4.
* Strategies that shard a dim unevenly (size not divisible by the product of the axes sharding it)
  are dropped, so plans are exact. Two axes may shard the same dim (DTensor nests them left to
  right, ``("S(0)", "S(0)")``) when the dim divides by both sizes' product.
* Strategies using ``_StridedShard`` (e.g. a view merging a sharded dim with a dim before it) are
  dropped: the cost models and the runtime only know R/S/P. The one such view the plan
  vocabulary does express (a dim sharded on two axes, one entry per device of the outer one:
  data x context parallelism) is added from its geometry (`planner.vocab.nested_views`, source
  ``"nested_view"``), where DTensor's strategies do not cover its input placements.
* When one input node feeds an op twice (``mul(x, x)``), both uses must want the same placement.
* A vocabulary-parallel embedding wants its indices as ``_MaskPartial``; DTensor makes that from a
  replicated input by masking locally, so the strategy asks for ``"R"`` (its output is
  ``"P(mask)"``). Two layouts DTensor 2.13 enumerates but fails to run (found by running every
  strategy on gloo) are dropped: ``P(mask)`` on both axes, and ``P(mask)`` on an axis with the
  indices sharded on a later axis (`_bad_mask`).
* convolution and its backward run through DTensor's own handler (``tp_convolution``), which
  rejects a dim sharded on two axes: those strategies are dropped (`dr.NO_NESTED_SHARDING`).

Node kinds:

* placeholders and get_attr (parameters, buffers, batch), and ops without tensor inputs (factory
  ops): `leaf_strategies`, source ``"leaf"``. The runtime places them directly (``distribute_tensor``,
  or DTensor factory functions).
* ``operator.getitem`` of a multi-output op (split, layer_norm, sdpa, nll_loss): one strategy per
  placement the producer's strategies give that output, ``inputs == output`` (source ``"getitem"``).
  The input refers to the producer's output number ``node.args[1]``; the ILP should merge the
  getitem with its producer (`getitem_source`). For an edge (u, v) the placement u provides is
  ``strategy.output[consumed_output(u, v)]``.
* other ops: sources ``"single_dim"``, ``"classic"``, ``"rule"``, ``"decomp"`` (DTensor's paths),
  ``"custom"`` (a rule this package registers in DTensor because PyTorch lacks it:
  ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, see `planner.intra.dtensor_rules`),
  ``"context"`` (context parallelism of that kernel: q split along the sequence, k and v
  gathered; no DTensor rule, the runtime runs it itself, `planner.vocab.context`),
  or ``"fallback"``: all inputs and outputs ``"R"``, when DTensor has no rule, its rule raises, or it
  leaves no even strategy. `fallback_ops` lists them with the reason; the runtime must run them on
  the replicated local tensors itself (DTensor would raise), e.g. by registering DTensor's
  ``replicate_op_strategy`` for the op (`register_fallback`).
* nodes without tensor outputs (symbolic ints): one strategy with no placements (source ``"scalar"``).

Strategies are cached by (op, input shapes/strides/dtypes and which inputs are the same node,
non-tensor arguments, output shapes, mesh shape): a 48-layer GPT has thousands of nodes but a few
dozen signatures. The order is deterministic (sorted, replication first).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from planner.intra import dtensor_rules as dr
from planner.vocab.context import context_strategies
from planner.vocab.dtensor_ext import placement_to_str, registrations
from planner.vocab.nested_views import VIEWS, nested_view_strategies
from planner.vocab.placements import Placements, mesh_axes
from planner.vocab.strategy import Strategy, getitem_source

__all__ = [
    "clear_cache",
    "fallback_ops",
    "fallback_reason",
    "graph_strategies",
    "leaf_strategies",
    "node_strategies",
]


# ----------------------------------------------------------------------------------------- helpers


def _rank(p: str) -> tuple:
    if p == "R":
        return (0, 0, "")
    if p.startswith("S("):
        return (1, int(p[2:-1]), "")
    return (2, 0, p)


def _sort_key(s: Strategy) -> tuple:
    outs = tuple(_rank(p) for o in s.output for p in o)
    ins = tuple(() if i is None else tuple(_rank(p) for p in i) for i in s.inputs)
    return (outs, ins)


def _even(
    shape: Iterable[int], placements: Placements, mesh_shape: tuple[int, ...]
) -> bool:
    splits = _splits([(tuple(shape), placements)])
    return splits is not None and not _uneven(splits, mesh_shape)


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _val(node: torch.fx.Node) -> Any:
    if "val" not in node.meta:
        raise ValueError(
            f"node {node.name} has no meta['val']; trace with make_fx on fake tensors"
        )
    return node.meta["val"]


def _outputs(val: Any) -> list[Any]:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _replicated(n_axes: int) -> Placements:
    return ("R",) * n_axes


# ----------------------------------------------------------------------------------------- leaves


def leaf_strategies(
    shape: Iterable[int], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """Every per-axis combination of R / S(d) that shards evenly (axes of size 1 are R)."""
    shape = tuple(shape)
    per_axis = [
        ["R"] + ([f"S({d})" for d in range(len(shape))] if size > 1 else [])
        for size in mesh_shape
    ]
    out = [
        Strategy(((*combo,),), (), "leaf")
        for combo in itertools.product(*per_axis)
        if _even(shape, combo, mesh_shape)
    ]
    return sorted(out, key=_sort_key)


def _scalar(node: torch.fx.Node, n_outputs: int) -> list[Strategy]:
    return [Strategy(((),) * n_outputs, (None,) * len(node.all_input_nodes), "scalar")]


def _fallback(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> Strategy:
    rep = _replicated(len(mesh_shape))
    outs = tuple(rep if _is_tensor(v) else () for v in _outputs(_val(node)))
    ins = tuple(
        rep if _is_tensor(n.meta.get("val")) else None for n in node.all_input_nodes
    )
    return Strategy(outs, ins, "fallback")


# ----------------------------------------------------------------------------------------- getitem


def _getitem(
    node: torch.fx.Node, producer: torch.fx.Node, idx: int, mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    seen: dict[Placements, None] = {}
    for s in node_strategies(producer, mesh_shape):
        if idx < len(s.output):
            seen.setdefault(s.output[idx], None)
    return [Strategy((p,), (p,), "getitem") for p in seen]


# ------------------------------------------------------------------------------------- op nodes

_CACHE: dict[tuple, tuple[tuple[Strategy, ...], str | None]] = {}
_PAIRS: dict[tuple, list[dr.Pair] | Exception] = {}  # `_probe_pairs`
_CACHED_AT = [registrations()]  # DTensor registrations when the cache was filled


def clear_cache() -> None:
    """Forget cached strategies (done by itself when DTensor gets new rules from
    `planner.vocab.dtensor_ext`)."""
    _CACHE.clear()
    _PAIRS.clear()
    _CONVERTED.clear()
    _GROUPED.clear()


def _template(node: torch.fx.Node) -> tuple[tuple, dict]:
    index = {n: i for i, n in enumerate(node.all_input_nodes)}

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = _val(a)
            if _is_tensor(v):
                return dr.TensorArg(index[a], TensorMeta(v.shape, v.stride(), v.dtype))
            return v
        if isinstance(a, (list, tuple)):
            items = [conv(x) for x in a]
            return tuple(items) if isinstance(a, tuple) else items
        return a

    return tuple(conv(a) for a in node.args), {
        k: conv(v) for k, v in node.kwargs.items()
    }


def _key(obj: Any) -> Any:
    if isinstance(obj, dr.TensorArg):
        return obj.key()
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_key(o) for o in obj))
    if isinstance(obj, dict):
        return tuple((k, _key(v)) for k, v in obj.items())
    try:
        hash(obj)
        return (type(obj).__name__, obj)
    except TypeError:
        return repr(obj)


def _out_meta(val: Any) -> Any:
    if _is_tensor(val):
        return TensorMeta(val.shape, val.stride(), val.dtype)
    if isinstance(val, (tuple, list)):
        return type(val)(_out_meta(v) for v in val)
    return None


def _to_strs(placements: Any, axes: list[int], n_axes: int) -> Placements | None:
    full = ["R"] * n_axes
    for j, p in zip(axes, placements):
        s = None if isinstance(p, _StridedShard) else placement_to_str(p)
        if s is None:
            return None
        full[j] = s
    return tuple(full)


def _convert(
    node: torch.fx.Node,
    pair: dr.Pair,
    leaves: list,
    axes: list[int],
    n: int,
    source: str,
) -> _Converted | None:
    """DTensor (input placements, output specs) on the squeezed mesh -> `_Converted`, or None if
    dropped whatever the mesh's sizes. Made once per pair object (from `_probe_pairs`, whose key
    fixes the node's op, shapes and inputs), axes and axis count (`_CONVERTED`)."""
    in_places, out_specs = pair
    if node.target in dr.NO_NESTED_SHARDING and _nested(pair):
        return None
    even: list[tuple[tuple[int, ...], Placements]] = []
    inputs: list[Placements | None] = [None] * len(node.all_input_nodes)
    for leaf, pl in zip(leaves, in_places):
        strs = _replicated(n) if pl is None else _to_strs(pl, axes, n)
        if strs is None or _bad_mask(strs):
            return None
        even.append((tuple(leaf.meta.shape), strs))
        # DTensor turns a replicated input into the _MaskPartial a vocabulary-parallel embedding
        # wants by masking locally (no communication): the plan asks for R.
        strs = tuple("R" if p == "P(mask)" else p for p in strs)
        if inputs[leaf.index] is not None and inputs[leaf.index] != strs:
            return None  # one node used twice with two placements
        inputs[leaf.index] = strs
    vals = _outputs(_val(node))
    if isinstance(out_specs, DTensorSpec) or out_specs is None:
        out_specs = [out_specs] * len(vals)
    if len(out_specs) != len(vals):
        return None
    outputs = []
    for v, spec in zip(vals, out_specs):
        if not _is_tensor(v):
            outputs.append(())
            continue
        strs = _replicated(n) if spec is None else _to_strs(spec.placements, axes, n)
        if strs is None or _bad_mask(strs):
            return None
        even.append((tuple(v.shape), strs))
        outputs.append(strs)
    splits = _splits(even)
    if splits is None:
        return None
    exact = not any(
        placement_to_str(p) == "P(mask)" for pl in in_places if pl for p in pl
    )
    strategy = Strategy(tuple(outputs), tuple(inputs), source)
    return strategy, exact, splits, _sort_key(strategy)


# A converted pair: its Strategy, whether no input is P(mask) (DTensor prefers such a strategy),
# its `_splits` (what must divide evenly on the real mesh) and its `_sort_key`.
_Converted = tuple[Strategy, bool, tuple[tuple[int, tuple[int, ...]], ...], tuple]


def _splits(
    tensors: list[tuple[tuple[int, ...], Placements]],
) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """`_even` of every (shape, placements) of `tensors` as (dim size, the mesh axes that split
    it) pairs, whatever the mesh's sizes: even on a mesh when each dim size is a multiple of the
    product of its axes' sizes (`_uneven`); None when a placement names a dim the tensor lacks."""
    out: dict[tuple[int, tuple[int, ...]], None] = {}
    for shape, placements in tensors:
        by_dim: dict[int, tuple[int, ...]] = {}
        for axis, p in enumerate(placements):
            if p.startswith("S("):
                d = int(p[2:-1])
                if d >= len(shape):
                    return None
                by_dim[d] = by_dim.get(d, ()) + (axis,)
        for d, split in by_dim.items():
            out[shape[d], split] = None
    return tuple(out)


def _uneven(
    splits: tuple[tuple[int, tuple[int, ...]], ...], mesh_shape: tuple[int, ...]
) -> bool:
    for size, split in splits:
        k = 1
        for axis in split:
            k *= mesh_shape[axis]
        if size % k:
            return True
    return False


# `_convert` per (id of a pair in `_PAIRS`, axes, axis count, node inputs): the pair kept with
# its conversion, so that an id is never another object's
_CONVERTED: dict[tuple, tuple[dr.Pair, _Converted | None]] = {}


def _nested(pair: dr.Pair) -> bool:
    """Some tensor of the pair has one dim sharded on two axes."""
    specs = list(pair[0])
    outs = pair[1] if isinstance(pair[1], (list, tuple)) else [pair[1]]
    specs += [o.placements for o in outs if isinstance(o, DTensorSpec)]
    for pl in specs:
        dims = [
            p.dim for p in pl or () if placement_to_str(p, strided=True).startswith("S")
        ]
        if len(dims) != len(set(dims)):
            return True
    return False


def _bad_mask(placements: Placements) -> bool:
    """Mask-partial layouts DTensor 2.13 plans but cannot run (found by the gloo test): P(mask) on
    two axes ("MaskBuffer has been materialized with conflicting data"), and P(mask) on an axis
    followed by a shard on a later axis (the mask is built for the wrong local shape)."""
    if "P(mask)" not in placements:
        return False
    first = placements.index("P(mask)")
    return placements.count("P(mask)") > 1 or any(
        p.startswith("S(") for p in placements[first + 1 :]
    )


def _resolve(
    op: Any, args: tuple, kwargs: dict, mesh: Any, pairs: list[dr.Pair]
) -> list[dr.Pair]:
    """Keep, for input placements that several pairs share, the output DTensor's propagator picks."""
    kept = []
    for k, group in _groups(pairs):
        if len(group) == 1:
            kept.append(group[0])
            continue
        chosen = dr.dtensor_output(op, args, kwargs, mesh, k)
        if chosen is not None:
            kept += [p for p in group if _spec_key(p[1]) == _spec_key(chosen)][:1]
    return kept


# `_groups` per id of a pair list of `_PAIRS`, the list kept with them
_GROUPED: dict[int, tuple[list[dr.Pair], list[tuple[tuple, list[dr.Pair]]]]] = {}


def _groups(pairs: list[dr.Pair]) -> list[tuple[tuple, list[dr.Pair]]]:
    """`pairs` by input placements, in order of first appearance: (placements, [the first
    pair]) where the group's pairs all give one output, else (placements, the group). The same
    on every mesh that shares a probe (`_probe_pairs`): made once per list."""
    hit = _GROUPED.get(id(pairs))
    if hit is None or hit[0] is not pairs:
        groups: dict[tuple, list[dr.Pair]] = {}
        for pair in pairs:
            groups.setdefault(pair[0], []).append(pair)
        out = [
            (k, g if len({_spec_key(p[1]) for p in g}) > 1 else g[:1])
            for k, g in groups.items()
        ]
        hit = _GROUPED[id(pairs)] = (pairs, out)
    return hit[1]


def _spec_key(specs: Any) -> Any:
    if isinstance(specs, DTensorSpec):
        return tuple(specs.placements)
    if isinstance(specs, (list, tuple)):
        return tuple(_spec_key(s) for s in specs)
    return None


def _compute(
    node: torch.fx.Node, mesh_shape: tuple[int, ...]
) -> tuple[list[Strategy], str | None]:
    op = node.target
    args, kwargs = _template(node)
    val = _val(node)
    leaves = dr.tensor_leaves(op, args, kwargs)
    axes = mesh_axes(mesh_shape)
    if not leaves and _is_tensor(val):
        return leaf_strategies(val.shape, mesh_shape), None  # factory op
    source = dr.registry_of(op)
    if source is None:
        return [
            _fallback(node, mesh_shape)
        ], "no DTensor strategy, rule or decomposition"
    if op in dr.CUSTOM_OPS:
        source = "custom"
    if not axes:
        strategy = _fallback(node, mesh_shape)
        return [Strategy(strategy.output, strategy.inputs, source)], None
    mesh = dr.get_mesh(tuple(mesh_shape[i] for i in axes))
    try:
        pairs = _probe_pairs(node, args, kwargs, tuple(mesh.shape))
        pairs = _resolve(op, args, kwargs, mesh, pairs)
    except Exception as e:  # noqa: BLE001 - any failure of a registry means DTensor cannot plan it
        return [
            _fallback(node, mesh_shape)
        ], f"{source} rule raised {type(e).__name__}: {str(e)[:200]}"
    # keyed by inputs; when R stands for P(mask), DTensor prefers a strategy that needs no change
    found: dict[tuple, _Converted] = {}
    n, at = len(mesh_shape), (tuple(axes), len(mesh_shape), len(node.all_input_nodes))
    for pair in pairs:
        key = (id(pair), *at)
        hit = _CONVERTED.get(key)
        if hit is None or hit[0] is not pair:
            hit = _CONVERTED[key] = (
                pair,
                _convert(node, pair, leaves, axes, n, source),
            )
        conv = hit[1]
        if conv is None or _uneven(conv[2], mesh_shape):
            continue
        prev = found.get(conv[0].inputs)
        if prev is None or (conv[1] and not prev[1]):
            found[conv[0].inputs] = conv
    if not found:
        return [
            _fallback(node, mesh_shape)
        ], f"{source} rule gave no evenly sharded strategy"
    return [c[0] for c in sorted(found.values(), key=lambda c: c[3])], None


def _smallest_factor(n: int) -> int:
    return next(p for p in range(2, n + 1) if n % p == 0)


def _probe_pairs(
    node: torch.fx.Node, args: tuple, kwargs: dict, axis_sizes: tuple[int, ...]
) -> list[dr.Pair]:
    """DTensor's pairs for `node` on a mesh of `axis_sizes` (no size 1), enumerated on the probe
    mesh of each size's smallest prime factor and cached by that: the 13 two-axis meshes of a
    64-device search then share one enumeration per op signature, not one each.

    Why the probe's pairs are a superset of the real mesh's, so that `_resolve` (on the real mesh)
    and `_convert` (evenness on the real sizes) keep the same strategies: the registries' only use
    of the axis sizes is whether a tensor dim can be split over one (the even candidates,
    `dr.candidate_placements`; DTensor's shardability checks: the dim at least, or a multiple of,
    the axis size), and a dim that splits over an axis splits over a factor of it. Checked on the
    op signatures of every built-in family on the meshes the searches use
    (tests/test_strategies.py)."""
    probe = tuple(_smallest_factor(n) for n in axis_sizes)
    key = _signature(node, probe)
    hit = _PAIRS.get(key)
    if hit is None:
        try:
            hit = dr.enumerate_pairs(
                node.target, args, kwargs, _out_meta(_val(node)), dr.get_mesh(probe)
            )[1]
        except Exception as e:  # noqa: BLE001 - raised again for every mesh of this probe
            hit = e
        _PAIRS[key] = hit
    if isinstance(hit, Exception):
        raise hit
    return hit


def _signature(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> tuple:
    args, kwargs = _template(node)
    return (
        node.target,
        _key(args),
        _key(kwargs),
        _key(_out_meta(_val(node))),
        tuple(mesh_shape),
    )


def _op_strategies(
    node: torch.fx.Node, mesh_shape: tuple[int, ...]
) -> tuple[tuple[Strategy, ...], str | None]:
    if _CACHED_AT[0] != registrations():
        clear_cache()
        _CACHED_AT[0] = registrations()
    key = _signature(node, mesh_shape)
    hit = _CACHE.get(key)
    if hit is None:
        strategies, reason = _compute(node, mesh_shape)
        hit = _CACHE[key] = (tuple(strategies), reason)
    return hit


def node_strategies(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """Every way DTensor can execute `node` on a mesh of `mesh_shape` (see module docstring)."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if node.op == "output":
        return []
    val = _val(node)
    if node.op in ("placeholder", "get_attr"):
        return (
            leaf_strategies(val.shape, mesh_shape)
            if _is_tensor(val)
            else _scalar(node, 1)
        )
    src = getitem_source(node)
    if src is not None:
        return _getitem(node, src[0], src[1], mesh_shape)
    outs = _outputs(val)
    if not any(_is_tensor(v) for v in outs):
        return _scalar(node, len(outs))
    if not isinstance(node.target, torch._ops.OpOverload):
        return [_fallback(node, mesh_shape)]
    base = list(_op_strategies(node, mesh_shape)[0])
    return (
        base
        + context_strategies(node, base, mesh_shape)
        + _nested_views(node, base, mesh_shape)
    )


def _nested_views(
    node: torch.fx.Node, base: list[Strategy], mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """`planner.vocab.nested_views`' strategies of a view node whose input placements DTensor's
    own strategies do not cover."""
    if node.target not in VIEWS or base[0].source == "fallback":
        return []
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or not _is_tensor(_val(src)):
        return []
    have = {s.inputs[0] for s in base}
    return [
        s
        for s in nested_view_strategies(_val(src).shape, _val(node).shape, mesh_shape)
        if s.inputs[0] not in have
    ]


def fallback_reason(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> str | None:
    """Why `node` fell back to replication on this mesh (None if it did not)."""
    strategies = node_strategies(node, mesh_shape)
    if not strategies or strategies[0].source != "fallback":
        return None
    if not isinstance(node.target, torch._ops.OpOverload):
        return f"{node.target} is not an aten op"
    return _op_strategies(node, tuple(mesh_shape))[1]


def graph_strategies(
    graph: torch.fx.Graph | torch.fx.GraphModule, mesh_shape: tuple[int, ...]
) -> dict[torch.fx.Node, list[Strategy]]:
    """`node_strategies` of every node of a graph except the output node."""
    g = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    return {n: node_strategies(n, mesh_shape) for n in g.nodes if n.op != "output"}


def fallback_ops(
    graph: torch.fx.Graph | torch.fx.GraphModule, mesh_shape: tuple[int, ...]
) -> list[str]:
    """``"node: op (reason)"`` for every node that falls back to replication on this mesh."""
    g = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    out = []
    for n in g.nodes:
        if n.op == "call_function":
            reason = fallback_reason(n, mesh_shape)
            if reason is not None:
                out.append(f"{n.name}: {n.target} ({reason})")
    return out
