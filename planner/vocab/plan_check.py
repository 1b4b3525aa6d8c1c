"""The rules of a plan file, checked once where a plan is read (`ParallelPlan.from_json`).

`validate` runs the rules of `_RULES` in order and raises MeshplanError with one line naming the
first field that breaks one: ``<source>: <field path>: <what is wrong and what would be valid>``.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from typing import Any

from cost_models.errors import MeshplanError
from cost_models.memory import OPTIMIZERS, SCHEDULES, canonical_schedule

# A `planner.vocab.plan_file.ParallelPlan` (which reads through this module: not imported here).
Plan = Any

# Activation recomputation of a stage: none; selective (only the attention cores,
# `planner.tracing.attention`); full (each transformer block checkpointed on its own, as
# Megatron-LM and torchtitan do); layer (each of the plan's layers checkpointed whole);
# `planner.inter.full_recompute` prices the last two
RECOMPUTE_MODES = ("none", "selective", "full", "layer")
#: A manual plan's parameter-state sharding over its data-parallel replicas
#: (`planner.plans.manual.manual_plan`'s ``fsdp``).
FSDP_MODES = ("none", "zero2", "full", "hybrid")


def recompute_mode(value: object) -> object:
    """A stage's recomputation as one of `RECOMPUTE_MODES`: plan files of before the three modes
    say true (full) or false (none); anything else is returned as it is (for `validate` to name)."""
    if value is True:
        return "full"
    if value is False:
        return "none"
    return value


FORMAT_VERSION = 1
KINDS = ("auto", "manual", "intra-only", "inter-only")
DTYPES = ("float32", "float16", "bfloat16")


class Invalid(Exception):
    """A broken rule: the field's path and what is wrong (the caller adds the file)."""

    def __init__(self, path: str, msg: str) -> None:
        super().__init__(f"{path}: {msg}")


def show(v: Any) -> str:
    """`v` as the plan file writes it (JSON), shortened, for a one-line message."""
    s = json.dumps(v, default=repr)
    return s if len(s) <= 80 else s[:76] + " ..."


def _need(ok: bool, path: str, msg: str) -> None:
    if not ok:
        raise Invalid(path, msg)


def _expect(ok: bool, path: str, value: Any, expected: str) -> None:
    if not ok:
        raise Invalid(path, f"{show(value)} is not {expected}")


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_number(v: Any) -> bool:
    """A non-negative int or float (not NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _is_pair(v: Any, low: int, sizes: tuple[int, ...] = (2,)) -> bool:
    return (
        isinstance(v, (list, tuple))
        and len(v) in sizes
        and all(_is_int(x, low) for x in v)
    )


def as_list(v: Any, path: str, what: str) -> list:
    _expect(isinstance(v, list) and len(v) > 0, path, v, f"a non-empty list of {what}")
    return v


_PAIRS = ("layers", "submesh", "logical_mesh")  # StagePlan's tuple fields


def fields_of(cls: type, d: Any, path: str) -> dict[str, Any]:
    """The keyword arguments of dataclass `cls` from JSON object `d` at `path`: every field
    without a default present, no unknown key ("dp_tp" is derived, dropped), pairs as tuples."""
    _expect(isinstance(d, dict), path, d, "an object")
    known = {f.name: f for f in fields(cls)}
    at = f"{path}." if path else ""  # "" at the top level
    for key in d:
        _need(
            key in known or key == "dp_tp",
            at + str(key),
            f"unknown field; expected one of {', '.join(known)}",
        )
    for f in known.values():
        needed = f.default is MISSING and f.default_factory is MISSING
        _need(f.name in d or not needed, at + f.name, "missing")
    return {
        k: tuple(v) if isinstance(v, list) and k in _PAIRS else v
        for k, v in d.items()
        if k in known
    }


def check_version(v: Any) -> None:
    _need(
        _is_int(v) and v == FORMAT_VERSION,
        "format_version",
        f"{show(v)} is not supported; this meshplan reads version {FORMAT_VERSION} plans "
        "(make the plan again with `meshplan plan`)",
    )


def _settings(p: Plan) -> None:
    """format_version, kind, dtype, optimizer, schedule, and the planner's own numbers."""
    check_version(p.format_version)
    for path, value, choices in (
        ("kind", p.kind, KINDS),
        ("dtype", p.dtype, DTYPES),
        ("optimizer", p.optimizer, tuple(OPTIMIZERS)),
    ):
        _expect(
            isinstance(value, str) and value in choices,
            path,
            value,
            f"one of {', '.join(choices)}",
        )
    try:
        canonical_schedule(p.schedule)
    except (MeshplanError, AttributeError):
        raise Invalid(
            "schedule",
            f"{show(p.schedule)} is not one of {', '.join(SCHEDULES)} (or an alias)",
        ) from None
    _expect(
        _is_number(p.planner_time_s),
        "planner_time_s",
        p.planner_time_s,
        "a number >= 0",
    )
    _expect(
        p.memory_budget_bytes is None or _is_number(p.memory_budget_bytes),
        "memory_budget_bytes",
        p.memory_budget_bytes,
        "null or a number >= 0",
    )
    _expect(
        p.manual is None or isinstance(p.manual, dict),
        "manual",
        p.manual,
        "null or an object",
    )
    _expect(
        isinstance(p.fallback_ops, list)
        and all(isinstance(x, str) for x in p.fallback_ops),
        "fallback_ops",
        p.fallback_ops,
        "a list of op names",
    )
    for key in ("iteration_time_s", "tflops_per_device", "peak_memory_bytes"):
        value = getattr(p.estimate, key)
        _expect(_is_number(value), f"estimate.{key}", value, "a number >= 0")


