"""`runtime.grad_sync.sync_grads`: bucketed gradient synchronisation against DTensor's own.

One gloo launch of 4 ranks on a (2, 2) mesh. Every gradient is built partial (different values
on every rank), and its full value is taken with DTensor's ``full_tensor`` before the sync; after
it, each gradient must be placed as its parameter and hold that same full value. The collectives
issued are counted (`runtime.comm_count.CommCounter`): one reduce-scatter for the bucket of
``Partial -> Shard(0)`` gradients on axis 1, one all-reduce for the ``Partial -> Replicate`` one,
and one redistribution each for the gradients that fit no bucket.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.launch import launch

pytestmark = pytest.mark.slow  # every test reads the launch of 4 gloo ranks

# name: (shape, parameter placements, gradient placements)
CASES = {
    "scatter_a": ((8, 4), ("R", "S0"), ("R", "P")),
    "scatter_b": ((6, 3), ("R", "S0"), ("R", "P")),
    "reduce": ((4, 4), ("S0", "R"), ("S0", "P")),
    "both_axes": ((4, 6), ("R", "S1"), ("P", "P")),  # all-reduce and reduce-scatter
    "uneven": ((5, 4), ("R", "S0"), ("R", "P")),  # 5 rows do not split in 2
    "nested": ((8, 2), ("S0", "S0"), ("S0", "P")),  # dim 0 already split on axis 0
}


def _placement(s: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial()}.get(s) or Shard(int(s[1:]))


def _body() -> dict[str, Any]:
    import logging

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from runtime.comm_count import CommCounter
    from runtime.grad_sync import sync_grads
    from runtime.meshes import device_mesh

    logging.getLogger("torch.distributed.tensor").setLevel(
        logging.ERROR
    )  # 2-D mesh notes
    mesh = device_mesh("cpu", torch.arange(4).view(2, 2))
    rank = dist.get_rank()
    params, want = {}, {}
    for i, (name, (shape, p_pl, g_pl)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        full = torch.randn(shape)
        p = distribute_tensor(full, mesh, [_placement(x) for x in p_pl])
        p.requires_grad_()
        # the gradient: a local piece shaped as `g_pl` needs, different on every rank
        ref = distribute_tensor(
            full, mesh, [_placement(x.replace("P", "R")) for x in g_pl]
        )
        local = ref.to_local() * (rank + 1) + rank
        g = DTensor.from_local(local, mesh, [_placement(x) for x in g_pl])
        want[name] = g.full_tensor()
        p.grad = g
        params[name] = p
    with CommCounter() as counter:
        sync_grads(params)
    out = {
        name: {
            "placed": p.grad.placements == p.placements,
            "close": torch.allclose(p.grad.full_tensor(), want[name]),
        }
        for name, p in params.items()
    }
    sites = [
        (r.site, r.kind) for r in counter.records if r.site.startswith("bwd:sync:")
    ]
    return {"grads": out, "sites": sites}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_body, 4, timeout_s=300)


def test_synchronised_gradients_equal_dtensors(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert all(v == {"placed": True, "close": True} for v in r["grads"].values()), r


def test_buckets_issue_one_collective_each(runs: list[dict[str, Any]]) -> None:
    sites = runs[0]["sites"]
    print(sites)
    by_param = {}
    for site, kind in sites:
        by_param.setdefault(site.removeprefix("bwd:sync:"), []).append(kind)
    # the two scatter gradients share one reduce-scatter; the others have their own collectives
    assert by_param["scatter_a"] == ["reduce_scatter"] and "scatter_b" not in by_param
    assert by_param["reduce"] == ["all_reduce"]
    assert set(by_param) == {"scatter_a", "reduce", "both_axes", "uneven", "nested"}
