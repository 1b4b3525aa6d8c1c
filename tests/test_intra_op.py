"""The intra-op pass on GPT blocks: the shardings the costs should favour, memory, explanations."""

from __future__ import annotations

import functools

import pytest
import torch

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner import trace
from planner.intra.solve import solve_stage
from planner.models import build_model
from planner.tracing.blocks import representatives


@functools.cache
def _gpt(batch: int, layers: int = 2, hidden: int = 2048, heads: int = 32):
    model, b = build_model(
        f"gpt:hidden={hidden},layers={layers},heads={heads},seq=1024,vocab=51200",
        batch=batch,
        dtype=torch.float16,
    )
    return trace(model, b)


def _mesh(spec: str, shape: tuple[int, int]) -> LogicalMesh:
    cluster = Cluster.from_spec(spec)
    return LogicalMesh(cluster, cluster.shape, shape)


def _block_weights(sol, axis: int) -> dict[str, str]:
    names = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]
    return {n: sol.param_placements[f"blocks.0.{n}.weight"][axis] for n in names}


MEGATRON = {
    "attn.qkv": "S(0)",
    "attn.proj": "S(1)",
    "mlp.fc": "S(0)",
    "mlp.proj": "S(1)",
}  # Linear weight: [out, in]


def test_small_batch_on_one_host_gives_megatron() -> None:
    g = _gpt(batch=2)
    sol = solve_stage(g, _mesh("1x8xA100-80GB", (1, 8)))
    assert sol.optimal
    assert _block_weights(sol, 1) == MEGATRON
    sdpa = next(
        n
        for n in g.ops
        if "scaled_dot_product" in n.target and n.module_path.startswith("blocks.0")
    )
    assert all(
        p == ("R", "S(1)") for p in sol.choice[sdpa.name].strategy.inputs
    )  # split by heads
    # One all-reduce per sub-block forward: the row-parallel output (partial sums, carried through the
    # residual add) is reduced before the next LayerNorm; no other collective inside the blocks.
    # The embedding is split by vocabulary, as Megatron's VocabParallelEmbedding: its output,
    # partial sums, is all-reduced before the first LayerNorm (the optimizer's step on the
    # replicated 105M-parameter table would cost more than that all-reduce).
    assert sol.param_placements["wte.weight"] == ("R", "S(0)")
    inside = [
        (g.node(v).module_path, [st.collective for st in steps])
        for _, v, steps in sol.forward_reshards()
    ]
    inside = [x for x in inside if x[0].startswith("blocks.") or x[0] == "ln_f"]
    assert inside == [
        (m, ["all_reduce"])
        for m in (
            "blocks.0.ln_1",
            "blocks.0.ln_2",
            "blocks.1.ln_1",
            "blocks.1.ln_2",
            "ln_f",
        )
    ]


def test_large_batch_gives_data_parallel() -> None:
    g = _gpt(batch=64)
    sol = solve_stage(g, _mesh("1x8xA100-80GB", (1, 8)), num_microbatches=8)
    assert set(_block_weights(sol, 1).values()) == {"R"}
    ln = next(n for n in g.ops if n.module_path == "blocks.0.ln_1")
    assert sol.choice[ln.name].strategy.output[0] == ("R", "S(0)")  # batch split
    assert sol.grad_sync_s > 0 and sol.comm_s < 0.01 * sol.compute_s


def test_two_hosts_data_parallel_across_tensor_parallel_inside() -> None:
    g = _gpt(batch=32)
    # 16 micro-batches: the once-per-iteration gradient all-reduce over the 0.39 GB/s inter-host
    # axis (~0.4 s) is then cheaper per micro-batch than computing every micro-batch on both hosts.
    # With 8 the two are within a few percent (a V100 quad's tensor-parallel all-reduces run at
    # 100 GB/s, `Cluster.group_link`), too close for a test to pin.
    sol = solve_stage(g, _mesh("2x4xV100-16GB", (2, 4)), num_microbatches=16)
    assert set(_block_weights(sol, 0).values()) == {
        "R"
    }  # data parallel over the slow inter-host axis
    assert _block_weights(sol, 1) == MEGATRON  # tensor parallel over NVLink
    ln = next(n for n in g.ops if n.module_path == "blocks.0.ln_1")
    assert sol.choice[ln.name].strategy.output[0][0] == "S(0)"


def test_memory_budget_forces_zero_and_then_fails_clearly() -> None:
    g = _gpt(batch=64)
    mesh = _mesh("1x8xA100-80GB", (1, 8))
    free = solve_stage(g, mesh, num_microbatches=8)
    # data parallel: ZeRO-2 on the large weights even where memory does not ask for it (each
    # device steps an eighth of their optimizer state, for one more all-gather per iteration),
    # not on the biases and norms, where the all-gather's latency outweighs their step
    assert free.zero_params and all(p.endswith(".weight") for p in free.zero_params)
    budget = 0.9 * free.memory_bytes
    tight = solve_stage(g, mesh, num_microbatches=8, memory_budget=budget)
    assert tight.memory_bytes <= budget
    assert tight.param_state_bytes < free.param_state_bytes  # more of the state sharded
    with pytest.raises(
        MeshplanError,
        match=r"needs at least [\d.]+ GiB per device, 0\.1 GiB available",
    ):
        solve_stage(g, mesh, num_microbatches=8, memory_budget=0.1 * 2**30)


