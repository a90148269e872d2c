"""What Lightning sees of the disk tier (``offload_device="disk"``): the checks of a run before it starts, the hooks
on the user's ``zero_grad`` and ``state_dict``, and the tier's files beside each ``.ckpt``.

The tier itself, a kind of home whose blocks stream from files, is :mod:`lightning_superpipe.memory.disk_homes`.

* **Checkpoints**: the ``.ckpt`` holds the store's manifest; the committed files are hard-linked (or copied) into a
  new subfolder of :func:`~lightning_superpipe.memory.disk.checkpoint_folder` beside it, named in the manifest, and
  a resume restores them from there. Older subfolders go once the new ``.ckpt`` is written, so a kill during a save
  leaves the previous ``.ckpt`` with its files. The live files never write into a copy: a slot hard-linked into a
  checkpoint is replaced by a new file before it is written again (:class:`~lightning_superpipe.memory.disk.DiskStore`).
* **Several ranks**: each keeps its own store in ``offload_path/rank-<rank>`` (:func:`rank_folder`), stepped alike
  from the averaged gradients. Rank 0's files go beside the ``.ckpt``.
* **The user's calls**: ``zero_grad`` drops spilled gradients as it would drop ``.grad`` (:class:`ZeroGradHook`);
  ``state_dict()`` during the run gives the committed values and ``load_state_dict()`` of block parameters is refused
  (:class:`BlockValuesHook`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk import DiskStore, DiskTierError, checkpoint_folder, preflight
from lightning_superpipe.memory.disk.folder import map_committed_masters
from lightning_superpipe.memory.disk_budget import check_disk_host_room, disk_host_bytes
from lightning_superpipe.memory.disk_homes import READ_AHEAD, DiskHome, DiskTier
from lightning_superpipe.streaming.optimizers import (
    REGISTER_HINT,
    has_step_hooks,
    per_parameter_optimizer_names,
    updates_each_parameter_alone,
)
from lightning_superpipe.streaming.wrappers import BeforeCalls

if TYPE_CHECKING:
    from lightning_superpipe.streaming.engine import StreamingEngine

#: Where a checkpoint keeps the disk tier's manifest.
DISK_KEY = "superpipe_disk_tier"
#: The key, in a checkpoint's manifest, of the subfolder beside the ``.ckpt`` that holds that save's files.
SNAPSHOT_KEY = "snapshot"
#: The key, in a checkpoint's manifest, of the frozen packed weights' names (not in the ``.ckpt``, nor in the files).
FROZEN_KEY = "frozen"

__all__ = [  # the tier itself is a kind of home (memory/); what Lightning sees of it is here
    "DISK_KEY",
    "READ_AHEAD",
    "SNAPSHOT_KEY",
    "BlockValuesHook",
    "DiskHome",
    "DiskTier",
    "ZeroGradHook",
    "add_to_checkpoint",
    "check_optimizer_state",
    "check_training",
    "checkpoint_block_values",
    "checkpoint_saved",
    "check_disk_host_room",
    "disk_host_bytes",
    "disk_tier_of",
    "load_state_dict",
    "rank_folder",
    "remove_snapshot",
    "resume_folder",
]


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


def weight_averaging_callbacks(trainer: Any) -> list[Any]:
    """The trainer's callbacks that keep an average of the weights and swap it into the parameters
    (``EMAWeightAveraging``, any ``WeightAveraging``, ``StochasticWeightAveraging``)."""
    from lightning.pytorch import callbacks

    # WeightAveraging (and EMAWeightAveraging) came with Lightning 2.6.
    names = ("WeightAveraging", "StochasticWeightAveraging")
    kinds = tuple(getattr(callbacks, name) for name in names if hasattr(callbacks, name))
    return [c for c in trainer.callbacks if isinstance(c, kinds)]


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


def _modules_holding(model: nn.Module, tier: DiskTier) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Each module of ``model`` that holds block parameters (its own or its submodules'), with them by name in it."""
    held = [(m, [(n, p) for n, p in m.named_parameters() if p in tier._place]) for m in model.modules()]
    return [(module, params) for module, params in held if params]


class ZeroGradHook(BeforeCalls):
    """Tells the tier when the user zeroes gradients, which it must know because a block's gradients are in its
    files, not in ``.grad``: before ``zero_grad`` of the optimizer, of Lightning's wrapper of it, and of every module
    holding block parameters (the LightningModule's ``self.zero_grad()``), :meth:`DiskTier.zero_grad` hears which
    block parameters it zeroes.
    """

    def __init__(self, tier: DiskTier, model: nn.Module, optimizers: Sequence[Any]) -> None:
        # An optimizer's groups are read at each call: BaseFinetuning adds the blocks' group mid-run.
        targets: list[tuple[Any, str, Callable[[], None]]] = [
            (o, "zero_grad", lambda o=o: tier.zero_grad(p for group in o.param_groups for p in group["params"]))
            for o in optimizers
        ]
        for module, held in _modules_holding(model, tier):
            params = [p for _, p in held]
            targets.append((module, "zero_grad", lambda params=params: tier.zero_grad(params)))
        super().__init__(targets)


