"""Progress that a log file can hold, and the throughput figures users compare.

On a terminal, Lightning's progress bar redraws one line in place. Written to a file (under ``nohup``, SLURM or a CI
job) the same bar is carriage returns, or nothing at all until the run ends. :class:`LoggingProgressBar` takes its
place there: a plain line through :mod:`logging` after the first step, then every half minute or so, and when a
stage ends. :class:`ThroughputLogger` logs ``train/tokens_per_s`` and ``train/step_time_s`` for either bar and the
loggers. The ``superpipe`` command picks the bar by where standard error goes (:func:`is_terminal`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TextIO

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from typing_extensions import override

from lightning_superpipe.strategies.superpipe import SuperpipeStrategy
from lightning_superpipe.units import format_bytes

log = logging.getLogger(__name__)

#: Progress-bar items left out of the plain lines: the logger's version number says nothing about progress.
HIDDEN_ITEMS = ("v_num",)


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: standard error, where Lightning's bars draw) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a batch: the ones of its ``attention_mask``, else the elements of its ``input_ids`` (or of the
    batch itself, when it is one tensor); ``None`` when the batch holds neither."""
    if isinstance(batch, Mapping):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        return ids.numel() if isinstance(ids, torch.Tensor) else None
    return batch.numel() if isinstance(batch, torch.Tensor) else None


def batch_samples(batch: Any) -> int:
    """Sequences in a batch: the first dimension of its ``input_ids`` (or of the batch tensor); 1 otherwise."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.ndim > 0 else 1


def device_peak_bytes(trainer: Trainer) -> int | None:
    """The most the run has held on its device: the superpipe strategy's own count, or CUDA's allocator peak;
    ``None`` where neither is known (another strategy on the CPU)."""
    strategy = trainer.strategy
    if isinstance(strategy, SuperpipeStrategy):
        try:
            return int(strategy.engine.ledger.peak_bytes)
        except (RuntimeError, AttributeError):  # not set up: outside a run
            return None
    device = strategy.root_device
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def format_figure(value: Any) -> str:
    """A logged figure as a person reads it: ``3.412``, ``0.8123``, ``12,345``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and abs(value) >= 1000):
        return f"{value:,.0f}"
    return f"{value:.4g}"


def loader_batches(counts: list[int | float], dataloader_idx: int) -> float:
    """Batches of data loader ``dataloader_idx`` in a stage (``trainer.num_val_batches`` ...); ``inf`` if unknown."""
    return counts[dataloader_idx] if 0 <= dataloader_idx < len(counts) else math.inf


def format_duration(seconds: float) -> str:
    """``0:03:52`` for 232 seconds."""
    return str(timedelta(seconds=int(max(seconds, 0.0))))


