"""An opt-in callback that logs what :class:`~lightning_superpipe.SuperpipeStrategy` holds on the device.

The strategy logs nothing by itself: a run's logged metrics are the ones its user asked for. Add
:class:`DeviceMemoryLogger` to the Trainer's callbacks to have the device figures of every training batch in the
loggers and ``trainer.callback_metrics``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_superpipe.strategies.superpipe import SuperpipeStrategy


class DeviceMemoryLogger(Callback):
    """Logs ``superpipe/device_bytes`` and ``superpipe/peak_device_bytes`` after each training batch.

    The figures come from the strategy's ledger of the bytes it put on the device (the same as
    ``memory_report()["device_bytes"]`` and ``["peak_device_bytes"]``). Under another strategy it logs nothing.

    Example::

        trainer = Trainer(strategy="superpipe", callbacks=[DeviceMemoryLogger()])

    Args:
        prog_bar: Also show the figures on the progress bar.
    """

    def __init__(self, prog_bar: bool = False) -> None:
        self.prog_bar = prog_bar

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not isinstance(trainer.strategy, SuperpipeStrategy):
            return
        ledger = trainer.strategy.engine.ledger  # the full `memory_report()` walks every parameter: not per batch
        for key, value in (("device_bytes", ledger.total_bytes), ("peak_device_bytes", ledger.peak_bytes)):
            # A figure of this step alone: `batch_size` only weighs epoch means, and an iterator-style
            # `training_step(dataloader_iter)` requires it.
            pl_module.log(f"superpipe/{key}", float(value), on_step=True, on_epoch=False, batch_size=1,
                          prog_bar=self.prog_bar)
