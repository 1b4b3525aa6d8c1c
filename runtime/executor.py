"""Execute a traced graph under one stage's planned shardings with DTensor (principles 1, 6, 7).

``run_graph(graph, program, mesh, params, batch)`` interprets ``graph.gm`` (the aten-level fx graph
of `planner.tracing.tracer.trace`) node by node on DTensors:

* Leaves. Parameters are placed as DTensors with their planned placements (`place_params`), leaves
  of autograd that require grad, so ``loss.backward()`` leaves their gradients in ``.grad`` as
  DTensors. Buffers, batch tensors and factory ops without tensor inputs (``aten.arange``) are
  created as plain tensors and placed the same way. Placing never communicates
  (``distribute_tensor(..., src_data_rank=None)``): every rank is assumed to hold the same full
  tensor (same seed, same batch), and keeps its own shard.
* Edges. Before a node runs, every DTensor input is moved to the placement the node's chosen
  strategy requires (``Strategy.inputs[k]``) by `Edge`, an autograd function whose forward is
  ``DTensor.redistribute`` and whose backward moves the gradient to the placement the planner
  prices for the producer (`planner.vocab.grads.expected_grad`: S(d) where the producer's output
  was S(d), else R). DTensor refuses S -> P; we go S -> R -> P, as `cost_models` prices it. A
  getitem of a multi-output op is an edge from the producer's output to the getitem's placement.
* Ops. The aten op runs on the DTensors; DTensor's dispatcher picks the output placement. When it
  differs from the planned output (it should not: the planner keeps the output DTensor's propagator
  picks), the executor records it in ``mismatches`` and redistributes to the planned placement (or
  raises with ``strict=True``). Ops that fell back to replication in the plan are registered with
  DTensor's ``replicate_op_strategy`` (`planner.vocab.dtensor_ext.register_fallback`), and the rules the
  planner added (CPU flash attention) with `planner.vocab.dtensor_ext.register_missing_rules`. On
  GPUs, ops traced as CPU kernels run as their CUDA equivalents (`runtime.device_ops`). Attention
  planned context-parallel (sequence split, `planner.vocab.context`) has no DTensor rule and runs
  as `runtime.context.context_attention`.
* Output. The loss is returned replicated; a partial loss (``P(avg)`` under data parallelism) is
  all-reduced first (one scalar, which the planner prices on the loss node:
  `planner.intra.prices.loss_reduction_time`).

Backward is plain autograd through DTensor ops and the `Edge` functions. Why an explicit edge
function instead of relying on ``DTensor.redistribute``'s own backward: the planner prices every
edge's gradient separately (`planner.intra.prices.edge_matrices`), from the placement the consumer's
backward hands back (`grad_from_consumer`) to ``expected_grad(src)``, including edges whose forward
needs no redistribution (a replicated weight used by a batch-sharded matmul: the data-parallel
gradient all-reduce). ``redistribute`` records no backward when src == dst, leaving a partial
gradient partial (DTensor would then reduce it only where a later op needs it, or never: the
``.grad`` of a replicated weight stays ``Partial``). The edge function makes the runtime perform
exactly the priced collectives.

What PyTorch lacks (why this module exists): there is no PyTorch API that runs an fx graph with a
placement per node. ``parallelize_module`` / ``ParallelStyle`` work per ``nn.Module`` (inputs and
outputs of modules, parameters of Linear/Embedding), not per aten op, and ``distribute_module``
only places parameters; DTensor then picks every op's output placement greedily, which need not be
the plan's. The closest piece, ``torch.distributed.tensor.experimental._tp_transform``
(``tensor_parallel_transformation``), rewrites an ExportedProgram for one 1D mesh from
colwise/rowwise styles of Linear weights, propagating the rest with DTensor's own choices: no
per-node placements and a 1D mesh only. So we interpret the graph ourselves.

Sites: the executor labels the current node / edge (`runtime.comm_count.site`) so that
`runtime.comm_count.CommCounter` can attribute every collective to a forward node, an edge's
forward or backward, or a node's backward (autograd pre-hooks on each node's ``grad_fn``).

Compiled mode (``compile=True``; `runtime.pipeline.PipelineRunner` and `runtime.train.Trainer` use
it): the interpretation above runs once per input signature, on fake tensors under AOTAutograd
(`runtime.compiled`), which records it as a forward and a backward graph of local aten ops and
functional collectives; later calls replay those graphs without DTensor dispatch or Python per
node. Same ops, same collectives at the same sites, same gradients (``tests/test_compiled.py``).
Layers under recomputation (`runtime.checkpointed`), and stages whose tracing fails, run eagerly
as described above.

Random ops (dropout): with a `runtime.dropout.DropoutMasks` attached (``masks``; `runtime.train.Trainer`
attaches one when the graph samples), `run_outputs` pre-fills the random nodes with this rank's
shards of the single-device samples of its micro-batch (``microbatch``) and skips the ops that only
shape them (``empty_like``): the eager interpreter skips pre-filled nodes; under recomputation the
sample is a segment input, so the recomputed forward reuses it; compiled, it is an input of the
AOTAutograd graphs, which contain no random op. Without masks every rank draws its own samples.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import Placement
from torch.fx.node import map_arg

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph
from planner.vocab.context import SDPA, context_axis
from planner.vocab.dtensor_ext import (
    placement_to_str,
    register_fallback,
    register_missing_rules,
    str_to_placement,
)
from planner.vocab.grads import expected_grad, grad_from_consumer
from planner.vocab.nested_views import VIEWS, nested_unflatten
from planner.vocab.placements import device_mesh_shape, fsdp_gradient, mesh_axes
from planner.vocab.strategy import StageProgram, consumed_output
from runtime import comm_count
from runtime.checkpointed import run_checkpointed
from runtime.compiled import CompiledStage, tolerant_view
from runtime.context import context_attention
from runtime.device_ops import device_targets
from runtime.differentiable import differentiable_targets
from runtime.fsdp import FsdpParams
from runtime.grad_sync import sync_grads
from runtime.meshes import device_mesh
from runtime.redistribute import Edge, redistribute, strided_writing, unmask
from runtime.vocab_embedding import (
    EMBEDDING,
    MASK,
    output_placements,
    vocab_axes,
    vocab_parallel_embedding,
)

if TYPE_CHECKING:
    from runtime.dropout import DropoutMasks

__all__ = ["PlanExecutor", "make_mesh", "place_params", "run_graph"]

Strs = tuple[str, ...]
VIEW = torch.ops.aten.view.default
_NOT_COMPILED = object()  # `_run_compiled`: this stage runs eagerly


def make_mesh(program: StageProgram, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh a program runs on: its logical mesh without the axes of size 1 (the planner
    derives strategies on that squeezed mesh, see `planner.intra.strategies`). Needs an initialised
    default process group of ``prod(program.mesh_shape)`` ranks."""
    shape = device_mesh_shape(program.mesh_shape)
    return device_mesh(device_type, torch.arange(math.prod(shape)).view(shape))