def test_repeated_blocks_share_one_solution() -> None:
    g = _gpt(batch=2, layers=3)
    names = [n.name for n in g.nodes]
    rep = representatives(g, names)
    qkv = [
        n.name
        for n in g.ops
        if n.module_path.endswith("attn.qkv") and n.target == "aten.addmm.default"
    ]
    assert len({rep[q] for q in qkv}) == 1
    sol = solve_stage(g, _mesh("1x8xA100-80GB", (1, 8)))
    assert (
        len({sol.param_placements[f"blocks.{i}.mlp.fc.weight"] for i in range(3)}) == 1
    )
    assert sol.ilp_nodes < len(g.nodes) / 5


def test_explain_lists_options_and_marks_the_choice() -> None:
    g = _gpt(batch=2)
    sol = solve_stage(g, _mesh("1x8xA100-80GB", (1, 8)))
    qkv = next(
        n.name
        for n in g.ops
        if n.module_path == "blocks.0.attn.qkv" and n.target == "aten.addmm.default"
    )
    text = sol.explain(qkv)
    assert (
        "blocks.0.attn.qkv" in text and text.count("\n * ") == 1 and "compute" in text
    )
    with pytest.raises(MeshplanError, match="no node"):
        sol.explain("nope")


def test_same_input_same_plan() -> None:
    g = _gpt(batch=8)
    mesh = _mesh("1x8xA100-80GB", (2, 4))
    a, b = solve_stage(g, mesh), solve_stage(g, mesh)
    assert a.param_placements == b.param_placements


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).square().mean()


def test_gradient_all_reduce_latency_is_paid_once_per_bucket() -> None:
    """Data parallel on 2 devices: the runtime all-reduces the four float32 gradients as one
    bucket, so the priced synchronisation is one all-reduce of all their bytes (up to the byte of
    the latency probe, `planner.intra.prices.bucket_line`), not four all-reduces; a stage holding
    either layer or both pays the latency once."""
    from planner.inter import boundaries as bd
    from planner.inter import stage_table as st

    model = _MLP()
    g = trace(model, (torch.randn(64, 64),))
    mesh = _mesh("1x2xA100-80GB", (1, 2))
    sol = solve_stage(g, mesh, batch_axes=(1,), num_microbatches=2)
    assert set(sol.param_placements.values()) == {("R", "R")}
    latency = mesh.all_reduce(1.0, 1)
    sizes = [p.numel() * 4 for p in model.parameters()]
    one = mesh.all_reduce(sum(sizes), 1)
    assert sol.grad_sync_s == pytest.approx(one, rel=1e-6)
    assert sol.grad_sync_s < sum(mesh.all_reduce(b, 1) for b in sizes) - 2 * latency
    assert [len(b.consumers) for b in sol.buckets.values()] == [4]

    half = len(g.ops) // 2
    layers = [(0, half - 1), (half, len(g.ops) - 1)]
    layer_of = bd.layer_of_nodes(g, layers)
    prof = st.profile(sol, g, layer_of, bd.boundary_values(g, layer_of, 2), 2)
    assert prof.fixed[0, 0] == prof.fixed[1, 1] == prof.fixed[0, 1] == latency / 2
    assert prof.range_time(0, 1, False) == pytest.approx(sol.time_s, rel=1e-9)


def test_a_partial_loss_pays_its_all_reduce_every_micro_batch() -> None:
    """Data parallel on 2 devices: the loss leaves the forward partial over the batch axis and the
    runtime all-reduces it to replicated after every micro-batch's forward
    (`runtime.executor.PlanExecutor.run_plan`). No edge leads to the graph's output, so the loss
    node's own price holds that all-reduce; a replicated loss has none to pay."""
    from planner.intra.prices import compute_time
    from planner.intra.solve import price_stage

    g = trace(_MLP(), (torch.randn(64, 64),))
    mesh = _mesh("1x2xA100-80GB", (1, 2))
    loss = g.loss_value
    assert g.node(loss).target == "aten.mean.default"
    ctx = price_stage(g, mesh, num_microbatches=2).ctx
    paid = {}
    for opt in ctx.options[loss]:
        placement = tuple(opt.strategy.output[0])
        paid[placement] = ctx.node_cost(loss, opt) - compute_time(
            g.node(loss), opt, ctx.settings
        )
    assert paid[("R", "R")] == 0.0
    partial = [p for p in paid if p[1].startswith("P")]
    reduction = mesh.all_reduce(float(g.node(loss).outputs[0].nbytes), 1)
    assert partial and reduction > 0
    for p in partial:
        assert paid[p] == pytest.approx(reduction, rel=1e-9)
    # a solution with a partial loss (the filter keeps only those) counts its reduction once,
    # as communication: the ops' compute without it, the edges' resharding plus it
    sol = solve_stage(
        g,
        mesh,
        batch_axes=(1,),
        num_microbatches=2,
        activation_filter=lambda n, o: n != loss or o.strategy.output[0][1] != "R",
    )
    chosen = tuple(sol.choice[loss].strategy.output[0])
    assert chosen in partial
    assert sol.compute_s == pytest.approx(
        sum(
            compute_time(g.node(n), o, sol._ctx.settings)
            for n, o in sol.choice.items()
            if g.node(n).op == "call"
        ),
        rel=1e-9,
    )
    edges = sum(sol._ctx.edge_terms(sol._chosen())[0])
    assert sol.comm_s == pytest.approx(edges + paid[chosen], rel=1e-9)