class ThroughputLogger(Callback):
    """Logs ``train/tokens_per_s`` and ``train/step_time_s``: their rolling means over the last ``window`` steps.

    The figures are computed by Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` from the
    training's wall-clock time, validation left out (as Lightning's ``ThroughputMonitor`` does), data loading,
    logging and checkpoints included: what a user waits for. They are logged with
    ``self.log``, so they reach the loggers (every ``log_every_n_steps``), ``trainer.callback_metrics`` and the
    progress bar; ``ThroughputMonitor`` writes straight to the loggers and names them per sample and per batch.

    Tokens are the ones of each batch's ``attention_mask``, else the elements of its ``input_ids``
    (:func:`batch_tokens`); ``tokens_per_s`` counts every rank's. A batch without either gets only the step time.

    Example::

        trainer = Trainer(callbacks=[ThroughputLogger(window=20)])

    Args:
        window: Optimizer steps the means span; the first figures come after this many steps.
        prog_bar: Also show the figures on the progress bar.

    Raises:
        ValueError: If ``window`` is not a whole number of at least 1.
    """

    #: Its training-loop hooks read no weights, so the superpipe strategy's pipelined step keeps running past them.
    superpipe_reads_no_weights = True

    def __init__(self, window: int = 10, prog_bar: bool = True) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"ThroughputLogger(window={window!r}) must be a whole number of steps, at least 1")
        self.window = window
        self.prog_bar = prog_bar
        self._throughput: Throughput | None = None
        self._start = 0.0
        self._paused = 0.0  # seconds spent validating since training started
        self._validation_start: float | None = None
        self._batches = self._samples = self._tokens = 0
        self._counts_tokens = True  # until a batch comes whose tokens cannot be counted

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # One point per micro-batch, the start included: a window of `window` steps spans this many intervals.
        points = self.window * trainer.accumulate_grad_batches + 1
        self._throughput = Throughput(world_size=trainer.world_size, window_size=points)
        self._batches = self._samples = self._tokens = 0
        self._paused = 0.0
        self._counts_tokens = True
        self._start = time.perf_counter()
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None:
            self._paused += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._throughput is None:
            return
        # No device synchronization (ThroughputMonitor's): over a window of steps, the device running behind the
        # host evens out, and waiting for it every step would slow the run being measured.
        samples, tokens = batch_samples(batch), batch_tokens(batch)
        # `Throughput` wants at least a token a sequence, each update more than the last.
        self._counts_tokens = self._counts_tokens and tokens is not None and tokens >= samples
        self._batches += 1
        self._samples += samples
        self._tokens += tokens or 0
        self._throughput.update(
            time=time.perf_counter() - self._start - self._paused,
            batches=self._batches,
            samples=self._samples,
            lengths=self._tokens if self._counts_tokens else None,
        )
        figures = self._throughput.compute()
        batches_per_s = figures.get("device/batches_per_sec")
        if not batches_per_s:
            return  # the window is not full yet
        log_figure = {"on_step": True, "on_epoch": False, "prog_bar": self.prog_bar, "batch_size": 1}
        pl_module.log("train/step_time_s", trainer.accumulate_grad_batches / batches_per_s, **log_figure)
        if self._counts_tokens and "device/items_per_sec" in figures:
            tokens_per_s = figures["device/items_per_sec"] * trainer.world_size
            pl_module.log("train/tokens_per_s", tokens_per_s, **log_figure)


