"""Benchmark: what passing parameters to compiled stages as local tensors saves a step
(`runtime.local_leaves`).

    python -m benchmarks.bench_local_leaves [--spec SPEC] [--batch G] [--microbatches B]
        [--dp N] [--tp N] [--steps 30]

One launch of dp * tp gloo ranks, one thread each. Every rank builds two `runtime.train.Trainer`s
of the same `manual_plan` (Adam): the first compiles its stages with the aliasing turned off
(`runtime.compiled.is_leaf_input` answering False while it traces, so its parameters go in as
DTensors, as before the change), the second as the runtime does. Their steps alternate, each
between two barriers, so both see the same machine; it prints the median step of each, their
ratio, and whether the losses were equal step for step (they must be: same model, data, maths).
Separate launches of one configuration differ by more than the saving on this shared machine
(`benchmarks.bench_runtime`'s dp2 of the default spec here: 120 and 149 ms a step in two
launches of one commit), hence one launch with both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DEFAULT_SPEC = "gpt:hidden=64,layers=24,heads=4,seq=32,vocab=256"


def _rank(
    spec: str, batch: int, microbatches: int, dp: int, tp: int, steps: int
) -> tuple:
    import torch.distributed as dist

    from planner.plans.manual import manual_plan
    from runtime import compiled
    from runtime.train import Trainer, seeded_model_and_batches

    torch.set_num_threads(1)
    plan = manual_plan(
        spec,
        f"1x{dp * tp}xV100-16GB",
        dp=dp,
        tp=tp,
        pp=1,
        num_microbatches=microbatches,
        global_batch=batch,
        dtype=torch.float32,
        allow_oom=True,
    )
    model, batches = seeded_model_and_batches(spec, batch, 4)
    keep = compiled.is_leaf_input
    compiled.is_leaf_input = lambda v: False
    try:
        before = Trainer(plan, model, batches[0], optimizer="adam")
        before.step(batches[0])  # compiles, leaves as DTensors
    finally:
        compiled.is_leaf_input = keep
    after = Trainer(plan, model, batches[0], optimizer="adam")
    after.step(batches[0])
    times: dict[str, list[float]] = {"before": [], "after": []}
    losses: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(steps):
        for name, tr in (("before", before), ("after", after)):
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(tr.step(batches[i % len(batches)]))
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return (
        statistics.median(times["before"]),
        statistics.median(times["after"]),
        losses["before"] == losses["after"],
    )


def main(argv: list[str] | None = None) -> int:
    from runtime.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=DEFAULT_SPEC)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args(argv)
    before, after, equal = launch(
        _rank,
        a.dp * a.tp,
        args=(a.spec, a.batch, a.microbatches, a.dp, a.tp, a.steps),
    )[0]
    print(
        f"{a.spec} G={a.batch} B={a.microbatches} dp={a.dp} tp={a.tp}: parameters as "
        f"DTensors {before * 1e3:.1f} ms, as local tensors {after * 1e3:.1f} ms a step "
        f"(median of {a.steps}; ratio {after / before:.3f}); losses equal: {equal}"
    )
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
