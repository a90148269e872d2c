"""How :class:`~lightning_superpipe.recipes.CausalLMModule` gets its model: loaded from a ``save_pretrained`` folder,
built from a ``model_type`` and a few sizes, and given LoRA adapters, each refusing bad settings with a
:class:`~lightning_superpipe.recipes.RecipeError` that names the recipe key to fix."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_superpipe.recipes.errors import RecipeError, TokenizerError, did_you_mean, first_line
from lightning_superpipe.recipes.quantized_base import load_quantized
from lightning_superpipe.recipes.settings import LoRASettings, QuantizationSettings

log = logging.getLogger(__name__)

#: Weight files of a folder saved with ``save_pretrained``.
WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
#: Checkpoint key of the random-number state at the time of saving.
RNG_STATE_KEY = "causal_lm_rng_states"
#: ``dtype`` names accepted in recipes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lora_adaptable_types() -> tuple[type[nn.Module], ...]:
    """Module types that ``peft`` LoRA can wrap."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)


def check_lora_targets(model: nn.Module, target_modules: list[str] | str | None) -> None:
    """Fail with a clear message if a LoRA target names no module of ``model`` that LoRA can adapt.

    ``peft`` would raise a long error, or for a regular expression silently adapt nothing; quoting the names that do
    exist lets the user fix the recipe in one go.

    Args:
        model: The model that will receive the adapters.
        target_modules: As in :class:`LoRASettings`.

    Raises:
        RecipeError: If a name matches no module, or only modules LoRA cannot adapt.
    """
    if target_modules is None or target_modules == "all-linear":
        return
    adaptable = lora_adaptable_types()
    modules = dict(model.named_modules())
    adaptable_names = sorted(
        {name.rsplit(".", 1)[-1] for name, module in modules.items() if isinstance(module, adaptable)}
    )
    hint = f"modules LoRA can adapt in this model: {', '.join(adaptable_names)}"
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as error:
            raise RecipeError(
                f"LoRA target_modules '{target_modules}' is not a valid regular expression: {error}"
            ) from error
        if not any(pattern.fullmatch(name) and isinstance(module, adaptable) for name, module in modules.items()):
            raise RecipeError(f"LoRA target_modules '{target_modules}' matches no module name in the model; {hint}")
        return
    if not target_modules:
        raise RecipeError(f"LoRA target_modules is an empty list; {hint}")
    for target in target_modules:
        matches = [module for name, module in modules.items() if name == target or name.endswith(f".{target}")]
        if not matches:
            raise RecipeError(f"LoRA target module '{target}' is not in the model; {hint}")
        if not any(isinstance(module, adaptable) for module in matches):
            kind = type(matches[0]).__name__
            raise RecipeError(f"LoRA target module '{target}' is a {kind}, which LoRA cannot adapt; {hint}")


def find_weight_files(folder: Path) -> list[Path]:
    """Weight files of a ``save_pretrained`` folder."""
    return sorted({path for pattern in WEIGHT_FILE_PATTERNS for path in folder.glob(pattern)})


def blame_config_keys(overrides: dict[str, Any], build: Callable[[dict[str, Any]], object]) -> list[str]:
    """The keys of ``overrides`` that a failed ``build(overrides)`` is down to.

    Those without which it succeeds; failing that, those that fail on their own (over the type's defaults); none
    if the build succeeds after all (a failure that is not about the values, such as running out of memory).
    """

    def builds(settings: dict[str, Any]) -> bool:
        try:
            build(settings)
        except Exception:  # noqa: BLE001 - any failure counts: it is the one being explained
            return False
        return True

    if builds(overrides):
        return []
    if len(overrides) == 1:
        return list(overrides)
    culprits = [key for key in overrides if builds({k: v for k, v in overrides.items() if k != key})]
    return culprits or [key for key, value in overrides.items() if not builds({key: value})]


