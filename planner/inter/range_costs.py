"""What a stage holding layers k..j costs, for every range k..j at once, from one solution's
per-layer profile (`planner.inter.stage_table.LayerProfile`; the formulas are in that module's
docstring): its memory terms per recomputation mode (`range_footprint`, `recomputed`) and, for
the stage DP, its time and peak memory per number of micro-batches in flight (`range_costs`)."""

from __future__ import annotations

import numpy as np

from cost_models.errors import MeshplanError
from cost_models.memory import stage_peak_bytes
from planner.inter.ranges import range_max, range_sums
from planner.inter.stage_table import LayerProfile, need_cores
from planner.vocab.plan_check import RECOMPUTE_MODES, recompute_mode

__all__ = ["range_costs", "range_footprint", "recomputed"]


def range_footprint(
    prof: LayerProfile, recompute: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[k, j] arrays for a stage holding layers k..j: its parameter-state bytes, the activation
    bytes it keeps per micro-batch in flight, and the bytes live only while one layer (one
    attention core, selective) is recomputed or its FSDP parameters are gathered, plus what its
    backward holds besides activations and parameter state (`LayerProfile.backward_bytes`)
    (`planner.inter.stage_table`'s docstring); `cost_models.memory.stage_peak_bytes` adds them
    up."""
    recompute = recompute_mode(recompute)
    if recompute not in RECOMPUTE_MODES:
        raise MeshplanError(
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
        )
    params = range_sums(prof.params)
    extra = prof.backward_bytes()
    if prof.gathered is not None:
        # FSDP parameters are gathered at their use and freed after it; a recomputed segment
        # holds its own and the next one's (`runtime.fsdp`): with "layer" two layers', else
        # two FSDP units' (the next prefetched)
        gathered = prof.gathered if recompute == "layer" else prof.unit_gathered
        extra = extra + 2 * range_max(gathered)
    if recompute == "full" and prof.block_kept is not None:  # each block on its own
        kept, held = prof.block_kept, prof.block_held
    elif recompute in ("full", "layer"):  # each layer whole
        kept, held = prof.inputs, prof.inputs + prof.acts
    elif recompute == "selective":
        kept = prof.acts - need_cores(prof.core_bytes)
        held = kept + need_cores(prof.core_peak)
    else:
        return params, range_sums(prof.acts), extra
    return params, range_sums(kept), recomputed(kept, held) + extra


def recomputed(kept: np.ndarray, held: np.ndarray) -> np.ndarray:
    """[k, j]: the bytes a stage of layers k..j holds while one of its layers is recomputed,
    beyond the kept bytes of the micro-batch back-propagated (per layer l: `kept[l]` its kept
    bytes, `held[l]` what it holds of them and of its recomputation then)::

        max(0, max over l in k..j of (kept[k..l-1] + held[l]) - kept[k..j])

    Backward runs from layer j down: when layer l is recomputed the layers after it are done
    and their kept bytes freed."""
    L = len(kept)
    sums = range_sums(kept)
    upper = np.triu(np.ones((L, L), dtype=bool))
    at = np.where(upper, sums - kept[None, :] + held[None, :], -np.inf)
    return np.where(upper, np.maximum(np.maximum.accumulate(at, axis=1) - sums, 0), 0)


def range_costs(
    prof: LayerProfile,
    inflight: np.ndarray,
    budget: float,
    send: np.ndarray,
    recompute: str,
    pending: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(cost[k, j, s], memory[k, j, s]) of one option, s indexing `inflight` (the micro-batches a
    stage with s - 1 stages after it keeps in flight) and `pending` (the weight gradients it
    defers, zero bubble; None: none); cost is inf where memory exceeds the budget."""
    L = len(prof.time)
    time = prof.range_times(recompute)
    params, kept, transient = range_footprint(prof, recompute)
    deferred = 0.0
    if pending is not None and prof.wgrad_bytes is not None:
        deferred = range_sums(prof.wgrad_bytes)[:, :, None] * pending[None, None, :]
    mem = stage_peak_bytes(
        params[:, :, None],
        kept[:, :, None],
        transient[:, :, None],
        inflight[None, None, :],
        # zero-bubble stages run eager (`runtime.torch_pipeline`): no second set of gradients
        (
            prof.unmade_bytes()
            if pending is not None
            else prof.accumulate_bytes(recompute)
        )[:, :, None],
        prof.solution.num_microbatches,
        weight_grads=deferred,
    )
    valid = np.triu(np.ones((L, L), dtype=bool))[:, :, None]
    cost = np.where(valid & (mem <= budget), (time + send[None, :])[:, :, None], np.inf)
    return np.broadcast_to(cost, mem.shape).copy(), mem
