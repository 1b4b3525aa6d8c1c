"""Diagnostic: gloo with several collectives of one group in flight at once, the measurement
behind `runtime.redistribute.waits_at_once`.

Each launch starts 2 gloo ranks that issue `--ops` random DTensor redistributions on a 1-D mesh
of both, as FSDP issues its own: all-gathers (Shard -> Replicate, 35%) and reduce-scatters
(Partial -> Shard, 35%) of 4 to 65536 elements with ``async_op=True``, left in flight; a
synchronous scalar all-reduce (10%); a wait for a random subset of what is in flight (20%). The
sequence is seeded alike on both ranks, so both issue the same collectives in the same order. A
launch that does not finish within `--timeout` seconds is a hang: both ranks' Python stacks
are printed (each waiting in ``wait_tensor``); a rank may also crash inside gloo (a SIGSEGV in a
reduce-scatter at 200 collectives, once, in a CI run on 2026-12-06). With ``--wait-at-once``
every collective is waited for as it is issued, as the runtime does on gloo.

    python -m benchmarks.gloo_inflight [--launches 20] [--ops 30000] [--wait-at-once]

On this machine (2026-11-29, 2 cores, torch 2.13.0+cpu; scripts of the same loop): these
settings hung 1 launch of 10 (about 45 s each otherwise); with all-gathers and reduce-scatters
at 40% each, 5% scalar all-reduces, 15% waits and at most 8192 elements, 0 of 38 on the default
group and 2 of 30 on a second gloo group (``new_group``). gdb on a hung pair: gloo's worker
threads stuck, not Python (`runtime.redistribute.waits_at_once`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from runtime.launch import LaunchError, launch


def _rank(ops: int, seed: int, wait_at_once: bool) -> int:
    """One rank's collectives (module docstring); returns how many it issued."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    rng = random.Random(seed)
    pending: list[DTensor] = []

    def wait(x: DTensor) -> None:
        if isinstance(x._local_tensor, AsyncCollectiveTensor):
            x._local_tensor.wait()

    def issue(x: DTensor, to: Placement) -> None:
        pending.append(x.redistribute(mesh, [to], async_op=True))
        if wait_at_once:
            wait(pending[-1])

    for _ in range(ops):
        k, n = rng.random(), rng.choice([4, 64, 1024, 8192, 65536])
        if k < 0.35:
            issue(DTensor.from_local(torch.ones(n), mesh, [Shard(0)]), Replicate())
        elif k < 0.7:
            issue(DTensor.from_local(torch.ones(2 * n), mesh, [Partial()]), Shard(0))
        elif k < 0.8:
            x = DTensor.from_local(torch.ones(1), mesh, [Partial()])
            x.redistribute(mesh, [Replicate()]).to_local().sum().item()
        else:
            rng.shuffle(pending)
            m = rng.randint(0, len(pending))
            for x in pending[:m]:
                wait(x)
            pending = pending[m:]
    for x in pending:
        wait(x)
    return ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--ops", type=int, default=30000, help="collectives per launch")
    ap.add_argument("--timeout", type=int, default=150, help="seconds before a hang")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first launch")
    ap.add_argument("--wait-at-once", action="store_true")
    args = ap.parse_args(argv)
    failed = 0
    for i in range(args.launches):
        t0 = time.perf_counter()
        try:
            launch(
                _rank,
                2,
                args=(args.ops, args.seed + i, args.wait_at_once),
                timeout_s=args.timeout,
            )
            print(
                f"launch {i}: finished in {time.perf_counter() - t0:.1f} s", flush=True
            )
        except LaunchError as exc:
            failed += 1
            print(f"launch {i}: {exc}", flush=True)
            for rank, stack in sorted((exc.tracebacks or {}).items()):
                print(f"rank {rank}:\n{stack}", flush=True)
    print(
        f"{failed} of {args.launches} launches hung or crashed ({args.ops} collectives each)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
