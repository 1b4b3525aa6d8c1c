"""runtime.executor: a planned stage runs on DTensor, matches one device, and communicates what was priced.

Three plans of a small GPT on 4 devices (one gloo launch runs them all, ranks = devices):

* ``megatron``: tensor parallel on (1, 4): column-parallel qkv / fc, row-parallel proj, the
  LayerNorm region batch-sharded (sequence-parallel style: reduce-scatter after the row-parallel
  matmuls, all-gather before the column-parallel ones);
* ``data_parallel``: every weight replicated, the batch split, gradients all-reduced;
* ``mixed_2x2``: data parallel on axis 0 and tensor parallel on axis 1 of a (2, 2) mesh.

The cluster is an A100 host slowed down 1000x (compute and memory bandwidth; links as they are), so
that a GPT of hidden size 64 has computation worth splitting: on a real A100 it is latency-bound and
the planner rightly keeps it on one device.

For each plan: the loss and every parameter gradient equal the single-device run within 1e-5
(relative, float32), DTensor's output placements are the planned ones, and the bytes of every
collective DTensor issued in forward + backward (`runtime.comm_count.CommCounter`) equal what the
planner prices (`planner.intra.priced_comm.predicted_collectives`), per collective kind within 10 %.
Where they differ, the site (edge or op) is listed in ``KNOWN_DIFFS`` / ``UNPRICED_SITES`` with
its cause. The data-parallel plan is also run over two micro-batches with the parameter gradients
synchronised once. A last test counts the bytes of the Megatron plan of a hidden-2048 GPT on (1, 8)
with the fake process group and fake tensors (nothing is computed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from planner import trace
from planner.intra.solve import solve_stage
from planner.models import build_model
from runtime.launch import launch

# Every test reads a gloo launch, or plans the cases (~3 s, cached for the launch).
pytestmark = pytest.mark.slow

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128"
# name -> (batch, micro-batches priced, logical mesh)
CASES = {
    "megatron": (4, 1, (1, 4)),
    "data_parallel": (16, 4, (1, 4)),
    "mixed_2x2": (8, 4, (2, 2)),
}
# Collectives the planner does not price: the all-reduce of the scalar total_weight that DTensor's
# nll_loss_backward wants replicated while the forward left it partial (the runtime's fitted
# overheads hold it: `runtime.overhead`). The loss's own all-reduce to replicated is priced
# (``fwd:output``, `planner.intra.prices.loss_reduction_time`).
UNPRICED_SITES = ("bwd:nll_loss_forward",)
# Sites where the runtime's bytes differ from the price, with the cause (planner-side):
KNOWN_DIFFS = {
    # wte is vocabulary-sharded on axis 1 and the tokens batch-sharded on axis 0. The planner
    # assumes the weight gradient leaves the embedding as (P, S(0)) (a sharded input gets a
    # sharded gradient); DTensor's embedding_dense_backward has no vocabulary-sharded strategy
    # and returns (P, R): the full gradient on every rank, so the axis-0 all-reduce moves the
    # whole table (32 KiB) instead of half of it.
    "mixed_2x2": {"bwd:p_1->embedding"},
}


def _slow_a100(n: int) -> Cluster:
    c = Cluster.from_spec(f"1x{n}xA100-80GB")
    d = c.device
    slow = dataclasses.replace(
        d,
        peak_flops={k: v * 1e-3 for k, v in d.peak_flops.items()},
        memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s * 1e-3,
    )
    return dataclasses.replace(c, device=slow)


def _megatron_blocks(path: str, option: Any) -> bool:
    """Parameter filter: the blocks' Linear weights placed as Megatron places them on axis 1."""
    for k, placement in MEGATRON.items():
        if path.startswith("blocks.") and path.endswith(f"{k}.weight"):
            return option.strategy.output[0][1] == placement
    return True


@functools.cache
def _case(name: str) -> dict[str, Any]:
    """Model, batch, traced graph, plan and the single-device reference of one case."""
    batch, nmb, shape = CASES[name]
    torch.manual_seed(0)
    model, b = build_model(SPEC, batch=batch, device="cpu")
    graph = trace(model, b)
    cluster = _slow_a100(4)
    lmesh = LogicalMesh(cluster, cluster.shape, shape)
    # mixed_2x2: Megatron's block weights on axis 1 are within 0.1% of the free optimum (2.787
    # against 2.785 ms per micro-batch, attn.proj replicated), a near tie that pricing details
    # flip; this test is about executing that layout, so those weights are held to it
    pinned = {"param_filter": _megatron_blocks} if name == "mixed_2x2" else {}
    sol = solve_stage(graph, lmesh, num_microbatches=nmb, **pinned)
    loss = model(*b)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    # a second micro-batch, for gradient accumulation: reference = grad of loss(b) + loss(b2)
    gen = torch.Generator().manual_seed(1)
    b2 = tuple(torch.randint(0, 128, x.shape, generator=gen) for x in b)
    model(*b2).backward()
    return {
        "graph": graph,
        "solution": dataclasses.replace(sol, _ctx=None),
        "program": sol.program(),
        "lmesh": lmesh,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "batch": tuple(b),
        "loss": loss.item(),
        "grads": grads,
        "batch2": b2,
        "grads_accumulated": {k: p.grad.clone() for k, p in model.named_parameters()},
    }


