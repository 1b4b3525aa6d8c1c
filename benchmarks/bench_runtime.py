"""Step time of meshplan's runtime against a hand-written PyTorch reference, same Megatron config.

    python -m benchmarks.bench_runtime                       # tp2, dp2, pp2 (and tp2xdp2 on 4 ranks)
    python -m benchmarks.bench_runtime --configs tp2 --steps 5 --warmup 2 --repeats 3
    python -m benchmarks.bench_runtime --profile tp2         # also cProfile one runtime step on rank 0

Each configuration is one `runtime.launch.launch` of dp * tp * pp gloo ranks. Every rank builds the
same seeded GPT and seeded global batches, then trains two copies of it side by side:

* **runtime**: `runtime.train.Trainer` on `planner.plans.manual.manual_plan` (dp, tp, pp, micro-batches);
* **reference**: PyTorch's own pieces, written by hand as a user would (`ReferenceTrainer`):
  tensor parallelism with ``parallelize_module`` on the ``tp`` axis of a DeviceMesh (ColwiseParallel
  for ``attn.qkv`` and ``mlp.fc`` - the qkv features are head-major, so a column shard holds whole
  heads and attention needs no communication - RowwiseParallel for ``attn.proj`` and ``mlp.proj``;
  ``wte`` split by vocabulary (RowwiseParallel) and ``lm_head`` by vocabulary (ColwiseParallel,
  logits gathered), as the Megatron plan places them), data parallelism by all-reducing (averaging)
  gradients over the ``dp`` axis, pipeline parallelism with ``torch.distributed.pipelining``
  (``PipelineStage`` + ``Schedule1F1B``, the blocks split evenly), SGD. Like the runtime, it
  broadcasts the step's loss from the last stage to every rank.

Steps alternate (runtime step, reference step, ...) so that both see the same machine noise; each
step is timed between two barriers of the whole group. Each configuration is launched `--repeats`
times; per launch the median step time of each over the timed steps gives a ratio (runtime /
reference), and the issue's target (ratio <= 1.10) is checked on the median ratio of the
launches; the first step's losses of both are printed too (they must agree: same model, same
data, same maths).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TARGET = 1.10
DEFAULT_SPEC = "gpt:hidden=256,layers=4,heads=8,seq=128,vocab=512"
DEFAULT_BATCH = 8
LR = 0.1

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Config:
    """A Megatron configuration: data, tensor and pipeline parallel degrees and micro-batches."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1

    @property
    def world(self) -> int:
        """Ranks the configuration runs on."""
        return self.dp * self.tp * self.pp


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("tp2", tp=2),
        Config("dp2", dp=2),
        Config("pp2", pp=2, microbatches=2),
        Config("tp2xdp2", dp=2, tp=2),
    )
}


# --------------------------------------------------------------------------------------------
# The hand-written reference
# --------------------------------------------------------------------------------------------


