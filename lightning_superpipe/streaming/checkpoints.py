"""Checkpoints of a streaming run: what the strategy's save and load hooks do besides Lightning's own.

The host tier's parameters are the masters, so Lightning's save and load work on them as they are; only the device
copies must be refreshed after a load. The disk tier's block values are in its files: a ``.ckpt`` carries their
manifest and a hard-linked copy of the files beside it, and a resume restores the blocks from that copy when
streaming starts (:mod:`.disk_tier`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.memory.packed import packed_entries_left_out
from lightning_superpipe.streaming import disk_tier
from lightning_superpipe.streaming.deferred_init import DeferredInit
from lightning_superpipe.streaming.engine import StreamingEngine


@contextmanager
def tier_files_beside(engine: Optional[StreamingEngine], checkpoint: dict[str, Any], filepath: Any) -> Iterator[None]:
    """Around the write of a ``.ckpt`` (on the rank that writes it): the disk tier's committed files are linked
    beside it first, since a ``.ckpt`` implies them, and older copies go once the ``.ckpt`` is in place."""
    tier = disk_tier.disk_tier_of(engine)
    if tier is not None:
        disk_tier.add_to_checkpoint(tier, checkpoint, filepath)
    yield
    if tier is not None:
        disk_tier.checkpoint_saved(checkpoint, filepath)


@contextmanager
def blocks_left_to_files(engine: Optional[StreamingEngine]) -> Iterator[None]:
    """Around the state dict of a ``.ckpt``: under the disk tier its blocks' entries are dropped for the files
    linked beside it (:meth:`~.disk_tier.DiskTier.placeholders_in_state_dict`), and those of a 4-bit base, in the
    tier's read-only files, are neither copied nor dequantized (the ``.ckpt`` holds none of them)."""
    tier = disk_tier.disk_tier_of(engine)
    with tier.placeholders_in_state_dict() if tier is not None else nullcontext():
        with packed_entries_left_out() if tier is not None else nullcontext():
            yield


def load_model_state(
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    strict: bool,
    engine: Optional[StreamingEngine],
    deferred: Optional[DeferredInit],
    load: Callable[[Mapping[str, Any], bool], None],
) -> None:
    """Loads ``checkpoint``'s state dict into ``module`` where ``load`` (Lightning's) would, with the streaming
    run's rules: what it holds is not initialized later by the deferred init calls; a disk-tier checkpoint's blocks
    come from its files when streaming starts; while streaming, no copy may read a master being loaded, and the
    device copies are refreshed after."""
    if deferred is not None:
        held = module.state_dict(keep_vars=True)
        deferred.discard(held[name] for name in checkpoint["state_dict"] if name in held)
    if disk_tier.DISK_KEY in checkpoint:
        disk_tier.load_state_dict(module, checkpoint, strict, engine is not None)
        return
    if engine is not None:
        engine.copier.synchronize()
    load(checkpoint, strict)
    if engine is not None:
        engine.refresh()


def load_optimizer_states(
    optimizers: Iterable[Optimizer],
    checkpoint: Mapping[str, Any],
    engine: Optional[StreamingEngine],
    keep_own: Callable[[Optimizer], None],
) -> None:
    """Loads each optimizer's state from ``checkpoint``, kept with the host masters (Lightning's moves it to the
    device); ``keep_own`` drops what another rank steps (``shard_optimizer``). The disk tier refuses a host tier's
    state for its blocks first."""
    tier = disk_tier.disk_tier_of(engine)
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
        if tier is not None and disk_tier.DISK_KEY not in checkpoint:
            disk_tier.check_optimizer_state(tier, optimizer, state)
        optimizer.load_state_dict(state)
        keep_own(optimizer)
