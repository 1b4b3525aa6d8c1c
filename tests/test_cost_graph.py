"""Follower merging and repeated-block quotient preserve the objective of every choice they allow."""

from __future__ import annotations

import itertools

import numpy as np

from planner.intra.cost_graph import CostGraph, identity, merge_followers, quotient
from planner.intra.ilp import brute_force, solve


def _original_objective(g: CostGraph, choice: dict[str, int]) -> tuple[float, float]:
    c = [choice[n] for n in g.names]
    obj = sum(g.costs[v][c[v]] for v in range(len(c))) + sum(
        r[c[u], c[v]] for (u, v), r in g.edges.items()
    )
    return obj, sum(g.memory[v][c[v]] for v in range(len(c)))


def _random_graph(rng: np.random.Generator, n: int, k: list[int]) -> CostGraph:
    g = CostGraph(
        [f"n{i}" for i in range(n)],
        [rng.uniform(0, 5, k[i]) for i in range(n)],
        [rng.uniform(0, 9, k[i]) for i in range(n)],
    )
    for v in range(1, n):
        for u in {int(x) for x in rng.integers(0, v, size=2)}:
            g.add_edge(
                u,
                v,
                rng.uniform(0, 5, (k[u], k[v]))
                * (rng.uniform(size=(k[u], k[v])) < 0.6),
            )
    return g


def test_merge_preserves_objective_and_memory() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        n = 7
        g = _random_graph(rng, n, [int(rng.integers(1, 4)) for _ in range(n)])
        producers = {v: [u for (u, w) in g.edges if w == v] for v in range(n)}
        leaders = {
            g.names[v]: g.names[max(ps)]
            for v, ps in producers.items()
            if ps and rng.uniform() < 0.6
        }
        red = merge_followers(identity(g), leaders)
        assert len(red.graph.names) == n - len(leaders)
        assert all(red.target[f] == red.target[lead] for f, lead in leaders.items())
        for _ in range(5):
            choice = [int(rng.integers(0, c.size)) for c in red.graph.costs]
            got = red.graph.problem(None)
            full = red.expand(choice)
            obj, mem = _original_objective(g, full)
            assert np.isclose(got.objective(choice), obj)
            assert np.isclose(got.memory(choice), mem)


def test_quotient_is_exact_over_shared_choices() -> None:
    rng = np.random.default_rng(1)
    # Three identical "blocks" of 3 nodes in a chain, with a prefix and a suffix node.
    k = [2, 3, 2, 3, 3, 2, 3, 3, 2, 3, 2]
    g = CostGraph(
        [f"n{i}" for i in range(11)],
        [rng.uniform(0, 5, x) for x in k],
        [rng.uniform(0, 9, x) for x in k],
    )
    for v in range(1, 11):
        g.add_edge(v - 1, v, rng.uniform(0, 5, (k[v - 1], k[v])))
    g.add_edge(
        1, 4, rng.uniform(0, 5, (k[1], k[4]))
    )  # block 0 -> block 1 skip edge (a residual)
    g.add_edge(4, 7, rng.uniform(0, 5, (k[4], k[7])))
    rep = {f"n{1 + 3 * b + j}": f"n{1 + j}" for b in range(3) for j in range(3)}
    red = quotient(identity(g), rep)
    assert len(red.graph.names) == 5
    best_reduced = solve(red.graph.problem(None))
    # Brute force over the original choices that shard all copies alike.
    p = g.problem(None)
    best = min(
        (p.objective(c), c)
        for c in itertools.product(*(range(x) for x in k))
        if all(c[1 + 3 * b + j] == c[1 + j] for b in range(3) for j in range(3))
    )
    assert np.isclose(best_reduced.objective, best[0])
    full = red.expand(best_reduced.choice)
    assert np.isclose(_original_objective(g, full)[0], best[0])
    assert np.isclose(
        brute_force(red.graph.problem(None)).objective, best_reduced.objective
    )
