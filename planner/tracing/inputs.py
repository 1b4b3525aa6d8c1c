"""What the planner traces: a built-in model (name or spec) or an `nn.Module` with its example
batch, built at any batch size on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.tracing.calls import batch_tuple


def resolve_model(
    model: Any, example_batch: Any, dtype: torch.dtype, name: str | None
) -> tuple[str, Callable[[int], tuple[nn.Module, tuple]], int]:
    """(name, batch_fn(b) -> (module, batch), default global batch)."""
    if isinstance(model, str):
        from planner.models import build_model

        _, probe = build_model(model, device="meta", dtype=dtype)
        default = int(probe[0].shape[0]) if probe and probe[0].dim() else 1
        return (
            name or model,
            lambda b: build_model(model, batch=b, device="meta", dtype=dtype),
            default,
        )
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

    return name or type(model).__name__, make, default
