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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from planner.intra.prices import Option

_COLUMN = (
    *("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias"),
    *("attn.q.weight", "attn.k.weight", "attn.v.weight"),  # Llama
    *("mlp.gate.weight", "mlp.up.weight"),
)
_ROW = ("attn.proj.weight", "mlp.proj.weight", "attn.o.weight", "mlp.down.weight")
_VOCAB = ("wte.weight", "lm_head.weight")
_EXPERT = ("mlp.wi", "mlp.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")

ParamFilter = Callable[[str, Option], bool]


class Seed(NamedTuple):
    """A Megatron layout as an intra-op restriction: the parameters' placements and the mesh axes
    on which activations split the batch (`planner.intra.solve.solve_stage`'s arguments)."""

    params: ParamFilter
    batch_axes: tuple[int, ...]


def megatron_placement(path: str) -> str:
    """Megatron's placement of a parameter on the tensor-parallel axis (module docstring)."""
    if path.endswith(_COLUMN) or path.endswith(_VOCAB):
        return "S(0)"
    if path.endswith(_ROW) or path.endswith(("mlp.wo", "mlp.w_down")):
        return "S(1)"
    if path.endswith(("mlp.wi", "mlp.w_gate", "mlp.w_up")):
        return "S(2)"
    return "R"


def is_expert_weight(path: str) -> bool:
    return path.endswith(_EXPERT)


def axes_filter(
    tp_axis: int | None,
    ep_axis: int | None,
    fsdp: bool = False,
    hybrid: tuple[int, ...] | None = None,
) -> ParamFilter:
    """Parameters placed by Megatron's rules on mesh axis `tp_axis` (None: no tensor parallelism),
    expert weights split by experts on `ep_axis` (None: no expert parallelism), replicated on the
    other axes, never ZeRO-sharded; with `fsdp`, always FSDP-sharded (ZeRO stage 3) instead, over
    every replicating axis, or with `hybrid` over those axes only (HSDP)."""
    if tp_axis is not None and tp_axis == ep_axis:
        raise ValueError(f"tensor and expert parallelism on the same axis {tp_axis}")

    def allowed(path: str, option: Option) -> bool:
        if option.zero != (3 if fsdp else 0) or option.shard_axes != hybrid:
            return False
        for axis, placement in enumerate(option.strategy.output[0]):
            if axis == tp_axis:
                want = megatron_placement(path)
            elif axis == ep_axis and is_expert_weight(path):
                want = "S(0)"
            else:
                want = "R"
            if placement != want:
                return False
        return True

    return allowed


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
) -> list[Seed]:
    """Megatron-style layouts worth solving on a logical mesh (a, b), one `Seed` each:

    * tensor parallelism on axis 1 (b devices, when b > 1 and b is in `tp_sizes`, the sizes that
      fit in a host) with data parallelism on axis 0 - Megatron's (dp, tp) = (a, b);
    * pure data parallelism (every parameter replicated) - Megatron's tp = 1 on all a * b devices;
    * for models with experts, each of those with the expert weights also split on the other axis
      of size > 1 (expert parallelism).

    * pure data parallelism with every parameter FSDP-sharded (ZeRO stage 3, as torchtitan runs
      FSDP over all devices; a model with a parameter the runtime cannot shard has no solution
      under it, and the search skips it); and where the mesh spans hosts (`hybrid`: the axes
      inside a host, `planner.intra.prices.hybrid_axes`) with every parameter HSDP-sharded
      over those (torchtitan's HSDP).

    Activations split the batch on the data-parallel axes (`batch_axes`). None on a single
    device (replication is then the only placement)."""
    a, b = mesh_shape
    if a * b == 1:
        return []
    out: list[Seed] = []
    tps = ([1] if b > 1 and b in tp_sizes else []) + [None]
    for tp in tps:
        axes = batch_axes(mesh_shape, tp, has_experts)
        out.append(Seed(axes_filter(tp, None), axes))
        if tp is None:
            out.append(Seed(axes_filter(None, None, fsdp=True), axes))
            if hybrid:
                out.append(Seed(axes_filter(None, None, True, hybrid), axes))
        if has_experts:
            free = [ax for ax, n in enumerate(mesh_shape) if n > 1 and ax != tp]
            if free:
                out.append(Seed(axes_filter(tp, free[-1]), axes))
    return out
