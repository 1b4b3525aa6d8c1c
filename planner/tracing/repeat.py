"""Trace a deep stack of identical blocks by tracing three of them and repeating the last.

`make_fx` costs about 1.5 ms of CPU per aten op on this machine: 10 s for llama3-70b's 6,501 ops
at every micro-batch size the planner tries, the largest single part of planning it (issue 23,
`benchmarks.planning_time`). Its 80 blocks trace to the same ops, so a model whose class says so
(``repeats_blocks = True``: each block's forward depends on its own modules and parameters only,
not on its index) is traced with the first ``start + 3 * period`` blocks of its ``blocks`` list,
and the graph of the whole stack is written from that one (`expand`): PyTorch has no way to
trace a module once and instantiate its graph many times (`torch.compile`'s regional compilation
reuses compiled code, not aten graphs), so we write the copies ourselves.

A Hugging Face model is read the same way, its stack being its longest ``nn.ModuleList``
(``model.layers``, ``transformer.h``, ``bert.encoder.layer``): ``transformers`` builds what
differs between its layers into the layers' attributes (``attention_type``, ``sliding_window``,
``use_rope``) or their module types (a dense first layer, ``mlp_only_layers``), and every
layer's forward reads those, so a block's signature (`_signature`) holds its modules' types,
its tensors' shapes and its modules' plain attributes other than the layer's own index
(``layer_idx``); layers that differ end or break the repeating stack.

Units. Blocks ``start, start + 1, ...`` repeat with ``period`` (a GShard MoE alternates dense and
mixture blocks: period 2; DeepSeek's first dense blocks: ``start``); a unit is ``period`` blocks,
numbered from 0. In the short trace, the nodes from a unit's first op to the next unit's first
op belong to it (ops of the model's own loop between blocks included, such as an auxiliary-loss
sum); unit 2, the last, takes as many ops after its blocks' as unit 1. Unit 0 may differ from
the others (it reads the embedding, its loop ops see no earlier loss), so unit 2 must equal
unit 1 with every reference moved one unit on (`_shifted_equal`): units 3, 4, ... of the whole
model are unit 2's nodes moved on again, and the ops after the stack read the last unit where
they read unit 2; a list of one value per unit (the blocks' auxiliary losses stacked) gets one
per unit of the whole model. Anything else (a reference two units back, a constant tensor in a
block, a list that is not one value per unit) keeps the full trace: `expand` returns None.

Names are made as the tracer makes them: each op's name asked of a fresh `torch.fx.Graph`'s
namespace in the same order (``mm``, ``mm_1``, ...), placeholders numbered per kind (``p_1``,
...), so the graph equals the full trace node for node (tests/test_repeat.py compares them for
every family that repeats blocks).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._pytree import tree_flatten

from planner.tracing.calls import is_hf_model

#: units of the short trace: the first, one the next repeats, and that next one
UNITS = 3
_NUMBERED = re.compile(r"^(.*)_(\d+)$")
#: attributes that number a block (`_signature` leaves them out): transformers' ``layer_idx``
_INDEX = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
_PLAIN = (bool, int, float, str, type(None))

Key = tuple  # ("ph", path) | ("pre", k) | ("u", unit, k) | ("suf", k) | ("out",)
#: the tracer's (`planner.tracing.tracer`): a model and a batch -> aten graph, placeholder paths
MakeFx = Callable[
    [nn.Module, tuple[torch.Tensor, ...]], tuple[fx.GraphModule, list[str]]
]


class Stack(NamedTuple):
    """The repeating part of a model's block list: the list's module path (``blocks``,
    ``model.layers``), the block the repetition starts at, its period and its number of units."""

    prefix: str
    start: int
    period: int
    units: int

    def unit(self, path: str) -> int | None:
        """The unit of a module or placeholder path in the repeated stack, or None."""
        i = self._index(path)
        return None if i is None or i < self.start else (i - self.start) // self.period

    def shift(self, path: str, d: int) -> str:
        """``PREFIX.i.rest`` -> ``PREFIX.(i + d * period).rest`` in the repeated stack."""
        i = self._index(path)
        if i is None or i < self.start or d == 0:
            return path
        head = f"{self.prefix}.{i}"
        return f"{self.prefix}.{i + d * self.period}{path[len(head) :]}"

    def _index(self, path: str) -> int | None:
        if not path.startswith(self.prefix + "."):
            return None
        head = path[len(self.prefix) + 1 :].split(".", 1)[0]
        return int(head) if head.isdigit() else None


def _signature(block: nn.Module) -> tuple:
    return (
        tuple((n, type(m), _attributes(m)) for n, m in block.named_modules()),
        tuple(
            (n, tuple(t.shape), t.dtype)
            for n, t in [*block.named_parameters(), *block.named_buffers()]
        ),
    )


def _attributes(m: nn.Module) -> tuple:
    """`m`'s own plain attributes (numbers, strings, their tuples and lists) but its index."""
    out = []
    for k, v in vars(m).items():
        if k.startswith("_") or k in _INDEX:
            continue
        if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
            v = tuple(v)
        elif not isinstance(v, _PLAIN):
            continue
        out.append((k, v))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def block_list(model: nn.Module) -> str | None:
    """The module path of `model`'s block list: ``blocks`` for a model that declares
    ``repeats_blocks``, a Hugging Face model's longest ``nn.ModuleList`` outside its layers, or
    None."""
    if getattr(model, "repeats_blocks", False):
        return (
            "blocks"
            if isinstance(getattr(model, "blocks", None), nn.ModuleList)
            else None
        )
    if not is_hf_model(model):
        return None
    lists = [
        (len(m), path)
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        and not any(p.isdigit() for p in path.split("."))
    ]
    return max(lists, key=lambda x: x[0])[1] if lists else None


