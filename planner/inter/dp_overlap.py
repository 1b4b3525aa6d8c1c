"""The data-parallel gradient all-reduce overlapping backward: its buckets and what stays exposed.

The parameters of a stage whose gradient synchronisation is an all-reduce alone (``P -> R`` on
some axes, `planner.vocab.grads.bucketed_axes`; not ZeRO, not FSDP) are synchronised in
size-capped buckets launched during the backward of the step's last micro-batch
(`runtime.grad_overlap`), as PyTorch's DDP does; the earlier micro-batches only accumulate.

**Readiness.** A parameter's gradient is complete once the backward of the first op of the stage
(in forward order) that reads it, or a view of it, has run: backward visits the ops in reverse.
Ordered latest-first (descending index of that op, the readiness order), the parameters are cut
into buckets by DDP's rule (``torch.distributed._compute_bucket_assignment_by_size``, what
``DistributedDataParallel`` uses): add a parameter's local gradient bytes, close the bucket once
it holds at least `BUCKET_CAP_BYTES`. A bucket issues one all-reduce per distinct key (the
gradient's placements, the parameter's placements, the dtype; `planner.intra.prices.grad_buckets`
keys them alike) and per mesh axis of the key, so its communication takes

    C_b = sum over its keys of bucket_latency(axes) + sum over its gradients of their bandwidth
          (`planner.intra.prices._bucket_bandwidth`: the part the ILP's edges price)

**Timeline of the last micro-batch's backward** on the stage. K_o = op o's backward compute
(its forward + backward compute less its forward: `StageSolution.value_table`), T = sum_o K_o.
Bucket b (b = 1..n in launch order) is launched when its last gradient is complete, after the
backward compute of the ops from the stage's last down to that gradient's first reader:
t_b = sum of K_o over those ops (t_n = T: the last bucket holds the first op's parameters). The
all-reduces run one after another on the communication stream, each starting when launched and
the one before it has finished, and the optimizer waits for them all:

    s_b = max(t_b, e_{b-1}),  e_b = s_b + C_b  (e_0 = 0),   exposed = max(0, e_n - T)

Unrolling the max-plus recursion, e_n = max_b (t_b + C_b + ... + C_n) (the bucket after which the
stream never idles), so

    exposed = max_b [ (C_b + C_{b+1} + ... + C_n) - (T - t_b) ]   (>= C_n, as t_n = T)
    hidden  = sum_b C_b - exposed

Each bucket hides behind the backward compute left after its launch, T - t_b, less what the
buckets before it still occupy the stream with (`exposed_seconds`; tests/test_dp_overlap.py
checks it against an explicit event simulation).

**Price.** The stage table already charges the all-reduce in full, per micro-batch: its
bandwidth on the edges leaving the parameters (divided by the B micro-batches) and one latency
per key and stage (`LayerProfile.fixed`, divided by B). The buckets' price replaces that
(`DpSync.adjust_s`, added per micro-batch to a stage's time by `planner.plans.assemble`, for
automatic and manual plans alike):

    adjust = (sum_b latencies of b - latencies once per key - hidden) / B

Where the runtime cannot overlap, the stage's gradients make one bucket (no cap: launched after
the backward, smaller buckets would hide nothing and add latencies), t = T, hidden = 0 and
adjust = 0, as the stage table prices it: a stage run as AOTAutograd-compiled graphs (`runtime.compiled`:
no recomputation, no FSDP parameters; its backward returns every gradient at its end), and a
stage with FSDP parameters (whose gathers and reduce-scatters already claim its backward
compute, `planner.intra.fsdp_prices.fsdp_exposed`; priced exposed there, an upper bound).
Recomputed forward compute in backward is not counted in K (it would hide more; an upper bound).
Not modelled: the backward's own collectives (a tensor-parallel all-reduce of an activation
gradient) sharing the links with the buckets' (on NCCL they run on their own communicators'
streams). Per micro-batch, as every per-iteration cost of the stage table: the B micro-batches of
a bottleneck stage add up to the iteration's sync once.

**The stage DP** (`planner.inter.range_costs.range_costs`) ranks layer ranges with the
all-reduce exposed (the buckets depend on where a stage starts and ends); the candidates it
returns are then ranked by `planner.plans.assemble.predicted_iteration_time`, which includes
the overlap, as the ILP sees FSDP's collectives unhidden and the stage table hides them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.inter.held_memory import cached_on
from planner.intra import prices as sc
from planner.vocab.grads import bucketed_axes, expected_grad, grad_from_consumer
from planner.vocab.placements import norm, shards
from planner.vocab.plan_check import recompute_mode

__all__ = [
    "BUCKET_CAP_BYTES",
    "NO_SYNC",
    "DpSync",
    "GradItem",
    "exposed_seconds",
    "form_buckets",
    "overlaps",
    "stage_dp_sync",
]

#: PyTorch DDP's default bucket size, ``DistributedDataParallel(bucket_cap_mb=25)``
#: (torch/nn/parallel/distributed.py, 25 MiB): a bucket closes once it holds this many bytes.
BUCKET_CAP_BYTES = 25 * 2**20


@dataclass(frozen=True)
class GradItem:
    """One parameter's gradient in a stage's all-reduce buckets."""

    path: str  # the parameter's path
    ready: int  # graph index of the first op of the stage reading it (or a view of it)
    nbytes: float  # its local gradient bytes on one device
    key: tuple  # (axes, placements, bytes per element): one all-reduce per key and axis
    bandwidth_s: float  # its share of the bucket's all-reduces (per iteration)
    # the keys of the edges leaving it (`planner.intra.prices.grad_buckets`, by the consumed
    # view's placements), whose latency the stage table charges once per stage
    table_keys: frozenset = frozenset()


def form_buckets(
    items: Sequence[GradItem], cap: float | None = None
) -> list[list[GradItem]]:
    """DDP's rule on `items` in readiness order: fill a bucket, close it at >= `cap` bytes
    (default `BUCKET_CAP_BYTES`)."""
    cap = BUCKET_CAP_BYTES if cap is None else cap
    out: list[list[GradItem]] = []
    current: list[GradItem] = []
    held = 0.0
    for it in items:
        current.append(it)
        held += it.nbytes
        if held >= cap:
            out.append(current)
            current, held = [], 0.0
    if current:
        out.append(current)
    return out


def exposed_seconds(
    launch: Sequence[float], comm: Sequence[float], total: float
) -> float:
    """Seconds the all-reduces outlast the backward (module docstring): buckets launched at
    `launch` (ascending, the last at most `total`) taking `comm` each on one stream, backward
    compute ending at `total`: max(0, max_b (C_b + ... + C_n - (total - t_b)))."""
    tail, worst = 0.0, 0.0
    for t, c in zip(reversed(launch), reversed(comm)):
        tail += c
        worst = max(worst, tail - (total - t))
    return worst


def overlaps(recompute: str, has_fsdp: bool) -> bool:
    """Whether the runtime overlaps a stage's bucket all-reduces with its backward: eager stages
    (`runtime.compiled` compiles those without recomputation and FSDP) without FSDP parameters
    (module docstring)."""
    return recompute_mode(recompute) != "none" and not has_fsdp


@dataclass(frozen=True)
class DpSync:
    """A stage's gradient all-reduce buckets and their price (module docstring; seconds per
    iteration unless named per micro-batch)."""

    buckets: tuple[tuple[str, ...], ...]  # parameter paths, in launch order
    comm_s: tuple[float, ...]  # C_b
    launch_s: tuple[float, ...]  # t_b
    backward_s: float  # T
    overlapped: bool
    exposed_s: float
    hidden_s: float
    extra_latency_s: float  # latencies beyond one per key and stage (the table's)
    adjust_s: float  # per micro-batch: what the buckets change in the stage's time


#: the price of a stage without buckets (nothing to synchronise, or no solution to read)
NO_SYNC = DpSync((), (), (), 0.0, False, 0.0, 0.0, 0.0, 0.0)


# the last few graphs' parameter roots, op indices and node positions: plans price many stages
# of one graph
_PER_GRAPH: list[tuple[object, dict[str, str], dict[str, int], dict[str, int]]] = []


def _graph_tables(graph) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
    """(parameter roots, op name -> index in ``graph.ops``, node name -> index in
    ``graph.nodes``) of `graph`, made once per graph."""
    for g, roots, index, position in _PER_GRAPH:
        if g is graph:
            return roots, index, position
    index = {n.name: i for i, n in enumerate(graph.ops)}
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    _PER_GRAPH.insert(0, (graph, graph.param_roots(), index, position))
    del _PER_GRAPH[4:]
    return _PER_GRAPH[0][1:]


# the last few (solution, layer map)s' op indices, layers and backward seconds: a solution's
# stages are priced for many layer ranges
_PER_SOLUTION: list[tuple[object, object, np.ndarray, np.ndarray, np.ndarray]] = []


def _backward_seconds(sol, layer_of: dict[str, int]):
    """(index in ``graph.ops``, layer, backward seconds) of every op `sol` prices, in graph
    order; kept per (solution, layer map) object."""
    for s, lo, idx, lay, back in _PER_SOLUTION:
        if s is sol and lo is layer_of:
            return idx, lay, back
    names, values = sol.value_table()
    idx, at = _op_rows(sol, names)
    lay = [layer_of.get(names[p], 0) for p in at.tolist()]
    back = np.maximum(0.0, values[at, 0] - values[at, 2])
    entry = (sol, layer_of, idx, np.asarray(lay, dtype=int).reshape(-1), back)
    _PER_SOLUTION.insert(0, entry)
    del _PER_SOLUTION[16:]
    return entry[2:]


def _op_rows(sol, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the index in ``graph.ops`` of each op among `names`, in graph order; its position in
    `names`): alike for every solution of a pricing, made once per pricing."""
    ctx = sol._ctx

    def make() -> tuple[np.ndarray, np.ndarray]:
        where = {n: p for p, n in enumerate(names)}
        rows = [
            (i, where[o.name]) for i, o in enumerate(ctx.graph.ops) if o.name in where
        ]
        idx, at = zip(*rows) if rows else ((), ())
        return np.array(idx, dtype=int), np.array(at, dtype=int)

    return ctx.per_pricing(ctx.graph, ("op_rows", len(names)), make)


