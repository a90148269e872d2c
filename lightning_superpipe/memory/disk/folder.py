"""The tier's folder: its files' names, the manifest that names the committed step, the manifest's atomic and
durable commit, and the hard links that copy a committed step into a checkpoint's folder.

A step writes every stepped block to its *other* slot and ``fsync``s it, then writes the manifest to a temporary
name, ``fsync``s it, renames it over the old one and ``fsync``s the folder: a kill at any moment leaves the folder at
the previous step or the new one, never a mix."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.file_io import CHUNK_BYTES, _check_length, _fsync_dir, _io_error
from lightning_superpipe.memory.disk.records import Record
from lightning_superpipe.memory.disk.space import PathLike

FORMAT = "superpipe-disk-tier"
VERSION = 1
MANIFEST = "manifest.json"


def checkpoint_folder(ckpt_path: PathLike) -> Path:
    """The folder beside a ``.ckpt`` that holds the disk tier's files of that checkpoint."""
    return Path(f"{os.fspath(ckpt_path)}.disk-tier")


def _slot_name(index: int, slot: int) -> str:
    return f"block{index:05d}.{slot}.bin"


def _grad_name(index: int) -> str:
    return f"grad{index:05d}.bin"


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DiskTierError(
            f"{str(folder)!r} holds no committed disk tier ({MANIFEST} is missing): nothing to open. Create one with"
            " DiskStore.create, or restore a checkpoint's copy with DiskStore.restore."
        ) from error
    except (OSError, ValueError) as error:
        raise DiskTierError(f"The disk tier's manifest {str(path)!r} cannot be read: {error}.") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DiskTierError(f"{str(path)!r} is not a version-{VERSION} superpipe disk tier manifest.")
    return manifest


def _check_manifest(folder: Path, manifest: Mapping[str, Any], blocks: Sequence[Mapping[str, nn.Parameter]]) -> None:
    """Raises :class:`DiskTierError` unless the manifest describes ``blocks`` and its committed files are whole."""
    names = [list(b) for b in blocks]
    if manifest["names"] != names:
        raise DiskTierError(
            f"The disk tier in {str(folder)!r} was written for other blocks ({len(manifest['names'])} blocks, first"
            f" names {manifest['names'][0][:2] if manifest['names'] else []}) than the model's ({len(names)} blocks,"
            f" {names[0][:2] if names else []}). Open it with the model it was written for."
        )
    for index, (block, data) in enumerate(zip(blocks, manifest["blocks"])):
        record = Record.from_json(data)
        params = list(block.values())
        for entry in record.masters():
            param = params[entry.param]
            if tuple(param.shape) != entry.shape or param.dtype != entry.dtype:
                raise DiskTierError(
                    f"{names[index][entry.param]} is {tuple(param.shape)} {param.dtype} in the model but"
                    f" {entry.shape} {entry.dtype} in the disk tier in {str(folder)!r}."
                )
        path = folder / _slot_name(index, record.slot)
        try:
            size = path.stat().st_size
        except FileNotFoundError as error:
            raise DiskTierError(
                f"The disk tier's file {str(path)!r} (block {index} of committed step {manifest['step']}) is missing."
                " Restore the folder from a checkpoint's copy (DiskStore.restore)."
            ) from error
        _check_length(path, size, record.file_bytes)


def map_committed_masters(path: PathLike) -> dict[str, Tensor]:
    """The masters of the step committed in the folder ``path`` (a tier's, or a checkpoint's copy of one) by name, as
    copy-on-write views of its files (a private ``mmap``: no host memory until read, never written to the files).

    Raises:
        DiskTierError: No committed manifest, or a missing or truncated file.
    """
    folder = Path(path)
    manifest = _read_manifest(folder)
    masters: dict[str, Tensor] = {}
    for index, (names, data) in enumerate(zip(manifest["names"], manifest["blocks"])):
        record = Record.from_json(data)
        file = folder / _slot_name(index, record.slot)
        if not file.is_file():
            raise DiskTierError(
                f"The disk tier's file {str(file)!r} (block {index} of the step committed in {str(folder)!r}) is"
                " missing: the folder is incomplete. Copy it whole from where it was written."
            )
        _check_length(file, file.stat().st_size, record.file_bytes)
        mapped = torch.from_file(str(file), shared=False, size=record.file_bytes, dtype=torch.uint8)
        masters.update({names[entry.param]: entry.view_of(mapped) for entry in record.masters()})
    return masters


def _replace(source: Path, target: Path) -> None:
    os.replace(source, target)


def _commit(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Makes ``manifest`` the folder's committed step, atomically and durably."""
    _fsync_dir(folder)  # the directory entries of files created by this step first
    temporary = folder / (MANIFEST + ".tmp")
    path = folder / MANIFEST
    try:
        with open(temporary, "w") as out:
            json.dump(manifest, out)
            out.flush()
            os.fsync(out.fileno())
        _replace(temporary, path)
        _fsync_dir(folder)
    except OSError as error:
        raise _io_error("committing", path, error) from error


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
        return
    except FileNotFoundError as error:
        raise DiskTierError(f"The disk tier's file {str(source)!r} is missing; it cannot be copied.") from error
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise _io_error("linking", target, error) from error
    try:  # another file system: copy, durably
        with open(source, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK_BYTES)
            dst.flush()
            os.fsync(dst.fileno())
            os.posix_fadvise(dst.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as error:
        target.unlink(missing_ok=True)
        raise _io_error("copying", target, error) from error
