"""Step 3 of `runtime.profiler`: every collective timed for every world size and message size
(the module docstring of `runtime.profiler` says how: sub-groups, byte convention, repeats)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from cost_models.errors import MeshplanError
from runtime.profile_options import KB, MB, ProfileOptions, _device, _log, _sync


def measure_collectives(
    opts: ProfileOptions, rank: int
) -> list[tuple[str, int, list[tuple[int, float]]]]:
    """On every rank of the launch: (op, world size, [(bytes, seconds)]) of every pair of
    `_plan_collectives`, on rank 0 (empty elsewhere)."""
    import torch.distributed as dist

    pairs = _plan_collectives(opts)
    groups = _collective_groups(opts, sorted({w for _, w in pairs}), rank)
    fits: list[tuple[str, int, list[tuple[int, float]]]] = []
    for i, (op, w) in enumerate(pairs, 1):
        if rank == 0:
            sizes = f"{_fmt_bytes(opts.sizes[0])}..{_fmt_bytes(opts.sizes[-1])}"
            _log(opts, f"{op} on {w} ranks, {sizes} ({i}/{len(pairs)})")
        if w in groups:
            grank = dist.get_group_rank(groups[w], rank)
            fns = [_collective_call(op, n, groups[w], w, grank) for n in opts.sizes]
            secs = _time_sizes(fns, groups[w], opts)
            del fns
            if op == "send_recv":
                secs = [s / 2 for s in secs]
            if rank == 0:
                fits.append((op, w, list(zip(opts.sizes, secs))))
        dist.barrier()
    return fits


def _collective_call(
    op: str, nbytes: int, group: Any, w: int, rank: int
) -> Callable[[], Any]:
    """A closure running `op` once on buffers sized by the byte convention (float32 elements).

    The four collectives go through the functional collectives (``_c10d_functional``) and their
    ``wait_tensor``, as the runtime issues every one of them (DTensor's redistributions, the
    gradient buckets in `runtime.grad_sync`). That path costs more than ``dist.all_reduce`` and
    its kind, a difference the cost model would otherwise miss once per collective (gloo, 4
    ranks on this machine's 2 cores, all-reduces over groups of 2, 20 calls in a row, the faster
    of two rounds, 2026-12-05: 4 KiB 1.70 ms plain against 2.34 functional, 64 KiB 1.62 against
    2.33, 1 MiB 2.57 against 3.40; through ``DTensor.redistribute`` 2.29-3.76 ms, the functional
    figures within the rounds' noise). Point-to-point stays ``dist.send`` and ``dist.recv``, as
    ``torch.distributed.pipelining`` sends."""
    import torch
    import torch.distributed as dist

    dev = _device()
    numel = max(w, nbytes // 4 // w * w)  # divisible by w, for the sharded ops
    c10d = torch.ops._c10d_functional
    name = group.group_name
    if op == "all_reduce":
        x = torch.ones(numel, device=dev)
        return lambda: c10d.wait_tensor(c10d.all_reduce(x, "sum", name))
    if op == "all_gather":
        inp = torch.ones(numel // w, device=dev)
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(inp, w, name))
    if op == "reduce_scatter":
        inp = torch.ones(numel, device=dev)
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(inp, "sum", w, name))
    if op == "all_to_all":
        inp = torch.ones(numel, device=dev)
        split = [numel // w] * w
        return lambda: c10d.wait_tensor(c10d.all_to_all_single(inp, split, split, name))
    if op == "send_recv":
        x = torch.ones(max(1, nbytes // 4), device=dev)

        def ping_pong() -> None:
            # one round trip between the group's ranks 0 and 1; halved by the caller
            if rank == 0:  # ranks within `group`
                dist.send(x, group=group, group_dst=1)
                dist.recv(x, group=group, group_src=1)
            else:
                dist.recv(x, group=group, group_src=0)
                dist.send(x, group=group, group_dst=0)

        return ping_pong
    raise MeshplanError(f"unknown collective {op!r}")


#: Timed calls of each size per repeat, each on its own (`_time_sizes`).
CALLS_PER_REPEAT = 5


def _time_sizes(
    fns: list[Callable[[], Any]], group: Any, opts: ProfileOptions
) -> list[float]:
    """Median seconds of one call of each closure (one per message size), the slowest rank's.

    Each call is timed on its own: a group barrier, the call, the wait for its result, as the
    runtime issues a collective between computations (a step's gradient bucket, an activation's
    redistribution) and waits for it. Calls back to back measure less than that: a rank done with
    one starts the next while others finish (gloo on this machine's 4 ranks: 1 MiB all-reduces
    5.1 ms back to back, 7.5 ms each on its own; 4 MiB 11.7 and 15.7 ms), and the overheads that
    `runtime.overhead` fits are net of the step's collectives timed on their own. A sample is the
    slowest rank's time of one call, and a size's figure the median of its ``opts.repeats *
    CALLS_PER_REPEAT`` samples. Repeats go round-robin over the sizes (size 1, size 2, ...,
    size 1, ...), so a burst of load from elsewhere on the machine spoils one repeat of several
    sizes rather than every repeat of one.
    """
    import torch
    import torch.distributed as dist

    dev = _device()
    for fn in fns:
        for _ in range(opts.warmup):
            fn()
    _sync()
    calls = opts.repeats * CALLS_PER_REPEAT
    times = torch.zeros(calls, len(fns), dtype=torch.float64)
    for r in range(opts.repeats):
        for i, fn in enumerate(fns):
            for c in range(r * CALLS_PER_REPEAT, (r + 1) * CALLS_PER_REPEAT):
                dist.barrier(group=group)
                t = time.perf_counter()
                fn()
                _sync()
                times[c, i] = time.perf_counter() - t
    times = times.to(dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return [statistics.median(col) for col in times.cpu().T.tolist()]


def _plan_collectives(opts: ProfileOptions) -> list[tuple[str, int]]:
    """(op, world size) pairs to measure, in order."""
    sizes = opts.world_sizes or list(range(2, opts.nproc + 1))
    pairs = []
    for w in sizes:
        for op in opts.ops:
            if op == "send_recv" and w != 2:
                continue
            pairs.append((op, w))
    return pairs


def _collective_groups(
    opts: ProfileOptions, worlds: list[int], rank: int
) -> dict[int, Any]:
    """World size -> this rank's process group to time collectives of that size on: ranks
    0..w-1, or with ``concurrent_collectives`` the w consecutive ranks holding this rank (then
    only whole groups: the last ``nproc % w`` ranks get none). Every rank creates every group
    (``new_group`` is collective), in the same order."""
    import torch.distributed as dist

    out: dict[int, Any] = {}
    for w in worlds:
        starts = range(0, opts.nproc - w + 1, w) if opts.concurrent_collectives else [0]
        for start in starts:
            g = dist.new_group(list(range(start, start + w)))
            if start <= rank < start + w:
                out[w] = g
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n // MB} MiB" if n >= MB else f"{n // KB} KiB"
