"""Checks of the tier's folder and of the process before training: free space, write access, ``O_DIRECT``, and
glibc's heap retention."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Union

from lightning_superpipe.memory.disk.buffers import _aligned_buffer, _byte_view
from lightning_superpipe.memory.disk.errors import DiskSpaceError, DiskTierError
from lightning_superpipe.memory.pinned import PAGE
from lightning_superpipe.units import format_bytes

#: Room kept free beyond the tier's files for manifests and file-system overhead.
_MARGIN_BYTES = 16 << 20

PathLike = Union[str, "os.PathLike[str]"]


def free_bytes(path: PathLike) -> int:
    """Bytes an unprivileged writer may still allocate on the file system holding ``path``."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def preflight(path: PathLike, needed_bytes: int, what: str = "two slots of every block's record") -> None:
    """Checks before training that ``path`` exists, is a writable folder and has ``needed_bytes`` free.

    Raises:
        DiskTierError: The folder is missing or not writable.
        DiskSpaceError: It has less than ``needed_bytes`` (plus a small margin) free.
    """
    folder = Path(path)
    if not folder.is_dir():
        # Callers that check the folder before the tier's size is known pass 0 bytes: name what it will hold instead.
        room = f"at least {format_bytes(needed_bytes)} free" if needed_bytes > 0 else f"room for {what}"
        if folder.exists():
            raise DiskTierError(
                f"The disk tier's offload_path {str(folder)!r} is not a folder. Pass a folder on a fast local disk"
                f" with {room} as offload_path."
            )
        raise DiskTierError(
            f"The disk tier's offload_path {str(folder)!r} does not exist: the folder is missing. Create it (e.g."
            f" `mkdir -p {folder}`) on a fast local disk with {room}, or pass another offload_path."
        )
    probe = folder / f".superpipe-write-probe-{os.getpid()}"  # several ranks may probe one folder
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"superpipe")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise DiskTierError(
            f"The disk tier's offload_path {str(folder)!r} is not writable ({error.strerror or error}). Give this"
            " process write access to it or pass another offload_path."
        ) from error
    available = free_bytes(folder)
    if needed_bytes + _MARGIN_BYTES > available:
        raise DiskSpaceError(
            f"The disk tier needs {format_bytes(needed_bytes)} ({needed_bytes} bytes: {what}) and"
            f" {format_bytes(_MARGIN_BYTES)} of room in offload_path {str(folder)!r}, but only"
            f" {format_bytes(available)} ({available} bytes) are free there. Free space, or point offload_path at a"
            " larger disk."
        )


def supports_direct_io(path: PathLike) -> bool:
    """Whether files in the folder ``path`` accept ``O_DIRECT`` reads and writes of page-aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(path) / f".superpipe-direct-probe-{os.getpid()}"
    buffer = _aligned_buffer(PAGE)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False  # e.g. tmpfs before Linux 6.6: EINVAL at open
    try:
        view = _byte_view(buffer, PAGE)
        os.pwritev(fd, [view], 0)
        os.preadv(fd, [view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def limit_heap_retention(threshold_bytes: int = 1 << 20) -> bool:
    """Makes glibc return freed allocations of ``threshold_bytes`` or more to the system at once.

    glibc raises its ``mmap`` threshold dynamically up to 32 MiB, after which freed tensors below that size stay in
    the heap: measured here, streaming blocks of 32 MiB tensors through the tier kept 250-800 MB resident beyond the
    pool (the optimizer's first-step state, gradients the caller made and dropped). A fixed threshold keeps RSS at
    the pool's size; it costs a page fault per page of each large allocation made afterwards. Process-wide: the
    strategy calls it when it builds a disk tier. Returns whether it applied (``False`` off glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # M_MMAP_THRESHOLD in malloc.h
    return bool(mallopt(m_mmap_threshold, int(threshold_bytes)))
