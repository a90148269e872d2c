"""The settings of :class:`~lightning_superpipe.recipes.CausalLMModule` (the ``model.lora``, ``model.quantization``,
``model.optimizer`` and ``model.generation`` sections of a recipe) and the learning-rate schedule they describe."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar


@dataclass(frozen=True)
class LoRASettings:
    """Low-rank adapters (``peft`` LoRA) instead of training all weights.

    Args:
        rank: Rank of each adapter's update matrices.
        alpha: Scale of the update; the effective scale is ``alpha / rank``.
        dropout: Dropout on the adapter's input.
        target_modules: Names of the modules to adapt, matched against the end of each module's dotted name
            (e.g. ``[q_proj, v_proj]``); a single string is a regular expression over full names, ``all-linear``
            adapts every linear layer but the output layer, and ``None`` uses ``peft``'s default for the model type.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str | None = None


@dataclass(frozen=True)
class QuantizationSettings:
    """QLoRA: the frozen base model in 4 bits (bitsandbytes), the LoRA adapters in full precision on top.

    Args:
        quant_type: ``nf4`` (4-bit NormalFloat, QLoRA's) or ``fp4``.
        double_quant: Quantize the per-block scales too (about 0.4 bits less per weight).
        compute_dtype: The dtype the 4-bit layers compute in (``auto``: the model's dtype).
        prepare: Run ``peft``'s ``prepare_model_for_kbit_training`` (layer norms in float32, input gradients on),
            as QLoRA scripts do.
    """

    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    prepare: bool = True


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW with linear warm-up and cosine decay, stepped every optimizer step.

    Args:
        lr: Peak learning rate, reached after ``warmup_steps``.
        weight_decay: Decoupled weight decay of matrices; biases and norm weights are never decayed.
        betas: AdamW's moment decay rates.
        eps: AdamW's denominator epsilon.
        warmup_steps: Steps of linear warm-up from ``lr / (warmup_steps + 1)``.
        min_lr_ratio: The cosine ends at ``lr * min_lr_ratio`` on the last step (1.0 keeps the rate constant).
        implementation: ``fused`` (one kernel for all parameters; fastest, ~9x ``foreach`` on CPU), ``for-loop``
            (a Python loop over parameters; ~3x ``foreach`` on CPU), ``foreach`` (PyTorch's multi-tensor default) or
            ``auto``: ``fused`` unless gradients are clipped under mixed precision, which Lightning cannot do with an
            optimizer that unscales gradients itself (the superpipe strategy can, under ``bf16-mixed``), in which case
            ``for-loop``.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"


@dataclass(frozen=True)
class GenerationSettings:
    """How ``predict`` continues prompts.

    Args:
        max_new_tokens: Tokens generated after each prompt at most.
        do_sample: Sample from the model's distribution instead of taking the most likely token.
        temperature: Sampling temperature (only with ``do_sample``).
        top_p: Nucleus-sampling probability mass (only with ``do_sample``).
        schedule: ``model``: ``model.generate`` per batch; ``flexgen``: :func:`lightning_superpipe.generate`, each
            block on the device once per token for the whole batch split into micro-batches, the KV cache in host
            memory (under ``SuperpipeStrategy`` the strategy streams the weights, this the cache).
        micro_batch_size: Prompts per micro-batch with ``flexgen`` (``None``: the policy's or the whole batch).
        memory_budget: Device bytes for ``flexgen``'s cost model (``2GiB``, ``90%`` of free device memory, ``auto``;
            :class:`~lightning_superpipe.GenerationPolicy`); ``None``: no cost model.
        compress_kv: ``flexgen``: the KV cache in FlexGen's 4-bit form in host memory and over the link.
        compress_weights: ``flexgen`` without ``SuperpipeStrategy``: block weights in FlexGen's 4-bit form.
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    schedule: Literal["model", "flexgen"] = "model"
    micro_batch_size: int | None = None
    memory_budget: int | str | None = None
    compress_kv: bool = False
    compress_weights: bool = False


@dataclass(frozen=True)
class WarmupCosine:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_lr_ratio``.

    Args:
        warmup_steps: Steps of linear warm-up.
        total_steps: Optimizer steps of the whole run; ``None`` (unknown length) keeps the rate flat after warm-up.
        min_lr_ratio: Multiplier reached on the last step.
    """

    warmup_steps: int
    total_steps: int | None
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        """The multiplier of the learning rate at optimizer step ``step`` (from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


SettingsT = TypeVar("SettingsT")


def settings_from(value: SettingsT | Mapping[str, Any], settings_type: type[SettingsT]) -> SettingsT:
    """``value`` itself, or the settings dataclass built from it when it is a dict (as stored in checkpoints)."""
    return settings_type(**value) if isinstance(value, Mapping) else value
