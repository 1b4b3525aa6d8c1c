"""When, in a stage's backward, its parameter gradients exist: the working bytes of an op's
backward net of the gradients not yet made.

`planner.inter.held_memory` prices what a stage's backward holds besides saved activations and
parameter state: the largest op's activation gradients (``work(v)``). Parameter state counts
every fresh gradient, but a gradient is made only when the backward reaches the parameter's
last reader (the first in backward order). Before that the bytes are not live: the runtime
sets gradients to None after each step (`runtime.train.Trainer.step`), and its compiled stages
return a micro-batch's gradients from one backward graph, allocated as that graph reaches them
(and from a later micro-batch on, the fresh set being made is `cost_models.memory
.stage_peak_bytes`'s ``accumulating``, made the same way). So the backward's peak is::

    held(v) = made(v) + work(v)    for the op v being back-propagated,
    peak    = everything else + max(fresh, max over v of held(v))
            = everything else + fresh + max(0, max over v of (work(v) - not_yet(v)))

with ``fresh`` all of the stage's fresh gradients and ``not_yet(v) = fresh - made(v)``. The
LM head's log-softmax, the largest working set in a language model, runs first in backward,
when few gradients exist: measured on the local CPU processes, a 4-layer GPT whose head's
working set is 8.6 MB held its 21 MB of gradients at the end of backward, and nothing more
(its peak was parameters + gradients + activations within 0.5%).

``not_yet`` is counted from below, so the peak stays an upper bound: per op ``v`` of layer
``l`` of a stage holding layers ``k..j`` (layers are consecutive ranges of ops), the gradients
of parameters whose readers all lie in one layer ``m`` with ``k <= m < l`` (``done[m]``), and
of those of ``l`` itself whose readers all come before ``v`` (``within(v)``); ``v``'s own
parameters count as made (their gradients are written while ``v``'s input gradients are). A
parameter the stage reads in several layers counts as made from the stage's first backward op
on, so never here. One read in exactly two layers ``a < b`` (a tied embedding) is, in a stage
ending before ``b``, read in ``a`` alone: there it counts as ``a``'s (the later reader's
gradient is its copy's, in a later stage, `planner.plans.assemble`). Per layer::

    work'[l] = max over v in l of (work(v) - within(v))
    backward[k, j] = max(0, max over l in k..j of (work'[l] - done[k..l-1]))
"""

from __future__ import annotations

import numpy as np

from planner.tracing.opgraph import OpGraph

__all__ = ["grad_timeline", "net_backward_work"]

# the last few index arrays, per (layer_of, op names, parameter names) object identities: the
# search attributes many solutions of one graph to each of a few clusterings
_INDEX: list[tuple[tuple[object, ...], tuple[np.ndarray, ...]]] = []


