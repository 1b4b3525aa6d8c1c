"""A stage's DTensor program traced once by AOTAutograd and replayed as plain aten ops.

`runtime.executor.PlanExecutor` interprets a stage's aten graph op by op on DTensors: every op pays
DTensor's Python dispatch (sharding propagation, cache lookups, wrapping and unwrapping) and every
planned redistribution an autograd function (`runtime.redistribute.Edge`). On small per-device
work this overhead, not the arithmetic, sets the step time. `CompiledStage` removes it:

* **Trace once.** ``torch._functorch.aot_autograd.aot_function`` runs the executor's interpreter
  once on fake tensors with DTensor (a tensor subclass) inputs: AOTAutograd desugars the subclass,
  so DTensor's dispatch runs at trace time only, and records one forward and one backward fx
  graph of local aten ops plus functional collectives (``torch.ops._c10d_functional.*``, which is
  what DTensor's redistributions call). The backward graph is the traced autograd of the same
  program, `Edge`'s backward included, so the gradients and their collectives are the planned
  ones. The compilers are no-ops (``nop``, boxed): the graphs run as fx GraphModules, no Inductor.
* **Replay every step.** The result is an autograd-aware callable (AOTAutograd's
  ``CompiledFunction``) returning DTensors. DTensor leaves (parameters, received activations)
  go in as aliases of their local tensors and their gradients come back into the DTensor
  leaves' ``.grad`` with the placements the trace produced (`runtime.local_leaves`: without
  AOTAutograd wrapping every gradient per call), so gradient accumulation over micro-batches,
  `sync_grads` and the pipeline runner's per micro-batch forward / backward work unchanged.
* **Cache** one callable per input signature (`signature`: type, shape, stride, dtype,
  requires_grad and placements of every input, and the grad mode): ``aot_function`` itself
  compiles on its first call and never checks its inputs again.
* **Sites.** While tracing, `runtime.comm_count` copies the current site label into every new fx
  node's ``meta["custom"]``; the compilers wrap each collective in push / pop of its label
  (`runtime.comm_count.label_graph_sites`), so `runtime.comm_count.CommCounter` attributes the
  compiled graphs' collectives exactly as it does the eager executor's.

Random ops (dropout): with `runtime.dropout.DropoutMasks` attached, the executor passes each
random node's pre-drawn sample as an input of the traced function (`PlanExecutor._run_compiled`),
so the graphs contain no random op and replay the single-device masks; the ops that only shaped
the sample (``empty_like``) are dead and pruned. Without masks a random op stays in the forward
graph and draws from the default generator at every replay (AOTAutograd's
``functionalize_rng_ops`` is off), as the eager interpreter does.

Why ``aot_function`` rather than ``torch.compile``: ``torch.compile`` puts Dynamo (Python
bytecode capture of the interpreter, its dicts and hooks) in front of AOTAutograd and Inductor
behind it; we need neither, only the piece in the middle that traces through the DTensor subclass
and autograd once and hands back the graphs. (``torch.compile`` was not tried here.)

Not compiled (the caller falls back to the eager interpreter): stages with layers under activation
recomputation (``torch.utils.checkpoint``; tracing it is not attempted), and any stage whose
tracing fails (`CompiledStage.error` keeps the reason, e.g. an op that needs real data).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_compiler
from torch._functorch.partitioners import default_partition
from torch.distributed.tensor import DTensor

from runtime import comm_count
from runtime.local_leaves import LocalLeaves, is_leaf_input

__all__ = ["CompiledStage", "signature"]


def signature(values: Sequence[Any]) -> tuple:
    """What a traced graph assumes about its inputs: per input its type, shape, strides (of the
    local tensor for a DTensor), dtype, requires_grad (and for a DTensor whether it is a leaf)
    and placements; and the grad mode. Each
    input's part is a small int (`_entry_id`), so the key hashes fast."""
    return (*map(_entry_id, values), torch.is_grad_enabled())


# An input's signature part, interned as an int: a stage takes hundreds of parameters, the same
# objects on every call, and building and hashing their parts took ~2 ms a call on this machine
# (once per micro-batch and chunk). A DTensor leaf's part is kept with it, valid while it holds the
# same local tensor and spec objects and its requires_grad and is_leaf are unchanged.
_IDS: dict[tuple, int] = {}
# id(DTensor) -> (weakref to it, weakref to its local tensor, its spec, (requires_grad,
# is_leaf), part)
_KEPT: dict[int, tuple] = {}


def _entry_id(v: Any) -> int:
    """`v`'s part of the signature (see above)."""
    if isinstance(v, DTensor):
        kept = _KEPT.get(id(v))
        local, spec = v._local_tensor, v._spec
        if (
            kept is not None
            and kept[0]() is v
            and kept[1]() is local
            and kept[2] is spec
            and kept[3] == (v.requires_grad, v.is_leaf)
        ):
            return kept[4]
        entry: tuple = (
            DTensor,
            tuple(v.shape),
            tuple(local.stride()),
            v.dtype,
            (v.requires_grad, v.is_leaf),  # a leaf goes in as its alias (`LocalLeaves`)
            tuple(v.placements),
            id(v.device_mesh),
        )
        out = _IDS.setdefault(entry, len(_IDS))
        if v.is_leaf:  # parameters come back every call; a computed value never does
            key = id(v)
            ref = weakref.ref(v, lambda _, key=key: _forget(key))
            _KEPT[key] = (ref, weakref.ref(local), spec, (v.requires_grad, True), out)
        return out
    if isinstance(v, torch.Tensor):
        entry = (type(v), tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad)
    else:
        entry = (type(v), v)
    return _IDS.setdefault(entry, len(_IDS))


