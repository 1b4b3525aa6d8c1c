"""The backward's working bytes net of the gradients not yet made (`planner.inter.grad_timeline`)
against a step-by-step replay of the backward, and the compiled stage's peak as measured."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from profiles import cpu_cluster

from planner.inter.grad_timeline import grad_timeline, net_backward_work
from planner.tracing.opgraph import OpGraph, OpNode


def _instance(rng: random.Random, shared: str) -> tuple[OpGraph, dict, dict, dict]:
    """Random layers of ops, each op reading some of its layer's parameters (through a view
    for some); one parameter more is read, `shared`, by the first op of the first and the last
    layer (\"tied\"), of every layer (\"every\"), or by none (\"none\")."""
    nodes: list[OpNode] = []
    layer_of: dict[str, int] = {}
    work: dict[str, float] = {}
    fresh: dict[str, float] = {}
    L = rng.randint(1, 5)
    for layer in range(L):
        params = [f"p{layer}_{i}" for i in range(rng.randint(0, 3))]
        for p in params:
            nodes.append(OpNode(p, "param", p, "param", requires_grad=True))
            layer_of[p] = layer
            fresh[p] = float(rng.randint(1, 50))
        unread = set(params)
        ops = rng.randint(1, 4)
        for i in range(ops):
            reads = rng.sample(params, rng.randint(0, len(params)))
            if (
                i == ops - 1
            ):  # every parameter is read (one never read gets no gradient)
                reads += sorted(unread.difference(reads))
            unread.difference_update(reads)
            if i == 0 and (
                (shared == "tied" and layer in (0, L - 1)) or shared == "every"
            ):
                reads.append("tied")
            inputs = []
            for p in reads:
                if p == "tied" and "tied" not in fresh:
                    nodes.append(OpNode(p, "param", p, "param", requires_grad=True))
                    layer_of[p], fresh[p] = 0, 40.0
                if (
                    rng.random() < 0.5
                ):  # read through a view, as a linear reads t(weight)
                    view = f"t{len(nodes)}"
                    nodes.append(OpNode(view, "call", "t", "view", [p], is_view=True))
                    layer_of[view] = layer
                    p = view
                inputs.append(p)
            name = f"op{len(nodes)}"
            nodes.append(OpNode(name, "call", "f", "op", inputs, requires_grad=True))
            layer_of[name] = layer
            work[name] = float(rng.randint(0, 100))
    graph = OpGraph(nodes, {}, {}, {})
    return graph, layer_of, work, fresh


def _replayed(graph: OpGraph, layer_of, work, fresh, k: int, j: int) -> float:
    """max(0, max over ops v of layers k..j of (made(v) + work(v)) - fresh): the backward run
    op by op from the last, a parameter's gradient made from its last reader on."""
    ops = [n for n in graph.nodes if n.op == "call" and n.name in work]
    ops = [n for n in ops if k <= layer_of[n.name] <= j]
    roots = graph.param_roots()
    params = {p for p in fresh if k <= layer_of[p] <= j}
    total = sum(fresh[p] for p in params)
    made: set[str] = set()
    peak = 0.0
    for node in reversed(ops):
        made |= {roots[u] for u in node.inputs if roots.get(u) in params}
        peak = max(peak, sum(fresh[p] for p in made) + work[node.name] - total)
    return peak


@pytest.mark.parametrize("shared", ["none", "tied", "every"])
def test_net_backward_work_against_a_replay(shared: str) -> None:
    """For every range of layers (a pipeline stage), the formula equals the replay where each
    parameter the stage holds is read in one of its layers, a tied one included in a stage
    without its later reader (its gradient there is made at its last reader in the stage);
    where a stage holds a parameter's readers in several layers, the formula stays an upper
    bound (that gradient counted as made from the stage's first backward op on)."""
    rng = random.Random(3)
    exact = 0
    for _ in range(200):
        graph, layer_of, work, fresh = _instance(rng, shared)
        L = max(layer_of.values()) + 1
        ops, params = list(work), list(fresh)
        spans = grad_timeline(
            graph,
            layer_of,
            ops,
            np.array([work[v] for v in ops]),
            params,
            np.array([fresh[p] for p in params]),
            L,
        )
        table = net_backward_work(spans, L)
        for k in range(L):
            for j in range(k, L):
                replay = _replayed(graph, layer_of, work, fresh, k, j)
                spread = shared == "every" or (shared == "tied" and k == 0 < j == L - 1)
                if spread:
                    assert table[k, j] >= replay - 1e-9
                    exact += table[k, j] == pytest.approx(replay)
                else:
                    assert table[k, j] == pytest.approx(replay), (k, j)
    if shared != "none":
        assert exact > 0


def _peak(plan: Any, spec: str) -> list[dict[str, Any]]:
    from runtime.train import measure_peak_memory, seeded_model_and_batches

    model, batches = seeded_model_and_batches(spec, plan.global_batch, 2, seed=0)
    return measure_peak_memory(plan, model, batches, optimizer="sgd", lr=0.01)


@pytest.mark.slow
def test_compiled_stage_peak_as_measured() -> None:
    """One process, a GPT whose LM head's working set (logits and their gradient, 8.6 MB) is as
    large as its blocks' gradients: the runtime's compiled stage holds parameters, activations
    and every gradient at the end of backward, and the head's working set only at its start,
    before most gradients are made. The predicted peak equals the measured one within 1%, with
    one micro-batch and with two (the second's fresh gradients next to the accumulated ones).
    Counting the head's working set on top of every gradient predicted 13% above the measured
    peak with one micro-batch and 10% with two."""
    from planner.plans.manual import manual_plan
    from runtime.launch import launch

    spec = "gpt:hidden=256,layers=4,heads=4,seq=64,vocab=4096"
    for B, batch in ((1, 4), (2, 8)):
        plan = manual_plan(
            spec,
            cpu_cluster(1),
            dp=1,
            tp=1,
            pp=1,
            num_microbatches=B,
            global_batch=batch,
            dtype="float32",
            optimizer="sgd",
            allow_oom=True,
        )
        (r,) = launch(_peak, 1, args=(plan, spec), timeout_s=300)[0]
        assert r["ratio"] == pytest.approx(1.0, abs=0.01), (B, r)