def _grad_edges(sol) -> list[tuple]:
    """What `grad_items` reads of each parameter-gradient edge of `sol`, in edge order:
    (consumer, parameter, None where the edge refuses the parameter's bucketing, else its
    record); edges that neither refuse nor add are left out. It depends on the solution alone:
    kept with it (`held_memory.cached_on`), as its stages are priced for many layer ranges."""
    return cached_on(
        sol, sol._ctx.graph, ("grad_edges",), lambda: _make_grad_edges(sol)
    )


def _make_grad_edges(sol) -> list[tuple]:
    ctx = sol._ctx
    graph, s, choice = ctx.graph, ctx.settings, sol.choice
    mesh = s.mesh
    roots, index, _ = _graph_tables(graph)
    derived = set(roots)
    edges = []
    for u, v, o, kk, meta in ctx.param_grad_edges:
        if u not in choice or v not in choice:
            continue
        p = roots.get(u)
        if p is None or p not in choice or choice[p].zero != 0:
            continue
        vs = choice[v].strategy
        src, dst = choice[u].strategy.output[o], vs.inputs[kk]
        if not src or dst is None:
            continue
        src, dst = tuple(map(norm, src)), tuple(map(norm, dst))
        if src != dst:
            # redistributed on its way to v: the parameter's gradient is not P -> R alone
            # (the runtime's end sync, `runtime.grad_sync`, redistributes it)
            edges.append((v, p, None))
            continue
        if v in derived:
            continue  # a view of the parameter: its gradient passes through unchanged
        want = expected_grad(src)
        grad = grad_from_consumer(dst, vs, mesh.shape)
        axes = bucketed_axes(grad, want)
        own = expected_grad(tuple(map(norm, choice[p].strategy.output[0])))
        if not axes or any(own[a] != "R" for a in axes):
            edges.append((v, p, None))
            continue
        width = sc._element_bytes(meta)
        edges.append(
            (
                v,
                p,
                (
                    index[v],
                    index.get(u, index[v]),
                    graph.node(p).outputs[0].nbytes / shards(own, mesh.shape),
                    (axes, own, width),  # the runtime's bucket key
                    (axes, want, width),  # `prices.grad_buckets`' key
                    sc._bucket_bandwidth(s, meta.shape, width, grad, want),
                ),
            )
        )
    return edges


