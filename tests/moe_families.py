"""Every fused-experts causal LM that ``transformers`` can build offline from a small config.

The families are enumerated from the installed ``transformers``: the model types whose modeling file
decorates an experts class with ``@use_experts_implementation``. Each is built the way a user builds
one (``AutoModelForCausalLM.from_config``, the family's default experts implementation), with only
the sizes shrunk. A family that cannot be built that way (multimodal-only wrappers, configs whose
validation a generic shrink does not satisfy, or still too big) is listed in :data:`SKIPPED` with the
reason, so that the parametrized tests cover the rest and nothing is dropped silently.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import nn

MAX_PARAMETERS = 5_000_000
"""Families larger than this at the tiny sizes are left out (they would slow the suite down)."""

_SMALL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)

# Sizes the generic shrink does not reach (first dense layers, other names of the same fields).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "deepseek_v2": dict(first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(first_k_dense_replace=1, n_group=1, topk_group=1),
    "glm4_moe_lite": dict(first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, hidden_size_per_layer_input=16,
                        vocab_size_per_layer_input=256, num_global_key_value_heads=2, global_head_dim=16,
                        expert_intermediate_size=32, layer_types=["sliding_attention", "full_attention"]),
    "axk1": dict(n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                 v_head_dim=16, head_dim=8, mlp_layer_types=["dense", "sparse"]),
    "axk2": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                 mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "indexed_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
                        linear_head_dim=16, linear_num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "hunyuan_v1_moe": dict(moe_topk=2, num_shared_expert=1),
    "ernie4_5_moe": dict(moe_k=2, moe_num_experts=8, moe_layer_start_index=0),
    "bailing_hybrid": dict(first_k_dense_replace=0, num_expert_group=1, topk_group=1,
                           mlp_layer_types=["sparse", "sparse"], layer_types=["linear_attention", "full_attention"]),
    "flint": dict(first_k_dense_replace=0),
    "beam": dict(first_k_dense_replace=0),
}


@functools.cache
def fused_experts_model_types() -> tuple[str, ...]:
    """Model types of the installed ``transformers`` whose modeling file uses the experts interface."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        path = os.path.join(root, module, f"modeling_{module}.py")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as source:
                if "@use_experts_implementation" in source.read():
                    found.append(model_type)
    return tuple(found)


def _config(model_type: str, **extra: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **(_SMALL | _OVERRIDES.get(model_type, {}) | extra))


def _has_fused_experts(model: nn.Module) -> bool:
    from lightning_superpipe.moe.layouts import is_fused_experts

    return any(is_fused_experts(m) for m in model.modules())


@functools.cache
def _survey() -> tuple[tuple[str, ...], dict[str, str]]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    buildable, skipped = [], {}
    for model_type in fused_experts_model_types():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = _config(model_type)
                with torch.device("meta"):  # sizes first: some defaults stay huge
                    model = AutoModelForCausalLM.from_config(config)
        except Exception as error:  # noqa: BLE001 - a survey: every reason is reported in SKIPPED
            skipped[model_type] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            continue
        parameters = sum(p.numel() for p in model.parameters())
        if not _has_fused_experts(model):
            skipped[model_type] = "no fused experts at the tiny sizes (dense layers only)"
            continue
        if parameters > MAX_PARAMETERS:
            skipped[model_type] = f"{parameters:,} parameters at the tiny sizes"
            continue
        try:  # the family's own forward, unpaged, must run at these sizes
            with torch.no_grad():
                build(model_type)(input_ids=torch.zeros(1, 4, dtype=torch.long))
        except Exception as error:  # noqa: BLE001
            skipped[model_type] = f"its unpaged forward fails at the tiny sizes: {type(error).__name__}: {error}"[:200]
            continue
        buildable.append(model_type)
    return tuple(buildable), skipped


def buildable_model_types() -> tuple[str, ...]:
    """Fused-experts model types that build as small causal LMs here."""
    return _survey()[0]


def skipped_model_types() -> dict[str, str]:
    """Fused-experts model types left out, with the reason."""
    return _survey()[1]


def build(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **extra: Any) -> nn.Module:
    """A small random causal LM of ``model_type`` with its default experts implementation, in eval mode.

    Args:
        model_type: One of :func:`buildable_model_types`.
        seed: Seed of the weight initialisation.
        dtype: Parameter dtype.
        **extra: Further config fields (e.g. ``num_experts_per_tok=8``).
    """
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = _config(model_type, **extra)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    # Random init leaves some families' experts at zero or tiny scales: give every expert weight a
    # spread so that quantization error is visible and routing varies.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name and param.dim() >= 2 and param.std() == 0:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.to(dtype).eval()
