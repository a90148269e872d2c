"""Checkpoints to resume from: ``last.ckpt`` is kept current every N steps, at the end, and when a run is stopped.

Ctrl-C (SIGINT) and SIGTERM stop ``fit`` at the end of a training step rather than in the middle of one, so that
the weights, the optimizer, the schedule, the loops' counters and the data loader's position in the epoch all agree
in the checkpoint, and ``fit --ckpt_path last.ckpt`` continues as if the run had never stopped.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, Literal

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException


class TrainingInterrupted(BaseException):
    """``fit`` stopped on a signal; a ``BaseException`` like ``KeyboardInterrupt``, because it is not an error.

    Args:
        signal_name: ``SIGINT`` or ``SIGTERM``.
        step: Optimizer steps completed when training stopped.
        checkpoint_path: The checkpoint to resume from, or ``None`` if there is none.
        saved: Whether ``checkpoint_path`` was written on stopping (``False``: an older periodic checkpoint).
    """

    def __init__(self, signal_name: str, step: int, checkpoint_path: str | None, saved: bool) -> None:
        self.signal_name = signal_name
        self.step = step
        self.checkpoint_path = checkpoint_path
        self.saved = saved
        if checkpoint_path is None:
            message = f"{signal_name} stopped training at step {step}, before any checkpoint was saved"
        elif saved:
            message = f"{signal_name} stopped training at step {step}; saved {checkpoint_path}"
        else:
            message = (
                f"{signal_name} stopped training at step {step} without saving; "
                f"the newest checkpoint is {checkpoint_path}"
            )
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + int(getattr(signal, self.signal_name))


class ResumableCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is always the newest state that ``fit --ckpt_path`` can resume from.

    On top of what ``ModelCheckpoint`` saves (every ``every_n_train_steps`` here):

    * at the end of training, ``last.ckpt`` is brought up to the final step (``ModelCheckpoint`` leaves it at the
      last multiple of ``every_n_train_steps``);
    * the first Ctrl-C (SIGINT) or a SIGTERM lets the current training step finish, and the validation after it if
      one is due, saves ``last.ckpt`` and stops ``fit`` with :class:`TrainingInterrupted`; a second Ctrl-C stops at
      once, without saving. Lightning's own SIGTERM handler is called when the run stops (at once where there are
      several processes, whose ``SIGTERMException`` then also leaves a ``last.ckpt`` behind).

    With ``save_last=False`` the checkpoint saved on a signal takes ``filename``'s name (``epoch=E-step=S.ckpt``).

    Args:
        save_last: As in ``ModelCheckpoint``; on by default, since ``last.ckpt`` is what a run resumes from.
        **kwargs: The other arguments of ``ModelCheckpoint`` (``every_n_train_steps``, ``save_top_k`` ...).
    """

    def __init__(self, save_last: bool | Literal["link"] | None = True, **kwargs: Any) -> None:
        super().__init__(save_last=save_last, **kwargs)
        self.interruption: TrainingInterrupted | None = None
        self._stop_signal: str | None = None
        self._stop_checkpoint: str | None = None
        self._trainer: Trainer | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._pending_sigterm: tuple[int, FrameType | None] | None = None

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        # Python lets only the main thread set signal handlers (a trainer run from a thread keeps them as they are).
        if threading.current_thread() is not threading.main_thread() or self._previous_handlers:
            return
        for signum, handler in ((signal.SIGINT, self._on_sigint), (signal.SIGTERM, self._on_sigterm)):
            self._previous_handlers[signum] = signal.signal(signum, handler)

    def _restore_signal_handlers(self) -> None:
        self._forward_sigterm()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _forward_sigterm(self) -> None:
        """Pass a SIGTERM received on to the handler it displaced: Lightning's, with any it had displaced."""
        pending, self._pending_sigterm = self._pending_sigterm, None
        previous = self._previous_handlers.get(signal.SIGTERM)
        if pending is not None and callable(previous):
            previous(*pending)

    def _notify(self, message: str) -> None:
        """Say on standard error, from a signal handler, what the signal will do."""
        if self._trainer is not None and not self._trainer.is_global_zero:
            return
        try:
            # Not through ``logging``: the signal may have come in the middle of a write to the same stream (a
            # progress bar's), and the write here would then fail; the message is skipped rather than the step.
            sys.stderr.write(f"\n{message}\n")
            sys.stderr.flush()
        except (RuntimeError, OSError, ValueError):
            pass

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        trainer = self._trainer
        if self._stop_signal is not None or trainer is None or trainer.global_step == 0:
            # Asked twice, or before any step completed (nothing to save): stop now, as Ctrl-C always does.
            self._stop_signal = self._stop_signal or "SIGINT"
            self._restore_signal_handlers()
            raise KeyboardInterrupt
        self._stop_signal = "SIGINT"
        self._notify(
            "Ctrl-C: training stops after this step and saves a checkpoint to resume from; "
            "press Ctrl-C again to stop at once without one."
        )

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is None:
            self._stop_signal = "SIGTERM"
            self._notify("SIGTERM: training stops after this step and saves a checkpoint to resume from.")
        self._pending_sigterm = (signum, frame)
        # Lightning's handler would stop the run itself, with ``SIGTERMException``: in the middle of a validation
        # (its figures then lost) or just after one (the resumed run's step count then one too high). It is
        # therefore told only when this callback stops the run, except where it must tell the other processes.
        trainer = self._trainer
        if trainer is not None and (trainer.world_size > 1 or trainer.strategy.launcher is not None):
            self._forward_sigterm()

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.interruption = None
        self._stop_signal = self._stop_checkpoint = None
        self._trainer = trainer
        # After Lightning has registered its own handlers, so that its teardown does not reinstate this one.
        self._install_signal_handlers()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if self._stop_signal is not None and self._stop_checkpoint is None and not self._training_ends(trainer):
            # Saved now, when the step is complete and nothing of the next one has happened; the stop itself waits
            # for the step's logging and validation, which the resumed run would not repeat.
            self._stop_checkpoint = self._save_for_resume(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._stop_signal is not None and not trainer.sanity_checking and not self._training_ends(trainer):
            if self._stop_checkpoint is None:
                self._stop_checkpoint = self._save_for_resume(trainer)
            self._stop(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_start(trainer, pl_module, *args, **kwargs)
        if self._stop_checkpoint is not None:
            self._stop(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._stop_checkpoint is not None:
            self._stop(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_signal_handlers()
        super().on_train_end(trainer, pl_module)
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_signal_handlers()
        if isinstance(exception, TrainingInterrupted):
            return
        if isinstance(exception, SIGTERMException):
            # Where Lightning acts on SIGTERM itself (several processes): between steps, or between validation
            # batches, where the training state is consistent; the validation cut short is not redone.
            self._stop_signal = self._stop_signal or "SIGTERM"
            if self._stop_checkpoint is None and trainer.global_step > 0 and not trainer.sanity_checking:
                self._stop_checkpoint = self._save_for_resume(trainer)
        elif isinstance(exception, KeyboardInterrupt) and self._stop_signal == "SIGINT":
            pass  # a second Ctrl-C: whatever the step was doing is lost, but a checkpoint saved before stands
        else:
            super().on_exception(trainer, pl_module, exception)
            return
        self.interruption = self._interruption(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath", self.dirpath) != self.dirpath:
            # A resumed run writes to a version folder of its own, so the stopped run's file paths do not carry
            # over; ``ModelCheckpoint`` would warn about that on every resume, which is how resuming works here.
            self.best_model_path = state_dict["best_model_path"]
            return
        super().load_state_dict(state_dict)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_signal_handlers()
        self._trainer = None
        super().teardown(trainer, pl_module, stage)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _training_ends(trainer: Trainer) -> bool:
        """Whether the step just taken is the run's last: it then ends by itself, and ``on_train_end`` saves."""
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def _save_for_resume(self, trainer: Trainer) -> str:
        """Save the current state unless this step's is saved already; the path of the checkpoint to resume from."""
        candidates = self._monitor_candidates(trainer)
        if self._last_global_step_saved == trainer.global_step:
            return self.last_model_path or self.best_model_path
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
            return self.last_model_path
        path = self.format_checkpoint_name(candidates)
        self._save_checkpoint(trainer, path)
        return path

    def _interruption(self, trainer: Trainer) -> TrainingInterrupted:
        saved = self._stop_checkpoint is not None
        path = self._stop_checkpoint or self.last_model_path or self.best_model_path or None
        return TrainingInterrupted(self._stop_signal or "SIGINT", trainer.global_step, path, saved=saved)

    def _stop(self, trainer: Trainer) -> None:
        self._restore_signal_handlers()
        self.interruption = self._interruption(trainer)
        raise self.interruption
