"""What the planner traces: a built-in model (name or spec) or an `nn.Module` with its example
batch, built at any batch size on the meta device."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.tracing.calls import batch_tuple
from planner.tracing.opgraph import OpGraph
from planner.tracing.tracer import trace
from planner.vocab.plan_check import DTYPES

#: The graphs of models named by a string that builds the same model every time
#: (`planner.models.registry.built_from_string_alone`), per (spec, micro-batch size, dtype, name),
#: the `TRACES_KEPT` used last. Planning reads a graph and never changes it, and one process
#: often plans a model many times: a manual grid prices each micro-batch size for dozens of
#: configurations, a session calls `plan` and `manual_plan` on one spec, a suite plans one model
#: on several clusters.
_TRACES: OrderedDict[tuple, OpGraph] = OrderedDict()
TRACES_KEPT = 16


@dataclass(frozen=True)
class ModelSource:
    """A model to plan at any micro-batch size: ``source(b)`` is (module on meta, batch of `b`
    rows), `trace(b)` its OpGraph. `spec`: the model's string when it builds the same model every
    time (its traces are then kept, `_TRACES`)."""

    name: str
    build: Callable[[int], tuple[nn.Module, tuple]]
    spec: str | None = None
    dtype: torch.dtype | None = None

    def __call__(self, b: int) -> tuple[nn.Module, tuple]:
        return self.build(b)

    def trace(self, b: int) -> OpGraph:
        key = (self.spec, b, self.dtype, self.name)
        if self.spec is not None and key in _TRACES:
            _TRACES.move_to_end(key)
            return _TRACES[key]
        module, batch = self.build(b)
        graph = trace(module, batch, model_name=self.name)
        if self.spec is not None:
            _TRACES[key] = graph
            while len(_TRACES) > TRACES_KEPT:
                _TRACES.popitem(last=False)
        return graph


def training_dtype(model: Any, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype `model` is planned in: `dtype` (a torch dtype or its name), by default float16
    for a model given by name or spec. An `nn.Module` is traced as it was built, in its
    parameters' dtype: a `dtype` other than theirs is an error naming both, instead of a plan
    in a dtype the caller did not ask for."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise MeshplanError(
                f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}"
            )
        dtype = getattr(torch, dtype)
    if not isinstance(model, nn.Module):
        return dtype or torch.float16
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if own is None:
        return dtype or torch.float32
    if dtype is not None and dtype != own:
        name = str(dtype).removeprefix("torch.")
        raise MeshplanError(
            f"the model's parameters are {str(own).removeprefix('torch.')}, but dtype "
            f"{name} was asked for: a module is planned as it is built; build it in {name} "
            f"(model.to(torch.{name}) on the meta device costs nothing) or leave dtype unset"
        )
    return own


def resolve_model(
    model: Any, example_batch: Any, dtype: torch.dtype, name: str | None
) -> tuple[str, ModelSource, int]:
    """(name, its `ModelSource`, default global batch)."""
    if isinstance(model, str):
        from planner.models import build_model
        from planner.models.registry import built_from_string_alone

        _, probe = build_model(model, device="meta", dtype=dtype)
        default = int(probe[0].shape[0]) if probe and probe[0].dim() else 1
        source = ModelSource(
            name or model,
            lambda b: build_model(model, batch=b, device="meta", dtype=dtype),
            model if built_from_string_alone(model) else None,
            dtype,
        )
        return source.name, source, default
    if not isinstance(model, nn.Module):
        raise MeshplanError(
            f"model must be an nn.Module or a model name, got {type(model).__name__}"
        )
    if example_batch is None:
        raise MeshplanError(
            "planning an nn.Module needs its example batch (a tensor or tuple of tensors)"
        )
    example_batch = batch_tuple(example_batch)
    batch = (
        example_batch if isinstance(example_batch, (tuple, list)) else (example_batch,)
    )
    default = int(batch[0].shape[0])

    def make(b: int):
        return model, tuple(
            t.new_empty((b, *t.shape[1:]), device="meta") for t in batch
        )

    source = ModelSource(name or type(model).__name__, make)
    return source.name, source, default
