"""`StageSolution`: the intra-op pass's answer for one stage (`planner.intra.solve.solve_stage`),
the strategy of every node with its prices broken down, and the tables later passes read of it
(per-node costs, FSDP collectives, resharding steps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cost_models.errors import MeshplanError
from cost_models.resharding import ReshardStep, reshard_steps
from planner.intra import fsdp_prices as fp
from planner.intra import prices as sc
from planner.intra.priced_stage import PricedStage
from planner.intra.prices import Option
from planner.vocab.placements import norm
from planner.vocab.strategy import StageProgram, consumed_output


@dataclass
class StageSolution:
    """The chosen sharding of one stage; times are per micro-batch unless named per iteration."""

    mesh_shape: tuple[int, ...]
    choice: dict[str, Option]
    param_placements: dict[str, tuple[str, ...]]
    zero_params: list[str]
    compute_s: float
    comm_s: float
    # per iteration, bucket latencies and the runtime's per-parameter overhead included
    # (`PricedStage.node_cost` of the parameters, less their optimizer step)
    grad_sync_s: float
    param_state_bytes: float
    activation_bytes: float
    fallback_ops: list[str]
    num_microbatches: int
    optimal: bool
    ilp_nodes: int
    solve_time_s: float
    # the gradient all-reduce buckets (`planner.intra.prices.grad_buckets`), whose latency the
    # per-node costs leave out: a stage pays it once per bucket it holds
    buckets: dict[tuple, sc.Bucket] = field(
        default_factory=dict, repr=False, compare=False
    )
    # the runtime's fixed seconds per stage and micro-batch (`cost_models.compute`), once a stage
    overhead_s: float = 0.0
    # the optimizer's step per iteration (`PricedStage.optimizer_cost` of the parameters)
    optimizer_s: float = 0.0
    # parameters fully sharded (FSDP, ZeRO stage 3; `planner.intra.fsdp_prices`), by path
    fsdp_params: list[str] = field(default_factory=list)
    _ctx: PricedStage | None = field(default=None, repr=False, compare=False)
    _fsdp_table: np.ndarray | None = field(default=None, repr=False, compare=False)
    # what other passes derive from this solution alone (`planner.inter.held_memory`), kept
    # because one solution is attributed to several layer clusterings; read-only once made
    _derived: dict = field(default_factory=dict, repr=False, compare=False)
    _cost_table: tuple[list[str], np.ndarray] | None = field(
        default=None, repr=False, compare=False
    )
    _index: dict[str, int] | None = field(
        default=None, repr=False, compare=False
    )  # node -> index of its choice in _ctx.options (equal options price alike)
    _value_table: tuple[list[str], np.ndarray] | None = field(
        default=None, repr=False, compare=False
    )  # `value_table`
    _edge_terms: tuple[list[float], list[float]] | None = field(
        default=None, repr=False, compare=False
    )  # `PricedStage.edge_terms` of its choice

    @property
    def optimizer(self) -> str | None:
        """The optimizer the stage was priced for (None for a solution built without pricing)."""
        return self._ctx.settings.optimizer if self._ctx else None

    @property
    def fsdp_axes(self) -> dict[str, list[int]]:
        """HSDP parameters (path -> the axes they are sharded over; `StagePlan.fsdp_axes`)."""
        if not self.fsdp_params:
            return {}
        paths = self._ctx.graph.placeholder_paths if self._ctx else {}
        return {
            paths[n]: list(o.shard_axes)
            for n, o in self.choice.items()
            if o.zero == 3 and o.shard_axes is not None and n in paths
        }

    def _chosen(self) -> dict[str, int]:
        if self._index is None:
            options = self._ctx.options
            self._index = {n: options[n].index(o) for n, o in self.choice.items()}
        return self._index

    @property
    def time_s(self) -> float:
        """Per-micro-batch time with the gradient synchronisation and the optimizer's step spread
        over the micro-batches."""
        return (
            self.compute_s
            + self.comm_s
            + (self.grad_sync_s + self.optimizer_s) / self.num_microbatches
            + self.overhead_s
        )

    @property
    def memory_bytes(self) -> float:
        return self.param_state_bytes + self.activation_bytes

    def program(self) -> StageProgram:
        """The stage's program in the plan vocabulary: what the runtime executes."""
        return StageProgram(
            self.mesh_shape, {n: o.strategy for n, o in self.choice.items()}
        )

    def value_table(self) -> tuple[list[str], np.ndarray]:
        """Per node, in `choice`'s order: (its own time per micro-batch: compute forward and
        backward for an op, ZeRO's collectives for a parameter; its memory; its forward compute
        time), resharding of its inputs left out, as (node names, array (nodes, 3))
        (`PricedStage.value_table`). Computed once."""
        if self._value_table is None:
            index = self._chosen()
            self._value_table = self._ctx.value_table(
                {n: index[n] for n in self.choice}
            )
        return self._value_table

    def fsdp_table(self) -> np.ndarray:
        """Per node, in `node_cost_table`'s order (nodes, 5): an op's own compute forward and
        backward and its forward compute; an FSDP parameter's all-gathers of one pass
        (`fsdp_prices.fsdp_gather` / 2), its reduce-scatter (`fsdp_prices.fsdp_reduce_scatter`) and its
        gathered bytes (`fsdp_prices.fsdp_gathered_bytes`). Computed once."""
        if self._fsdp_table is None:
            names, values = self.value_table()
            ctx = self._ctx
            is_param, _, is_call = _table_structure(ctx, names)
            table = np.zeros((len(names), 5))
            table[is_call, 0], table[is_call, 1] = (
                values[is_call, 0],
                values[is_call, 2],
            )
            for i in np.flatnonzero(is_param).tolist():
                n = names[i]
                opt, node = self.choice[n], ctx.graph.node(n)
                if opt.zero == 3:
                    meta, s = node.outputs[0], ctx.settings
                    # alike for every parameter of this shape choosing this option
                    key = ("fsdp_row", meta, id(opt))
                    if key not in ctx.shared:
                        ctx.shared[key] = (
                            fp.fsdp_gather(meta, opt, s) / 2,
                            fp.fsdp_reduce_scatter(meta, opt, s),
                            fp.fsdp_gathered_bytes(meta, opt, s),
                        )
                    table[i, 2:] = ctx.shared[key]
            self._fsdp_table = table
        return self._fsdp_table

    def node_cost_table(self) -> tuple[list[str], np.ndarray]:
        """Per node: (time per micro-batch including resharding of its inputs, forward compute
        time, parameter-state bytes, activation bytes per in-flight micro-batch), as (node
        names, array of shape (nodes, 4)); sums to the stage totals. Computed once."""
        if self._cost_table is None:
            ctx = self._ctx
            names, own = self.value_table()
            is_param, readers, _ = _table_structure(ctx, names)
            table = np.empty((len(names), 4))
            table[:, 0] = own[:, 0]
            table[:, 1] = own[:, 2]
            table[:, 2] = np.where(is_param, own[:, 1], 0.0)
            table[:, 3] = np.where(is_param, 0.0, own[:, 1] / ctx.settings.in_flight)
            if self._edge_terms is None:
                self._edge_terms = ctx.edge_terms(self._chosen())
            acts, grads = self._edge_terms
            # each edge's resharding onto its consumer, activation then gradient, edge by
            # edge (`np.add.at` adds in order: the same sums as a loop over the edges)
            steps = np.empty(2 * len(acts))
            steps[0::2], steps[1::2] = acts, grads
            np.add.at(table[:, 0], np.repeat(readers, 2), steps)
            self._cost_table = (names, table)
        return self._cost_table

    def forward_reshards(
        self, consumers: set[str] | None = None
    ) -> list[tuple[str, str, list[ReshardStep]]]:
        """(producer, consumer, steps) of every edge whose forward pass redistributes a tensor."""
        ctx = self._ctx
        out = []
        for u, v in ctx.edges if ctx else []:
            if consumers is not None and v not in consumers:
                continue
            k = ctx.fx[v].all_input_nodes.index(ctx.fx[u])
            o = consumed_output(ctx.fx[u], ctx.fx[v])
            src, dst = (
                self.choice[u].strategy.output[o],
                self.choice[v].strategy.inputs[k],
            )
            if not src or dst is None:
                continue
            src, dst = tuple(map(norm, src)), tuple(map(norm, dst))
            if src != dst:
                meta = ctx.graph.node(u).outputs[o]
                steps = reshard_steps(
                    ctx.settings.mesh,
                    meta.shape,
                    meta.nbytes / max(meta.numel(), 1),
                    src,
                    dst,
                )
                if any(st.collective for st in steps):
                    out.append((u, v, steps))
        return out

    def explain(self, name: str) -> str:
        """A node's options with their compute time, memory and resharding from the chosen producers."""
        if self._ctx is None or name not in self._ctx.options:
            raise MeshplanError(f"no node {name!r} in this stage")
        return self._ctx.explain(name, self.choice)


def _table_structure(
    ctx: PricedStage, names: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(whether each of `names` is a parameter, the position in `names` of each edge's
    consumer, whether each is an op), alike for every solution of a pricing: made once per
    pricing."""

    def make() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        where = {n: i for i, n in enumerate(names)}
        kinds = [ctx.graph.node(n).op for n in names]
        return (
            np.array([k == "param" for k in kinds], dtype=bool),
            np.array([where[v] for _, v in ctx.edges], dtype=np.int64),
            np.array([k == "call" for k in kinds], dtype=bool),
        )

    return ctx.per_pricing(ctx.graph, ("cost_table_structure", len(names)), make)
