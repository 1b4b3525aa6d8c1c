"""Models the tracer cannot take get one error naming the module, the op and what to do; ops
without a DTensor rule are planned replicated with a warning; in-place ops and buffer writes."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner import plan, trace


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.sum() > 0:  # data-dependent control flow
            return h
        return -h


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).pow(2).mean()


class Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h.mean() * int(h.argmax().item())


class NotALoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_data_dependent_control_flow_names_the_module_and_what_to_do() -> None:
    with pytest.raises(MeshplanError) as err:
        trace(WithGate(), torch.randn(4, 8))
    msg = str(err.value)
    assert "module 'inner'" in msg and "_local_scalar_dense" in msg
    assert "torch.where" in msg and "if h.sum() > 0" in msg


class MaskedAttention(nn.Module):
    """Attention whose additive mask is a parameter (`learned`) or a constant: Doge's dynamic
    mask is computed from parameters so."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        bias = torch.zeros(8, 8)
        self.bias = nn.Parameter(bias) if learned else nn.Buffer(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return out.pow(2).mean()


@pytest.mark.parametrize("learned", [True, False])
def test_a_mask_that_needs_a_gradient_asks_for_eager_attention(learned: bool) -> None:
    batch = (torch.randn(2, 8, 16),)
    if not learned:
        assert any(
            "flash_attention" in n.target
            for n in trace(MaskedAttention(False), batch).nodes
        )
        return
    with pytest.raises(MeshplanError, match="mask computed from parameters") as info:
        trace(MaskedAttention(True), batch)
    msg = str(info.value)
    assert "module ''" in msg and "attn=eager" in msg and "\n" not in msg, msg
    # the computation as it trains: the math kernel, with a gradient for the mask
    model = MaskedAttention(True)
    model(*batch).backward()
    assert model.bias.grad is not None


def test_item_names_the_op() -> None:
    with pytest.raises(MeshplanError, match=r"(?s)top-level forward.*\.item\(\)"):
        trace(Item(), torch.randn(4, 8))


def test_shape_mismatch_is_one_line_without_torchs_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An example batch of the wrong width: one error naming the op's shapes and what to check,
    and none of the traceback FakeTensorMode logs from inside torch."""
    with pytest.raises(MeshplanError) as err:
        trace(nn.Sequential(nn.Linear(4, 4)), torch.zeros(2, 5))
    logged = [
        (r.name, r.getMessage())
        for r in caplog.records
        if r.name.startswith("torch") and r.levelno >= logging.WARNING
    ]
    assert not logged, logged
    msg = str(err.value)
    assert "\n" not in msg and "module '0'" in msg and "[2, 5] X [4, 4]" in msg, msg
    assert "check that its sizes agree" in msg, msg


def test_a_module_is_planned_in_its_own_dtype() -> None:
    """An nn.Module is traced as it was built: with no dtype its plan is in its parameters'
    dtype; another dtype is an error naming both and what to do, as is a dtype torch lacks.
    Before, `dtype` (default float16) was recorded nowhere and ignored for modules."""

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).float().pow(2).mean()

    model = Loss().to(torch.bfloat16)
    batch = torch.zeros(4, 8, dtype=torch.bfloat16)
    p = plan(model, "1x2xA100-80GB", batch, microbatch_size=4)
    assert p.dtype == "bfloat16"
    with pytest.raises(
        MeshplanError, match="parameters are bfloat16, but dtype float16"
    ):
        plan(model, "1x2xA100-80GB", batch, dtype=torch.float16)
    with pytest.raises(MeshplanError, match="unknown dtype 'float8'"):
        plan(
            "gpt:hidden=8,layers=1,heads=2,seq=4,vocab=16",
            "1x2xA100-80GB",
            dtype="float8",
        )


def test_forward_must_return_a_scalar_loss() -> None:
    with pytest.raises(MeshplanError, match=r"returned a tensor of shape \(4, 8\)"):
        trace(NotALoss(), torch.randn(4, 8))


@torch.library.custom_op("meshplan_test::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_scale.register_autograd(
    lambda ctx, grad: grad * 2, setup_context=lambda ctx, inputs, output: None
)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.meshplan_test.scale(self.proj(x)).pow(2).mean()


@pytest.mark.slow
def test_an_op_without_a_sharding_rule_is_planned_replicated_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="no DTensor sharding rule"):
        p = plan(Custom(), "1x2xA100-80GB", torch.randn(8, 8), global_batch=8)
    assert any("meshplan_test.scale" in f for f in p.fallback_ops)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        h += x
        h.masked_fill_(x > 2, 0.0)
        self.calls += 1
        return self.b(h).pow(2).mean()


def test_in_place_ops_are_traced_out_of_place_and_buffer_writes_warn() -> None:
    with pytest.warns(UserWarning, match="updates calls in place"):
        graph = trace(InPlace(), torch.randn(4, 8))
    targets = [n.target for n in graph.ops]
    in_place = [
        t for t in targets if t.startswith("aten.") and t.split(".")[1].endswith("_")
    ]
    assert not in_place, in_place
    assert "aten.relu.default" in targets and "aten.masked_fill.Scalar" in targets
    # the same FLOPs as the model with out-of-place ops: two linears forward, backward 2x + 1x
    fwd = 2 * (2 * 4 * 8 * 8)
    assert graph.fwd_flops == fwd


def test_writing_a_parameter_is_an_error() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.w.mul_(0.5)
            return (x * self.w).sum()

    with pytest.raises(MeshplanError, match="writes its parameter 'w' in place"):
        trace(Writes(), torch.randn(4, 8))
