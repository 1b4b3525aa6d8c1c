"""Predicted against measured communication, for the runtime tests: the collectives the planner
prices (`planner.intra.priced_comm.predicted_collectives`, and the stage boundaries'
`planner.inter.boundaries.stage_boundary_bytes`) against `runtime.comm_count.CommCounter`'s
records."""

from __future__ import annotations

from collections import defaultdict

from planner.inter.boundaries import stage_boundary_bytes
from planner.tracing.opgraph import OpGraph
from planner.vocab.plan_file import ParallelPlan
from runtime.comm_count import Collective


def as_run_on(kind: str, device_type: str) -> str:
    """The collective DTensor really issues for a priced one: on CPU meshes (gloo has no
    all-to-all) DTensor 2.13 re-shards S(i) -> S(j) by all-gather + local chunk
    (``shard_dim_alltoall``), so a priced all_to_all of B bytes runs as an all_gather of B bytes."""
    return "all_gather" if kind == "all_to_all" and device_type == "cpu" else kind


def compare(
    predicted: dict[str, list[tuple[str, float]]],
    measured: list[Collective],
    device_type: str = "cpu",
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Predicted vs measured bytes: ``{kind: (predicted, measured)}`` (predicted kinds mapped with
    `as_run_on`) and one line per site whose collectives differ."""
    pred_site: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for label, colls in predicted.items():
        for kind, nbytes in colls:
            pred_site[label][as_run_on(kind, device_type)] += nbytes
    meas_site: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in measured:
        meas_site[r.site][r.kind] += r.nbytes
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    diffs = []
    for label in sorted(set(pred_site) | set(meas_site)):
        p, m = dict(pred_site.get(label, {})), dict(meas_site.get(label, {}))
        for kind, b in p.items():
            totals[kind][0] += b
        for kind, b in m.items():
            totals[kind][1] += b
        if p != m:
            diffs.append(f"{label}: predicted {p or '{}'}, measured {m or '{}'}")
    return {k: (v[0], v[1]) for k, v in sorted(totals.items())}, diffs


DIRECTIONS = ("fwd", "bwd")


def predicted_boundary(graph: OpGraph, plan: ParallelPlan) -> dict[str, float]:
    """Point-to-point bytes of one step between stages as the planner prices them, per direction:
    ``{"fwd": activations, "bwd": their gradients}``. For every stage boundary, the full values
    crossing it and the gradients of those that need one
    (`planner.inter.boundaries.stage_boundary_bytes`; the planner's send time is that many bytes
    split over the sending stage's devices) times the micro-batches. `graph`: the model traced
    on one micro-batch."""
    layers = plan.layer_ranges([n.name for n in graph.ops])
    last = [s.layers[1] for s in plan.stages]
    return {
        d: sum(stage_boundary_bytes(graph, layers, last, d == "bwd"))
        * plan.num_microbatches
        for d in DIRECTIONS
    }


def boundary_bytes(records: list[Collective], kind: str = "send") -> dict[str, float]:
    """Bytes of the point-to-point records of `kind` ("send" or "recv") per direction, from the
    runner's sites ``fwd:<value>->p2p`` / ``bwd:<value>->p2p``. Pass the records of every rank: a
    rank records only what it sends or receives itself."""
    out = dict.fromkeys(DIRECTIONS, 0.0)
    for r in records:
        if r.kind == kind and r.site.endswith("->p2p"):
            out[r.site.split(":", 1)[0]] += r.nbytes
    return out


def compare_boundary(
    predicted: dict[str, float], records: list[Collective], rel: float = 0.1
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Priced vs sent point-to-point bytes per direction: ``{direction: (predicted, measured)}``
    and one line per direction where they differ by more than `rel` of the prediction (measured
    from every rank's "send" records)."""
    sent = boundary_bytes(records)
    table = {d: (predicted[d], sent[d]) for d in DIRECTIONS}
    diffs = [
        f"{d}: priced {p:.0f} B, sent {m:.0f} B"
        for d, (p, m) in table.items()
        if abs(m - p) > rel * max(p, 1.0)
    ]
    return table, diffs
