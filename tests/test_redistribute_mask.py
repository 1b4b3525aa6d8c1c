"""A vocabulary-parallel embedding's output converted locally to Partial("sum") releases its mask.

DTensor caches the `_MaskPartial` placement with the op's sharding, so a mask left materialized
after `runtime.redistribute` converted the output made the next call with other indices fail
("MaskBuffer has been materialized with conflicting data"), which the local suite hit on its second
training step. One launch of 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from runtime.launch import launch

pytestmark = pytest.mark.slow  # launches 2 gloo ranks


def _two_lookups() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from runtime.redistribute import redistribute

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    weight = torch.randn(16, 4)
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None)
    ok = []
    for seed in (1, 2):  # different indices each time, as in successive training steps
        idx = torch.randint(
            0, 16, (3, 5), generator=torch.Generator().manual_seed(seed)
        )
        i = distribute_tensor(idx, mesh, [Replicate()], src_data_rank=None)
        out = torch.ops.aten.embedding.default(w, i)
        assert type(out.placements[0]).__name__ == "_MaskPartial"
        summed = redistribute(out, [Partial("sum")])
        full = redistribute(summed, [Replicate()]).to_local()
        ok.append(torch.equal(full, torch.nn.functional.embedding(idx, weight)))
    return ok


def test_mask_partial_converts_on_every_step():
    assert launch(_two_lookups, 2, timeout_s=120) == [[True, True], [True, True]]
