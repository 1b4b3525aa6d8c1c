"""Run a graph traced on the planning machine's CPU (or meta) tensors on the devices of the run.

The planner traces on fake tensors of the machine it runs on, so the graph names what a CPU runs:

* ``F.scaled_dot_product_attention`` is recorded as ``aten._scaled_dot_product_flash_attention_for_cpu``,
  a kernel that exists for CPU tensors only;
* factory ops (``aten.arange``, ``aten.empty``) carry ``device=cpu``.

`device_targets(gm, device_type)` gives, for the nodes that need it, the callable that runs them on
this process's device of that type (a DeviceMesh's ``device_type``): attention through the CUDA flash kernel (half precision, head size a multiple of 8 up to
256, compute capability 8.0 or newer) or else the memory-efficient kernel, with the same inputs,
the same causal flag and scale, and the same first two outputs (attention output and log-sum-exp);
factory ops with the run's device. DTensor shards both CUDA kernels by batch or by heads, the
strategies `planner.intra.dtensor_rules` registers for the CPU kernel, so the planned placements hold.
On CPU nothing is replaced.

What PyTorch lacks: ``aten.scaled_dot_product_attention`` is CompositeImplicitAutograd, so a trace
records the backend kernel the tracing device picked rather than a device-neutral op, and there is
no pass that retargets a traced aten graph to another device type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from cost_models.errors import MeshplanError

aten = torch.ops.aten

CPU_SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
HALF = (torch.float16, torch.bfloat16)


def flash_supported(
    q: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> bool:
    """Whether the CUDA flash kernel takes these inputs (else the memory-efficient one runs)."""
    head = q.shape[-1]
    return (
        q.dtype in HALF
        and attn_mask is None
        and dropout_p == 0.0
        and head % 8 == 0
        and head <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def cuda_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_scaled_dot_product_flash_attention_for_cpu``'s signature and outputs, on CUDA kernels."""
    if flash_supported(q, attn_mask, dropout_p):
        out = aten._scaled_dot_product_flash_attention.default(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )
    else:
        out = aten._scaled_dot_product_efficient_attention.default(
            q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
        )
    return out[0], out[1]


def _on(target: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    def factory(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **{**kwargs, "device": device})

    return factory


def run_device(device_type: str) -> torch.device:
    """This process's device of `device_type` (a DeviceMesh's): the CPU, or the current GPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    raise MeshplanError(
        f"cannot run a plan on {device_type!r} devices; the runtime runs on 'cpu' (gloo) "
        "and 'cuda' (NCCL)"
    )


def device_targets(
    gm: torch.fx.GraphModule, device_type: str
) -> dict[torch.fx.Node, Callable[..., Any]]:
    """Replacement callables for the nodes of `gm` that would not run on `device_type` as traced."""
    device = run_device(device_type)
    if device.type == "cpu":
        return {}
    out: dict[torch.fx.Node, Callable[..., Any]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is CPU_SDPA:
            out[n] = cuda_sdpa
        elif (
            isinstance(n.kwargs.get("device"), torch.device)
            and n.kwargs["device"] != device
        ):
            out[n] = _on(n.target, device)
    return out