class BlockValuesHook:
    """``state_dict()`` and ``load_state_dict()`` during the run, where the block parameters hold placeholders: a
    state dict gets each block's committed masters, mapped copy-on-write from its file (no host memory until read;
    the store writes that slot into a new file from then on, so the values stay those of the step the state dict
    was taken at), and a load that would write block parameters is refused before anything is loaded (the tier's
    files are the weights; loading into placeholders would fail deep inside torch, or be lost).

    Hooks every module holding block parameters: the state-dict hook on their owners, the load pre-hook on every
    module above them too, so that a load is refused at the module it was called on.
    """

    def __init__(self, tier: DiskTier, model: nn.Module) -> None:
        self._tier = tier
        self._owners = [(m, [(n, p) for n, p in m._parameters.items() if p in tier._place]) for m in model.modules()]
        self._owners = [(m, owned) for m, owned in self._owners if owned]
        self._holders = [(m, [n for n, _ in held]) for m, held in _modules_holding(model, tier)]
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        for module, owned in self._owners:
            self._handles.append(module.register_state_dict_post_hook(partial(self._committed, owned)))
        for module, names in self._holders:
            self._handles.append(module.register_load_state_dict_pre_hook(partial(self._refuse_load, names)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _committed(self, owned: list[tuple[str, nn.Parameter]], module: nn.Module, state_dict: dict[str, Any],
                   prefix: str, local_metadata: Any) -> None:
        if self._tier.checkpointing:
            return
        for name, param in owned:
            key = prefix + name
            if key in state_dict and state_dict[key] is not param:  # keep_vars=True asks for the parameter itself
                state_dict[key] = self._tier.committed_master(param)

    def _refuse_load(self, names: list[str], module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                     *args: Any) -> None:
        loaded = next((prefix + name for name in names if prefix + name in state_dict), None)
        if loaded is not None:
            raise RuntimeError(
                f"SuperpipeStrategy(offload_device='disk'): load_state_dict during the run would write {loaded!r}, a"
                " parameter whose values are in the tier's files (the parameter holds a placeholder). Load"
                " the weights before fit (or resume with trainer.fit(..., ckpt_path=...)), or after it, or use"
                " offload_device='cpu'. Nothing was loaded."
            )


def disk_tier_of(engine: Optional[StreamingEngine]) -> Optional[DiskTier]:
    """The engine's disk tier, or ``None`` (no engine, or homes of another kind)."""
    kind = engine.home_kind if engine is not None else None
    return kind if isinstance(kind, DiskTier) else None


def check_optimizer_state(tier: DiskTier, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Refuses optimizer state for block parameters from a checkpoint of the host tier: loaded into the
    optimizer it would be dropped at the first step, which reads the blocks' state from the files.

    Raises:
        MisconfigurationException: Saying how to resume such a checkpoint.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(int(i) < len(params) and tier.holds(params[int(i)]) for i in state.get("state", {})):
        raise MisconfigurationException(
            "This checkpoint was written with offload_device='cpu': it holds the blocks' optimizer state, which the"
            " disk tier keeps in its files and cannot take from a .ckpt yet. Resume it with offload_device='cpu',"
            " or load only its weights (e.g. `model.load_state_dict(ckpt['state_dict'])`) and start a new run."
        )

def add_to_checkpoint(tier: DiskTier, checkpoint: dict[str, Any], ckpt_path: Union[str, os.PathLike[str]]) -> None:
    """Hard-links (or copies) the committed files into a new subfolder of the folder beside ``ckpt_path`` and
    puts the manifest, with the subfolder's name, in ``checkpoint``, whose state dict loses the block parameters'
    placeholders (their values are in the files). Nothing of the blocks is materialized in memory.

    The subfolder is new for every save, so a ``.ckpt`` saved again under the same name (``last.ckpt``) keeps
    its previous copy until the new ``.ckpt`` is written: a kill while the files are linked, or before the
    ``.ckpt`` is renamed into place, leaves the old ``.ckpt`` with the files it names. :func:`checkpoint_saved`
    removes the older subfolders once the new ``.ckpt`` is on disk.
    """
    folder = checkpoint_folder(ckpt_path)
    name = f"step-{tier.store.step_count:09d}-{time.time_ns():x}"
    manifest = tier.store.snapshot(folder / name)
    checkpoint[DISK_KEY] = {**manifest, SNAPSHOT_KEY: name, FROZEN_KEY: sorted(tier.frozen_names)}
    state = checkpoint.get("state_dict")
    if state is not None:  # nor the frozen 4-bit base, nor its quantization state: the run writes them at set-up
        frozen = tuple(f"{name}." for name in tier.frozen_names)
        checkpoint["state_dict"] = type(state)((k, v) for k, v in state.items()
                                               if k not in tier.state_names and not k.startswith(frozen))

def checkpoint_saved(checkpoint: Mapping[str, Any], ckpt_path: Union[str, os.PathLike[str]]) -> None:
    """After the ``.ckpt`` is written: removes the other subfolders beside it (older saves under the same name,
    or what a killed save left); the live files are untouched (hard links)."""
    name = checkpoint.get(DISK_KEY, {}).get(SNAPSHOT_KEY)
    folder = checkpoint_folder(ckpt_path)
    if name is None or not folder.is_dir() or folder.is_symlink():
        return
    for entry in folder.iterdir():
        if entry.name != name and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.name != name and entry.name.startswith(("block", "manifest")):
            entry.unlink()  # the files of a single-folder copy (before snapshots had subfolders)


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


def resume_folder(ckpt_path: Union[str, os.PathLike[str]], manifest: Mapping[str, Any], offload_device: str) -> Path:
    """The folder of the disk tier's files of the checkpoint ``ckpt_path`` (through a symlinked ``last.ckpt`` too).

    Raises:
        MisconfigurationException: The strategy does not use the disk tier.
        DiskTierError: The folder is missing or holds another step than the checkpoint's.
    """
    if offload_device != "disk":
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        raise MisconfigurationException(
            f"The checkpoint {os.fspath(ckpt_path)!r} was written by SuperpipeStrategy(offload_device='disk'): its"
            " blocks are in the files beside it. Resume it with offload_device='disk' (and an offload_path)."
        )
    folder = checkpoint_folder(ckpt_path)
    if not folder.is_dir():
        folder = checkpoint_folder(os.path.realpath(ckpt_path))
    name = manifest.get(SNAPSHOT_KEY)
    if name is not None:
        folder = folder / name
    if not (folder / "manifest.json").is_file():
        raise DiskTierError(
            f"The checkpoint {os.fspath(ckpt_path)!r} was written by the disk tier, whose files belong in"
            f" {str(checkpoint_folder(ckpt_path))!r}{'' if name is None else f' (its subfolder {name!r})'}, which is"
            " missing or incomplete. Copy that folder beside the .ckpt (it travels with it)."
        )
    found = json.loads((folder / "manifest.json").read_text())
    if found.get("step") != manifest.get("step") or found.get("names") != manifest.get("names"):
        raise DiskTierError(
            f"{str(folder)!r} holds the disk tier at step {found.get('step')}, but the checkpoint"
            f" {os.fspath(ckpt_path)!r} was saved at step {manifest.get('step')}: they do not belong together."
        )
    return folder


def checkpoint_block_values(ckpt_path: Union[str, os.PathLike[str]], manifest: Mapping[str, Any]) -> dict[str, Tensor]:
    """The block parameters' values of the disk-tier checkpoint ``ckpt_path`` (whose manifest is ``manifest``), by
    name, mapped copy-on-write from the files beside it (no host memory until read): its weights without a resume.

    Raises:
        DiskTierError: The files are missing, incomplete, or of another step.
    """
    return map_committed_masters(resume_folder(ckpt_path, manifest, "disk"))


def remove_snapshot(ckpt_path: Union[str, os.PathLike[str]]) -> None:
    """Removes the disk tier's folder of a checkpoint being removed (hard links: the live files stay)."""
    folder = checkpoint_folder(ckpt_path)
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)


def load_state_dict(module: nn.Module, checkpoint: Mapping[str, Any], strict: bool, streaming: bool) -> None:
    """Loads a disk-tier checkpoint's state dict, which lacks the block parameters (they are restored from the
    checkpoint's folder when streaming starts).

    Raises:
        RuntimeError: The tier is already streaming (a checkpoint is loaded before ``fit`` starts streaming), or, with
            ``strict``, keys other than the blocks' are missing or unexpected.
    """
    if streaming:
        raise RuntimeError(
            "A disk-tier checkpoint can be loaded only when a run starts (`Trainer.fit(ckpt_path=...)`), not while the"
            " blocks stream."
        )
    blocks = {name for block in checkpoint[DISK_KEY]["names"] for name in block}
    blocks.update(checkpoint[DISK_KEY].get(FROZEN_KEY, []))  # a 4-bit base: written again from the model at set-up
    # A tied alias of a parameter in the files (a head tied to an embedding there) is missing too.
    named = dict(module.named_parameters(remove_duplicate=False))
    in_files = {id(named[name]) for name in blocks if name in named}
    missing, unexpected = module.load_state_dict(checkpoint["state_dict"], strict=False)
    missing = [key for key in missing if key not in blocks and id(named.get(key)) not in in_files]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the state dict of {type(module).__name__}: missing keys {missing[:5]}, unexpected"
            f" keys {list(unexpected)[:5]} (the blocks' parameters come from the disk tier's files)."
        )
