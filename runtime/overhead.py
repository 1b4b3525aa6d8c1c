"""The runtime's per-op overhead: seconds per traced op per micro-batch that are not the op's compute.

The executor (`runtime.executor.PlanExecutor`) interprets the traced aten graph node by node on
DTensors, and autograd runs every op's backward through DTensor again. Each node therefore costs a
roughly fixed amount of Python and dispatch time besides its FLOPs and bytes; for the small models
that train on a CPU this is most of a step. The roofline in `cost_models.compute` knows nothing of
it, so the profiler measures it here and the cost model adds it per op
(`cost_models.compute.op_overhead`).

Measurement (`measure_op_overhead`, inside a launched group, on every rank at once as in training):
a tiny GPT (``CALIBRATION_MODEL``, hidden 8: a few thousand FLOPs per op) is traced, every node is
given its fully replicated strategy on a 1-D mesh of all the ranks (no op communicates, nothing is
sharded), and the executor runs forward + ``loss.backward()`` ``steps`` times after ``warmup`` (the
first step costs ~10x the rest - DTensor's propagation caches fill - and the next few still fall
by about a third on this machine, hence 5). The
overhead is the median step time divided by the graph's ``call_function`` nodes (views included:
they dispatch too). The ops' own compute is negligible at this size (it is not subtracted). Every
rank measures at the same time, so on a machine with fewer cores than ranks the figure includes
the ranks' time-sharing of the cores, as in training; the largest rank's median is returned.

The figure belongs to the executor measured: when the runtime gets faster (e.g. compiled stages),
re-profiling updates it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

CALIBRATION_MODEL = "gpt:hidden=8,layers=2,heads=2,seq=4,vocab=16"
CALIBRATION_BATCH = 2


def replicated_solution(graph: Any, mesh_shape: tuple[int, int]) -> Any:
    """A `StageSolution` choosing for every node the strategy with every input and output
    replicated (DTensor can always run an op so); raises MeshplanError if a node has none."""
    from cost_models.errors import MeshplanError
    from planner.intra_op import StageSolution
    from planner.stage_costs import Option
    from planner.strategies import node_strategies

    def replicated(p: Any) -> bool:
        return p is None or all(x == "R" for x in p)

    choice = {}
    for n in graph.gm.graph.nodes:
        if n.op == "output":
            continue
        options = [
            s
            for s in node_strategies(n, mesh_shape)
            if all(replicated(p) for p in (*s.output, *s.inputs))
        ]
        if not options:
            raise MeshplanError(f"no replicated strategy for node {n.name}")
        choice[n.name] = Option(options[0])
    return StageSolution(
        mesh_shape=mesh_shape,
        choice=choice,
        param_placements={},
        zero_params=[],
        compute_s=0.0,
        comm_s=0.0,
        grad_sync_s=0.0,
        param_state_bytes=0.0,
        activation_bytes=0.0,
        fallback_ops=[],
        num_microbatches=1,
        optimal=True,
        ilp_nodes=0,
        solve_time_s=0.0,
    )


def measure_op_overhead(steps: int = 10, warmup: int = 5) -> float:
    """Seconds of runtime overhead per traced op per micro-batch (forward + backward); call on every
    rank of an initialised CPU (gloo) process group. See the module docstring."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from planner.models import build_model
    from planner.tracer import trace
    from runtime.executor import PlanExecutor

    world = dist.get_world_size()
    torch.manual_seed(0)
    model, batch = build_model(
        CALIBRATION_MODEL, batch=CALIBRATION_BATCH, device="cpu", dtype=torch.float32
    )
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    graph = trace(model, batch, model_name=CALIBRATION_MODEL)
    mesh_shape = (1, world)
    executor = PlanExecutor(
        graph, replicated_solution(graph, mesh_shape), init_device_mesh("cpu", (world,))
    )
    params = executor.place_params(
        {k: p.detach().clone() for k, p in model.named_parameters()}
    )
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    ops = sum(1 for n in graph.gm.graph.nodes if n.op == "call_function")
    times = []
    dist.barrier()
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        executor.run_plan(params, batch, buffers).backward()
        for p in params.values():
            p.grad = None
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times) / ops], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)