def _model_and_cluster(p: Plan) -> None:
    """The model's name, fingerprint and parameter count; the cluster's device counts."""
    _expect(isinstance(p.model, dict), "model", p.model, "an object")
    for key, ok, what in (
        ("name", isinstance(p.model.get("name"), str), "a string"),
        ("fingerprint", isinstance(p.model.get("fingerprint"), str), "a string"),
        ("params", _is_int(p.model.get("params")), "an int >= 0"),
    ):
        _expect(ok, f"model.{key}", p.model.get(key), what)
    _expect(isinstance(p.cluster, dict), "cluster", p.cluster, "an object")
    _expect(
        isinstance(p.cluster.get("spec"), str),
        "cluster.spec",
        p.cluster.get("spec"),
        "a string",
    )
    for key in ("num_devices", "hosts", "devices_per_host"):
        _expect(
            _is_int(p.cluster.get(key), 1),
            f"cluster.{key}",
            p.cluster.get(key),
            "a positive int",
        )


def _batches(p: Plan) -> None:
    """global_batch and num_microbatches >= 1, the one divisible by the other; virtual_stages >= 1."""
    for key in ("global_batch", "num_microbatches", "virtual_stages"):
        _expect(_is_int(getattr(p, key), 1), key, getattr(p, key), "a positive int")
    _need(
        p.global_batch % p.num_microbatches == 0,
        "global_batch",
        f"{p.global_batch} does not split into num_microbatches={p.num_microbatches} equal "
        "micro-batches (expected a multiple of it)",
    )


def _layer_nodes(p: Plan) -> None:
    """A non-empty list of [first op name, last op name] pairs."""
    for k, pair in enumerate(as_list(p.layer_nodes, "layer_nodes", "layers")):
        _expect(
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(x, str) for x in pair),
            f"layer_nodes[{k}]",
            pair,
            "a [first op name, last op name] pair of strings",
        )


def _stage_list(p: Plan) -> None:
    """A non-empty list of stages, p * v chunks with virtual_stages v; their scalar fields."""
    S, v = len(as_list(p.stages, "stages", "stages")), p.virtual_stages
    _need(
        S % v == 0,
        "stages",
        f"{S} stages do not split into chunks of virtual_stages={v} per device group "
        f"(expected a multiple of {v})",
    )
    for i, s in enumerate(p.stages):
        _expect(
            s.recompute in RECOMPUTE_MODES,
            f"stages[{i}].recompute",
            s.recompute,
            f"one of {', '.join(RECOMPUTE_MODES)} (true and false read as full and none)",
        )
        for key in (
            "time_s",
            "memory_bytes",
            "compute_s",
            "comm_s",
            "grad_sync_s",
            "optimizer_s",
        ):
            value = getattr(s, key)
            _expect(_is_number(value), f"stages[{i}].{key}", value, "a number >= 0")


