"""How the tracer calls a model to get its training loss: the calling convention of a plain
`nn.Module` (``model(*batch)`` returns the loss) and of a Hugging Face ``transformers`` model
(``model(input_ids=..., labels=...).loss``), so that both are traced, planned and run unchanged.

A Hugging Face model is recognised without importing ``transformers`` (it is an optional extra):
a module with a ``config`` that has a ``model_type`` and a ``can_generate``/``base_model_prefix``
attribute, i.e. a ``PreTrainedModel``. Its batch is ``(input_ids, labels[, attention_mask])``,
all ``[batch, seq]`` integer tensors; the task head decides what ``labels`` mean (next tokens for
a causal LM, which shifts them itself; masked tokens, -100 elsewhere, for a masked LM). The key/
value cache is switched off: training does not use it, and a cache object is no loss. Without an
``attention_mask`` in the batch the model is called without one, as transformers' trainers call
it on unpadded rows: its ``sdpa`` attention then runs causal (``is_causal``) with no mask tensor,
as it would on a device (`tracing_patches` says what the trace needs for that).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from cost_models.errors import MeshplanError

# Class-name endings of the Hugging Face task heads meshplan trains, and their task names.
HF_TASKS = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForMaskedLM": "masked-lm",
}
HF_BATCH = ("input_ids", "labels", "attention_mask")


def is_hf_model(model: Any) -> bool:
    """Whether `model` is a Hugging Face ``PreTrainedModel`` (duck-typed, see the module docstring)."""
    config = getattr(model, "config", None)
    return (
        isinstance(model, nn.Module)
        and hasattr(config, "model_type")
        and hasattr(model, "base_model_prefix")
    )


def hf_task(model: nn.Module) -> str:
    """The training task of a Hugging Face model, from its head's class name."""
    name = type(model).__name__
    for suffix, task in HF_TASKS.items():
        if name.endswith(suffix):
            return task
    raise MeshplanError(
        f"{name} is a Hugging Face model without a language-modelling head meshplan can train; "
        f"use a class ending in one of {sorted(HF_TASKS)} (e.g. AutoModelForCausalLM."
        "from_config(config)), or wrap the model in an nn.Module whose forward returns the loss"
    )


def batch_tuple(example: Any) -> Any:
    """A Hugging Face style batch ``{"input_ids": ..., "labels": ...[, "attention_mask": ...]}``
    as the tuple meshplan passes around; anything else unchanged."""
    if not isinstance(example, dict):
        return example
    unknown = sorted(set(example) - set(HF_BATCH))
    if unknown or "input_ids" not in example:
        raise MeshplanError(
            f"a batch given as a dict needs 'input_ids' and may have {list(HF_BATCH[1:])}; "
            f"got keys {sorted(example)}"
        )
    keys = [k for k in HF_BATCH if k in example]
    if keys != list(HF_BATCH[: len(keys)]):
        raise MeshplanError(
            "a batch with an attention_mask needs labels too (for a causal LM, the input_ids)"
        )
    return tuple(example[k] for k in keys)


def _hf_kwargs(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    hf_task(model)
    if not 1 <= len(batch) <= len(HF_BATCH):
        raise MeshplanError(
            f"a Hugging Face model's batch is (input_ids[, labels[, attention_mask]]), "
            f"got {len(batch)} tensors"
        )
    kwargs: dict[str, Any] = dict(zip(HF_BATCH, batch))
    kwargs.setdefault("labels", batch[0])
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False
    kwargs["return_dict"] = True
    return kwargs


def call_for_loss(
    model: nn.Module, batch: tuple[torch.Tensor, ...], call: Any = None
) -> torch.Tensor:
    """The scalar training loss of `model` on `batch` under its calling convention (module
    docstring). ``call(model, args, kwargs)`` replaces ``model(*args, **kwargs)`` (the tracer
    passes `torch.func.functional_call` with its fake parameters)."""
    call = call or (lambda m, a, k: m(*a, **k))
    if is_hf_model(model):
        out = call(model, (), _hf_kwargs(model, batch))
        loss = getattr(out, "loss", None)
        what = f"{type(model).__name__}(input_ids=..., labels=...).loss"
    else:
        loss = out = call(model, batch, {})
        what = f"{type(model).__name__}.forward"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(out).__name__
        )
        raise MeshplanError(
            f"{what} returned {got}; meshplan trains a model whose forward returns the scalar "
            "training loss: compute the loss inside forward (e.g. wrap the model in an nn.Module "
            "that applies your loss function to its output and the batch's targets)"
        )
    return loss