def describe_config_error(
    model_type: str,
    what: str,
    overrides: dict[str, Any],
    error: BaseException,
    build: Callable[[dict[str, Any]], object],
) -> str:
    """One line for an error that transformers raised while building a configuration or a model from ``overrides``.

    Args:
        model_type: The ``transformers`` model type.
        what: ``"configuration"`` or ``"model"``: what was being built.
        overrides: The values under ``model.config``.
        error: What transformers raised.
        build: Builds the same thing from other values, to tell which keys the failure is down to.

    Returns:
        For example ``"model.config.hidden_size: The hidden size (250) is not a multiple of the number of attention
        heads (4)."`` or ``"model.config.num_attention_heads: transformers cannot build a 'llama' configuration
        with num_attention_heads=0 (ZeroDivisionError: integer division or modulo by zero)"``.
    """
    # ``huggingface_hub``'s strict dataclasses wrap the validator's own error, and name the field they checked.
    field = re.match(r"Validation error for field '(\w+)'", str(error))
    keys = [field.group(1)] if field and field.group(1) in overrides else blame_config_keys(overrides, build)
    cause = error.__cause__
    root = cause if cause is not None and type(error).__module__.startswith("huggingface_hub") else error
    message = first_line(root)
    if len(keys) == 1:
        message = re.sub(rf"^Field '{re.escape(keys[0])}' ", "", message)  # the key is named already
    where = " and ".join(f"model.config.{key}" for key in keys) or "model.config"
    if isinstance(root, (ValueError, TypeError)):
        # transformers' validators say what is wrong in words.
        return f"{where}: {message}"
    values = ", ".join(f"{key}={overrides[key]!r}" for key in keys)
    with_values = f" with {values}" if values else ""
    return f"{where}: transformers cannot build a '{model_type}' {what}{with_values} ({type(root).__name__}: {message})"


def check_numeric_values(default_config: Any, overrides: dict[str, Any]) -> None:
    """Refuse text where the configuration has a number, for configurations that do not check their types.

    Raises:
        RecipeError: Naming the first key whose value is not a number though its default is.
    """
    for key, value in overrides.items():
        default = getattr(default_config, key, None)
        numeric_default = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric_default and (isinstance(value, bool) or not isinstance(value, (int, float))):
            kind = "an integer" if isinstance(default, int) else "a number"
            raise RecipeError(f"model.config.{key}: expected {kind} (the default is {default!r}), got {value!r}")


def check_folder(pretrained_path: str, safetensors_only: bool = False) -> Path:
    """The folder of ``pretrained_path``, checked to hold a ``save_pretrained`` model.

    Args:
        pretrained_path: The recipe's ``model.pretrained_path``.
        safetensors_only: Also require ``*.safetensors`` files (read tensor by tensor).

    Raises:
        RecipeError: If the folder is missing, is a file, or lacks ``config.json`` or weights.
    """
    folder = Path(pretrained_path).expanduser()
    if not folder.exists():
        raise RecipeError(f"model path '{pretrained_path}' does not exist")
    if not folder.is_dir():
        raise RecipeError(f"model path '{pretrained_path}' is a file; expected a folder saved with save_pretrained")
    if not (folder / "config.json").is_file():
        raise RecipeError(f"model path '{pretrained_path}' holds no model: it has no config.json")
    if not find_weight_files(folder):
        raise RecipeError(
            f"model path '{pretrained_path}' holds no model weights: no *.safetensors or pytorch_model*.bin files"
        )
    if safetensors_only and not list(folder.glob("*.safetensors")):
        raise RecipeError(
            f"model path '{pretrained_path}' has no *.safetensors files, which model.build_in_configure_model"
            " reads tensor by tensor; save the model with safe_serialization, or leave the option off"
        )
    return folder


