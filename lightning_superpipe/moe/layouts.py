"""Find the routed-expert layers of the supported ``transformers`` MoE families.

All supported families keep, per decoder layer, a sparse MoE block ``mlp`` with a router ``gate``
(returning ``(logits, top_k_weights, top_k_index)``) and an experts module ``experts`` with fused
3-D weights ``gate_up_proj [E, 2I, H]`` (gate half first) and ``down_proj [E, H, I]``. Qwen2-MoE
adds a dense ``shared_expert``, which every token uses: it is left as it is (never paged).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

__all__ = [
    "EXPERT_PROJECTIONS",
    "SUPPORTED_MODEL_TYPES",
    "MoELayer",
    "UnsupportedMoEModelError",
    "find_moe_layers",
]

EXPERT_PROJECTIONS: tuple[str, ...] = ("gate_up_proj", "down_proj")
"""Names of the fused expert weights, in the order the experts apply them."""

# model_type -> (modeling module, sparse MoE block class name)
_SPARSE_BLOCKS: dict[str, tuple[str, str]] = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_SPARSE_BLOCKS)
"""``config.model_type`` values whose experts can be paged."""


class UnsupportedMoEModelError(ValueError):
    """The model has no expert layout that paging supports."""


@dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of a model.

    Args:
        index: Position among the model's MoE blocks (0-based).
        name: Qualified module name of the block, e.g. ``"model.layers.3.mlp"``.
        block: The sparse MoE block.
        router: Its router (``block.gate``).
        experts: Its fused experts module (``block.experts``).
    """

    index: int
    name: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module

    @property
    def num_experts(self) -> int:
        """Routed experts in this layer."""
        return int(self.experts.num_experts)

    @property
    def top_k(self) -> int:
        """Experts each token is routed to."""
        return int(self.router.top_k)


def _unsupported(reason: str) -> UnsupportedMoEModelError:
    return UnsupportedMoEModelError(
        f"{reason}. Paged MoE precision supports transformers models of type "
        f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)} (fused experts `gate_up_proj [E, 2I, H]`, "
        "`down_proj [E, H, I]`, no bias, not transposed); load one of those families."
    )


def _block_class(model_type: str) -> type[nn.Module]:
    module_name, class_name = _SPARSE_BLOCKS[model_type]
    return getattr(importlib.import_module(module_name), class_name)


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) if config is not None else None
    for candidate in (config, text_config):
        model_type = getattr(candidate, "model_type", None)
        if model_type in _SPARSE_BLOCKS:
            return model_type
    return getattr(config, "model_type", None)


def _check_experts(name: str, experts: nn.Module) -> None:
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        raise _unsupported(f"experts module {name!r} is transposed or has biases")
    if not getattr(experts, "has_gate", True):
        raise _unsupported(f"experts module {name!r} has no gate projection")
    gate_up, down = (getattr(experts, p, None) for p in EXPERT_PROJECTIONS)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        raise _unsupported(
            f"experts module {name!r} does not hold `gate_up_proj`/`down_proj` as parameters "
            "(already paged, or wrapped by an adapter)"
        )
    num_experts, two_inter, hidden = gate_up.shape
    if down.shape != (num_experts, hidden, two_inter // 2):
        raise _unsupported(
            f"experts module {name!r} has gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)}, not [E, 2I, H] and [E, H, I]"
        )


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Return the sparse MoE blocks of a supported model, in module order.

    Args:
        model: A ``transformers`` causal LM (or any module containing one, e.g. a PEFT wrapper).

    Returns:
        One :class:`MoELayer` per sparse MoE block (dense layers, e.g. Qwen2-MoE's
        ``mlp_only_layers``, are skipped).

    Raises:
        UnsupportedMoEModelError: If the model is of another family or its experts are laid out
            differently.
    """
    model_type = _model_type(model)
    if model_type not in _SPARSE_BLOCKS:
        raise _unsupported(f"model of type {model_type!r} ({type(model).__name__}) is not supported")
    block_class = _block_class(model_type)
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, block_class):
            experts_name = f"{name}.experts"
            _check_experts(experts_name, module.experts)
            layers.append(
                MoELayer(index=len(layers), name=name, block=module, router=module.gate, experts=module.experts)
            )
    if not layers:
        raise _unsupported(f"model of type {model_type!r} has no {block_class.__name__} modules")
    return layers
