"""Checkpoints of a streaming run: what the strategy's save and load hooks do besides Lightning's own.

The host tier's parameters are the masters, so Lightning's save and load work on them as they are; only the device
copies must be refreshed after a load. They are views into their block's flat buffer, which ``torch.save`` would write
whole for each one saved: a ``.ckpt`` holding only some of them (a LoRA run's adapters) gets copies of those instead
(:func:`saved_bytes_only`). The disk tier's block values are in its files: a ``.ckpt`` carries their
manifest and a hard-linked copy of the files beside it, and a resume restores the blocks from that copy when
streaming starts (:mod:`.disk_tier`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

from torch import Tensor, nn
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


#: The most a storage's bytes may exceed those of its tensors in a checkpoint before they are written as copies: a
#: storage saved whole for views that cover this much of it (a block saved whole, but for its layout's alignment gaps)
#: adds at most a tenth to the file, and copying it would double the host memory it takes while the save runs.
UNSAVED_FRACTION = 0.1


def saved_bytes_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with copies of the tensors that are views into a storage they cover only part of.

    ``torch.save`` writes the whole storage of every tensor it saves. A host tier's parameters are views into their
    block's flat buffer, so a checkpoint of a LoRA run's adapters would hold every frozen base weight beside them.
    The tensors of such a storage are copied, views of one place sharing one copy (tied weights stay tied); where
    they cover the storage but for :data:`UNSAVED_FRACTION` of it (a model saved whole), they stay views. Containers
    on the way to a copy are copied too; nothing of ``checkpoint`` itself (the optimizer's live state among it)
    changes. Tensor subclasses other than ``nn.Parameter`` are left as they are.
    """
    tensors: list[Tensor] = []
    _collect_tensors(checkpoint, tensors)
    ranges: dict[tuple[Any, int], tuple[int, list[tuple[int, int]]]] = {}
    for tensor in tensors:
        place = _storage_place(tensor)
        if place is not None:
            key, nbytes, start, end = place
            ranges.setdefault(key, (nbytes, []))[1].append((start, end))
    partial = {key for key, (nbytes, spans) in ranges.items()
               if nbytes - _covered_bytes(spans) > UNSAVED_FRACTION * _covered_bytes(spans)}
    if not partial:
        return checkpoint
    copies: dict[tuple[Any, ...], Tensor] = {}

    def copied(tensor: Tensor) -> Tensor:
        place = _storage_place(tensor)
        if place is None or place[0] not in partial:
            return tensor
        view = (place[0], tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view not in copies:
            data = tensor.detach().clone()
            copies[view] = nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
        return copies[view]

    return _replace_tensors(checkpoint, copied)


def _collect_tensors(value: Any, found: list[Tensor]) -> None:
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect_tensors(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_tensors(item, found)


def _storage_place(tensor: Tensor) -> Optional[tuple[tuple[Any, int], int, int, int]]:
    """The storage of ``tensor`` (a key), its bytes, and the byte range ``tensor`` spans in it; ``None`` for a tensor
    without a storage of its own to write (meta, a wrapper subclass) or one left as it is."""
    if type(tensor) not in (Tensor, nn.Parameter) or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    itemsize = tensor.element_size()
    start = tensor.storage_offset() * itemsize
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    span = 0 if tensor.numel() == 0 else itemsize * (1 + reach)
    return (tensor.device, storage.data_ptr()), storage.nbytes(), start, start + span


def _covered_bytes(spans: list[tuple[int, int]]) -> int:
    """The bytes the union of the ranges ``spans`` covers."""
    covered, reached = 0, 0
    for start, end in sorted(spans):
        start = max(start, reached)
        if end > start:
            covered += end - start
            reached = end
    return covered


def _replace_tensors(value: Any, replace: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with each tensor ``t`` in it (in mappings, lists and tuples) replaced by ``replace(t)``; a container
    is copied only where something inside it was replaced."""
    if isinstance(value, Tensor):
        return replace(value)
    if isinstance(value, Mapping):
        changed = {key: new for key, item in value.items() if (new := _replace_tensors(item, replace)) is not item}
        if not changed:
            return value
        result = copy.copy(value) if isinstance(value, dict) else dict(value)
        result.update(changed)
        return result
    if isinstance(value, (list, tuple)):
        items = [_replace_tensors(item, replace) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        if isinstance(value, list):
            result_list = copy.copy(value)
            result_list[:] = items
            return result_list
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


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
