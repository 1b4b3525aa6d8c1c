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

from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.tracing.opgraph import OpGraph

__all__ = ["grad_timeline", "net_backward_work"]

# the last few spans' index arrays (`_spans`), per (layer_of, op names, parameter names): the
# search attributes many solutions of one graph to each of a few clusterings
_SPANS: list[tuple[tuple[Any, ...], list[_Span]]] = []


@dataclass(frozen=True)
class _Span:
    """What `grad_timeline` reads of the graph and the clustering for one span of last layers:
    a permutation of the parameters by when, in forward order, their gradients are made; per
    op, where its layer's parameters and those made before it begin in that order; the ops
    grouped by layer (a permutation, each group's start, its layer); and each parameter's
    layer in ``done`` (-1: none)."""

    j0: int
    order: np.ndarray
    upto: np.ndarray
    start: np.ndarray
    by_layer: np.ndarray
    groups: np.ndarray
    group_layer: np.ndarray
    done_layer: np.ndarray


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
    out = []
    for span in _spans(graph, layer_of, ops, params):
        cum = np.concatenate([[0.0], np.cumsum(fresh[span.order])])
        within = cum[span.upto] - cum[span.start]  # within(v), module docstring
        net = np.zeros(L)
        if len(ops):
            net[span.group_layer] = np.maximum.reduceat(
                (work - within)[span.by_layer], span.groups
            )
        mask = span.done_layer >= 0
        done = np.bincount(span.done_layer[mask], weights=fresh[mask], minlength=L)
        out.append((span.j0, net, done[:L]))
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


def _spans(
    graph: OpGraph, layer_of: dict[str, int], ops: list[str], params: list[str]
) -> list[_Span]:
    """`_Span` of each span of last layers (`grad_timeline`); kept for the last few."""
    for (known, known_ops, known_params), spans in _SPANS:
        if (
            known is layer_of
            and (known_ops is ops or known_ops == ops)
            and (known_params is params or known_params == params)
        ):
            return spans
    spans = _make_spans(graph, layer_of, ops, params)
    _SPANS.insert(0, ((layer_of, ops, params), spans))
    del _SPANS[16:]
    return spans


def _make_spans(
    graph: OpGraph, layer_of: dict[str, int], ops: list[str], params: list[str]
) -> list[_Span]:
    """The spans, from keys ``layer * N + position`` (N nodes in the graph): per op its own;
    per parameter its layer's and its last reader's position (beyond every op of its layer
    when a reader lies in a later one: never within, never in ``done``), or, read in exactly
    two layers ``a < b``, in a span ending before ``b``, its last reader's in ``a``."""
    position, readers = _positions(graph)
    n = len(graph.nodes)
    names = [node.name for node in graph.nodes]
    op_layer = np.fromiter((layer_of.get(v, 0) for v in ops), int, len(ops))
    op_key = op_layer * n + np.fromiter((position[v] for v in ops), int, len(ops))
    P = len(params)
    plain_key, plain_done = np.empty(P, int), np.empty(P, int)
    own_key, until = np.empty(P, int), np.full(P, -1)
    for i, p in enumerate(params):
        a = layer_of.get(p, 0)
        at = readers.get(p) or [position[p]]
        layers = [layer_of.get(names[r], 0) for r in at]
        plain_key[i] = a * n + at[-1]  # read beyond its layer: past every op of it
        plain_done[i] = a if layers[-1] == a else -1
        own_key[i] = plain_key[i]
        if len(set(layers)) == 2 and layers[0] == a:
            own_key[i] = a * n + max(r for r, m in zip(at, layers) if m == a)
            until[i] = layers[-1]
    by_layer = np.argsort(op_layer, kind="stable")
    sorted_layers = op_layer[by_layer]
    groups = np.flatnonzero(np.r_[True, sorted_layers[1:] != sorted_layers[:-1]])
    groups = groups if len(ops) else np.zeros(0, int)
    spans = []
    for j0 in [0] + sorted({int(b) for b in until[until >= 0]}):
        own = until > j0  # two-layer parameters whose later reader lies after this span
        key = np.where(own, own_key, plain_key)
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        spans.append(
            _Span(
                j0,
                order,
                np.searchsorted(sorted_key, op_key),
                np.searchsorted(sorted_key, op_key - op_key % n),
                by_layer,
                groups,
                sorted_layers[groups] if len(ops) else np.zeros(0, int),
                np.where(own, own_key // n, plain_done),
            )
        )
    return spans


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
