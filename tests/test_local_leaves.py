"""runtime.local_leaves: a compiled stage takes DTensor leaves as local aliases and hands their
gradients back into the DTensor leaves' ``.grad``, and its input signature keeps each parameter's
part, in one process (a gloo group of one rank).

The 4-rank checks (training under a pipeline x tensor plan, where some weights' gradients arrive
split otherwise than the weights and stay DTensor inputs) are in tests/test_compiled.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from runtime.compiled import CompiledStage


@pytest.fixture(scope="module")
def mesh() -> Iterator:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _leaf(mesh, t: torch.Tensor) -> DTensor:
    return DTensor.from_local(t.clone(), mesh, [Replicate()]).requires_grad_(True)


def _run(w: DTensor, x: DTensor) -> DTensor:
    return (torch.tanh(x @ w) * 2).sum()


def test_gradients_accumulate_into_the_dtensor_leaf_and_its_hooks_fire(mesh) -> None:
    torch.manual_seed(0)
    w0, xs = torch.randn(4, 3), [torch.randn(5, 4) for _ in range(3)]
    stage = CompiledStage(_run)
    w = _leaf(mesh, w0)
    fired: list[int] = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    for x in xs:  # three micro-batches, the gradient accumulating
        stage([w, DTensor.from_local(x, mesh, [Replicate()])]).backward()
    ref = w0.clone().requires_grad_(True)
    for x in xs:
        (torch.tanh(x @ ref) * 2).sum().backward()
    assert isinstance(w.grad, DTensor) and w.grad.placements == (Replicate(),)
    torch.testing.assert_close(w.grad.to_local(), ref.grad)
    assert fired == [True, True, True]  # once per accumulation, as autograd runs them
    assert stage.compiles == 1 and stage.compiled_calls == 3
    ((_, local),) = stage._fns.values()
    assert local.indices == [0]  # the weight went in as its local alias, x as a DTensor


def test_a_leaf_made_anew_each_step_does_not_keep_its_alias(mesh) -> None:
    """A ZeRO parameter's gathered copy is a new leaf every step: once it is gone, the stage
    holds neither its alias nor its storage."""
    stage = CompiledStage(_run)
    x = DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()])
    w = _leaf(mesh, torch.randn(4, 3))
    stage([w, x]).backward()
    ((_, local),) = stage._fns.values()
    assert len(local._aliases) == 1
    del w
    gc.collect()
    assert local._aliases == {}
    w2 = _leaf(mesh, torch.randn(4, 3))
    stage(
        [w2, x]
    ).backward()  # a fresh alias for the new leaf, the same compiled graphs
    assert stage.compiles == 1 and isinstance(w2.grad, DTensor)


def test_without_grad_nothing_is_aliased(mesh) -> None:
    stage = CompiledStage(_run)
    w = _leaf(mesh, torch.randn(4, 3))
    x = DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()])
    with torch.no_grad():
        out = stage([w, x])
    assert out is not None and w.grad is None
    ((_, local),) = stage._fns.values()
    assert local.indices == []


def test_the_signature_of_a_kept_parameter_follows_its_changes(mesh) -> None:
    """`runtime.compiled.signature` keeps each DTensor's part while the same local tensor and
    spec back it: a new key when requires_grad flips, the local tensor is swapped for one of
    other strides or the DTensor is placed anew; the old key when nothing changed."""
    from runtime.compiled import signature

    w = _leaf(mesh, torch.randn(4, 3))
    x = DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()])
    key = signature([w, x])
    assert (
        signature([w, DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()])])
        == key
    )
    w.requires_grad_(False)
    assert signature([w, x]) != key
    w.requires_grad_(True)
    assert signature([w, x]) == key
    w._local_tensor = torch.randn(3, 4).t()  # same shape, other strides
    assert signature([w, x]) != key
    assert signature([_leaf(mesh, torch.randn(4, 3)), x]) == key
    shard = DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_(True)
    assert signature([shard, x]) != key


def test_a_non_leaf_input_gets_its_own_graph(mesh) -> None:
    """An input that requires grad but is computed (not a leaf) is not aliased: its gradient
    flows on to what computed it, through a graph traced for it."""
    stage = CompiledStage(_run)
    x = DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()])
    stage([_leaf(mesh, torch.randn(4, 3)), x]).backward()
    base = _leaf(mesh, torch.randn(4, 3))
    stage([base * 2, x]).backward()  # the same shape and placements, not a leaf
    assert stage.compiles == 2
    ref = base.to_local().detach().clone().requires_grad_(True)
    _run(ref * 2, x.to_local()).backward()
    torch.testing.assert_close(base.grad.to_local(), ref.grad)
