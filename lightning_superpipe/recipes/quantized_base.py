"""QLoRA's base model: a causal LM whose linear layers hold their weights in 4 bits (bitsandbytes), built by
``transformers``' own loader (``BitsAndBytesConfig``) from a saved folder, or from a model made here with random
weights (saved to a temporary folder first, so that both paths quantize the same way)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_superpipe.recipes.errors import RecipeError, first_line
from lightning_superpipe.recipes.settings import QuantizationSettings

#: The dtypes ``compute_dtype`` names.
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_bitsandbytes() -> None:
    """Raises:
    RecipeError: bitsandbytes is not installed (with the command that installs it)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise RecipeError(
            "model.quantization needs bitsandbytes: pip install 'lightning-superpipe[qlora]' (or bitsandbytes)"
        ) from error


def quantization_config(settings: QuantizationSettings, model_dtype: torch.dtype) -> Any:
    """``transformers``' ``BitsAndBytesConfig`` for ``settings``; the layers compute in ``model_dtype`` unless
    ``compute_dtype`` says otherwise."""
    from transformers import BitsAndBytesConfig

    compute = model_dtype if settings.compute_dtype == "auto" else COMPUTE_DTYPES[settings.compute_dtype]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quant_type,
        bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=compute,
    )


def load_quantized(folder: Path, settings: QuantizationSettings, dtype: torch.dtype | str) -> nn.Module:
    """The causal LM saved in ``folder``, its linear layers (but the output layer) quantized to 4 bits as they load,
    in host memory, in training mode.

    Raises:
        RecipeError: The folder holds no model bitsandbytes can load.
    """
    from transformers import AutoModelForCausalLM

    require_bitsandbytes()
    model_dtype = torch.float32 if dtype == "auto" else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=dtype,
            quantization_config=quantization_config(settings, model_dtype),  # type: ignore[arg-type]
            device_map="cpu",  # quantized on the host: the strategy streams the 4-bit blocks from there
        )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise RecipeError(f"cannot load a 4-bit causal LM from '{folder}': {first_line(error)}") from error
    model.train()
    return model


def quantized(model: nn.Module, settings: QuantizationSettings) -> nn.Module:
    """``model`` (random weights, built here) with its linear layers in 4 bits: saved to a temporary folder and
    loaded back through :func:`load_quantized`, as a pretrained model is."""
    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="superpipe-qlora-") as folder:
        model.save_pretrained(folder)
        return load_quantized(Path(folder), settings, dtype)


def prepare_for_training(model: nn.Module, settings: QuantizationSettings) -> nn.Module:
    """``peft``'s ``prepare_model_for_kbit_training`` where ``settings.prepare`` (layer norms in float32, input
    gradients on); its gradient checkpointing is left off: the superpipe strategy recomputes each block itself."""
    if not settings.prepare:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