def block_pattern(model: nn.Module) -> Stack | None:
    """The `Stack` of a model whose block list (`block_list`) repeats from block ``start`` with
    ``period`` (the least period whose stack holds more than `UNITS` units), or None when the
    model has no such list or its stack is too short to gain."""
    prefix = block_list(model)
    if prefix is None:
        return None
    sigs = [_signature(b) for b in model.get_submodule(prefix)]
    for period in range(1, 5):
        start = len(sigs) - period
        while start > 0 and sigs[start - 1] == sigs[start - 1 + period]:
            start -= 1
        start += (len(sigs) - start) % period
        units = (len(sigs) - start) // period
        if units > UNITS:
            return Stack(prefix, start, period, units)
    return None


def short_model(model: nn.Module, prefix: str, blocks: int) -> nn.Module:
    """A shallow copy of `model` whose block list at `prefix` holds its first `blocks` blocks
    (the same module objects; `model` and its submodules are not changed): each module on the
    way to the list is copied with its own dict of children."""
    *parents, name = prefix.split(".")
    short = copy.copy(model)
    short._modules = dict(model._modules)
    at = short
    for p in parents:
        child = copy.copy(at._modules[p])
        child._modules = dict(child._modules)
        at._modules[p] = child
        at = child
    at._modules[name] = nn.ModuleList(list(at._modules[name])[:blocks])
    return short


def repeated_trace(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    make_fx: MakeFx,
) -> tuple[fx.GraphModule, list[str]] | None:
    """The graph of `model`'s loss on `batch` and its placeholders' paths, traced by `make_fx`
    (`planner.tracing.tracer`'s) on the model's first ``start + UNITS * period`` blocks and
    expanded (`expand`); None for a model that does not repeat (`block_pattern`) or whose short
    trace does not. A stack whose first unit is read differently by the next than the next by
    its own (a running sum the first unit starts: the GShard MoE's auxiliary losses where block 0
    holds experts) is tried again starting a unit later, its first unit traced before it."""
    stack = block_pattern(model)
    if stack is None:
        return None
    later = stack._replace(start=stack.start + stack.period, units=stack.units - 1)
    readings = [stack, later] if later.units > UNITS else [stack]
    key = (type(model), stack)
    if key in _READ_LATER:  # each reading gives the full trace: try the one that worked
        readings.reverse()
    for s in readings:
        out = _short_and_expanded(model, batch, make_fx, s)
        if out is not None:
            if s is later:
                _READ_LATER.add(key)
            else:
                _READ_LATER.discard(key)
            return out
    return None


