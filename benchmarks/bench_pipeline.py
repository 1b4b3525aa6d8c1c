"""Step time of the two pipeline runners on the same plan: torch.distributed.pipelining
(`runtime.torch_pipeline.TorchPipelineRunner`) against our own send/recv runner
(`runtime.pipeline.PipelineRunner`).

    python -m benchmarks.bench_pipeline                      # pp2, pp2xtp2, pp2xv2
    python -m benchmarks.bench_pipeline --configs pp2 --steps 10

Each configuration is one `runtime.launch.launch` of gloo ranks; every rank builds the same seeded
GPT and batches and trains two `runtime.train.Trainer` copies of the Megatron plan
(`planner.plans.manual.manual_plan`), one per runner (``pipeline="torch"`` and ``"ours"``), alternating
their steps so that both see the same machine noise; each step is timed between two barriers of
the whole group (`benchmarks.bench_runtime._timed`). The table gives the median step time of each
and their ratio (torch / ours), and both runners' losses of the first step (they must agree).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_runtime import DEFAULT_BATCH, DEFAULT_SPEC, LR, _timed


@dataclass(frozen=True)
class PipelineConfig:
    """A Megatron pipeline configuration."""

    name: str
    tp: int = 1
    pp: int = 2
    microbatches: int = 2
    virtual_stages: int = 1

    @property
    def world(self) -> int:
        """Ranks the configuration runs on."""
        return self.tp * self.pp


CONFIGS = {
    c.name: c
    for c in (
        PipelineConfig("pp2"),
        PipelineConfig("pp2xtp2", tp=2),
        PipelineConfig("pp2xv2", microbatches=4, virtual_stages=2),
        PipelineConfig("pp4", pp=4, microbatches=4),
    )
}


def compare_rank(
    cfg: PipelineConfig, spec: str, batch: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Body of one rank: both runners on the same plan, alternating timed steps."""
    from planner.plans.manual import manual_plan
    from runtime.train import Trainer, seeded_model_and_batches

    plan = manual_plan(
        spec,
        f"1x{cfg.world}xA100-80GB",
        dp=1,
        tp=cfg.tp,
        pp=cfg.pp,
        num_microbatches=cfg.microbatches,
        virtual_stages=cfg.virtual_stages,
        global_batch=batch,
        dtype="float32",
        allow_oom=True,
    )
    n = warmup + steps
    out: dict[str, Any] = {}
    trainers = {}
    for impl in ("torch", "ours"):
        model, batches = seeded_model_and_batches(spec, batch, n, seed=0)
        trainers[impl] = Trainer(
            plan, model, batches[0], optimizer="sgd", lr=LR, pipeline=impl
        )
        out[impl] = {"times": [], "losses": []}
    for i, b in enumerate(batches):
        for impl, tr in trainers.items():
            loss, t = _timed(tr.step, b)
            out[impl]["losses"].append(loss)
            if i >= warmup:
                out[impl]["times"].append(t)
    out["runners"] = {k: type(t.runner).__name__ for k, t in trainers.items()}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command line (module docstring)."""
    from runtime.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="pp2,pp2xtp2,pp2xv2")
    ap.add_argument("--spec", default=DEFAULT_SPEC)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    print(
        f"model {args.spec}, global batch {args.batch}, SGD; median of {args.steps} steps "
        f"after {args.warmup} warm-up"
    )
    print(
        "| config | ranks | torch ms | ours ms | torch / ours | loss step 1 (torch / ours) |"
    )
    print("|---|---|---|---|---|---|")
    for name in [c for c in args.configs.split(",") if c]:
        cfg = CONFIGS[name]
        r = launch(
            compare_rank,
            cfg.world,
            args=(cfg, args.spec, args.batch, args.steps, args.warmup),
            timeout_s=1200.0,
        )[0]
        assert r["runners"] == {
            "torch": "TorchPipelineRunner",
            "ours": "PipelineRunner",
        }
        t = statistics.median(r["torch"]["times"])
        o = statistics.median(r["ours"]["times"])
        print(
            f"| {name} | {cfg.world} | {t * 1e3:8.1f} | {o * 1e3:8.1f} | {t / o:5.2f} | "
            f"{r['torch']['losses'][0]:.6f} / {r['ours']['losses'][0]:.6f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
