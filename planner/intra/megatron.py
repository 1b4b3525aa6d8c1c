"""Megatron-LM's parameter placements, as parameter filters of the intra-op pass (`planner.intra.solve`).

Used twice: `planner.plans.manual` prices Megatron configurations with them, and the automatic planner
adds the same placements as seed solutions of its intra-op pass (`planner.inter.stage_table`), so that
every manual configuration of the benchmark grid is also in the automatic search space.

On the tensor-parallel axis (Megatron's rules, for the built-in GPT and MoE models):

    attention qkv (Llama: q, k, v) and MLP fc (gate, up) weights: by output features S(0)
    attention and MLP output projections (Llama: o, down): by input features     S(1)
    token embedding and LM head:                  split by vocabulary          S(0)
    MoE expert weights wi [E, h, f] / wo [E, f, h]: split by f                  S(2) / S(1)
    (Mixtral's w_gate and w_up [E, h, f] / w_down [E, f, h] alike)
    everything else (norms, routers):             replicated
    a split the shape does not allow evenly (a vocabulary that is not a multiple of tp, which
    Megatron pads to one):                        replicated

Hugging Face's Llama family (Llama, Mistral, Qwen, Gemma, ... and the attention, dense and
shared-expert MLPs of Mixtral, Qwen-MoE and DeepSeek) by the same rules: ``q/k/v_proj``,
``gate_proj`` and ``up_proj`` column, ``o_proj`` and ``down_proj`` row, ``embed_tokens`` the
token embedding. Its routers (``mlp.gate``) and its experts' fused tensors
(``mlp.experts.gate_up_proj`` / ``down_proj``, gate and up side by side, which a split by f
would not keep together) are replicated. Hugging Face's BERT family (BERT, RoBERTa, ELECTRA,
...) as Megatron's own BERT: ``attention.self.query/key/value`` and ``intermediate.dense``
column, ``attention.output.dense`` and ``output.dense`` row, ``word_embeddings`` (tied to the
masked-LM decoder) and the decoder's bias ``cls.predictions.bias`` by vocabulary. OPT's and
Phi's MLPs (``fc1`` column, ``fc2`` row), GPT-J's (``fc_in``, ``fc_out``), GPT-NeoX's and Bloom's
(``dense_h_to_4h``, ``dense_4h_to_h``), and the attention output of OPT (``self_attn.out_proj``)
and Phi (``self_attn.dense``), whose q, k and v are split, row. Not GPT-J's and MPT's
``attn.out_proj`` (one name; MPT's q, k and v are fused), nor GPT-2's and GPT-BigCode's ``c_fc``
and ``c_proj`` (GPT-2's are transposed ``Conv1D`` weights). Fused
projections (GPT-2's ``c_attn``, Falcon's ``query_key_value``, Phi-3's and CodeGen's
``qkv_proj``, Phi-3's and GLM-4's ``gate_up_proj``) have no rule: a split of the fused output
by features would not give each device whole heads of all three, or its gate and up columns
together, so they stay replicated (names match at a module boundary, `_named`).

DeepSeek-MoE (`planner.models.deepseek`) needs no rule of its own: its dense blocks are Llama's, and
a mixture block holds its shared experts as ``mlp.gate``/``mlp.up``/``mlp.down`` (column, column,
row, as Llama's MLP) and its routed experts as Mixtral's ``mlp.w_gate``/``w_up``/``w_down``.

On an expert-parallel axis (GShard / DeepSpeed-MoE) the expert weights are also split by experts,
S(0); every other parameter is replicated on every other axis (data parallelism, no ZeRO).

On a data-parallel axis Megatron (like DDP) also splits every activation by the batch: each rank
runs the whole layer on its own samples (`batch_axes`; `planner.intra.solve.solve_stage` then keeps
each value computed from the data S(0) on those axes). Left to itself the intra-op program may
instead split a replicated-weight layer by sequence or hidden features on such an axis, which the
cost model prices the same but which runs as extra redistributions.

Sequence parallelism (Korthikanti et al. 2022, Megatron-SP; `sequence_filter`): on the
tensor-parallel axis the ops between a row-parallel output (or the embedding) and the next
column-parallel input - norms, dropouts, residual adds - are split along the sequence, dim 1 of
their [batch, sequence, ...] outputs, S(1). The row-parallel output's partial sum then reaches
them by a reduce-scatter (P -> S(1)) instead of an all-reduce, and the column-parallel input is
all-gathered (S(1) -> R); the cost model prices those edges as it prices every other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from cost_models.errors import MeshplanError
from planner.intra.batch_split import data_nodes
from planner.intra.prices import Option, replicated_on
from planner.tracing.opgraph import OpGraph

_QKV = ("query", "key", "value")
_COLUMN = (
    *("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias"),
    *("attn.q.weight", "attn.k.weight", "attn.v.weight"),  # Llama
    *("mlp.gate.weight", "mlp.up.weight"),
    # Hugging Face's Llama family (Llama, Mistral, Qwen, Gemma, ..., and the attention, dense
    # and shared-expert MLPs of its mixtures of experts)
    *(f"{p}_proj.{w}" for p in ("q", "k", "v") for w in ("weight", "bias")),
    *("gate_proj.weight", "up_proj.weight"),
    # Hugging Face's BERT family (BERT, RoBERTa, ELECTRA, ...), as Megatron's own BERT
    *(f"attention.self.{p}.{w}" for p in _QKV for w in ("weight", "bias")),
    *("intermediate.dense.weight", "intermediate.dense.bias"),
    # the first MLP projection of OPT and Phi (fc1), GPT-J (fc_in), GPT-NeoX and Bloom
    *(
        f"{p}.{w}"
        for p in ("fc1", "fc_in", "dense_h_to_4h")
        for w in ("weight", "bias")
    ),
)
_ROW = (
    *("attn.proj.weight", "mlp.proj.weight", "attn.o.weight", "mlp.down.weight"),
    *("o_proj.weight", "down_proj.weight"),  # Hugging Face's Llama family
    "output.dense.weight",  # BERT's attention.output.dense and its MLP's output.dense
    *("fc2.weight", "fc_out.weight", "dense_4h_to_h.weight"),  # their second
    *("self_attn.out_proj.weight", "self_attn.dense.weight"),  # OPT's and Phi's o
)
# BERT's masked-LM head: the decoder is tied to word_embeddings, its bias is per token
_VOCAB = (
    *("wte.weight", "lm_head.weight", "embed_tokens.weight"),
    *("word_embeddings.weight", "cls.predictions.bias"),
)
#: Hugging Face's mixture-of-experts router (Mixtral, Qwen-MoE, DeepSeek: ``mlp.gate``, under
#: the causal LM's ``model.``), which the built-in Llama's column-parallel ``mlp.gate`` would
#: otherwise match: Megatron replicates routers
_HF_ROUTER = ("mlp.gate.weight", "mlp.gate.bias")
_EXPERT = ("mlp.wi", "mlp.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")

ParamFilter = Callable[[str, Option], bool]


class Seed(NamedTuple):
    """A Megatron layout as an intra-op restriction: the parameters' placements and the mesh axes
    on which activations split the batch (`planner.intra.solve.solve_stage`'s arguments)."""

    params: ParamFilter
    batch_axes: tuple[int, ...]
    # the tensor-parallel axis on which Megatron-SP splits the norms and residual adds along
    # the sequence (`sequence_filter`), or None
    sequence_axis: int | None = None
    # the axis on which every attention is context-parallel (`planner.intra.context`), or None
    context_axis: int | None = None
    # also its ZeRO-2 variant, Megatron-Core's distributed optimizer (`planner.intra.solve.
    # with_zero2`: every parameter a data-parallel axis replicates keeps its optimizer state
    # sharded there), made from the seed's own solution
    zero2: bool = False


def _named(path: str, names: tuple[str, ...]) -> bool:
    """Whether `path` ends with one of `names` at a module boundary: ``q_proj.weight`` names
    ``model.layers.0.self_attn.q_proj.weight``, not Phi-3's fused ``...qkv_proj.weight``
    (nor ``up_proj.weight`` its ``gate_up_proj.weight``)."""
    return ("." + path).endswith(_dotted(names))


@functools.cache
def _dotted(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("." + n for n in names)


def megatron_placement(path: str) -> str:
    """Megatron's placement of a parameter on the tensor-parallel axis (module docstring)."""
    if path.startswith("model.") and _named(path, _HF_ROUTER):
        return "R"
    if _named(path, _COLUMN) or _named(path, _VOCAB):
        return "S(0)"
    if _named(path, _ROW) or _named(path, ("mlp.wo", "mlp.w_down")):
        return "S(1)"
    if _named(path, ("mlp.wi", "mlp.w_gate", "mlp.w_up")):
        return "S(2)"
    return "R"


def is_expert_weight(path: str) -> bool:
    return _named(path, _EXPERT)


def axes_filter(
    tp_axis: int | None,
    ep_axis: int | None,
    fsdp: bool = False,
    hybrid: tuple[int, ...] | None = None,
    zero: tuple[int, ...] | None = None,
) -> ParamFilter:
    """Parameters placed by Megatron's rules on mesh axis `tp_axis` (None: no tensor parallelism),
    expert weights split by experts on `ep_axis` (None: no expert parallelism), replicated on the
    other axes, never ZeRO-sharded; with `fsdp`, always FSDP-sharded (ZeRO stage 3) instead, over
    every replicating axis, or with `hybrid` over those axes only (HSDP). With `zero` (the
    logical mesh's shape), ZeRO-2 instead: gradients and optimizer state sharded over the axes
    of more than one device that replicate the parameter, wherever there is one (Megatron-Core's
    distributed optimizer; `planner.intra.prices.replicated_on`)."""
    if tp_axis is not None and tp_axis == ep_axis:
        raise ValueError(f"tensor and expert parallelism on the same axis {tp_axis}")

    def placed(path: str, option: Option, rule: bool) -> bool:
        want = 3 if fsdp else 0
        if zero is not None and replicated_on(option.strategy, zero):
            want = 2
        if option.zero != want or option.shard_axes != hybrid:
            return False
        for axis, placement in enumerate(option.strategy.output[0]):
            if axis == tp_axis:
                want = megatron_placement(path) if rule else "R"
            elif axis == ep_axis and is_expert_weight(path):
                want = "S(0)"
            else:
                want = "R"
            if placement != want:
                return False
        return True

    def allowed(path: str, option: Option) -> bool:
        return placed(path, option, True)

    # what `allowed_options` allows a parameter the rule would split unevenly
    allowed.uneven = lambda path, option: placed(path, option, False)  # type: ignore[attr-defined]
    return allowed


def allowed_options(
    param_filter: ParamFilter, path: str, options: list[Option]
) -> list[int]:
    """The positions in `options` (a parameter's) that `param_filter` allows. Where an
    `axes_filter` allows none, because its rule would split the parameter unevenly (a
    vocabulary that is not a multiple of the tensor-parallel size, which Megatron pads; the
    planner splits only evenly), those with the parameter replicated on the tensor-parallel
    axis instead."""
    kept = [i for i, o in enumerate(options) if param_filter(path, o)]
    uneven = getattr(param_filter, "uneven", None)
    if not kept and uneven is not None:
        kept = [i for i, o in enumerate(options) if uneven(path, o)]
    return kept


def both_filters(f: ParamFilter, g: ParamFilter) -> ParamFilter:
    """The options both filters allow, keeping `g`'s fallback for uneven splits
    (`allowed_options`)."""

    def both(path: str, option: Option) -> bool:
        return f(path, option) and g(path, option)

    uneven = getattr(g, "uneven", None)
    if uneven is not None:
        both.uneven = lambda path, option: f(path, option) and uneven(path, option)  # type: ignore[attr-defined]
    return both


def batch_axes(
    mesh_shape: tuple[int, ...], tp_axis: int | None, has_experts: bool
) -> tuple[int, ...]:
    """Megatron's data-parallel axes: every axis of more than one device but the tensor-parallel
    one; () for models with experts: their expert tensors ([E, G, C, h]) carry the batch in
    dim 1, which a dim-0 rule cannot express, so their activations stay free."""
    if has_experts:
        return ()
    return tuple(a for a, n in enumerate(mesh_shape) if n > 1 and a != tp_axis)


def megatron_filter(tp: int, dp: int = 1, expert_parallel: bool = False) -> ParamFilter:
    """The filter of a Megatron configuration on a (dp, tp) logical mesh: tensor parallelism on
    axis 1 when tp > 1, expert parallelism on axis 0 when asked and dp > 1."""
    return axes_filter(1 if tp > 1 else None, 0 if expert_parallel and dp > 1 else None)


def seed_filters(
    mesh_shape: tuple[int, int],
    has_experts: bool,
    tp_sizes: set[int],
    hybrid: tuple[int, ...] = (),
    tensor_parallel_only: bool = False,
) -> list[Seed]:
    """Megatron-style layouts worth solving on a logical mesh (a, b), one `Seed` each (with
    `tensor_parallel_only`, only those with tensor parallelism on axis 1, and for models
    without experts only with sequence parallelism: two seeds where the mesh crosses hosts,
    against six):

    * tensor parallelism on axis 1 (b devices, when b > 1 and b is in `tp_sizes`, the sizes that
      fit in a host) with data parallelism on axis 0 - Megatron's (dp, tp) = (a, b); and the
      same with sequence parallelism (Megatron-SP, `sequence_filter`; for models without
      experts): its activations are leaner than the free activations' time optimum; and that
      with every weight also FSDP-sharded over axis 0 when a > 1 (torchtitan's 2D parallelism:
      llama3-405b on 512 H100s, whose best manual configuration is dp256 x tp2 with FSDP + SP);
    * pure data parallelism (every parameter replicated) - Megatron's tp = 1 on all a * b devices;
    * for models with experts, each of those with the expert weights also split on the other axis
      of size > 1 (expert parallelism);
    * each of these (Megatron's tensor parallelism only with sequence parallelism, for models
      without experts) also with ZeRO-2 over its data-parallel replicas where it has some
      (``Seed.zero2``: the optimizer state sharded, Megatron-Core's distributed optimizer;
      Megatron-Core publishes Mixtral 8x7B on 64 H100s as dp2 x ep8 with it, which fits in 80 GB
      only with the optimizer state sharded).

    * pure data parallelism with every parameter FSDP-sharded (ZeRO stage 3, as torchtitan runs
      FSDP over all devices; a model with a parameter the runtime cannot shard has no solution
      under it, and the search skips it); and where the mesh spans hosts (`hybrid`: the axes
      inside a host, `planner.intra.fsdp_prices.hybrid_axes`) with every parameter HSDP-sharded
      over those (torchtitan's HSDP).

    Activations split the batch on the data-parallel axes (`batch_axes`). None on a single
    device (replication is then the only placement)."""
    a, b = mesh_shape
    if a * b == 1:
        return []
    out: list[Seed] = []
    tps = [1] if b > 1 and b in tp_sizes else []
    if not tensor_parallel_only:
        tps.append(None)
    for tp in tps:
        axes = batch_axes(mesh_shape, tp, has_experts)
        # the distributed optimizer's variant where a data-parallel axis replicates the weights
        zero2 = tp is None or a > 1
        if not (tensor_parallel_only and not has_experts):
            # a dense model's TP gets the distributed optimizer with SP only (below)
            dist_opt = zero2 and (tp is None or has_experts)
            out.append(Seed(axes_filter(tp, None), axes, zero2=dist_opt))
        if tp is not None and not has_experts:
            # Megatron-Core's TP + SP (+ distributed optimizer)
            out.append(Seed(axes_filter(tp, None), axes, tp, zero2=zero2))
            if a > 1:  # torchtitan's FSDP x TP + SP: weights also sharded over dp
                out.append(Seed(axes_filter(tp, None, fsdp=True), axes, tp))
        if tp is None:
            out.append(Seed(axes_filter(None, None, fsdp=True), axes))
            if hybrid:
                out.append(Seed(axes_filter(None, None, True, hybrid), axes))
        if has_experts:
            free = [ax for ax, n in enumerate(mesh_shape) if n > 1 and ax != tp]
            if free:
                out.append(Seed(axes_filter(tp, free[-1]), axes, zero2=zero2))
    return out


def context_seeds(
    mesh_shape: tuple[int, int], has_experts: bool, tp_sizes: set[int]
) -> list[Seed]:
    """Context-parallel layouts worth solving on a logical mesh (a, b) (`manual_plan`'s
    ``context_parallel``): CP over all devices (a mesh with one axis of more than one device),
    its parameters replicated or FSDP-sharded over it (torchtitan's FSDP + CP); and, where both
    axes have more than one device, data parallelism on axis 0 with CP on axis 1 (the
    parameters replicated, with Megatron-Core's distributed optimizer as a variant, or
    FSDP-sharded over both axes), and where b is a tensor-parallel size, CP on axis 0 with
    Megatron's tensor parallelism on axis 1. None for models with experts. A seed is skipped
    where the graph cannot take it (`planner.intra.context.context_filter`: another number of
    rows per micro-batch than one per data-parallel device, no fused attention)."""
    a, b = mesh_shape
    if has_experts or a * b == 1:
        return []
    if a == 1 or b == 1:
        axis = 0 if b == 1 else 1
        return [
            Seed(axes_filter(None, None), (), context_axis=axis),
            Seed(axes_filter(None, None, fsdp=True), (), context_axis=axis),
        ]
    out = [Seed(axes_filter(1, None), (), context_axis=0)] if b in tp_sizes else []
    return out + [
        Seed(axes_filter(None, None), (0,), context_axis=1, zero2=True),
        Seed(axes_filter(None, None, fsdp=True), (0,), context_axis=1),
    ]


def _weight_placements(graph: OpGraph) -> dict[str, str]:
    """Op -> Megatron's tensor-parallel placement of the weight it reads ("R" ones left out):
    the ops that are column-parallel (S(0), and the vocabulary-split embedding and LM head) or
    row-parallel (S(1), S(2))."""
    root: dict[str, str] = {}  # parameter-derived value -> its parameter's path
    for n in graph.nodes:
        if n.op == "param":
            root[n.name] = graph.placeholder_paths[n.name]
        elif n.is_view and n.inputs and n.inputs[0] in root:
            root[n.name] = root[n.inputs[0]]
    out = {}
    for n in graph.ops:
        if n.is_view:
            continue
        for u in n.inputs:
            if u in root and megatron_placement(root[u]) != "R":
                out[n.name] = megatron_placement(root[u])
    return out


def sequence_parallel_nodes(graph: OpGraph) -> frozenset[str]:
    """The ops sequence parallelism splits along the sequence (module docstring): ops computed
    from the data that lead to a column-parallel op (the LM head included), neither a weight's
    op nor inside a tensor-parallel region (reached from a column-parallel op before any
    row-parallel one, and leading to a row-parallel one), no view (views follow their input),
    with an output of at least two dimensions. Found once per graph (every seed of every
    logical mesh asks, `planner.inter.stage_solves`)."""
    return graph.derived(
        "sequence_parallel_nodes", lambda: frozenset(_sequence_parallel_nodes(graph))
    )


def _sequence_parallel_nodes(graph: OpGraph) -> set[str]:
    weights = _weight_placements(graph)
    column = [
        n
        for n, p in weights.items()
        if p == "S(0)" and "embedding" not in graph.node(n).target
    ]
    row = [n for n, p in weights.items() if p in ("S(1)", "S(2)")]
    users: dict[str, list[str]] = {}
    for n in graph.ops:
        for u in n.inputs:
            users.setdefault(u, []).append(n.name)

    def closure(start: list[str], step) -> set[str]:
        seen, todo = set(start), list(start)
        while todo:
            for w in step(todo.pop()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    rows = set(row)  # a tensor-parallel region ends at its row-parallel op
    after_column = closure(column, lambda n: [] if n in rows else users.get(n, []))
    before_row = closure(row, lambda n: graph.node(n).inputs) - set(row)
    before_column = closure(column, lambda n: graph.node(n).inputs) - set(column)
    data = data_nodes(graph)
    return {
        n.name
        for n in graph.ops
        if n.name in before_column
        and n.name in data
        and n.name not in weights
        and not (n.name in after_column and n.name in before_row)
        and not n.is_view
        and n.outputs
        and len(n.outputs[0].shape) >= 2
    }


def sequence_filter(
    graph: OpGraph, tp_axis: int, tp: int, split: bool = True
) -> Callable[[str, Option], bool]:
    """Options of ops restricted to Megatron-SP on mesh axis `tp_axis` of `tp` devices: the
    `sequence_parallel_nodes` split by dim 1 there (their first output), every other op free.
    Raises MeshplanError when such an op's sequence does not divide by `tp`. With
    ``split=False``, Megatron without sequence parallelism instead: those ops replicated on
    `tp_axis` (the row-parallel output all-reduced)."""
    region = sequence_parallel_nodes(graph)
    want = "S(1)" if split else "R"
    for n in sorted(region) if split else ():
        shape = graph.node(n).outputs[0].shape
        if shape[1] % tp:
            raise MeshplanError(
                f"sequence parallelism splits dim 1 of op {n} {tuple(shape)} over tp={tp}; "
                "it does not divide"
            )

    def allowed(name: str, option: Option) -> bool:
        return name not in region or option.strategy.output[0][tp_axis] == want

    return allowed
