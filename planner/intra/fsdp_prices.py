"""What sharding a parameter's state costs: its bytes per device and, for ZeRO-2, FSDP (ZeRO
stage 3) and HSDP, the collectives that sharding adds, per micro-batch, with the part of FSDP's
that compute leaves exposed (`fsdp_exposed`); and where HSDP is offered.

Node and edge prices are in `planner.intra.prices`; this module adds the parameter options' own
terms (`planner.intra.priced_stage` calls both).

* ZeRO: a parameter replicated on some mesh axes may also keep its gradient and optimizer state
  sharded over those axes ("zero" option). Reduce-scatter + all-gather cost what the all-reduce
  would, and we charge one more all-gather of the parameter per iteration (an upper bound), so the
  solver picks it only when memory demands.
* FSDP (ZeRO stage 3, ``Option.zero == 3``): weights, gradients and optimizer state all sharded
  over the replicating axes (`planner.vocab.placements.zero_shard`: the shard the runtime keeps),
  so memory is ``numel / shards / zero_shards * (param + grad + optimizer)``
  (`cost_models.memory.param_state_bytes`). The runtime (`runtime.fsdp`) gathers the weight
  before its first use in every micro-batch's forward, drops it after its last, gathers it again
  in backward, and reduce-scatters its gradient onto the shard once per micro-batch (FSDP's
  default: no unsharded gradient is kept across micro-batches). Per micro-batch:

      fsdp_comm = 2 * reshard(shard -> planned) + reshard(grad -> shard)

  with grad = `fsdp_gradient(planned)`: the planned placement with P on the sharded axes (the
  consumers are split there, as data parallelism splits them). Each edge leaving the parameter
  or a view of it brings its consumer's gradient there first (`fsdp_edge_time`: per micro-batch,
  nothing where the consumer reads the planned placement of a data-parallel parameter; an
  all-gather where it reads a slice of a weight planned whole, say), and the runtime does
  exactly that (`runtime.executor`: the edge's gradient goes to `fsdp_gradient` of the value's
  placement), so the gradients of several consumers add up in one placement and the
  reduce-scatter starts from the one priced. A solution's price (`zero_cost` = `fsdp_comm` on
  the node, `fsdp_edge_time` on those edges, no gradient all-reduce and no bucket:
  `planner.intra.priced_stage.PricedStage.edge_terms`) is what runs.
  In the ILP an edge's price cannot depend on whether the parameter behind a view is FSDP (the
  view's options do not say), so its edges charge every parameter gradient's all-reduce share
  (`planner.intra.prices._bucket_bandwidth` / B) and the ILP's node cost is
  ``fsdp_comm - that share where the consumers read the planned placement`` (`ilp_credit`):
  exact where they do, split on its replicating axes (Megatron's and torchtitan's layouts),
  optimistic where they read another placement or compute whole on such an axis; the stage's
  price is the solution's, never the ILP's objective, so such a program is priced for what runs
  (and may lose to a seed's). The ILP sees ``fsdp_comm`` unhidden
  (linear, an upper bound: it picks FSDP when memory demands); the stage's price
  (`planner.inter.stage_table.profile`, `fsdp_exposed`) then hides what the runtime overlaps
  with compute.
  Per layer l of a stage holding layers k..j (a parameter in its first consumer's layer):
  G_l = its parameters' all-gathers of one pass (`fsdp_gather` / 2: the same in forward and in
  backward), R_l = their reduce-scatters (`fsdp_reduce_scatter`), F_l = the layer's forward
  compute, K_l = its backward compute (forward + backward less forward). The forward gathers,
  prefetched one parameter ahead, overlap forward compute; in backward the gathers (prefetched)
  and the reduce-scatters (issued as each gradient is complete, waited one layer later: the
  runtime waits for layer l's reduce-scatters when layer l-1 issues its first) share the
  backward compute, so layer l's backward hides its own gathers and layer l+1's
  reduce-scatters; the first layer's, issued last in backward, are waited for at its end:

      exposed = sum_{l=k..j} [ max(0, G_l - F_l) + max(0, G_l + R_{l+1} - K_l) ] + R_k
                + min(G_k, F_k) + min(G_j, K_j)
                (R_{j+1} = 0: the stage's last layer hides no reduce-scatter)

  The first gather of each pass has no compute before it to hide behind: layer k's in forward,
  layer j's in backward, charged in full by the last two terms.

  With recomputation (FSDP2 with activation checkpointing) the communication is the same: the
  forward gathers, drops the copy after its last use; backward gathers once, before the
  recomputed forward, which reads that copy, and the layer's backward uses it too (`runtime.fsdp`).
  The recomputed forward X_l (the layer's forward compute for full, its attention cores' for
  selective) is compute of the layer's backward pass: the formula above with K_l + X_l for K_l
  (`planner.inter.stage_table.LayerProfile.fsdp_recompute`).

  With equal layers the neighbour's compute is the layer's own (a gather is prefetched while the
  parameter before it computes; layer l's reduce-scatters run behind the rest of its backward and
  the start of layer l-1's: about one layer's backward in all). The gathered copy
  (`fsdp_gathered_bytes`) is live only around its use: a stage adds twice its largest layer's
  gathered bytes (the layer running and the one gathered next, or its gradient being reduced).
* HSDP (hybrid sharding, ``Option.shard_axes``; torch FSDP2's ``fully_shard`` on a 2D mesh):
  FSDP over the axes inside a host only (`hybrid_axes`), replicated over an axis that spans
  hosts (offered where a stage's mesh has both). With m the devices of the shard axes, and
  grad = P on every replicating axis (`planner.vocab.placements.fsdp_gradient`):

      memory         = numel / shards / m * (param + grad + optimizer)
      gather         = reshard(shard -> planned)           (an all-gather inside the host)
      reduce-scatter = reshard(grad -> mid) + reshard(mid -> shard)
                     = RS_intra(B) + AR_inter(B / m)      (mid = `reduce_midpoint`: the shard on
                                                           the intra axes, P across hosts)

  HSDP is chosen only in solves that split the data on every axis replicating the parameter
  (`hsdp_holds`: Megatron-style data parallelism, its seeds, `meshplan manual --fsdp hybrid`),
  where the gradient is partial there as priced. Per micro-batch, in `fsdp_comm`, `ilp_credit`
  and the overlap model above exactly as FSDP's
  (G_l from the gathers, R_l from the reduce-scatter + all-reduce, which the runtime issues
  together and waits one layer later). For FSDP ``mid`` is the shard: the formulas above are
  this one with the second step empty.
"""