def grad_timeline(
    graph: OpGraph,
    layer_of: dict[str, int],
    ops: list[str],
    work: np.ndarray,
    params: list[str],
    fresh: np.ndarray,
    L: int,
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(``j0``, ``work'``, ``done``) per layer of the clustering `layer_of` (module docstring),
    for ops `ops` with working bytes `work` and parameters `params` with fresh gradient bytes
    `fresh`: one triple per span of last layers, for the stages ending in a layer ``j >= j0``
    (up to the next triple's ``j0``). A parameter read in exactly two layers ``a < b`` (a tied
    embedding) is, in a stage ending before ``b``, one read in ``a`` alone: its gradient there
    is made at its last reader in ``a``; in a stage holding ``b``, from ``b`` on."""
    op_key, plain_key, plain_done, own_key, own_done, until = _index(
        graph, layer_of, ops, params
    )
    n = len(graph.nodes)
    hi_key = op_key
    lo_key = op_key - op_key % n
    out = []
    starts = [0] + sorted({int(b) for b in until[until >= 0]})
    for j0 in starts:
        own = until > j0  # two-layer parameters whose later reader lies after this span
        key = np.where(own, own_key, plain_key)
        done_layer = np.where(own, own_done, plain_done)
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        made = np.concatenate([[0.0], np.cumsum(fresh[order])])
        hi = np.searchsorted(sorted_key, hi_key, side="left")
        lo = np.searchsorted(sorted_key, lo_key, side="left")
        net = np.full(L, -np.inf)
        np.maximum.at(net, op_key // n, work - (made[hi] - made[lo]))
        done = np.zeros(L)
        mask = done_layer >= 0
        np.add.at(done, done_layer[mask], fresh[mask])
        out.append((j0, np.where(np.isfinite(net), net, 0.0), done))
    return out


def net_backward_work(
    spans: list[tuple[int, np.ndarray, np.ndarray]], L: int
) -> np.ndarray:
    """[k, j]: ``max(0, max over l in k..j of (work'[l] - done[k..l-1]))`` (module docstring),
    each column ``j`` from its span of `grad_timeline`."""
    out = np.zeros((L, L))
    bounds = [j0 for j0, _, _ in spans[1:]] + [L]
    for (j0, work, done), j1 in zip(spans, bounds):
        before = np.concatenate([[0.0], np.cumsum(done)])  # before[l] = done[0..l-1]
        d = work - before[:-1]
        for k in range(min(j1, L)):
            lo = max(k, j0)
            if lo >= j1:
                continue
            run = np.maximum.accumulate(d[k:j1])[lo - k :] + before[k]
            out[k, lo:j1] = np.maximum(run, 0.0)
    return out


def _index(
    graph: OpGraph, layer_of: dict[str, int], ops: list[str], params: list[str]
) -> tuple[np.ndarray, ...]:
    """Per op: ``layer * N + position`` (N nodes in the graph). Per parameter: ``layer * N +
    position of its last reader`` and its layer when all its readers are in it (else -1); for
    one read in exactly two layers ``a < b``: ``a * N + position of its last reader in a``,
    ``a`` and ``b`` (else the first two as for the others, and -1)."""
    for known, arrays in _INDEX:
        if known[0] is layer_of and known[1] is ops and known[2] is params:
            return arrays
    position, readers = _positions(graph)
    n = len(graph.nodes)
    names = [node.name for node in graph.nodes]
    op_key = np.fromiter(
        (layer_of.get(v, 0) * n + position[v] for v in ops), int, len(ops)
    )
    P = len(params)
    plain_key, plain_done = np.empty(P, int), np.empty(P, int)
    own_key, own_done, until = np.empty(P, int), np.empty(P, int), np.full(P, -1)
    for i, p in enumerate(params):
        a = layer_of.get(p, 0)
        at = readers.get(p) or [position[p]]
        layers = [layer_of.get(names[r], 0) for r in at]
        plain_key[i] = a * n + at[-1]
        plain_done[i] = a if layers[-1] == a else -1
        own_key[i], own_done[i] = plain_key[i], plain_done[i]
        if len(set(layers)) == 2 and layers[0] == a:
            own_key[i] = a * n + max(r for r, m in zip(at, layers) if m == a)
            own_done[i], until[i] = a, layers[-1]
    arrays = (op_key, plain_key, plain_done, own_key, own_done, until)
    _INDEX.insert(0, ((layer_of, ops, params), arrays))
    del _INDEX[16:]
    return arrays


def _positions(graph: OpGraph) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Each node's index in graph order, and each parameter's readers' (nodes reading it or a
    view of it), in graph order."""

    def make() -> tuple[dict[str, int], dict[str, list[int]]]:
        position = {node.name: i for i, node in enumerate(graph.nodes)}
        roots = graph.param_roots()
        readers: dict[str, list[int]] = {}
        for i, node in enumerate(graph.nodes):
            for u in node.inputs:
                root = roots.get(u)
                if root is not None and (
                    not readers.get(root) or readers[root][-1] != i
                ):
                    readers.setdefault(root, []).append(i)
        return position, readers

    return graph.derived("grad_timeline_positions", make)
