"""Views of a dimension sharded on two mesh axes (`planner.vocab.nested_views`): the strategies
the planner adds from their geometry, and DTensor running them as planned (the runtime's side;
the trained plans are in tests/test_context_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.experimental.proxy_tensor import make_fx

from planner.intra import dtensor_rules as dr
from planner.intra.strategies import node_strategies
from planner.vocab.dtensor_ext import placement_to_str, str_to_placement
from planner.vocab.nested_views import (
    NESTED_SOURCE,
    nested_unflatten,
    nested_view_strategies,
)
from runtime.redistribute import relabel, same_layout, strided_writing


def _pairs(in_shape: tuple, out_shape: tuple, mesh: tuple) -> list[tuple]:
    return [
        (s.inputs[0], s.output[0])
        for s in nested_view_strategies(in_shape, out_shape, mesh)
    ]


def test_geometry() -> None:
    """One row per device of the outer axis, the inner dim divisible by the inner axis: the
    flatten keeps both splits on the merged dim, the unflatten gives them back; anything else
    has none."""
    split, merged = ("S(0)", "S(1)"), ("S(0)", "S(0)")
    assert _pairs((4, 8, 16), (32, 16), (4, 2)) == [(split, merged)]
    assert _pairs((32, 16), (4, 8, 16), (4, 2)) == [(merged, split)]
    assert _pairs((2, 8, 4, 16), (2, 32, 16), (2, 4)) == []  # dims 1, 2 merged: 8 != 2
    assert _pairs((2, 8, 4, 16), (2, 32, 16), (8, 4)) == [
        (("S(1)", "S(2)"), ("S(1)", "S(1)"))
    ]
    assert _pairs((8, 8, 16), (64, 16), (4, 2)) == []  # two rows per device: strided
    assert _pairs((4, 6, 16), (24, 16), (4, 4)) == []  # 6 does not split over 4
    assert _pairs((4, 8, 16), (32, 16), (4, 1)) == []  # one axis only
    assert _pairs((4, 8, 16), (4, 128), (4, 2)) == []  # another view
    # three axes: every ordered pair whose outer one has 2 devices, the third replicated,
    # partial or sharding the dim the view leaves alone
    assert _pairs((2, 8, 16), (16, 16), (2, 2, 2)) == [
        (("S(0)", "S(1)", "R"), ("S(0)", "S(0)", "R")),
        (("S(0)", "S(1)", "P"), ("S(0)", "S(0)", "P")),
        (("S(0)", "S(1)", "S(2)"), ("S(0)", "S(0)", "S(1)")),
        (("S(0)", "R", "S(1)"), ("S(0)", "R", "S(0)")),
        (("S(0)", "P", "S(1)"), ("S(0)", "P", "S(0)")),
        (("S(0)", "S(2)", "S(1)"), ("S(0)", "S(1)", "S(0)")),
        (("R", "S(0)", "S(1)"), ("R", "S(0)", "S(0)")),
        (("P", "S(0)", "S(1)"), ("P", "S(0)", "S(0)")),
        (("S(2)", "S(0)", "S(1)"), ("S(1)", "S(0)", "S(0)")),
    ]
    # the third axis shards only a dim that divides by it
    assert (("S(0)", "S(1)", "S(2)"), ("S(0)", "S(0)", "S(1)")) not in _pairs(
        (2, 8, 6), (16, 6), (2, 2, 4)
    )
    assert nested_unflatten(merged, split) == 1
    assert nested_unflatten(split, merged) is None
    assert nested_unflatten(merged, merged) is None


def _view_nodes(rows: int) -> list[torch.fx.Node]:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.view(rows * 8, 16), w).view(rows, 8, 16)

    g = make_fx(f)(torch.randn(rows, 8, 16), torch.randn(16, 16))
    return [n for n in g.graph.nodes if n.target is torch.ops.aten.view.default]


@pytest.mark.parametrize("rows, expected", [(4, 1), (8, 0)])
def test_planner_adds_them_once(rows: int, expected: int) -> None:
    """DTensor's probes give neither view (strided output, or an unflatten DTensor cannot run);
    the planner adds each once, only where one row lies on each device of axis 0."""
    for node in _view_nodes(rows):
        got = node_strategies(node, (4, 2))
        nested = [s for s in got if s.source == NESTED_SOURCE]
        assert len(nested) == expected
        assert len({s.inputs for s in got}) == len(got)  # no input placement twice


def _parse(strs: tuple[str, ...]) -> tuple:
    return tuple(str_to_placement(p) for p in strs)


def test_dtensor_runs_them_as_planned() -> None:
    """The flatten's output comes written as ``_StridedShard(0, 1)`` on axis 1, the plan's
    "S(0)" (same layout, relabelled without data); the unflatten of the strided writing gives
    the planned placement and local shape."""
    mesh = dr.get_mesh((4, 2))
    flatten, unflatten = (
        nested_view_strategies(*shapes, (4, 2))[0]
        for shapes in (((4, 8, 16), (32, 16)), ((32, 16), (4, 8, 16)))
    )
    x = DTensor.from_local(
        torch.randn(1, 4, 16), mesh, _parse(flatten.inputs[0]), run_check=False
    )
    y = x.view(32, 16)
    assert tuple(placement_to_str(p) for p in y.placements) == flatten.output[0]
    assert isinstance(y.placements[1], _StridedShard)
    planned = _parse(unflatten.inputs[0])
    assert same_layout(y.placements, planned) and y.placements != planned
    y = relabel(y, planned)
    assert y.to_local().shape == (4, 16) and y.placements == (Shard(0), Shard(0))
    b = nested_unflatten(unflatten.inputs[0], unflatten.output[0])
    z = relabel(y, strided_writing(planned, b)).view(4, 8, 16)
    assert z.placements == _parse(unflatten.output[0])
    assert z.to_local().shape == (1, 4, 16)


def test_dtensor_runs_them_on_three_axes() -> None:
    """On a (dp, cp, tp) mesh every strategy, the third axis replicated, partial or sharding
    the hidden dim, is what DTensor's own view gives, flatten then unflatten, with the planned
    local shapes."""
    shape, flat, mesh_shape = (2, 8, 16), (16, 16), (2, 2, 2)
    mesh = dr.get_mesh(mesh_shape)
    flattens = nested_view_strategies(shape, flat, mesh_shape)
    unflattens = nested_view_strategies(flat, shape, mesh_shape)
    assert len(flattens) == len(unflattens) == 9
    for f, u in zip(flattens, unflattens, strict=True):
        assert (f.output[0], f.inputs[0]) == (u.inputs[0], u.output[0])
        local, _ = compute_local_shape_and_global_offset(
            shape, mesh, _parse(f.inputs[0])
        )
        x = DTensor.from_local(
            torch.randn(local), mesh, _parse(f.inputs[0]), run_check=False
        )
        y = x.view(*flat)
        planned = _parse(u.inputs[0])
        assert same_layout(y.placements, planned)
        b = nested_unflatten(u.inputs[0], u.output[0])
        z = relabel(relabel(y, planned), strided_writing(planned, b)).view(*shape)
        assert tuple(placement_to_str(p) for p in z.placements) == u.output[0]
        assert tuple(z.to_local().shape) == tuple(local)
