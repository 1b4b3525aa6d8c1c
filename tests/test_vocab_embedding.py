"""`runtime.vocab_embedding` against `torch.nn.functional.embedding` on one device: a table of 11
rows split unevenly over 2 ranks (6 + 5), tokens in both shards, a padding index in the second
shard, once with the tokens replicated and once split by rows on a data-parallel axis. The
output (reduced over the vocabulary axis) and the table's gradient (each rank's rows, gathered)
equal one device's, the padding row's gradient zero; the gradient is this rank's rows only."""

from __future__ import annotations

import math
from typing import Any

import torch

from runtime.launch import launch

ROWS, DIM, PAD = 11, 3, 7
TOKENS = torch.tensor([[0, 5, 6, 10], [7, 3, 7, 9]])


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(ROWS, DIM, requires_grad=True)
    up = torch.randn(*TOKENS.shape, DIM)
    out = torch.nn.functional.embedding(TOKENS, w, padding_idx=PAD)
    (out * up).sum().backward()
    return out.detach(), w.grad


def _run(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """On every rank: the embedding on a mesh whose last axis splits the table."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from runtime.vocab_embedding import vocab_parallel_embedding

    torch.manual_seed(0)
    w0 = torch.randn(ROWS, DIM)
    up = torch.randn(*TOKENS.shape, DIM)
    mesh = init_device_mesh("cpu", mesh_shape)
    data = (Shard(0),) if len(mesh_shape) == 2 else ()  # tokens split by rows on axis 0
    table = (Replicate(),) * len(data) + (Shard(0),)
    w = distribute_tensor(w0, mesh, table).requires_grad_()
    ids = distribute_tensor(TOKENS, mesh, data + (Replicate(),))
    out_pl = data + (Partial(),)
    run = vocab_parallel_embedding(mesh, w0.shape, table, out_pl)
    out = run(w, ids, PAD)
    # reduced over the table's axis: this data-parallel rank's rows, whole
    mine = out.redistribute(mesh, data + (Replicate(),))
    up_mine = distribute_tensor(up, mesh, data + (Replicate(),)).to_local()
    (mine.to_local() * up_mine).sum().backward()  # the gradient sums over data ranks
    local_rows = w.grad.to_local().shape[0]
    everywhere = (Replicate(),) * mesh.ndim
    grad = w.grad.redistribute(mesh, everywhere).to_local()
    whole = mine.detach().redistribute(mesh, everywhere).to_local()
    return {
        "out": whole.clone().tolist(),
        "grad": grad.detach().clone().tolist(),
        "local_rows": int(local_rows),
    }


def test_matches_one_device_with_padding_and_uneven_shards() -> None:
    ref_out, ref_grad = _reference()
    assert ref_grad[PAD].abs().sum() == 0
    for shape in ((2,), (2, 2)):
        runs = launch(_run, math.prod(shape), args=(shape,), timeout_s=120)
        for rank, got in enumerate(runs):
            torch.testing.assert_close(torch.tensor(got["out"]), ref_out)
            torch.testing.assert_close(torch.tensor(got["grad"]), ref_grad)
            # the table's coordinate is the last mesh axis: torch.chunk's split of the rows
            rows = torch.arange(ROWS).chunk(shape[-1])[rank % shape[-1]].numel()
            assert got["local_rows"] == rows, (shape, rank)
