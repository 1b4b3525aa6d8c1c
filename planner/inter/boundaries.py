"""Layer boundaries of a clustering: which layer each node belongs to, the values that cross
from one layer to the next, their bytes, and the seconds a stage ending at a layer takes to send
them to the next stage and receive their gradients (what the stage DP adds to a range's cost,
`planner.inter.stage_table`).
"""

from __future__ import annotations

import numpy as np

from cost_models.communication import LogicalMesh, boundary_send_times
from planner.tracing.opgraph import OpGraph


def layer_of_nodes(graph: OpGraph, layers: list[tuple[int, int]]) -> dict[str, int]:
    """Node -> layer: ops by their position, placeholders by their first consumer."""
    ops = graph.ops
    out = {}
    for k, (a, b) in enumerate(layers):
        for n in ops[a : b + 1]:
            out[n.name] = k
    # Ops are in topological order and layers ascend with it: the first consumer has the least layer.
    for o in ops:
        for u in o.inputs:
            if graph.node(u).op != "call":
                out.setdefault(u, out[o.name])
    for n in graph.nodes:
        if n.op != "call" and n.op != "output":
            out.setdefault(n.name, 0)  # consumed by no op
    return out


def boundary_values(
    graph: OpGraph, layer_of: dict[str, int], num_layers: int
) -> list[list[str]]:
    """Values produced before layer k (ops or batch inputs) and read in or after it, for each k."""
    out: list[set[str]] = [set() for _ in range(num_layers)]
    for n in graph.ops:
        for u in n.inputs:
            if graph.node(u).op in ("param", "buffer"):
                continue
            a, b = layer_of.get(u, 0), layer_of[n.name]
            for k in range(a + 1, b + 1):
                out[k].add(u)
        for u in n.inputs:
            if graph.node(u).op == "input":
                out[0].add(u)
    return [sorted(s) for s in out]


def boundary_bytes(
    graph: OpGraph, bounds: list[list[str]], gradients: bool = False
) -> np.ndarray:
    """Per layer j: bytes of the full values crossing from layer j to layer j + 1 (``bounds[j + 1]``),
    one micro-batch; 0 for the last layer. With `gradients`, of their gradients sent back: only
    the floating values that need one (computed from parameters; not rotary tables sliced from a
    buffer, the runtime sends those none, `runtime.pipeline`)."""
    L = len(bounds)

    def sent(v: str) -> bool:
        return not gradients or graph.node(v).carries_grad

    return np.array(
        [
            sum(graph.node(v).output_bytes for v in bounds[k + 1] if sent(v))
            if k + 1 < L
            else 0
            for k in range(L)
        ]
    )


def stage_boundary_bytes(
    graph: OpGraph,
    layers: list[tuple[int, int]],
    last_layers: list[int],
    gradients: bool = False,
) -> list[float]:
    """What a plan prices as sent from each stage to the next per micro-batch (with
    `gradients`: sent back): `boundary_bytes` after each stage's last layer but the last
    stage's. `layers`: the op index ranges of the layers; `last_layers`: every stage's last
    layer. `graph` is traced on one micro-batch."""
    sent = _layer_boundary_bytes(graph, layers)[gradients]
    return [float(sent[k]) for k in last_layers[:-1]]


def _layer_boundary_bytes(
    graph: OpGraph, layers: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """`boundary_bytes` of `layers` without and with `gradients`, made once per graph and
    clustering (a plan search prices many candidates of one clustering)."""

    def make() -> tuple[np.ndarray, np.ndarray]:
        bounds = boundary_values(graph, layer_of_nodes(graph, layers), len(layers))
        return boundary_bytes(graph, bounds), boundary_bytes(graph, bounds, True)

    return graph.derived(("boundary_bytes", tuple(layers)), make)


def send_times(
    mesh: LogicalMesh,
    boundary_bytes: np.ndarray,
    crosses_hosts: bool,
    grad_bytes: np.ndarray | None = None,
) -> np.ndarray:
    """Per layer j: a stage on `mesh` ending at layer j sending its boundary values to the next
    stage and receiving their gradient (`boundary_bytes` and `grad_bytes`, default the same;
    `cost_models.communication.boundary_send_times`, every device of the mesh sending; over the
    inter-host link when `crosses_hosts`), 0 for the last layer."""
    L = len(boundary_bytes)
    out = np.array(
        boundary_send_times(
            mesh.cluster,
            boundary_bytes,
            [mesh.num_devices] * L,
            [crosses_hosts] * L,
            grad_nbytes=grad_bytes,
        )
    )
    out[-1] = 0.0
    return out
