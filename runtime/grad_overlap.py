"""The data-parallel gradient all-reduce, bucket by bucket, overlapping the last backward.

The plan lists each stage's buckets (``StagePlan.grad_buckets``: parameter paths in launch order,
cut by `planner.inter.dp_overlap` at DDP's 25 MiB in the order their gradients complete in
backward). `GradOverlap` registers a post-accumulate-grad hook on every parameter of a bucket
(``Tensor.register_post_accumulate_grad_hook``, which fires once per backward after autograd
accumulated the leaf's ``.grad``). Over a step of B micro-batches a parameter's gradient is
final after its B-th accumulation (the last micro-batch's backward: the earlier ones only
accumulate); once every gradient of a bucket is final and the buckets before it are launched,
the bucket is launched: its gradients, grouped as `runtime.grad_sync.sync_grads` groups them
(same placements, dtype and all-reduce axes), are flattened into one tensor each and
all-reduced in place without waiting (``_c10d_functional.all_reduce_``; on NCCL it runs on
its own stream while backward goes on; a second axis waits for the first). `finish`, before
the optimizer step (`runtime.pipeline.PipelineRunner._finish_grads`), launches any bucket not
launched yet (a gradient accumulated without the hook, e.g. torch's zero-bubble weight pass,
or never produced), waits for all and sets the parameters' synchronised gradients; what no
bucket holds is synchronised after it as before (`runtime.grad_sync.sync_grads`).

Compiled stages (`runtime.compiled`) return every gradient at the end of their backward, so
their hooks fire together there: the same buckets, launched back to back after the
computation, as `planner.inter.dp_overlap` prices them (exposed).

What PyTorch lacks: DDP's Reducer buckets the gradients of one ``nn.Module``'s plain-tensor
parameters replicated over one process group; here a stage is an fx graph interpreted over
DTensors whose gradients are partial on some axes of a 2-D mesh and sharded on others, and
accumulated over micro-batches by a pipeline schedule (DDP's ``no_sync`` would be the analogue
of the earlier micro-batches): nothing in torch buckets those. The hook and the functional
collectives are PyTorch's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor

from runtime import comm_count
from runtime.grad_sync import _set_grads, _split, _take_grads
from runtime.redistribute import allreduce_axes

__all__ = ["GradOverlap"]


@dataclass
class _Bucket:
    paths: list[str]
    left: int = 0  # gradients not final yet this step
    launched: bool = False


@dataclass
class _InFlight:
    flat: torch.Tensor
    paths: list[str]
    shapes: list[torch.Size]
    metas: list[Any]
    mesh: Any
    placements: tuple


class GradOverlap:
    """The buckets of this rank's stages (chunk -> ``StagePlan.grad_buckets``; module
    docstring). Call `arm` at the start of every step, `finish` after its last backward."""

    def __init__(self, buckets: Mapping[int, Sequence[Sequence[str]]]) -> None:
        self.chunks: dict[int, list[_Bucket]] = {}
        self.owner: dict[str, _Bucket] = {}
        self.holders: dict[str, int] = {}
        for c, bs in sorted(buckets.items()):
            mine = []
            for b in bs:
                paths = []
                for p in b:
                    # a parameter two chunks of this rank read (tied): accumulated by both
                    # chunks' backward, reduced once, in the first chunk's bucket
                    self.holders[p] = self.holders.get(p, 0) + 1
                    if p not in self.owner:
                        paths.append(p)
                if paths:
                    bucket = _Bucket(paths)
                    mine.append(bucket)
                    for p in paths:
                        self.owner[p] = bucket
            self.chunks[c] = mine
        self._hooked: dict[str, Any] = {}  # path -> (param, handle)
        self._params: Mapping[str, DTensor] = {}
        self._count: dict[str, int] = {}
        self._expected: dict[str, int] = {}
        self._flight: list[_InFlight] = []
        # buckets launched from the hooks (during backward) in the last step, and at `finish`
        self.launched_in_backward = 0
        self.launched_at_finish = 0

    def arm(self, params: Mapping[str, DTensor], num_microbatches: int) -> None:
        """Before a step of `num_microbatches`: hook the parameters (once) and reset counts."""
        self._params = params
        for path in self.owner:
            p = params.get(path)
            if p is None:
                continue
            hooked = self._hooked.get(path)
            if hooked is None or hooked[0] is not p:
                if hooked is not None:
                    hooked[1].remove()
                handle = p.register_post_accumulate_grad_hook(self._hook_for(path))
                self._hooked[path] = (p, handle)
        self._count = dict.fromkeys(self.owner, 0)
        self._expected = {p: num_microbatches * self.holders[p] for p in self.owner}
        for bs in self.chunks.values():
            for b in bs:
                b.left, b.launched = len(b.paths), False
        self._flight = []
        self.launched_in_backward = self.launched_at_finish = 0

    def _hook_for(self, path: str) -> Any:
        def hook(_param: torch.Tensor) -> None:
            self._accumulated(path)

        return hook

    def _accumulated(self, path: str) -> None:
        if path not in self._count:
            return  # not armed (a backward outside a step)
        self._count[path] += 1
        if self._count[path] != self._expected[path]:
            return
        self.owner[path].left -= 1
        for bs in self.chunks.values():
            if self.owner[path] in bs:
                self._launch_ready(bs)
                break

    def _launch_ready(self, buckets: list[_Bucket]) -> None:
        """Launch, in order, the buckets whose gradients are all final (stopping at the first
        that is not: every rank launches them in the plan's order)."""
        for b in buckets:
            if b.launched:
                continue
            if b.left > 0:
                return
            self._launch(b)
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients per (placements, dtype, axes) and start their
        all-reduces (module docstring)."""
        bucket.launched = True
        params = self._params
        groups: dict[tuple, list[str]] = {}
        for path in bucket.paths:
            p = params.get(path)
            g = None if p is None else p.grad
            if not isinstance(g, DTensor) or g.placements == p.placements:
                continue
            if g.device_mesh != p.device_mesh:
                continue
            axes = allreduce_axes(g.placements, p.placements)
            if axes is None:
                continue  # left to `sync_grads` after `finish`
            key = (tuple(g.placements), tuple(p.placements), g.dtype, axes)
            groups.setdefault(key, []).append(path)
        for (g_pl, p_pl, _, axes), paths in groups.items():
            mesh = params[paths[0]].grad.device_mesh
            shapes = [params[k].grad._local_tensor.shape for k in paths]
            flat = torch.cat([params[k].grad._local_tensor.reshape(-1) for k in paths])
            metas = _take_grads(params, paths)  # the flat copy replaces them in memory
            with comm_count.site(f"bwd:sync:{paths[0]}"):
                for i, a in enumerate(axes):
                    if i:  # in place on the same tensor: one axis after the other
                        torch.ops._c10d_functional.wait_tensor(flat)
                    group = funcol._resolve_group_name((mesh, a))
                    torch.ops._c10d_functional.all_reduce_(
                        flat, g_pl[a].reduce_op, group
                    )
            self._flight.append(_InFlight(flat, paths, shapes, metas, mesh, p_pl))

    def finish(self) -> None:
        """After the step's last backward: launch what is left, wait for every bucket and set
        the parameters' synchronised gradients (module docstring)."""
        for bs in self.chunks.values():
            for b in bs:
                if not b.launched:
                    self._launch(b)
                    self.launched_at_finish += 1
        for f in self._flight:
            torch.ops._c10d_functional.wait_tensor(f.flat)
            _set_grads(
                self._params,
                f.paths,
                _split(f.flat, f.shapes),
                f.metas,
                f.mesh,
                f.placements,
            )
        self._flight = []
        self._count = {}
