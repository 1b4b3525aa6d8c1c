"""Dropout masks (and other random samples) drawn as one device draws them (principle 7).

Single-device training draws, at every step, one sample per random op of the forward in the
order the forward runs: ``nn.Dropout`` on the CPU calls ``empty_like(x).bernoulli_(1 - p)`` on the
default generator, at the shape of ``x`` for the *whole* batch. Under a plan every rank runs only
its shard of a micro-batch, so a rank drawing its own samples (DTensor's random-op support,
``OffsetBasedRNGTracker``, is not active on the CPU) uses masks no single device would. Instead,
`DropoutMasks` replays the single-device stream on every rank:

* **Sites.** The random nodes of the traced graph (`planner.tracing.tracer.is_random`), in graph
  order, which is the forward's order. Their shapes at the global batch come from a second trace
  at the global batch (`random_sites`): the one dimension whose size is the micro-batch's times
  the number of micro-batches holds the micro-batches' rows (none: every micro-batch reads the
  whole sample, as the one device's single forward does).
* **Stream.** A dedicated ``torch.Generator`` per rank, seeded with ``seed`` (the same as the
  reference's ``torch.manual_seed(seed)`` before its first step) or, with ``seed=None``, a copy of
  the default generator's state when the masks are made. Each step (`draw`) draws every site's
  full global sample in graph order, with the single device's call: ``bernoulli_`` in place on an
  empty tensor with the strides of the traced ``empty_like`` (a transposed input is drawn in
  memory order, which differs from a contiguous draw), other samplers by their aten op on empty
  tensors shaped like their inputs. One call per site at the full shape: the CPU kernel consumes
  the generator per call (the MKL path takes one seed per call), so drawing micro-batches or shards
  separately would not give the same numbers.
* **Shards.** Each rank keeps, per micro-batch, only the local shard of every site its stages run:
  the micro-batch's rows, sliced by the node's planned placement (``distribute_tensor`` with
  ``src_data_rank=None``: local slicing, no communication). Bernoulli masks are kept as ``bool``
  (their values are 0 and 1) and converted back when used.
* **Use.** `runtime.executor.PlanExecutor` (after `attach`) pre-fills the random nodes' values
  with these shards for the micro-batch it runs (and skips the ops that only shaped them, such as
  the ``empty_like``), in its eager, checkpointed and compiled paths alike: recomputation under
  activation checkpointing takes the mask as a segment input and reuses it; the AOTAutograd graphs
  (`runtime.compiled`) take it as an input, so no random op runs inside them.

Limits. Exact on the CPU, where the traced graph is what eager PyTorch runs; on GPUs the masks are
still drawn on the CPU (so every plan trains like one CPU device, not like CUDA's fused dropout,
which uses a different generator). Every rank draws every site's full global sample each step
(time and, transiently, memory of one global activation per site); its shards of all micro-batches
stay until the micro-batch's forward takes them. Random ops whose result depends on their inputs'
values (``bernoulli(probabilities)``, ``multinomial``, ``normal(mean_tensor)``) cannot be drawn
ahead: they keep drawing on each rank (`unreproduced`, warned). Kernels that draw inside
(``native_dropout``; fused attention with ``dropout_p > 0``: flash / memory-efficient kernels use
their own Philox stream) cannot be reproduced shard-wise either (`fused_dropout`, warned once). A
CPU trace records neither: ``F.scaled_dot_product_attention(dropout_p > 0)`` on the CPU runs
PyTorch's math path, whose ``bernoulli`` is an ordinary site, so attention dropout is reproduced.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.fx.node import map_aggregate, map_arg

from cost_models.errors import MeshplanError
from planner.tracing.opgraph import OpGraph
from planner.tracing.tracer import is_random
from planner.vocab.dtensor_ext import SHAPE_ONLY_SAMPLERS

# A `runtime.executor.PlanExecutor`; not imported, since the executor imports this module.
PlanExecutor = Any

__all__ = [
    "DropoutMasks",
    "Like",
    "RandomSite",
    "fused_dropout",
    "random_sites",
    "samples_randomly",
]

aten = torch.ops.aten
_warned: set[str] = set()


@dataclass(frozen=True)
class Like:
    """A tensor argument of a sampler at the global batch: only its layout matters."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def empty(self) -> torch.Tensor:
        """An uninitialised CPU tensor with this layout."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)


@dataclass(frozen=True)
class RandomSite:
    """One random node: its name in the traced graph, its op and arguments at the global batch
    (tensor arguments as `Like`), its global output shape, the dimension holding the
    micro-batches' rows (None: not batched) and whether it can be drawn ahead (its tensor inputs
    give only shapes)."""

    name: str
    target: Any
    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    batch_dim: int | None
    drawable: bool


def _random_nodes(graph: OpGraph) -> list[torch.fx.Node]:
    assert graph.gm is not None
    return [
        n
        for n in graph.gm.graph.nodes
        if n.op == "call_function" and is_random(n.target)
    ]


def random_sites(
    micro: OpGraph, full: OpGraph, num_microbatches: int
) -> list[RandomSite]:
    """The random nodes of `micro` (the graph traced at one micro-batch) in graph order, with
    their shapes and arguments taken from `full` (the same model traced at the global batch of
    ``num_microbatches`` micro-batches; `micro` itself when there is one)."""
    mine, theirs = _random_nodes(micro), _random_nodes(full)
    if [n.target for n in mine] != [n.target for n in theirs]:
        raise MeshplanError(
            "the model's random ops differ between the micro-batch and the global-batch traces "
            f"({len(mine)} and {len(theirs)}): its forward must draw the same samples whatever "
            "the batch size"
        )
    out = []
    for m, g in zip(mine, theirs):
        ms, gs = tuple(m.meta["val"].shape), tuple(g.meta["val"].shape)
        diff = [d for d in range(len(gs)) if len(ms) == len(gs) and ms[d] != gs[d]]
        if len(ms) != len(gs) or len(diff) > 1:
            raise MeshplanError(
                f"random op {m.name} ({m.target}) has shape {ms} per micro-batch and {gs} for "
                "the batch: cannot tell which of its rows belong to which micro-batch"
            )
        batch_dim = diff[0] if diff else None
        if batch_dim is not None and gs[batch_dim] != ms[batch_dim] * num_microbatches:
            raise MeshplanError(
                f"random op {m.name}: dimension {batch_dim} is {ms[batch_dim]} per micro-batch "
                f"and {gs[batch_dim]} for {num_microbatches} micro-batches"
            )
        drawable = g.target in SHAPE_ONLY_SAMPLERS or not g.all_input_nodes
        args, kwargs = map_arg(
            (g.args, g.kwargs),
            lambda a: Like(
                tuple(a.meta["val"].shape),
                tuple(a.meta["val"].stride()),
                a.meta["val"].dtype,
            ),
        )
        out.append(RandomSite(m.name, g.target, args, kwargs, gs, batch_dim, drawable))
    return out


def samples_randomly(graph: OpGraph) -> bool:
    """Whether `graph` has random ops or kernels that draw random numbers (`fused_dropout`)."""
    return bool(_random_nodes(graph) or fused_dropout(graph))


def fused_dropout(graph: OpGraph) -> list[str]:
    """Nodes of `graph` whose kernel draws its own random numbers: ``native_dropout`` and fused
    attention kernels called with ``dropout_p > 0`` (module docstring)."""
    assert graph.gm is not None
    out = []
    for n in graph.gm.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        name = t._opname
        if name == "native_dropout":  # (input, p, train): draws when training
            if n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True):
                out.append(n.name)
            continue
        if "attention" not in name:
            continue
        for i, a in enumerate(t._schema.arguments):
            if a.name == "dropout_p":
                p = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else 0.0)
                if p:
                    out.append(n.name)
    return out


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


@contextmanager
def _drawing_from(gen: torch.Generator) -> Iterator[None]:
    """The default CPU generator runs `gen`'s stream inside the block (aten samplers without a
    generator argument draw from it); its own state is restored after."""
    saved = torch.default_generator.get_state()
    torch.default_generator.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(saved)


class DropoutMasks:
    """The per-step random samples of a model's random ops, as one device draws them, sliced to
    this rank's shards (module docstring). Make it, `attach` every executor this rank runs, call
    `draw` before each step; the executors take their values with `take`.

    `micro` and `full` are the model traced at one micro-batch and at the global batch of
    `num_microbatches` micro-batches (`random_sites`). The generator starts from ``seed``
    (``torch.manual_seed(seed)``'s state), else from the CPU generator state ``state``, else from
    the default generator's current state."""

    def __init__(
        self,
        micro: OpGraph,
        full: OpGraph,
        num_microbatches: int,
        *,
        seed: int | None = None,
        state: torch.Tensor | None = None,
    ) -> None:
        self.sites = random_sites(micro, full, num_microbatches)
        self.num_microbatches = num_microbatches
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.set_state(
                torch.default_generator.get_state() if state is None else state
            )
        self.unreproduced = [s.name for s in self.sites if not s.drawable]
        if self.unreproduced:
            _warn_once(
                f"random ops {', '.join(self.unreproduced)} read their inputs' values, so their "
                "samples cannot be drawn ahead as one device draws them: each rank draws its own "
                "and training does not match one device"
            )
        fused = fused_dropout(micro)
        if fused:
            _warn_once(
                f"{', '.join(fused)} draw random numbers inside their kernels (fused dropout or "
                "attention with dropout_p > 0): each rank draws its own, so training does not "
                "match one device; use nn.Dropout / dropout on the attention probabilities"
            )
        self._users: dict[str, tuple[PlanExecutor, tuple]] = {}
        self._local: dict[tuple[str, int], torch.Tensor] = {}

    def attach(self, executor: PlanExecutor) -> None:
        """Serve `executor`'s random nodes: it pre-fills them from `take` from now on."""
        names = {n.name for n in executor.opgraph.gm.graph.nodes}
        for s in self.sites:
            if not s.drawable or s.name not in names:
                continue
            places = executor.placements(executor._planned_output(s.name))
            if not all(p.is_shard() or p.is_replicate() for p in places):
                raise MeshplanError(
                    f"random op {s.name} is planned as {places}: a sample can only be sharded "
                    "or replicated"
                )
            self._users[s.name] = (executor, places)
        executor.masks = self

    def draw(self) -> None:
        """One step's samples: every site's global sample in graph order from the generator, and
        this rank's shard of every micro-batch of the sites its executors run."""
        self._local.clear()
        if not self._users:
            return  # this rank runs none of them
        for s, full in self.global_samples():
            if s.name in self._users:
                self._keep(s, full)

    def global_samples(self) -> Iterator[tuple[RandomSite, torch.Tensor]]:
        """One step's samples at the global batch, site by site in graph order, as one device
        draws them (advances the generator; `draw` calls it)."""
        for s in self.sites:
            if s.drawable:
                with _drawing_from(self.generator):
                    full = self._sample(s)
                yield s, full

    @staticmethod
    def _sample(s: RandomSite) -> torch.Tensor:
        args, kwargs = map_aggregate(
            (s.args, s.kwargs), lambda a: a.empty() if isinstance(a, Like) else a
        )
        if s.target is aten.bernoulli.p:  # nn.Dropout's call: in place on empty_like(x)
            return args[0].bernoulli_(*args[1:], **kwargs)
        with torch.no_grad():
            return s.target(*args, **kwargs)

    def _keep(self, s: RandomSite, full: torch.Tensor) -> None:
        ex, places = self._users[s.name]
        if s.target is aten.bernoulli.p:
            full = full.to(torch.bool)
        full = full.to(ex.mesh.device_type)
        B = self.num_microbatches
        for m in range(B):
            piece = full
            if s.batch_dim is not None:
                rows = s.shape[s.batch_dim] // B
                piece = full.narrow(s.batch_dim, m * rows, rows)
            d = distribute_tensor(piece, ex.mesh, places, src_data_rank=None)
            local = d.to_local()
            self._local[s.name, m] = local.clone(memory_format=torch.contiguous_format)

    def take(self, executor: PlanExecutor, microbatch: int) -> dict[str, DTensor]:
        """Node name -> this rank's shard (a DTensor in the node's planned placement) of the
        current step's sample of micro-batch `microbatch`, for every site `executor` runs."""
        out = {}
        for name, (ex, places) in self._users.items():
            if ex is not executor:
                continue
            local = self._local.pop((name, microbatch), None)
            if local is None:
                raise MeshplanError(
                    f"no sample of {name} for micro-batch {microbatch}: call "
                    "DropoutMasks.draw() once before each step, and run each micro-batch's "
                    "forward once"
                )
            node = ex.opgraph.node(name).outputs[0]
            shape = torch.Size(node.shape)
            out[name] = DTensor.from_local(
                local.to(getattr(torch, node.dtype)),
                ex.mesh,
                places,
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )
        return out
