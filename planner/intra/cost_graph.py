"""A cost graph (nodes with per-strategy costs, edges with cost matrices) and its two reductions.

Both reductions shrink the intra-op ILP before it is built (DESIGN, "The two searches"):

* `merge_followers`: a node that only follows one neighbour (a view, getitem, or single-input
  elementwise op) takes, for each strategy i of its leader, the strategy j(i) that needs no
  resharding from it (cheapest among those). Its costs, memory and outgoing edges fold into the
  leader: cost'[u, i] = cost[u, i] + R[u, v, i, j(i)] + cost[v, j(i)] and R'[u, w, i, k] =
  R[v, w, j(i), k].
* `quotient`: identical repeated blocks (transformer layers) share one strategy per position, so the
  nodes of every copy map to one representative: its cost and memory are the sums over the copies;
  edges are summed over copies after mapping both ends; an edge whose ends map to the same
  representative becomes its diagonal added to the node's cost. The program's size no longer grows
  with the number of layers, and its optimum is exact among plans that shard every copy alike.

`expand` maps a choice on the reduced graph back to every original node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.intra.ilp import ILPProblem


@dataclass
class CostGraph:
    names: list[str]
    costs: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def add_edge(self, u: int, v: int, r: np.ndarray) -> None:
        if u == v:
            self.costs[u] = self.costs[u] + np.diag(r)
        elif (u, v) in self.edges:
            self.edges[u, v] = self.edges[u, v] + r
        else:
            self.edges[u, v] = np.array(r, dtype=float)

    def problem(self, budget: float | None) -> ILPProblem:
        return ILPProblem(
            self.costs,
            [(u, v, r) for (u, v), r in sorted(self.edges.items())],
            self.memory,
            budget,
        )


@dataclass
class Reduction:
    """How original nodes map to the reduced graph: node -> (reduced index, strategy map).

    `strategy_of[name][i]` is the original node's strategy when its reduced node picks strategy i.
    """

    graph: CostGraph
    target: dict[str, int]
    strategy_of: dict[str, np.ndarray]

    def expand(self, choice: list[int]) -> dict[str, int]:
        return {n: int(self.strategy_of[n][choice[t]]) for n, t in self.target.items()}


def identity(graph: CostGraph) -> Reduction:
    return Reduction(
        graph,
        {n: i for i, n in enumerate(graph.names)},
        {n: np.arange(c.size) for n, c in zip(graph.names, graph.costs)},
    )


def merge_followers(red: Reduction, leader_of: dict[str, str]) -> Reduction:
    """Fold every `follower -> leader` pair (processed in node order) into the leader."""
    g = red.graph
    costs = [c.copy() for c in g.costs]
    memory = [m.copy() for m in g.memory]
    edges = dict(g.edges)
    alive = set(range(len(g.names)))
    strategy_of = dict(red.strategy_of)
    target = dict(red.target)
    idx = g.index()
    # Where each reduced node's strategies point in the node it was merged into.
    where: dict[int, tuple[int, np.ndarray]] = {}
    for v in range(len(g.names)):
        leader = leader_of.get(g.names[v])
        if leader is None or leader not in idx:
            continue
        # Edges out of a merged leader were re-pointed at its root, rows in the root's strategies.
        u_root = where[idx[leader]][0] if idx[leader] in where else idx[leader]
        r_root = edges.get((u_root, v))
        if r_root is None or v not in alive:
            continue
        # j(i): among v's strategies with the least resharding from the root's strategy i, the cheapest.
        best = r_root.min(axis=1, keepdims=True)
        score = np.where(
            r_root == best, costs[v][None, :], np.inf
        )  # exact: tiny costs are not ties
        j = np.argmin(score, axis=1)
        rows = np.arange(r_root.shape[0])
        costs[u_root] = costs[u_root] + r_root[rows, j] + costs[v][j]
        memory[u_root] = memory[u_root] + memory[v][j]
        del edges[u_root, v]
        for (a, b), m in list(edges.items()):
            if a == v:
                del edges[a, b]
                _acc(edges, costs, u_root, b, m[j])
            elif b == v:
                del edges[a, b]
                _acc(edges, costs, a, u_root, m[:, j])  # column i <- column j(i)
        alive.discard(v)
        where[v] = (u_root, j)
    # Renumber the survivors.
    keep = sorted(alive)
    new_id = {old: k for k, old in enumerate(keep)}
    for name, t in target.items():
        root, smap = t, np.arange(costs[t].size)
        if t not in alive:
            root, smap = where[t]
            while root not in alive:  # follow merges of merged leaders
                root, prev = where[root]
                smap = smap[prev]
        target[name] = new_id[root]
        strategy_of[name] = red.strategy_of[name][smap]
    new = CostGraph(
        [g.names[k] for k in keep], [costs[k] for k in keep], [memory[k] for k in keep]
    )
    for (a, b), m in edges.items():
        new.add_edge(new_id[a], new_id[b], m)
    return Reduction(new, target, strategy_of)


def _acc(edges: dict, costs: list, a: int, b: int, m: np.ndarray) -> None:
    if a == b:
        costs[a] = costs[a] + np.diag(m)
    elif (a, b) in edges:
        edges[a, b] = edges[a, b] + m
    else:
        edges[a, b] = m


def quotient(red: Reduction, rep_of: dict[str, str]) -> Reduction:
    """Map every reduced node named in `rep_of` to its representative (which maps to itself)."""
    g = red.graph
    idx = g.index()
    reps = [i for i, n in enumerate(g.names) if rep_of.get(n, n) == n]
    new_id = {old: k for k, old in enumerate(reps)}
    mapped = {i: new_id[idx[rep_of.get(n, n)]] for i, n in enumerate(g.names)}
    costs = [np.zeros_like(g.costs[i]) for i in reps]
    memory = [np.zeros_like(g.memory[i]) for i in reps]
    for i in range(len(g.names)):
        if g.costs[i].size != costs[mapped[i]].size:
            raise ValueError(
                f"{g.names[i]} and its representative have different strategy counts"
            )
        costs[mapped[i]] = costs[mapped[i]] + g.costs[i]
        memory[mapped[i]] = memory[mapped[i]] + g.memory[i]
    new = CostGraph([g.names[i] for i in reps], costs, memory)
    for (a, b), m in g.edges.items():
        new.add_edge(mapped[a], mapped[b], m)
    target = {n: mapped[t] for n, t in red.target.items()}
    return Reduction(new, target, dict(red.strategy_of))