def _layer_ranges(p: Plan) -> None:
    """Every layer in exactly one stage: [first, last] ranges in order from 0 to the last layer."""
    L, start = len(p.layer_nodes), 0
    for i, s in enumerate(p.stages):
        path = f"stages[{i}].layers"
        _expect(
            _is_pair(s.layers, 0) and s.layers[0] <= s.layers[1] < L,
            path,
            s.layers,
            f"[first, last] with 0 <= first <= last < {L} (the number of layer_nodes)",
        )
        after = f"right after stages[{i - 1}]" if i else "the first layer"
        _need(
            s.layers[0] == start,
            path,
            f"{show(s.layers)} starts at layer {s.layers[0]}, expected {start} ({after}); "
            "stages cover the layers in order, each in exactly one stage",
        )
        start = s.layers[1] + 1
    _need(
        start == L,
        f"stages[{len(p.stages) - 1}].layers",
        f"{show(p.stages[-1].layers)} ends at layer {start - 1}, but the last stage must end "
        f"at the last layer, {L - 1}",
    )


def _devices(p: Plan) -> None:
    """Distinct ranks of the cluster per stage; the first p = len(stages) / virtual_stages stages
    on disjoint devices, and chunk c >= p on the devices of chunk c % p (interleaving)."""
    D, groups = p.cluster["num_devices"], len(p.stages) // p.virtual_stages
    owner: dict[int, int] = {}
    for i, s in enumerate(p.stages):
        path = f"stages[{i}].devices"
        as_list(s.devices, path, "device ranks")
        for d in s.devices:
            _expect(
                _is_int(d) and d < D,
                path,
                d,
                f"a device of the cluster, which has {D} devices (0..{D - 1})",
            )
        dup = next((d for d in s.devices if s.devices.count(d) > 1), None)
        _need(dup is None, path, f"{show(s.devices)} names device {dup} twice")
        if i >= groups:
            first = p.stages[i % groups].devices
            _need(
                list(s.devices) == list(first),
                path,
                f"{show(s.devices)} differs from stages[{i % groups}].devices {show(first)}: "
                f"with virtual_stages={p.virtual_stages}, chunk {i} runs on the devices of "
                f"chunk {i % groups}",
            )
            continue
        shared = next((d for d in s.devices if d in owner), None)
        _need(
            shared is None,
            path,
            f"{show(s.devices)} shares device {shared} with stages[{owner.get(shared)}]; "
            "stages run on disjoint devices",
        )
        owner.update(dict.fromkeys(s.devices, i))


def _meshes(p: Plan) -> None:
    """submesh [hosts, devices per host] within the cluster and the logical_mesh (two or three
    axes), each with as many devices as the stage; data_parallel_axes are distinct axes of the
    mesh."""
    hosts, per_host = p.cluster["hosts"], p.cluster["devices_per_host"]
    for i, s in enumerate(p.stages):
        at = f"stages[{i}]"
        _expect(
            _is_pair(s.submesh, 1)
            and s.submesh[0] <= hosts
            and s.submesh[1] <= per_host,
            f"{at}.submesh",
            s.submesh,
            f"[hosts, devices per host] of positive ints within the cluster's [{hosts}, {per_host}]",
        )
        _expect(
            _is_pair(s.logical_mesh, 1, (2, 3)),
            f"{at}.logical_mesh",
            s.logical_mesh,
            "two or three positive ints",
        )
        n = len(s.devices)
        for key in ("submesh", "logical_mesh"):
            shape = getattr(s, key)
            _need(
                math.prod(shape) == n,
                f"{at}.{key}",
                f"{show(shape)} has {math.prod(shape)} devices, but the stage has {n} devices "
                f"{show(s.devices)}",
            )
        axes = s.data_parallel_axes
        _expect(
            isinstance(axes, list)
            and all(_is_int(a) and a < len(s.logical_mesh) for a in axes)
            and len(set(axes)) == len(axes),
            f"{at}.data_parallel_axes",
            axes,
            f"a list of distinct logical mesh axes (0 to {len(s.logical_mesh) - 1})",
        )


