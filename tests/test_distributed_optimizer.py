"""`manual_plan(fsdp="zero2")`: Megatron-Core's distributed optimizer priced as ZeRO-2, against
its closed form on a small GPT (dp 2 x tp 2, one micro-batch, Adam with fp16 weights): every
parameter's optimizer state is split over the devices that replicate it, while its weights stay
whole and its gradient is held whole until the step's reduce-scatter (as Megatron-Core's
gradient buffer holds it), so the peak falls by exactly the optimizer state's other shards.
Runs of such plans against one device: `tests/test_runtime_vocab_zero.py`."""

from __future__ import annotations

import pytest

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from cost_models.memory import state_bytes_per_param
from planner.inter import boundaries as bd
from planner.inter import stage_solves
from planner.inter.layers import layers_in
from planner.intra.megatron import Seed, axes_filter, batch_axes, megatron_placement
from planner.intra.solve import price_stage, solve_stage, with_zero2
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.tracing.tracer import trace

SPEC = "gpt:hidden=128,layers=2,heads=4,seq=64,vocab=512"
CLUSTER = "1x4xA100-80GB"
DP = TP = 2
KW = {"dp": DP, "tp": TP, "pp": 1, "num_microbatches": 1, "global_batch": 8}


def test_zero2_shards_the_optimizer_state_over_its_replicas() -> None:
    plain = manual_plan(SPEC, CLUSTER, **KW)
    zero = manual_plan(SPEC, CLUSTER, fsdp="zero2", **KW)
    module, _ = build_model(SPEC, batch=8, device="meta")
    # elements per device under Megatron's tensor parallelism, and the devices that replicate
    # each parameter: the dp replicas, and the tp axis too for norms and biases left whole
    local, copies = {}, {}
    for path, p in module.named_parameters():
        whole = megatron_placement(path) == "R"
        local[path] = p.numel() / (1 if whole else TP)
        copies[path] = DP * (TP if whole else 1)
    st = zero.stages[0]
    assert sorted(st.zero_params) == sorted(local)  # every one is replicated over dp
    assert st.param_placements == plain.stages[0].param_placements
    optimizer = state_bytes_per_param("adam_mixed").optimizer
    saved = sum(n * optimizer * (1 - 1 / copies[p]) for p, n in local.items())
    assert plain.estimate.peak_memory_bytes - zero.estimate.peak_memory_bytes == (
        pytest.approx(saved, rel=1e-9)
    )
    # the same collectives, and one more all-gather of the weights per step
    assert zero.estimate.iteration_time_s > plain.estimate.iteration_time_s
    assert (zero.manual["fsdp"], plain.manual["fsdp"]) == ("zero2", "none")


def test_zero2_is_checked_like_the_other_modes() -> None:
    with pytest.raises(MeshplanError, match="fsdp must be one of none, zero2, full"):
        manual_plan(SPEC, CLUSTER, fsdp="zero1", **KW)


@pytest.mark.parametrize("tp_axis", [None, 1])
def test_zero2_variant_equals_its_solve(tp_axis: int | None) -> None:
    """The automatic search's distributed-optimizer seeds (`Seed.zero2`) are made from the
    plain seed's solution (`with_zero2`) without a solve: the same choice, time and memory as
    solving under ZeRO-2 (`axes_filter(zero=...)`), on pure dp and on dp x tp."""
    module, batch = build_model(SPEC, batch=8, device="meta")
    graph = trace(module, batch)
    mesh = LogicalMesh(Cluster.from_spec(CLUSTER), (1, 4), (2, 2))
    pricing = price_stage(graph, mesh, num_microbatches=2)
    axes = batch_axes(mesh.shape, tp_axis, False)
    kw = {"pricing": pricing, "num_microbatches": 2, "batch_axes": axes}
    plain = solve_stage(graph, mesh, param_filter=axes_filter(tp_axis, None), **kw)
    solved = solve_stage(
        graph, mesh, param_filter=axes_filter(tp_axis, None, zero=mesh.shape), **kw
    )
    made = with_zero2(pricing, plain)
    assert made is not None and made.choice == solved.choice
    assert sorted(made.zero_params) == sorted(solved.zero_params) != []
    fields = ("time_s", "memory_bytes", "grad_sync_s", "param_state_bytes", "comm_s")
    for field in fields + ("compute_s", "activation_bytes", "optimizer_s"):
        assert getattr(made, field) == pytest.approx(getattr(solved, field), rel=1e-12)
    # per node too (`with_zero2` reuses the plain solution's values off the parameters)
    names, table = made.node_cost_table()
    assert names == solved.node_cost_table()[0]
    assert table == pytest.approx(solved.node_cost_table()[1], rel=1e-12)
    assert made.memory_bytes < plain.memory_bytes
    assert with_zero2(pricing, made) is None  # nothing left to shard


