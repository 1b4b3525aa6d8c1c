"""Measure the devices of this machine and write a `DeviceProfile` (cost_models/profile.py).

One launch (`runtime.launch.launch`) of N ranks measures, in order:

1. matrix products on rank 0 alone (the other ranks wait in a barrier), over a grid of (m, n, k)
   shapes, for float32 and for bfloat16 / float16 when the device runs them; warm-up, then the
   fastest of the repeats (small products are looped so one repeat lasts at least ~1 ms), the
   shapes taking turns, one loop of each per round (`time_calls`); on a GPU the grid reaches 8192
   (`GPU_MATMUL_DIMS`) and the budget's probe is a 2048^3 product. The
   fastest, not the median: one process's kernel is only slowed by outside interference, and on a
   loaded 2-core machine a 1.5 ms product preempted for a ~4 ms scheduler slice in most repeats
   showed a median 3.7x its real time. A rank computes with the cores and threads it gets in
   training (the launcher binds rank r to its own `cores // nproc` cores, or one core round-robin
   when there are more ranks than cores), so on CPU a "device" is that share of the cores. Shapes
   whose predicted time exceeds `matmul_budget_s` are skipped: float16 on most CPUs runs without
   vector units at ~1-2 GFLOP/s and would take minutes.
2. memory bandwidth on rank 0: fastest copy of a large tensor, counting read + write bytes.
3. every collective for every world size w in `world_sizes` (sub-group of ranks 0..w-1; ranks outside
   it wait; with ``concurrent_collectives`` every group of w consecutive ranks at once) and message
   size: all_reduce, all_gather (all_gather_into_tensor), reduce_scatter (reduce_scatter_tensor;
   gloo in torch 2.13 runs it, so no emulation is needed) and all_to_all (all_to_all_single), each
   the functional collective (``_c10d_functional``) and its ``wait_tensor``, the path DTensor and
   the gradient buckets take; and send_recv (world size 2 only: the group's two ranks ping-pong
   with ``dist.send``/``recv``, one-way time = round trip / 2). Each call is timed on its own, as the
   runtime issues them: a sub-group barrier, the call, its wait; a call's time is the slowest
   rank's, and the sample is the median call (collectives vary between calls by themselves, from
   the ranks' mutual scheduling, so the median is their typical time;
   `runtime.profile_collectives._time_sizes`).
   Byte convention: see cost_models/profile.py (the full unsharded tensor for all_gather output /
   reduce_scatter input / all_reduce / all_to_all buffer; the per-rank message for send_recv).
   (`runtime.profile_collectives`.)

With ``concurrent_compute`` steps 1 and 2 run on every rank at once (rank 0's figures are kept;
see `ProfileOptions`; every loop starts at a barrier and lasts as many calls on every rank,
`_timer`), followed by the non-GEMM ops of ``op_models`` (`runtime.op_rates`); with
``op_overhead`` every rank then measures the runtime's overheads per op, parameter, micro-batch
and step (`runtime.overhead`, CPU ranks), under calibration plans that `check_options` makes
before the launch (`runtime.overhead.calibration_plans`: one child process of our CLI).

Then alpha and beta are fitted per (op, world size) with `fit_alpha_beta`, plus a continuous
piecewise-linear fit (`fit_segments`) where one line misses a sample by more than 20%: gloo's
all_gather / reduce_scatter grow ~4x per doubling above ~16 MiB here. Progress goes to stderr.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from cost_models.errors import MeshplanError
from cost_models.profile import (
    PROFILE_VERSION,
    CollectiveFit,
    DeviceProfile,
    MatmulSample,
    fit_alpha_beta,
    fit_segments,
)
from runtime.launch import MAX_LOCAL_RANKS_CPU, default_backend, launch, rank_cpu_sets
from runtime.profile_options import (  # noqa: F401 - KB, MB, size_range: re-exported
    DEFAULT_MATMUL_DIMS,
    GPU_MATMUL_DIMS,
    KB,
    MB,
    ProfileOptions,
    _device,
    _log,
    _sync,
    size_range,
)


def check_nproc(nproc: int, backend: str | None = None) -> None:
    """Raise MeshplanError unless `nproc` local ranks can run here (1..8 with gloo, 1..#GPUs with NCCL)."""
    if (backend or default_backend(nproc)) == "nccl":
        import torch

        limit, what = torch.cuda.device_count(), "GPUs"
    else:
        limit, what = MAX_LOCAL_RANKS_CPU, "gloo processes on one machine"
    if not 1 <= nproc <= limit:
        raise MeshplanError(
            f"--nproc must be between 1 and {limit} ({what}), got {nproc}"
        )


def time_call(
    fn: Callable[[], Any],
    repeats: int,
    warmup: int = 1,
    min_s: float = 1e-3,
    reduce: Callable[[list[float]], float] = min,
    agree: Callable[[list[int]], list[int]] = lambda counts: counts,
) -> float:
    """Seconds of one `fn()` call: warm-up, then `repeats` timed loops of >= `min_s` each, reduced
    with `reduce` (default the fastest: what the device can do when nothing else interferes);
    `agree` as for `time_calls`."""
    return time_calls([fn], repeats, warmup, min_s, reduce, agree=agree)[0]


def time_calls(
    fns: list[Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    min_s: float = 1e-3,
    reduce: Callable[[list[float]], float] = min,
    meet: Callable[[], None] = lambda: None,
    agree: Callable[[list[int]], list[int]] = lambda counts: counts,
) -> list[float]:
    """Seconds of one call of each of `fns`: each warmed up, then `repeats` rounds, a round being
    one timed loop of >= `min_s` of every fn in turn (`meet()` before each loop: the ranks'
    barrier when they measure at once), each fn's loops reduced with `reduce`. `agree` maps the
    calls per loop, one count per fn, to the counts every rank uses (`_agree_counts`).

    Rounds rather than one fn's loops back to back: this machine's speed dips for a few hundred
    milliseconds at a time (a 256x128x128 float32 product timed in 30 loops of 30 ms ran at
    146-164 GFLOP/s but for four loops in a row at 41-127), so back-to-back loops of one fn could
    all fall in one dip and leave that sample alone slow: in two profiles of one launch (2 ranks,
    3 loops per shape) the 1024x512x512 product measured 47 and 113 GFLOP/s while its neighbours
    agreed. Spread over the rounds, a dip costs each fn a loop or two, which the median leaves
    out."""
    inner = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        one = max(time.perf_counter() - t, 1e-9)
        inner.append(max(1, min(1000, int(min_s / one))))
    inner = agree(inner)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n, out in zip(fns, inner, times):
            meet()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            _sync()
            out.append((time.perf_counter() - t) / n)
    return [float(reduce(t)) for t in times]


def matmul_grid(opts: ProfileOptions, gpu: bool = False) -> list[tuple[int, int, int]]:
    """The (m, n, k) shapes to measure (``gpu``: the larger grid of a GPU)."""
    if opts.matmul_shapes is not None:
        return list(opts.matmul_shapes)
    d = GPU_MATMUL_DIMS if gpu else DEFAULT_MATMUL_DIMS
    return [(m, n, k) for m in d for n in d for k in d]


def _agree_min(x: float, concurrent: bool) -> float:
    """The smallest `x` over all ranks when they measure concurrently (so that they take the same
    branches and meet at the same barriers), else `x`."""
    if not concurrent:
        return x
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t)


def _agree_counts(counts: list[int]) -> list[int]:
    """The largest of each count over all ranks: ranks that measure at once run loops of the same
    length, so that every loop overlaps the other ranks' loops from barrier to end. With counts
    of their own (each from one call timed alone), a rank with fewer calls left its core to its
    neighbour for the rest of the neighbour's loop: with 4 ranks on 2 cores, six launches' profiles
    of 2026-11-30 had the 1024x128x128 float32 product at 49 to 131 GFLOP/s (one rank per core:
    ~110-130; two: ~50-60), and the fastest sample, the profile's float32 peak, at 55 to 131."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(counts, dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(c) for c in t.tolist()]


def _timer(opts: ProfileOptions) -> dict[str, Any]:
    """`time_call` settings. Alone: the fastest of >= 1 ms loops (module docstring). Concurrent:
    every rank barriers before each measurement, loops last >= 30 ms (many scheduler slices, so
    that time-sharing of cores shows in every loop), of as many calls on every rank
    (`_agree_counts`), and the median loop is taken."""
    if opts.concurrent_compute:
        return {"min_s": 0.03, "reduce": statistics.median, "agree": _agree_counts}
    return {}


def _meet(opts: ProfileOptions) -> None:
    if opts.concurrent_compute:
        import torch.distributed as dist

        dist.barrier()


def measure_matmul(opts: ProfileOptions) -> list[MatmulSample]:
    """Time (m x k) @ (k x n) for every shape and supported dtype on this process's device."""
    import torch

    dev = _device()
    shapes = matmul_grid(opts, gpu=dev.type == "cuda")
    # the probe's size: one a GPU's launch latency does not dominate
    p = 2048 if dev.type == "cuda" else 256
    samples: list[MatmulSample] = []
    for dtype_name in opts.dtypes:
        dtype = getattr(torch, dtype_name)
        try:  # supported at all? and how fast, to skip shapes over budget
            a = torch.randn(p, p, device=dev).to(dtype)
            probe = time_call(lambda a=a: a @ a, repeats=1, warmup=1)
        except RuntimeError:
            probe = float("inf")
        probe = -_agree_min(-probe, opts.concurrent_compute)  # the slowest rank's
        if probe == float("inf"):
            _log(opts, f"matmul {dtype_name}: not supported on {dev}, skipped")
            continue
        probe_rate = 2 * p**3 / probe
        timed = []
        for m, n, k in shapes:
            predicted = 2 * m * n * k / probe_rate * (opts.matmul_repeats + 2)
            if predicted > opts.matmul_budget_s * (opts.matmul_repeats + 2) and (
                samples or timed
            ):
                _log(opts, f"matmul {dtype_name} {m}x{n}x{k}: over budget, skipped")
                continue
            a = torch.randn(m, k, device=dev).to(dtype)
            b = torch.randn(k, n, device=dev).to(dtype)
            timed.append(((m, n, k), lambda a=a, b=b: a @ b))
        _log(
            opts,
            f"matmul {dtype_name}: {len(timed)} shapes, {opts.matmul_repeats} rounds",
        )
        secs = time_calls(
            [fn for _, fn in timed],
            opts.matmul_repeats,
            meet=lambda: _meet(opts),
            **_timer(opts),
        )
        for ((m, n, k), _), sec in zip(timed, secs):
            samples.append(MatmulSample(m, n, k, dtype_name, sec))
    return samples


def measure_bandwidth(nbytes: int, repeats: int = 5, **timer: Any) -> float:
    """Bytes per second of copying an `nbytes` tensor (read + write counted); `timer` goes to
    `time_call`."""
    import torch

    dev = _device()
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    sec = time_call(lambda: dst.copy_(src), repeats, warmup=1, **timer)
    return 2.0 * nbytes / sec


def _measure_op_rates(opts: ProfileOptions) -> list[Any]:
    """`runtime.op_rates.measure_op_rates` of `opts.op_models`, timed as matrix products are."""
    from runtime.op_rates import measure_op_rates

    _log(opts, f"non-GEMM ops of {', '.join(opts.op_models)} (batch {opts.op_batch})")

    def time_all(fns: list[Callable[[], Any]]) -> list[float]:
        return time_calls(
            fns, opts.matmul_repeats, meet=lambda: _meet(opts), **_timer(opts)
        )

    return measure_op_rates(
        opts.op_models, opts.op_batch, time_all, device_type=_device().type
    )


def _profile_worker(opts: ProfileOptions) -> dict[str, Any] | None:
    """Runs on every rank; rank 0 returns the raw measurements."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, Any] = {"op_overhead": None}
    if rank == 0 or opts.concurrent_compute:
        out["matmul"] = measure_matmul(opts)
        _log(opts, f"memory bandwidth ({opts.bandwidth_bytes // MB} MiB copy)")
        _meet(opts)
        out["bandwidth"] = measure_bandwidth(opts.bandwidth_bytes, **_timer(opts))
        if opts.op_models:
            out["op_rates"] = _measure_op_rates(opts)
    dist.barrier()
    if opts.op_overhead and dist.get_backend() == "gloo":
        from runtime.overhead import REPEATS, measure_op_overhead

        rounds = opts.calibration_rounds or ()
        times = rounds[2] if rounds else REPEATS
        _log(
            opts,
            "runtime overheads per op, parameter and step "
            f"(tiny GPTs, llama and Mixtral, every rank, {times} times)",
        )
        out["op_overhead"] = measure_op_overhead(opts.calibration_plans, *rounds)
    from runtime.profile_collectives import measure_collectives

    out["collectives"] = measure_collectives(opts, rank)
    return out if rank == 0 else None


def _device_name(backend: str, threads: int) -> str:
    if backend == "nccl":
        import torch

        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({threads} thread{'s' if threads != 1 else ''} per rank)"


def _memory_bytes(backend: str, nproc: int) -> int:
    if backend == "nccl":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // nproc)  # a CPU "device" is one rank's share of the host memory


def check_options(opts: ProfileOptions) -> str:
    """Raise MeshplanError for options that cannot run here; the backend to measure with. Called
    by the launching process before the launch: with `op_overhead` on gloo ranks it also makes
    `opts.calibration_plans` when they are missing (`runtime.overhead.calibration_plans`)."""
    backend = opts.backend or default_backend(opts.nproc)
    check_nproc(opts.nproc, backend)
    bad = [w for w in (opts.world_sizes or []) if not 2 <= w <= opts.nproc]
    if bad:
        raise MeshplanError(f"world sizes {bad} are outside 2..{opts.nproc} (--nproc)")
    if opts.op_overhead and backend == "gloo" and opts.calibration_plans is None:
        from runtime.overhead import calibration_plans

        _log(opts, "calibration plans (meshplan manual, in one child process)")
        opts.calibration_plans = calibration_plans(opts.nproc)
    return backend


def profile_worker(opts: ProfileOptions) -> dict[str, Any] | None:
    """The measurements, run on every rank of an initialised group of `opts.nproc` ranks (for
    callers that measure inside their own launch); rank 0 returns the raw data for
    `profile_from_raw`, the other ranks None."""
    return _profile_worker(opts)


def profile_from_raw(
    raw: dict[str, Any], opts: ProfileOptions, backend: str
) -> DeviceProfile:
    """Fit rank 0's raw measurements into a DeviceProfile."""
    threads = len(rank_cpu_sets(opts.nproc)[0])
    fits = []
    for op, w, samples in raw["collectives"]:
        alpha, beta = fit_alpha_beta(samples)
        fits.append(CollectiveFit(op, w, alpha, beta, samples, fit_segments(samples)))
    overheads = _overheads(raw["op_overhead"], fits, opts.nproc)
    peak: dict[str, float] = {}
    for s in raw["matmul"]:
        peak[s.dtype] = max(peak.get(s.dtype, 0.0), s.flops_per_s)
    return DeviceProfile(
        version=PROFILE_VERSION,
        device_name=_device_name(backend, threads),
        backend=backend,
        hosts=1,
        devices_per_host=opts.nproc,
        memory_bytes=_memory_bytes(backend, opts.nproc),
        memory_bandwidth_bytes_per_s=raw["bandwidth"],
        peak_flops=peak,
        matmul=raw["matmul"],
        collectives=fits,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        host=socket.gethostname(),
        op_overhead_s=overheads.op_s,
        param_overhead_s=overheads.param_s,
        param_step_overhead_s=overheads.param_step_s,
        grad_byte_overhead_s=overheads.grad_byte_s,
        step_overhead_s=overheads.step_s,
        microbatch_overhead_s=overheads.microbatch_s,
        op_rates=raw.get("op_rates", []),
    )


def _overheads(
    raw: dict[str, Any] | None, fits: list[CollectiveFit], nproc: int
) -> Any:
    """`runtime.overhead.overheads_from_steps` (an `Overheads`) with the all_reduce fit at
    `nproc` ranks; zeros when the overheads were not measured."""
    from runtime.overhead import Overheads, overheads_from_steps

    if raw is None:
        return Overheads()

    fit = next(
        (f for f in fits if f.op == "all_reduce" and f.world_size == nproc), None
    )
    return overheads_from_steps(raw, fit)


def run_profile(opts: ProfileOptions) -> DeviceProfile:
    """Measure this machine with `opts.nproc` ranks and return the fitted DeviceProfile."""
    backend = check_options(opts)
    _log(opts, f"measuring with {opts.nproc} {backend} ranks")
    (raw, *_) = launch(
        _profile_worker, opts.nproc, (opts,), backend=backend, timeout_s=opts.timeout_s
    )
    return profile_from_raw(raw, opts, backend)