from __future__ import annotations

import math

import numpy as np

from cost_models.communication import LogicalMesh
from cost_models.memory import gathered_bytes
from cost_models.memory import param_state_bytes as state_bytes
from planner.intra.prices import (
    Option,
    StageSettings,
    _bucket_bandwidth,
    _element_bytes,
    _reshard,
)
from planner.tracing.opgraph import TensorMeta
from planner.vocab.grads import bucketed_axes, grad_from_consumer
from planner.vocab.placements import (
    fsdp_gradient,
    norm,
    reduce_midpoint,
    shards,
    zero_shard,
)
from planner.vocab.strategy import Strategy


def hybrid_axes(mesh: LogicalMesh) -> tuple[int, ...]:
    """The axes HSDP may shard over on `mesh`: those of more than one device inside one host,
    when another axis of more than one device spans hosts (else none: no hybrid to make)."""
    inside = tuple(
        a for a, n in enumerate(mesh.shape) if n > 1 and mesh.axis(a).hosts == 1
    )
    across = any(n > 1 and mesh.axis(a).hosts > 1 for a, n in enumerate(mesh.shape))
    return inside if across else ()


def hsdp_holds(
    option: Option, mesh_shape: tuple[int, ...], batch_axes: tuple[int, ...]
) -> bool:
    """Whether `option` may be chosen in a solve splitting the data on `batch_axes`: any but
    HSDP; HSDP where the data is split on every axis that replicates the parameter. Its price
    takes the gradient as partial there (`fsdp_gradient`: the consumers split on those axes);
    with a consumer computing whole on such an axis, a collective that the price counts (and
    subtracts from the consumers' edges: the all-reduce across hosts) would not run."""
    if option.shard_axes is None:
        return True
    planned = option.strategy.output[0]
    return all(
        a in batch_axes for a, n in enumerate(mesh_shape) if n > 1 and planned[a] == "R"
    )


