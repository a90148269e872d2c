"""A LightningModule that fine-tunes, evaluates and samples any ``transformers`` causal language model.

The model is built in ``__init__``, on the host: from a local folder (``from_pretrained``, offline) or from a
``model_type`` and a few sizes (random initialisation). Building it here rather than in ``configure_model`` keeps the
weights out of the accelerator, which the superpipe strategy streams block by block, and reports a bad model path or
LoRA target before any data is read. ``build_in_configure_model`` builds it in ``configure_model`` instead, where the
strategy's disk tier takes it block by block, for a model that does not fit in host memory.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, is_dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchmetrics.aggregation import MeanMetric

from lightning_superpipe.recipes.errors import RecipeError
from lightning_superpipe.recipes.instruction_data import IGNORE_INDEX
from lightning_superpipe.recipes.model_building import (
    add_lora,
    build_from_config,
    check_folder,
    check_vocabulary,
    embedding_rows_in_config,
    load_pretrained,
)
from lightning_superpipe.recipes.quantized_base import prepare_for_training, quantized, require_bitsandbytes
from lightning_superpipe.recipes.settings import (
    GenerationSettings,
    LoRASettings,
    OptimizerSettings,
    QuantizationSettings,
    WarmupCosine,
    settings_from,
)
from lightning_superpipe.recipes.tokenization import TextTokenizer
from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.sequence import chunk_causal_lm_loss, tile_position_wise
from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

# The settings (and their schedule) live in ``settings`` now; ``lightning_superpipe.recipes.causal_lm.LoRASettings`` and
# the others keep working for code that imported them from here.
__all__ = ["CausalLMModule", "GenerationSettings", "LoRASettings", "OptimizerSettings", "WarmupCosine"]

log = logging.getLogger(__name__)

#: Checkpoint key of the random-number state at the time of saving.
RNG_STATE_KEY = "causal_lm_rng_states"



class CausalLMModule(LightningModule):
    """Causal-LM fine-tuning (full or LoRA), evaluation with loss and perplexity, and text generation.

    Logs ``train/loss`` (on the progress bar) and ``train/lr`` every training step, and ``val/loss`` and ``val/ppl``
    (``test/...`` for ``test``) once per evaluation.

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
        quantization: QLoRA: the base model's linear layers in 4 bits (bitsandbytes), frozen under the adapters
            (needs ``lora``); ``None`` keeps the base in ``dtype``.
        optimizer: Optimizer and learning-rate schedule.
        generation: How ``predict`` continues prompts.
        vocab_size: Token ids the tokenizer produces; the ``superpipe`` command sets it from the data module. A
            random model gets exactly this many embedding rows; more than a pretrained one embeds is an error
            (:class:`~lightning_superpipe.recipes.errors.TokenizerError`) unless ``resize_token_embeddings``.
        resize_token_embeddings: Add embedding rows, randomly initialised, when the tokenizer has more token ids
            than the pretrained model embeds (a tokenizer given tokens of its own); off, that is an error.
        loss_chunk_tokens: Compute the head and the loss over chunks of this many tokens, each chunk's logits
            recomputed in backward (:func:`~lightning_superpipe.sequence.chunk_causal_lm_loss`), so that the
            whole sequence's logits never exist; ``None`` computes them whole. For long sequences and large
            vocabularies; losses equal the whole computation's to fp32 rounding.
        mlp_tile_tokens: Run each layer's MLP over tiles of this many positions, recomputed in backward
            (:func:`~lightning_superpipe.sequence.tile_position_wise`); ``None`` runs it whole.
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
        quantization: QuantizationSettings | None = None,
        optimizer: OptimizerSettings = OptimizerSettings(),
        generation: GenerationSettings = GenerationSettings(),
        vocab_size: int | None = None,
        build_in_configure_model: bool = False,
        resize_token_embeddings: bool = False,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("loss_chunk_tokens", loss_chunk_tokens), ("mlp_tile_tokens", mlp_tile_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RecipeError(f"model.{name}={value!r} must be a whole number of tokens, 1 or more (or null)")
        self.save_hyperparameters()
        # Checkpoints keep the settings as plain dicts, which ``torch.load(weights_only=True)`` accepts and
        # ``load_from_checkpoint`` passes back to this constructor.
        for name, value in self.hparams.items():
            if is_dataclass(value) and not isinstance(value, type):
                self.hparams[name] = asdict(value)
        lora = settings_from(lora, LoRASettings)
        quantization = settings_from(quantization, QuantizationSettings)
        if quantization is not None:
            if lora is None:
                raise RecipeError("model.quantization freezes the base model in 4 bits: set model.lora to train"
                                  " adapters on it")
            if build_in_configure_model:
                raise RecipeError("model.quantization with model.build_in_configure_model is not supported yet")
            require_bitsandbytes()
        self.quantization = quantization
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
                folder = check_folder(pretrained_path, safetensors_only=True)
                check_vocabulary(pretrained_path, vocab_size, embedding_rows_in_config(folder), resize_token_embeddings)
            else:
                with torch.device("meta"):  # the settings' errors now, without the memory
                    build_from_config(model_type, config or {}, dtype, vocab_size)
        else:
            self.configure_model()
        # A LoRA fine-tune of a pretrained model needs only the adapters in its checkpoints: the base weights are
        # reloaded from ``pretrained_path`` (or, for a 4-bit base of random weights, rebuilt under the run's seed).
        # Loading must then accept a state dict without them.
        self.saves_trainable_only = lora is not None and (pretrained_path is not None or quantization is not None)
        self.strict_loading = not self.saves_trainable_only
        self.val_nll = MeanMetric()
        self.test_nll = MeanMetric()

    def configure_model(self) -> None:
        """Builds the model (in ``__init__``, or here with ``build_in_configure_model``) and adds the adapters."""
        if self.model is not None:
            return
        settings = self.hparams
        if settings["pretrained_path"] is not None:
            model = load_pretrained(settings["pretrained_path"], settings["dtype"], settings["vocab_size"],
                                    tensor_by_tensor=settings["build_in_configure_model"],
                                    quantization=self.quantization,
                                    resize_token_embeddings=settings.get("resize_token_embeddings", False))
        else:
            model = build_from_config(settings["model_type"], settings["config"] or {}, settings["dtype"],
                                      settings["vocab_size"])
            if self.quantization is not None:
                model = quantized(model, self.quantization)
        if self.quantization is not None:
            model = prepare_for_training(model, self.quantization)
        model = add_lora(model, self.lora) if self.lora is not None else model
        if settings.get("loss_chunk_tokens") is not None:
            chunk_causal_lm_loss(model, settings["loss_chunk_tokens"])
        if settings.get("mlp_tile_tokens") is not None:
            tile_position_wise(model, settings["mlp_tile_tokens"])
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits of shape ``(batch, sequence, vocabulary)``.

        ``position_ids`` that restart within a row, without an ``attention_mask``, mark packed examples: each attends
        only to itself (``transformers``' convention for packed sequences).
        """
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Mean next-token cross-entropy of the batch and the number of tokens it averages over.

        A batch of plain text (``input_ids`` alone) is trained on every token. Instruction data brings ``labels``
        (``-100`` where no loss is taken) and either ``position_ids`` of packed examples or an ``attention_mask`` of
        padded ones; the mean is then over the labelled tokens.
        """
        input_ids = batch["input_ids"]
        # ``transformers`` shifts the labels itself: position t predicts token t + 1.
        labels = batch.get("labels")
        inputs = {name: batch[name] for name in ("attention_mask", "position_ids") if name in batch}
        loss = self.model(
            input_ids=input_ids, labels=input_ids if labels is None else labels, use_cache=False, **inputs
        ).loss
        if labels is None:
            return loss, input_ids.shape[0] * (input_ids.shape[1] - 1)
        return loss, (labels[:, 1:] != IGNORE_INDEX).sum()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        # The schedule's rate for this step, logged here rather than by Lightning's LearningRateMonitor, which refuses
        # to run without a logger (`--trainer.logger false`).
        schedules = self.trainer.lr_scheduler_configs
        if schedules:
            self.log("train/lr", float(schedules[0].scheduler.get_last_lr()[0]), batch_size=batch_size)
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