def _quiet() -> None:
    """Silence DTensor's per-rank warnings (gloo's missing all-to-all, unflattened 2D meshes)."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)


def _plain(t: torch.Tensor) -> Any:
    """A copy that survives the pipe to the parent: torch pickles tensors through shared memory,
    which a rank that exits right after sending takes with it; numpy arrays go by value."""
    t = (t.wait() if hasattr(t, "wait") else t).detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _run_cases(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Body of every rank: run each plan forward + backward, counting collectives."""
    import torch.distributed as dist

    from runtime.comm_count import CommCounter
    from runtime.executor import PlanExecutor, make_mesh

    _quiet()
    out = {}
    for name, c in cases.items():
        # fx GraphModules do not unpickle in a fresh process: trace again (deterministic names)
        model, b = build_model(SPEC, batch=len(c["batch"][0]), device="meta")
        graph = trace(model, b)
        mesh = make_mesh(c["program"])
        ex = PlanExecutor(graph, c["program"], mesh)
        params = ex.place_params(c["params"])
        axes = {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}
        with CommCounter(axes) as counter:
            loss = ex.run_plan(params, c["batch"])
            loss.backward()
        grads = {k: _plain(p.grad.full_tensor()) for k, p in params.items()}
        grad_placements = {k: str(p.grad.placements) for k, p in params.items()}
        param_placements = {k: str(p.placements) for k, p in params.items()}
        out[name] = {
            "loss": loss.to_local().item(),
            "grads": grads if dist.get_rank() == 0 else None,
            "grads_placed_as_params": grad_placements == param_placements,
            "mismatches": ex.mismatches,
            "records": counter.records,
        }
        if "batch2" in c:  # two micro-batches, parameter gradients synchronised once
            ex = PlanExecutor(graph, c["program"], mesh, sync_param_grads=False)
            params = ex.place_params(c["params"])
            with CommCounter(axes) as counter:
                for b in (c["batch"], c["batch2"]):
                    ex.run_plan(params, b).backward()
                ex.sync_grads(params)
            out[name]["accumulated"] = {
                "grads": {k: _plain(p.grad.full_tensor()) for k, p in params.items()},
                "records": counter.records,
            }
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    cases = {name: _case(name) for name in CASES}
    sent = {
        n: {k: c[k] for k in ("program", "params", "batch")} for n, c in cases.items()
    }
    sent["data_parallel"]["batch2"] = cases["data_parallel"]["batch2"]
    per_rank = launch(_run_cases, 4, args=(sent,), timeout_s=300)
    return {name: [r[name] for r in per_rank] for name in CASES}


def _weights(name: str, axis: int) -> dict[str, str]:
    sol = _case(name)["solution"]
    keys = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    return {k: sol.param_placements[f"blocks.0.{k}.weight"][axis] for k in keys}


MEGATRON = {
    "attn.qkv": "S(0)",
    "attn.proj": "S(1)",
    "mlp.fc": "S(0)",
    "mlp.proj": "S(1)",
}


def test_the_plans_are_the_intended_ones() -> None:
    assert _weights("megatron", 1) == MEGATRON
    assert set(_weights("data_parallel", 1).values()) == {"R"}
    assert set(_weights("mixed_2x2", 0).values()) == {"R"}
    assert _weights("mixed_2x2", 1) == MEGATRON
    for name in CASES:
        sol = _case(name)["solution"]
        ln = next(
            n for n in _case(name)["graph"].ops if n.module_path == "blocks.0.ln_1"
        )
        assert sol.choice[ln.name].strategy.output[0][-1] == "S(0)", name
        assert not sol.fallback_ops


