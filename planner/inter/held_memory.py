"""What a stage holds that the intra-op pass's per-node memory prices leave out.

`cost_models.memory.stage_peak_bytes` sums a stage's parameter state (weights, gradients,
optimizer state), the activations it keeps per micro-batch in flight and a transient term. The
intra-op pass prices a saved activation once, at its producer's placement, and no backward
working memory. Measured against the runtime (`runtime.peak_memory`, the local suite), three
things the runtime legitimately holds were missing. This module prices them for a solved stage;
the stage table adds them (`planner.inter.stage_table.LayerProfile`), so the stage DP's fit
checks and the plan's memory include them, while the intra-op program's own memory constraint
(per-node prices) does not:

* **Redistributed copies kept for backward** (`resharded_saves`, per micro-batch in flight). An op
  that saves an input it receives redistributed (gathered, reduced or exchanged: a new tensor,
  not a slice of the producer's) keeps that copy: DTensor redistributes per use and the
  compiled backward reads the saved copy instead of redistributing again. This includes a weight
  gathered for the op (the tracer's ``saved_params``: parameter state prices only the shard). Per
  op ``v`` and saved input ``w``: ``w``'s bytes at ``v``'s placement when, on the way from the
  value owning ``w``'s storage through the views between, some placement changes other than by
  slicing a replicated axis. Conversely, a value that every op saving it receives so copied is
  not kept itself (its producer's activation price counted it): its bytes at its producer's
  placement are taken back. A tensor-parallel residual stream left partial, for example, is
  all-reduced into each layer norm, which saves the reduced copy, while the partial sum is freed
  once the next residual add has read it (the local suite's dp4 x tp2 GPT: 1.19 MiB of a
  9.7 MiB peak counted twice).

* **Gradients of activations** (`backward_terms`' ``work`` per op). Back-propagating an op holds the gradient of
  its output while it writes the gradients of its inputs, on top of everything the forward saved
  that is still live. Per op ``v``::

      work(v) = grad bytes of v's output  +  grad bytes of v's non-parameter inputs

  on one device (each at the placement the op runs it with), counted for ops whose output needs a
  gradient and that allocate (views alias their input's gradient). The stage holds the largest
  such set once: one micro-batch is back-propagated at a time, one op at a time. (The LM head's
  log-softmax of a ``tokens x vocabulary`` tensor is typically the largest: its gradient in and
  out.)
* **Fresh parameter gradients** (``fresh`` and ``priced`` per parameter). The runtime's compiled
  stages (`runtime.compiled`: AOTAutograd) run a micro-batch's backward as one graph that returns
  every parameter gradient of the stage at its end, at the parameter's own placement; only then
  are they accumulated into ``.grad``. And gradients are synchronised, all-reduced or (ZeRO)
  reduce-scattered, once per step after the last micro-batch (`runtime.grad_sync`), so until then
  a ZeRO parameter's accumulated gradient is held at its full local size, not its ZeRO shard.
  Per non-FSDP parameter, ``fresh`` = its gradient bytes at its placement (or, where ops receive
  it all-gathered, at the placements they use it with: the backward computes the gradient of the
  gathered copy before reducing it to the parameter's placement), ``priced`` = those the
  parameter state already counts (its bytes at its placement / zero shards). A stage then holds
  ``fresh - priced`` more (ZeRO, gathered weights), and with more than one micro-batch per step
  and compiled graphs (no recomputation, no FSDP: those run eagerly, where autograd accumulates
  each gradient as it is produced) one more ``fresh`` set during a later micro-batch's backward,
  the new gradients next to the accumulated ones (`cost_models.memory.stage_peak_bytes`'s
  ``accumulating``).

The sum is an upper bound: the peak is taken as if every gradient and every saved activation
coexisted with the largest backward working set (measured on the local suite: 2 to 10% above).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from cost_models.memory import state_bytes_per_param
from planner.intra.prices import saved_values
from planner.intra.solve import StageSolution
from planner.tracing.opgraph import OpGraph
from planner.vocab.context import context_axis
from planner.vocab.placements import shards

__all__ = ["backward_terms", "cached_on", "resharded_saves"]


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def backward_terms(
    sol: StageSolution, graph: OpGraph, layer_of: dict[str, int] | None = None
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Per op node its backward working bytes ``work(v)``, and per non-FSDP parameter node its
    (``fresh``, ``priced``) gradient bytes on one device (module docstring), for the optimizer
    `sol` was priced for. With `layer_of`, a parameter's gathered gradients count only from its
    readers in its own layer (a tied parameter's readers in later stages are its copies':
    `param_grad_terms`, `planner.plans.assemble`)."""
    grad_bytes = state_bytes_per_param(sol.optimizer or "adam_mixed").grad
    work, base = _own_terms(sol, graph, grad_bytes)
    grads = dict(base)
    for param, nbytes in _gathered_weight_grads(
        sol, graph, grad_bytes, layer_of
    ).items():
        if param in grads:
            grads[param] = (max(grads[param][0], nbytes), grads[param][1])
    return work, grads


