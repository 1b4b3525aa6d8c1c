"""Measure the time per unit of a model's non-GEMM ops on this device: a profile's ``op_rates``.

Why: the roofline (`cost_models.compute.op_time`) prices an op without FLOPs by its bytes at the
measured memory bandwidth. On a CPU, GELU's erf, softmax's exp and the fused attention kernel
run far slower than that; `cost_models.compute.measured_op_time` prices them from the rates
measured here instead.

How (`measure_op_rates`, on every rank of a launched group at once, as the profiler's other compute
measurements): each model spec is built small and real on the CPU at two batch sizes (``batch``
and ``BATCH_FACTOR`` times it) and traced (`planner.tracing.tracer.trace`), and each traced graph is run
once on the real weights and the model's example batch, keeping every value. On a GPU rank the
model and batch are moved to the rank's GPU in bfloat16 (what GPUs train in) and the graph runs
there, with the CPU-only targets the trace records replaced as the runtime replaces them
(`runtime.device_ops.device_targets`: the CUDA attention kernels, factory ops on the GPU), so the
rates are the GPU's. Then, for each op
target that is neither a view nor a GEMM (a GEMM's rate depends on the shape a sharding gives it:
the profile's matmul samples price those), up to ``CALLS_PER_TARGET`` of its calls are re-run on
their recorded inputs: the forward alone, and the forward followed by the gradients of the inputs
that need them in training (those whose producer requires grad, as the tracer marks it). The
calls of every model at both batch sizes are timed together, in rounds
(`runtime.profiler.time_calls`), so that a dip of the machine's speed costs each a loop rather
than every loop of one.

A target's rate is the slope between the two batch sizes: ``forward_s`` = (forward seconds at the
large batch - at the small) / (units at the large - at the small), summed over its calls, and
``backward_s`` likewise for the forward-and-backward seconds less the forward's. The intercept, the
fixed cost of a call (Python, dispatch, the autograd engine's start: 80-95 us for a GELU's forward
and backward here, whatever its size), is left out: the profile's ``op_overhead_s`` charges it per
op. The unit is the call's forward FLOPs when the op counts FLOPs (attention), else the bytes it
reads and writes (the roofline's memory term, now at the op's own speed). A target gets no rate,
and keeps the roofline, when its units do not grow with the batch, when its forward slope is not
positive (noise), or when a call cannot run on its own (an in-place op on a leaf, say); its
``backward_s`` is None when no call needed a gradient or that slope is not positive.

What PyTorch lacks: its profiler times ops inside a whole run, where they cannot be attributed to
the traced graph's nodes and their units; `torch.utils.benchmark` times one callable, which is
what `time_all` is handed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cost_models.profile import OpRate

#: Calls timed per op target: a target's calls in a transformer repeat the same few shapes.
CALLS_PER_TARGET = 2
#: The second batch size, as a multiple of the first: the rate is the slope between them.
BATCH_FACTOR = 4
#: Ops the matrix-product samples price (their targets as the tracer names them).
GEMM_TARGETS = frozenset(
    f"aten.{op}.default"
    for op in ("mm", "addmm", "bmm", "baddbmm", "convolution", "matmul", "linear")
)

# per call: (target, unit, units, forward, forward-and-backward or None), not yet timed
Call = tuple[str, str, float, Callable[[], Any], Callable[[], Any] | None]


def measure_op_rates(
    model_specs: tuple[str, ...],
    batch: int,
    time_all: Callable[[list[Callable[[], Any]]], list[float]],
    device_type: str = "cpu",
) -> list[OpRate]:
    """Rates of the non-view, non-GEMM ops of the models `model_specs` (built-in model specs),
    the slope between batches of `batch` and ``BATCH_FACTOR * batch`` rows, every call timed in
    one ``time_all(fns)`` (seconds per call of each fn) on this process's device of
    `device_type` ("cpu" or "cuda"); module docstring. Targets in the order first met."""
    pairs = [
        [_calls_of(spec, b, device_type) for b in (batch, BATCH_FACTOR * batch)]
        for spec in model_specs
    ]
    fns = [
        fn
        for pair in pairs
        for calls in pair
        for call in calls.values()
        for fn in call[3:]
        if fn is not None
    ]
    seconds = iter(time_all(fns))
    # target -> per batch size: [units, forward s, units with backward, backward s]
    sums: dict[str, list[list[float]]] = {}
    units_of: dict[str, str] = {}
    for pair in pairs:
        # per batch size: node name -> (target, unit, units, forward s, both s or None)
        small, large = (
            {
                name: (*c[:3], next(seconds), None if c[4] is None else next(seconds))
                for name, c in calls.items()
            }
            for calls in pair
        )
        for name, a in small.items():
            b = large.get(name)
            if b is None or units_of.setdefault(a[0], a[1]) != a[1]:
                continue
            row = sums.setdefault(a[0], [[0.0] * 4, [0.0] * 4])
            with_backward = a[4] is not None and b[4] is not None
            for level, (_, _, units, fwd, both) in enumerate((a, b)):
                row[level][0] += units
                row[level][1] += fwd
                if with_backward:
                    row[level][2] += units
                    row[level][3] += both - fwd
    rates = []
    for target, (lo, hi) in sums.items():
        forward = _slope(lo[0], lo[1], hi[0], hi[1])
        if forward is None:
            continue
        rates.append(
            OpRate(
                target, units_of[target], forward, _slope(lo[2], lo[3], hi[2], hi[3])
            )
        )
    return rates


def _slope(u0: float, t0: float, u1: float, t1: float) -> float | None:
    """(t1 - t0) / (u1 - u0), or None unless the units grew and the slope is positive."""
    if u1 <= u0 or t1 <= t0:
        return None
    return (t1 - t0) / (u1 - u0)


def _calls_of(spec: str, batch: int, device_type: str = "cpu") -> dict[str, Call]:
    """Node name -> `Call` of the calls to time (`_calls`) in `spec`'s graph at `batch` rows, on
    this process's device of `device_type`."""
    import torch

    from planner.models import build_model
    from planner.tracing.tracer import trace
    from runtime.device_ops import device_targets, run_device

    device = run_device(device_type)
    torch.manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, example = build_model(spec, batch=batch, device="cpu", dtype=dtype)
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    graph = trace(model, example)
    model = model.to(device)
    example = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in example)
    targets = device_targets(graph.gm, device_type)
    values = _run_graph(graph.gm, model, example, targets)
    out: dict[str, Call] = {}
    for fx_node, op in _calls(graph):
        fns = _call_fns(fx_node, op, graph, values, targets.get(fx_node))
        if fns is not None:
            unit = "flop" if op.fwd_flops > 0 else "byte"
            units = op.fwd_flops if unit == "flop" else op.bytes_read + op.bytes_written
            out[op.name] = (op.target, unit, float(units), *fns)
    return out


