"""Lightning callback: evaluate, test or predict with the experts paged under a device budget."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import move_data_to_device
from torch import nn

from lightning_superpipe.moe.api import PagedExperts, expert_parameters, full_expert_bytes, page_experts
from lightning_superpipe.moe.layouts import UnsupportedMoEModelError, is_fused_experts
from lightning_superpipe.moe.metrics import IGNORE_INDEX, QualityMeter
from lightning_superpipe.moe.options import PagingOptions, resolve_expert_budget
from lightning_superpipe.planning.budget import MemoryBudget, parse_budget

__all__ = ["PagedMoECallback"]

_MODEL_INPUTS = ("input_ids", "attention_mask")
_STAGES = ("validate", "test", "predict")


def default_batch_to_inputs(batch: Any) -> dict[str, torch.Tensor]:
    """Model inputs of a batch: the ``input_ids``/``attention_mask`` of a dict, a tensor as
    ``input_ids``, or the first element of a tuple or list."""
    if isinstance(batch, Mapping):
        return {key: batch[key] for key in _MODEL_INPUTS if key in batch}
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, (tuple, list)) and batch:
        return default_batch_to_inputs(batch[0])
    raise TypeError(f"cannot find model inputs in a batch of type {type(batch).__name__}; pass batch_to_inputs")


class PagedMoECallback(Callback):
    """Page a MoE model's experts for validation, test and predict; restore them afterwards.

    On ``on_{validation,test,predict}_start`` the model is paged with :func:`page_experts`,
    calibrating on the first batches of that stage's dataloader; on the matching ``*_end`` (or an
    exception) the original parameters are restored bit for bit, so the same ``Trainer`` can go on
    fine-tuning. Per run it logs, under ``paged_moe/<stage>/``: expert bytes on the device (at the
    end and the most seen) and at 16 bits, their ratio, pages per level, promotions and demotions,
    tokens/s of the paged forwards and, with ``measure_quality``, perplexity with paged and full
    precision experts, its relative change and the KL divergence from full precision.

    Under ``strategy="superpipe"`` the pages live on the strategy's compute device while the model's home stays in
    host memory, and the paged experts' weights stop streaming with their blocks for the stage (the blocks' device
    buffers shrink to the rest); they stream again once restored.

    The calibration shows its progress as Lightning shows a stage's (on rank 0, unless the trainer's progress bar is
    off): a bar on a terminal, INFO lines of the ``lightning_superpipe.moe.progress`` logger elsewhere
    (:meth:`PagedExperts.calibrate`).

    Args:
        expert_budget: Device bytes for the experts only, not the device's whole budget (``memory_budget``):
            bytes (``6_000_000_000``, ``"6GiB"``) or a percentage of the experts' 16-bit size (``"30%"``);
            ``None``: unlimited.
        expert_and_kv_budget: Pressure mode: device bytes for experts plus KV cache (see ``page_experts``).
        calibration_batches: Batches of the stage's first dataloader used for calibration.
        measure_quality: Also run each forward with full-precision experts (streamed from host
            memory) and compare; doubles the evaluation time. Forwards that are given a KV cache
            (generation) are not measured.
        stages: Stages to page, among ``"validate"``, ``"test"`` and ``"predict"``.
        page_sanity_check: Also page during Lightning's sanity-check validation.
        model_getter: Returns the ``transformers`` model from the LightningModule (default: the
            outermost ``transformers`` model holding fused experts).
        batch_to_inputs: Maps a batch to model keyword arguments (default: see
            :func:`default_batch_to_inputs`).
        shared_experts: Also page the blocks' dense shared experts (see :func:`page_experts`).
        options: Codes, pages and planner (:class:`~lightning_superpipe.moe.PagingOptions`).
    """

    def __init__(
        self,
        expert_budget: MemoryBudget | None = None,
        *,
        expert_and_kv_budget: MemoryBudget | None = None,
        calibration_batches: int = 4,
        measure_quality: bool = False,
        stages: Iterable[str] = _STAGES,
        page_sanity_check: bool = False,
        model_getter: Callable[[LightningModule], nn.Module] | None = None,
        batch_to_inputs: Callable[[Any], Mapping[str, Any]] = default_batch_to_inputs,
        shared_experts: bool = True,
        options: PagingOptions | None = None,
    ) -> None:
        # Read now, so that a budget that means nothing fails at construction rather than at the stage's start.
        if expert_budget is not None:
            parse_budget(expert_budget, f"PagedMoECallback(expert_budget={expert_budget!r})", allow_auto=False)
        call = f"PagedMoECallback(expert_and_kv_budget={expert_and_kv_budget!r})"
        resolve_expert_budget(expert_and_kv_budget, None, call)
        self.stages = tuple(stages)
        unknown = set(self.stages) - set(_STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; choose among {_STAGES}")
        self.expert_budget = expert_budget
        self.expert_and_kv_budget = expert_and_kv_budget
        self.calibration_batches = calibration_batches
        self.measure_quality = measure_quality
        self.page_sanity_check = page_sanity_check
        self.model_getter = model_getter
        self.batch_to_inputs = batch_to_inputs
        self.shared_experts = shared_experts
        self.options = options
        self.handle: PagedExperts | None = None
        self.reports: dict[str, dict[str, float]] = {}
        self._streaming: Any = None  # the SuperpipeStrategy's engine while it withholds the experts
        self._stage: str | None = None
        self._reset_run()

    # ------------------------------------------------------------------ Lightning hooks
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module, "validate")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module, "test")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module, "predict")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._teardown()

    # ------------------------------------------------------------------ run
    def _reset_run(self) -> None:
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._tokens = 0
        self._seconds = 0.0
        self._started_at = 0.0
        self._max_device_bytes = 0
        self._moves_at_start = (0, 0)
        self._in_reference = False
        self._quality = QualityMeter()

    def _start(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage not in self.stages or (trainer.sanity_checking and not self.page_sanity_check):
            return
        self._teardown()  # a previous run that did not end cleanly
        model = self.model_getter(pl_module) if self.model_getter else _find_moe_model(pl_module)
        call = f"PagedMoECallback(expert_budget={self.expert_budget!r})"
        # Bytes here, the experts' 16-bit size measured before paging (the model's own dtype may differ).
        full = full_expert_bytes(model, shared_experts=self.shared_experts)
        budget = resolve_expert_budget(self.expert_budget, full, call)
        device = pl_module.device
        calibration = [
            move_data_to_device(dict(self.batch_to_inputs(batch)), device)
            for batch in islice(_first_dataloader(trainer, stage), self.calibration_batches)
        ]
        pages_device = None
        engine = _streaming_engine(trainer)
        if engine is not None:
            # The model's home is the host: the pages go to the compute device, and the experts' weights stop
            # streaming (calibration below already computes without them).
            pages_device = trainer.strategy.root_device
            engine.withhold(expert_parameters(model, shared_experts=self.shared_experts))
            self._streaming = engine
        try:
            self.handle = page_experts(
                model,
                expert_budget=budget,
                calibration=calibration or None,
                device=pages_device,
                expert_and_kv_budget=self.expert_and_kv_budget,
                shared_experts=self.shared_experts,
                options=self.options,
                # As Lightning's own bars: on rank 0, unless the trainer's progress bar is off.
                progress=trainer.is_global_zero and trainer.progress_bar_callback is not None,
            )
        except BaseException:
            self._teardown()
            raise
        self._stage = stage
        self._reset_run()
        self._quality.to(device)
        self._moves_at_start = (self.handle.moves.promotions, self.handle.moves.demotions)
        self._max_device_bytes = self.handle.device_bytes()
        self._hooks = [
            # Before the handle's own hook, so that planner work counts in tokens/s.
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._in_reference:
            return
        _synchronize(self.handle.store.device)
        self._started_at = time.perf_counter()

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._in_reference:
            return
        handle = self.handle
        _synchronize(handle.store.device)
        self._seconds += time.perf_counter() - self._started_at
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            mask = kwargs.get("attention_mask")
            self._tokens += int(mask.sum()) if mask is not None else input_ids.numel()
        self._max_device_bytes = max(self._max_device_bytes, handle.device_bytes())
        # A forward that continues a KV cache (generation) is not measured: the reference forward
        # would append to the same cache.
        continues_cache = kwargs.get("cache", kwargs.get("past_key_values")) is not None
        if (
            self.measure_quality
            and not continues_cache
            and input_ids is not None
            and getattr(output, "logits", None) is not None
        ):
            self._in_reference = True
            try:
                with handle.reference():
                    reference = module(*args, **kwargs)
            finally:
                self._in_reference = False
            self._update_quality(output.logits, reference.logits, input_ids, kwargs)

    def _update_quality(
        self, logits: torch.Tensor, reference: torch.Tensor, input_ids: torch.Tensor, kwargs: dict
    ) -> None:
        labels = kwargs.get("labels")
        if labels is None:
            mask = kwargs.get("attention_mask")
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
        self._quality.update(logits, reference, labels)

    def _end(self, trainer: Trainer) -> None:
        if self.handle is None:
            return
        handle = self.handle
        promotions, demotions = self._moves_at_start
        metrics: dict[str, float] = {
            "expert_bytes_device": float(handle.device_bytes()),
            "expert_bytes_device_max": float(self._max_device_bytes),
            "expert_bytes_16bit": float(handle.full_bytes()),
            "expert_bytes_fraction": handle.device_bytes() / handle.full_bytes(),
            "promotions": float(handle.moves.promotions - promotions),
            "demotions": float(handle.moves.demotions - demotions),
            "tokens_per_s": self._tokens / self._seconds if self._seconds > 0 else 0.0,
        }
        for level, count in handle.level_counts().items():
            metrics[f"pages_{level}bit"] = float(count)
        if self.measure_quality and self._quality.tokens:
            metrics.update(self._quality.compute())
        stage = self._stage
        self.reports[stage] = metrics
        self._teardown()
        prefixed = {f"paged_moe/{stage}/{name}": value for name, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(prefixed, step=trainer.global_step)

    def _teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.handle is not None:
            self.handle.restore()
            self.handle = None
        if self._streaming is not None:  # after the restore: the experts are parameters of their blocks again
            self._streaming.release_withheld()
            self._streaming = None


def _find_moe_model(pl_module: LightningModule) -> nn.Module:
    for module in pl_module.modules():
        if hasattr(module, "set_experts_implementation") and any(is_fused_experts(m) for m in module.modules()):
            return module
    raise UnsupportedMoEModelError(
        f"{type(pl_module).__name__} contains no transformers model whose experts go through the experts "
        "interface (fused `@use_experts_implementation` experts); pass model_getter= to point at the model."
    )


def _streaming_engine(trainer: Trainer) -> Any:
    """The streaming engine of a ``SuperpipeStrategy`` trainer, else ``None``."""
    from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

    return trainer.strategy.engine if isinstance(trainer.strategy, SuperpipeStrategy) else None


def _first_dataloader(trainer: Trainer, stage: str) -> Iterable[Any]:
    loaders = {
        "validate": trainer.val_dataloaders,
        "test": trainer.test_dataloaders,
        "predict": trainer.predict_dataloaders,
    }[stage]
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else []
    return loaders if loaders is not None else []


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
