"""Run a pipeline plan whose stages have equal submeshes with ``torch.distributed.pipelining``.

    runner = make_runner(plan, graph)            # TorchPipelineRunner or PipelineRunner
    loss = runner.step(params, microbatches, buffers)

When every stage of a plan (every chunk, when interleaved) has the same logical mesh shape, the
stage meshes line up coordinate by coordinate: the rank at position ``i`` of stage ``s``'s mesh
talks only to the rank at position ``i`` of stage ``s + 1``'s mesh. `TorchPipelineRunner` then
builds one ``DeviceMesh`` of shape ``(p, *stage_mesh_shape)`` over the ``p`` device groups, with
dimension names ``("pp", "stage0", ...)``: the ``"stage*"`` slice is this rank's stage mesh (what
the executor shards over), and the ``"pp"`` dimension's process group links the ranks at the same
mesh position of every stage. Over that group each rank runs PyTorch's own schedule
(``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` for ``plan.virtual_stages >
1``) with one ``PipelineStage`` per stage (or chunk) it runs. The pipelines of the different mesh
positions run side by side; the collectives inside a stage (tensor or data parallelism) run on the
stage mesh's own groups.

The stage's submodule (`_StageModule`) wraps the stage's `runtime.executor.PlanExecutor`:

* it receives, as plain tensors, the local shards of the boundary values crossing into the stage,
  wraps them with ``DTensor.from_local`` in their wire placement and redistributes them to the
  placement the stage plans them in (below);
* it runs the stage's graph with ``PlanExecutor.run_outputs`` on the parameters, the micro-batch
  (looked up by the ``mb`` keyword argument that the schedule splits like a batch) and buffers;
* for every boundary value crossing out of the stage, it redistributes the value on its own mesh to
  its wire placement and returns ``to_local()``: the shard at mesh position ``i`` is the one
  the receiving stage's rank at position ``i`` needs, because both meshes have the same shape.

A received value's placeholder is planned, as on our own runner, in the placement the receiving
stage's intra-op solution gave the value (``StagePlan.input_placements`` through
`runtime.stages.stage_program`): the source of the edges to its consumers, and of their
gradients' way back, that the planner priced, so the executor's edges run what was priced. A
value's boundary placement (`boundary_placements`) is that placement in its first receiving
stage; its wire placement (`wire_placements`) is the boundary placement with its replicated mesh
axes sharded on a tensor dimension: each rank sends a 1/n piece and the receiving mesh
all-gathers them (``fwd:<v>->recv``, the gradient's slice back needs none), so the full value
crosses once per direction, as the planner prices stage boundaries. A value read by a stage after
the next is relayed by the stages between (their submodules pass its local shard through):
torch's schedules only move values between adjacent stages; a later reader redistributes the
wire placement to its own planned placement.

Backward is autograd end to end: ``PipelineStage`` back-propagates the received output gradients
through ``to_local`` (which wraps the local gradient in the wire placement), the executor's
graph and ``from_local`` (which redistributes the input's gradient to the wire placement and
returns its local shard), and sends that shard back.

Loss semantics are those of `runtime.pipeline.PipelineRunner`: the last stage's submodule returns
the micro-batch loss (replicated, as a local scalar), the schedule's ``loss_fn`` divides it by the
number of micro-batches ``B`` before its backward (``scale_grads=False``: the parameters are the
runner's DTensor leaves, not the submodule's), so the accumulated gradient is that of the global
batch's mean loss; the step's loss is the mean of the micro-batch losses, broadcast from the last
stage's first rank to the world. ZeRO parameters are all-gathered once per step before the
schedule runs and their gradients reduce-scattered after it, and the other gradients synchronised
once per step (`PipelineRunner._finish_grads`); recomputation runs inside the executor
(``recompute_layers``), so both work as in `PipelineRunner`.

Zero bubble (``plan.schedule == "zero_bubble"``): torch's ``ScheduleInterleavedZeroBubble``
(ZB1P) over the same stages, one per device group. It splits each backward into the input
gradient (``stage_backward_input``: ``autograd.grad`` to the stage's inputs, keeping the graph)
and the weight gradient run later (``stage_backward_weight``: from the intermediates it saved to
the parameters, ``submod.parameters()``, which `_StageModule` answers with the DTensor leaves the
stage computes with this step). The split needs an autograd graph of one node per op, so these
stages run the eager executor, not `runtime.compiled`: a compiled stage's backward is one
autograd node that computes input and weight gradients together, and the weight pass would run
it all again. Not run: FSDP stages (`runtime.fsdp` reduce-scatters inside backward and waits one
layer later in backward order; the weight pass runs outside that order), virtual stages, and
fewer micro-batches than stages; our own runner has no zero-bubble order.

Which runner (`make_runner`): ``impl="auto"`` (the default; or the environment variable
``MESHPLAN_PIPELINE``) takes this module's runner when `torch_pipelining_unsupported` finds no
reason against it and torch's receive buffers fit the plan's memory budget
(`receive_buffers_exceed_budget`: torch's ``PipelineStage`` allocates one per micro-batch up
front, which the plan's memory, priced for our runner, does not hold), else `PipelineRunner`
(our own send/recv and schedules, needed when the submeshes differ in size or shape); ``"ours"`` forces `PipelineRunner`; ``"torch"`` forces this
runner and raises when the plan does not fit it. Plans of one stage run on `PipelineRunner`
(there is no pipeline to schedule).

What PyTorch lacks here (why `_StageModule` exists): no PyTorch piece runs an fx graph under
per-node placements (`runtime.executor`), so the stage module wraps our executor. Why it exchanges
local shards rather than DTensors: torch 2.13's ``PipelineStage`` can carry DTensor boundary values
(it sends the local tensor and rebuilds the DTensor from metadata, on a mesh looked up by dimension
names and layout), but then the gradients' placements must be declared up front (static
``input_grads`` / ``output_grads``) or inferred by a metadata pass that runs the stage on real
tensors, and a value would cross in whatever placement its producer left it. Plain local shards in
a wire placement fixed from the plan keep both sides' layouts, and the gradients' placements
(pinned by ``to_local`` / ``from_local``), in our hands, with plain-tensor static metadata.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph
from planner.vocab.placements import device_mesh_shape
from planner.vocab.plan_file import ParallelPlan
from runtime import boundary, comm_count
from runtime.meshes import device_mesh
from runtime.pipeline import PipelineRunner
from runtime.stages import StageGraph, split_stages

__all__ = [
    "IMPLS",
    "PIPELINE_ENV",
    "TorchPipelineRunner",
    "boundary_placements",
    "crossing_values",
    "make_runner",
    "receive_buffer_bytes",
    "receive_buffers_exceed_budget",
    "torch_pipelining_unsupported",
]

PIPELINE_ENV = "MESHPLAN_PIPELINE"
IMPLS = ("auto", "torch", "ours")
Strs = tuple[str, ...]


def torch_pipelining_unsupported(
    plan: ParallelPlan, schedule: str | None = None
) -> str | None:
    """Why `plan` cannot run on ``torch.distributed.pipelining`` (None when it can): it needs at
    least two stages, the same logical mesh for every stage, as many micro-batches as its
    schedules accept, and at every mesh position the device groups' ranks increasing in stage order (the ``pp`` group's rank order is the ranks'
    order, and torch's schedules place stage ``s`` on group rank ``s % p``)."""
    if len(plan.stages) < 2:
        return "a plan of one stage has no pipeline"
    shapes = {tuple(s.logical_mesh) for s in plan.stages}
    if len(shapes) > 1:
        return f"the stages' logical meshes differ ({sorted(shapes)})"
    p = len(plan.stages) // max(plan.virtual_stages, 1)
    B = plan.num_microbatches
    if (schedule or plan.schedule) == "zero_bubble":
        reason = _zero_bubble_unsupported(plan, p, B)
        if reason is not None:
            return reason
    elif plan.virtual_stages > 1:
        rounds = max(1, B // p)
        if B % rounds:
            return (
                f"interleaved 1F1B in torch needs the {B} micro-batches to be a multiple "
                f"of the rounds ({rounds})"
            )
    elif (schedule or plan.schedule) != "gpipe" and B < p:
        return (
            f"1F1B in torch needs at least as many micro-batches ({B}) as stages ({p})"
        )
    groups = [list(s.devices) for s in plan.stages[:p]]
    if len({len(g) for g in groups}) > 1:
        return "the device groups differ in size"
    for i in range(len(groups[0])):
        ranks = [g[i] for g in groups]
        if ranks != sorted(ranks):
            return (
                f"the ranks at mesh position {i} ({ranks}) are not increasing in stage "
                "order"
            )
    return None


def _zero_bubble_unsupported(plan: ParallelPlan, p: int, B: int) -> str | None:
    """Why torch's zero-bubble schedule cannot run `plan` (None when it can)."""
    if plan.virtual_stages > 1:
        return "the zero_bubble schedule runs one stage per device group (virtual_stages 1)"
    if B < p or B % (B // p):
        return (
            f"zero bubble in torch needs at least as many micro-batches ({B}) as stages "
            f"({p}), and a multiple of its rounds (B // stages)"
        )
    fsdp = [i for i, s in enumerate(plan.stages) if s.fsdp_params]
    if fsdp:
        # `runtime.fsdp` reduce-scatters a gradient inside backward and waits for it one
        # layer later in backward order; the weight-gradient pass runs outside that order
        return (
            f"stages {fsdp} hold FSDP parameters, whose in-backward reduce-scatters "
            "(runtime.fsdp) are not split into input and weight gradients"
        )
    return None


def make_runner(
    plan: ParallelPlan,
    graph: OpGraph,
    *,
    device_type: str = "cpu",
    schedule: str | None = None,
    impl: str | None = None,
    compile: bool = True,
) -> PipelineRunner:
    """The runner of `plan` (module docstring): `impl` is ``"auto"``, ``"torch"`` or ``"ours"``
    (default: ``$MESHPLAN_PIPELINE`` or ``"auto"``); `compile` as in `PipelineRunner`."""
    impl = impl or os.environ.get(PIPELINE_ENV) or "auto"
    if impl not in IMPLS:
        raise MeshplanError(f"pipeline implementation {impl!r}: use one of {IMPLS}")
    reason = torch_pipelining_unsupported(plan, schedule)
    if impl == "torch" and reason is not None:
        raise MeshplanError(
            f"torch.distributed.pipelining cannot run this plan: {reason}"
        )
    kw = {"device_type": device_type, "schedule": schedule, "compile": compile}
    zb = (schedule or plan.schedule) == "zero_bubble"
    if zb and len(plan.stages) > 1 and reason is not None:
        raise MeshplanError(f"the zero_bubble schedule cannot run this plan: {reason}")
    if impl == "auto" and reason is None and not zb:
        reason = receive_buffers_exceed_budget(plan, graph)
    if impl == "ours" or reason is not None:
        return PipelineRunner(plan, graph, **kw)
    return TorchPipelineRunner(plan, graph, **kw)


def receive_buffer_bytes(
    plan: ParallelPlan, graph: OpGraph, stages: Sequence[StageGraph]
) -> list[float]:
    """Per stage (chunk) of `plan`: the bytes per device that torch's ``PipelineStage``
    allocates up front to receive into, the same on every stage of a device group. It makes one
    buffer per micro-batch (``_prepare_forward_infra`` / ``_prepare_backward_infra``) for every
    value crossing into a chunk and every gradient coming back to its outputs, each a rank's
    piece of the wire placement (about 1/n of the value on a stage of n devices), and keeps them
    for the whole run: B boundaries each way. Our runner holds only the micro-batches in
    flight, as the planner prices them."""
    cross = crossing_values(stages)
    B, S = plan.num_microbatches, len(stages)
    per_chunk = []
    for c in range(S):
        values = (cross[c - 1] if c > 0 else []) + (cross[c] if c < S - 1 else [])
        full = sum(float(graph.node(v).output_bytes) for v in values)
        per_chunk.append(B * full / len(plan.stages[c].devices))
    p = S // max(plan.virtual_stages, 1)
    group = [sum(per_chunk[g::p]) for g in range(p)]
    return [group[c % p] for c in range(S)]


def receive_buffers_exceed_budget(plan: ParallelPlan, graph: OpGraph) -> str | None:
    """Why torch's pipelining would not fit `plan` (traced as `graph`) in its memory budget
    (None when it would or the plan has no budget): a stage's predicted peak plus
    `receive_buffer_bytes`."""
    budget = plan.memory_budget_bytes
    if not budget:
        return None
    extra = receive_buffer_bytes(plan, graph, split_stages(graph, plan))
    over = [
        i
        for i, (s, x) in enumerate(zip(plan.stages, extra))
        if s.memory_bytes + x > budget
    ]
    if not over:
        return None
    i = over[0]
    return (
        f"torch's PipelineStage would hold receive buffers for all {plan.num_microbatches} "
        f"micro-batches ({_mib(extra[i])} per device on stage {i}, beside the plan's "
        f"{_mib(plan.stages[i].memory_bytes)}; budget {_mib(budget)})"
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def crossing_values(stages: Sequence[StageGraph]) -> list[list[str]]:
    """``out[b]``: the boundary values that go from stage ``b`` to stage ``b + 1`` - produced at
    a stage ``<= b`` and read at a stage ``> b`` - in the order of their producers' outputs."""
    producer: dict[str, int] = {}
    last_reader: dict[str, int] = {}
    for st in stages:
        for v, dsts in st.outputs.items():
            producer[v] = st.index
            last_reader[v] = max(dsts)
    order = [v for st in stages for v in st.outputs]
    return [
        [v for v in order if producer[v] <= b < last_reader[v]]
        for b in range(len(stages) - 1)
    ]


def boundary_placements(
    stages: Sequence[StageGraph], plan: ParallelPlan
) -> dict[str, Strs]:
    """Boundary value -> its boundary placement (plan strings, one per logical-mesh axis): the
    placement its first receiving stage plans it in (``StagePlan.input_placements``, ``R`` on
    every axis when not listed), from which its wire placement follows (module docstring)."""
    out: dict[str, Strs] = {}
    for st in stages:
        for v, dsts in st.outputs.items():
            sp = plan.stages[min(dsts)]
            rep = ["R"] * len(sp.logical_mesh)
            out[v] = tuple(sp.input_placements.get(v, rep))
    return out


def wire_placements(
    shape: Sequence[int], places: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[Placement, ...]:
    """The placement a boundary value travels in: `places` (its boundary placement) with every
    replicated mesh axis of size n > 1 sharded on the largest tensor dimension that no other axis
    shards and that n divides (kept replicated when there is none). The ranks of a stage then each
    send a 1/n piece and the full value crosses once per direction, as the planner prices it
    (`planner.inter.stage_table`; Alpa's cross-mesh resharding: send pieces, all-gather on the
    receiving mesh) instead of n copies of it."""
    out = list(places)
    taken = {p.dim for p in out if isinstance(p, Shard)}
    for axis, n in enumerate(mesh_shape):
        if n == 1 or not out[axis].is_replicate():
            continue
        dims = [d for d in range(len(shape)) if d not in taken and shape[d] % n == 0]
        if dims:
            d = max(dims, key=lambda d: shape[d])
            out[axis] = Shard(d)
            taken.add(d)
    return tuple(out)


def _loss_fn(num_microbatches: int) -> Any:
    def scaled(output: torch.Tensor, _mb: torch.Tensor) -> torch.Tensor:
        # the micro-batch loss over B: gradients accumulate to the mean loss's
        return output / num_microbatches

    return scaled


class TorchPipelineRunner(PipelineRunner):
    """`PipelineRunner` whose step runs ``torch.distributed.pipelining`` (module docstring).

    ``pp_group`` is this rank's pipeline process group (None outside the plan),
    ``pipeline_stages`` its ``PipelineStage`` objects (one per chunk it runs) and
    ``pipeline_schedule`` the torch schedule object driving them."""

    uses_torch_pipelining = True

    def __init__(
        self,
        plan: ParallelPlan,
        graph: OpGraph,
        *,
        device_type: str = "cpu",
        schedule: str | None = None,
        compile: bool = True,
    ) -> None:
        reason = torch_pipelining_unsupported(plan, schedule)
        if reason is not None:
            raise MeshplanError(
                f"torch.distributed.pipelining cannot run this plan: {reason}"
            )
        self.pp_group: dist.ProcessGroup | None = None
        self._boundary: dict[str, Strs] | None = None
        if (schedule or plan.schedule) == "zero_bubble":
            # a compiled stage is one autograd node computing input and weight gradients
            # together: the weight-gradient pass would run its whole backward again
            compile = False
        super().__init__(
            plan, graph, device_type=device_type, schedule=schedule, compile=compile
        )
        self.crossing = crossing_values(self.stages)
        self._micro: Sequence[Sequence[torch.Tensor]] = ()
        self._used: dict[str, DTensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._losses: list[torch.Tensor] = []
        self.pipeline_stages: list[PipelineStage] = []
        self.pipeline_schedule: Any = None
        if not self.chunks:
            return
        S = len(self.stages)
        for c in self.chunks:
            module = _StageModule(self, c)
            self.pipeline_stages.append(
                PipelineStage(
                    module,
                    c,
                    S,
                    self.device,
                    input_args=module.example_inputs(),
                    output_args=module.example_outputs(),
                    group=self.pp_group,
                )
            )
        B = plan.num_microbatches
        loss_fn = _loss_fn(B)
        if self.schedule in ("interleaved", "zero_bubble"):
            cls = (
                ScheduleInterleaved1F1B
                if self.schedule == "interleaved"
                else ScheduleInterleavedZeroBubble
            )
            self.pipeline_schedule = cls(
                self.pipeline_stages, B, loss_fn=loss_fn, scale_grads=False
            )
        else:
            cls = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
            self.pipeline_schedule = cls(
                self.pipeline_stages[0], B, loss_fn=loss_fn, scale_grads=False
            )

    # ------------------------------------------------------------------ construction hooks

    def _build_meshes(self, device_type: str) -> list[DeviceMesh | None]:
        """One DeviceMesh ``(p, *stage shape)`` over the device groups (module docstring); this
        rank's stage mesh for the chunks it runs, None for the others."""
        p = self.groups
        shape = device_mesh_shape(tuple(self.plan.stages[0].logical_mesh))
        ranks = torch.tensor(
            [list(s.devices) for s in self.plan.stages[:p]], dtype=torch.int64
        ).view(p, *shape)
        names = ("pp", *(f"stage{i}" for i in range(len(shape))))
        mesh = device_mesh(device_type, ranks, names)
        mine = [self.rank in s.devices for s in self.plan.stages]
        if not any(mine):
            return [None] * len(self.plan.stages)
        stage = device_mesh(
            device_type, ranks, names, names[1] if len(names) == 2 else names[1:]
        )
        self.pp_group = mesh.get_group("pp")
        pos = next(s.devices for s in self.plan.stages if self.rank in s.devices)
        i = list(pos).index(self.rank)
        for g in range(p):
            got = dist.get_group_rank(self.pp_group, self.plan.stages[g].devices[i])
            if got != g:
                raise MeshplanError(
                    f"device group {g} has rank {got} in the pipeline group, not {g}"
                )
        return [stage if m else None for m in mine]

    @property
    def boundary(self) -> dict[str, Strs]:
        """Boundary value -> its boundary placement (plan strings; `boundary_placements`)."""
        if self._boundary is None:
            self._boundary = boundary_placements(self.stages, self.plan)
        return self._boundary

    # ------------------------------------------------------------------ one step

    def step(
        self,
        params: dict[str, DTensor],
        microbatches: Sequence[Sequence[torch.Tensor]],
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch in PyTorch's schedule, then the gradient
        sync; the mean micro-batch loss, the same on every rank of the world, as a 0-dim tensor
        on this rank's device (`PipelineRunner.step`)."""
        B = len(microbatches)
        if B != self.plan.num_microbatches:
            raise MeshplanError(
                f"the plan runs {self.plan.num_microbatches} micro-batches, got {B}"
            )
        loss = torch.zeros((), device=self.device)
        if self.index is not None:
            self._micro, self._buffers, self._losses = microbatches, buffers or {}, []
            self.overlap.arm(params, B)
            used = self._gather_zero(params) if self.zero_placements else params
            self._used = used
            ids = torch.arange(B)
            try:
                self.pipeline_schedule.step(target=ids, return_outputs=False, mb=ids)
            finally:
                self._micro, self._used, self._buffers = (), {}, {}
            for x in self._losses:
                loss += x
            self._finish_grads(params, used)
        dist.broadcast(loss, src=self.plan.stages[-1].devices[0])
        return loss / B


class _StageModule(nn.Module):
    """One stage (chunk) of a `TorchPipelineRunner` as the module of a ``PipelineStage``:
    ``forward(*received_shards, mb)`` -> the local shards of the values crossing out of the
    stage, or the micro-batch loss on the last stage (module docstring). It holds no
    parameters: they are the runner's DTensor leaves."""

    def __init__(self, runner: TorchPipelineRunner, c: int) -> None:
        super().__init__()
        self.runner, self.c = runner, c
        self.ex = runner.executors[c]
        self.st = runner.stages[c]
        self.recv = runner.crossing[c - 1] if c > 0 else []
        self.send = [] if self.st.is_last else runner.crossing[c]
        # the placement the stage plans each received value in (`runtime.stages.stage_program`)
        self.places = {
            v: self.ex.placements(self.ex._planned_output(v)) for v in self.st.inputs
        }
        # the placement each value crosses in (`wire_placements`)
        self.wire = {
            v: wire_placements(
                runner.graph.node(v).outputs[0].shape,
                self.ex.placements(runner.boundary[v]),
                self.ex.mesh.shape,
            )
            for v in self.recv + self.send
        }

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The DTensor leaves this stage computes with in the current step (the runner's, not
        registered here): what torch's zero-bubble split takes the weight gradients of
        (``stage_backward_input`` / ``stage_backward_weight`` read ``submod.parameters()``)."""
        used = self.runner._used
        return iter([used[p] for p in self.ex.opgraph.params if p in used])

    def _example(self, v: str) -> torch.Tensor:
        """An empty tensor shaped as this rank's shard of boundary value `v`."""
        meta = self.runner.graph.node(v).outputs[0]
        shape, _ = compute_local_shape_and_global_offset(
            tuple(meta.shape), self.ex.mesh, self.wire[v]
        )
        t = torch.empty(
            shape, dtype=getattr(torch, meta.dtype), device=self.runner.device
        )
        # a value that needs no gradient (rotary tables sliced from a buffer) gets none back:
        # torch's stages then neither compute, reduce nor send one for it
        return t.requires_grad_(boundary.needs_grad(self.runner.graph, v))

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Examples of the received shards (none for the first stage: its input is the batch)."""
        return tuple(self._example(v) for v in self.recv)

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        """Examples of the sent shards, or of the loss on the last stage."""
        if not self.st.is_last:
            return tuple(self._example(v) for v in self.send)
        out = next(n for n in self.st.graph.gm.graph.nodes if n.op == "output")
        val = out.args[0]
        val = val[0] if isinstance(val, (tuple, list)) else val
        dtype = val.meta["val"].dtype
        return (
            torch.empty((), dtype=dtype, device=self.runner.device, requires_grad=True),
        )

    def forward(
        self, *received: torch.Tensor, mb: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        runner, ex = self.runner, self.ex
        m = int(mb.reshape(-1)[0])
        shards = dict(zip(self.recv, received))
        inputs = {}
        for v in self.st.inputs:
            meta = runner.graph.node(v).outputs[0]
            shape = torch.Size(meta.shape)
            x = DTensor.from_local(
                shards[v],
                ex.mesh,
                self.wire[v],
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )
            if self.wire[v] != self.places[v]:  # gather the pieces (module docstring)
                with comm_count.site(f"fwd:{v}->recv"):
                    x = x.redistribute(ex.mesh, self.places[v])
            inputs[v] = x
        out = ex.run_outputs(
            runner._used,
            runner._micro[m],
            runner._buffers,
            inputs=inputs,
            microbatch=m,
        )
        if self.st.is_last:
            loss = out[0] if isinstance(out, (list, tuple)) else out
            if any(not p.is_replicate() for p in loss.placements):
                with comm_count.site("fwd:output"):
                    loss = loss.redistribute(placements=[Replicate()] * ex.mesh.ndim)
            local = loss.to_local()
            runner._losses.append(local.detach())  # float() would wait for the device
            return local
        produced = dict(zip(self.st.outputs, out))
        sent = []
        for v in self.send:
            if v not in produced:  # relayed to a later stage
                sent.append(shards[v].view_as(shards[v]))
                continue
            x = produced[v]
            if tuple(x.placements) != self.wire[v]:
                with comm_count.site(f"fwd:{v}->send"):
                    x = x.redistribute(ex.mesh, self.wire[v])
            sent.append(x.to_local().contiguous())
        return tuple(sent)