def grad_items(sol, layer_of: dict[str, int], k: int, j: int) -> list[GradItem]:
    """The bucketed parameter gradients of a stage holding layers k..j of solution `sol`
    (consumers in the range, as `planner.inter.stage_table.profile` charges their latency), in
    readiness order (latest-complete first)."""
    graph = sol._ctx.graph
    _, _, position = _graph_tables(graph)
    found: dict[str, dict] = {}
    refused: set[str] = set()  # a parameter some edge of which is not all-reduce alone
    for v, p, record in _grad_edges(sol):
        if not k <= layer_of.get(v, 0) <= j:
            continue
        if record is None:
            refused.add(p)
            continue
        ready_v, ready_u, nbytes, key, table_key, bw = record
        rec = found.setdefault(
            p,
            {
                "ready": ready_v,
                "nbytes": nbytes,
                "key": key,
                "table_keys": set(),
                "bw": 0.0,
            },
        )
        if rec["key"][0] != key[0]:
            refused.add(p)  # consumers partial on different axes
        rec["table_keys"].add(table_key)
        rec["ready"] = min(rec["ready"], ready_v, ready_u)
        rec["bw"] += bw
    for p in refused:
        found.pop(p, None)
    paths = graph.placeholder_paths
    order = sorted(found, key=lambda p: (-found[p]["ready"], -position[p]))
    return [
        GradItem(
            paths[p],
            found[p]["ready"],
            found[p]["nbytes"],
            found[p]["key"],
            found[p]["bw"],
            frozenset(found[p]["table_keys"]),
        )
        for p in order
    ]