def grad_bytes(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Bytes of one parameter's gradient on one device as backward computes it: its planned
    placement's shard (for FSDP the gathered placement, before the reduce-scatter)."""
    planned = (
        fsdp_placements(meta, option, s)[0]
        if option.zero == 3
        else option.strategy.output[0]
    )
    return meta.nbytes / shards(planned, s.mesh.shape)


def param_state_bytes(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Weights + gradients + optimizer state of one parameter on one device
    (`cost_models.memory.param_state_bytes`; ZeRO over the axes that replicate it)."""
    placements = option.strategy.output[0]
    if option.zero == 3:
        planned, held, _ = fsdp_placements(meta, option, s)
        return state_bytes(
            meta.numel(),
            s.optimizer,
            shards=shards(planned, s.mesh.shape),
            zero_shards=shards(held, s.mesh.shape) / shards(planned, s.mesh.shape),
            zero_stage=3,
        )
    return state_bytes(
        meta.numel(),
        s.optimizer,
        shards=shards(placements, s.mesh.shape),
        zero_shards=_zero_shards(option, s),
    )


def _zero_shards(option: Option, s: StageSettings) -> int:
    """The devices a ZeRO-2 parameter's gradient and optimizer state are split over: those of
    the mesh axes that replicate it (1 without ZeRO)."""
    if not option.zero:
        return 1
    placements = option.strategy.output[0]
    return math.prod(size for p, size in zip(placements, s.mesh.shape) if p == "R")


def optimizer_numel(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Elements of one parameter's optimizer state on one device, the part of the parameter its
    optimizer step updates there: its placement's shard, divided further over the axes that
    replicate it under ZeRO-2, and FSDP's shard (`param_state_bytes`' division)."""
    if option.zero == 3:
        return meta.numel() / shards(fsdp_placements(meta, option, s)[1], s.mesh.shape)
    placements = option.strategy.output[0]
    return meta.numel() / shards(placements, s.mesh.shape) / _zero_shards(option, s)


def fsdp_placements(
    meta: TensorMeta, option: Option, s: StageSettings
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(planned, shard, gradient) placements of an FSDP / HSDP parameter: the placement its
    consumers read, the shard the runtime keeps (`zero_shard` over ``option.shard_axes``), and
    its gradient as the consumers hand it back (`fsdp_gradient`: partial on the replicating
    axes)."""
    planned = tuple(map(norm, option.strategy.output[0]))
    held = zero_shard(meta.shape, planned, s.mesh.shape, option.shard_axes)
    return planned, held, fsdp_gradient(planned, s.mesh.shape)


def fsdp_gather(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Seconds per micro-batch of an FSDP parameter's all-gathers: in forward and again in
    backward (the part `planner.inter.stage_table` hides behind compute)."""
    if option.zero != 3:
        return 0.0
    planned, held, _ = fsdp_placements(meta, option, s)
    width = _element_bytes(meta)
    return 2 * _reshard(s, meta.shape, width, held, planned)


def fsdp_reduce_scatter(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Seconds per micro-batch of an FSDP parameter's gradient reduce-scatter onto its shard,
    through `reduce_midpoint` (HSDP: reduce-scatter inside the host, then all-reduce of the
    shard across hosts; module docstring). The runtime issues it asynchronously;
    `planner.inter.stage_table` hides it behind the next layer's backward."""
    if option.zero != 3:
        return 0.0
    planned, held, grad = fsdp_placements(meta, option, s)
    mid = reduce_midpoint(planned, held, grad)
    width = _element_bytes(meta)
    return _reshard(s, meta.shape, width, grad, mid) + _reshard(
        s, meta.shape, width, mid, held
    )


def fsdp_comm(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Seconds per micro-batch of an FSDP parameter's collectives (module docstring): the
    all-gather in forward and again in backward (`fsdp_gather`), and the gradient's
    reduce-scatter (`fsdp_reduce_scatter`)."""
    return fsdp_gather(meta, option, s) + fsdp_reduce_scatter(meta, option, s)


def fsdp_gathered_bytes(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """Bytes of an FSDP parameter's gathered copy (weights and unsharded gradient, planned
    placement) while it is live; 0 for other options."""
    if option.zero != 3:
        return 0.0
    planned = tuple(map(norm, option.strategy.output[0]))
    return meta.numel() / shards(planned, s.mesh.shape) * gathered_bytes(s.optimizer)


def zero_cost(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """ZeRO-2: the extra all-gather of a ZeRO-sharded parameter over its replicated axes, once per
    iteration (returned as its share per micro-batch). FSDP: `fsdp_comm` (module docstring)."""
    if option.zero == 3:
        return fsdp_comm(meta, option, s)
    if not option.zero:
        return 0.0
    placements = option.strategy.output[0]
    local = meta.nbytes / shards(placements, s.mesh.shape)
    seconds = sum(
        s.mesh.all_gather(local, a)
        for a, (p, size) in enumerate(zip(placements, s.mesh.shape))
        if p == "R" and size > 1
    )
    return seconds / s.num_microbatches


def ilp_credit(meta: TensorMeta, option: Option, s: StageSettings) -> float:
    """What the intra-op program takes off an FSDP parameter's `zero_cost`: the share per
    micro-batch of the gradient all-reduce its consumers' edges charge there when they read
    the planned placement (module docstring, "In the ILP"); 0 for other options."""
    if option.zero != 3:
        return 0.0
    planned, _, grad = fsdp_placements(meta, option, s)
    width = _element_bytes(meta)
    if bucketed_axes(grad, planned):
        charged = _bucket_bandwidth(s, meta.shape, width, grad, planned)
    else:
        charged = _reshard(s, meta.shape, width, grad, planned)
    return charged / s.num_microbatches


def fsdp_edge_grad(
    dst: tuple[str, ...],
    consumer: Strategy,
    mesh_shape: tuple[int, ...],
    consumer_is_view: bool,
) -> tuple[str, ...]:
    """The gradient a consumer hands back on an edge leaving an FSDP parameter or a view of one,
    read as `dst`: `grad_from_consumer`, or where the consumer is itself a view of the
    parameter (`consumer_is_view`) `fsdp_gradient(dst)`, the placement its own edges bring its
    gradient to (a transposed weight gathered on a tensor-parallel axis hands back a gradient
    partial there, which its producer's edge reduce-scatters onto the planned shard)."""
    if consumer_is_view:
        return fsdp_gradient(dst, mesh_shape)
    return grad_from_consumer(dst, consumer, mesh_shape)


def fsdp_edge_time(
    meta: TensorMeta,
    src: tuple[str, ...],
    dst: tuple[str, ...],
    consumer: Strategy,
    s: StageSettings,
    consumer_is_view: bool = False,
) -> float:
    """Seconds per micro-batch of the gradient's way back on an edge leaving an FSDP parameter
    (or a view of one) placed `src`, read as `dst` by a consumer running `consumer`: from the
    consumer's gradient (`fsdp_edge_grad`) to `fsdp_gradient(src)`, where the runtime brings it
    before the reduce-scatter (module docstring). Nothing when the consumer reads the planned
    placement of a data-parallel parameter: its gradient already is that."""
    grad = fsdp_edge_grad(dst, consumer, s.mesh.shape, consumer_is_view)
    return _reshard(
        s, meta.shape, _element_bytes(meta), grad, fsdp_gradient(src, s.mesh.shape)
    )


def fsdp_exposed(
    F: np.ndarray, K: np.ndarray, G: np.ndarray, R: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The seconds per micro-batch of FSDP collectives that compute does not hide (module
    docstring), from per-layer forward compute F, backward compute K, all-gathers of one pass G
    and reduce-scatters R: (e, first, last) with a stage of
    layers k..j exposed for ``e[k..j].sum() + first[k] + last[j]``. Per layer, with
    s_l = max(0, K_l - G_l) the backward compute its gathers leave and s_{-1} = 0:

        e_l = max(0, G_l - F_l) + max(0, G_l - K_l) + max(0, R_l - s_{l-1})
        first_k = min(R_k, s_{k-1}) + min(G_k, F_k)
        last_j = min(G_j, K_j)

    which equals sum_l [max(0, G_l - F_l) + max(0, G_l + R_{l+1} - K_l)] + R_k (R_{j+1} = 0)
    + min(G_k, F_k) + min(G_j, K_j): layer k's reduce-scatter, issued last in backward, and the
    first gather of each pass (layer k's in forward, layer j's in backward: nothing computes
    before them) in full."""
    slack = np.maximum(0.0, K - G)
    before = np.concatenate([[0.0], slack[:-1]])  # s_{l-1}
    e = np.maximum(0.0, G - F) + np.maximum(0.0, G - K) + np.maximum(0.0, R - before)
    return e, np.minimum(R, before) + np.minimum(G, F), np.minimum(G, K)