class LoggingProgressBar(ProgressBar):
    """Lightning's progress bar as plain lines through :mod:`logging`, for output that is not a terminal.

    A line after a stage's first batch (training, validation, test, predict), then whenever ``every_n_seconds`` have
    passed or ``every_n_steps`` steps (batches, outside training) were done since the last line, and one when the stage
    ends. A training line gives the step of the total, the time elapsed and left, what the run shows on the progress
    bar (``train/loss``, ``train/tokens_per_s`` and ``train/step_time_s`` of :class:`ThroughputLogger`, ...) and the
    device's peak (:func:`device_peak_bytes`)::

        train step 21/60, epoch 0 (0:03:10 elapsed, about 0:05:53 left): train/loss=4.547, dev_mem_MiB=3.822,
        train/step_time_s=2.724, train/tokens_per_s=375.9; device peak 47.4 MiB

    The lines go to the ``lightning_superpipe.recipes.progress`` logger at level INFO, on rank 0. The ``superpipe``
    command shows them on standard error; elsewhere configure :mod:`logging` to see them
    (``logging.basicConfig(level=logging.INFO)``).

    Example::

        trainer = Trainer(callbacks=[LoggingProgressBar(every_n_seconds=60)])  # in place of the default bar

    Args:
        every_n_seconds: Seconds between lines; ``None`` for lines by steps only.
        every_n_steps: Steps between lines; ``None`` (default) for lines by time only.

    Raises:
        ValueError: If both are ``None``, or one is not positive.
    """

    superpipe_reads_no_weights = True

    def __init__(self, every_n_seconds: float | None = 30.0, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_seconds is None and every_n_steps is None:
            raise ValueError("LoggingProgressBar needs every_n_seconds or every_n_steps (or both); got neither")
        number = isinstance(every_n_seconds, (int, float)) and not isinstance(every_n_seconds, bool)
        if every_n_seconds is not None and not (number and every_n_seconds > 0):
            raise ValueError(f"LoggingProgressBar(every_n_seconds={every_n_seconds!r}) must be a positive number of "
                             "seconds")
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"LoggingProgressBar(every_n_steps={every_n_steps!r}) must be a whole number, 1 or more")
        self.every_n_seconds = every_n_seconds
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._stage_start = 0.0
        self._last_line = (0.0, 0)  # (time, step or batch count) of the last line
        self._written = False  # whether the stage has had its first line
        self._training_clock = (0.0, (0.0, 0), False)  # the three above, kept while fit validates
        self._first_step = 0  # global step when training started (a resumed run starts past 0)
        self._total_steps: int | None = None

    @property
    def is_enabled(self) -> bool:
        """Whether lines are written (only on rank 0, and not while Lightning's tuner has the bar disabled)."""
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _begin(self, count: int) -> None:
        self._stage_start = time.perf_counter()
        self._last_line = (self._stage_start, count)
        self._written = False

    def _due(self, count: int) -> bool:
        """Whether a line is due after ``count`` steps (or batches) of the stage: the first, then by time or steps."""
        if not self._enabled:
            return False
        if not self._written:
            return True
        since_time, since_count = self._last_line
        by_time = self.every_n_seconds is not None and time.perf_counter() - since_time >= self.every_n_seconds
        by_steps = self.every_n_steps is not None and count - since_count >= self.every_n_steps
        return by_time or by_steps

    def _write(self, head: str, trainer: Trainer, pl_module: LightningModule, count: int) -> None:
        items = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k not in HIDDEN_ITEMS}
        figures = ", ".join(f"{key}={format_figure(value)}" for key, value in items.items())
        peak = device_peak_bytes(trainer)
        tail = "; ".join(part for part in (figures, f"device peak {format_bytes(peak)}" if peak is not None else "")
                         if part)
        log.info("%s%s", head, f": {tail}" if tail else "")
        self._last_line = (time.perf_counter(), count)
        self._written = True

    def _times(self, done: int, total: float | None) -> str:
        elapsed = time.perf_counter() - self._stage_start
        text = f"{format_duration(elapsed)} elapsed"
        if total is not None and math.isfinite(total) and 0 < done < total:
            text += f", about {format_duration(elapsed / done * (total - done))} left"
        return text

    # ------------------------------------------------------------------ training

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step = trainer.global_step
        total = trainer.estimated_stepping_batches
        self._total_steps = int(total) if math.isfinite(total) else None
        self._begin(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._first_step or not self._due(step):
            return  # no optimizer step yet (accumulating gradients), or no line due
        total = f"/{self._total_steps}" if self._total_steps is not None else ""
        done = step - self._first_step
        left = self._total_steps - self._first_step if self._total_steps is not None else None
        head = f"train step {step}{total}, epoch {trainer.current_epoch} ({self._times(done, left)})"
        self._write(head, trainer, pl_module, step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled:
            head = f"training done: step {trainer.global_step} ({self._times(0, None)})"
            self._write(head, trainer, pl_module, trainer.global_step)

    # ------------------------------------------------------------------ evaluation and prediction

    def _eval_batch_end(self, trainer: Trainer, pl_module: LightningModule, what: str, batch_idx: int,
                        total: float) -> None:
        done = batch_idx + 1
        if trainer.sanity_checking or done >= total or not self._due(done):
            return  # the last batch's line is the stage's "done" line
        of = f"/{int(total)}" if math.isfinite(total) else ""
        self._write(f"{what} batch {done}{of} ({self._times(done, total)})", trainer, pl_module, done)

    def _eval_end(self, trainer: Trainer, pl_module: LightningModule, what: str) -> None:
        if self._enabled and not trainer.sanity_checking:
            self._write(f"{what} done ({self._times(0, None)})", trainer, pl_module, 0)

    def _eval_start(self, trainer: Trainer) -> None:
        if not trainer.sanity_checking:
            self._begin(0)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:  # training's clock goes on after validating
            self._training_clock = (self._stage_start, self._last_line, self._written)
        self._eval_start(trainer)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_end(trainer, pl_module, "validation", batch_idx, loader_batches(trainer.num_val_batches,
                                                                                      dataloader_idx))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end(trainer, pl_module, "validation")
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stage_start, self._last_line, self._written = self._training_clock

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start(trainer)

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_end(trainer, pl_module, "test", batch_idx, loader_batches(trainer.num_test_batches,
                                                                                dataloader_idx))

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end(trainer, pl_module, "test")

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start(trainer)

    @override
    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_end(trainer, pl_module, "predict", batch_idx, loader_batches(trainer.num_predict_batches,
                                                                                   dataloader_idx))

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end(trainer, pl_module, "predict")
