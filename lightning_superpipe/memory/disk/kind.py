"""The disk tier as a kind of home (``offload_device="disk"``): its knobs, the checks of a run before anything is
allocated, the building of its store and homes, and what it keeps beside each ``.ckpt``.

The homes themselves, which stream the blocks from files, are :class:`~lightning_superpipe.memory.disk.tier.DiskTier`;
its files beside a checkpoint are :mod:`.checkpoints`, its hooks on the user's objects :mod:`.hooks`.

* **Checks**: ``offload_path`` is a writable folder; the tier steps block by block, so it trains one optimizer that
  updates each parameter alone, with no step hooks and no weight-averaging callback (:func:`check_training`); its
  host memory (the pool, the gradients arriving, the cast's staging, the trunk's state) fits
  (:mod:`.budget`).
* **Several ranks**: each keeps its own store in ``offload_path/rank-<rank>`` (:func:`rank_folder`), stepped alike
  from the averaged gradients, so ``shard_optimizer`` does not apply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.averaging import weight_averaging_callbacks
from lightning_superpipe.memory.disk import checkpoints
from lightning_superpipe.memory.disk.budget import check_disk_host_room, disk_host_bytes
from lightning_superpipe.memory.disk.errors import DiskSpaceError, DiskTierError
from lightning_superpipe.memory.disk.frozen import FrozenFiles, block_itemsize, split_frozen
from lightning_superpipe.memory.disk.space import preflight
from lightning_superpipe.memory.disk.store import DiskStore
from lightning_superpipe.memory.disk.tier import DiskTier
from lightning_superpipe.memory.disk.trunk import trunk_on_disk
from lightning_superpipe.memory.fourbit.packed import split_packed
from lightning_superpipe.memory.home import HomeKind, Homes, HomesBuilder, HomesRun, Knobs
from lightning_superpipe.memory.pinned import HostArena
from lightning_superpipe.stepping.optimizers import (
    REGISTER_HINT,
    has_step_hooks,
    per_parameter_optimizer_names,
    updates_each_parameter_alone,
)


class DiskKind(HomeKind):
    """``offload_device="disk"``: the blocks' masters and optimizer state in files under ``offload_path``, streamed
    through a bounded pool of host buffers (:class:`~lightning_superpipe.memory.disk.tier.DiskTier`)."""

    name = "disk"
    summary = "block masters and optimizer state in files under offload_path"
    title = "the disk tier"
    purpose = "keep the training state in files"
    own_knobs = ("offload_path", "host_buffer_bytes")
    records_init = True
    needs_optimizers = True
    sharding_refusal = "the disk tier keeps each rank's copy of the training state in files of its own"

    def check_knobs(self, knobs: Knobs) -> None:
        """``offload_path`` given, ``host_buffer_bytes`` a positive number of bytes or ``None``.

        Raises:
            ValueError: With the user's call.
        """
        call = knobs.offload_call
        if knobs.offload_path is None:
            raise ValueError(f"{call}: offload_device='disk' needs offload_path, a folder on a fast local disk.")
        size = knobs.host_buffer_bytes
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
            raise ValueError(f"{call}: host_buffer_bytes must be a positive number of bytes, or None for the default.")

    def check_run(self, knobs: Knobs, *, fitting: bool, trainer: Any, optimizers: Sequence[Any], ranks: int) -> None:
        """Sharding refused on several ranks, the folder writable now (its free space is checked once the bytes
        needed are known), and what the tier cannot train (:func:`check_training`).

        Raises:
            ValueError: With the user's call.
        """
        call, shard_optimizer = knobs.offload_call, knobs.shard_optimizer
        if ranks > 1 and shard_optimizer:
            raise ValueError(
                f"{call} keeps each rank's copy of the training state in files of its own, so"
                f" shard_optimizer={shard_optimizer!r} does not apply: leave it False, or use offload_device='cpu'"
                " to shard the optimizer state across ranks."
            )
        assert knobs.offload_path is not None
        try:
            preflight(knobs.offload_path, 0)
        except DiskSpaceError:
            pass  # the space is checked against the bytes the tier needs once the blocks and optimizer are known
        except DiskTierError as error:
            raise ValueError(f"{call}: {error}") from error
        if fitting:
            check_training(trainer, optimizers, call)

    def check_host_room(self, run: HomesRun) -> None:
        """The tier's buffers for ``run.slots`` device slots, the gradients arriving, the cast's staging and the
        trunk's state; a 4-bit base is in files of its own, read through staging buffers of the largest block's
        frozen bytes.

        Raises:
            MisconfigurationException: ``host_buffer_bytes`` is below the least pool.
            HostMemoryError: With the bytes needed and available.
        """
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        knobs, slots = run.knobs, run.slots
        masters, frozen_bytes = split_frozen(run.block_params, knobs.quantize_frozen, run.transfer_dtype)
        try:  # the pool, the gradients arriving, the cast's staging and the trunk's state
            parts = disk_host_bytes(masters, run.trunk_params if run.fitting else [], _optimizer(run),
                                    run.transfer_dtype, slots, knobs.host_buffer_bytes,
                                    pinned=run.device.type == "cuda")
        except DiskTierError as error:  # a bound below the least pool
            raise MisconfigurationException(f"{knobs.offload_call}: {error}") from error
        parts = replace(parts, staging=parts.staging + (slots + 1) * max(frozen_bytes, default=0))
        check_disk_host_room(parts, knobs.host_buffer_bytes)

    def prepare(self, run: HomesRun) -> HomesBuilder:
        """The tier's folder for this rank, with the files of the blocks' frozen packed weights (a 4-bit base),
        which ``quantize_frozen`` writes block by block as it quantizes; the store is built by
        :meth:`HomesBuilder.before_engine`.

        Raises:
            DiskTierError: The rank's folder cannot be made.
        """
        return _DiskBuilder(run)

    def wrote(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether ``checkpoint`` holds the tier's manifest (its blocks are in the files beside it)."""
        return checkpoints.DISK_KEY in checkpoint

    def resume_folder(self, ckpt_path: Union[str, os.PathLike[str]], checkpoint: Mapping[str, Any],
                      chosen: HomeKind) -> Optional[Path]:
        """The folder of the tier's files beside ``ckpt_path`` (:func:`.checkpoints.resume_folder`).

        Raises:
            MisconfigurationException: The run does not use the disk tier.
            DiskTierError: The folder is missing or holds another step than the checkpoint's.
        """
        if chosen.name != self.name:
            from lightning.pytorch.utilities.exceptions import MisconfigurationException

            raise MisconfigurationException(
                f"The checkpoint {os.fspath(ckpt_path)!r} was written by SuperpipeStrategy(offload_device='disk'): its"
                " blocks are in the files beside it. Resume it with offload_device='disk' (and an offload_path)."
            )
        return checkpoints.resume_folder(ckpt_path, checkpoint[checkpoints.DISK_KEY])

    def load_model_state(self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool,
                         streaming: bool) -> None:
        """The state dict without the blocks, which come from the files when streaming starts
        (:func:`.checkpoints.load_state_dict`)."""
        checkpoints.load_state_dict(module, checkpoint, strict, streaming)

    def checkpoint_weights(self, ckpt_path: Union[str, os.PathLike[str]], checkpoint: Mapping[str, Any]
                           ) -> tuple[dict[str, Tensor], list[str]]:
        """The block parameters' values, mapped from the files beside ``ckpt_path``, and the modules of a 4-bit base
        (not in the files: a run writes them again from the model)."""
        manifest = checkpoint[checkpoints.DISK_KEY]
        values = checkpoints.checkpoint_block_values(ckpt_path, manifest)
        return values, list(manifest.get(checkpoints.FROZEN_KEY, []))

    def remove_checkpoint(self, ckpt_path: Union[str, os.PathLike[str]]) -> None:
        """The folder of the files beside the ``.ckpt`` goes with it (:func:`.checkpoints.remove_snapshot`)."""
        checkpoints.remove_snapshot(ckpt_path)