@pytest.mark.parametrize("name", list(CASES))
def test_same_numbers_as_one_device(runs: dict, name: str) -> None:
    ref = _case(name)
    ranks = runs[name]
    for r in ranks:
        assert r["mismatches"] == []
        assert r["grads_placed_as_params"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    grads = ranks[0]["grads"]
    assert set(grads) == set(ref["grads"])
    for k, g in ref["grads"].items():
        err = (torch.from_numpy(grads[k]) - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, (k, err.item())


def _report(name: str, runs: dict) -> tuple[dict, list[str]]:
    from comm_check import compare

    from planner.intra.priced_comm import predicted_collectives

    c = _case(name)
    predicted = predicted_collectives(c["graph"], c["program"], c["lmesh"])
    records = runs[name][0]["records"]
    for r in runs[name][1:]:  # SPMD: every rank issued the same collectives
        assert [(x.kind, x.nbytes, x.site) for x in r["records"]] == [
            (x.kind, x.nbytes, x.site) for x in records
        ]
    priced = [r for r in records if r.site not in UNPRICED_SITES]
    unpriced = [r for r in records if r.site in UNPRICED_SITES]
    assert all(r.nbytes <= 8 for r in unpriced), unpriced  # scalars
    return compare(predicted, priced)


@pytest.mark.parametrize("name", list(CASES))
def test_comm_matches_prices(runs: dict, name: str) -> None:
    totals, diffs = _report(name, runs)
    print(name, totals, *diffs, sep="\n  ")
    assert totals, "the plan should communicate"
    for kind, (pred, meas) in totals.items():
        assert meas == pytest.approx(pred, rel=0.10), (kind, pred, meas, diffs)
    assert {d.split(": ")[0] for d in diffs} <= KNOWN_DIFFS.get(name, set()), diffs


def _count_fake(program: Any, spec: str, batch: int, world: int) -> tuple:
    """Body of one process: run a plan on a fake process group of `world` ranks with fake
    tensors (collectives and kernels do nothing; DTensor still issues every collective)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.comm_count import CommCounter
    from runtime.executor import PlanExecutor, make_mesh

    _quiet()
    dist.destroy_process_group()  # launch's gloo group of one rank
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    model, b = build_model(spec, batch=batch, dtype=torch.float16, device="meta")
    ex = PlanExecutor(trace(model, b), program, make_mesh(program))
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = {
            k: torch.empty(p.shape, dtype=p.dtype) for k, p in model.named_parameters()
        }
        batch_ = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in b)
        placed = ex.place_params(params)
        with CommCounter() as counter:
            ex.run_plan(placed, batch_).backward()
    return counter.records, ex.mismatches


def test_megatron_gpt_2048_on_8_fake_ranks_communicates_what_is_priced() -> None:
    """tests/test_intra_op.py's Megatron case: GPT hidden 2048, 2 layers, seq 1024, fp16, on
    (1, 8) A100s. Counted with the fake process group: one process, nothing computed."""
    from comm_check import compare

    from planner.intra.priced_comm import predicted_collectives

    spec = "gpt:hidden=2048,layers=2,heads=32,seq=1024,vocab=51200"
    model, b = build_model(spec, batch=2, dtype=torch.float16)
    graph = trace(model, b)
    cluster = Cluster.from_spec("1x8xA100-80GB")
    lmesh = LogicalMesh(cluster, cluster.shape, (1, 8))
    sol = dataclasses.replace(solve_stage(graph, lmesh), _ctx=None)
    assert sol.param_placements["blocks.0.attn.qkv.weight"] == ("R", "S(0)")
    args = (sol.program(), spec, 2, 8)
    records, mismatches = launch(_count_fake, 1, args=args, timeout_s=300)[0]
    assert mismatches == []
    priced = [r for r in records if r.site not in UNPRICED_SITES]
    totals, diffs = compare(predicted_collectives(graph, sol.program(), lmesh), priced)
    print(totals, *diffs, sep="\n  ")
    assert diffs == []
    assert totals["all_reduce"][0] > 0  # Megatron's all-reduces, forward and backward


def test_gradient_accumulation_syncs_parameter_gradients_once(runs: dict) -> None:
    """data_parallel over two micro-batches with ``sync_param_grads=False`` + ``sync_grads``:
    the gradients of loss(b1) + loss(b2), activations' collectives twice, parameters' once."""
    from planner.intra.priced_comm import predicted_collectives

    c = _case("data_parallel")
    acc = runs["data_parallel"][0]["accumulated"]
    for k, g in c["grads_accumulated"].items():
        err = (torch.from_numpy(acc["grads"][k]) - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, (k, err.item())
    params = c["graph"].param_derived()
    expected: dict[str, float] = {}
    once_bytes = 0.0
    for site, colls in predicted_collectives(
        c["graph"], c["program"], c["lmesh"]
    ).items():
        once = site.startswith("bwd:") and site[4:].split("->")[0] in params
        for kind, nbytes in colls:
            expected[kind] = expected.get(kind, 0.0) + nbytes * (1 if once else 2)
            once_bytes += nbytes if once else 0.0
    measured: dict[str, float] = {}
    for r in acc["records"]:
        if r.site not in UNPRICED_SITES:
            measured[r.kind] = measured.get(r.kind, 0.0) + r.nbytes
    assert measured == pytest.approx(expected, rel=1e-9)
    synced = sum(r.nbytes for r in acc["records"] if r.site.startswith("bwd:sync:"))
    assert synced == pytest.approx(once_bytes, rel=1e-9)
    assert once_bytes > 0