class PlanExecutor(torch.fx.Interpreter):
    """Runs ``graph.gm`` on DTensors placed as ``program`` plans on ``mesh`` (module docstring).

    ``mesh`` must be the program's logical mesh without its size-1 axes (`make_mesh`).
    ``mismatches`` lists, after a run, every node whose DTensor output placement differed from the
    plan (the executor redistributed it to the plan's).

    Recomputation: with ``recompute_layers`` (op node name -> layer index) the forward runs each
    layer's consecutive nodes under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): only the
    values that leave a layer are kept, and backward recomputes the layer's forward (its edges'
    redistributions included) before differentiating it.

    Gradient accumulation: with ``sync_param_grads=False`` the edges leaving parameters (and views
    of parameters, as `planner.intra.solve` counts them) do not redistribute their gradients, so the
    ``.grad`` of a replicated weight accumulates as a partial sum over the micro-batches; call
    `sync_grads` once after the last backward (the planner prices this synchronisation once per
    iteration).

    FSDP: ``fsdp`` (placeholder name -> the placements of its shard) are gathered around their
    use and reduce-scattered in backward (`runtime.fsdp.FsdpParams`), the reduce-scatters waited
    one unit of ``layers`` (op node name -> its FSDP unit, `runtime.stages.fsdp_units`) later; with ``recompute_layers``
    a segment's recomputed forward reads the backward's gathered copies (FSDP2 with activation
    checkpointing: gathered in forward, freed, gathered once more for recompute and backward).

    Compilation: with ``compile=True`` `run_outputs` runs the stage through AOTAutograd-traced
    graphs (module docstring) unless ``recompute_layers`` is given; ``last_run_compiled`` tells
    whether the last call did.

    Random ops: ``masks`` (set by `runtime.dropout.DropoutMasks.attach`) provides the random
    nodes' values per micro-batch (module docstring).
    """

    def __init__(
        self,
        graph: OpGraph,
        program: StageProgram,
        mesh: DeviceMesh,
        *,
        strict: bool = False,
        sync_param_grads: bool = True,
        recompute_layers: dict[str, int] | None = None,
        compile: bool = False,
        fsdp: dict[str, tuple[Placement, ...]] | None = None,
        layers: dict[str, int] | None = None,
    ) -> None:
        if graph.gm is None:
            raise MeshplanError("the op graph has no fx GraphModule to execute")
        super().__init__(graph.gm, garbage_collect_values=True)
        self.opgraph, self.program, self.mesh, self.strict = (
            graph,
            program,
            mesh,
            strict,
        )
        shape = tuple(program.mesh_shape)
        self.axes = mesh_axes(shape)
        want = device_mesh_shape(shape)
        if tuple(mesh.shape) != want:
            raise MeshplanError(
                f"plan for logical mesh {shape} runs on a DeviceMesh of shape {want} "
                f"(size-1 axes dropped), got {tuple(mesh.shape)}"
            )
        self.n_axes = len(shape)
        self.mismatches: list[str] = []
        self.sync_param_grads = sync_param_grads
        self.recompute_layers = recompute_layers
        self.param_derived = graph.param_derived()
        register_missing_rules()
        # scatters DTensor cannot differentiate: `runtime.differentiable`
        self._targets = differentiable_targets(graph.gm)
        self._targets |= device_targets(graph.gm, mesh.device_type)
        self._parsed: dict[Strs, tuple[Placement, ...]] = {}
        for n in graph.gm.graph.nodes:
            strategy = program.strategies.get(n.name)
            if n.op not in ("placeholder", "output") and strategy is None:
                raise MeshplanError(f"the plan has no strategy for node {n.name}")
            if (
                strategy is not None
                and strategy.source == "fallback"
                and isinstance(n.target, torch._ops.OpOverload)
            ):
                register_fallback(n.target, _on_meta(n))
            if n.target is SDPA and context_axis(strategy) is not None:
                # context parallelism: no DTensor rule, run by `runtime.context`
                out, lse = n.meta["val"][:2]
                self._targets[n] = context_attention(
                    self._targets.get(n, n.target),
                    mesh,
                    self.axes.index(context_axis(strategy)),
                    (out.stride(), lse.stride()),
                )
            if n.target is EMBEDDING and (
                axes := vocab_axes(strategy.inputs[0], strategy.output[0])
            ):
                # the table's gradient split like the table (`runtime.vocab_embedding`)
                self._targets[n] = vocab_parallel_embedding(
                    mesh,
                    graph.node(n.args[0].name).outputs[0].shape,
                    self._parse(strategy.inputs[0]),
                    output_placements(strategy.output[0], axes, self._parse),
                )
            if n.target is VIEW and n not in self._targets:
                # a view the trace made on fake tensors may not fit the local tensor's strides
                # here (a kernel that lays its output out by its inputs' strides: `tolerant_view`)
                self._targets[n] = tolerant_view
        # FSDP parameters (placeholder name -> shard placements; `runtime.fsdp`): eager only;
        # `layers` (op node name -> FSDP unit) paces their reduce-scatters
        # with recomputation, the recomputed forward gathers them again (`runtime.fsdp`)
        self.fsdp = FsdpParams(self, fsdp, layers, recompute_layers) if fsdp else None
        # their views too: the gradient on an edge leaving one goes to `fsdp_gradient` of its
        # placement (`_edge_plan`)
        self.fsdp_derived = graph.views_of(set(fsdp or ()), self.param_derived)
        self.compile = compile and recompute_layers is None and self.fsdp is None
        self._compiled: CompiledStage | None = None
        self.last_run_compiled = False
        self.masks: DropoutMasks | None = None
        self._shaping: dict[frozenset[str], list[torch.fx.Node]] = {}
        self._plans = {
            n: self._node_plan(n)
            for n in graph.gm.graph.nodes
            if n.op == "call_function"
        }

    def _parse(self, strs: Strs) -> tuple[Placement, ...]:
        """`placements`, memoised per string tuple."""
        got = self._parsed.get(strs)
        if got is None:
            got = self._parsed[strs] = self.placements(strs)
        return got

    def _try_parse(self, strs: Strs) -> tuple[Placement, ...] | None:
        try:
            return self._parse(strs)
        except ValueError:  # "P(mask)" / "P(norm)": not rebuildable from the string
            return None

    def _edge_plan(self, u: torch.fx.Node, v: torch.fx.Node, dst: Strs) -> tuple:
        """Everything `_edge` needs for edge u -> v, computed once: (dst placements, gradient
        placements or None, label, skip). ``skip``: the edge moves nothing in either direction as
        planned - the producer's planned output already is `dst`, and the gradient the consumer's
        backward hands back (`grad_from_consumer`, no partial) already is the one priced for the
        producer, or the gradient is left as it is - so no autograd function is needed (checked
        again at run time against the value's actual placements)."""
        src = self._planned_output(u.name, consumed_output(u, v))
        dst_pl = self._parse(dst)
        if u.name in self.fsdp_derived:
            # an FSDP parameter or a view of one: the gradient goes where its reduce-scatter
            # starts, every micro-batch (`planner.intra.fsdp_prices`: priced so)
            grad_dst = self._parse(fsdp_gradient(src, tuple(self.program.mesh_shape)))
            return dst_pl, grad_dst, f"{u.name}->{v.name}", False
        if v.target in VIEWS:  # DTensor unflattens a nested shard only strided-written
            axis = nested_unflatten(dst, self.program.strategies[v.name].output[0])
            if axis is not None:
                dst_pl = strided_writing(dst_pl, self.axes.index(axis))
        sync = self.sync_param_grads or u.name not in self.param_derived
        grad_strs = expected_grad(src)
        grad_dst = self._parse(grad_strs) if sync else None
        src_pl = self._try_parse(src)
        skip = src_pl is not None and src_pl == dst_pl
        if skip and sync:
            if u.name in self.param_derived:  # a leaf's .grad must end as planned
                return dst_pl, grad_dst, f"{u.name}->{v.name}", False
            strategy = self.program.strategies[v.name]
            got = grad_from_consumer(dst, strategy, tuple(self.program.mesh_shape))
            skip = tuple(got) == tuple(grad_strs) and not any(
                g.startswith("P") for g in got
            )
        return dst_pl, grad_dst, f"{u.name}->{v.name}", skip

    def _node_plan(self, n: torch.fx.Node) -> tuple:
        """(site label, getitem edge or None, input edges {k: (u, edge plan)}, planned outputs
        with their parsed placements)."""
        strategy = self.program.strategies[n.name]
        getitem = None
        edges: list[tuple[torch.fx.Node, tuple]] = []
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
            if strategy.inputs and strategy.inputs[0] is not None:
                getitem = self._edge_plan(n.args[0], n, strategy.inputs[0])
        else:
            for k, u in enumerate(n.all_input_nodes):
                if strategy.inputs[k] is not None:
                    edges.append((u, self._edge_plan(u, n, strategy.inputs[k])))
        outputs = tuple(
            (strs, self._try_parse(strs) if strs else None) for strs in strategy.output
        )
        return f"fwd:{n.name}", getitem, edges, outputs, f"bwd:{n.name}"

    # ------------------------------------------------------------------ placements

    def placements(self, strs: Strs) -> tuple[Placement, ...]:
        """Plan strings (one per logical-mesh axis) -> DTensor placements on the squeezed mesh."""
        if not self.axes:
            return (Replicate(),)
        return tuple(str_to_placement(strs[i]) for i in self.axes)

    def strings(self, placements: Sequence[Placement]) -> Strs:
        """DTensor placements -> plan strings (``"R"`` on size-1 axes)."""
        out = ["R"] * self.n_axes
        for i, p in zip(self.axes, placements):
            out[i] = placement_to_str(p) or repr(p)
        return tuple(out)

    def _place(self, t: torch.Tensor, strs: Strs) -> DTensor:
        return distribute_tensor(
            t.detach(), self.mesh, self._parse(strs), src_data_rank=None
        )

    def _planned_output(self, name: str, k: int = 0) -> Strs:
        return self.program.strategies[name].output[k]

    # ------------------------------------------------------------------ running

    def place_params(self, params: dict[str, torch.Tensor]) -> dict[str, DTensor]:
        """Parameters (by path) as DTensors with their planned placements, leaves requiring grad.
        Tensors that already are DTensors are kept as they are."""
        out = {}
        for name, path in self.opgraph.placeholder_paths.items():
            if path not in self.opgraph.params:
                continue
            if path not in params:
                raise MeshplanError(f"missing parameter {path}")
            t = params[path]
            if not isinstance(t, DTensor):
                t = self._place(t, self._planned_output(name)).requires_grad_(True)
            out[path] = t
        return out

    def run_plan(
        self,
        params: dict[str, torch.Tensor],
        batch: Sequence[torch.Tensor],
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> DTensor:
        """Forward pass; returns the loss as a replicated DTensor (call ``.backward()`` on it)."""
        out = self.run_outputs(params, batch, buffers)
        loss = out[0] if isinstance(out, (list, tuple)) else out
        if isinstance(loss, DTensor) and any(
            not p.is_replicate() for p in loss.placements
        ):
            with comm_count.site("fwd:output"):
                loss = loss.redistribute(placements=[Replicate()] * self.mesh.ndim)
        return loss

    def run_outputs(
        self,
        params: dict[str, torch.Tensor],
        batch: Sequence[torch.Tensor],
        buffers: dict[str, torch.Tensor] | None = None,
        inputs: dict[str, DTensor] | None = None,
        microbatch: int = 0,
    ) -> Any:
        """Forward pass returning the graph's outputs as they are (DTensors in their planned
        placements). ``inputs`` maps placeholder names to DTensors used as they are (a pipeline
        stage's received values: leaves that may require grad); the other placeholders are
        parameters (by path), ``"batch[i]"`` or buffers, placed per the plan. ``microbatch``:
        the index of `batch` in the step, whose random samples ``masks`` provides."""
        placed = self.place_params(params)
        buffers = buffers or {}
        inputs = inputs or {}
        env: dict[torch.fx.Node, Any] = {}
        for n in self.opgraph.gm.graph.nodes:
            if n.op != "placeholder":
                continue
            path = self.opgraph.placeholder_paths[n.name]
            if n.name in inputs:
                env[n] = inputs[n.name]
            elif path in placed:
                env[n] = placed[path]
            elif path.startswith("batch["):
                env[n] = self._place(
                    batch[int(path[6:-1])], self._planned_output(n.name)
                )
            elif path in buffers:
                env[n] = self._place(buffers[path], self._planned_output(n.name))
            else:
                raise MeshplanError(f"missing input {path}")
        if self.masks is not None:
            self._prefill(env, microbatch)
        if self.recompute_layers is not None:
            if self.fsdp is not None:
                with self.fsdp.forward(microbatch, env):
                    return run_checkpointed(self, env, microbatch)
            return run_checkpointed(self, env, microbatch)
        self.last_run_compiled = False
        if self.compile:
            out = self._run_compiled(env)
            if out is not _NOT_COMPILED:
                self.last_run_compiled = True
                return out
        if self.fsdp is not None:
            with self.fsdp.forward(microbatch, env):
                return self.run(initial_env=env, enable_io_processing=False)
        return self.run(initial_env=env, enable_io_processing=False)

    def _prefill(self, env: dict[torch.fx.Node, Any], microbatch: int) -> None:
        """Put the random nodes' samples of micro-batch `microbatch` (from ``masks``) into `env`,
        and None for the nodes that only feed them (never run)."""
        assert self.masks is not None
        got = self.masks.take(self, microbatch)
        if not got:
            return
        key = frozenset(got)
        if key not in self._shaping:
            skip = {n for n in self.opgraph.gm.graph.nodes if n.name in key}
            for n in reversed(self.opgraph.gm.graph.nodes):
                only_shapes = n.users and all(u in skip for u in n.users)
                if n.op == "call_function" and n not in skip and only_shapes:
                    skip.add(n)
            self._shaping[key] = [n for n in skip if n.name not in key]
        for n in self.opgraph.gm.graph.nodes:
            if n.name in got:
                env[n] = got[n.name]
        env.update(dict.fromkeys(self._shaping[key]))

    def _run_compiled(self, env: dict[torch.fx.Node, Any]) -> Any:
        """The graph's outputs from the stage traced once by AOTAutograd (`runtime.compiled`), or
        `_NOT_COMPILED` when the stage cannot be traced (the caller runs it eagerly). The graph's
        inputs are its placeholders and the pre-filled random samples (`_prefill`); the nodes
        pre-filled with None are skipped."""
        nodes = [n for n, v in env.items() if v is not None]
        skipped = [n for n, v in env.items() if v is None]
        if self._compiled is None:

            def interpret(*values: Any) -> Any:
                initial = dict(zip(self._inputs, values))
                initial.update(dict.fromkeys(self._skipped))
                return self.run(initial_env=initial, enable_io_processing=False)

            self._compiled = CompiledStage(interpret)
        self._inputs, self._skipped = (
            nodes,
            skipped,
        )  # read by `interpret` when it traces
        out = self._compiled([env[n] for n in nodes])
        return _NOT_COMPILED if out is None and self._compiled.error else out

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        label, getitem, edges, outputs, bwd_label = self._plans[n]
        comm_count.push_site(label)
        try:
            env = self.env
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
                src = env[n.args[0]]
                value = src[n.args[1]]
                if (
                    getitem is not None
                    and isinstance(value, DTensor)
                    and isinstance(src, (tuple, list))
                ):
                    value = self._edge(value, getitem)
                return value
            fsdp = self._fsdp_inputs(n)
            moved = {}
            for u, plan in edges:
                value = fsdp[u] if u in fsdp else env[u]
                if isinstance(value, DTensor):
                    moved[u] = self._edge(value, plan)
            moved = {**fsdp, **moved}
            if moved:
                args, kwargs = map_arg(
                    (n.args, n.kwargs), lambda a: moved.get(a, env[a])
                )
            else:
                args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a])
            out = self._targets.get(n, n.target)(*args, **kwargs)
            for u in fsdp:
                self.fsdp.done(u.name)
            return self._check_outputs(n, out, outputs, bwd_label)
        finally:
            comm_count.pop_site()

    def _fsdp_inputs(self, n: torch.fx.Node) -> dict[torch.fx.Node, DTensor]:
        """The gathered copies of the FSDP parameters node `n` reads (`runtime.fsdp`)."""
        if self.fsdp is None:
            return {}
        return {
            u: self.fsdp.value(u.name)
            for u in dict.fromkeys(n.all_input_nodes)
            if u.name in self.fsdp.shards
        }

    def _edge(self, x: DTensor, plan: tuple) -> DTensor:
        dst, grad_dst, label, skip = plan
        if x.requires_grad:
            if skip and x.placements == dst:
                return x
            return Edge.apply(x, dst, grad_dst, label)
        if x.placements == dst:
            return x
        with comm_count.site(f"fwd:{label}"):
            return redistribute(x, dst)

    def sync_grads(self, params: dict[str, DTensor]) -> None:
        """Bring every parameter's accumulated ``.grad`` to the parameter's placement, bucketed
        (`runtime.grad_sync.sync_grads`); for ``sync_param_grads=False``."""
        sync_grads(params)

    def _move(
        self, x: DTensor, dst: Strs, label: str, src: Strs, sync: bool = True
    ) -> DTensor:
        """Redistribute `x` to `dst`; its gradient goes back to ``expected_grad(src)`` (if `sync`)."""
        if x.requires_grad:
            grad_dst = self._parse(expected_grad(src)) if sync else None
            return Edge.apply(x, self._parse(dst), grad_dst, label)
        with comm_count.site(f"fwd:{label}"):
            return redistribute(x, self._parse(dst))

    def _check_outputs(
        self, n: torch.fx.Node, out: Any, planned: tuple, bwd_label: str
    ) -> Any:
        single = not isinstance(out, (tuple, list))
        items = [out] if single else list(out)
        for k, item in enumerate(items):
            if not isinstance(item, torch.Tensor) or k >= len(planned):
                continue
            strs, parsed = planned[k]
            if not strs:
                continue
            if not isinstance(item, DTensor):  # a factory op: no tensor inputs
                items[k] = self._place(item, strs)
                continue
            if parsed is None or item.placements != parsed:
                have = self.strings(item.placements)
                if have != strs and have != tuple(
                    "P" if s == MASK else s for s in strs
                ):  # "P(mask)" as "P": `runtime.vocab_embedding`'s output
                    msg = f"{n.name} ({n.target}) output {k}: DTensor gave {have}, plan {strs}"
                    if self.strict:
                        raise MeshplanError(msg)
                    if (
                        msg not in self.mismatches
                    ):  # a recomputed layer reports it again
                        self.mismatches.append(msg)
                    item = items[k] = self._move(item, strs, f"{n.name}.{k}", have)
            # P(mask) -> P at once (`runtime.redistribute.unmask` says why)
            item = items[k] = unmask(item)
            if item.grad_fn is not None:
                item.grad_fn.register_prehook(
                    lambda g, label=bwd_label: comm_count.set_site(label)
                )
        if single:
            return items[0]
        return type(out)(items) if isinstance(out, tuple) else items


