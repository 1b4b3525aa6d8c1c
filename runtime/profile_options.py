"""What `runtime.profiler` measures (`ProfileOptions`) and the helpers its steps share on a rank:
the rank's device, synchronising it, progress lines."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from cost_models.profile import COLLECTIVE_OPS
from planner.vocab.plan_file import ParallelPlan

KB = 1 << 10
MB = 1 << 20
DEFAULT_MATMUL_DIMS = (128, 512, 2048)
#: On a GPU a product fills its multiprocessors only at thousands of rows (an H100's 132 SMs take
#: 132 output tiles of 128 x 128 at a time), so the grid reaches the shapes of training's products.
GPU_MATMUL_DIMS = (128, 512, 2048, 8192)
QUICK_MATMUL_SHAPES = ((128, 128, 128), (512, 512, 512), (1024, 1024, 1024))


@dataclass
class ProfileOptions:
    """What to measure. `full()` / `quick()` give the CLI's two presets; tests shrink further."""

    nproc: int = 2
    world_sizes: list[int] | None = None  # None: 2..nproc
    ops: tuple[str, ...] = COLLECTIVE_OPS
    sizes: list[int] = field(default_factory=lambda: [64 * KB << i for i in range(11)])
    repeats: int = 5
    warmup: int = 1
    matmul_shapes: list[tuple[int, int, int]] | None = (
        None  # None: DEFAULT_MATMUL_DIMS grid
    )
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    matmul_repeats: int = 5
    matmul_budget_s: float = 0.3
    bandwidth_bytes: int = 256 * MB
    backend: str | None = None
    timeout_s: float = 1200.0
    progress: bool = True
    #: Every rank measures matmul and bandwidth at once (rank 0's figures are kept): a device is
    #: what one rank gets while all of them compute, as in data- or tensor-parallel training (on a
    #: CPU with fewer cores than ranks, the ranks time-share the cores). False: rank 0 alone.
    concurrent_compute: bool = False
    #: Measure the runtime's overheads per op, parameter, micro-batch and step (`runtime.overhead`;
    #: CPU ranks only).
    op_overhead: bool = False
    #: The plans `op_overhead` trains (`runtime.overhead.calibration_plans` for `nproc` ranks):
    #: None until `check_options` makes them, before the launch.
    calibration_plans: list[ParallelPlan] | None = None
    #: `op_overhead`'s (steps, warmup, repeats) for `runtime.overhead.measure_op_overhead`;
    #: None: its defaults (tests shrink them).
    calibration_rounds: tuple[int, int, int] | None = None
    #: Time a collective of w ranks on every group of w consecutive ranks at once (rank 0's
    #: group's figures are kept), as a mesh axis's groups all communicate at once in training.
    #: False: ranks 0..w-1 alone, the others idle (an upper bound on speed where the groups share
    #: cores or links).
    concurrent_collectives: bool = False
    #: Built-in model specs whose non-GEMM ops to time (`runtime.op_rates`), at a batch of
    #: `op_batch` rows, on the ranks that measure matmul; () measures none.
    op_models: tuple[str, ...] = ()
    op_batch: int = 1

    @staticmethod
    def full(nproc: int, max_bytes: int = 64 * MB) -> ProfileOptions:
        """64 KB .. max_bytes in powers of 2, 5 repeats, the full matmul grid."""
        return ProfileOptions(nproc=nproc, sizes=size_range(64 * KB, max_bytes, 2))

    @staticmethod
    def quick(nproc: int, max_bytes: int = 4 * MB) -> ProfileOptions:
        """64 KB .. max_bytes in powers of 2, 3 repeats, three square products."""
        return ProfileOptions(
            nproc=nproc,
            sizes=size_range(64 * KB, max_bytes, 2),
            repeats=3,
            matmul_shapes=list(QUICK_MATMUL_SHAPES),
            matmul_repeats=3,
            bandwidth_bytes=64 * MB,
        )


def size_range(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*factor, ... up to and including hi (at least [lo])."""
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def _log(opts: ProfileOptions, msg: str) -> None:
    if opts.progress:
        print(f"[profile] {msg}", file=sys.stderr, flush=True)


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _device() -> Any:
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
