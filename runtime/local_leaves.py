"""DTensor leaves handed to a compiled stage as their local tensors, their gradients handed back.

A compiled stage (`runtime.compiled`) is AOTAutograd's autograd-aware callable. Given DTensor
inputs, its runtime wrapper flattens every DTensor into its local tensor on each call and wraps
every DTensor gradient of its backward back into a DTensor (``DTensor.__tensor_unflatten__``);
autograd then accumulates each parameter's gradient through DTensor's dispatch (an ``add`` per
parameter and micro-batch after the first). A stage has hundreds of parameters, so that is
Python work per parameter on every call: on one rank of this machine, a 24-layer GPT of 293
parameters (hidden size 64, one thread), 146 ms a step with it and 138 ms without; on an H200,
the wrapping of the 294 gradients was the largest part of the host time profiled.

`LocalLeaves` removes it for the inputs that are autograd leaves (the parameters, a pipeline
stage's received activations): the compiled function takes an alias of each leaf's local tensor
(the same storage, a leaf requiring grad itself), and inside the traced function `_AsDTensor`
wraps it with the leaf's spec. `_AsDTensor`'s backward hands the local gradient back as it is
(no redistribution: a replicated weight's gradient stays partial, to be summed once per step
by `runtime.grad_sync` / `runtime.grad_overlap`, as with DTensor leaves) and records the
gradient's spec while AOTAutograd traces it. At run time, a post-accumulate-grad hook on the
alias moves each micro-batch's local gradient into the DTensor leaf's ``.grad`` (the first
wrapped with the recorded spec, the next ones added in place to its local tensor) and runs the
leaf's own post-accumulate-grad hooks (`runtime.grad_overlap` counts the accumulations there),
so everything after backward reads ``.grad`` of the DTensor leaves as before.

A leaf whose gradient the trace produces split otherwise than the leaf (a sharded weight that the
plan gathers before use gets a replicated gradient, sliced at the step's gradient sync) cannot
take it through an alias of its local shape: the compilation stops after the joint trace, before
anything runs, and the stage is traced again with that leaf a DTensor input
(`LocalLeaves.without_mismatched`, `runtime.compiled.CompiledStage`).

What PyTorch lacks: AOTAutograd has no mode that keeps a subclass input's local tensor as the
autograd leaf; DTensor's own ``from_local`` redistributes the gradient to the input's placements
in backward (an all-reduce per micro-batch for a replicated weight).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["LocalLeaves", "is_leaf_input"]


class _AsDTensor(torch.autograd.Function):
    """A local tensor as a DTensor with a given spec; backward returns the gradient's local
    tensor as it is and records the gradient's spec in ``slot[0]`` (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, spec: DTensorSpec, slot: list
    ) -> DTensor:
        ctx.slot, ctx.shape = slot, local.shape
        # a view, so that the DTensor is not the input object itself (as DTensor.from_local)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None, None]:
        ctx.slot[0] = grad._spec
        local = grad._local_tensor
        if local.shape != ctx.shape:
            # the gradient is split otherwise than the leaf (a sharded weight gathered before
            # use: its gradient arrives replicated): it cannot be the alias's gradient;
            # `LocalLeaves.without_mismatched` has it traced again as a DTensor input
            ctx.slot[1] = True
            return local.new_zeros(ctx.shape), None, None
        return local, None, None


def is_leaf_input(v: Any) -> bool:
    """Whether `v` is a DTensor leaf that autograd accumulates a gradient into."""
    return (
        isinstance(v, DTensor)
        and v.is_leaf
        and v.requires_grad
        and torch.is_grad_enabled()
    )


def _mover(leaf: weakref.ref, slot: list) -> Callable[[torch.Tensor], None]:
    """The hook on an alias: its gradient moved into the DTensor leaf's ``.grad``."""

    def hook(alias: torch.Tensor) -> None:
        g, alias.grad = alias.grad, None
        p = leaf()
        if p is None or g is None:
            return
        have, spec = p.grad, slot[0]
        if have is None:
            p.grad = DTensor(g, spec, requires_grad=False)
        elif isinstance(have, DTensor) and (have._spec is spec or have._spec == spec):
            have._local_tensor.add_(g)
        else:  # accumulated on another path (an eager micro-batch): DTensor adds them
            p.grad = have + DTensor(g, spec, requires_grad=False)
        # Tensor.register_post_accumulate_grad_hook keeps them here; autograd would have
        # run them after accumulating into the DTensor leaf
        for h in list((p._post_accumulate_grad_hooks or {}).values()):
            h(p)

    return hook


def _forget(aliases: dict, k: int, leaf: weakref.ref) -> None:
    """Drop alias `k` if it still belongs to `leaf` (gone now)."""
    if k in aliases and aliases[k][0] is leaf:
        del aliases[k]


class LocalLeaves:
    """The aliases of one compiled callable's leaf inputs, kept across calls (a parameter's alias
    is the same leaf on every micro-batch) and dropped with their DTensor leaf."""

    def __init__(self, indices: Sequence[int], specs: Sequence[DTensorSpec]) -> None:
        self.indices = list(indices)
        self.specs = list(specs)
        self.slots: list[list] = [[None, False] for _ in self.indices]
        self._aliases: dict[int, tuple[weakref.ref, weakref.ref, torch.Tensor]] = {}
        self.excluded = 0  # leaves left DTensor inputs (`without_mismatched`)

    def without_mismatched(self) -> LocalLeaves | None:
        """After AOTAutograd traced the backward: None when every leaf's gradient is split as
        the leaf is, else the leaves less those whose gradient is not (to trace again)."""
        bad = {k for k, slot in enumerate(self.slots) if slot[1]}
        if not bad:
            return None
        keep = [k for k in range(len(self.indices)) if k not in bad]
        out = LocalLeaves(
            [self.indices[k] for k in keep], [self.specs[k] for k in keep]
        )
        out.excluded = self.excluded + len(bad)
        return out

    def wrap(self, values: Sequence[Any]) -> list[Any]:
        """Inside the traced function: the aliases wrapped back into DTensors."""
        out = list(values)
        for k, i in enumerate(self.indices):
            out[i] = _AsDTensor.apply(out[i], self.specs[k], self.slots[k])
        return out

    def substitute(self, values: Sequence[Any]) -> list[Any]:
        """`values` with each leaf input replaced by its alias (made on first use)."""
        out = list(values)
        for k, i in enumerate(self.indices):
            p = values[i]
            got = self._aliases.get(k)
            if got is None or got[0]() is not p or got[1]() is not p._local_tensor:
                alias = p._local_tensor.detach().requires_grad_(True)
                alias.register_post_accumulate_grad_hook(
                    _mover(weakref.ref(p), self.slots[k])
                )
                got = (weakref.ref(p), weakref.ref(p._local_tensor), alias)
                self._aliases[k] = got
                # a leaf made anew each step (a ZeRO parameter's gathered copy) must not
                # keep its storage alive through its alias once it is gone
                weakref.finalize(p, _forget, self._aliases, k, got[0])
            out[i] = got[2]
        return out