def place_params(
    graph: OpGraph,
    program: StageProgram,
    mesh: DeviceMesh,
    params: dict[str, torch.Tensor],
) -> dict[str, DTensor]:
    """Parameters as DTensor leaves requiring grad with the planned placements; pass the result to
    `run_graph` and read ``.grad`` after ``loss.backward()``."""
    return PlanExecutor(graph, program, mesh).place_params(params)


def run_graph(
    graph: OpGraph,
    program: StageProgram,
    mesh: DeviceMesh,
    params: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, ...],
    *,
    buffers: dict[str, torch.Tensor] | None = None,
    strict: bool = False,
) -> DTensor:
    """Run the forward pass of ``graph`` as ``program`` plans it on ``mesh``; returns the loss
    (replicated DTensor). ``params`` maps parameter paths to full tensors (placed here, so their
    gradients are not reachable: use `place_params` first) or to DTensors from `place_params`."""
    return PlanExecutor(graph, program, mesh, strict=strict).run_plan(
        params, batch, buffers
    )


def _on_meta(n: torch.fx.Node) -> tuple[tuple, dict]:
    """(args, kwargs) of `n` with each input node's traced value as an empty meta tensor."""

    def meta(a: torch.fx.Node) -> Any:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    return map_arg(n.args, meta), map_arg(n.kwargs, meta)