@contextlib.contextmanager
def tracing_patches(model: nn.Module) -> Iterator[None]:
    """What a Hugging Face model needs to be traced on fake tensors, for the length of a trace:

    * without an attention mask, transformers looks for packed sequences (several documents in
      one row) in the position ids it made, by reading their values, which a fake tensor does
      not have; while tracing it then builds the mask of every packing it cannot rule out, a
      ``[batch, 1, seq, seq]`` tensor turned into an additive float mask in every attention
      layer (8192 tokens: 128 MiB saved per layer and row, and no flash kernel). The batch has no
      position ids (`_hf_kwargs`), so transformers' own are ``0 .. seq - 1`` in every row: one
      sequence, no packing. The mask's preprocessing is given no position ids, as for a batch
      known not to be packed (giving it ours would also add an expand of them, at more than
      one row only, and change the graph with the batch size);
    * a model that makes its own mask of ones when called without one (BioGPT, Megatron-BERT,
      RoFormer, RemBERT: ``torch.ones(batch, seq)``) has transformers read it to see whether
      any token is padded, which a traced tensor cannot answer. That mask is a constant of the
      trace, so its values are read here instead: a mask of ones is given to the preprocessing
      as no mask, which is what transformers makes of it on a device (``sdpa`` causal or
      unmasked with no mask tensor; eager attention the same mask);
    * a mixture of experts' experts run transformers' grouped matrix-product path: its
      ``eager`` path loops over the experts that received tokens (data-dependent control
      flow); both compute the same;
    * ``torch.nn.functional.grouped_mm`` is used only for bfloat16 weights: its fake kernel
      rejects other dtypes (the CPU kernel accepts them), so other dtypes take transformers' own
      fallback operator (``transformers::grouped_mm_fallback``, one matrix product per expert),
      which DTensor shards as it shards ``aten._grouped_mm`` (`planner.vocab.dtensor_ext`).

    The runtime executes the traced graph, so it runs the same operators the planner priced."""
    if not is_hf_model(model):
        yield
        return
    masks = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as undo:
        preprocess = getattr(masks, "_preprocess_mask_arguments", None)
        signature = None if preprocess is None else inspect.signature(preprocess)
        if signature is not None and "position_ids" in signature.parameters:

            def unpacked(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                bound.arguments["position_ids"] = None
                if _made_of_ones(bound.arguments.get("attention_mask")):
                    bound.arguments["attention_mask"] = None
                return preprocess(*bound.args, **bound.kwargs)

            masks._preprocess_mask_arguments = unpacked
            undo.callback(setattr, masks, "_preprocess_mask_arguments", preprocess)
        with _experts_patches(model):
            yield


def _made_of_ones(mask: Any) -> bool:
    """Whether `mask` is a 2-D padding mask the model made itself (a real tensor, not one of the
    trace's fake inputs) with no token masked. Its values are read with the trace's recording
    switched off: reading them through it would be a data-dependent op of the graph."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    if isinstance(mask, FakeTensor) or mask.is_meta:
        return False
    with disable_proxy_modes_tracing():
        return bool(mask.all())


@contextlib.contextmanager
def _experts_patches(model: nn.Module) -> Iterator[None]:
    """The mixture-of-experts part of `tracing_patches`."""
    moe = sys.modules.get("transformers.integrations.moe")
    config = getattr(model, "config", None)
    if moe is None:
        yield
        return
    original = moe._can_use_grouped_mm
    implementation = getattr(config, "_experts_implementation", None)
    moe._can_use_grouped_mm = lambda input, weight, offs: (
        weight.dtype == torch.bfloat16 and original(input, weight, offs)
    )
    if implementation == "eager":
        config._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
        if implementation == "eager":
            config._experts_implementation = implementation
