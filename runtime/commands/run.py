"""`meshplan run`: train a model as a plan says, on processes of this machine (or under torchrun).

meshplan run gpt-tiny --plan plan.json --steps 10 --json losses.json   # ranks started here
meshplan run gpt-tiny --nproc 2                                         # profile, plan, then run
torchrun --nproc-per-node 8 --nnodes 2 ... -m runtime.cli run gpt-1.3b --plan plan.json

Every rank builds the model after ``torch.manual_seed(--seed)`` and draws the same synthetic global
batches from the seed (`runtime.train.seeded_model_and_batches`), so the losses of different plans,
and of one device, are comparable step by step. Rank 0 prints the loss and wall time of every step.

Modes (`launch_mode`): when the environment already names a rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: torchrun), this process is one rank and joins that group; otherwise `runtime.launch`
starts one process per device of the plan here (gloo on CPU, NCCL when there is a GPU per rank),
fails fast when any rank raises or dies (the error names the rank), and enforces ``--timeout``.

Under torchrun, on one host or several, global rank r runs plan device r (on LOCAL_RANK's GPU where
there are GPUs). Before the process group forms, `runtime.torchrun` checks torchrun's nodes x
processes per node against the plan's hosts x devices, and every rank meets the others on
torchrun's store, so that a rank failing before the group forms, a rank that never comes, or ranks
given different plans or options stop every rank at once (``--join-timeout``) instead of leaving
them in ``init_process_group`` until ``--timeout``.

Checks made before any process starts: the plan's model fingerprint against MODEL (traced on meta
tensors in the plan's dtype), the process count against the plan's devices, and the dtype: CPU
(gloo) ranks train in float32 only, so a float16 / bfloat16 plan is refused there with a message
saying to plan with ``--dtype float32`` (training half precision on CPU is slow and not what the plan
priced; silently switching dtype would also change the model's fingerprint). On GPUs ranks train in
the plan's dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cost_models.errors import MeshplanError
from planner.vocab.plan_check import DTYPES
from planner.vocab.plan_file import ParallelPlan
from runtime.torchrun import (
    agent_store,
    check_torchrun_shape,
    join_peers,
    run_digest,
    tell_peers,
)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAULT_KINDS = ("kill", "exit", "raise", "hang")


@dataclass(frozen=True)
class Fault:
    """Fault injection for tests: rank `rank` fails at the start of step `step` (1-based) by
    SIGKILL ("kill"), ``os._exit(3)`` ("exit"), raising RuntimeError ("raise"), or sleeping
    until it is stopped ("hang": its peers wait in their next collective)."""

    rank: int
    step: int
    kind: str = "kill"

    @staticmethod
    def parse(text: str) -> Fault:
        """'RANK:STEP[:KIND]' -> Fault."""
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            kind = parts[2] if len(parts) == 3 else "kill"
            if kind not in FAULT_KINDS:
                raise ValueError
            return Fault(int(parts[0]), int(parts[1]), kind)
        except ValueError:
            raise MeshplanError(
                f"--fault {text!r}: expected RANK:STEP[:{'|'.join(FAULT_KINDS)}]"
            ) from None

    def trigger(self) -> None:
        """Fail now, as `kind` says."""
        print(
            f"meshplan run: injected fault ({self.kind}) on rank {self.rank} at step {self.step}",
            file=sys.stderr,
            flush=True,
        )
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "exit":
            os._exit(3)
        while self.kind == "hang":
            time.sleep(60)
        raise RuntimeError(f"injected fault at step {self.step}")


@dataclass(frozen=True)
class RunConfig:
    """What every rank needs to train (picklable: it travels to the ranks)."""

    model: str
    steps: int
    seed: int = 0
    lr: float = 0.1
    optimizer: str = "sgd"
    dtype: str = "float32"
    fault: Fault | None = None


def launch_mode(env: Mapping[str, str] | None = None) -> str:
    """ "torchrun" when the environment already defines this process's rank and rendezvous
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else "spawn" (start the ranks here)."""
    env = os.environ if env is None else env
    return "torchrun" if all(env.get(k) for k in TORCHRUN_VARS) else "spawn"


def plan_world_size(plan: ParallelPlan) -> int:
    """The number of processes the plan needs: its devices, which must be ranks 0..n-1."""
    devices = sorted({d for s in plan.stages for d in s.devices})
    if not devices or devices != list(range(len(devices))):
        raise MeshplanError(
            f"plan places stages on devices {devices}; expected ranks 0..n-1 each used once"
        )
    return len(devices)


def check_plan_model(plan: ParallelPlan, model: str) -> str:
    """Refuse a plan made for another model (traced on meta tensors in the plan's dtype: cheap, no
    process); return the dtype the plan trains in."""
    import torch

    from planner.models import build_model
    from planner.tracing.tracer import trace

    m, batch = build_model(model, device="meta", dtype=getattr(torch, plan.dtype))
    plan.check_model(trace(m, batch, model_name=model).fingerprint(), model)
    return plan.dtype


def check_dtype(dtype: str, backend: str) -> None:
    """CPU ranks train float32 plans only (module docstring)."""
    if backend == "gloo" and dtype != "float32":
        raise MeshplanError(
            f"the plan trains in {dtype}, but these ranks run on CPUs (gloo), which train in "
            "float32 only; make the plan with --dtype float32"
        )


def _fmt_step(i: int, steps: int, loss: float, dt: float) -> str:
    return f"step {i}/{steps}  loss {loss:.6f}  time {dt * 1e3:.1f} ms"


def rank_main(plan: ParallelPlan, cfg: RunConfig) -> dict[str, list[float]]:
    """One rank's training (inside an initialised process group): the per-step losses (the same
    on every rank) and this rank's wall time of every step. Rank 0 prints every step as it ends."""
    import torch
    import torch.distributed as dist

    from runtime.train import Trainer, seeded_model_and_batches

    rank = dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    dtype = getattr(torch, cfg.dtype)
    model, batches = seeded_model_and_batches(
        cfg.model, plan.global_batch, cfg.steps, cfg.seed, dtype
    )
    if cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
        model = model.to(dev)
        batches = [tuple(t.to(dev) for t in b) for b in batches]
    trainer = Trainer(
        plan,
        model,
        batches[0],
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        device_type="cuda" if cuda else "cpu",
    )
    losses: list[float] = []
    times: list[float] = []
    for i, batch in enumerate(batches, start=1):
        if cfg.fault is not None and cfg.fault.rank == rank and cfg.fault.step == i:
            cfg.fault.trigger()
        t0 = time.perf_counter()
        loss = trainer.step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if rank == 0:
            print(_fmt_step(i, cfg.steps, losses[-1], times[-1]), flush=True)
    return {"losses": losses, "step_times_s": times}