def embedding_rows_in_config(folder: Path) -> int | None:
    """The vocabulary size ``config.json`` in ``folder`` declares (its text model's, for a multimodal one); ``None``
    if the configuration cannot be read, which loading the model then reports."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text_config, "vocab_size", None)
    return rows if isinstance(rows, int) else None


def check_vocabulary(pretrained_path: str, vocab_size: int | None, embedding_rows: int | None, resize: bool) -> None:
    """Refuse a tokenizer with more token ids than the model embeds, unless the embeddings may grow.

    Ids past the embedding would index outside it (on a GPU, a device-side assertion deep in the first forward). A
    tokenizer with fewer ids than the model embeds is common (rows padded to a multiple of 64) and fine.

    Args:
        pretrained_path: The model's folder, for the message.
        vocab_size: Token ids the tokenizer produces (``len(tokenizer)``); ``None``: not known, nothing to check.
        embedding_rows: Rows of the model's input embeddings; ``None``: not known, nothing to check.
        resize: ``model.resize_token_embeddings``: the embeddings will grow to ``vocab_size`` instead.

    Raises:
        TokenizerError: If ``vocab_size`` exceeds ``embedding_rows`` and ``resize`` is off.
    """
    if vocab_size is None or embedding_rows is None or vocab_size <= embedding_rows or resize:
        return
    raise TokenizerError(
        f"the tokenizer has {vocab_size} token ids but the model in '{pretrained_path}' embeds {embedding_rows}: "
        "ids past its embeddings cannot be trained on; use the tokenizer saved with the model (data.tokenizer_path), "
        "or set model.resize_token_embeddings: true to add rows for the new ids (they start random)"
    )


def load_pretrained(
    pretrained_path: str, dtype: str, vocab_size: int | None, tensor_by_tensor: bool = False,
    quantization: QuantizationSettings | None = None, resize_token_embeddings: bool = False,
) -> nn.Module:
    """The causal LM saved in ``pretrained_path``, loaded offline, in training mode.

    Args:
        pretrained_path: A folder saved with ``save_pretrained``.
        dtype: A key of :data:`DTYPES`, or ``auto`` for the checkpoint's own dtype.
        vocab_size: Token ids the tokenizer produces; more than the model embeds is an error unless
            ``resize_token_embeddings``.
        tensor_by_tensor: Build the model from its ``config.json`` and read each weight from the safetensors files
            (:func:`~lightning_superpipe.load_safetensors`), for the disk tier's deferred blocks.
        quantization: Load the linear layers in 4 bits (QLoRA's base; :mod:`.quantized_base`).
        resize_token_embeddings: Add embedding rows (random) when the tokenizer has more ids than the model embeds.

    Raises:
        RecipeError: If the folder holds no loadable causal LM.
        TokenizerError: If the tokenizer has more ids than the model embeds (:func:`check_vocabulary`).
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_superpipe.construction.deferred_init import load_safetensors

    folder = check_folder(pretrained_path, safetensors_only=tensor_by_tensor)
    # From config.json first: a tokenizer the model cannot embed is refused before its weights are read.
    check_vocabulary(pretrained_path, vocab_size, embedding_rows_in_config(folder), resize_token_embeddings)
    try:
        if quantization is not None:
            model = load_quantized(folder, quantization, "auto" if dtype == "auto" else DTYPES[dtype])
        elif tensor_by_tensor:  # built from its config, each weight read when it is needed (the disk tier's blocks)
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            saved = getattr(config, "dtype", None) or torch.float32
            saved = getattr(torch, saved) if isinstance(saved, str) else saved
            model_dtype = saved if dtype == "auto" else DTYPES[dtype]
            model = AutoModelForCausalLM.from_config(config, dtype=model_dtype)
            load_safetensors(model, folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype="auto" if dtype == "auto" else DTYPES[dtype]
            )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        # Whatever fails while loading from a folder (an unknown architecture, a corrupt or truncated weight
        # file, shapes that do not match the config) is a problem with that folder, so it is reported as such.
        raise RecipeError(f"cannot load a causal LM from '{pretrained_path}': {first_line(error)}") from error
    # ``from_pretrained`` returns the model in eval mode; fine-tuning wants dropout as in pre-training, and
    # Lightning keeps whatever mode the module starts ``fit`` in.
    model.train()
    embedding_rows = model.get_input_embeddings().num_embeddings
    check_vocabulary(pretrained_path, vocab_size, embedding_rows, resize_token_embeddings)
    if vocab_size is not None and vocab_size > embedding_rows:
        log.info(
            "The tokenizer has %d ids and '%s' embeds %d: resizing the embeddings (the new rows start random).",
            vocab_size,
            pretrained_path,
            embedding_rows,
        )
        model.resize_token_embeddings(vocab_size)
    return model


def build_from_config(model_type: str, overrides: dict[str, Any], dtype: str, vocab_size: int | None) -> nn.Module:
    """A randomly initialised causal LM of ``model_type``, its configuration's defaults replaced by ``overrides``.

    Args:
        model_type: A ``transformers`` model type.
        overrides: The recipe's ``model.config``.
        dtype: A key of :data:`DTYPES` (float32 otherwise).
        vocab_size: The vocabulary size, whatever ``overrides`` say.

    Raises:
        RecipeError: Naming the ``model.config`` key that is unknown or that transformers cannot build with.
    """
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        suggestion = f"; did you mean {', '.join(repr(name) for name in close)}?" if close else ""
        raise RecipeError(f"model_type '{model_type}' is not a transformers model type{suggestion}")
    default_config = AutoConfig.for_model(model_type)
    # ``AutoConfig.for_model`` stores any keyword as an attribute, so a misspelt size would be silently ignored.
    # Some settings (``attn_implementation``) are stored under a private name.
    unknown = [key for key in overrides if not any(hasattr(default_config, name) for name in (key, f"_{key}"))]
    if unknown:
        details = ", ".join(f"'{key}'{did_you_mean(key, default_config.to_dict())}" for key in unknown)
        raise RecipeError(f"model.config has keys that the '{model_type}' configuration does not know: {details}")
    torch_dtype = DTYPES.get(dtype, torch.float32)

    def make_config(settings: dict[str, Any]) -> Any:
        config = AutoConfig.for_model(model_type, **settings)
        if vocab_size is not None:
            config.vocab_size = vocab_size
        return config

    def make_model_on_meta(settings: dict[str, Any]) -> Any:
        with torch.device("meta"):  # the layers' shapes without their memory, to tell which key is wrong
            return AutoModelForCausalLM.from_config(make_config(settings), dtype=torch_dtype)

    # Whatever goes wrong while transformers builds the configuration or the model from it (a failed
    # validator, a division by a zero head count, an unknown activation, a negative size) is down to the values
    # under model.config, so it is reported against them.
    try:
        config = make_config(overrides)
    except Exception as error:
        message = describe_config_error(model_type, "configuration", overrides, error, make_config)
        raise RecipeError(message) from error
    check_numeric_values(default_config, overrides)
    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except Exception as error:
        if isinstance(error, ValueError) and "Unrecognized configuration class" in str(error):
            raise RecipeError(f"model_type '{model_type}' has no causal-LM model in transformers") from error
        message = describe_config_error(model_type, "model", overrides, error, make_model_on_meta)
        raise RecipeError(message) from error


def add_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """``model`` wrapped by ``peft`` with the LoRA adapters of ``settings``.

    Raises:
        RecipeError: If a target names no module LoRA can adapt, or peft refuses the settings.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    check_lora_targets(model, settings.target_modules)
    target_modules = settings.target_modules
    # GPT-2 style ``Conv1D`` layers store the weight transposed; telling peft avoids a warning per layer.
    fan_in_fan_out = isinstance(target_modules, list) and any(
        isinstance(module, Conv1D) and name.rsplit(".", 1)[-1] in target_modules
        for name, module in model.named_modules()
    )
    lora_config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=target_modules,
        fan_in_fan_out=fan_in_fan_out,
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, lora_config)
    except ValueError as error:
        # Reached for ``target_modules: null`` on a model type peft has no default for.
        raise RecipeError(f"cannot add LoRA adapters: {first_line(error)}") from error
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("LoRA: training %d of %d parameters (%.2f%%).", trainable, total, 100.0 * trainable / total)
    return peft_model
