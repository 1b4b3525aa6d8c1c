"""`meshplan plan`, `meshplan manual` and `meshplan explain`: make, price and read parallel plans."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from cost_models.memory import OPTIMIZERS
from planner.collector import sparse_collections
from planner.commands.fmt import nbytes, param_count, table
from planner.vocab.plan_check import DTYPES, FSDP_MODES, RECOMPUTE_MODES
from planner.vocab.plan_file import ParallelPlan, StagePlan


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="built-in name (e.g. gpt-1.3b), spec (gpt:hidden=..,layers=..,heads=..) or pkg.module:factory",
    )
    p.add_argument(
        "--cluster",
        required=True,
        metavar="SPEC",
        help="HOSTSxDEVICESxDEVICE, e.g. 1x4xV100-16GB",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="measured profile (meshplan profile) for the cost models",
    )
    p.add_argument(
        "--batch",
        type=int,
        help="global batch size (default: the model's example batch)",
    )
    p.add_argument(
        "--memory",
        type=float,
        metavar="GIB",
        help="memory budget per device in GiB (default: the device's)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="training dtype (default: the one a Hugging Face config.json declares, else "
        "float16)",
    )
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="adam_mixed",
        help="optimizer whose state the memory estimate counts (default adam_mixed)",
    )
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search the fastest data/tensor/pipeline parallel plan",
        description="Plan MODEL on a cluster.",
    )
    _common(p)
    p.add_argument(
        "--microbatch-size",
        type=int,
        action="append",
        help="micro-batch size(s) to try, in rows of the global batch per micro-batch (default: "
        "powers of two up to 32, on one host up to 16 per device)",
    )
    p.add_argument(
        "--layers",
        type=int,
        help="number of layers to cluster the model into (default: automatic)",
    )
    p.add_argument(
        "--schedule",
        default="auto",
        choices=["auto", "1f1b", "interleaved", "gpipe", "zero_bubble"],
        help="pipeline schedule: auto (default: 1F1B and interleaved 1F1B with 2 to 8 chunks "
        "per device group searched, the faster kept), or one pinned: 1f1b, interleaved, gpipe, "
        "zero_bubble (torch's ScheduleInterleavedZeroBubble, backward split into input and "
        "weight gradients)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress messages on stderr (what is being traced and solved)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--intra-only",
        action="store_true",
        help="one stage over the whole cluster (intra-op search only)",
    )
    mode.add_argument(
        "--inter-only",
        action="store_true",
        help="pipeline stages with pure data parallelism inside each",
    )
    p.set_defaults(func=run_plan, exit_fast=True)

    m = sub.add_parser(
        "manual",
        help="price a Megatron-style dp x (cp) x tp x pp configuration",
        description="Price a manual configuration.",
    )
    _common(m)
    m.add_argument("--dp", type=int, required=True)
    m.add_argument("--tp", type=int, required=True)
    m.add_argument("--pp", type=int, required=True)
    nmb = m.add_mutually_exclusive_group(required=True)
    nmb.add_argument("--microbatches", type=int, help="number of micro-batches")
    nmb.add_argument(
        "--microbatch-size",
        type=int,
        help="rows of the global batch per micro-batch, as for `plan` (each data-parallel "
        "replica runs microbatch-size / dp of them)",
    )
    nmb.add_argument(
        "--micro-batch-size",
        type=int,
        dest="per_replica_microbatch",
        help="deprecated: rows per data-parallel replica (Megatron's --micro-batch-size); "
        "use --microbatch-size (rows per micro-batch, = this times --dp)",
    )
    m.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        choices=RECOMPUTE_MODES,
        help="recompute activations in backward: none (default), selective (only the "
        "attention cores), full (every transformer block on its own) or layer (each of "
        "the plan's layers whole); --recompute alone is full",
    )
    sp = m.add_mutually_exclusive_group()
    sp.add_argument(
        "--sp",
        dest="sp",
        action="store_const",
        const=True,
        help="sequence parallelism on the tensor-parallel axis (Megatron-SP: norms, dropouts "
        "and residual adds split along the sequence)",
    )
    sp.add_argument(
        "--no-sp",
        dest="sp",
        action="store_const",
        const=False,
        help="norms, dropouts and residual adds replicated on the tensor-parallel axis, as "
        "Megatron without sequence parallelism (default: placed at the least cost)",
    )
    m.add_argument(
        "--fsdp",
        choices=FSDP_MODES,
        default="none",
        help="shard parameter state over the data-parallel devices: zero2 (gradients and "
        "optimizer state, as Megatron-Core's distributed optimizer), full (FSDP: weights too) "
        "or hybrid (HSDP: inside each host, replicated across hosts; tp 1)",
    )
    m.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism: MoE expert weights split by experts over this many of the "
        "data-parallel devices (default 1: none; --ep DP: over all of them; fewer needs tp 1, "
        "as Megatron-Core's --expert-model-parallel-size)",
    )
    m.add_argument(
        "--schedule",
        choices=("1f1b", "gpipe", "interleaved", "zero_bubble"),
        default=None,
        help="pipeline schedule: 1f1b (default), gpipe, interleaved (the default with "
        "--virtual-stages > 1) or zero_bubble (backward split into input and weight "
        "gradients, torch's ScheduleInterleavedZeroBubble)",
    )
    m.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context parallelism: the sequence split over this many devices, attention on "
        "all-gathered keys and values (with dp > 1, one row per data-parallel replica per "
        "micro-batch; dp x cp x tp x pp = the devices)",
    )
    m.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        help="interleaved 1F1B with this many chunks per device",
    )
    m.add_argument(
        "--allow-oom",
        action="store_true",
        help="write the plan even when a stage does not fit in memory (manual.fits says so)",
    )
    m.set_defaults(func=run_manual, exit_fast=True)

    e = sub.add_parser(
        "explain", help="show a plan file: stages, placements and where the time goes"
    )
    e.add_argument("plan", help="a plan JSON file written by `meshplan plan --json`")
    e.add_argument(
        "--params",
        type=int,
        default=12,
        help="parameters to list per stage (default 12; 0 for all)",
    )
    e.set_defaults(func=run_explain)


def _cluster(args: argparse.Namespace) -> Cluster:
    profile = None
    if args.profile:
        from cost_models.profile import load_profile

        profile = load_profile(args.profile)
    return Cluster.from_spec(args.cluster, profile=profile)


def _dtype(args: argparse.Namespace) -> str | None:
    """``--dtype``, else the dtype a Hugging Face config.json declares, else None (the
    planner's default for a model given by name or spec, float16)."""
    from planner.models.hf import declared_dtype

    return args.dtype or declared_dtype(args.model)


def _budget(args: argparse.Namespace) -> float | None:
    if args.memory is not None and args.memory <= 0:
        raise MeshplanError(f"--memory must be positive GiB, got {args.memory}")
    return None if args.memory is None else args.memory * 2**30


def run_plan(args: argparse.Namespace) -> int:
    mode = (
        "intra-only" if args.intra_only else "inter-only" if args.inter_only else "auto"
    )
    # the search's sparse collections (`planner.collector`) from the start: importing torch
    # and the planner ran five collections of the oldest generation (0.33 s of gpt-39b's
    # 2.4 s before its search began), which collected next to nothing
    with sparse_collections():
        from planner.api import plan

        result = plan(
            args.model,
            _cluster(args),
            global_batch=args.batch,
            dtype=_dtype(args),
            memory_budget=_budget(args),
            schedule=args.schedule,
            microbatch_size=args.microbatch_size,
            num_layers=args.layers,
            optimizer=args.optimizer,
            mode=mode,
            progress=None
            if args.quiet
            else lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
        )
    print(summary(result))
    _write(result, args.json)
    return 0


def run_manual(args: argparse.Namespace) -> int:
    from planner.plans.manual import manual_plan

    if args.per_replica_microbatch is not None:
        args.microbatch_size = args.per_replica_microbatch * args.dp
        print(
            "meshplan: warning: --micro-batch-size (rows per data-parallel replica) is "
            "deprecated; use --microbatch-size (rows of the global batch per micro-batch): "
            f"here --microbatch-size {args.microbatch_size}",
            file=sys.stderr,
        )
    result = manual_plan(
        args.model,
        _cluster(args),
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        num_microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        global_batch=args.batch,
        recompute=args.recompute,
        sequence_parallel=args.sp,
        virtual_stages=args.virtual_stages,
        schedule=args.schedule,
        dtype=_dtype(args),
        optimizer=args.optimizer,
        memory_budget=_budget(args),
        allow_oom=args.allow_oom,
        fsdp=args.fsdp,
        context_parallel=args.cp,
        expert_parallel=args.ep,
    )
    print(summary(result))
    _write(result, args.json)
    return 0


def _write(result: ParallelPlan, path: str | None) -> None:
    if path:
        result.save(path)
        print(f"wrote {path}", file=sys.stderr)


def _sharded_state(s: StagePlan) -> str:
    """How many of the stage's parameters are FSDP- (ZeRO-3) or ZeRO-2-sharded, or "-"."""
    n = len(s.param_placements)
    parts = [
        f"{name} {len(ps)}/{n}"
        for name, ps in (
            ("FSDP", [p for p in s.fsdp_params if p not in s.fsdp_axes]),
            ("HSDP", list(s.fsdp_axes)),
            ("ZeRO-2", s.zero_params),
        )
        if ps
    ]
    return ", ".join(parts) or "-"


def summary(p: ParallelPlan) -> str:
    """The plan as a readable table."""
    head = (
        f"{p.kind} plan for {p.model['name']} ({param_count(p.model['params'])} params) on {p.cluster['spec']} "
        f"in {p.dtype}: "
        f"global batch {p.global_batch}, {p.num_microbatches} micro-batch"
        f"{'es' if p.num_microbatches != 1 else ''}, {p.schedule}"
        + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
    )
    rows = [
        [
            str(i),
            f"{s.layers[0]}-{s.layers[1]}",
            f"{s.submesh[0]}x{s.submesh[1]}",
            "x".join(map(str, s.logical_mesh)),
            s.dp_tp,
            s.recompute,
            _sharded_state(s),
            f"{s.time_s * 1e3:.2f}",
            nbytes(s.memory_bytes),
        ]
        for i, s in enumerate(p.stages)
    ]
    body = table(
        rows,
        [
            "stage",
            "layers",
            "submesh",
            "logical mesh",
            "dp x tp",
            "recompute",
            "sharded state",
            "ms / micro-batch",
            "memory / device",
        ],
    )
    est = p.estimate
    tail = (
        f"iteration {est.iteration_time_s:.3f} s, {est.tflops_per_device:.1f} TFLOP/s per device, "
        f"peak memory {nbytes(est.peak_memory_bytes)} per device"
        + ("" if p.kind == "manual" else f"; planned in {p.planner_time_s:.1f} s")
    )
    if p.fallback_ops:
        tail += f"\nreplicated (no DTensor rule): {len(p.fallback_ops)} ops, e.g. {p.fallback_ops[0]}"
    return f"{head}\n{body}\n{tail}"


def run_explain(args: argparse.Namespace) -> int:
    p = ParallelPlan.load(args.plan)
    print(summary(p))
    for i, s in enumerate(p.stages):
        print(
            f"\nstage {i}: layers {s.layers[0]}-{s.layers[1]} on devices {_ranks(s.devices)}, logical mesh {s.logical_mesh}"
        )
        print(
            f"  time per micro-batch {s.time_s * 1e3:.3f} ms (compute and resharding; gradient sync {s.grad_sync_s * 1e3:.3f} ms and optimizer step {s.optimizer_s * 1e3:.3f} ms per "
            f"iteration{'' if s.recompute == 'none' else f', recomputation {s.recompute}'}); memory {nbytes(s.memory_bytes)} per device"
        )
        layers = [p.layer_nodes[k] for k in range(s.layers[0], s.layers[1] + 1)]
        print(f"  layers span ops {layers[0][0]} .. {layers[-1][1]}")
        kinds = Counter(",".join(pl) for pl in s.param_placements.values())
        print(
            "  parameter placements: "
            + ", ".join(f"[{k}] x{v}" for k, v in kinds.most_common())
        )
        items = list(s.param_placements.items())
        shown = items if args.params == 0 else items[: args.params]
        for path, pl in shown:
            zero = (
                " +ZeRO"
                if path in s.zero_params
                else f" +HSDP{s.fsdp_axes[path]}"
                if path in s.fsdp_axes
                else " +FSDP"
                if path in s.fsdp_params
                else ""
            )
            print(f"    {path:<48} [{', '.join(pl)}]{zero}")
        if len(shown) < len(items):
            print(f"    ... {len(items) - len(shown)} more (--params 0 lists all)")
    return 0


def _ranks(devs: list[int]) -> str:
    return (
        f"{devs[0]}-{devs[-1]}"
        if devs == list(range(devs[0], devs[-1] + 1))
        else ",".join(map(str, devs))
    )
