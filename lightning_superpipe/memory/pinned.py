"""Host buffers for a run, page-aligned and exactly sized, page-locked with ``cudaHostRegister``.

Every ``pin_memory()`` goes through PyTorch's caching host allocator, which rounds each allocation up to a power of
two (+23% for the fp32 master of a Llama-3-8B block, up to +100%), keeps it after it is freed, and is invisible to a
host-memory check, so page-locked memory can run the host out of RAM after the check passed. The arena instead
allocates what each buffer needs, rounded to pages only, in chunks it registers with CUDA itself (one per block's
home, so re-homing a model holds one block twice at most, never the whole model), counts every byte, reports
progress on large chunks (pinning hundreds of GB takes minutes), and unregisters them on :meth:`HostArena.close`.
Without pinning (a CPU compute device) the same layout is used, unregistered.

:meth:`HostArena.shared` hands out buffers that every rank of a node maps from one file in ``/dev/shm``
(``shard_optimizer="node"``): the node's local rank 0 creates the file and writes the buffers' first values, the other
ranks map it (``MAP_SHARED``, page-aligned) and only read; the file is unlinked as soon as every rank has mapped it,
so the memory goes when the last process lets go of it, also after a crash. Each rank registers its own mapping for
pinned copies.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_superpipe.host_memory import HostMemoryError
from lightning_superpipe.units import format_bytes

log = logging.getLogger(__name__)

#: Every buffer starts on a page: kernels see the alignment separately allocated tensors have, and the disk tier
#: can read into them with ``O_DIRECT``.
PAGE = 4096
#: Register with CUDA in pieces of this size, to report progress on large arenas.
_REGISTER_PIECE = 1 << 30
#: Report progress for arenas larger than this.
_PROGRESS_FROM = 8 << 30


#: Where the node's shared copy lives: a RAM-backed file system every local process can map.
SHARED_MEMORY_DIR = "/dev/shm"


class NodeRanks(Protocol):
    """The ranks of one node that map a shared region (a :class:`.distributed.NodeShare`)."""

    local_rank: int
    call: str

    def agree(self, error: Optional[BaseException], payload: Any = None) -> list[Any]:
        """Exchanges ``payload`` between the node's ranks; raises on every one of them if ``error`` is set on any."""
        ...


def caching_allocator_bytes(nbytes: int) -> int:
    """What PyTorch's caching host allocator (``pin_memory()``) reserves for a request of ``nbytes``: the next
    power of two."""
    return 1 << max(0, (nbytes - 1).bit_length())


