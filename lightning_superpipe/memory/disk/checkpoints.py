"""The disk tier's files beside each ``.ckpt``: what a checkpoint holds of the tier, and how a resume finds it.

The ``.ckpt`` holds the store's manifest; the committed files are hard-linked (or copied) into a new subfolder of
:func:`~lightning_superpipe.memory.disk.checkpoint_folder` beside it, named in the manifest, and a resume restores
them from there. Older subfolders go once the new ``.ckpt`` is written, so a kill during a save leaves the previous
``.ckpt`` with its files. The live files never write into a copy: a slot hard-linked into a checkpoint is replaced by
a new file before it is written again (:class:`~lightning_superpipe.memory.disk.DiskStore`). On several ranks, rank
0's files go beside the ``.ckpt`` (every rank's are alike).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.folder import checkpoint_folder, map_committed_masters
from lightning_superpipe.memory.disk.store import DiskStore

#: Where a checkpoint keeps the disk tier's manifest.
DISK_KEY = "superpipe_disk_tier"
#: The key, in a checkpoint's manifest, of the subfolder beside the ``.ckpt`` that holds that save's files.
SNAPSHOT_KEY = "snapshot"
#: The key, in a checkpoint's manifest, of the frozen packed weights' names (not in the ``.ckpt``, nor in the files).
FROZEN_KEY = "frozen"


def add_to_checkpoint(store: DiskStore, frozen_names: set[str], state_names: set[str], checkpoint: dict[str, Any],
                      ckpt_path: Union[str, os.PathLike[str]]) -> None:
    """Hard-links (or copies) the committed files into a new subfolder of the folder beside ``ckpt_path`` and
    puts the manifest, with the subfolder's name, in ``checkpoint``, whose state dict loses the entries of the
    parameters in the ``store`` (``state_names``; their values are in the files) and of the frozen packed weights
    (``frozen_names``, written again at set-up). Nothing of the blocks is materialized in memory.

    The subfolder is new for every save, so a ``.ckpt`` saved again under the same name (``last.ckpt``) keeps
    its previous copy until the new ``.ckpt`` is written: a kill while the files are linked, or before the
    ``.ckpt`` is renamed into place, leaves the old ``.ckpt`` with the files it names. :func:`checkpoint_saved`
    removes the older subfolders once the new ``.ckpt`` is on disk.
    """
    folder = checkpoint_folder(ckpt_path)
    name = f"step-{store.step_count:09d}-{time.time_ns():x}"
    manifest = store.snapshot(folder / name)
    checkpoint[DISK_KEY] = {**manifest, SNAPSHOT_KEY: name, FROZEN_KEY: sorted(frozen_names)}
    state = checkpoint.get("state_dict")
    if state is not None:  # nor the frozen 4-bit base, nor its quantization state: the run writes them at set-up
        frozen = tuple(f"{name}." for name in frozen_names)
        checkpoint["state_dict"] = type(state)((k, v) for k, v in state.items()
                                               if k not in state_names and not k.startswith(frozen))


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


def resume_folder(ckpt_path: Union[str, os.PathLike[str]], manifest: Mapping[str, Any]) -> Path:
    """The folder of the disk tier's files of the checkpoint ``ckpt_path`` (through a symlinked ``last.ckpt`` too).

    Raises:
        DiskTierError: The folder is missing or holds another step than the checkpoint's.
    """
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
    return map_committed_masters(resume_folder(ckpt_path, manifest))


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


def refuse_host_optimizer_state(holds: Callable[[nn.Parameter], bool], optimizer: Optimizer,
                                state: Mapping[str, Any]) -> None:
    """Refuses optimizer state for block parameters from a checkpoint of the host tier: loaded into the
    optimizer it would be dropped at the first step, which reads the blocks' state from the files (``holds``: whether
    a parameter is a block parameter of the tier).

    Raises:
        MisconfigurationException: Saying how to resume such a checkpoint.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(int(i) < len(params) and holds(params[int(i)]) for i in state.get("state", {})):
        raise MisconfigurationException(
            "This checkpoint was written with offload_device='cpu': it holds the blocks' optimizer state, which the"
            " disk tier keeps in its files and cannot take from a .ckpt yet. Resume it with offload_device='cpu',"
            " or load only its weights (e.g. `model.load_state_dict(ckpt['state_dict'])`) and start a new run."
        )