def _optimizer(run: HomesRun) -> Optional[Optimizer]:
    """The optimizer whose state the tier keeps in its files (``None`` outside ``fit``)."""
    return run.optimizers[0] if run.fitting and run.optimizers else None


class _DiskBuilder(HomesBuilder):
    """One run's tier: the rank's folder and frozen files now, the store (written or restored) before the engine."""

    def __init__(self, run: HomesRun) -> None:
        self._run = run
        assert run.knobs.offload_path is not None
        path = run.knobs.offload_path
        self._frozen = FrozenFiles(make_rank_folder(path, run.rank) if run.ranks > 1 else Path(path),
                                   block_itemsize(run.block_params, run.transfer_dtype))
        self.write_frozen = self._frozen.write_block
        self._tier: Optional[DiskTier] = None

    def before_engine(self) -> None:
        self._tier = build_tier(self._run, self._frozen)

    def homes(self, arena: HostArena) -> Homes:
        assert self._tier is not None, "before_engine() builds the tier"
        return self._tier

    def discard(self) -> None:
        if self._tier is not None:
            self._tier.close()


def build_tier(run: HomesRun, frozen: Optional[FrozenFiles] = None) -> DiskTier:
    """The disk tier's store under ``offload_path`` (on several ranks, this rank's folder in it, once every rank
    checked the node's space), written from the model or restored from ``run.resume``; of the trunk parameters, those
    that go to its files when it trains (:func:`~lightning_superpipe.memory.disk.trunk.trunk_on_disk`), each a
    record after the blocks'.

    Raises:
        MisconfigurationException: The folder cannot hold it (the message quotes the user's call).
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    knobs, model, block_params, optimizer = run.knobs, run.model, run.block_params, _optimizer(run)
    assert knobs.offload_path is not None
    trunk = trunk_on_disk(run.trunk_params) if optimizer is not None else []  # matrices that train; the rest: memory
    names = {p: name for name, p in model.named_parameters()}
    streamed = {p for params in block_params for p in params} | set(trunk)
    state_names = {name for name, p in model.named_parameters(remove_duplicate=False) if p in streamed}
    masters = [split_packed(params)[0] for params in block_params]  # the 4-bit base goes to ``frozen``'s files
    in_store = {p for params in masters for p in params} | set(trunk)
    try:
        folder = Path(knobs.offload_path)
        if run.ranks > 1:  # every rank checks the node's space before any of them writes
            records = [*masters, *([p] for p in trunk)]
            folder = rank_folder(knobs.offload_path, run.rank, run.local_ranks, records, optimizer, run.resume is None)
            run.barrier("check the disk tier's folders")
        tier = DiskTier.build(folder, block_params, names, state_names, optimizer, run.transfer_dtype,
                              knobs.host_buffer_bytes, run.slots, run.resume, run.deferred, frozen, trunk)
        tier.frozen_names = {name for name, p in model.named_parameters(remove_duplicate=False)
                             if p in streamed and p not in in_store}
        return tier
    except DiskTierError as error:
        raise MisconfigurationException(f"{knobs.offload_call}: {error}") from error


def check_training(trainer: Any, optimizers: Sequence[Optimizer], call: str) -> None:
    """Refuses, before the tier is built, what it cannot train exactly.

    Raises:
        ValueError: With the user's call and what to do instead.
    """
    averaging = weight_averaging_callbacks(trainer)
    refusal = None
    if averaging:
        refusal = (
            f"the callback {type(averaging[0]).__name__} is not supported: it averages the parameters into a copy of"
            " the whole model in host memory and writes the average back into them for validation, while the disk"
            " tier keeps the blocks' values in its files (the parameters hold placeholders during the run). Remove"
            " it, or, to keep weight averaging, train"
        )
    elif len(optimizers) != 1:
        refusal = f"one optimizer is supported, configure_optimizers returned {len(optimizers)}"
    elif not updates_each_parameter_alone(optimizers[0]):
        name = type(optimizers[0]).__name__
        refusal = (
            f"{name} is not known to update each parameter on its own, and the tier steps block by block (supported:"
            f" {per_parameter_optimizer_names()}, and subclasses of them that override only __init__; "
            f"{REGISTER_HINT.format(name=name)})"
        )
    elif has_step_hooks(optimizers[0]):
        refusal = "the optimizer has step hooks, which would run once per block"
    elif getattr(trainer.precision_plugin, "scaler", None) is not None and getattr(
        optimizers[0], "_step_supports_amp_scaling", False
    ):
        refusal = (
            f"{type(optimizers[0]).__name__} unscales the gradients inside its step under a gradient scaler"
            " (16-mixed), which the tier runs block by block; pass fused=False, or use precision='bf16-mixed'"
        )
    if refusal is not None:
        ending = " with offload_device='cpu'." if averaging else ". Use offload_device='cpu' for this run."
        raise ValueError(f"{call}: {refusal}{ending}")
    readers = gradient_readers(trainer)
    if readers:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"{call}: {', '.join(readers)} will see `p.grad is None` for the blocks' parameters and the matrices"
            " outside them (embeddings, head): the disk tier moves their gradients to its files (or steps the block)"
            " as soon as they are complete. Gradients of the vectors outside the blocks (norms, biases) are there as"
            " usual, and `self.clip_gradients(...)` clips them all."
            " Use offload_device='cpu' if the hook needs every gradient."
        )


def gradient_readers(trainer: Any) -> list[str]:
    """The user's overrides of the hooks that run between backward and the step (``on_after_backward``,
    ``on_before_optimizer_step``, and ``configure_gradient_clipping``, where ``self.clip_gradients`` does clip the
    blocks' gradients), on the LightningModule and its callbacks, as ``"Class.hook"``."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = trainer.lightning_module
    hooks = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
    found = [f"{type(module).__name__}.{hook}" for hook in hooks if is_overridden(hook, module, LightningModule)]
    for callback in trainer.callbacks:
        found += [f"{type(callback).__name__}.{hook}" for hook in hooks[:2] if is_overridden(hook, callback, Callback)]
    return found