def cached_on(sol: StageSolution, graph: OpGraph, key: tuple, compute: Callable) -> Any:
    """``compute()``, kept in the solution's cache under `key`: what these functions derive from
    a solution does not change (its choice is fixed), and the search attributes every solution
    to several layer clusterings (`planner.inter.stage_table.profile`)."""
    if sol._ctx is None or sol._ctx.graph is not graph:
        return compute()  # not the solution's own graph: nothing to keep
    cache = sol._derived
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _own_terms(
    sol: StageSolution, graph: OpGraph, grad_bytes: float
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """`backward_terms` before the gathered weight gradients: ``work`` per op and
    (``fresh``, ``priced``) per parameter from its own placement; computed once per solution."""
    return cached_on(
        sol,
        graph,
        ("own_terms", grad_bytes),
        lambda: _compute_own_terms(sol, graph, grad_bytes),
    )


def _compute_own_terms(
    sol: StageSolution, graph: OpGraph, grad_bytes: float
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    # a node's term depends on its option alone (unless its strategy does not give its inputs'
    # placements): kept per (node, option) for every solution of the pricing
    memo = sol._ctx.shared.setdefault(("own_terms", grad_bytes), {})
    work: dict[str, float] = {}
    grads: dict[str, tuple[float, float]] = {}
    for name, opt in sol.choice.items():
        key = (name, id(opt))
        term = memo.get(key)
        if term is None:
            term, alone = _own_term(sol, graph, grad_bytes, name, opt)
            if alone:
                memo[key] = term
        kind, value = term
        if kind == "work":
            work[name] = value
        elif kind == "grads":
            grads[name] = value
    return work, grads


def _own_term(
    sol: StageSolution, graph: OpGraph, grad_bytes: float, name: str, opt
) -> tuple[tuple[str | None, Any], bool]:
    """(("work", work(v)) for an op, ("grads", (fresh, priced)) for a parameter, or (None,
    None)), and whether it depends on `opt` alone (not on the inputs' choices)."""
    mesh = sol.mesh_shape
    node = graph.node(name)
    strategy = opt.strategy
    if node.op == "param":
        if opt.zero == 3 or not strategy.output or not strategy.output[0]:
            return (None, None), True
        placement = strategy.output[0]
        fresh = node.outputs[0].numel() / shards(placement, mesh) * grad_bytes
        zero = (
            math.prod(n for p, n in zip(placement, mesh) if p == "R") if opt.zero else 1
        )
        return ("grads", (fresh, fresh / zero)), True
    if node.op != "call" or not node.requires_grad or node.is_view:
        return (None, None), True
    out = node.outputs[0]
    total = 0.0
    if _is_float(out.dtype) and strategy.output and strategy.output[0]:
        total += out.nbytes / shards(strategy.output[0], mesh)
    by_index = len(strategy.inputs) == len(node.inputs)
    seen = set()
    for i, u in enumerate(node.inputs):
        if u in seen:
            continue
        seen.add(u)
        src = graph.node(u)
        if src.op == "param" or not src.requires_grad or not src.outputs:
            continue
        if not _is_float(src.outputs[0].dtype):
            continue
        placement = strategy.inputs[i] if by_index else None
        if placement is None and u in sol.choice:
            placement = sol.choice[u].strategy.output[0]
        total += src.outputs[0].nbytes / (shards(placement, mesh) if placement else 1)
    return ("work", total), by_index and all(p is not None for p in strategy.inputs)


def param_grad_terms(
    sol: StageSolution, graph: OpGraph, param: str, readers: set[str]
) -> tuple[float, float]:
    """(``fresh``, ``priced``) gradient bytes of `param` on one device (module docstring) where
    only the ops `readers` use it: a tied parameter's copy in a later stage."""
    _, grads = backward_terms(sol, graph)
    if param not in grads:
        return 0.0, 0.0
    mesh = sol.mesh_shape
    grad_bytes = state_bytes_per_param(sol.optimizer or "adam_mixed").grad
    opt = sol.choice[param]
    fresh = graph.node(param).outputs[0].numel() / shards(opt.strategy.output[0], mesh)
    fresh *= grad_bytes
    gathered = _gathered_weight_grads(sol, graph, grad_bytes, None, readers).get(
        param, 0.0
    )
    return max(fresh, gathered), grads[param][1]


def _gathered_weight_grads(
    sol: StageSolution,
    graph: OpGraph,
    grad_bytes: float,
    layer_of: dict[str, int] | None = None,
    readers: set[str] | None = None,
) -> dict[str, float]:
    """Per parameter that some op receives redistributed into a new tensor (a weight all-gathered
    for its use): the gradient bytes of those ops' copies, at the placements the ops use them
    with. The backward computes the weight's gradient there first, then reduces it to the
    parameter's placement. `layer_of`: only ops in the parameter's own layer; `readers`: only
    those ops."""
    out: dict[str, float] = {}
    for name, root, nbytes in _weight_copies(sol, graph, grad_bytes):
        if readers is not None and name not in readers:
            continue
        if layer_of is not None and layer_of.get(name) != layer_of.get(root):
            continue
        out[root] = out.get(root, 0.0) + nbytes
    return out


def _weight_copies(
    sol: StageSolution, graph: OpGraph, grad_bytes: float
) -> list[tuple[str, str, float]]:
    """(op, parameter, gradient bytes) of every weight an op receives as a new tensor
    (`_gathered_weight_grads` before its filters), in the order of ``sol.choice`` and the ops'
    inputs; computed once per solution."""
    return cached_on(
        sol,
        graph,
        ("weight_copies", grad_bytes),
        lambda: _compute_weight_copies(sol, graph, grad_bytes),
    )


def _compute_weight_copies(
    sol: StageSolution, graph: OpGraph, grad_bytes: float
) -> list[tuple[str, str, float]]:
    mesh = sol.mesh_shape
    out = []
    for name, reads in _weight_reads(sol, graph):
        ins = sol.choice[name].strategy.inputs
        if len(ins) != len(graph.node(name).inputs):
            continue
        for i, w, root in reads:
            target = ins[i]
            if target is None:
                continue
            if _copied_on_the_way(sol, graph, w, target):
                meta = graph.node(w).outputs[0]
                out.append(
                    (name, root, meta.numel() / shards(target, mesh) * grad_bytes)
                )
    return out


def _weight_reads(
    sol: StageSolution, graph: OpGraph
) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """Per op (not a view) of the solution, in its order: (input position, input, parameter)
    of each input whose storage is a parameter's."""

    def make() -> list[tuple[str, list[tuple[int, str, str]]]]:
        out = []
        for name in sol.choice:
            node = graph.node(name)
            if node.op != "call" or node.is_view:
                continue
            reads = [
                (i, w, root)
                for i, w in enumerate(node.inputs)
                if graph.node(root := _root(graph, w)).op == "param"
            ]
            if reads:
                out.append((name, reads))
        return out

    return _per_pricing(sol, graph, ("weight_reads", len(sol.choice)), make)


def _per_pricing(sol: StageSolution, graph: OpGraph, key: tuple, make: Callable) -> Any:
    """`PricedStage.per_pricing` of the solution's pricing (``make()`` without one)."""
    return make() if sol._ctx is None else sol._ctx.per_pricing(graph, key, make)


def _root(graph: OpGraph, name: str) -> str:
    """The value owning `name`'s storage, as the tracer resolves ``saved`` (through views; a
    getitem of a multi-output op owns its storage); found once per graph and value (every
    solution of every mesh asks)."""
    roots = graph.derived("storage_roots", dict)
    root = roots.get(name)
    if root is None:
        root = roots[name] = _find_root(graph, name)
    return root


def _find_root(graph: OpGraph, name: str) -> str:
    node = graph.node(name)
    while node.is_view and node.inputs:
        src = graph.node(node.inputs[0])
        if node.target == "getitem" and not src.is_view:
            break
        node = src
    return node.name


def _new_tensor(source: tuple[str, ...], target: tuple[str, ...]) -> bool:
    """Whether redistributing `source` placements to `target` makes a new tensor: not when they
    are equal (any two partial reductions alike) or every differing axis slices a replicated
    tensor (R -> S(d): a view)."""
    return any(
        s != t
        and not (s.startswith("P") and t.startswith("P"))
        and not (s == "R" and t.startswith("S"))
        for s, t in zip(source, target)
    )


def _copied_on_the_way(
    sol: StageSolution, graph: OpGraph, name: str, target: tuple[str, ...]
) -> bool:
    """Whether value `name`, received at placements `target`, is a new tensor made by a
    redistribution on its way from the value owning its storage (along the views between)."""
    while True:
        src = sol.choice.get(name)
        if src is None or not src.strategy.output or not src.strategy.output[0]:
            return False
        if _new_tensor(tuple(src.strategy.output[0]), tuple(target)):
            return True
        node = graph.node(name)
        if not node.is_view or not node.inputs:
            return False
        if node.target == "getitem" and not graph.node(node.inputs[0]).is_view:
            return False
        ins = src.strategy.inputs
        if not ins or ins[0] is None or len(ins) != len(node.inputs):
            return False
        name, target = node.inputs[0], ins[0]


def resharded_saves(sol: StageSolution, graph: OpGraph) -> dict[str, float]:
    """Per op node: bytes per micro-batch of the redistributed inputs it saves for backward
    (module docstring)."""
    return cached_on(
        sol, graph, ("resharded_saves",), lambda: _compute_resharded_saves(sol, graph)
    )


def _compute_resharded_saves(sol: StageSolution, graph: OpGraph) -> dict[str, float]:
    mesh = sol.mesh_shape
    out: dict[str, float] = {}
    # saved values some op keeps in their own storage: its own outputs (a layer norm's mean,
    # an attention's log-sum-exp), inputs read without a copy, inputs of ops not examined here
    kept_whole: set[str] = set()
    for name, inputs, own in _saving_reads(sol, graph):
        kept_whole.update(own)
        strategy = sol.choice[name].strategy
        if (
            len(strategy.inputs) != len(graph.node(name).inputs)
            or context_axis(strategy) is not None
        ):
            # context-parallel attention: its gathered k and v are in its activation bytes
            # already (`planner.intra.context.gathered_kv_bytes`)
            kept_whole.update(_root(graph, w) for _, w in inputs)
            continue
        total = 0.0
        for i, w in inputs:
            target = strategy.inputs[i]
            if target is not None and _copied_on_the_way(sol, graph, w, target):
                total += graph.node(w).outputs[0].nbytes / shards(target, mesh)
            else:
                kept_whole.add(_root(graph, w))
        if total:
            out[name] = total
    # a saved value every saver receives as a copy is not kept itself: take back the bytes its
    # producer's activation price counts for it
    for w in saved_values(graph, list(sol.choice)) - kept_whole:
        own = sol.choice.get(w)
        if own is None or not own.strategy.output or not own.strategy.output[0]:
            continue
        nbytes = graph.node(w).outputs[0].nbytes / shards(own.strategy.output[0], mesh)
        out[w] = out.get(w, 0.0) - nbytes
    return out


def _saving_reads(
    sol: StageSolution, graph: OpGraph
) -> list[tuple[str, list[tuple[int, str]], frozenset[str]]]:
    """Per op of the solution that saves something, in its order: (position, input) of each
    input it saves (a saved parameter, or a value whose storage it saves), and the values it
    saves that are none of its inputs' storage (its own outputs, say: kept whole)."""

    def make() -> list[tuple[str, list[tuple[int, str]], frozenset[str]]]:
        out = []
        for name in sol.choice:
            node = graph.node(name)
            if node.op != "call" or not (node.saved or node.saved_params):
                continue
            saved = set(node.saved)
            roots = [_root(graph, w) for w in node.inputs]
            out.append(
                (
                    name,
                    [
                        (i, w)
                        for i, (w, r) in enumerate(zip(node.inputs, roots))
                        if w in node.saved_params or r in saved
                    ],
                    frozenset(saved.difference(roots)),
                )
            )
        return out

    return _per_pricing(sol, graph, ("saving_reads", len(sol.choice)), make)
