"""Page-aligned host buffers: the bounded pool the tier's reads and writes go through, and views of them that
``preadv``/``pwritev`` fill."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Optional

import torch
from torch import Tensor

from lightning_superpipe.memory.disk.clock import IoClock
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.pinned import PAGE, HostArena, page_rounded
from lightning_superpipe.units import format_bytes

#: A wait for a free buffer longer than this means a caller holds too many (I/O itself takes far less).
ACQUIRE_TIMEOUT_S = 300.0


def _aligned_buffer(nbytes: int) -> Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + nbytes]


def _byte_view(buffer: Tensor, nbytes: int, start: int = 0) -> memoryview:
    """A writable memoryview of ``nbytes`` of the uint8 CPU ``buffer`` from ``start`` (what ``preadv`` fills)."""
    if start + nbytes > buffer.numel():
        raise ValueError(f"A view of {nbytes} bytes at {start} exceeds a buffer of {buffer.numel()} bytes.")
    array = (ctypes.c_char * nbytes).from_address(buffer.data_ptr() + start)
    return memoryview(array).cast("B")


class BufferPool:
    """A bounded set of equal page-aligned host buffers (page-locked with CUDA), handed out and returned.

    Args:
        buffer_bytes: Size of each buffer (rounded up to pages).
        count: How many buffers the pool holds at most.
        pin: Page-lock the buffers with ``cudaHostRegister`` (a CUDA compute device).
        bounded: Whether ``count * buffer_bytes`` is a user's bound: then a record larger than a buffer is an error,
            otherwise buffers grow to fit it.
        clock: Counts the time callers wait for a free buffer (``pool_wait``).
    """

    def __init__(self, buffer_bytes: int, count: int, pin: bool, bounded: bool,
                 clock: Optional[IoClock] = None) -> None:
        if count < 1:
            raise ValueError("A buffer pool needs at least one buffer.")
        self.buffer_bytes = page_rounded(max(buffer_bytes, 1))
        self.count = count
        self.pin = pin
        self.bounded = bounded
        self._free: list[tuple[Tensor, HostArena]] = []
        self._allocated = 0
        #: The most host bytes the pool's buffers held at once.
        self.peak_bytes = 0
        self._owners: dict[int, HostArena] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._clock = clock

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the pool's buffers hold now."""
        with self._cond:
            return self._allocated * self.buffer_bytes

    def acquire(self, nbytes: int) -> Tensor:
        """A free buffer of at least ``nbytes`` (uint8), waiting for one to be released if all are in use."""
        with self._cond:
            if nbytes > self.buffer_bytes:
                if self.bounded:
                    raise DiskTierError(
                        f"A block's record needs {format_bytes(nbytes)} but host_buffer_bytes allows buffers of"
                        f" {format_bytes(self.buffer_bytes)} ({self.count} of them); raise host_buffer_bytes to at"
                        f" least {page_rounded(nbytes) * self.count} bytes."
                    )
                self._grow(nbytes)
            began = time.perf_counter()
            waited = False
            while not self._free and self._allocated >= self.count:
                waited = True
                if not self._cond.wait(timeout=ACQUIRE_TIMEOUT_S):
                    raise DiskTierError(
                        f"All {self.count} disk tier buffers have been in use for {ACQUIRE_TIMEOUT_S:.0f} s: a caller"
                        " holds more leases (prefetch_masters) than the pool has buffers without releasing one."
                        " Release each lease once its block is copied, or raise host_buffer_bytes."
                    )
            if waited and self._clock is not None:
                self._clock.add("pool_wait", time.perf_counter() - began)
            return self._take()

    def try_acquire(self) -> Optional[Tensor]:
        """A buffer if one is free (or may be allocated) now, else ``None`` (never waits)."""
        with self._cond:
            if not self._free and self._allocated >= self.count:
                return None
            return self._take()

    def _take(self) -> Tensor:
        """A free buffer, or a new one (under the lock, with room for it)."""
        if self._free:
            buffer, arena = self._free.pop()
        else:
            arena = HostArena(pin=self.pin)
            buffer = arena.empty(self.buffer_bytes, torch.uint8)
            self._allocated += 1
            self.peak_bytes = max(self.peak_bytes, self._allocated * self.buffer_bytes)
        self._owners[buffer.data_ptr()] = arena
        return buffer

    def grow(self, nbytes: int) -> None:
        """Makes every buffer handed out from now on hold at least ``nbytes`` (an unbounded pool only)."""
        with self._cond:
            if nbytes > self.buffer_bytes:
                self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        self.buffer_bytes = page_rounded(nbytes)  # smaller buffers are dropped as they come back
        for buffer, arena in self._free:
            self._drop(buffer, arena)
        self._free = []

    def release(self, buffer: Tensor) -> None:
        """Returns ``buffer`` to the pool (from any thread)."""
        with self._cond:
            arena = self._owners.pop(buffer.data_ptr())
            if buffer.numel() < self.buffer_bytes or self._closed:
                self._drop(buffer, arena)
            else:
                self._free.append((buffer, arena))
            self._cond.notify()

    def close(self) -> None:
        """Frees the free buffers (and unpins them); buffers still out are freed when released."""
        with self._cond:
            self._closed = True
            for buffer, arena in self._free:
                self._drop(buffer, arena)
            self._free = []

    def _drop(self, buffer: Tensor, arena: HostArena) -> None:
        arena.close()
        self._allocated -= 1
