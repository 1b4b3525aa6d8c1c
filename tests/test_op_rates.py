"""Measured op rates: what `runtime.op_rates` measures, and how the cost model prices an op from a
profile's rate (`cost_models.compute.measured_op_time`, `planner.intra.prices.compute_time`)."""

from __future__ import annotations

import pytest
import torch
from profiles import cpu_profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.compute import measured_op_time, op_overhead
from cost_models.profile import (
    CollectiveFit,
    DeviceProfile,
    OpRate,
)
from planner.intra.prices import Option, StageSettings, compute_time, forward_time
from planner.models import build_model
from planner.tracing.op_flops import VIEW_OPS
from planner.tracing.tracer import trace
from planner.vocab.strategy import Strategy
from runtime.op_rates import GEMM_TARGETS, measure_op_rates

SPEC = "gpt:hidden=32,layers=1,heads=2,seq=16,vocab=64"
GELU = "aten.gelu.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _profile(rates: list[OpRate]) -> DeviceProfile:
    return cpu_profile(
        memory_bytes=8 << 30,
        memory_bandwidth_bytes_per_s=20e9,
        collectives=[CollectiveFit("send_recv", 2, 1e-5, 1e-9)],
        op_overhead_s=3e-5,
        op_rates=rates,
    )


def test_measured_op_time_is_units_times_the_rate():
    c = Cluster.from_profile(
        _profile(
            [OpRate(GELU, "byte", 2e-10, 6e-10), OpRate(SDPA, "flop", 1e-11, None)]
        )
    )
    assert measured_op_time(
        c, GELU, flops=0, nbytes=1e6, backward=True
    ) == pytest.approx(8e-4)
    assert measured_op_time(
        c, GELU, flops=0, nbytes=1e6, backward=False
    ) == pytest.approx(2e-4)
    assert measured_op_time(
        c, SDPA, flops=1e9, nbytes=5, backward=False
    ) == pytest.approx(1e-2)
    # no backward measured, or no rate, or no profile: the caller keeps the roofline
    assert measured_op_time(c, SDPA, flops=1e9, nbytes=5, backward=True) is None
    assert (
        measured_op_time(c, "aten.mm.default", flops=1, nbytes=1, backward=False)
        is None
    )
    v100 = Cluster.from_spec("1x2xV100-16GB")
    assert measured_op_time(v100, GELU, flops=0, nbytes=1e6, backward=True) is None


def test_the_planner_prices_a_measured_op_from_its_rate_per_device():
    """A GELU whose profile has a rate costs the per-op overhead plus rate x its bytes, forward
    and backward, divided by the mesh axes that split it; recomputation re-runs the forward
    alone. Without the rate it is priced by the roofline."""
    module, example = build_model(SPEC, batch=4, device="meta")
    graph = trace(module, example)
    gelu = next(n for n in graph.ops if n.target == GELU)
    nbytes = gelu.bytes_read + gelu.bytes_written
    rate = OpRate(GELU, "byte", 2e-10, 6e-10)
    cluster = Cluster.from_profile(_profile([rate]), hosts=1, devices_per_host=2)
    settings = StageSettings(mesh=LogicalMesh(cluster, (1, 2), (2, 1)))
    split = Option(Strategy((("S(0)", "R"),), (("S(0)", "R"),), "dp"))
    whole = Option(Strategy((("R", "R"),), (("R", "R"),), "r"))
    overhead = op_overhead(cluster)
    assert compute_time(gelu, split, settings) == pytest.approx(
        overhead + nbytes * 8e-10 / 2
    )
    assert compute_time(gelu, whole, settings) == pytest.approx(
        overhead + nbytes * 8e-10
    )
    assert forward_time(gelu, split, settings) == pytest.approx(nbytes * 2e-10 / 2)
    roofline = Cluster.from_profile(_profile([]), hosts=1, devices_per_host=2)
    plain = StageSettings(mesh=LogicalMesh(roofline, (1, 2), (2, 1)))
    assert compute_time(gelu, whole, plain) != pytest.approx(
        compute_time(gelu, whole, settings)
    )


FIXED_S = 5e-5
PER_BYTE_S = 1e-10


class _Touched(TorchDispatchMode):
    """Counts the aten calls run under it and the bytes of their tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        self.bytes += sum(
            t.numel() * t.element_size()
            for t in tree_flatten((args, kwargs, out))[0]
            if isinstance(t, torch.Tensor)
        )
        return out


def simulated_seconds(fn) -> float:
    """A simulated device where every aten call costs ``FIXED_S`` plus ``PER_BYTE_S`` per byte
    it reads or writes: deterministic, so the rates can be derived exactly."""
    with _Touched() as touched:
        fn()
    return FIXED_S * touched.calls + PER_BYTE_S * touched.bytes


@pytest.fixture(scope="module")
def gpt_rates() -> list[OpRate]:
    return measure_op_rates(
        (SPEC,), 4, lambda fns: [simulated_seconds(fn) for fn in fns]
    )


def test_the_non_gemm_ops_of_the_model_get_rates(gpt_rates):
    module, example = build_model(SPEC, batch=4, device="meta")
    graph = trace(module, example)
    expected = {
        n.target
        for n in graph.ops
        if n.op == "call"
        and not n.is_view
        and n.target not in GEMM_TARGETS
        and n.outputs
    }
    rates = {r.target: r for r in gpt_rates}
    # all but the position index (arange over the sequence), which does not grow with the batch
    assert set(rates) == expected - {"aten.arange.default"}
    assert not {str(v) for v in VIEW_OPS} & set(rates)
    assert rates[SDPA].unit == "flop" and rates[GELU].unit == "byte"
    assert all(r.forward_s > 0 for r in gpt_rates)
    assert rates["aten.native_layer_norm.default"].backward_s is not None


def test_a_rate_is_the_slope_without_the_fixed_cost_of_a_call(gpt_rates):
    """On the simulated device, GELU's forward reads x and writes y: its rate is exactly
    ``PER_BYTE_S`` per byte, the ``FIXED_S`` of the call gone (the per-op overhead charges it).
    Its backward (gelu_backward reads the gradient and x and writes x's gradient) touches 1.5
    times the forward's bytes: 1.5 ``PER_BYTE_S`` per forward byte."""
    gelu = next(r for r in gpt_rates if r.target == GELU)
    assert gelu.forward_s == pytest.approx(PER_BYTE_S, rel=1e-9)
    assert gelu.backward_s == pytest.approx(1.5 * PER_BYTE_S, rel=1e-9)


def test_the_graph_runs_the_replacement_of_a_node_it_is_given():
    """On a GPU rank, nodes the trace recorded for the CPU (attention) run through the runtime's
    replacements (`runtime.device_ops.device_targets`); here a replacement that counts its
    calls and returns what the original target returns."""
    from runtime.op_rates import _run_graph

    torch.manual_seed(0)
    model, example = build_model(SPEC, batch=2, device="cpu")
    graph = trace(model, tuple(example))
    node = next(n for n in graph.gm.graph.nodes if str(n.target) == SDPA)
    calls = []

    def replacement(*args, **kwargs):
        calls.append(1)
        return node.target(*args, **kwargs)

    plain = _run_graph(graph.gm, model, tuple(example))
    replaced = _run_graph(graph.gm, model, tuple(example), {node: replacement})
    assert calls == [1]
    loss = tree_flatten(list(graph.gm.graph.nodes)[-1].args[0])[0][0]
    assert torch.equal(replaced[loss.name], plain[loss.name])