def _run_torchrun(
    plan: ParallelPlan,
    cfg: RunConfig,
    nproc: int | None,
    timeout_s: float,
    join_timeout_s: float,
) -> dict[str, list[float]] | None:
    """Join the torchrun group as this process's rank (global rank r runs plan device r, on
    LOCAL_RANK's GPU where there are GPUs) and train; rank 0's results, else None."""
    import datetime

    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    need = plan_world_size(plan)
    if world != need or (nproc is not None and nproc != world):
        raise MeshplanError(
            f"the plan needs {need} processes; torchrun started {world}"
            + (f" and --nproc is {nproc}" if nproc is not None else "")
        )
    check_torchrun_shape(plan, os.environ)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.device_count() >= local_world else "gloo"
    check_dtype(cfg.dtype, backend)
    join_peers(join_timeout_s, run_digest(plan, cfg))
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(local)
        device_id = torch.device("cuda", local)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id
    )
    try:
        result = rank_main(plan, cfg)
        # no rank tears its connections down while a peer may still use them
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result if int(os.environ["RANK"]) == 0 else None


def _plan_here(args: argparse.Namespace, nproc: int) -> ParallelPlan:
    """Plan MODEL for `nproc` local processes (a quick profile of this machine unless --profile).

    The search runs as a child process of our own CLI (`meshplan plan --cluster 1xNxCPU --profile
    FILE`: the cluster of the profile, `Cluster.from_profile(profile, 1, N)`), so that the runtime
    does not import the planner's search. Its summary and progress are printed here."""
    from cost_models.profile import save_profile
    from runtime.cli import run_child
    from runtime.profiler import ProfileOptions, run_profile

    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as tmp:
        profile = args.profile
        if not profile:
            print(
                f"  no --plan: measuring this machine with {nproc} processes (quick profile)",
                file=sys.stderr,
                flush=True,
            )
            profile = os.path.join(tmp, "profile.json")
            save_profile(run_profile(ProfileOptions.quick(nproc)), profile)
        out = args.save_plan or os.path.join(tmp, "plan.json")
        cmd = ["plan", args.model, "--cluster", f"1x{nproc}xCPU"]
        cmd += ["--profile", profile, "--json", out, "--dtype", args.dtype]
        if args.batch is not None:
            cmd += ["--batch", str(args.batch)]
        child = run_child(cmd, f"planning {args.model}")
        # progress, then the summary; the temporary plan file is ours, not worth a line
        err = (
            child.stderr
            if args.save_plan
            else child.stderr.replace(f"wrote {out}\n", "")
        )
        print(err, end="", file=sys.stderr, flush=True)
        print(child.stdout, end="", flush=True)
        return ParallelPlan.load(out)


