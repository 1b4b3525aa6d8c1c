"""Train a model as a `ParallelPlan` says, inside each rank of a launched process group.

    losses = train(plan, model_fn, batches, optimizer="sgd", lr=0.1, steps=3)   # in every rank
    losses = run_local(plan, "gpt-tiny", steps=3, nproc=4)                      # launches the ranks

`model_fn()` returns the model with its initial parameters (on the CPU, the same on every rank:
seed it); `batches` are global batches (tuples of tensors of ``plan.global_batch`` rows), each split
into ``plan.num_microbatches`` micro-batches along dimension 0. Every rank traces the model on one
micro-batch (fake tensors), checks that the plan was made for it (`ParallelPlan.check_model`), and
runs its stage with the runner `runtime.torch_pipeline.make_runner` picks (``torch.distributed.pipelining``
when the stages' submeshes are equal, else `runtime.pipeline.PipelineRunner`; ``pipeline="ours"`` or
``MESHPLAN_PIPELINE=ours`` forces the latter); the optimizer (`runtime.shard_optim.ShardOptimizer`:
``torch.optim`` on the local tensors of the stage's DTensor parameters) updates each rank's shards
after the gradient sync.

Random ops (dropout in training mode) draw what one device draws: single-device training
``torch.manual_seed(seed)`` followed by steps of ``model(*batch).backward(); opt.step()`` is
reproduced by ``train(..., seed=seed)`` (`runtime.dropout.DropoutMasks`: a generator per rank, each
step's samples drawn at the global batch's shapes in the forward's order, each rank keeping its
shards). With ``seed=None`` the generator starts from the default generator's state when the
`Trainer` is made (equal on every rank when the ranks seeded alike), which reproduces one device
that goes on from that state without reseeding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph, TensorMeta
from planner.tracing.tracer import trace
from planner.vocab.plan_file import ParallelPlan
from runtime.dropout import DropoutMasks, samples_randomly
from runtime.peak_memory import PeakMemory
from runtime.pipeline import PipelineRunner
from runtime.shard_optim import OPTIMIZERS, ShardOptimizer
from runtime.torch_pipeline import make_runner

__all__ = [
    "Trainer",
    "measure_peak_memory",
    "run_local",
    "seeded_model_and_batches",
    "split_batch",
    "stage_peaks",
    "train",
]

Batch = tuple[torch.Tensor, ...]


def split_batch(batch: Sequence[torch.Tensor], n: int) -> list[Batch]:
    """A global batch as `n` equal micro-batches (along dimension 0)."""
    rows = int(batch[0].shape[0])
    if rows % n:
        raise MeshplanError(
            f"a batch of {rows} rows does not split into {n} micro-batches"
        )
    return [tuple(t.chunk(n, dim=0)[i] for t in batch) for i in range(n)]


def _param_dtype(graph: OpGraph) -> str | None:
    """The dtype of the graph's floating parameters when they share one, else None."""
    dtypes = {m.dtype for m in graph.params.values() if "float" in m.dtype}
    return dtypes.pop() if len(dtypes) == 1 else None


def _check_graph_params(graph: OpGraph, model: nn.Module) -> None:
    mine = {k: TensorMeta.of(p) for k, p in model.named_parameters()}
    if mine != graph.params:
        wrong = sorted(set(mine) ^ set(graph.params)) or [
            k for k in mine if mine[k] != graph.params[k]
        ]
        raise MeshplanError(
            f"the graph given is not this model's trace: its parameters differ at "
            f"{', '.join(wrong[:3])}; pass the model's own trace (planner.trace) or none"
        )


