"""A LightningModule that fine-tunes, evaluates and samples any ``transformers`` causal language model.

The model is built in ``__init__``, on the host: from a local folder (``from_pretrained``, offline) or from a
``model_type`` and a few sizes (random initialisation). Building it here rather than in ``configure_model`` keeps the
weights out of the accelerator, which the superpipe strategy streams block by block, and reports a bad model path or
LoRA target before any data is read. ``build_in_configure_model`` builds it in ``configure_model`` instead, where the
strategy's disk tier takes it block by block, for a model that does not fit in host memory.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchmetrics.aggregation import MeanMetric

from lightning_superpipe.recipes.errors import RecipeError, did_you_mean, first_line
from lightning_superpipe.recipes.tokenization import TextTokenizer
from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

log = logging.getLogger(__name__)

#: Weight files of a folder saved with ``save_pretrained``.
WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
#: Checkpoint key of the random-number state at the time of saving.
RNG_STATE_KEY = "causal_lm_rng_states"
#: ``dtype`` names accepted in recipes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class CausalLMModule(LightningModule):
    """Causal-LM fine-tuning (full or LoRA), evaluation with loss and perplexity, and text generation.

    Args:
        pretrained_path: Local folder saved with ``save_pretrained`` (``config.json`` and weights, optionally the
            tokenizer); loaded offline. ``None`` builds a randomly initialised model from ``model_type`` and
            ``config``, which are then ignored when a path is given.
        model_type: A ``transformers`` model type with a causal-LM class (``llama``, ``qwen2``, ``mixtral``, ``gpt2``
            ...), for random initialisation.
        config: Values that replace the defaults of ``model_type``'s configuration (``hidden_size``,
            ``num_hidden_layers`` ...), for random initialisation. The vocabulary size always follows the tokenizer.
        dtype: Weight dtype; ``auto`` keeps a checkpoint's own dtype and uses float32 for random initialisation.
        lora: LoRA settings; ``None`` trains all weights.
        optimizer: Optimizer and learning-rate schedule.
        generation: How ``predict`` continues prompts.
        vocab_size: Token ids the tokenizer produces; the ``superpipe`` command sets it from the data module. A
            random model gets exactly this many embedding rows; a pretrained one is resized only if it has fewer.
        build_in_configure_model: Build the model in ``configure_model`` rather than here. Under
            ``SuperpipeStrategy(offload_device="disk")`` its blocks are then initialized, or read from
            ``pretrained_path``'s safetensors files, one at a time into the tier's files, so that the model never
            sits whole in host memory (a pretrained model is built from its ``config.json`` and given its weights by
            :func:`~lightning_superpipe.load_safetensors`, which refuses layouts transformers converts as it loads:
            the fused experts of MoE models). The path and the settings are still checked here.
    """

    def __init__(
        self,
        pretrained_path: str | None = None,
        model_type: str = "llama",
        config: dict[str, Any] | None = None,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        lora: LoRASettings | None = None,
        optimizer: OptimizerSettings = OptimizerSettings(),
        generation: GenerationSettings = GenerationSettings(),
        vocab_size: int | None = None,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Checkpoints keep the settings as plain dicts, which ``torch.load(weights_only=True)`` accepts and
        # ``load_from_checkpoint`` passes back to this constructor.
        for name, value in self.hparams.items():
            if is_dataclass(value) and not isinstance(value, type):
                self.hparams[name] = asdict(value)
        lora = settings_from(lora, LoRASettings)
        optimizer = settings_from(optimizer, OptimizerSettings)
        generation = settings_from(generation, GenerationSettings)
        self.pretrained_path = pretrained_path
        self.lora = lora
        self.optimizer_settings = optimizer
        self.generation = generation
        if pretrained_path is not None and config:
            log.info("model.pretrained_path is set, so model.config (random-init sizes) is not used.")
        self.model: nn.Module | None = None
        if build_in_configure_model:
            if pretrained_path is not None:
                self._check_folder(pretrained_path, safetensors_only=True)
            else:
                with torch.device("meta"):  # the settings' errors now, without the memory
                    self._build_from_config(model_type, config or {}, dtype, vocab_size)
        else:
            self.configure_model()
        # A LoRA fine-tune of a pretrained model needs only the adapters in its checkpoints: the base weights are
        # reloaded from ``pretrained_path``. Loading must then accept a state dict without them.
        self.saves_trainable_only = lora is not None and pretrained_path is not None
        self.strict_loading = not self.saves_trainable_only
        self.val_nll = MeanMetric()
        self.test_nll = MeanMetric()

    def configure_model(self) -> None:
        """Builds the model (in ``__init__``, or here with ``build_in_configure_model``) and adds the adapters."""
        if self.model is not None:
            return
        settings = self.hparams
        if settings["pretrained_path"] is not None:
            model = self._load_pretrained(settings["pretrained_path"], settings["dtype"], settings["vocab_size"],
                                          tensor_by_tensor=settings["build_in_configure_model"])
        else:
            model = self._build_from_config(settings["model_type"], settings["config"] or {}, settings["dtype"],
                                            settings["vocab_size"])
        self.model = self._add_lora(model, self.lora) if self.lora is not None else model

    @staticmethod
    def _check_folder(pretrained_path: str, safetensors_only: bool = False) -> Path:
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

    @staticmethod
    def _load_pretrained(
        pretrained_path: str, dtype: str, vocab_size: int | None, tensor_by_tensor: bool = False
    ) -> nn.Module:
        from safetensors import SafetensorError
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_superpipe.streaming.deferred_init import load_safetensors

        folder = CausalLMModule._check_folder(pretrained_path, safetensors_only=tensor_by_tensor)
        try:
            if tensor_by_tensor:  # built from its config, each weight read when it is needed (the disk tier's blocks)
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
        if vocab_size is not None and vocab_size > embedding_rows:
            log.warning(
                "The tokenizer has %d ids but '%s' embeds %d; resizing the embeddings (new rows start random).",
                vocab_size,
                pretrained_path,
                embedding_rows,
            )
            model.resize_token_embeddings(vocab_size)
        return model

    @staticmethod
    def _build_from_config(model_type: str, overrides: dict[str, Any], dtype: str, vocab_size: int | None) -> nn.Module:
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

    @staticmethod
    def _add_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits of shape ``(batch, sequence, vocabulary)``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy of the batch and the number of tokens it averages over."""
        input_ids = batch["input_ids"]
        # ``transformers`` shifts the labels itself: position t predicts token t + 1.
        loss = self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        return loss, input_ids.shape[0] * (input_ids.shape[1] - 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch)
        self.val_nll.update(loss.detach(), weight=tokens)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch)
        self.test_nll.update(loss.detach(), weight=tokens)

    def on_validation_epoch_end(self) -> None:
        self._log_loss_and_perplexity("val", self.val_nll)

    def on_test_epoch_end(self) -> None:
        self._log_loss_and_perplexity("test", self.test_nll)

    def _log_loss_and_perplexity(self, prefix: str, nll: MeanMetric) -> None:
        # Perplexity is exp of the token-weighted mean loss. ``torchmetrics.text.Perplexity`` would give the same
        # number but needs the logits again, a second (batch x sequence x vocabulary) tensor, which is exactly the
        # memory this package exists to save.
        if nll.update_count == 0:
            return
        mean_nll = nll.compute()
        self.log(f"{prefix}/loss", mean_nll, prog_bar=True)
        self.log(f"{prefix}/ppl", torch.exp(mean_nll), prog_bar=True)
        nll.reset()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, str]]:
        """Continue each prompt of the batch.

        Returns:
            One ``{"prompt": ..., "completion": ...}`` per prompt.
        """
        tokenizer = self._tokenizer()
        settings = self.generation
        sampling = {"temperature": settings.temperature, "top_p": settings.top_p} if settings.do_sample else {}
        input_ids = batch["input_ids"]
        if settings.schedule == "flexgen":
            return self._predict_flexgen(batch, tokenizer, sampling)
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=batch["attention_mask"],
            max_new_tokens=settings.max_new_tokens,
            do_sample=settings.do_sample,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        completions = [tokenizer.decode(row.tolist()) for row in output[:, input_ids.shape[1] :]]
        return [{"prompt": prompt, "completion": text} for prompt, text in zip(batch["prompts"], completions)]

    def _predict_flexgen(
        self, batch: dict[str, Any], tokenizer: TextTokenizer, sampling: dict[str, float]
    ) -> list[dict[str, str]]:
        """``predict_step`` with FlexGen's schedule (:func:`lightning_superpipe.generate`), tokens/s on the bar."""
        from lightning_superpipe.generation import GenerationPolicy, generate

        settings = self.generation
        strategy = self.trainer.strategy
        # SuperpipeStrategy already streams every block once per forward and keeps its slot while the micro-batches
        # call it again, so it moves the weights and generate the KV cache; without it generate moves both.
        streamed = isinstance(strategy, SuperpipeStrategy)
        input_ids = batch["input_ids"]
        policy = GenerationPolicy(
            memory_budget=settings.memory_budget,
            micro_batch_size=settings.micro_batch_size,
            compress_weights=settings.compress_weights,
            compress_kv=settings.compress_kv,
            stream_weights=not streamed,
        )
        result = generate(
            self.model,
            input_ids.cpu(),
            policy,
            attention_mask=batch["attention_mask"].cpu(),
            max_new_tokens=settings.max_new_tokens,
            do_sample=settings.do_sample,
            device=strategy.root_device,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        self.last_generation_stats = result.stats
        _show_on_progress_bar(self.trainer, f"{result.stats['tokens_per_s']:.1f} tokens/s")
        output = result.sequences
        completions = [tokenizer.decode(row.tolist()) for row in output[:, input_ids.shape[1] :]]
        return [{"prompt": prompt, "completion": text} for prompt, text in zip(batch["prompts"], completions)]

    def _tokenizer(self) -> TextTokenizer:
        datamodule = getattr(self.trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is None:
            raise RuntimeError("predict needs a data module with a `tokenizer` attribute, such as TextDataModule")
        return tokenizer  # type: ignore[no-any-return]

    def configure_optimizers(self) -> dict[str, Any]:
        settings = self.optimizer_settings
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        # Decaying biases and norm gains only pulls them towards zero for no regularisation benefit.
        groups = [
            {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [group for group in groups if group["params"]],
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            **self._adamw_implementation(),
        )
        total_steps = self.trainer.estimated_stepping_batches
        schedule = WarmupCosine(
            warmup_steps=settings.warmup_steps,
            total_steps=int(total_steps) if math.isfinite(total_steps) else None,
            min_lr_ratio=settings.min_lr_ratio,
        )

        def multiplier(step: int) -> float:
            return schedule(step)

        # A plain function, not the schedule object: ``LambdaLR`` saves and restores the fields of callable objects,
        # so a run resumed with a larger ``max_steps`` would keep decaying over the old length.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _adamw_implementation(self) -> dict[str, bool]:
        """Keyword arguments that select AdamW's implementation.

        Raises:
            RecipeError: If ``fused`` is asked for together with gradient clipping under mixed precision.
        """
        implementation = self.optimizer_settings.implementation
        clip_value = self.trainer.gradient_clip_val
        # Lightning's mixed-precision plugin unscales gradients before clipping; a fused AdamW unscales inside its
        # step, so Lightning refuses to clip with it. The superpipe strategy lifts that where no scaler is in use
        # (bf16-mixed).
        plugin = self.trainer.precision_plugin
        lifted = isinstance(self.trainer.strategy, SuperpipeStrategy) and getattr(plugin, "scaler", None) is None
        clipping_unsupported = bool(clip_value) and isinstance(plugin, MixedPrecision) and not lifted
        if implementation == "auto":
            implementation = "for-loop" if clipping_unsupported else "fused"
        if implementation == "fused" and clipping_unsupported:
            raise RecipeError(
                "model.optimizer.implementation 'fused' cannot clip gradients "
                f"(trainer.gradient_clip_val={clip_value}) under trainer.precision '{self.trainer.precision}'; "
                "use 'auto' or 'for-loop'"
            )
        return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[implementation]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.saves_trainable_only:
            trainable = {name for name, parameter in self.named_parameters() if parameter.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        # Lightning does not save the random-number state, which dropout draws from: without it, a resumed run's
        # dropout masks (LoRA's, the model's) differ from an uninterrupted run's, whatever the strategy.
        checkpoint[RNG_STATE_KEY] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # ``strict_loading`` is off for adapter-only checkpoints, so check by hand that nothing would be dropped.
        unexpected = sorted(set(checkpoint.get("state_dict", {})) - set(self.state_dict()))
        if unexpected:
            raise RecipeError(
                f"the checkpoint has {len(unexpected)} weights this model lacks (first: '{unexpected[0]}'); "
                "was it trained with other model or lora settings?"
            )
        states = checkpoint.get(RNG_STATE_KEY)
        # Only to continue training: ``load_from_checkpoint`` or ``predict`` leave the generator as seeded.
        trainer = getattr(self, "_trainer", None)
        if states is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            set_rng_states(states)


def _show_on_progress_bar(trainer: Any, text: str) -> None:
    """Shows ``text`` beside the predict progress bar (Rich's description or tqdm's postfix), if there is one."""
    callback = getattr(trainer, "progress_bar_callback", None)
    if callback is None:
        return
    progress, task = getattr(callback, "progress", None), getattr(callback, "predict_progress_bar_id", None)
    if progress is not None and task is not None:  # RichProgressBar
        progress.update(task, description=f"Predicting ({text})")
        return
    try:
        bar = callback.predict_progress_bar  # TQDMProgressBar raises TypeError before the bar exists
    except (AttributeError, TypeError):
        return
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(text)