def test_search_adds_the_variant_where_it_fits() -> None:
    """`profiles_for` with a pure data-parallel seed marked ``zero2``: the seed's solution and
    its distributed-optimizer variant; with a budget that the seed's lightest layer exceeds
    and the variant's does not, the variant alone (before it, no profile at all)."""
    module, batch = build_model(SPEC, batch=8, device="meta")
    graph = trace(module, batch)
    mesh = LogicalMesh(Cluster.from_spec(CLUSTER), (1, 4), (2, 2))
    layers = layers_in(graph, 2)
    layer_of = bd.layer_of_nodes(graph, layers)
    bounds = bd.boundary_values(graph, layer_of, len(layers))
    seed = Seed(axes_filter(None, None), (0, 1), zero2=True)

    def profiles(budget: float) -> list:
        return stage_solves.profiles_for(
            graph, mesh, layer_of, bounds, len(layers), num_microbatches=2,
            budget=budget, optimizer="adam_mixed", seeds=[seed], seeds_only=True,
        )  # fmt: skip

    plain, zero = profiles(float("inf"))
    assert plain.solution.zero_params == []
    assert sorted(zero.solution.zero_params) == sorted(plain.solution.param_placements)
    lightest = [p.params.min() for p in (plain, zero)]  # a layer's parameter state
    assert lightest[1] < lightest[0]
    between = (
        sum(lightest) / 2
    )  # the variant's lightest layer fits, the seed's does not
    assert [p.solution.zero_params != [] for p in profiles(between)] == [True]
    assert profiles(lightest[1] / 2) == []


@pytest.mark.parametrize(
    "spec", [SPEC.replace("layers=2", "layers=4"), "moe:hidden=64,layers=4,experts=4"]
)
def test_seed_bound_reads_each_block_once(spec: str) -> None:
    """`profiles_for`'s bound on a seed's lightest layer (`_seed_params_per_layer`) reads the seed
    once per repeated block's representative: the same bytes as reading it with every copy's own
    path, for every seed of a 2 x 2 mesh, with and without ZeRO-2."""
    from planner.inter.mesh_shapes import _seeds
    from planner.intra.prices import zero2_option

    module, batch = build_model(spec, batch=8, device="meta")
    graph = trace(module, batch)
    mesh = LogicalMesh(Cluster.from_spec(CLUSTER), (1, 4), (2, 2))
    layers = layers_in(graph, 4)
    layer_of = bd.layer_of_nodes(graph, layers)
    pricing = price_stage(graph, mesh, num_microbatches=2)
    ctx, rep = pricing.ctx, pricing.ctx.rep
    params = [n for n in pricing.names if graph.node(n).op == "param"]
    assert any(rep.get(n, n) != n for n in params)  # copies read their representative
    seeds = _seeds(graph, mesh, "auto")
    assert len(seeds) > 3
    for seed in seeds:
        for zero2 in (False, True):
            per_layer = [0.0] * len(layers)
            for n in params:  # every parameter with its own path
                r = rep.get(n, n)
                memory, options = pricing.node_arrays(r)[1], ctx.options[r]
                allowed = [
                    memory[options.index(zero2_option(o, mesh.shape)) if zero2 else i]
                    for i, o in enumerate(options)
                    if seed.params(graph.placeholder_paths[n], o)
                ]
                per_layer[layer_of.get(n, 0)] += min(allowed, default=float("inf"))
            got = stage_solves._seed_params_per_layer(
                pricing, graph, seed.params, params, layer_of, len(layers), zero2
            )
            assert got == min(per_layer)
