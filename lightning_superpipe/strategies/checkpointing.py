"""How :class:`~lightning_superpipe.SuperpipeStrategy` saves and restores a run: Lightning's checkpoint calls, with
what the kind of home keeps beside the ``.ckpt``, the RNG states of every rank, pending optimizer steps waited for, and
a file that holds the bytes of the tensors saved, not the whole blocks they are views into.

A base class of the strategy, so that the strategy's module stays the glue between Lightning's hooks and the
streaming engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.construction.deferred_init import DeferredInit
from lightning_superpipe.memory.home import kind_that_wrote
from lightning_superpipe.run.checkpoints import (
    blocks_left_to_files,
    homes_beside,
    load_model_state,
    load_optimizer_states,
    saved_bytes_only,
)
from lightning_superpipe.run.options import SuperpipeOptions
from lightning_superpipe.run.session import StreamingSession
from lightning_superpipe.stepping.optimizers import put_state_in_group_order
from lightning_superpipe.strategies.ranks import RanksStrategy
from lightning_superpipe.streaming.engine import StreamingEngine


class CheckpointingStrategy(RanksStrategy):
    """Lightning's checkpoint calls for a streaming run (the streaming itself is the subclass's)."""

    _streaming: Optional[StreamingSession]
    _resume: Optional[Path]  # the folder a checkpoint's homes are restored from
    _deferred: Optional[DeferredInit]
    options: SuperpipeOptions

    @property
    def _engine(self) -> Optional[StreamingEngine]:  # type: ignore[override]
        return self._streaming.engine if self._streaming is not None else None

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        self._settle()
        # What the strategy adds goes to the file, not into the dict the hooks were handed (and may keep).
        checkpoint = dict(checkpoint)
        self.add_rng_states(checkpoint)
        # Rank 0 writes the .ckpt, and what its homes keep beside it (every rank's are alike).
        with homes_beside(self._engine if self.is_global_zero else None, checkpoint, filepath):
            # Here, below every checkpoint IO plugin, and after the homes have dropped what they keep beside it.
            written = saved_bytes_only(checkpoint) if self.is_global_zero else checkpoint
            super().save_checkpoint(written, filepath, storage_options=storage_options)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._settle()
        with blocks_left_to_files(self._engine):
            return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self._settle()
        put_state_in_group_order(getattr(optimizer, "_optimizer", optimizer))  # block steps made it in another order
        return super().optimizer_state(optimizer)

    def _settle(self) -> None:
        """Waits for pending (pipelined) optimizer steps: what follows reads weights or optimizer state."""
        if self._streaming is not None:
            self._streaming.settle()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        kind = self.options.home_kind
        if kind is not None and self.is_global_zero:
            kind.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.restore_rng_states(checkpoint)
        writer, kind = kind_that_wrote(checkpoint), self.options.home_kind
        if writer is not None and kind is not None:  # its homes are beside the .ckpt: restored when streaming starts
            self._resume = writer.resume_folder(checkpoint_path, checkpoint, kind)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        parent = super().load_model_state_dict
        load_model_state(self.lightning_module, checkpoint, strict, self._engine, self._deferred,
                         lambda state, strict: parent(state, strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load_optimizer_states(self.optimizers, checkpoint, self._engine, self.keep_own_optimizer_state)

