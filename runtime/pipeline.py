"""Run one training step of a multi-stage plan: each stage on its own submesh, micro-batches in a
GPipe or 1F1B order, activations and their gradients moved between the submeshes.

Every rank of the launched group builds the same `PipelineRunner`: it traces nothing itself (it is
given the traced graph of one micro-batch), splits it into stages (`runtime.stages`), and creates
one DeviceMesh per stage over the stage's devices (``DeviceMesh("cpu", ranks.view(shape))`` with the
logical mesh's size-1 axes squeezed, as `runtime.executor.make_mesh` does; every rank creates every
mesh, in stage order, because creating a mesh's process groups is collective over the world). A
rank runs the stage whose devices hold it with `runtime.executor.PlanExecutor` driven by the plan's
strategies (`runtime.stages.stage_program`); a rank in no stage only joins the loss broadcast.

Moving a boundary value from stage s to stage t (one micro-batch):

* forward: the sender stage redistributes the value from its planned placement to Replicate on its
  mesh (an executor edge, whose backward moves the gradient back to the planned placement), then
  sender rank ``Ds[i % |Ds|]`` sends the i-th of ``|Dt|`` pieces of it to the i-th receiver rank
  (`runtime.boundary`: every byte crosses once, as the planner prices it); the receivers all-gather
  the pieces and place the value (local slices) in its planned placement on their mesh
  (``StagePlan.input_placements``, the placement the stage's solution priced its edges from), a
  leaf requiring grad; the executor's edges to its consumers then run as priced.
* backward: the receiver stage's gradient of that leaf arrives in that placement (the executor's
  edges give it back there) and is made replicated (``bwd:<v>->recv``); receiver rank
  ``Dt[j % |Dt|]`` sends the j-th of ``|Ds|`` pieces of it to the j-th sender rank, which sums
  the pieces from every consuming stage, all-gathers them within its stage and back-propagates
  the sum through its replicated copy.

A value read by several later stages goes to each directly (no relay through the stages between).
Sends are ``isend`` (released once the receiver is known to have them, `runtime.mailbox`);
receives block, so a stage runs its schedule
in its own order (`runtime.schedules`): GPipe (every forward, then every backward) or 1F1B
(``S - s - 1`` warm-up forwards, then one forward and one backward alternately, then the remaining
backwards). The runner checks at construction, by simulating every group's order
(`runtime.schedules.deadlock_free`), that every blocking receive has its send posted before.

Interleaved plans (``plan.virtual_stages == v > 1``, ``schedule "interleaved"``): the plan's
``p * v`` stages are chunks, chunk ``c`` on the devices of group ``c % p``. A rank runs the ``v``
chunks of its group, each with its own executor and parameters, in Megatron-LM's interleaved 1F1B
order (warm-up forwards across its chunks, steady one-forward-one-backward, cool-down; the
micro-batches a multiple of ``p``). Boundary values move between chunks as between stages above:
chunk ``p - 1`` sends to chunk ``p`` on group 0. A value between two chunks of the same group (a
skip by a multiple of ``p``) stays on the rank. Messages are tagged by micro-batch, value and
consuming chunk.

What PyTorch lacks (why this module sends and receives itself): ``torch.distributed.pipelining``
(``PipelineStage`` and its schedules) runs stages over a 1D pipeline process group and moves the
tensors a stage returns from stage ``i`` to stage ``i + 1`` only, between ranks of that group. When
every stage has the same logical mesh, one such group per mesh position fits, and
`runtime.torch_pipeline.TorchPipelineRunner` (a subclass of this runner, chosen by
`runtime.torch_pipeline.make_runner`) runs those plans on PyTorch's schedules. It has no piece for
stages whose submeshes differ in size or shape (a rank of one stage would have to exchange parts of
a value with several ranks of the next), so this runner keeps those plans: every boundary value made
replicated, and the rank mapping between the submeshes above. It also runs any plan when forced
(``MESHPLAN_PIPELINE=ours``, ``Trainer(..., pipeline="ours")``); its gradients and losses match one
device (`tests/test_runtime_pipeline.py`).

The hooks `_build_meshes` (the stage meshes), `_program` (each chunk's stage program) and
`_finish_grads` (ZeRO reduce-scatter and gradient sync after the last backward) are shared with
the torch-pipelining subclass.

Recomputation (``StagePlan.recompute``): each executor checkpoints the segments
`runtime.stages.recomputed` gives.

FSDP (``StagePlan.fsdp_params``, ZeRO stage 3): the parameter's leaf is its shard
(`shard_placements`); the stage's executor gathers it around its use in every micro-batch and
reduce-scatters its gradient onto the shard in backward, waited one layer of the plan later
(`runtime.fsdp`); with recomputation the recomputed forward reads the backward's gathered copies.

ZeRO (``StagePlan.zero_params``): such a parameter's leaf, the one the optimizer updates (and keeps
its state for), is sharded over the mesh axes where the plan replicates it (`place_params`). A step
all-gathers it once to its planned placement (a new leaf the micro-batches compute with), and after
the last backward reduce-scatters that leaf's accumulated partial gradient onto the shard: the
all-reduce of data parallelism split into its two halves, plus the parameter all-gather, as
`planner.intra.prices` prices it.

Tied parameters (``plan.tied_params``: one tensor read by several stages, such as an input
embedding and the LM head sharing its weight): every stage reading it has it in its graph and its
plan, so every device group holding one places its own copy (`place_params`, from the same full
tensor: the copies start equal; chunks of one group share one copy). After the gradient sync of
each step the copies' gradients are summed across the groups (`runtime.grad_sync.sync_tied`, over
the process groups `_tied_copies` makes), so every copy takes the same optimizer step. The runner
checks that the plan's ``tied_params`` are exactly the parameters its stages' graphs share
(`runtime.stages.check_tied`).

Losses: each micro-batch's loss is divided by the number of micro-batches before its backward, so
the accumulated gradient is that of the mean loss over the global batch (single-device training on
the whole batch). Parameters' gradients are synchronised once per step (`PlanExecutor.sync_grads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph
from planner.vocab.dtensor_ext import str_to_placement
from planner.vocab.placements import device_mesh_shape, mesh_axes, norm, zero_shard
from planner.vocab.plan_check import validate
from planner.vocab.plan_file import ParallelPlan, StagePlan
from planner.vocab.strategy import StageProgram, tied_copies_align
from runtime import boundary, comm_count
from runtime.device_ops import run_device
from runtime.executor import PlanExecutor
from runtime.grad_overlap import GradOverlap
from runtime.grad_sync import TiedCopy, sync_tied
from runtime.mailbox import Mailbox
from runtime.meshes import device_mesh, stage_mesh
from runtime.redistribute import redistribute
from runtime.schedules import (
    SCHEDULES,
    Action,
    deadlock_free,
    interleaved_order,
    schedule_order,
)
from runtime.stages import (
    StageGraph,
    check_tied,
    fsdp_units,
    layer_of_nodes,
    recomputed,
    split_stages,
    stage_program,
)

__all__ = ["PipelineRunner", "schedule_order"]


def shard_placements(
    graph: OpGraph, stage: StagePlan, paths: list[str]
) -> dict[str, tuple[Placement, ...]]:
    """Placeholder name -> the placements of the shard that a ZeRO or FSDP parameter among
    `paths` (``stage.zero_params`` or ``stage.fsdp_params``) keeps
    (`planner.vocab.placements.zero_shard`, as the planner prices it), on the stage's squeezed
    mesh; parameters the rule leaves whole are not listed."""
    names = {v: k for k, v in graph.placeholder_paths.items()}
    axes = mesh_axes(tuple(stage.logical_mesh))
    out: dict[str, tuple[Placement, ...]] = {}
    for path in paths:
        if path not in names or path not in graph.params:
            continue
        planned = tuple(norm(p) for p in stage.param_placements[path])
        meta = graph.node(names[path]).outputs[0]
        held = zero_shard(
            tuple(meta.shape),
            planned,
            tuple(stage.logical_mesh),
            stage.shard_axes(path),
        )
        if held != planned:
            out[names[path]] = tuple(str_to_placement(held[a]) for a in axes) or (
                Replicate(),
            )
    return out


def _check_devices(plan: ParallelPlan, world: int) -> int:
    """The number of device groups of `plan` (its stages, or ``len(stages) // v`` when
    interleaved). The plan must be valid (`planner.vocab.plan_check.validate`: disjoint device
    groups, chunk ``c`` on the devices of group ``c % p``, ...) and its ranks below `world`."""
    validate(plan)
    p = len(plan.stages) // plan.virtual_stages
    used = [r for s in plan.stages[:p] for r in s.devices]
    if max(used) >= world:
        raise MeshplanError(
            f"the plan runs on ranks up to {max(used)}, but the group has {world} ranks"
        )
    return p


def _all_reduced(stage: StagePlan) -> list[list[str]]:
    """The stage's gradient buckets without ZeRO and FSDP parameters (a hand-edited plan may
    list them; their gradients are reduce-scattered, `_scatter_zero` / `runtime.fsdp`)."""
    skip = set(stage.zero_params) | set(stage.fsdp_params)
    buckets = ([p for p in b if p not in skip] for b in stage.grad_buckets)
    return [b for b in buckets if b]


class PipelineRunner:
    """Runs training steps of `plan` on this rank (module docstring).

    `graph` is the model traced on one micro-batch (``plan.global_batch // plan.num_microbatches``
    rows) with the dtype it trains in; node names must be the plan's. With ``compile`` (default)
    each executor runs its stage through AOTAutograd-compiled graphs (`runtime.compiled`) where it
    can, eagerly where it cannot (recomputed layers). ``chunks`` are the stages
    this rank runs (one, or the ``v`` chunks of its device group when interleaved), each with its
    own `PlanExecutor` in ``executors``; ``index`` and ``executor`` are the first of them.
    """

    uses_torch_pipelining = False

    def __init__(
        self,
        plan: ParallelPlan,
        graph: OpGraph,
        *,
        device_type: str = "cpu",
        schedule: str | None = None,
        compile: bool = True,
    ) -> None:
        self.plan, self.graph = plan, graph
        interleaved = plan.virtual_stages > 1
        default = plan.schedule if plan.schedule in ("gpipe", "zero_bubble") else "1f1b"
        self.schedule = schedule or ("interleaved" if interleaved else default)
        if self.schedule == "zero_bubble" and len(plan.stages) == 1:
            self.schedule = "1f1b"  # one stage: no pipeline, nothing waits for a split
        if self.schedule not in SCHEDULES:
            raise MeshplanError(
                f"schedule {self.schedule!r} is not supported; use one of {SCHEDULES}"
            )
        if self.schedule == "zero_bubble" and not self.uses_torch_pipelining:
            raise MeshplanError(
                "the zero_bubble schedule runs on torch.distributed.pipelining only "
                "(runtime.torch_pipeline): this runner does not split backward into input "
                "and weight gradients"
            )
        if (self.schedule == "interleaved") != interleaved:
            raise MeshplanError(
                f"schedule {self.schedule!r} does not fit a plan with "
                f"{plan.virtual_stages} virtual stages (interleaved needs more than one)"
            )
        self.groups = _check_devices(plan, dist.get_world_size())
        self.rank = dist.get_rank()
        self.stages = split_stages(graph, plan)
        self.device = run_device(device_type)
        self.meshes = self._build_meshes(device_type)
        # boundary values travel in pieces, gathered within each stage (`runtime.boundary`)
        self._groups = boundary.stage_groups([s.devices for s in plan.stages])
        check_tied(self.stages, plan)
        self.tied = self._tied_copies(device_type)
        self.chunks = [i for i, s in enumerate(plan.stages) if self.rank in s.devices]
        self.index: int | None = self.chunks[0] if self.chunks else None
        fallback = {f.split(":")[0] for f in plan.fallback_ops}
        layer_of = layer_of_nodes(graph, plan)
        units = fsdp_units(graph, plan)  # FSDP's reduce-scatters paced per block
        self.executors: dict[int, PlanExecutor] = {}
        self._zero: dict[int, dict[str, tuple[Placement, ...]]] = {}
        for c in self.chunks:
            st, stage_plan = self.stages[c], plan.stages[c]
            self.executors[c] = PlanExecutor(
                st.graph,
                self._program(c, fallback),
                self.meshes[c],
                sync_param_grads=False,
                # blocks found in the whole model, as the planner prices it
                recompute_layers=recomputed(graph, stage_plan.recompute, layer_of),
                compile=compile,
                fsdp=shard_placements(st.graph, stage_plan, stage_plan.fsdp_params),
                layers=units,
            )
            self._zero[c] = {
                st.graph.placeholder_paths[n]: places
                for n, places in shard_placements(
                    st.graph, stage_plan, stage_plan.zero_params
                ).items()
            }
        self.executor: PlanExecutor | None = (
            None if self.index is None else self.executors[self.index]
        )
        # the gradient all-reduce buckets, launched in the last backward (`runtime.grad_overlap`)
        self.overlap = GradOverlap(
            {c: _all_reduced(plan.stages[c]) for c in self.chunks}
        )
        # ZeRO parameter path -> its shard placements (every chunk of this rank)
        self.zero_placements = {k: v for z in self._zero.values() for k, v in z.items()}
        if self.schedule == "zero_bubble":
            return  # torch's schedule orders (and validates) its own actions
        inputs = {st.index: set(st.inputs.values()) for st in self.stages}
        blocked = deadlock_free(
            [self._order(g, plan.num_microbatches) for g in range(self.groups)], inputs
        )
        if blocked:
            raise MeshplanError(
                f"the {self.schedule} order deadlocks on this plan (blocked: {blocked})"
            )

    def _build_meshes(self, device_type: str) -> list[DeviceMesh | None]:
        """One DeviceMesh per stage (`stage_mesh`), shared by the stages of a device group;
        every rank creates every mesh, in stage order. A subclass may build them otherwise
        (``None`` for the stages this rank does not run)."""
        meshes: dict[tuple, DeviceMesh] = {}
        for s in self.plan.stages:
            key = (tuple(s.devices), tuple(s.logical_mesh))
            if key not in meshes:
                meshes[key] = stage_mesh(s, device_type)
        return [
            meshes[tuple(s.devices), tuple(s.logical_mesh)] for s in self.plan.stages
        ]

    def _tied_copies(self, device_type: str) -> list[TiedCopy]:
        """This rank's copies of tied parameters and the process groups that sum their
        gradients (`runtime.grad_sync.sync_tied`): when the copies lie alike, the ``"tied"``
        dimension of a DeviceMesh shaped (copies, *stage mesh) over the holding stages' devices,
        else one group over all their devices. A copy per device group (its first chunk holding
        the parameter). Every rank creates every group, in the plan's order (collective over the
        world)."""
        out: list[TiedCopy] = []
        for path, stages in self.plan.tied_params.items():
            first: dict[int, int] = {}
            for i in stages:
                first.setdefault(i % self.groups, i)
            held = [self.plan.stages[i] for i in first.values()]
            if len(held) < 2:
                continue  # the chunks of one device group share their copy
            mine = next((s for s in held if self.rank in s.devices), None)
            copies = [
                (s.logical_mesh, s.param_placements[path], path in s.zero_params)
                for s in held
            ]
            if tied_copies_align(copies):
                shape = device_mesh_shape(tuple(held[0].logical_mesh))
                ranks = torch.tensor([s.devices for s in held], dtype=torch.int64)
                names = ("tied", *(f"stage{a}" for a in range(len(shape))))
                mesh = device_mesh(device_type, ranks.view(len(held), *shape), names)
                if mine is not None:
                    out.append(TiedCopy(path, mesh.get_group("tied"), True, False))
                continue
            union = sorted({r for s in held for r in s.devices})
            mesh = device_mesh(device_type, torch.tensor(union, dtype=torch.int64))
            if mine is not None:
                leader = self.rank == mine.devices[0]
                out.append(TiedCopy(path, mesh.get_group(), False, leader))
        return out

    def _program(self, c: int, fallback: set[str]) -> StageProgram:
        """The program chunk `c` runs (`runtime.stages.stage_program`)."""
        return stage_program(self.stages[c], self.plan.stages[c], fallback)

    def _order(self, group: int, B: int) -> list[Action]:
        """The (kind, chunk, micro-batch) actions of device group `group` in a step."""
        if self.schedule == "interleaved":
            return interleaved_order(group, self.groups, self.plan.virtual_stages, B)
        order = schedule_order(self.schedule, group, len(self.stages), B)
        return [(a, group, m) for a, m in order]

    @property
    def stage(self) -> StageGraph | None:
        """This rank's (first) stage (None for a rank outside the plan)."""
        return None if self.index is None else self.stages[self.index]

    def place_params(self, params: dict[str, torch.Tensor]) -> dict[str, DTensor]:
        """This rank's parameters (from full tensors by path; those of every chunk it runs) as
        DTensor leaves requiring grad: the optimizer's parameters. A ZeRO parameter is placed as
        its shard (`shard_placements`); `step` gathers it to the planned placement once per
        step."""
        out: dict[str, DTensor] = {}
        for c, ex in self.executors.items():
            # a tied parameter another chunk of this rank placed already: one copy, shared
            new = {p: params[p] for p in ex.opgraph.params if p not in out}
            out.update(ex.place_params({**new, **out}))
            shards = dict(self._zero[c])
            if ex.fsdp is not None:
                shards.update(
                    (ex.fsdp.paths[n], pl) for n, pl in ex.fsdp.shards.items()
                )
            for path, places in shards.items():
                if path not in new:
                    continue
                out[path] = redistribute(out[path].detach(), places).requires_grad_(
                    True
                )
        return out

    def _gather_zero(self, params: dict[str, DTensor]) -> dict[str, DTensor]:
        """The parameters the chunks compute with: ZeRO shards all-gathered to their planned
        placements (new leaves, whose gradients accumulate over the micro-batches)."""
        out, done = dict(params), set()
        for c, ex in self.executors.items():
            names = {v: k for k, v in ex.opgraph.placeholder_paths.items()}
            for path in self._zero[c]:
                if path in done:  # tied, in an earlier chunk: gathered already
                    continue
                done.add(path)
                want = ex.placements(ex._planned_output(names[path]))
                with comm_count.site(f"fwd:zero:{path}"):
                    full = redistribute(params[path].detach(), want)
                out[path] = full.requires_grad_(True)
        return out

    def _scatter_zero(
        self, params: dict[str, DTensor], used: dict[str, DTensor]
    ) -> None:
        """Reduce-scatter the accumulated gradient of every ZeRO parameter onto its shard."""
        for path in self.zero_placements:
            g = used[path].grad
            if g is None:
                continue
            with comm_count.site(f"bwd:zero:{path}"):
                params[path].grad = redistribute(g, params[path].placements)

    # ------------------------------------------------------------------ one step

    def step(
        self,
        params: dict[str, DTensor],
        microbatches: Sequence[Sequence[torch.Tensor]],
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch, then the parameters' gradient sync; the
        mean micro-batch loss (the global batch's loss), the same on every rank of the world, as
        a 0-dim tensor on this rank's device (nothing here waits for the device: ``float()`` of
        it does, after the caller has queued its optimizer step)."""
        B = len(microbatches)
        loss = torch.zeros((), device=self.device)
        if self.index is not None:
            orders = [self._order(g, B) for g in range(self.groups)]
            self._mail = Mailbox(self.rank, orders)
            self._state: dict[tuple[int, int], dict[str, Any]] = {}
            order = orders[self.index % self.groups]
            self.overlap.arm(params, B)
            used = self._gather_zero(params) if self.zero_placements else params
            for action, c, m in order:
                if action == "F":
                    out = self._forward(c, m, microbatches[m], used, buffers or {}, B)
                    if out is not None:
                        loss += out
                else:
                    self._backward(c, m)
            self._mail.close()
            self._state = {}
            self._finish_grads(params, used)
        dist.broadcast(loss, src=self.plan.stages[-1].devices[0])
        return loss / B

    def _finish_grads(
        self, params: dict[str, DTensor], used: dict[str, DTensor]
    ) -> None:
        """After the last backward of a step: reduce-scatter the ZeRO parameters' gradients
        onto their shards, wait for the gradient buckets (`runtime.grad_overlap`),
        synchronise the other parameters' accumulated gradients, then sum
        the tied parameters' copies' gradients across their stages."""
        if self.zero_placements:
            self._scatter_zero(params, used)
        self.overlap.finish()  # the buckets launched in backward, and any left
        for ex in self.executors.values():
            # FSDP gradients were reduce-scattered onto their shards in backward
            fsdp = set(ex.fsdp.paths.values()) if ex.fsdp is not None else set()
            if ex.fsdp is not None:
                ex.fsdp.finish()
            ex.sync_grads(
                {
                    k: params[k]
                    for k in ex.opgraph.params
                    if k in params and k not in self.zero_placements and k not in fsdp
                }
            )
        if self.tied:  # tied parameters: sum the copies' gradients across the stages
            sync_tied(params, self.tied)

    def _tag(self, m: int, value: str, dst: int, backward: bool) -> int:
        """The message tag of `value` of micro-batch `m` sent to (or, backward, from) chunk
        `dst`."""
        names = self._names()
        key = (m * len(names) + names[value]) * len(self.stages) + dst
        return key * 2 + int(backward)

    def _names(self) -> dict[str, int]:
        if not hasattr(self, "_value_ids"):
            vals = sorted({v for st in self.stages for v in st.inputs})
            self._value_ids = {v: i for i, v in enumerate(vals)}
        return self._value_ids

    def _forward(
        self,
        c: int,
        m: int,
        batch: Sequence[torch.Tensor],
        params: dict[str, DTensor],
        buffers: dict[str, torch.Tensor],
        B: int,
    ) -> torch.Tensor | None:
        ex, st = self.executors[c], self.stages[c]
        inputs = {}
        devices = self.plan.stages[c].devices
        for v, src in st.inputs.items():
            meta = st.meta(v).outputs[0]
            piece = boundary.empty_piece(
                meta.shape, getattr(torch, meta.dtype), len(devices), self.device
            )
            sender = self._peer(src, c, self.rank)
            with comm_count.site(f"fwd:{v}->p2p"):
                tag = self._tag(m, v, c, False)
                piece = self._mail.recv(piece, sender, tag, ("F", src, m))
            with comm_count.site(f"fwd:{v}->recv"):
                buf = boundary.assemble(piece, meta.shape, self._group(c))
            x = ex._place(buf, ex._planned_output(v))
            inputs[v] = (
                x.requires_grad_(True) if boundary.needs_grad(self.graph, v) else x
            )
        out = ex.run_outputs(params, batch, buffers, inputs=inputs, microbatch=m)
        state: dict[str, Any] = {"inputs": inputs}
        self._state[c, m] = state
        if st.is_last:
            loss = out[0] if isinstance(out, (list, tuple)) else out
            if any(not p.is_replicate() for p in loss.placements):
                with comm_count.site("fwd:output"):
                    loss = loss.redistribute(placements=[Replicate()] * ex.mesh.ndim)
            state["loss"] = loss / B
            # a tensor, not float(): that would wait for the device before backward is queued
            return loss.to_local().detach()
        sent = {}
        for (v, dsts), x in zip(st.outputs.items(), out):
            full = x
            if x.requires_grad:
                full = ex._move(
                    x, ("R",) * ex.n_axes, f"{v}->send", ex._planned_output(v)
                )
            else:
                full = redistribute(x, [Replicate()] * ex.mesh.ndim)
            sent[v] = full
            local = full.to_local()
            for t in dsts:
                dt = self.plan.stages[t].devices
                parts = boundary.pieces(local, len(dt))
                for r in dt:
                    if self._peer(c, t, r) == self.rank:
                        with comm_count.site(f"fwd:{v}->p2p"):
                            part = parts[boundary.piece_index(dt, r)]
                            tag = self._tag(m, v, t, False)
                            self._mail.send(part, r, tag, ("F", t, m))
        state["sent"] = sent
        return None

    def _group(self, c: int) -> dist.ProcessGroup | None:
        """The process group over chunk `c`'s devices (None for one device)."""
        return self._groups.get(tuple(sorted(self.plan.stages[c].devices)))

    def _peer(self, src_stage: int, dst_stage: int, dst_rank: int) -> int:
        """The rank of `src_stage` that sends to rank `dst_rank` of `dst_stage`."""
        ds, dt = (
            self.plan.stages[src_stage].devices,
            self.plan.stages[dst_stage].devices,
        )
        return ds[dt.index(dst_rank) % len(ds)]

    def _backward(self, c: int, m: int) -> None:
        ex, st = self.executors[c], self.stages[c]
        state = self._state.pop((c, m))
        if st.is_last:
            state["loss"].backward()
        else:
            outs, grads = [], []
            for v, dsts in st.outputs.items():
                full = state["sent"][v]
                if not boundary.needs_grad(self.graph, v):
                    continue
                meta = st.meta(v).outputs[0]
                total = None
                ds = self.plan.stages[c].devices
                for t in dsts:
                    buf = boundary.empty_piece(
                        meta.shape, getattr(torch, meta.dtype), len(ds), self.device
                    )
                    peer = self._peer(t, c, self.rank)
                    with comm_count.site(f"bwd:{v}->p2p"):
                        tag = self._tag(m, v, t, True)
                        buf = self._mail.recv(buf, peer, tag, ("B", t, m))
                    total = buf if total is None else total + buf
                if total is not None:  # the pieces' sum is a piece of the sum
                    with comm_count.site(f"bwd:{v}->send"):
                        total = boundary.assemble(total, meta.shape, self._group(c))
                if total is not None and full.requires_grad:
                    outs.append(full)
                    grads.append(
                        DTensor.from_local(
                            total, ex.mesh, full.placements, run_check=False
                        )
                    )
            if outs:
                torch.autograd.backward(outs, grads)
        for v, x in state["inputs"].items():
            if not boundary.needs_grad(self.graph, v):
                continue
            g = x.grad
            if g is None:
                local = torch.zeros(x.shape, dtype=x.dtype, device=self.device)
            else:
                with comm_count.site(f"bwd:{v}->recv"):
                    g = redistribute(g, [Replicate()] * ex.mesh.ndim)
                local = g.to_local()
            src = st.inputs[v]
            ds = self.plan.stages[src].devices
            parts = boundary.pieces(local, len(ds))
            for r in ds:
                if self._peer(c, src, r) == self.rank:
                    with comm_count.site(f"bwd:{v}->p2p"):
                        part = parts[boundary.piece_index(ds, r)]
                        tag = self._tag(m, v, c, True)
                        self._mail.send(part, r, tag, ("B", src, m))