def _local_devices() -> int:
    """Processes to plan for when neither --plan nor --nproc says: one per GPU, else per core."""
    import torch

    from runtime.launch import MAX_LOCAL_RANKS_CPU, rank_cpu_sets

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(MAX_LOCAL_RANKS_CPU, len(rank_cpu_sets(1)[0])))


def run(args: argparse.Namespace) -> int:
    """Check the plan, start (or join) the ranks, train, print and write the results. Under
    torchrun a failure is also written where the other ranks wait to join (`tell_peers`)."""
    if launch_mode() != "torchrun":
        return _run(args)
    try:
        agent_store(os.environ)  # connect now (see `runtime.torchrun.agent_store`)
        return _run(args)
    except Exception as exc:
        tell_peers(exc)
        raise


def _run(args: argparse.Namespace) -> int:
    from runtime.launch import default_backend, launch
    from runtime.profiler import check_nproc

    if args.steps < 1:
        raise MeshplanError(f"--steps must be at least 1, got {args.steps}")
    if args.lr <= 0:
        raise MeshplanError(f"--lr must be positive, got {args.lr}")
    if args.join_timeout <= 0:
        raise MeshplanError(f"--join-timeout must be positive, got {args.join_timeout}")
    if args.nproc is not None and args.nproc < 1:
        raise MeshplanError(f"--nproc must be at least 1, got {args.nproc}")
    fault = Fault.parse(args.fault) if args.fault else None
    mode = launch_mode()
    if args.plan:
        plan = ParallelPlan.load(args.plan)
        dtype = check_plan_model(plan, args.model)
    elif mode == "torchrun":
        raise MeshplanError(
            "under torchrun, give --plan (every rank must run one plan)"
        )
    else:
        n = args.nproc or _local_devices()
        check_nproc(n)
        check_dtype(args.dtype, default_backend(n))
        plan, dtype = _plan_here(args, n), args.dtype
    cfg = RunConfig(
        args.model, args.steps, args.seed, args.lr, args.optimizer, dtype, fault
    )
    need = plan_world_size(plan)
    if mode == "torchrun":
        result = _run_torchrun(plan, cfg, args.nproc, args.timeout, args.join_timeout)
    else:
        nproc = need if args.nproc is None else args.nproc
        if nproc != need:
            raise MeshplanError(
                f"--nproc {nproc} does not match the plan, which runs on {need} devices"
            )
        check_nproc(nproc)
        backend = default_backend(nproc)
        check_dtype(cfg.dtype, backend)
        print(
            f"running {args.model} on {nproc} {backend} processes for {args.steps} steps",
            file=sys.stderr,
            flush=True,
        )
        result = launch(
            rank_main, nproc, (plan, cfg), backend=backend, timeout_s=args.timeout
        )[0]
    if result is not None and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `run` command."""
    p = subparsers.add_parser(
        "run",
        help="train a model as a plan says, on processes of this machine (or under torchrun)",
        description=(
            "Train MODEL for --steps steps on seeded synthetic batches as PLAN says: one process "
            "per device of the plan (gloo on CPU, NCCL on GPUs), or this process as one rank when "
            "started by torchrun. Prints every step's loss and time. Without --plan, profiles "
            "this machine quickly and plans for --nproc processes first."
        ),
    )
    p.add_argument("model", help="built-in model name or spec (as given to `plan`)")
    p.add_argument("--plan", metavar="FILE", help="plan JSON (meshplan plan --json)")
    p.add_argument(
        "--nproc", type=int, help="local processes (default: the plan's devices)"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument(
        "--json", metavar="FILE", help="write {losses, step_times_s} as JSON"
    )
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a run that hangs is stopped (default 600)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        help="under torchrun: seconds to wait for every rank of every host to arrive before "
        "stopping (default 300; a rank that fails before arriving stops the others at once)",
    )
    g = p.add_argument_group("planning when --plan is not given")
    g.add_argument("--profile", metavar="FILE", help="measured profile to plan with")
    g.add_argument("--batch", type=int, help="global batch (default: the model's)")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="training dtype to plan for (default float32)",
    )
    g.add_argument("--save-plan", metavar="FILE", help="write the plan made here")
    p.add_argument("--fault", help=argparse.SUPPRESS)  # RANK:STEP[:KIND], for tests
    p.set_defaults(func=run)