def _placements(p: Plan) -> None:
    """Parameter and node placements: one placement string per logical mesh axis (an input may
    be null, an output of no tensor []); zero_params are parameters of the stage."""
    # imported here: it imports torch, which reading a plan otherwise does not need
    from planner.vocab.placements import VALID, is_placement

    def check(pl: Any, path: str, n: int) -> None:
        if not isinstance(pl, (list, tuple)) or len(pl) != n:
            raise Invalid(
                path,
                f"{show(pl)} is not a list of {n} placements, one per logical mesh axis",
            )
        for a, x in enumerate(pl):
            if not is_placement(x):
                raise Invalid(
                    f"{path}[{a}]", f"{show(x)} is not a placement; expected {VALID}"
                )

    for i, s in enumerate(p.stages):
        at, n = f"stages[{i}]", len(s.logical_mesh)
        _expect(
            isinstance(s.param_placements, dict),
            f"{at}.param_placements",
            s.param_placements,
            "an object",
        )
        for name, pl in s.param_placements.items():
            check(pl, f"{at}.param_placements[{show(name)}]", n)
        _expect(
            isinstance(s.input_placements, dict),
            f"{at}.input_placements",
            s.input_placements,
            "an object",
        )
        for name, pl in s.input_placements.items():
            path = f"{at}.input_placements[{show(name)}]"
            check(pl, path, n)
            for a, x in enumerate(pl):
                if x.startswith("P"):
                    raise Invalid(
                        f"{path}[{a}]",
                        f"{show(x)}: a received value arrives reduced; expected R or S(d)",
                    )
        _expect(
            isinstance(s.zero_params, list),
            f"{at}.zero_params",
            s.zero_params,
            "a list",
        )
        for name in s.zero_params:
            _expect(
                isinstance(name, str) and name in s.param_placements,
                f"{at}.zero_params",
                name,
                "a parameter of the stage (a key of its param_placements)",
            )
        _expect(
            isinstance(s.fsdp_params, list),
            f"{at}.fsdp_params",
            s.fsdp_params,
            "a list",
        )
        for name in s.fsdp_params:
            _expect(
                isinstance(name, str)
                and name in s.param_placements
                and name not in s.zero_params,
                f"{at}.fsdp_params",
                name,
                "a parameter of the stage (a key of its param_placements) not in zero_params",
            )
        _fsdp_axes(s, at)
        _grad_buckets(s, at)
        _expect(
            isinstance(s.node_strategies, dict),
            f"{at}.node_strategies",
            s.node_strategies,
            "an object",
        )
        for node, st in s.node_strategies.items():
            path = f"{at}.node_strategies[{show(node)}]"
            _expect(
                isinstance(st, dict)
                and set(st) == {"inputs", "outputs"}
                and all(isinstance(st[k], list) for k in st),
                path,
                st,
                '{"inputs": [...], "outputs": [...]}',
            )
            for k, pl in enumerate(st["inputs"]):
                if pl is not None:
                    check(pl, f"{path}.inputs[{k}]", n)
            for k, pl in enumerate(st["outputs"]):
                if pl != []:
                    check(pl, f"{path}.outputs[{k}]", n)