def page_rounded(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class HostArena:
    """Hands out page-aligned host buffers from a few large allocations, page-locked when ``pin`` is set.

    Args:
        pin: Page-lock the chunks with ``cudaHostRegister`` (a CUDA compute device).
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.requested_bytes = 0  # what the buffers handed out asked for
        self._chunks: list[Tensor] = []
        self._registered: list[Tensor] = []
        self._free: Optional[Tensor] = None  # the unused tail of the newest chunk
        self._shared: list[Tensor] = []  # chunks mapped from a file every rank of the node maps
        self._sharing = False  # inside shared(): buffers come from the shared chunk only
        #: Whether this process writes the buffers handed out now (``False`` inside :meth:`shared` on the ranks that
        #: map what local rank 0 writes).
        self.writable = True

    def reserve(self, nbytes: int) -> None:
        """Starts a chunk of ``nbytes`` for the buffers that follow (e.g. the many small ones of the trunk), so they
        share one registration instead of one each."""
        if nbytes > 0:
            self._grow(page_rounded(nbytes))

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the chunks hold (what the buffers asked for, rounded to pages, plus any unused tail)."""
        return sum(chunk.numel() for chunk in self._chunks)

    @property
    def shared_bytes(self) -> int:
        """Host bytes of the chunks shared with the node's other ranks (counted once per node, not per rank)."""
        return sum(chunk.numel() for chunk in self._shared)

    @contextmanager
    def shared(self, nbytes: int, node: NodeRanks) -> Generator[None, None, None]:
        """Inside, :meth:`empty` hands out ``nbytes`` (page-rounded) from one region that every rank of ``node`` maps.

        Local rank 0 creates it as a file in ``/dev/shm`` and writes the buffers' values inside (:attr:`writable`);
        the other ranks map the same pages and write nothing. On leaving, every rank of the node has seen the
        values written; the file is already unlinked (the mappings keep the memory). Each step ends with an
        agreement of the node's ranks, so a failure on any rank is an error on all of them, not a hang.

        Raises:
            HostMemoryError: ``/dev/shm`` has less free space than the region needs (from
                :mod:`lightning_superpipe.memory.host`, quoting ``node.call``).
        """
        nbytes = page_rounded(max(nbytes, 1))
        writer = node.local_rank == 0
        path: Optional[str] = None
        chunk: Optional[Tensor] = None
        error: Optional[BaseException] = None
        try:  # local rank 0 creates the file (it writes the values, and pins its mapping first as _grow does)
            if writer:
                _check_shared_space(nbytes, node.call)
                path = os.path.join(SHARED_MEMORY_DIR, f"superpipe-{os.getpid()}-{uuid.uuid4().hex}")
                chunk = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                if self.pin:
                    self._register(chunk)
        except Exception as caught:  # noqa: BLE001 - raised on every rank by the agreement below
            error = caught
        try:
            path = node.agree(error, path)[0]
            error = None
            if not writer:  # the others map the same pages
                chunk = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except Exception as caught:  # noqa: BLE001
            error = caught
        finally:
            try:
                node.agree(error)
            finally:  # every rank mapped it (or gave up): the name goes, the pages stay while mapped
                if writer and path is not None and os.path.exists(path):
                    os.unlink(path)
        assert chunk is not None
        self._chunks.append(chunk)
        self._shared.append(chunk)
        previous, self._free = self._free, chunk
        self.writable, self._sharing = writer, True
        error = None
        try:
            yield
        except Exception as caught:  # noqa: BLE001
            error = caught
        finally:
            self.writable, self._sharing = True, False
            self._free = previous  # what follows is this process's own again
        node.agree(error)  # local rank 0 wrote every value; the others may read them now
        if self.pin and not writer:  # the pages exist (written by rank 0): registering them touches nothing
            _check(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), 0), "cudaHostRegister")
            self._registered.append(chunk)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes (0 without pinning)."""
        return sum(chunk.numel() for chunk in self._registered)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A page-aligned, uninitialised 1-D buffer of ``numel`` elements."""
        nbytes = numel * dtype.itemsize
        rounded = page_rounded(max(nbytes, 1))
        if self._free is None or self._free.numel() < rounded:
            if self._sharing:  # a rank that maps the region would read a private buffer nobody wrote
                raise RuntimeError(f"SuperpipeStrategy: the node's shared host region is {rounded} bytes too small.")
            self._grow(rounded)
        assert self._free is not None
        piece, self._free = self._free[:rounded], self._free[rounded:]
        self.requested_bytes += nbytes
        return piece[:nbytes].view(dtype)

    def close(self) -> None:
        """Page-unlocks the arenas. Buffers stay valid (parameters keep living in them) but become pageable."""
        for chunk in self._registered:
            _check(torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr()), "cudaHostUnregister")
        self._registered = []

    def _grow(self, nbytes: int) -> None:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        chunk = raw[start : start + nbytes]
        if self.pin:
            self._register(chunk)
        self._chunks.append(chunk)
        self._free = chunk

    def _register(self, chunk: Tensor) -> None:
        total = chunk.numel()
        report = total >= _PROGRESS_FROM
        if report:
            log.warning("SuperpipeStrategy: page-locking %.1f GiB of host memory (takes a while)...", total / 2**30)
        cudart = torch.cuda.cudart()
        # One registration for the chunk (unregistered with one call), preceded by touching it piece by piece so
        # that the cost shows as progress: registering faults in every page.
        for offset in range(0, total, _REGISTER_PIECE):
            chunk[offset : offset + _REGISTER_PIECE].zero_()
            if report:
                done = min(total, offset + _REGISTER_PIECE)
                log.warning("SuperpipeStrategy: page-locking %3.0f%%", 100 * done / total)
        _check(cudart.cudaHostRegister(chunk.data_ptr(), total, 0), "cudaHostRegister")
        self._registered.append(chunk)


def shared_space() -> Optional[int]:
    """Free bytes in ``/dev/shm``, or ``None`` where there is no such file system."""
    try:
        stats = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _check_shared_space(nbytes: int, call: str) -> None:
    """Refuses a shared region that ``/dev/shm`` cannot hold: writing past its end would kill the process (SIGBUS)."""

    free = shared_space()
    if free is None:
        raise HostMemoryError(f"{call} keeps one copy of the blocks per node in {SHARED_MEMORY_DIR}, which this"
                              " machine does not have; use `shard_optimizer=True` instead.")
    if nbytes > free:
        raise HostMemoryError(
            f"{call} needs {format_bytes(nbytes)} ({nbytes} bytes) of {SHARED_MEMORY_DIR} for the node's shared copy"
            f" of the blocks but only {format_bytes(free)} ({free} bytes) is free. Enlarge it (e.g. `docker run"
            " --shm-size=...`, or `mount -o remount,size=... /dev/shm`), or use `shard_optimizer=True`."
        )


def _check(status: object, call: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(
            f"SuperpipeStrategy: {call} failed with CUDA error {code}; the host may lack the memory to page-lock"
            " (see `ulimit -l` and free memory), or the driver refused the range."
        )
