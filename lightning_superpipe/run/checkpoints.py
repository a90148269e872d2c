"""Checkpoints of a streaming run: what the strategy's save and load hooks do besides Lightning's own.

The host tier's parameters are the masters, so Lightning's save and load work on them as they are; only the device
copies must be refreshed after a load. They are views into their block's flat buffer, which ``torch.save`` would write
whole for each one saved: a ``.ckpt`` holding only some of them (a LoRA run's adapters) gets copies of those instead
(:func:`saved_bytes_only`). A kind of home that keeps the blocks elsewhere adds what a resume needs of them to the
``.ckpt`` (:meth:`.Homes.saving_checkpoint`; the disk tier links its files beside it), and restores them from there
when streaming starts (:meth:`.HomeKind.resume_folder`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.construction.deferred_init import DeferredInit
from lightning_superpipe.memory.home import kind_that_wrote
from lightning_superpipe.streaming.engine import StreamingEngine


def save_checkpoint(
    checkpoint: dict[str, Any], filepath: Any, engine: Optional[StreamingEngine], *, writes: bool,
    add_rng_states: Callable[[dict[str, Any]], None], write: Callable[[dict[str, Any]], None],
) -> None:
    """Writes ``checkpoint`` to ``filepath`` with Lightning's ``write``, with what the run adds: the RNG states, and,
    on the rank that ``writes`` it, what the kind of home keeps beside the file (:meth:`.Homes.saving_checkpoint`),
    and copies of the tensors that are views into storages they cover only part of (:func:`saved_bytes_only`). The
    dict the hooks were handed (and may keep) is left as it was."""
    checkpoint = dict(checkpoint)
    add_rng_states(checkpoint)
    homes = engine.home_kind if engine is not None and writes else None  # every rank's homes are alike
    with homes.saving_checkpoint(checkpoint, filepath) if homes is not None else nullcontext():
        # Here, below every checkpoint IO plugin, and after the homes have dropped what they keep beside it.
        write(saved_bytes_only(checkpoint) if writes else checkpoint)


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


def blocks_left_to_files(engine: Optional[StreamingEngine]) -> AbstractContextManager[None]:
    """Around the state dict of a ``.ckpt``: the kind of home leaves out what it keeps beside the file
    (:meth:`.Homes.checkpoint_state_dict`)."""
    return engine.home_kind.checkpoint_state_dict() if engine is not None else nullcontext()


def load_model_state(
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    strict: bool,
    engine: Optional[StreamingEngine],
    deferred: Optional[DeferredInit],
    load: Callable[[Mapping[str, Any], bool], None],
) -> None:
    """Loads ``checkpoint``'s state dict into ``module`` where ``load`` (Lightning's) would, with the streaming
    run's rules: what it holds is not initialized later by the deferred init calls; the blocks of a checkpoint whose
    kind of home keeps them beside the ``.ckpt`` come from there when streaming starts
    (:meth:`.HomeKind.load_model_state`); while streaming, no copy may read a master being loaded, and the device
    copies are refreshed after."""
    if deferred is not None:
        held = module.state_dict(keep_vars=True)
        deferred.discard(held[name] for name in checkpoint["state_dict"] if name in held)
    writer = kind_that_wrote(checkpoint)
    if writer is not None:
        writer.load_model_state(module, checkpoint, strict, engine is not None)
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
    device); ``keep_own`` drops what another rank steps (``shard_optimizer``). The kind of home refuses first a state
    it could not use (:meth:`.Homes.check_optimizer_state`)."""
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
        if engine is not None:
            engine.home_kind.check_optimizer_state(optimizer, state, checkpoint)
        optimizer.load_state_dict(state)
        keep_own(optimizer)