def _tied(p: Plan) -> None:
    """A parameter is in the param_placements of several stages only when it is one tensor read
    by each of them (tied weights): then tied_params lists it with exactly those stages (two or
    more, ascending). Chunks of one device group hold one copy: they place it alike."""
    S = len(p.stages)
    _expect(
        isinstance(p.tied_params, dict),
        "tied_params",
        p.tied_params,
        "an object (parameter path -> the stages holding it)",
    )
    holders: dict[str, list[int]] = {}
    for i, s in enumerate(p.stages):
        for name in s.param_placements:
            holders.setdefault(name, []).append(i)
    for name, stages in p.tied_params.items():
        at = f"tied_params[{show(name)}]"
        _expect(
            isinstance(stages, list)
            and len(stages) >= 2
            and all(_is_int(i) and i < S for i in stages)
            and stages == sorted(set(stages)),
            at,
            stages,
            f"a list of two or more distinct stage indices (0..{S - 1}), ascending",
        )
        missing = next((i for i in stages if i not in holders.get(name, [])), None)
        _need(
            missing is None,
            at,
            f"names stages[{missing}], which has no placement for {show(name)} in its "
            "param_placements (every stage holding a tied parameter places its copy)",
        )
    for name, stages in holders.items():
        if len(stages) > 1 and p.tied_params.get(name) != stages:
            raise Invalid(
                f"stages[{stages[1]}].param_placements[{show(name)}]",
                f"also a parameter of stages[{stages[0]}]; a parameter may be in several "
                "stages only when it is one tensor read by each of them (tied weights), "
                f"listed in tied_params as {show({name: stages})}",
            )
    groups = S // p.virtual_stages
    for name, stages in p.tied_params.items():
        first: dict[int, int] = {}
        for i in stages:
            j = first.setdefault(i % groups, i)
            a, b = p.stages[j], p.stages[i]
            _need(
                a.param_placements[name] == b.param_placements[name]
                and (name in a.zero_params) == (name in b.zero_params),
                f"stages[{i}].param_placements[{show(name)}]",
                f"{show(b.param_placements[name])} differs from stages[{j}]'s "
                f"{show(a.param_placements[name])} (or only one shards it with ZeRO): chunks "
                "of one device group hold one copy of a tied parameter",
            )


def _fsdp_axes(s: Any, at: str) -> None:
    """fsdp_axes (hybrid sharding): parameters of fsdp_params -> a non-empty ascending list of
    distinct logical mesh axes of more than one device on which the parameter is replicated,
    leaving at least one such axis unsharded (sharded over all of them, it is plain FSDP)."""
    _expect(isinstance(s.fsdp_axes, dict), f"{at}.fsdp_axes", s.fsdp_axes, "an object")
    mesh = tuple(s.logical_mesh)
    for name, axes in s.fsdp_axes.items():
        path = f"{at}.fsdp_axes[{show(name)}]"
        _expect(name in s.fsdp_params, path, name, "a parameter listed in fsdp_params")
        pl = s.param_placements[name]
        free = [a for a, n in enumerate(mesh) if n > 1 and pl[a] == "R"]
        _expect(
            isinstance(axes, list)
            and axes
            and all(_is_int(a) for a in axes)
            and axes == sorted(set(axes))
            and set(axes) < set(free),
            path,
            axes,
            f"a non-empty ascending list of some but not all of the axes {free} (the mesh "
            f"axes of more than one device that replicate {name})",
        )


def _grad_buckets(s: Any, at: str) -> None:
    """grad_buckets: a list of non-empty lists of the stage's parameters (keys of its
    param_placements), each parameter in one bucket at most. (A ZeRO or FSDP parameter listed
    there, e.g. after a hand edit, is skipped by the runtime: its gradient goes its own way.)"""
    _expect(
        isinstance(s.grad_buckets, list), f"{at}.grad_buckets", s.grad_buckets, "a list"
    )
    seen: set[str] = set()
    for i, bucket in enumerate(s.grad_buckets):
        path = f"{at}.grad_buckets[{i}]"
        _expect(isinstance(bucket, list) and bucket, path, bucket, "a non-empty list")
        for name in bucket:
            _expect(
                isinstance(name, str)
                and name in s.param_placements
                and name not in seen,
                path,
                name,
                "a parameter of the stage (a key of its param_placements) in no other bucket",
            )
            seen.add(name)


# In order: a rule may rely on the types the rules before it checked.
_RULES = (
    _settings,
    _model_and_cluster,
    _batches,
    _layer_nodes,
    _stage_list,
    _layer_ranges,
    _devices,
    _meshes,
    _placements,
    _tied,
)


def validate(plan: Plan, source: str = "plan") -> None:
    """Check `plan` against every rule of a plan file (the docstrings of `_RULES`); raise
    MeshplanError with one line naming the first field that breaks one: ``<source>: <field
    path>: <what is wrong and what would be valid>``."""
    try:
        for rule in _RULES:
            rule(plan)
    except Invalid as exc:
        raise MeshplanError(f"{source}: {exc}") from None