def _latency(mesh, key: tuple) -> float:
    return sc.bucket_latency(mesh, key[0])


def stage_dp_sync(
    sol,
    layer_of: dict[str, int],
    k: int,
    j: int,
    recompute: str,
    cap: float | None = None,
) -> DpSync:
    """The buckets of a stage holding layers k..j of `sol` (its `StageSolution`; `layer_of`:
    node -> layer) and their price under `recompute` (module docstring)."""
    mesh, B = sol._ctx.settings.mesh, sol.num_microbatches
    items = grad_items(sol, layer_of, k, j)
    overlapped = overlaps(recompute, bool(sol.fsdp_params))
    # launched after the backward, smaller buckets would hide nothing and add latencies
    buckets = form_buckets(items, cap if overlapped else math.inf)
    idx, lay, back = _backward_seconds(sol, layer_of)
    inside = (lay >= k) & (lay <= j)
    idx, back = idx[inside].tolist(), back[inside].tolist()
    T = float(sum(back))  # summed in graph order, as a loop over the ops would
    comm, launch, latency = [], [], 0.0
    for b in buckets:
        keys = list(dict.fromkeys(it.key for it in b))
        lat = sum(_latency(mesh, key) for key in keys)
        latency += lat
        comm.append(lat + sum(it.bandwidth_s for it in b))
        first = min(it.ready for it in b)
        done = sum(back[bisect.bisect_left(idx, first) :])  # the ops from `first` on
        launch.append(float(done) if overlapped else T)
    if overlapped:
        exposed = exposed_seconds(launch, comm, T)
        hidden = max(0.0, sum(comm) - exposed)
    else:  # every bucket after the backward: exposed_seconds would be sum(comm)
        exposed, hidden = float(sum(comm)), 0.0
    once = sum(
        _latency(mesh, key) for key in {t for it in items for t in it.table_keys}
    )
    return DpSync(
        buckets=tuple(tuple(it.path for it in b) for b in buckets),
        comm_s=tuple(comm),
        launch_s=tuple(launch),
        backward_s=T,
        overlapped=overlapped,
        exposed_s=exposed,
        hidden_s=hidden,
        extra_latency_s=latency - once,
        adjust_s=(latency - once - hidden) / B,
    )
