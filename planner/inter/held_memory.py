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
  gradient and that allocate (views alias their input's gradient); an input that is a view of a
  weight (``t(weight)``) is not an activation: its gradient is the weight's, which the parameter
  state counts. The stage holds the largest such set once: one micro-batch is back-propagated at
  a time, one op at a time. (The LM head's log-softmax of a ``tokens x vocabulary`` tensor is
  typically the largest: its gradient in and out; it runs first in backward, before most
  parameter gradients are made, `planner.inter.grad_timeline`.)
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

The sum is an upper bound: every saved activation is taken to live until the backward ends, next
to every gradient, or next to the largest backward working set and the gradients made before it
runs (`planner.inter.grad_timeline`: the LM head's, largest in a language model, runs first).

Each term is computed once per class of repeated-block copies that read the same choices
(`_classes`: all copies of a block node but the first block's) and given to every member: the
search asks for them for every solution of every logical mesh and micro-batch size (issue 23).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

from cost_models.memory import state_bytes_per_param
from planner.intra.prices import saved_values
from planner.intra.solution import StageSolution
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
    # placements): kept per (node, option) for every solution of the pricing; a copy of a
    # repeated block takes its class leader's (`_classes`)
    memo = sol._ctx.shared.setdefault(("own_terms", grad_bytes), {})
    work: dict[str, float] = {}
    grads: dict[str, tuple[float, float]] = {}
    leader_of = _classes(sol, graph)
    terms: dict[str, tuple[str | None, Any]] = {}
    for name, opt in sol.choice.items():
        leader = leader_of.get(name, name)
        term = terms.get(leader)
        if term is None:
            key = (leader, id(opt))
            term = memo.get(key)
            if term is None:
                term, alone = _own_term(sol, graph, grad_bytes, leader, opt)
                if alone:
                    memo[key] = term
            terms[leader] = term
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
        if graph.node(_root(graph, u)).op == "param":
            continue  # a view of a weight (``t(weight)``): its gradient is the weight's
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
    leader_of = _classes(sol, graph)
    # per class leader: (position, gradient bytes) of each weight it receives as a new tensor
    found: dict[str, list[tuple[int, float]]] = {}
    out = []
    for name, reads in _weight_reads(sol, graph):
        leader = leader_of.get(name, name)
        copies = found.get(leader)
        if copies is None:
            copies = found[leader] = []
            ins = sol.choice[leader].strategy.inputs
            if len(ins) == len(graph.node(leader).inputs):
                for i, _, _ in reads:  # the leader's reads are at the same positions
                    w = graph.node(leader).inputs[i]
                    if ins[i] is not None and _copied_on_the_way(sol, graph, w, ins[i]):
                        meta = graph.node(w).outputs[0]
                        copies.append(
                            (i, meta.numel() / shards(ins[i], mesh) * grad_bytes)
                        )
        roots = {i: root for i, _, root in reads}
        out.extend((name, roots[i], nbytes) for i, nbytes in copies)
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


def _classes(sol: StageSolution, graph: OpGraph) -> dict[str, str]:
    """The class leader of each node of the solution whose terms here are, in every solution of
    its pricing, those of its leader (the first of its class in the solution's order): a copy
    of a repeated block's node, choosing as its representative does (the pricing's ``rep``,
    `planner.tracing.blocks.representatives`), whose own attributes and saved inputs, and the
    attributes and representatives of each input and of the views between it and the value
    owning its storage, are the leader's (`_class_key`): so it reads the same options
    everywhere. Copies of a block after the first are one class per node; the first block's
    inputs come from outside the stack, so it has its own. Empty (each node its own class)
    for a solution whose copies do not choose their representative's option (one not made
    by `planner.intra.solve.solve_stage`)."""
    ctx = sol._ctx
    if ctx is None or ctx.graph is not graph or not ctx.rep:
        return {}
    return cached_on(sol, graph, ("classes",), lambda: _make_classes(sol, graph))


def _make_classes(sol: StageSolution, graph: OpGraph) -> dict[str, str]:
    choice, rep = sol.choice, sol._ctx.rep
    made = graph.derived("held_memory_classes", dict)
    names = list(choice)
    key = (id(rep), tuple(names))
    if key not in made:
        if len(made) >= 4:  # a few lists of names (whole model, stages) at a time
            made.clear()
        leaders: dict[tuple, str] = {}
        walk = functools.partial(_along_views, graph, rep, set(names), {})
        made[key] = (
            {n: leaders.setdefault(_class_key(graph, n, walk), n) for n in names},
            [n for n in names if rep.get(n, n) != n],
            [rep[n] for n in names if rep.get(n, n) != n],
        )
    leader_of, copies, their_reps = made[key]
    get = choice.get
    if all(map(operator.is_, map(get, copies), map(get, their_reps))):
        return leader_of
    return {}


def _class_key(graph: OpGraph, name: str, walk: Callable[[str], tuple]) -> tuple:
    """What the terms of op `name` read besides the choices (`_classes`): its own and its
    inputs' `_along_views` (`walk`), and the positions of the inputs it saves."""
    node = graph.node(name)
    saved = set(node.saved)
    return (
        walk(name),
        tuple(walk(u) for u in node.inputs),
        tuple(
            i
            for i, w in enumerate(node.inputs)
            if w in node.saved_params or _root(graph, w) in saved
        ),
    )


def _along_views(
    graph: OpGraph, rep: dict[str, str], inside: set[str], memo: dict, name: str
) -> tuple:
    """Node `name`'s representative, attributes and whether the solution has it (is in
    `inside`), then the same of the views from it to the value owning its storage (as
    `_find_root` and `_copied_on_the_way` walk)."""
    if name not in memo:
        node = graph.node(name)
        step = None
        if node.is_view and node.inputs:
            src = graph.node(node.inputs[0])
            if not (node.target == "getitem" and not src.is_view):
                step = _along_views(graph, rep, inside, memo, node.inputs[0])
        memo[name] = (
            rep.get(name, name),
            name in inside,
            node.op,
            node.target,
            node.requires_grad,
            node.is_view,
            tuple(node.outputs),
            len(node.inputs),
            step,
        )
    return memo[name]


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
    leader_of = _classes(sol, graph)
    # per class leader: its total, and which of its saved inputs it keeps whole
    found: dict[str, tuple[float, list[int]]] = {}
    reads, saved = _saving_reads(sol, graph)
    for name, positions, roots, own in reads:
        kept_whole.update(own)
        leader = leader_of.get(name, name)
        if leader not in found:
            found[leader] = _saving_terms(sol, graph, leader, positions)
        total, whole = found[leader]
        kept_whole.update(roots[k] for k in whole)
        if total:
            out[name] = total
    # a saved value every saver receives as a copy is not kept itself: take back the bytes its
    # producer's activation price counts for it
    for w in saved - kept_whole:
        own = sol.choice.get(w)
        if own is None or not own.strategy.output or not own.strategy.output[0]:
            continue
        nbytes = graph.node(w).outputs[0].nbytes / shards(own.strategy.output[0], mesh)
        out[w] = out.get(w, 0.0) - nbytes
    return out


def _saving_terms(
    sol: StageSolution, graph: OpGraph, name: str, positions: list[int]
) -> tuple[float, list[int]]:
    """For op `name` saving its inputs at `positions`: the bytes per micro-batch of those it
    receives as new tensors (`resharded_saves`), and the indices in `positions` of the
    others, whose storage it keeps whole."""
    strategy = sol.choice[name].strategy
    inputs = graph.node(name).inputs
    if len(strategy.inputs) != len(inputs) or context_axis(strategy) is not None:
        # context-parallel attention: its gathered k and v are in its activation bytes
        # already (`planner.intra.context.gathered_kv_bytes`)
        return 0.0, list(range(len(positions)))
    total, whole = 0.0, []
    for k, i in enumerate(positions):
        target, w = strategy.inputs[i], inputs[i]
        if target is not None and _copied_on_the_way(sol, graph, w, target):
            total += graph.node(w).outputs[0].nbytes / shards(target, sol.mesh_shape)
        else:
            whole.append(k)
    return total, whole


def _saving_reads(
    sol: StageSolution, graph: OpGraph
) -> tuple[list[tuple[str, list[int], list[str], frozenset[str]]], set[str]]:
    """Per op of the solution that saves something, in its order: the positions of the inputs
    it saves (a saved parameter, or a value whose storage it saves), the values owning their
    storage, and the values it saves that are none of its inputs' storage (its own outputs,
    say: kept whole); and every value some op of the solution saves (`saved_values`)."""

    def make() -> tuple[
        list[tuple[str, list[int], list[str], frozenset[str]]], set[str]
    ]:
        out = []
        for name in sol.choice:
            node = graph.node(name)
            if node.op != "call" or not (node.saved or node.saved_params):
                continue
            saved = set(node.saved)
            roots = [_root(graph, w) for w in node.inputs]
            positions = [
                i
                for i, (w, r) in enumerate(zip(node.inputs, roots))
                if w in node.saved_params or r in saved
            ]
            own = frozenset(saved.difference(roots))
            out.append((name, positions, [roots[i] for i in positions], own))
        return out, saved_values(graph, list(sol.choice))

    return _per_pricing(sol, graph, ("saving_reads", len(sol.choice)), make)