def _calls(graph: Any) -> list[tuple[Any, Any]]:
    """(fx node, OpNode) of the calls to time: the first ``CALLS_PER_TARGET`` of each target."""
    count: dict[str, int] = {}
    out = []
    for fx_node in graph.gm.graph.nodes:
        if fx_node.op != "call_function":
            continue
        op = graph.node(fx_node.name)
        if op.is_view or op.target in GEMM_TARGETS or not op.outputs:
            continue
        if count.get(op.target, 0) >= CALLS_PER_TARGET:
            continue
        count[op.target] = count.get(op.target, 0) + 1
        out.append((fx_node, op))
    return out


def _run_graph(
    gm: Any, model: Any, example: tuple, targets: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """Every value of the traced graph `gm` run on the model's real tensors, the nodes of
    `targets` (fx node -> callable) run by their replacement: node name -> value."""
    import torch

    flat = [
        *dict(model.named_parameters()).values(),
        *dict(model.named_buffers()).values(),
    ]
    flat += list(example)
    replaced = targets or {}

    class Run(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            if n not in replaced:
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return replaced[n](*args, **kwargs)

    interp = Run(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*flat)
    return {n.name: v for n, v in interp.env.items()}


def _call_fns(
    fx_node: Any,
    op: Any,
    graph: Any,
    values: dict[str, Any],
    replacement: Callable[..., Any] | None = None,
) -> tuple[Callable[[], Any], Callable[[], Any] | None] | None:
    """(forward, forward-and-backward or None when no input needs a gradient) of one call on its
    recorded inputs (by `replacement` when given), each run once here; None when the call fails
    on its own."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    leaves: list[torch.Tensor] = []

    def real(a: Any, grad: bool) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        v = values[a.name]
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        if grad and graph.node(a.name).requires_grad and v.is_floating_point():
            v = v.clone().requires_grad_(True)
            leaves.append(v)
        return v

    target = replacement or fx_node.target
    args, kwargs = tree_map(lambda a: real(a, False), (fx_node.args, fx_node.kwargs))
    g_args, g_kwargs = tree_map(lambda a: real(a, True), (fx_node.args, fx_node.kwargs))

    def forward() -> None:
        target(*args, **kwargs)

    def forward_backward() -> None:
        res = tree_flatten(target(*g_args, **g_kwargs))[0]
        diff = [o for o in res if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.grad(diff, leaves, grads, allow_unused=True)

    try:
        forward()
        if not leaves or not op.requires_grad:
            return forward, None
        outs = [
            o
            for o in tree_flatten(target(*g_args, **g_kwargs))[0]
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        grads = [torch.ones_like(o) for o in outs]
        forward_backward()
    except Exception:  # noqa: BLE001 - an op that cannot run alone keeps the roofline
        return None
    return forward, forward_backward
