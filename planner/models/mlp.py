"""A small multi-layer perceptron classifier for tests and demos.

``fc_in: Linear(in_features, hidden)``, then ``layers`` blocks of ``Linear(hidden, hidden)`` + GeLU
(``blocks``), then ``head: Linear(hidden, classes)``; ``forward(x[B, in_features], y[B])`` returns
the mean cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError

__all__ = ["MLP", "MLPConfig", "mlp_param_count"]


@dataclass(frozen=True)
class MLPConfig:
    """Input features, hidden width, number of hidden blocks and number of classes."""

    in_features: int = 64
    hidden: int = 256
    layers: int = 4
    classes: int = 16

    def __post_init__(self) -> None:
        for key in ("in_features", "hidden", "layers", "classes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"MLP {key} must be a positive integer, got {value!r}"
                )


def mlp_param_count(config: MLPConfig) -> int:
    """Closed-form parameter count of ``MLP(config)`` (all Linear layers have biases)."""
    h = config.hidden
    return (
        (config.in_features + 1) * h
        + config.layers * (h + 1) * h
        + (h + 1) * config.classes
    )


class MLP(nn.Module):
    """MLP classifier; ``forward(x[B, in_features], y[B] int64)`` returns the mean loss."""

    def __init__(self, config: MLPConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.fc_in = nn.Linear(config.in_features, h, dtype=dtype)
        self.blocks = nn.ModuleList(
            nn.Linear(h, h, dtype=dtype) for _ in range(config.layers)
        )
        self.head = nn.Linear(h, config.classes, dtype=dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of ``x`` against the labels ``y``."""
        x = F.gelu(self.fc_in(x))
        for block in self.blocks:
            x = F.gelu(block(x))
        return F.cross_entropy(self.head(x), y)