#: (model class, stack) whose first reading did not repeat and whose later one did: the next
#: trace of such a model (the planner traces it at every micro-batch size; a GShard MoE's, with
#: experts in block 0, is read later each time) tries the later reading first. Exact either way:
#: each reading that repeats gives the full trace node for node.
_READ_LATER: set[tuple] = set()


def _short_and_expanded(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    make_fx: MakeFx,
    stack: Stack,
) -> tuple[fx.GraphModule, list[str]] | None:
    """`repeated_trace` of one reading of the stack."""
    blocks = stack.start + UNITS * stack.period
    gm, paths = make_fx(short_model(model, stack.prefix, blocks), batch)
    buffers = [n for n, _ in model.named_buffers()]
    full = [n for n, _ in model.named_parameters()] + buffers
    full += [f"batch[{i}]" for i in range(len(batch))]
    kinds = (len(set(paths) & set(buffers)), len(buffers))
    big = expand(gm, paths, full, stack, kinds)
    return None if big is None else (big, full)


def _path(n: fx.Node) -> str:
    return n.meta.get("custom", {}).get("module_path", "")


def _outputs(n: fx.Node) -> list[tuple]:
    return [
        (tuple(t.shape), t.dtype, t.stride())
        for t in tree_flatten(n.meta.get("val"))[0]
        if isinstance(t, torch.Tensor)
    ]


class _NoRepeat(Exception):
    """The short trace is not a repeating stack as `_Layout` reads it: keep the full trace."""


class _Layout:
    """Where each node of the short trace lies (module docstring): its `Key`."""

    def __init__(self, gm: fx.GraphModule, paths: list[str], stack: Stack) -> None:
        self.stack = stack
        nodes = list(gm.graph.nodes)
        self.ph = [n for n in nodes if n.op == "placeholder"]
        body = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.output = nodes[-1]
        units = [stack.unit(_path(n)) for n in body]
        if any(u is not None and u >= UNITS for u in units) or any(
            j not in units for j in range(UNITS)
        ):
            raise _NoRepeat
        first = [units.index(j) for j in range(UNITS)]
        last = [max(k for k, u in enumerate(units) if u == j) for j in range(UNITS)]
        # the third unit: its blocks' ops, then as many ops as follow the second's blocks
        end = last[2] + first[2] - last[1]
        if first[2] - first[1] != end - first[2] or end > len(body):
            raise _NoRepeat
        bounds = [*first, end]
        for j in range(UNITS):
            if any(u not in (None, j) for u in units[bounds[j] : bounds[j + 1]]):
                raise _NoRepeat
        if any(u is not None for u in units[end:]):
            raise _NoRepeat
        self.pre = body[: first[0]]
        self.units = [body[bounds[j] : bounds[j + 1]] for j in range(UNITS)]
        self.suf = body[end:]
        self.key: dict[fx.Node, Key] = {n: ("ph", p) for n, p in zip(self.ph, paths)}
        self.key |= {n: ("pre", k) for k, n in enumerate(self.pre)}
        for j, members in enumerate(self.units):
            self.key |= {n: ("u", j, k) for k, n in enumerate(members)}
        self.key |= {n: ("suf", k) for k, n in enumerate(self.suf)}

    def unit_of(self, key: Key) -> int | None:
        """The unit a reference lies in (a block's parameter: its block's)."""
        if key[0] == "u":
            return key[1]
        if key[0] == "ph":
            return self.stack.unit(key[1])
        return None

    def shifted(self, key: Key, d: int) -> Key:
        """`key` moved `d` units on."""
        if key[0] == "ph":
            return ("ph", self.stack.shift(key[1], d))
        if key[0] == "u":
            return ("u", key[1] + d, key[2])
        return key