def _forget(key: int) -> None:
    """Drop a dead DTensor's kept part (unless the id was reused by a newer one)."""
    kept = _KEPT.get(key)
    if kept is not None and kept[0]() is None:
        del _KEPT[key]


def _keep(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination must keep `node` although nothing reads it: side effects,
    and every collective (all ranks run the same graph, but the plan priced them). Random ops
    whose result nobody reads go: they are the partitioner's dead copies (eager autograd never
    runs them)."""
    target = getattr(node.target, "namespace", "")
    return node.is_impure(impure_random=False) or target in (
        "_c10d_functional",
        "c10d_functional",
    )


def _prune(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` without dead nodes. AOTAutograd's default partitioner leaves dead forward ops in the
    backward graph: with ``aten._scaled_dot_product_flash_attention_for_cpu`` it re-runs every
    attention forward there and drops the result (measured: ~4 ms of a 110 ms step)."""
    if gm.graph.eliminate_dead_code(is_impure_node=_keep):
        gm.recompile()
    return gm


def tolerant_view(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``aten.view``, or the view of a contiguous copy where the real tensor's strides do not
    allow the view the trace made on fake tensors. Some ops' meta functions give their output other
    strides than their CPU kernels: ``softplus_backward``'s real output follows the gradient's
    layout, its fake one ``self``'s (torch 2.13), so a view of it that was valid at trace time
    fails at run time (Qwen3.5's gated delta rule: ``softplus(a)`` backward through a transpose).
    The same holds for a kernel that lays its output out by its inputs' strides (CPU flash
    attention), whose inputs' local layout under DTensor can differ from the trace's
    (FlexOLMo's attention output, viewed after a transpose). A graph after AOTAutograd is
    functional, and the executor's graph too, so a copy where the view cannot be is the same
    value; only a call that would fail changes. The copy is a contiguous clone, then the view:
    not ``aten.reshape``, which decides on a DTensor's global strides, and those can claim a
    layout its local tensor does not have."""
    try:
        return torch.ops.aten.view.default(x, size)
    except RuntimeError:
        copy = torch.ops.aten.clone.default(x, memory_format=torch.contiguous_format)
        return torch.ops.aten.view.default(copy, size)


def _tolerant_views(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with every ``aten.view`` run as `tolerant_view`."""
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    for n in views:
        n.target = tolerant_view
    if views:
        gm.recompile()
    return gm


def _forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """The no-op compiler, after pruning dead nodes, making views tolerant of strides
    (`tolerant_view`) and labelling the forward graph's collectives with their sites."""
    comm_count.label_graph_sites(_tolerant_views(_prune(gm)), backward=False)
    return gm


def _backward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """The no-op compiler, after pruning dead nodes, making views tolerant of strides
    (`tolerant_view`) and labelling the backward graph's collectives with their sites."""
    comm_count.label_graph_sites(_tolerant_views(_prune(gm)), backward=True)
    return gm


_BACKWARD = make_boxed_compiler(_backward_compiler)


class CompiledStage:
    """``run(*values)`` (the executor's interpreter over the stage graph's placeholders, in
    order) traced by AOTAutograd once per input signature (module docstring).

    ``compiled_calls`` counts the calls served by a compiled graph, ``compiles`` the traces. After
    a failed trace ``error`` holds the reason and `__call__` returns None from then on (the caller
    runs eagerly)."""

    def __init__(self, run: Callable[..., Any]) -> None:
        self.run = run
        self._fns: dict[tuple, tuple[Callable[..., Any], LocalLeaves]] = {}
        self.compiles = 0
        self.compiled_calls = 0
        self.error: str | None = None

    def __call__(self, values: Sequence[Any]) -> Any:
        """The outputs of ``run(*values)`` computed by the compiled graphs, or None when this
        stage cannot be compiled (``error``). DTensor leaves are passed as local aliases
        (`runtime.local_leaves`)."""
        if self.error is not None:
            return None
        key = signature(values)
        got = self._fns.get(key)
        if got is None:
            leaves = [i for i, v in enumerate(values) if is_leaf_input(v)]
            local = LocalLeaves(leaves, [values[i]._spec for i in leaves])
            while True:
                fn = self._aot(local)
                try:
                    out = fn(*local.substitute(values))  # traces, compiles, then runs
                except _Mismatch as m:
                    local = m.leaves
                    continue
                except Exception as exc:  # noqa: BLE001 - any tracing failure: run eagerly
                    self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    return None
                break
            self._fns[key] = (fn, local)
            self.compiles += 1
        else:
            fn, local = got
            out = fn(*local.substitute(values))
        self.compiled_calls += 1
        return out

    def _aot(self, local: LocalLeaves) -> Callable[..., Any]:
        """AOTAutograd's callable of ``run`` with `local`'s leaves as local aliases. Its forward
        compiler, called after the joint trace and before anything runs, stops the
        compilation (`_Mismatch`) when a leaf's gradient cannot be its alias's."""

        def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            retry = local.without_mismatched()
            if retry is not None:
                raise _Mismatch(retry)
            return _forward_compiler(gm, example_inputs)

        run = self.run
        return aot_function(
            lambda *xs: run(*local.wrap(xs)),
            fw_compiler=make_boxed_compiler(forward_compiler),
            bw_compiler=_BACKWARD,
            partition_fn=default_partition,
        )


class _Mismatch(Exception):
    """Trace again with `leaves` (`CompiledStage._aot`)."""

    def __init__(self, leaves: LocalLeaves) -> None:
        super().__init__("a leaf's gradient is split otherwise than the leaf")
        self.leaves = leaves
