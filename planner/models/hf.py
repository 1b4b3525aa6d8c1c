"""Hugging Face ``transformers`` models from a config, without weights: the ``hf:`` model spec.

    hf:MODEL_TYPE:key=value,...     e.g. hf:llama:hidden_size=4096,num_hidden_layers=32,...
    hf:PATH/TO/config.json[,key=value,...]

``MODEL_TYPE`` is a ``transformers`` model type (``gpt2``, ``llama``, ``mistral``, ``qwen2``,
``bert``, ``mixtral``, ``qwen2_moe``, ...): the keys are its config's (``AutoConfig.for_model``);
a ``config.json`` is one saved by ``transformers`` (a hub checkpoint's, no weights needed), and
keys given after it override it; the dtype it declares (``torch_dtype``) is the one `meshplan
plan` and `meshplan manual` plan for unless ``--dtype`` says otherwise (`declared_dtype`).
Three keys are meshplan's, not the config's:

* ``task``: the head, ``causal-lm`` (``AutoModelForCausalLM``, the default) or ``masked-lm``
  (``AutoModelForMaskedLM``); a config.json naming an ``...ForMaskedLM`` architecture defaults to
  ``masked-lm``;
* ``seq``: the example batch's sequence length (default the config's ``max_position_embeddings``,
  at most 2048);
* ``attn``: the attention implementation, ``sdpa`` or ``eager``; by default transformers' own
  choice, ``sdpa`` where the model type has it and ``eager`` where it does not (Bloom, MPT,
  gpt-oss; Mamba has no attention, and builds only so).

The model is built on the requested device with ``transformers``' own initialisation (seed the
global generator for reproducible weights); its example batch is ``(input_ids, labels)`` of
``[batch, seq]`` token ids (`planner.tracing.calls` says how it is called). ``transformers`` is an
optional dependency: ``pip install meshplan[hf]``.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.vocab.plan_check import DTYPES

TASKS = ("causal-lm", "masked-lm")
ATTENTION = ("sdpa", "eager")
_OURS = ("task", "seq", "attn")
_PYTHON = {"True": True, "False": False, "None": None}
FORM = "hf:MODEL_TYPE:key=value,... or hf:PATH/config.json[,key=value,...]"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MeshplanError(
            "hf: models need the transformers package: pip install 'meshplan[hf]'"
        ) from None
    return transformers


def _hub_errors() -> tuple[type[Exception], ...]:
    """The errors a config raises for a value of the wrong type or an inconsistent set
    (``huggingface_hub``'s strict dataclasses, transformers 5's configs)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _value(raw: str) -> Any:
    """A config value from its text: a JSON literal (number, true/false/null, list), Python's
    True/False/None as a config's repr writes them, or a string."""
    if raw in _PYTHON:
        return _PYTHON[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _split(body: str) -> list[str]:
    """`body`'s comma-separated items, a comma inside brackets or quotes kept in its item (a
    list value: ``layer_types=["conv","full_attention"]``)."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(body):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    return [*items, body[start:]]


def _items(body: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in _split(body))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise MeshplanError(
                f"malformed item {item!r} in model spec {name!r}: expected key=value ({FORM})"
            )
        out[key.strip()] = _value(raw.strip())
    return out


def declared_dtype(name: str) -> str | None:
    """The dtype an ``hf:PATH/config.json`` spec's config declares (``dtype``, or
    ``torch_dtype`` as transformers 4 saved it) when a plan may be in it (`DTYPES`); None for any other
    spec, where the CLI's default is float16."""
    if not name.strip().startswith("hf:"):
        return None
    head = name.strip()[3:].partition(",")[0]
    if not head.endswith(".json") or not os.path.isfile(head):
        return None
    with open(head) as f:
        saved = json.load(f)
    declared = saved.get("dtype") or saved.get("torch_dtype")
    return declared if declared in DTYPES else None


def _check_type(tf: Any, model_type: str, name: str) -> None:
    """An unknown model type is named with the nearest ones transformers knows (its own
    message lists all of them, hundreds)."""
    known = list(tf.CONFIG_MAPPING.keys())
    if model_type not in known:
        near = difflib.get_close_matches(model_type, known, 3)
        raise MeshplanError(
            f"model spec {name!r}: transformers {tf.__version__} has no model type "
            f"{model_type!r}"
            + (f"; did you mean {' or '.join(near)}?" if near else "")
            + " (the types are transformers.CONFIG_MAPPING's keys, a config.json's "
            "'model_type')"
        )


