"""Built-in models for demos, tests and benchmarks: GPT, Llama 3, Mixtral, DeepSeek-MoE, GShard MoE,
Wide-ResNet and a small MLP.

Every model's ``forward(*batch)`` returns the scalar training loss, builds on the meta device and
traces with ``make_fx`` on fake tensors. ``build_model(name)`` turns a built-in name, a spec string
or a user's ``package.module:factory`` into ``(module, example_batch)``.
"""

from planner.models.gpt import GPT, GPT_CONFIGS, GPTConfig, gpt_param_count
from planner.models.mlp import MLP, MLPConfig, mlp_param_count
from planner.models.moe import MOE_CONFIGS, MoE, MoEConfig, moe_param_count
from planner.models.registry import (
    DEFAULT_BATCH,
    SPEC_FORMS,
    build_model,
    get_config,
    list_models,
    param_count,
)
from planner.models.wresnet import (
    WRESNET_CONFIGS,
    WideResNet,
    WResNetConfig,
    wresnet_param_count,
)

__all__ = [
    "DEFAULT_BATCH",
    "GPT",
    "GPT_CONFIGS",
    "MLP",
    "MOE_CONFIGS",
    "SPEC_FORMS",
    "WRESNET_CONFIGS",
    "GPTConfig",
    "MLPConfig",
    "MoE",
    "MoEConfig",
    "WResNetConfig",
    "WideResNet",
    "build_model",
    "get_config",
    "gpt_param_count",
    "list_models",
    "mlp_param_count",
    "moe_param_count",
    "param_count",
    "wresnet_param_count",
]
