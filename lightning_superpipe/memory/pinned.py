"""Host buffers for a run, page-aligned and exactly sized, page-locked with ``cudaHostRegister``.

Every ``pin_memory()`` goes through PyTorch's caching host allocator, which rounds each allocation up to a power of
two (+23% for the fp32 master of a Llama-3-8B block, up to +100%), keeps it after it is freed, and is invisible to a
host-memory check, so page-locked memory can run the host out of RAM after the check passed. The arena instead
allocates what each buffer needs, rounded to pages only, in chunks it registers with CUDA itself (one per block's
home, so re-homing a model holds one block twice at most, never the whole model), counts every byte, reports
progress on large chunks (pinning hundreds of GB takes minutes), and unregisters them on :meth:`HostArena.close`.
Without pinning (a CPU compute device) the same layout is used, unregistered.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: Every buffer starts on a page: kernels see the alignment separately allocated tensors have, and the disk tier
#: can read into them with ``O_DIRECT``.
PAGE = 4096
#: Register with CUDA in pieces of this size, to report progress on large arenas.
_REGISTER_PIECE = 1 << 30
#: Report progress for arenas larger than this.
_PROGRESS_FROM = 8 << 30


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
    def pinned_bytes(self) -> int:
        """Page-locked host bytes (0 without pinning)."""
        return sum(chunk.numel() for chunk in self._registered)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A page-aligned, uninitialised 1-D buffer of ``numel`` elements."""
        nbytes = numel * dtype.itemsize
        rounded = page_rounded(max(nbytes, 1))
        if self._free is None or self._free.numel() < rounded:
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


def _check(status: object, call: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(
            f"SuperpipeStrategy: {call} failed with CUDA error {code}; the host may lack the memory to page-lock"
            " (see `ulimit -l` and free memory), or the driver refused the range."
        )
