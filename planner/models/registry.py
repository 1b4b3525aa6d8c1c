"""Model registry: turn a model name into ``(nn.Module, example_batch)``.

A name is one of

* a built-in name (``list_models()``): the reference sizes ``gpt-125m`` ... ``gpt-76b``,
  ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``mixtral-8x7b``, ``mixtral-8x22b``,
  ``deepseek-v3``, ``moe-380m`` ... ``moe-70b``, ``wresnet-250m`` ... ``wresnet-13b``, the small
  ``gpt-tiny``, ``llama-tiny``, ``mixtral-tiny``, ``deepseek-tiny``, ``moe-tiny``,
  ``wresnet-tiny`` for tests and demos, and ``mlp``; case-insensitive;
* a spec string ``family:key=value,...`` (``SPEC_FORMS``), e.g.
  ``gpt:hidden=8192,layers=48,heads=64,seq=2048``; keys left out take the family's defaults;
* a user's model ``package.module:factory``: the module is imported and ``factory`` called; it
  must return ``(module, example_batch)`` with ``example_batch`` a tensor or a tuple of tensors.
  ``factory`` receives the keyword arguments ``batch``, ``device`` and ``dtype`` when they were
  given to ``build_model`` and its signature names them (or takes ``**kwargs``); a factory that
  accepts ``device`` can build straight on the meta device. The returned module and batch are then
  moved to ``device`` (and floating tensors to ``dtype`` when one was given).

Default batch sizes (``DEFAULT_BATCH``): 8 sequences for the language models (8 x seq tokens; enough for
data parallelism and micro-batching to be searched), 8 images for Wide-ResNet, 32 rows for the MLP.
Benchmarks pass the reference global batch explicitly. On the meta device the example batch is meta
too; elsewhere it is random but seeded (the same every call).

Every error is a ``MeshplanError`` whose message is one line naming the problem and what is
accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cost_models.errors import MeshplanError
from planner.models.deepseek import (
    DEEPSEEK_CONFIGS,
    DeepSeek,
    DeepSeekConfig,
    deepseek_param_count,
)
from planner.models.gpt import GPT, GPT_CONFIGS, GPTConfig, gpt_param_count
from planner.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig, llama_param_count
from planner.models.mixtral import (
    MIXTRAL_CONFIGS,
    Mixtral,
    MixtralConfig,
    mixtral_param_count,
)
from planner.models.mlp import MLP, MLPConfig, mlp_param_count
from planner.models.moe import MOE_CONFIGS, MoE, MoEConfig, moe_param_count
from planner.models.wresnet import (
    WRESNET_CONFIGS,
    WideResNet,
    WResNetConfig,
    wresnet_param_count,
)

__all__ = [
    "DEFAULT_BATCH",
    "SPEC_FORMS",
    "build_model",
    "get_config",
    "list_models",
    "param_count",
]

Batch = tuple[torch.Tensor, ...]


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _token_batch(
    config: Any, batch: int, device: torch.device, dtype: torch.dtype
) -> Batch:
    shape = (batch, config.seq)
    if device.type == "meta":
        return (
            torch.empty(shape, dtype=torch.int64, device=device),
            torch.empty(shape, dtype=torch.int64, device=device),
        )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab, shape, generator=gen)
    targets = torch.randint(0, config.vocab, shape, generator=gen)
    return tokens.to(device), targets.to(device)


def _image_batch(
    config: WResNetConfig, batch: int, device: torch.device, dtype: torch.dtype
) -> Batch:
    shape = (batch, 3, config.image, config.image)
    if device.type == "meta":
        return (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        )
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(shape, generator=gen).to(dtype)
    labels = torch.randint(0, config.classes, (batch,), generator=gen)
    return images.to(device), labels.to(device)


def _row_batch(
    config: MLPConfig, batch: int, device: torch.device, dtype: torch.dtype
) -> Batch:
    if device.type == "meta":
        return (
            torch.empty(batch, config.in_features, dtype=dtype, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.in_features, generator=gen).to(dtype)
    y = torch.randint(0, config.classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


@dataclass(frozen=True)
class _Family:
    """One built-in model family: its config, module, spec keys and example batch."""

    config_cls: type
    model_cls: Callable[..., nn.Module]
    count: Callable[[Any], int]
    make_batch: Callable[[Any, int, torch.device, torch.dtype], Batch]
    default_batch: int
    form: str
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def keys(self) -> dict[str, type]:
        kinds = {"float": float, float: float, "str": str, str: str}
        return {
            f.name: kinds.get(f.type, int) for f in dataclasses.fields(self.config_cls)
        }

    def required(self) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self.config_cls)
            if f.default is dataclasses.MISSING
        ]


_FAMILIES: dict[str, _Family] = {
    "gpt": _Family(
        GPTConfig,
        GPT,
        gpt_param_count,
        _token_batch,
        8,
        "gpt:hidden=H,layers=L,heads=N[,seq=1024,vocab=51200,attn=fused|explicit|explicit-batch,attn_dropout=0]",
    ),
    "llama": _Family(
        LlamaConfig,
        Llama,
        llama_param_count,
        _token_batch,
        8,
        "llama:hidden=H,layers=L,heads=N,kv_heads=G,ffn=F[,vocab=128256,seq=8192,"
        "rope_theta=500000,norm_eps=1e-5,attn=fused|explicit|explicit-batch,attn_dropout=0]",
    ),
    "mixtral": _Family(
        MixtralConfig,
        Mixtral,
        mixtral_param_count,
        _token_batch,
        8,
        "mixtral:hidden=H,layers=L,heads=N,kv_heads=G,ffn=F[,experts=8,vocab=32000,seq=4096,"
        "group_size=4096,capacity_factor=1.0,aux_loss_coef=0.02,rope_theta=1e6,norm_eps=1e-5]",
    ),
    "deepseek-moe": _Family(
        DeepSeekConfig,
        DeepSeek,
        deepseek_param_count,
        _token_batch,
        8,
        "deepseek-moe:hidden=H,layers=L,heads=N,kv_heads=G,ffn=F,experts=E,shared=S,top_k=K,"
        "expert_ffn=FE,dense_layers=D[,vocab=129280,seq=4096,group_size=4096,"
        "capacity_factor=1.0,aux_loss_coef=0.003,rope_theta=10000,norm_eps=1e-6]",
    ),
    "moe": _Family(
        MoEConfig,
        MoE,
        moe_param_count,
        _token_batch,
        8,
        "moe:hidden=H,layers=L,experts=E[,heads=16,seq=1024,vocab=32000,group_size=2048,ffn=8,"
        "capacity_factor=1.0,aux_loss_coef=0.01]",
    ),
    "wresnet": _Family(
        WResNetConfig,
        WideResNet,
        wresnet_param_count,
        _image_batch,
        8,
        "wresnet:layers=50|101|...,channels=C,width=W[,image=224,classes=1000]",
    ),
    "mlp": _Family(
        MLPConfig,
        MLP,
        mlp_param_count,
        _row_batch,
        32,
        "mlp[:in_features=64,hidden=256,layers=4,classes=16]",
        aliases={"batch_in": "in_features", "in": "in_features"},
    ),
}

#: Default example-batch size of each built-in family (see the module docstring).
DEFAULT_BATCH: dict[str, int] = {
    name: fam.default_batch for name, fam in _FAMILIES.items()
}

#: The accepted spec-string forms, for help texts.
SPEC_FORMS: tuple[str, ...] = tuple(fam.form for fam in _FAMILIES.values())

_NAMED: dict[str, tuple[str, Any]] = {
    **{name: ("gpt", cfg) for name, cfg in GPT_CONFIGS.items()},
    "gpt-tiny": ("gpt", GPTConfig(hidden=64, layers=2, heads=4, seq=64, vocab=512)),
    **{name: ("llama", cfg) for name, cfg in LLAMA_CONFIGS.items()},
    "llama-tiny": (
        "llama",
        LlamaConfig(
            hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64
        ),
    ),
    **{name: ("mixtral", cfg) for name, cfg in MIXTRAL_CONFIGS.items()},
    "mixtral-tiny": (
        "mixtral",
        MixtralConfig(
            hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=512, seq=64
        ),
    ),
    **{name: ("deepseek-moe", cfg) for name, cfg in DEEPSEEK_CONFIGS.items()},
    "deepseek-tiny": (
        "deepseek-moe",
        DeepSeekConfig(
            hidden=64,
            layers=3,
            heads=4,
            kv_heads=2,
            ffn=128,
            experts=8,
            shared=1,
            top_k=3,
            expert_ffn=16,
            dense_layers=1,
            vocab=512,
            seq=64,
        ),
    ),
    **{name: ("moe", cfg) for name, cfg in MOE_CONFIGS.items()},
    "moe-tiny": (
        "moe",
        MoEConfig(
            hidden=64, layers=2, experts=4, heads=4, seq=64, vocab=512, group_size=128
        ),
    ),
    **{name: ("wresnet", cfg) for name, cfg in WRESNET_CONFIGS.items()},
    "wresnet-tiny": (
        "wresnet",
        WResNetConfig(layers=14, channels=8, width=2, image=32, classes=10),
    ),
    "mlp": ("mlp", MLPConfig()),
}


def list_models() -> list[str]:
    """All built-in model names, family by family, smallest first."""
    return list(_NAMED)


def _accepted_forms() -> str:
    return (
        f"built-in names: {', '.join(_NAMED)}; spec strings: {'; '.join(SPEC_FORMS)}; "
        "or your own 'package.module:factory'"
    )


def _parse_spec(family_name: str, body: str, name: str) -> Any:
    family = _FAMILIES[family_name]
    keys = family.keys()
    accepted = ", ".join(list(keys) + list(family.aliases))
    values: dict[str, Any] = {}
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not sep or not key or not raw:
            raise MeshplanError(
                f"malformed item {item!r} in model spec {name!r}: expected key=value; "
                f"accepted keys: {accepted} (form {family.form})"
            )
        key = family.aliases.get(key, key)
        if key not in keys:
            raise MeshplanError(
                f"unknown key {key!r} in model spec {name!r}; accepted keys: {accepted}"
            )
        if key in values:
            raise MeshplanError(f"key {key!r} given twice in model spec {name!r}")
        kind = keys[key]
        try:
            values[key] = kind(raw)
        except ValueError:
            what = "a number" if kind is float else "an integer"
            raise MeshplanError(
                f"bad value {raw!r} for {key} in model spec {name!r}: expected {what}"
            ) from None
    missing = [k for k in family.required() if k not in values]
    if missing:
        raise MeshplanError(
            f"model spec {name!r} is missing {', '.join(missing)}; expected {family.form}"
        )
    try:
        return family.config_cls(**values)
    except MeshplanError as exc:
        raise MeshplanError(f"model spec {name!r}: {exc}") from None


def _resolve(name: str) -> tuple[str, Any] | None:
    """``(family, config)`` for a built-in name or spec string; ``None`` for a factory."""
    if not isinstance(name, str) or not name.strip():
        raise MeshplanError(
            f"model name must be a non-empty string, got {name!r}; {_accepted_forms()}"
        )
    key = name.strip()
    if key.lower() in _NAMED:
        return _NAMED[key.lower()]
    prefix, sep, body = key.partition(":")
    if prefix.lower() in _FAMILIES:
        return prefix.lower(), _parse_spec(prefix.lower(), body, key)
    if sep:
        return None
    close = difflib.get_close_matches(key.lower(), list(_NAMED), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise MeshplanError(f"unknown model {key!r}{hint}; accepted: {_accepted_forms()}")


def _is_hf(name: Any) -> bool:
    return isinstance(name, str) and name.strip().lower().startswith("hf:")


def built_from_string_alone(name: str) -> bool:
    """Whether ``name`` (a valid model name) builds the same model every time: a built-in name or
    spec, or a Hugging Face spec written inline (``hf:TYPE:...``). Not a user factory (its code may
    read state) nor a Hugging Face config file (it may be edited)."""
    if _is_hf(name):
        return not name.strip()[3:].partition(",")[0].endswith(".json")
    return _resolve(name) is not None


def get_config(name: str) -> Any:
    """The config dataclass (``GPTConfig``, ``MoEConfig``, ...) of a built-in name or spec string."""
    resolved = _resolve(name)
    if resolved is None:
        raise MeshplanError(
            f"model {name!r} is a user factory; it has no built-in config"
        )
    return resolved[1]


def _check_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MeshplanError(
            f"bad device {device!r}: {_one_line(exc)}; expected e.g. 'meta', 'cpu', 'cuda:0'"
        ) from None


def _identifier_path(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _call_factory(
    name: str, batch: int | None, device: torch.device, dtype: torch.dtype | None
) -> tuple[nn.Module, Batch]:
    module_name, _, attr = name.strip().partition(":")
    if not _identifier_path(module_name) or not _identifier_path(attr):
        raise MeshplanError(
            f"malformed model factory {name!r}: expected 'package.module:factory'; "
            f"or {_accepted_forms()}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise MeshplanError(
            f"cannot import module {module_name!r} for model {name!r}: {_one_line(exc)}"
        ) from exc
    except Exception as exc:
        raise MeshplanError(
            f"importing module {module_name!r} for model {name!r} failed: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MeshplanError(
                f"module {module_name!r} has no attribute {attr!r} (model {name!r}); "
                "expected 'package.module:factory' naming a function"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise MeshplanError(
            f"{name!r} is a {type(obj).__name__}, not a callable factory"
        )

    wanted = {"batch": batch, "device": device, "dtype": dtype}
    try:
        params = inspect.signature(obj).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kwargs = {
            k: v for k, v in wanted.items() if v is not None and (var_kw or k in params)
        }
    except (TypeError, ValueError):
        kwargs = {}
    try:
        result = obj(**kwargs)
    except MeshplanError:
        raise
    except Exception as exc:
        raise MeshplanError(
            f"model factory {name!r} raised {type(exc).__name__}: {_one_line(exc)}"
        ) from exc

    expected = "expected (nn.Module, example_batch) with example_batch a tensor or tuple of tensors"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise MeshplanError(
            f"model factory {name!r} returned {type(result).__name__}; {expected}"
        )
    module, example = result
    if not isinstance(module, nn.Module):
        raise MeshplanError(
            f"model factory {name!r} returned a {type(module).__name__} as the model; {expected}"
        )
    if isinstance(example, torch.Tensor):
        example = (example,)
    if (
        not isinstance(example, (tuple, list))
        or not example
        or not all(isinstance(t, torch.Tensor) for t in example)
    ):
        raise MeshplanError(
            f"model factory {name!r} returned a bad example batch "
            f"({type(example).__name__}); {expected}"
        )
    try:
        module = (
            module.to(device)
            if dtype is None
            else module.to(device=device, dtype=dtype)
        )
        example = tuple(
            t.to(device=device, dtype=dtype)
            if dtype is not None and t.is_floating_point()
            else t.to(device)
            for t in example
        )
    except (RuntimeError, NotImplementedError) as exc:
        raise MeshplanError(
            f"cannot move model {name!r} to device {str(device)!r}: {_one_line(exc)}"
        ) from exc
    return module, tuple(example)


def build_model(
    name: str,
    *,
    batch: int | None = None,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, Batch]:
    """Build the model ``name`` and an example batch, both on ``device``.

    ``batch`` is the example batch's leading size (``DEFAULT_BATCH`` of the family when ``None``).
    ``dtype`` is the parameter dtype of built-in models (float32 when ``None``); for a user
    factory it converts floating parameters and inputs only when given. ``model(*batch)`` returns
    the scalar training loss.
    """
    dev = _check_device(device)
    if batch is not None and (
        not isinstance(batch, int) or isinstance(batch, bool) or batch < 1
    ):
        raise MeshplanError(f"batch must be a positive integer, got {batch!r}")
    if dtype is not None and (
        not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
    ):
        raise MeshplanError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if _is_hf(name):
        from planner.models import hf

        return hf.build(name, batch or 1, dev, dtype or torch.float32)
    resolved = _resolve(name)
    if resolved is None:
        return _call_factory(name, batch, dev, dtype)
    family_name, config = resolved
    family = _FAMILIES[family_name]
    dtype = dtype or torch.float32
    with torch.device(dev):
        model = family.model_cls(config, dtype=dtype)
    example = family.make_batch(config, batch or family.default_batch, dev, dtype)
    return model, example


def param_count(name: str) -> int:
    """Number of parameters of ``name``: closed form for built-ins, counted on meta otherwise."""
    if _is_hf(name):
        from planner.models import hf

        return hf.param_count(name)
    resolved = _resolve(name)
    if resolved is None:
        model, _ = _call_factory(name, None, torch.device("meta"), None)
        return sum(p.numel() for p in model.parameters())
    family_name, config = resolved
    return _FAMILIES[family_name].count(config)