class _FirstStage(nn.Module):
    """Embeddings and the first blocks of a GPT (pipeline stage 0)."""

    def __init__(self, gpt: nn.Module, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.wte, self.wpe, self.seq = gpt.wte, gpt.wpe, gpt.config.seq
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens[B, s] -> x[B, s, h]``."""
        from planner.models.gpt import embed

        x = embed(self.wte, self.wpe, tokens, self.seq)
        for b in self.blocks:
            x = b(x)
        return x


class _LastStage(nn.Module):
    """The last blocks, ``ln_f`` and ``lm_head`` of a GPT (the last pipeline stage)."""

    def __init__(self, gpt: nn.Module, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, s, h] -> logits[B, s, V]``."""
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from planner.models.gpt import lm_loss

    return lm_loss(logits, targets)


def _tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """Megatron tensor parallelism of a GPT with ``parallelize_module`` on a 1-D `mesh`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
        # The local qkv output holds heads/tp whole heads (head-major layout).
        block.attn.heads //= tp
        block.attn.hidden //= tp
    parallelize_module(
        model,
        mesh,
        {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )


class ReferenceTrainer:
    """One rank's share of the hand-written reference (module docstring). Ranks are laid out as
    ``(pp, dp, tp)``, tp fastest, as the runtime lays out a stage's ``(dp, tp)`` mesh."""

    def __init__(self, model: nn.Module, cfg: Config, lr: float = LR) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        rank = dist.get_rank()
        mesh = init_device_mesh(
            "cpu", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.stage = rank // (cfg.dp * cfg.tp)
        self.dp_rank = (rank // cfg.tp) % cfg.dp
        self.dp_group = mesh["dp"].get_group() if cfg.dp > 1 else None
        self.last_rank = (cfg.pp - 1) * cfg.dp * cfg.tp
        if cfg.tp > 1:
            _tensor_parallel(model, mesh["tp"])
        self.schedule = None
        self.module: nn.Module = model
        if cfg.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            if cfg.tp > 1 or cfg.dp > 1:
                raise NotImplementedError(
                    "the reference pipelines only pp-only configs"
                )
            blocks = list(model.blocks)
            per = len(blocks) // cfg.pp
            mine = blocks[self.stage * per : (self.stage + 1) * per]
            if self.stage == 0:
                self.module = _FirstStage(model, mine)
            elif self.stage == cfg.pp - 1:
                self.module = _LastStage(model, blocks[self.stage * per :])
            else:
                self.module = nn.Sequential(*mine)
            pstage = PipelineStage(
                self.module,
                self.stage,
                cfg.pp,
                torch.device("cpu"),
                group=mesh["pp"].get_group(),
            )
            self.schedule = Schedule1F1B(
                pstage, n_microbatches=cfg.microbatches, loss_fn=_lm_loss
            )
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, foreach=False)

    def step(self, batch: Batch) -> float:
        """One SGD step on a global batch; its mean loss (the same on every rank)."""
        tokens, targets = batch
        if self.cfg.dp > 1:
            tokens = tokens.chunk(self.cfg.dp)[self.dp_rank]
            targets = targets.chunk(self.cfg.dp)[self.dp_rank]
        loss = torch.zeros(())
        if self.schedule is not None:
            if self.stage == 0:
                self.schedule.step(tokens)
            elif self.stage == self.cfg.pp - 1:
                losses: list[torch.Tensor] = []
                self.schedule.step(target=targets, losses=losses)
                loss = torch.stack([x.detach() for x in losses]).mean()
            else:
                self.schedule.step()
        else:
            out = self.module(tokens, targets)
            out.backward()
            loss = out.detach()
            if hasattr(loss, "full_tensor"):
                loss = loss.full_tensor()
        if self.dp_group is not None:
            for p in self.params:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, op=dist.ReduceOp.AVG, group=self.dp_group)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.broadcast(loss, src=self.last_rank)
        return float(loss)


# --------------------------------------------------------------------------------------------
# One launch: both trainers in every rank
# --------------------------------------------------------------------------------------------


def _plan(cfg: Config, spec: str, batch: int) -> Any:
    from planner.plans.manual import manual_plan

    return manual_plan(
        spec,
        f"1x{cfg.world}xA100-80GB",
        dp=cfg.dp,
        tp=cfg.tp,
        pp=cfg.pp,
        num_microbatches=cfg.microbatches,
        global_batch=batch,
        dtype="float32",
        allow_oom=True,
        split="blocks",  # the reference splits the blocks evenly, as Megatron-LM does
    )


def _timed(fn: Any, *args: Any) -> tuple[float, float]:
    """`fn(*args)` between two barriers of the world: (its value, seconds)."""
    dist.barrier()
    t0 = time.perf_counter()
    value = fn(*args)
    dist.barrier()
    return value, time.perf_counter() - t0


def compare_rank(
    cfg: Config,
    spec: str,
    batch: int,
    steps: int,
    warmup: int,
    profile: bool = False,
) -> dict[str, Any]:
    """Body of one rank (inside a launched group): train both, time alternating steps."""
    from runtime.train import Trainer, seeded_model_and_batches

    plan = _plan(cfg, spec, batch)
    n = warmup + steps
    model, batches = seeded_model_and_batches(spec, batch, n, seed=0)
    ref_model, _ = seeded_model_and_batches(spec, batch, 1, seed=0)
    trainer = Trainer(plan, model, batches[0], optimizer="sgd", lr=LR)
    reference = ReferenceTrainer(ref_model, cfg)
    out: dict[str, Any] = {"runtime": [], "reference": [], "loss": [], "ref_loss": []}
    for i, b in enumerate(batches):
        loss, t_run = _timed(trainer.step, b)
        ref_loss, t_ref = _timed(reference.step, b)
        out["loss"].append(loss)
        out["ref_loss"].append(ref_loss)
        if i >= warmup:
            out["runtime"].append(t_run)
            out["reference"].append(t_ref)
    if profile:
        out["profile"] = _profile(trainer, reference, batches[-1])
    return out


def _profile(trainer: Any, reference: ReferenceTrainer, batch: Batch) -> str:
    """cProfile of one runtime step and one reference step (rank 0's view), top entries."""
    text = []
    for name, fn in (("runtime", trainer.step), ("reference", reference.step)):
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        fn(batch)
        dist.barrier()
        prof.disable()
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        text.append(f"===== {name} =====\n{s.getvalue()}")
    return "\n".join(text)


def run_config(
    cfg: Config,
    spec: str = DEFAULT_SPEC,
    batch: int = DEFAULT_BATCH,
    steps: int = 5,
    warmup: int = 2,
    profile: bool = False,
) -> dict[str, Any]:
    """Launch `cfg` and return rank 0's measurements (see `compare_rank`)."""
    from runtime.launch import launch

    return launch(
        compare_rank,
        cfg.world,
        args=(cfg, spec, batch, steps, warmup, profile),
        timeout_s=1200.0,
    )[0]


def _row(cfg: Config, runs: list[dict[str, Any]]) -> str:
    """One table row: per launch the median step times and their ratio; the row's verdict is
    the median ratio over the launches."""
    run = [statistics.median(r["runtime"]) for r in runs]
    ref = [statistics.median(r["reference"]) for r in runs]
    ratios = [a / b for a, b in zip(run, ref)]
    ratio = statistics.median(ratios)
    ok = "yes" if ratio <= TARGET else "no"
    r = runs[0]
    return (
        f"| {cfg.name:8} | {cfg.world} | {statistics.median(run) * 1e3:9.1f} "
        f"| {statistics.median(ref) * 1e3:9.1f} | {' '.join(f'{x:.2f}' for x in ratios)} "
        f"| {ratio:5.2f} | {ok:3} | {r['loss'][0]:.6f} / {r['ref_loss'][0]:.6f} |"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tp2,dp2,pp2,tp2xdp2")
    ap.add_argument("--spec", default=DEFAULT_SPEC)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=3, help="launches per config (median ratio)"
    )
    ap.add_argument("--profile", default="", help="configs to cProfile (rank 0)")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    profiled = set(args.profile.split(","))
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--repeats and --steps must be >= 1 and --warmup >= 0")
    print(
        f"model {args.spec}, global batch {args.batch}, SGD; per launch the median of "
        f"{args.steps} steps after {args.warmup} warm-up, {args.repeats} launches per config; "
        f"target: median ratio runtime/reference <= {TARGET}"
    )
    print(
        "| config | ranks | runtime ms | reference ms | ratio per launch | median ratio | ok "
        "| loss step 1 (run / ref) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    profiles = {}
    for name in names:
        cfg = CONFIGS[name]
        runs = [
            run_config(
                cfg,
                args.spec,
                args.batch,
                args.steps,
                args.warmup,
                i == 0 and name in profiled,
            )
            for i in range(args.repeats)
        ]
        print(_row(cfg, runs), flush=True)
        if "profile" in runs[0]:
            profiles[name] = runs[0]["profile"]
    for name, text in profiles.items():
        print(f"\n######## profile {name} (rank 0) ########\n{text}")


if __name__ == "__main__":
    main()