class Trainer:
    """One rank's share of training `model` under `plan` (module docstring). ``compile``: run
    the stages through AOTAutograd-compiled graphs (`runtime.pipeline.PipelineRunner`).
    ``seed``: the random ops' samples are those of one device after ``torch.manual_seed(seed)``
    (None: from the default generator's current state); ``masks`` holds them (None when the
    model draws nothing). ``graph``: the model's trace (`planner.trace`) at one micro-batch of
    `example_batch`, for a caller that holds it already (several trainers of one model in a
    process: `graph` of an earlier one); traced here when None. Its parameters must be the
    model's (names, shapes and dtypes are checked; the ops are trusted)."""

    def __init__(
        self,
        plan: ParallelPlan,
        model: nn.Module,
        example_batch: Sequence[torch.Tensor],
        *,
        optimizer: str = "sgd",
        lr: float = 0.1,
        schedule: str | None = None,
        device_type: str = "cpu",
        pipeline: str | None = None,
        compile: bool = True,
        seed: int | None = None,
        graph: OpGraph | None = None,
    ) -> None:
        if optimizer not in OPTIMIZERS:
            raise MeshplanError(f"optimizer {optimizer!r}: use one of {OPTIMIZERS}")
        self.plan = plan
        rng = torch.default_generator.get_state()
        micro = split_batch(example_batch, plan.num_microbatches)[0]
        if graph is None:
            graph = trace(model, micro, model_name=plan.model.get("name", ""))
        else:
            _check_graph_params(graph, model)
        plan.check_model(graph.fingerprint(), graph.model_name, _param_dtype(graph))
        self.graph = graph
        self.masks: DropoutMasks | None = None
        if samples_randomly(graph):
            whole = graph
            if plan.num_microbatches > 1:  # the samples' shapes at the global batch
                whole = trace(model, example_batch, model_name=graph.model_name)
            self.masks = DropoutMasks(
                graph, whole, plan.num_microbatches, seed=seed, state=rng
            )
        self.runner: PipelineRunner = make_runner(
            plan,
            graph,
            device_type=device_type,
            schedule=schedule,
            impl=pipeline,
            compile=compile,
        )
        full = {k: p.detach().clone() for k, p in model.named_parameters()}
        self.buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
        self.params = self.runner.place_params(full)
        if self.masks is not None:
            for ex in self.runner.executors.values():
                self.masks.attach(ex)
        self.optimizer: ShardOptimizer | None = None
        if self.params:
            self.optimizer = ShardOptimizer(
                self.params, optimizer, lr=lr, device_type=device_type
            )

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One training step on a global batch; its loss (the same on every rank)."""
        micro = split_batch(batch, self.plan.num_microbatches)
        if self.masks is not None:
            self.masks.draw()
        loss = self.runner.step(self.params, micro, self.buffers)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss)  # waits for the device only now, the update queued

    def full_params(self) -> dict[str, torch.Tensor]:
        """This rank's stage's parameters as full tensors (collective within the stage's mesh)."""
        return {k: p.full_tensor().detach() for k, p in self.params.items()}


def train(
    plan: ParallelPlan,
    model_fn: Callable[[], nn.Module],
    batches: Sequence[Sequence[torch.Tensor]],
    *,
    optimizer: str = "sgd",
    lr: float = 0.1,
    steps: int | None = None,
    schedule: str | None = None,
    pipeline: str | None = None,
    seed: int | None = None,
) -> list[float]:
    """Train for `steps` steps (default: one per batch; batches are reused cyclically) and return
    the per-step losses. Runs inside every rank of an initialised default process group.
    ``seed``: random ops (dropout) draw what one device draws after ``torch.manual_seed(seed)``
    before its first step (None: from the default generator's state after `model_fn`; module
    docstring)."""
    if not batches:
        raise MeshplanError("train needs at least one batch")
    trainer = Trainer(
        plan,
        model_fn(),
        batches[0],
        optimizer=optimizer,
        lr=lr,
        schedule=schedule,
        pipeline=pipeline,
        seed=seed,
    )
    n = len(batches) if steps is None else steps
    return [trainer.step(batches[i % len(batches)]) for i in range(n)]


def measure_peak_memory(
    plan: ParallelPlan,
    model: nn.Module,
    batches: Sequence[Sequence[torch.Tensor]],
    *,
    device_type: str = "cpu",
    **trainer_kw: Any,
) -> list[dict[str, Any]]:
    """Every rank's peak memory in a training step of `plan`, against the plan's prediction.
    Runs inside every rank of a launched group; every rank gets every rank's record.

    A `Trainer` is built inside a `runtime.peak_memory.PeakMemory` recorder, trains one step on
    ``batches[0]`` (first-step allocations: optimizer state, compiled graphs), then the peak is
    recorded over one more step on ``batches[1 % len]``: the bytes of live tensors the allocator
    reports, what the trainer holds (its parameter shards, optimizer state) and what the step
    allocates. Under the profiler on the CPU such a step takes about twice its time: a dedicated
    step, never a timed one. Per rank: ``rank``, ``stages`` (the plan's stage indices it runs),
    ``predicted_bytes`` (its stages' ``memory_bytes``: the plan's peak per device of that device
    group), ``measured_bytes`` and ``ratio`` (predicted / measured)."""
    import gc

    import torch.distributed as dist

    gc.collect()  # free what earlier work left, before the recorder starts (module docstring)
    with PeakMemory(device_type) as rec:
        trainer = Trainer(
            plan, model, batches[0], device_type=device_type, **trainer_kw
        )
        trainer.step(batches[0])
        rec.steps_begin()
        trainer.step(batches[1 % len(batches)])
        del trainer
    rank = dist.get_rank()
    stages = [i for i, s in enumerate(plan.stages) if rank in s.devices]
    predicted = plan.stages[stages[0]].memory_bytes if stages else 0.0
    mine = {
        "rank": rank,
        "stages": stages,
        "predicted_bytes": predicted,
        "measured_bytes": rec.peak_bytes,
        "ratio": predicted / rec.peak_bytes if rec.peak_bytes else None,
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def stage_peaks(
    plan: ParallelPlan, ranks: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per stage of `plan`: its predicted peak per device and the largest measured peak of its
    devices (from `measure_peak_memory`'s records), and their ratio."""
    by_rank = {r["rank"]: r["measured_bytes"] for r in ranks}
    out = []
    for i, s in enumerate(plan.stages):
        measured = max(by_rank[d] for d in s.devices)
        out.append(
            {
                "stage": i,
                "predicted_bytes": s.memory_bytes,
                "measured_bytes": measured,
                "ratio": s.memory_bytes / measured if measured else None,
            }
        )
    return out


def _random_batches(example: Batch, steps: int, seed: int = 0) -> list[Batch]:
    """`steps` batches shaped like `example`: integers drawn below the example's maximum + 1,
    floats from a normal distribution (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        b = []
        for t in example:
            if t.is_floating_point():
                b.append(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                b.append(
                    torch.randint(
                        0, int(t.max()) + 1, t.shape, generator=gen, dtype=t.dtype
                    )
                )
        out.append(tuple(b))
    return out


def seeded_model_and_batches(
    model: str,
    global_batch: int,
    steps: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, list[Batch]]:
    """The built-in model `model` (name or spec) built on the CPU after ``torch.manual_seed(seed)``,
    and `steps` synthetic global batches of `global_batch` rows drawn from `seed`: the same on every
    rank and whatever the plan, so runs of different plans (and one device) are comparable."""
    from planner.models import build_model

    torch.manual_seed(seed)
    m, b = build_model(model, batch=global_batch, device="cpu", dtype=dtype)
    example = tuple(b) if isinstance(b, (tuple, list)) else (b,)
    return m, _random_batches(example, steps, seed)


def _model_and_batch(
    model: str | Callable[..., Any], batch: int
) -> tuple[nn.Module, Batch]:
    from planner.models import build_model

    torch.manual_seed(0)
    if isinstance(model, str):
        m, b = build_model(model, batch=batch, device="cpu", dtype=torch.float32)
    else:
        m, b = model()
    return m, tuple(b) if isinstance(b, (tuple, list)) else (b,)


def _local_rank(plan: ParallelPlan, model: Any, steps: int, kw: dict) -> list[float]:
    m, example = _model_and_batch(model, plan.global_batch)
    batches = _random_batches(example, steps)
    return train(plan, lambda: m, batches, steps=steps, **kw)


def run_local(
    plan: ParallelPlan,
    model: str | Callable[[], tuple[nn.Module, Any]],
    steps: int = 3,
    nproc: int | None = None,
    **kw: Any,
) -> list[float]:
    """Launch `nproc` local ranks (default: the plan's devices) and train `model` (a model name or
    spec built seeded in float32, or a picklable function returning ``(module, batch)``) for
    `steps` steps on seeded random batches; rank 0's losses. ``kw`` goes to `train`."""
    from runtime.launch import launch

    n = nproc or max(r for s in plan.stages for r in s.devices) + 1
    return launch(_local_rank, n, args=(plan, model, steps, kw))[0]
