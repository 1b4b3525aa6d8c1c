"""`meshplan profile`: measure this machine's devices and write a profile file for the cost models.

meshplan profile --nproc 4 --out profile.json            # full run (64 KiB .. 64 MiB, ~1-2 min)
meshplan profile --nproc 2 --out p.json --quick          # a few seconds' worth
meshplan profile --nproc 8 --out p.json --concurrent --op-overhead   # as the local suite measures
meshplan profile --show profile.json                     # summarise an existing file
"""

from __future__ import annotations

import argparse
import re

from cost_models.errors import MeshplanError
from cost_models.profile import (
    OVERHEAD_FIELDS,
    DeviceProfile,
    load_profile,
    save_profile,
)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'65536', '64K', '64KB', '64KiB', '4M', '1G' -> bytes (K = 1024: message sizes are powers of 2)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgKMGbB]?)(?:i?[bB])?\s*", text)
    if not m:
        raise MeshplanError(
            f"cannot read {text!r} as a byte size (e.g. 65536, 64K, 4MiB, 1G)"
        )
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `profile` command."""
    p = subparsers.add_parser(
        "profile",
        help="measure matmul throughput, memory bandwidth and collectives; write a profile",
        description=(
            "Measure matrix-product throughput, memory bandwidth and every collective "
            "(all_reduce, all_gather, reduce_scatter, all_to_all, send_recv) on NPROC local ranks "
            "(gloo on CPU, NCCL on GPUs), fit alpha-beta per (collective, world size), and write a "
            "profile file for `--profile`. Progress goes to stderr."
        ),
    )
    p.add_argument("--nproc", type=int, help="number of local ranks (1..8 with gloo)")
    p.add_argument(
        "--out", default="profile.json", help="file to write (default profile.json)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: sizes 64 KiB..4 MiB, 3 repeats, 3 matmul shapes",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_bytes,
        help="largest message (default 64MiB, 4MiB with --quick); accepts 64K, 4MiB, ...",
    )
    p.add_argument(
        "--repeats", type=int, help="timed repeats per measurement (median taken)"
    )
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), help="default: nccl if GPUs, else gloo"
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="measure matmul and bandwidth on every rank at once (a device is then one rank's "
        "share while all compute; for more ranks than cores)",
    )
    p.add_argument(
        "--op-overhead",
        action="store_true",
        help="also measure the runtime's fixed overheads per op, parameter tensor, micro-batch "
        "and step (CPU ranks), which the planner charges",
    )
    p.add_argument(
        "--op-model",
        action="append",
        default=[],
        metavar="SPEC",
        help="also time the non-GEMM ops (GELU, softmax, norms, attention) of this built-in "
        "model spec, priced from these rates by the planner (repeatable; e.g. "
        "gpt:hidden=128,layers=2)",
    )
    p.add_argument(
        "--op-batch",
        type=int,
        default=1,
        help="batch rows of --op-model's models (default 1)",
    )
    p.add_argument(
        "--show", metavar="FILE", help="summarise an existing profile instead"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure (or with --show, summarise) and print a summary."""
    from runtime.profiler import ProfileOptions, check_nproc, run_profile

    if args.show:
        print(summary(load_profile(args.show)))
        return 0
    if args.nproc is None:
        raise MeshplanError(
            "--nproc is required (number of local ranks to measure with)"
        )
    check_nproc(args.nproc, args.backend)
    if args.max_bytes is not None and args.max_bytes < 64 * 1024:
        raise MeshplanError(f"--max-bytes must be at least 64KiB, got {args.max_bytes}")
    if args.op_batch < 1:
        raise MeshplanError(f"--op-batch must be at least 1, got {args.op_batch}")
    for spec in args.op_model:
        from planner.models import build_model

        build_model(spec, batch=args.op_batch, device="meta")  # a bad spec fails now
    if args.repeats is not None and args.repeats < 1:
        raise MeshplanError(f"--repeats must be at least 1, got {args.repeats}")
    make = ProfileOptions.quick if args.quick else ProfileOptions.full
    opts = (
        make(args.nproc) if args.max_bytes is None else make(args.nproc, args.max_bytes)
    )
    if args.repeats is not None:
        opts.repeats = opts.matmul_repeats = args.repeats
    opts.backend = args.backend
    opts.concurrent_compute = args.concurrent
    opts.op_overhead = args.op_overhead
    opts.op_models = tuple(args.op_model)
    opts.op_batch = args.op_batch
    try:
        with open(args.out, "a", encoding="utf-8"):
            pass  # fail now, not after minutes of measuring
    except OSError as exc:
        raise MeshplanError(
            f"{args.out}: cannot write: {exc.strerror or exc}"
        ) from None
    profile = run_profile(opts)
    save_profile(profile, args.out)
    print(summary(profile))
    print(f"wrote {args.out}")
    return 0


def summary(profile: DeviceProfile) -> str:
    """A few lines: device, peak FLOP/s, bandwidth, and alpha / bandwidth / fit error per collective."""
    lines = [
        (
            f"device     {profile.device_name} x {profile.devices_per_host} "
            f"({profile.backend}, {profile.memory_bytes / 2**30:.1f} GiB each)"
        ),
        "peak       "
        + ", ".join(
            f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in profile.peak_flops.items()
        ),
        f"memory bw  {profile.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s",
        f"op overhead {profile.op_overhead_s * 1e6:.0f} us per op per micro-batch, "
        f"{profile.param_overhead_s * 1e6:.0f} us per parameter per micro-batch, "
        f"{profile.param_step_overhead_s * 1e6:.0f} us per parameter per step, "
        f"{profile.grad_byte_overhead_s * 1e9:.2f} ns per byte of gradient per step, "
        f"{profile.microbatch_overhead_s * 1e3:.2f} ms per micro-batch, "
        f"{profile.step_overhead_s * 1e3:.1f} ms per step"
        + (
            " (not measured)"
            if not any(getattr(profile, k) for k in OVERHEAD_FIELDS)
            else ""
        ),
        f"matmul     {len(profile.matmul)} samples",
    ]
    for r in profile.op_rates:
        per = "GFLOP" if r.unit == "flop" else "GB"
        back = "-" if r.backward_s is None else f"{r.backward_s * 1e9 * 1e3:.3f} ms"
        lines.append(
            f"op         {r.target}: {r.forward_s * 1e9 * 1e3:.3f} ms forward, {back} backward"
            f" per {per}"
        )
    if profile.collectives:
        lines.append(
            f"{'collective':<15}{'ranks':>5}{'alpha':>11}{'bandwidth':>12}{'segments':>9}"
            f"{'median err':>11}{'worst err':>10}"
        )
    for f in profile.collectives:
        errs = sorted(abs(f.predict(b) - s) / s for b, s in f.samples if s > 0) or [0.0]
        bw = 1 / f.beta_s_per_byte / 1e9 if f.beta_s_per_byte > 0 else float("inf")
        lines.append(
            f"{f.op:<15}{f.world_size:>5}{f.alpha_s * 1e6:>9.0f}us{bw:>8.2f}GB/s"
            f"{len(f.segments):>9}{errs[len(errs) // 2]:>10.0%}{errs[-1]:>10.0%}"
        )
    return "\n".join(lines)
