"""The prices of one stage's intra-op program, computed lazily and shared (`planner.intra.solve`).

`PricedStage` holds one stage's graph on one logical mesh with every node's options, and prices
on demand: a node's cost and memory per option (`planner.intra.prices`), an edge's resharding
matrices. Prices are computed once per pricing and shared between nodes and edges that read the
same things: the copies of a repeated block (`price_key`), edges of equal tensor size and
placements (`edge_key`). `restricted` gives the same stage with fewer options per node, sharing
the prices already computed.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cost_models.compute import param_overhead, param_step_time
from planner.intra import fsdp_prices as fp
from planner.intra import prices as sc
from planner.intra.prices import Option, StageSettings
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import norm
from planner.vocab.strategy import consumed_output


@dataclass
class PricedStage:
    graph: OpGraph
    settings: StageSettings
    fx: dict[str, torch.fx.Node]
    options: dict[str, list[Option]]
    edges: list[tuple[str, str]]  # (producer, consumer)
    param_derived: set[str]
    saved: set[str]

    @functools.cached_property
    def param_grad_edges(self) -> list[tuple[str, str, int, int, sc.TensorMeta]]:
        return self.per_pricing(
            self.graph,
            ("param_grad_edges",),
            lambda: sc.param_grad_edges(self.graph, self.param_derived),
        )

    def node_cost(self, name: str, opt: Option) -> float:
        """Seconds per micro-batch of node `name` under `opt`: an op's compute
        (`prices.compute_time`), and for the loss its reduction to replicated
        (`prices.loss_reduction_time`); a parameter's ZeRO / FSDP collectives (`fsdp_prices.zero_cost`),
        the runtime's time per parameter tensor and per byte of its gradient
        (`cost_models.compute.param_overhead`, 0 without a measured profile) and its optimizer
        step on the shard of its state (`cost_models.compute.param_step_time`), the per-step
        terms spread over the micro-batches."""
        node = self.graph.node(name)
        if name in self.graph.placeholder_paths and node.op == "param":
            s, meta = self.settings, node.outputs[0]
            return (
                fp.zero_cost(meta, opt, s)
                + param_overhead(
                    s.mesh.cluster, s.num_microbatches, fp.grad_bytes(meta, opt, s)
                )
                + self.optimizer_cost(name, opt)
            )
        cost = sc.compute_time(node, opt, self.settings)
        if name == self.graph.loss_value:
            cost += sc.loss_reduction_time(node, opt, self.settings)
        return cost

    def optimizer_cost(self, name: str, opt: Option) -> float:
        """Seconds per micro-batch of parameter `name`'s optimizer step under `opt` (its share
        of one step per iteration; in `node_cost`)."""
        key = (self.price_key(name), opt)
        hit = self._steps.get(key)
        if hit is None:
            s = self.settings
            numel = fp.optimizer_numel(self.graph.node(name).outputs[0], opt, s)
            step = param_step_time(s.mesh.cluster, numel, s.optimizer)
            hit = self._steps[key] = step / s.num_microbatches
        return hit

    def ilp_node_cost(self, name: str, opt: Option) -> float:
        """`node_cost` as the intra-op program sees it: less `fsdp_prices.ilp_credit` for an
        FSDP parameter (the gradient all-reduce share its edges charge there)."""
        cost = self.node_cost(name, opt)
        if opt.zero == 3 and self.graph.node(name).op == "param":
            cost -= fp.ilp_credit(self.graph.node(name).outputs[0], opt, self.settings)
        return cost

    def node_memory(self, name: str, opt: Option) -> float:
        node = self.graph.node(name)
        if node.op == "param":
            return fp.param_state_bytes(node.outputs[0], opt, self.settings)
        return sc.activation_bytes(node, opt, name in self.saved, self.settings)

    rep: dict[str, str] = field(default_factory=dict)
    _edges: dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # priced over `full_options`; shared by the restrictions of one pricing
    full_options: dict[str, list[Option]] | None = None  # None: same as `options`
    keep: dict[str, np.ndarray] = field(
        default_factory=dict
    )  # node -> indices of its options in full_options, for nodes a filter restricted
    _sliced: dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )
    _values: dict[tuple[int, int], list[float]] = field(
        default_factory=dict
    )  # (price_key, index in full_options) -> [cost, memory, forward time]; shared like _edges
    _price_keys: dict[str, int] = field(default_factory=dict)  # shared like _edges
    # (price_key, option) -> `optimizer_cost`; shared like _edges
    _steps: dict[tuple[int, Option], float] = field(default_factory=dict)
    _price_ids: dict[tuple, int] = field(default_factory=dict)  # shared like _edges
    _keys: dict[tuple[str, str], tuple[str, str, int]] = field(
        default_factory=dict
    )  # edge -> edge_key; shared like _edges
    # what other passes derive per node and option, alike in every solution of this pricing
    # (`planner.inter.held_memory`); shared like _edges
    shared: dict = field(default_factory=dict)
    # `_keeps_alike`, per list of names: this instance's own (its `keep`)
    _alike: dict[tuple, bool] = field(default_factory=dict)
    # `per_pricing`'s: shared by every pricing of the graph and node set
    # (`planner.intra.solve.price_stage`)
    scope: dict = field(default_factory=dict)

    def price_key(self, name: str) -> int:
        """The number of what `node_cost`, `node_memory` and `sc.forward_time` read of node
        `name` besides the option and the settings: the node's attributes, whether it is a
        parameter and whether its output is saved, and its list of options (one list object for
        every copy of a repeated block). Nodes with equal keys have equal prices option by
        option, so the copies of a transformer block are priced once."""
        key = self._price_keys.get(name)
        if key is None:
            full = self.full_options or self.options
            what = (*self._signature(name), id(full[name]))
            key = self._price_keys[name] = self._price_ids.setdefault(
                what, len(self._price_ids)
            )
        return key

    def _signature(self, name: str) -> tuple:
        """What `price_key` reads of node `name` besides its list of options: the same on
        every mesh."""
        n = self.graph.node(name)
        return (
            n.op,
            n.target,
            n.kind,
            tuple(n.outputs),
            n.fwd_flops,
            n.bwd_flops,
            n.bytes_read,
            n.bytes_written,
            n.saved_extra_bytes,
            n.requires_grad,
            n.is_view,
            name in self.graph.placeholder_paths,
            name in self.saved,
            name == self.graph.loss_value,
        )

    def values(
        self, name: str, i: int, forward: bool = False
    ) -> tuple[float, float] | tuple[float, float, float]:
        """(node_cost, node_memory) of option i of node `name`, and its forward compute time
        when `forward`; computed once per pricing and `price_key`."""
        keep = self.keep.get(name)
        key = (self.price_key(name), i if keep is None else int(keep[i]))
        hit = self._values.get(key)
        if hit is None:
            opt = self.options[name][i]
            hit = self._values[key] = [
                self.node_cost(name, opt),
                self.node_memory(name, opt),
            ]
        if not forward:
            return hit[0], hit[1]
        if len(hit) == 2:
            opt = self.options[name][i]
            hit.append(sc.forward_time(self.graph.node(name), opt, self.settings))
        return hit[0], hit[1], hit[2]

    def costs(self, name: str) -> np.ndarray:
        """``values(name, i)[0]`` of every option i of node `name`, as one read-only array;
        made once per pricing and `price_key` where no filter restricted the node's options
        (`planner.inter.mesh_bound` reads every op's on every mesh it prices)."""
        n = len(self.options[name])

        def make() -> np.ndarray:
            out = np.array([self.values(name, i)[0] for i in range(n)])
            out.setflags(write=False)
            return out

        if name in self.keep:
            return make()
        return _kept(self.shared, ("costs", self.price_key(name)), make)

    def per_pricing(self, graph: OpGraph, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, kept in `scope` for every solution of this pricing, and of the other
        pricings of the graph and node set (on other meshes), when `graph` is its own: what a
        pass over a solution reads of the graph alone (which nodes, edges or inputs to look at),
        the same for all of them (one list of nodes, one of edges)."""
        if self.graph is not graph:
            return make()
        if key not in self.scope:
            self.scope[key] = make()
        return self.scope[key]

    def value_table(self, index: dict[str, int]) -> tuple[list[str], np.ndarray]:
        """(the nodes of `index` in its order, their ``values(n, index[n], forward=True)`` as the
        rows of an array (nodes, 3)). Where each class of nodes priced alike (`price_key` and
        representative, and kept options alike) chooses one option, as the copies of a block do
        in `solve_stage`'s solutions: one lookup per class, gathered for the rest; else one
        lookup per node."""
        names = list(index)
        key = tuple(names)
        cls, samples = self._value_classes(key)
        chosen = np.fromiter(map(index.__getitem__, names), np.int64, len(names))
        picked = chosen[samples]
        if self._keeps_alike(key, cls, samples) and (picked[cls] == chosen).all():
            rows = [
                self.values(names[p], i, forward=True)
                for p, i in zip(samples.tolist(), picked.tolist())
            ]
            return names, np.array(rows, dtype=float).reshape(-1, 3)[cls]
        keep, keys, known = self.keep, self._price_keys, self._values
        rows = []
        for n, i in index.items():  # the loop of `values` without a call per node
            k, pk = keep.get(n), keys.get(n)
            hit = known.get(
                (self.price_key(n) if pk is None else pk, i if k is None else int(k[i]))
            )
            if hit is None or len(hit) == 2:
                hit = self.values(n, i, forward=True)
            rows.append(hit[:3])
        return names, np.array(rows, dtype=float).reshape(-1, 3)

    def _value_classes(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(each of `names`' class among them, the position of each class's first node): nodes of
        one `price_key` and representative (`value_table`). Nodes of one representative share
        its list of options (`planner.intra.solve.price_stage`), so their `price_key`s are
        equal where their `_signature`s are, on every mesh: made once per graph and names."""

        def make() -> tuple[np.ndarray, np.ndarray]:
            found: dict[tuple, int] = {}
            cls = np.empty(len(names), dtype=np.int64)
            samples = []
            for p, n in enumerate(names):
                c = (self._signature(n), self.rep.get(n, n))
                if c not in found:
                    found[c] = len(samples)
                    samples.append(p)
                cls[p] = found[c]
            return cls, np.array(samples, dtype=np.int64)

        return self.per_pricing(self.graph, ("value_classes", names), make)

    def _keeps_alike(
        self, names: tuple[str, ...], cls: np.ndarray, samples: np.ndarray
    ) -> bool:
        """Whether every node of `names` keeps the options its class's first node keeps (the
        copies of a block do: `restricted` gives them one array); checked once per instance."""

        def make() -> bool:
            first = [names[p] for p in samples[cls].tolist()]
            get = self.keep.get
            return all(map(operator.is_, map(get, names), map(get, first)))

        return _kept(self._alike, names, make)

    def restricted(self, options: dict[str, list[Option]]) -> PricedStage:
        """The same stage with fewer options for some nodes; prices already computed are shared."""
        full = self.full_options or self.options
        keep = {}
        # per pair of lists: the copies of a repeated block share both
        made: dict[tuple[int, int], np.ndarray] = {}
        for n, opts in options.items():
            if opts is not full[n]:
                pair = (id(full[n]), id(opts))
                if pair not in made:
                    where = {id(o): i for i, o in enumerate(full[n])}
                    made[pair] = np.array([where[id(o)] for o in opts], dtype=int)
                keep[n] = made[pair]
        out = PricedStage(
            self.graph,
            self.settings,
            self.fx,
            options,
            self.edges,
            self.param_derived,
            self.saved,
            self.rep,
            self._edges,
            full,
            keep,
            _values=self._values,
            _price_keys=self._price_keys,
            _steps=self._steps,
            _price_ids=self._price_ids,
            _keys=self._keys,
            shared=self.shared,
            scope=self.scope,
        )
        for same in ("param_grad_edges", "_param_edges"):  # the same graph's
            out.__dict__[same] = getattr(self, same)
        return out

    def edge_key(self, u: str, v: str) -> tuple[str, str, int]:
        key = self._keys.get((u, v))
        if key is None:
            key = self._keys[u, v] = (
                self.rep.get(u, u),
                self.rep.get(v, v),
                self.fx[v].all_input_nodes.index(self.fx[u]),
            )
        return key

    def edge(self, u: str, v: str) -> tuple[np.ndarray, np.ndarray]:
        """Prices of edge u -> v; identical for every copy of a repeated block, so cached per copy class."""
        key = self.edge_key(u, v)
        if key not in self._edges:
            full = self.full_options or self.options
            self._edges[key] = sc.edge_matrices(
                self.graph.node(u),
                self.fx[v],
                self.fx[u],
                full[u],
                full[v],
                self.settings,
                u in self.param_derived,
            )
        if u not in self.keep and v not in self.keep:
            return self._edges[key]
        if key not in self._sliced:
            rows = self.keep.get(u, slice(None))
            cols = self.keep.get(v, slice(None))
            self._sliced[key] = tuple(m[rows][:, cols] for m in self._edges[key])
        return self._sliced[key]

    def edge_terms(self, index: dict[str, int]) -> tuple[list[float], list[float]]:
        """(act[i, j], grad[i, j]) of `edge` for every edge of `edges`, in order, when every
        node n chooses its option index[n]; gathered per edge key, one lookup per distinct edge.
        An edge leaving an FSDP parameter or a view of one is priced as it runs instead
        (`fsdp_prices`): its gradient's way to `fsdp_gradient` per micro-batch in act, no
        gradient all-reduce."""

        def make() -> tuple[list[np.ndarray], list[str], np.ndarray, np.ndarray]:
            """(positions in `edges` of each edge key, the nodes at either end of an edge,
            each edge's producer and consumer among them)"""
            groups: dict[tuple, list[int]] = {}
            for e, (u, v) in enumerate(self.edges):
                groups.setdefault(self.edge_key(u, v), []).append(e)
            nodes = list(dict.fromkeys(n for edge in self.edges for n in edge))
            where = {n: k for k, n in enumerate(nodes)}
            return (
                [np.array(g) for g in groups.values()],
                nodes,
                np.array([where[u] for u, _ in self.edges], dtype=np.int64),
                np.array([where[v] for _, v in self.edges], dtype=np.int64),
            )

        edge_groups, nodes, producers, consumers = self.per_pricing(
            self.graph, ("edge_groups",), make
        )
        chosen = np.fromiter(map(index.__getitem__, nodes), np.int64, len(nodes))
        i_all, j_all = chosen[producers], chosen[consumers]
        acts, grads = np.empty(len(self.edges)), np.empty(len(self.edges))
        for group in edge_groups:
            act, grad = self.edge(*self.edges[group[0]])
            i, j = i_all[group], j_all[group]
            acts[group], grads[group] = act[i, j], grad[i, j]
        for e in self._fsdp_edges(index):  # priced as they run (`fsdp_prices`)
            u, v = self.edges[e]
            # alike for the copies of an edge (`edge`) choosing the same options
            key = (
                "fsdp_grad",
                self.edge_key(u, v),
                self._full(u, index),
                self._full(v, index),
            )
            if key not in self.shared:
                self.shared[key] = self._fsdp_grad(u, v, index)
            acts[e] += self.shared[key]
            grads[e] = 0.0
        return acts.tolist(), grads.tolist()

    def _full(self, name: str, index: dict[str, int]) -> int:
        """The position in `full_options` of option index[name] of `options`."""
        keep = self.keep.get(name)
        return index[name] if keep is None else int(keep[index[name]])

    @functools.cached_property
    def _roots(self) -> dict[str, str]:
        """Parameters and their views -> the parameter (`OpGraph.param_roots`)."""
        return self.graph.param_roots(self.param_derived)

    @functools.cached_property
    def _param_edges(self) -> dict[str, list[int]]:
        """Parameter -> positions in `edges` of the edges leaving it or a view of it."""
        out: dict[str, list[int]] = {}
        for e, (u, _) in enumerate(self.edges):
            if u in self._roots:
                out.setdefault(self._roots[u], []).append(e)
        return out

    def _fsdp_edges(self, index: dict[str, int]) -> list[int]:
        """Positions in `edges` of the edges leaving the FSDP parameters of option choice
        `index` or views of them."""
        return [
            e
            for p, edges in self._param_edges.items()
            if self.options[p][index[p]].zero == 3
            for e in edges
        ]

    def fsdp_derived(self, index: dict[str, int]) -> set[str]:
        """The FSDP parameters of option choice `index` and the views of them (those that
        some edge of the stage leaves)."""
        return {self.edges[e][0] for e in self._fsdp_edges(index)}

    def _fsdp_grad(self, u: str, v: str, index: dict[str, int]) -> float:
        """The gradient's way back on an edge leaving an FSDP parameter or a view of one, as it
        runs (`fsdp_prices` docstring): brought to `fsdp_gradient` of u's placement every
        micro-batch (`fsdp_prices.fsdp_edge_time`); 0 for a value without a gradient."""
        fx_u, fx_v = self.fx[u], self.fx[v]
        o = consumed_output(fx_u, fx_v)
        value = self.graph.node(u)
        meta = value.outputs[o] if o < len(value.outputs) else value.outputs[0]
        src = self.options[u][index[u]].strategy.output[o]
        vs = self.options[v][index[v]].strategy
        dst = vs.inputs[fx_v.all_input_nodes.index(fx_u)]
        if (
            not src
            or dst is None
            or not value.requires_grad
            or not getattr(torch, meta.dtype).is_floating_point
        ):
            return 0.0
        src, dst = tuple(map(norm, src)), tuple(map(norm, dst))
        return fp.fsdp_edge_time(
            meta, src, dst, vs, self.settings, consumer_is_view=v in self._roots
        )

    def explain(self, name: str, choice: dict[str, Option]) -> str:
        lines = [
            f"{name} ({self.graph.node(name).target}, module {self.graph.node(name).module_path or '-'}):"
        ]
        producers = [u for u, v in self.edges if v == name]
        for j, opt in enumerate(self.options[name]):
            resh = 0.0
            for u in producers:
                act, grad = self.edge(u, name)
                i = self.options[u].index(choice[u])
                resh += act[i, j] + grad[i, j]
            mark = "*" if choice[name] == opt else " "
            lines.append(
                f" {mark} {opt}: compute {self.node_cost(name, opt) * 1e3:.4f} ms, resharding in {resh * 1e3:.4f} ms, "
                f"memory {self.node_memory(name, opt) / 2**20:.2f} MiB"
            )
        return "\n".join(lines)


def _kept(cache: dict, key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by `make` the first time."""
    if key not in cache:
        cache[key] = make()
    return cache[key]
