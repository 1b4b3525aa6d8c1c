"""runtime.shard_optim.ShardOptimizer: ``torch.optim`` on the DTensor parameters' local shards.

One gloo launch of 2 ranks: parameters on a 2-rank mesh, half sharded (``Shard(0)``, one of them
unevenly: 5 rows over 2 ranks) and half replicated, take three steps of Adam and of SGD with
gradients that change per step; one replicated parameter's gradient arrives sharded (it must
be redistributed to the parameter's placements) and one parameter has no gradient at one step.
The parameters and the Adam state, gathered, equal those of single-tensor ``torch.optim`` over
full tensors (the ground truth); the state reads back as DTensors placed like their parameters;
`zero_grad` drops the DTensor gradients.

And the order of a `runtime.train.Trainer` step, which on a GPU decides whether the host waits
for the device: in each runner (ours with two micro-batches, torch.distributed.pipelining over
two stages) the step reads no tensor's value (``float()``, ``.item()``: each would wait for the
device), and `Trainer.step` reads the loss once, after it has launched the optimizer's update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from runtime.launch import launch

SHAPES = [(6, 4), (5, 3), (4,), (3, 2)]
STEPS = 3


def _grad(i: int, step: int) -> torch.Tensor | None:
    if i == 2 and step == 1:
        return None
    g = torch.Generator().manual_seed(100 * step + i)
    return torch.randn(SHAPES[i], generator=g)


def _rank(kind: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from runtime.shard_optim import ShardOptimizer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = [
        torch.randn(s, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SHAPES)
    ]
    places = [[Shard(0)], [Shard(0)], [Replicate()], [Replicate()]]
    params = {
        f"p{i}": distribute_tensor(f.clone(), mesh, pl).requires_grad_(True)
        for i, (f, pl) in enumerate(zip(full, places))
    }
    opt = ShardOptimizer(params, kind, lr=0.05)
    ref = [f.clone().requires_grad_(True) for f in full]
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
    ref_opt = cls(ref, lr=0.05, foreach=False)
    for step in range(STEPS):
        for i, (p, r) in enumerate(zip(params.values(), ref)):
            g = _grad(i, step)
            r.grad = g
            if g is not None:
                # p3's gradient arrives sharded although p3 is replicated
                pl = [Shard(0)] if i == 3 else p.placements
                p.grad = distribute_tensor(g, mesh, pl)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state = opt.state
    return {
        "params": [p.full_tensor().detach().numpy().copy() for p in params.values()],
        "ref": [r.detach().numpy().copy() for r in ref],
        "grads_dropped": all(p.grad is None for p in params.values()),
        "state": {
            k: {
                n: (
                    v.full_tensor().numpy().copy(),
                    tuple(v.placements) == tuple(p.placements),
                )
                for n, v in state[p].items()
                if isinstance(v, DTensor)
            }
            for k, p in params.items()
            if p in state
        },
        "ref_state": {
            f"p{i}": {
                n: v.numpy().copy() for n, v in ref_opt.state[r].items() if n != "step"
            }
            for i, r in enumerate(ref)
            if r in ref_opt.state
        },
    }


SPEC = "gpt:hidden=32,layers=2,heads=2,seq=8,vocab=64"


def _reads(plans: dict[str, Any]) -> dict[str, list[str]]:
    """Per plan: what a runner step, then a Trainer step, did in order: "read" for each value
    read off a tensor outside the optimizer's update (the update's own reads are not counted:
    foreach Adam reads its step counters, fused Adam does not), "update" for the optimizer's
    step."""
    from runtime.shard_optim import ShardOptimizer
    from runtime.train import Trainer, seeded_model_and_batches, split_batch

    events: list[str] = []
    read_float, read_item = torch.Tensor.__float__, torch.Tensor.item
    update = ShardOptimizer.step

    inside: list[bool] = []  # set during the update, whose own reads are not counted

    def spy(read: Any) -> Any:
        def reading(self: torch.Tensor) -> Any:
            if not inside:
                events.append("read")
            return read(self)

        return reading

    def spy_update(self: ShardOptimizer) -> None:
        events.append("update")
        inside.append(True)
        try:
            update(self)
        finally:
            inside.pop()

    out = {}
    for name, plan in plans.items():
        model, batches = seeded_model_and_batches(SPEC, 4, 2)
        tr = Trainer(plan, model, batches[0], optimizer="adam", lr=0.01)
        tr.step(batches[0])  # the first step compiles
        torch.Tensor.__float__, torch.Tensor.item = spy(read_float), spy(read_item)
        ShardOptimizer.step = spy_update
        try:
            events.clear()
            tr.runner.step(tr.params, split_batch(batches[1], 2), tr.buffers)
            tr.optimizer.zero_grad()
            events.append("|")
            tr.step(batches[1])
        finally:
            torch.Tensor.__float__, torch.Tensor.item = read_float, read_item
            ShardOptimizer.step = update
        out[name] = list(events)
    return out


def _both(plans: dict[str, Any]) -> dict[str, Any]:
    return {kind: _rank(kind) for kind in ("adam", "sgd")} | {"reads": _reads(plans)}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    from planner.plans.manual import manual_plan

    plans = {
        name: manual_plan(
            SPEC,
            "1x2xA100-80GB",
            dp=dp,
            tp=1,
            pp=pp,
            num_microbatches=2,
            global_batch=4,
            dtype=torch.float32,
        )
        for name, dp, pp in (("dp2_mb2", 2, 1), ("pp2", 1, 2))
    }
    out = launch(_both, 2, args=(plans,))
    return {key: [r[key] for r in out] for key in ("adam", "sgd", "reads")}


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_steps_the_local_shards_as_one_device_steps_the_tensors(
    results: dict, kind: str
) -> None:
    for r in results[kind]:
        for got, want in zip(r["params"], r["ref"]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert r["grads_dropped"]


def test_adam_state_reads_back_as_dtensors_placed_like_the_parameters(
    results: dict,
) -> None:
    for r in results["adam"]:
        assert set(r["state"]) == set(r["ref_state"]) == {"p0", "p1", "p2", "p3"}
        for k, names in r["ref_state"].items():
            assert set(r["state"][k]) == set(names) == {"exp_avg", "exp_avg_sq"}
            for n, want in names.items():
                got, placed = r["state"][k][n]
                assert placed, (k, n)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_unknown_optimizer_is_refused() -> None:
    from cost_models.errors import MeshplanError
    from runtime.shard_optim import ShardOptimizer

    with pytest.raises(MeshplanError, match="use one of"):
        ShardOptimizer({}, "lamb", lr=0.1)


def test_a_step_reads_the_loss_once_after_launching_the_update(results: dict) -> None:
    for rank in results["reads"]:
        assert set(rank) == {"dp2_mb2", "pp2"}
        for name, events in rank.items():
            # the runner's step reads nothing; the trainer's step: the update, then one read
            assert events == ["|", "update", "read"], name