def parse(name: str) -> tuple[Any, dict[str, Any]]:
    """``(transformers config, meshplan options)`` of an ``hf:`` spec (module docstring)."""
    tf = _transformers()
    body = name.strip()[3:]
    head, _, rest = body.partition(",")
    if head.endswith(".json"):
        if not os.path.isfile(head):
            raise MeshplanError(f"model spec {name!r}: no config file {head!r}")
        with open(head) as f:
            saved = json.load(f)
        items = _items(rest, name)
        model_type = saved.get("model_type")
        if not model_type:
            raise MeshplanError(
                f"{head} has no 'model_type'; is it a transformers config.json?"
            )
        archs = saved.get("architectures") or []
        if any(a.endswith("ForMaskedLM") for a in archs):
            items.setdefault("task", "masked-lm")
        fields = {k: v for k, v in saved.items() if k != "model_type"}
    else:
        model_type, _, rest = body.partition(":")
        if not model_type.strip():
            raise MeshplanError(f"model spec {name!r}: no model type; expected {FORM}")
        items, fields = _items(rest, name), {}
    _check_type(tf, model_type, name)
    options = {k: items.pop(k) for k in _OURS if k in items}
    fields.update(items)
    try:
        config = tf.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, *_hub_errors()) as exc:
        raise MeshplanError(
            f"model spec {name!r}: {' '.join(str(exc).split())[:300]}"
        ) from None
    # transformers keeps unknown keys as attributes: compare with the type's own defaults.
    known = set(tf.AutoConfig.for_model(model_type).to_dict())
    known |= set(getattr(config, "attribute_map", {}))
    unknown = [k for k in items if k not in known]
    if unknown:
        raise MeshplanError(
            f"model spec {name!r}: {type(config).__name__} has no {', '.join(unknown)}"
        )
    _check_padding(config, name)
    task = options.get("task", "causal-lm")
    attn = options.get("attn")  # None: transformers' own choice
    if task not in TASKS or attn not in (None, *ATTENTION):
        raise MeshplanError(
            f"model spec {name!r}: task must be one of {TASKS} and attn one of {ATTENTION}, "
            f"got task={task!r}, attn={attn!r}"
        )
    seq = options.get(
        "seq", min(getattr(config, "max_position_embeddings", 2048), 2048)
    )
    if not isinstance(seq, int) or seq < 1:
        raise MeshplanError(
            f"model spec {name!r}: seq must be a positive integer, got {seq!r}"
        )
    return config, {"task": task, "seq": seq, "attn": attn}


def _check_padding(config: Any, name: str) -> None:
    """The padding token is a row of the embedding (``padding_idx``): a default of the model
    type (Phi-3's 32000) outside a small vocabulary stops the build deep inside torch."""
    text = config.get_text_config()
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise MeshplanError(
            f"model spec {name!r}: pad_token_id {pad} is not a token of the vocabulary "
            f"(vocab_size {vocab}); give pad_token_id=N with 0 <= N < {vocab}, or "
            "pad_token_id=null"
        )


def _build_error(exc: Exception, options: dict[str, Any]) -> str:
    """What stopped transformers building the model (no such head, an attention implementation
    the model type lacks, a module's own check), and what to change where we know."""
    msg = " ".join(str(exc).split())[:300]
    if "Unrecognized configuration class" in msg:
        return f"no {options['task']} head for this config: {msg}"
    hint = ""
    if "attention implementation" in msg and options["attn"] == "sdpa":
        hint = " (attn=eager builds it with the model's own attention)"
    return f"transformers could not build the model from this config{hint}: {msg}"


def build(
    name: str, batch: int, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The ``hf:`` spec's model (no weights loaded) and example batch, both on `device`."""
    tf = _transformers()
    config, options = parse(name)
    if options["attn"] is not None:
        config._attn_implementation = options["attn"]
    auto = (
        tf.AutoModelForCausalLM
        if options["task"] == "causal-lm"
        else tf.AutoModelForMaskedLM
    )
    try:
        with torch.device(device):
            model = auto.from_config(config, dtype=dtype)
    except (
        ValueError,
        AssertionError,
        RuntimeError,
        TypeError,
        AttributeError,  # a sub-config without a key the module reads (Dbrx's attn_config)
        KeyError,
        IndexError,
    ) as exc:
        raise MeshplanError(
            f"model spec {name!r}: {_build_error(exc, options)}"
        ) from None
    model.train()
    shape = (batch, options["seq"])
    vocab = config.get_text_config().vocab_size
    if device.type == "meta":
        ids = torch.empty(shape, dtype=torch.int64, device=device)
        return model, (ids, torch.empty_like(ids))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, shape, generator=gen)
    labels = torch.randint(0, vocab, shape, generator=gen)
    return model, (ids.to(device), labels.to(device))


def param_count(name: str) -> int:
    """Parameters of the ``hf:`` spec's model, counted on the meta device (tied weights once)."""
    model, _ = build(name, 1, torch.device("meta"), torch.float32)
    return sum(p.numel() for p in model.parameters())
