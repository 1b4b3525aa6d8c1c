"""Tensors made from data in a model's forward (planner.tracing.constants): written into the graph
as factory ops, or an error naming the module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner import trace


class Scaled(nn.Module):
    """Makes one-valued and empty tensors from data in its forward, as Falcon and GraniteMoE do."""

    def __init__(self, values: list[float] | float = 2.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.values = values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * torch.tensor(self.values)
        y = torch.cat([y.flatten(), torch.tensor([])])
        return y.square().mean()


def test_constants_become_factory_ops() -> None:
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(3, 4)
    graph = trace(model, (x,))
    nodes = list(graph.gm.graph.nodes)
    assert not [n for n in nodes if n.op == "get_attr"]
    fulls = [n for n in nodes if n.target is torch.ops.aten.full.default]
    assert sorted(tuple(n.args[0]) for n in fulls) == [(), (0,)]
    # the graph computes the model's loss
    loss = graph.gm(dict(model.named_parameters()), {}, (x,))
    assert torch.allclose(
        loss[0] if isinstance(loss, (list, tuple)) else loss, model(x)
    )


def test_constant_of_many_values_names_its_module() -> None:
    with pytest.raises(
        MeshplanError, match="tensor from data in its forward.*register_buffer"
    ):
        trace(Scaled([1.0, 2.0, 3.0, 4.0]), (torch.randn(3, 4),))
