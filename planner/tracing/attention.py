"""The attention cores of a traced graph: what selective recomputation re-runs in backward.

Megatron-LM's selective activation recomputation (Korthikanti et al. 2022, section 5) keeps every
activation of a transformer layer but those of the attention core - the score product QK^T, the
scaled masked softmax, the attention dropout and the product with V - and recomputes that core in
backward from its inputs (q, k, v and the mask), which are kept. `attention_cores` finds the cores
in the op graph by op kinds, within one module:

* fused: an ``aten._scaled_dot_product_*`` op (flash, efficient, cuDNN, math, CPU flash) with the
  getitems picking its outputs;
* explicit: a softmax (``aten._softmax`` / ``aten.softmax`` / ``aten._safe_softmax``) whose input
  comes (through element-wise ops and views) from a matrix product of two activations (no
  parameter), and whose output reaches (through dropout, element-wise ops and views) another
  such product: the core is every op on a path from the first product to the second, both
  included; ops of the softmax's module or its submodules (a dropout module) only.

A model with neither has no attention core (`attention_cores` returns {}); selective
recomputation is then refused for it (`planner.vocab.plan_check`, the stage DP never offers it).
"""

from __future__ import annotations

from planner.tracing.opgraph import OpGraph, OpNode

__all__ = ["FUSED_ATTENTION", "attention_cores", "storage_owner"]

#: The prefix of the targets of fused attention ops (flash, efficient, cuDNN, math, CPU flash).
FUSED_ATTENTION = "aten._scaled_dot_product_"
_SOFTMAX = ("aten._softmax.", "aten.softmax.", "aten._safe_softmax.")
_PRODUCTS = ("aten.bmm.", "aten.mm.", "aten.matmul.", "aten.baddbmm.")


def _target(node: OpNode) -> str:
    return str(node.target)


def storage_owner(graph: OpGraph, name: str) -> str:
    """The value owning the storage of `name` (through views; a getitem of a multi-output op owns
    its storage), as the tracer resolves saved tensors."""
    node = graph.node(name)
    while node.is_view and node.inputs:
        src = graph.node(node.inputs[0])
        if _target(node) == "getitem" and not src.is_view:
            break
        node = src
    return node.name


def _activation_product(graph: OpGraph, node: OpNode, derived: set[str]) -> bool:
    """A matrix product of two activations (no input derived from a parameter)."""
    ins = [u for u in node.inputs if graph.node(u).op not in ("param", "buffer")]
    return (
        _target(node).startswith(_PRODUCTS)
        and len(ins) >= 2
        and not any(u in derived for u in node.inputs)
    )


def attention_cores(graph: OpGraph) -> dict[str, int]:
    """Op node name -> index of its attention core, for every op of every core (module
    docstring); {} when the model has none."""
    derived = graph.param_derived()
    users: dict[str, list[str]] = {}
    for n in graph.ops:
        for u in n.inputs:
            users.setdefault(u, []).append(n.name)
    out: dict[str, int] = {}
    for n in graph.ops:
        t = _target(n)
        if t.startswith(FUSED_ATTENTION):
            core = [n.name] + [
                w for w in users.get(n.name, []) if graph.node(w).target == "getitem"
            ]
        elif t.startswith(_SOFTMAX):
            core = _explicit_core(graph, n, users, derived)
        else:
            continue
        if core and not any(c in out for c in core):
            k = len(set(out.values()))
            out.update(dict.fromkeys(core, k))
    return out


def _explicit_core(
    graph: OpGraph, softmax: OpNode, users: dict[str, list[str]], derived: set[str]
) -> list[str]:
    """The ops on paths from the score product to the product with V around `softmax`, both in
    the softmax's module; [] when either product is missing."""
    module = softmax.module_path

    def same(name: str) -> bool:
        path = graph.node(name).module_path
        return graph.node(name).op == "call" and (
            path == module or path.startswith(module + ".")
        )

    # back from the softmax along its first input to the score product
    first, node = None, softmax
    while node.inputs and same(node.inputs[0]):
        node = graph.node(node.inputs[0])
        if _activation_product(graph, node, derived):
            first = node
            break
    if first is None:
        return []
    # forward from the softmax to the first product of two activations
    reach, frontier, last = {softmax.name}, [softmax.name], None
    while frontier and last is None:
        nxt = []
        for u in frontier:
            for w in users.get(u, []):
                if w in reach or not same(w):
                    continue
                reach.add(w)
                if _activation_product(graph, graph.node(w), derived):
                    last = w
                    break
                nxt.append(w)
            if last is not None:
                break
        frontier = nxt
    if last is None:
        return []
    # every op after `first` (inclusive) that reaches `last`
    order = [n.name for n in graph.ops]
    a, b = order.index(first.name), order.index(last)
    down = {first.name}
    for name in order[a + 1 : b + 1]:
        if any(u in down for u in graph.node(name).inputs):
            down.add(name)
    up = {last}
    for name in reversed(order[a:b]):
        if any(w in up for w in users.get(name, [])):
            up.add(name)
    return [name for name in order[a : b + 1] if name in down and name in up]