def make_rank_folder(offload_path: Union[str, os.PathLike[str]], rank: int) -> Path:
    """``offload_path/rank-<rank>``, created: where rank ``rank`` keeps its files on several ranks.

    Raises:
        DiskTierError: The folder cannot be made.
    """
    folder = Path(offload_path) / f"rank-{rank}"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as error:
        raise DiskTierError(f"Could not create the folder {str(folder)!r} for rank {rank}'s files: {error}.") from error
    return folder


def rank_folder(
    offload_path: Union[str, os.PathLike[str]], rank: int, local_ranks: int,
    block_params: Sequence[Sequence[nn.Parameter]], optimizer: Optional[Optimizer], fresh: bool,
) -> Path:
    """The folder of rank ``rank``'s files on several ranks, ``offload_path/rank-<rank>`` (created): each rank keeps
    its own copy of the blocks' training state, stepped alike from the averaged gradients, as each DDP rank keeps its
    own optimizer. A ``fresh`` tier checks first that the disk holds the copies of the node's ``local_ranks`` ranks
    (which share ``offload_path``); call it on every rank before any writes.

    Raises:
        DiskTierError: The folder cannot be made, or the disk is too small for the node's copies.
    """
    folder = make_rank_folder(offload_path, rank)
    if fresh:
        needed = DiskStore.bytes_needed(block_params, optimizer, spill_grads=optimizer is not None)
        preflight(folder, local_ranks * needed,
                  f"{local_ranks} ranks on this node, each with two slots of every block's record and its gradients")
    return folder