def _shifted_equal(lay: _Layout, a: fx.Node, b: fx.Node) -> bool:
    """Whether node `b` (a unit later) is node `a` with every reference moved one unit on."""
    return (
        a.op == b.op
        and a.target == b.target
        and _base(a.name) == _base(b.name)
        and map_arg((a.args, a.kwargs), lambda n: lay.shifted(lay.key[n], 1))
        == map_arg((b.args, b.kwargs), lambda n: lay.key[n])
        and lay.stack.shift(_path(a), 1) == _path(b)
        and _outputs(a) == _outputs(b)
    )


def _base(name: str) -> str:
    m = _NUMBERED.match(name)
    return m.group(1) if m else name


def _tail_args(lay: _Layout, a: Any, units: int, env: dict[Key, fx.Node]) -> Any:
    """An argument of an op after the stack, in the whole model: references to the third unit
    go to the last; a list holding the same op's value of each unit in order gets that op's
    value of every unit of the whole model. Raises _NoRepeat for any other reference into the
    stack."""
    moved = units - UNITS

    def ref(n: fx.Node) -> fx.Node:
        key = lay.key[n]
        if lay.unit_of(key) not in (None, UNITS - 1):
            raise _NoRepeat
        return env[lay.shifted(key, moved)]

    if isinstance(a, list):
        keys = [lay.key[x] if isinstance(x, fx.Node) else None for x in a]
        out: list[Any] = []
        i = 0
        while i < len(a):
            k = keys[i]
            per_unit = k is not None and k[0] == "u" and k[1] == 0
            if per_unit and keys[i : i + UNITS] == [
                ("u", j, k[2]) for j in range(UNITS)
            ]:
                out += [env[("u", j, k[2])] for j in range(units)]
                i += UNITS
            else:
                out.append(_tail_args(lay, a[i], units, env))
                i += 1
        return type(a)(out)
    if isinstance(a, tuple):
        return tuple(_tail_args(lay, x, units, env) for x in a)
    if isinstance(a, dict):
        return {k: _tail_args(lay, v, units, env) for k, v in a.items()}
    return ref(a) if isinstance(a, fx.Node) else a


def expand(
    gm: fx.GraphModule,
    paths: list[str],
    full_paths: list[str],
    stack: Stack,
    buffers: tuple[int, int],
) -> fx.GraphModule | None:
    """The graph of the whole stack from the trace `gm` of its first ``start + UNITS * period``
    blocks (module docstring), or None where the short trace does not repeat as that reading
    needs. `paths` and `full_paths` name the placeholders of the short and the whole model
    (parameters, then buffers, ``buffers`` of each, then the batch, as
    `planner.tracing.tracer` lists them)."""
    units = stack.units
    try:
        lay = _Layout(gm, paths, stack)
    except _NoRepeat:
        return None
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None  # a constant tensor per block would need its own attribute per copy
    if not all(_shifted_equal(lay, a, b) for a, b in zip(lay.units[1], lay.units[2])):
        return None
    short, full = _kinds(paths, buffers[0]), _kinds(full_paths, buffers[1])
    names = _placeholder_names(lay.ph, short, full)
    codegen = _codegen(gm, paths, full_paths, short, full)
    mode = detect_fake_mode([n.meta.get("val") for n in lay.ph])
    if names is None or codegen is None or mode is None:
        return None
    g = fx.Graph()
    g._codegen = codegen
    env: dict[Key, fx.Node] = {}

    def add(t: fx.Node, key: Key, args: Any, kwargs: Any, d: int = 0) -> None:
        new = g.create_node(t.op, t.target, args, kwargs, _base(t.name), t.type)
        new.meta = dict(t.meta)
        if "custom" in t.meta:
            path = stack.shift(_path(t), d)
            new.meta["custom"] = {**t.meta["custom"], "module_path": path}
        env[key] = new

    by_path = dict(zip(paths, lay.ph))
    for path, name in zip(full_paths, names):
        d = max(0, (stack.unit(path) or 0) - (UNITS - 1))
        t = by_path[stack.shift(path, -d)]
        new = g.create_node("placeholder", name, name=name, type_expr=t.type)
        new.meta = dict(t.meta)
        env[("ph", path)] = new

    def copy_moved(n: fx.Node, key: Key, d: int) -> None:
        """`n` with every reference moved `d` units on."""
        args = (n.args, n.kwargs)
        add(n, key, *map_arg(args, lambda x: env[lay.shifted(lay.key[x], d)]), d)

    for n in [*lay.pre, *lay.units[0], *lay.units[1]]:
        copy_moved(n, lay.key[n], 0)
    for d in range(units - UNITS + 1):
        for k, n in enumerate(lay.units[2]):
            copy_moved(n, ("u", UNITS - 1 + d, k), d)
    try:
        for k, n in enumerate(lay.suf):
            add(n, ("suf", k), *_tail_args(lay, (n.args, n.kwargs), units, env))
            _propagate(env[("suf", k)], mode)
        add(lay.output, ("out",), *_tail_args(lay, (lay.output.args, {}), units, env))
    except _NoRepeat:
        return None
    # its Python code generated when first run (the runtime's stages; the planner reads only
    # the graph): 0.06 s of each micro-batch size's trace of gpt-39b's 1938 ops
    return _LazyGraphModule(gm, g)


def _propagate(n: fx.Node, mode: Any) -> None:
    """Set `n`'s value (``val``, and ``tensor_meta`` as `make_fx` sets it) from its inputs':
    an op after the stack may read one value per unit (its shape then grows with the units)."""
    args, kwargs = map_arg((n.args, n.kwargs), lambda x: x.meta["val"])
    with mode:
        val = n.target(*args, **kwargs)
    n.meta["val"] = val
    if isinstance(val, torch.Tensor):
        n.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        n.meta.pop("tensor_meta", None)


def _kinds(paths: list[str], buffers: int) -> tuple[int, int, int]:
    """Numbers of parameters, buffers and batch tensors among placeholder `paths`."""
    batch = sum(1 for p in paths if p.startswith("batch["))
    return len(paths) - buffers - batch, buffers, batch


def _placeholder_names(
    ph: list[fx.Node], short: tuple[int, int, int], full: tuple[int, int, int]
) -> list[str] | None:
    """The whole model's placeholder names, numbered as the short trace's are: per kind as
    `make_fx` names them (``p_1``.. parameters, ``b_1``.. buffers, ``inputs_1``.. the batch), or
    ``arg0_1``, ``arg1_1``, .. after functionalization; None for any other pattern."""
    numbered = [_NUMBERED.match(n.name) for n in ph]
    if not all(numbered):
        return None
    if [m.group(0) for m in numbered] == [f"arg{i}_1" for i in range(len(ph))]:
        return [f"arg{i}_1" for i in range(sum(full))]
    names: list[str] = []
    at = 0
    for size, full_size in zip(short, full):
        group = numbered[at : at + size]
        at += size
        if len({m.group(1) for m in group}) != min(size, 1) or [
            int(m.group(2)) for m in group
        ] != list(range(1, size + 1)):
            return None
        if full_size:
            names += [f"{group[0].group(1)}_{i + 1}" for i in range(full_size)]
    return names


def _codegen(
    gm: fx.GraphModule,
    paths: list[str],
    full_paths: list[str],
    short: tuple[int, int, int],
    full: tuple[int, int, int],
) -> fx.graph.CodeGen | None:
    """The whole model's calling convention: `make_fx`'s ``(params, buffers, batch)`` with the
    whole model's names, if the short trace's is that with its own (or flat arguments, as
    the short trace's)."""
    if type(gm.graph._codegen) is fx.graph.CodeGen:
        return fx.graph.CodeGen()  # flat arguments (a functionalized graph)
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None:
        return None

    def spec(names: list[str], kinds: tuple[int, int, int], wrap: bool) -> Any:
        p, b, batch = kinds
        args = (
            {k: 0 for k in names[:p]},
            {k: 0 for k in names[p : p + b]},
            (0,) * batch,
        )
        return tree_flatten((args, {}) if wrap else args)[1]

    for wrap in (False, True):
        if spec(paths, short, wrap) == info.in_spec:
            in_spec = spec(full_paths, full, wrap)
            return _PyTreeCodeGen(_PyTreeInfo(info.orig_args, in_spec, info.out_spec))
    return None
