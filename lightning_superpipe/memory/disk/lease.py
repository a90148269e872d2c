"""Leases on pool buffers that hold a block's masters: read from its file for a forward's copy, or left in the buffer
a step wrote them from (a pipelined step hands them to the next forward, which need not read them again)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_superpipe.memory.disk.clock import IoClock
from lightning_superpipe.memory.disk.records import Entry


class Releases(Protocol):
    """Where a lease gives its buffer back (a :class:`~.buffers.BufferPool`, or a :class:`SharedBuffer`)."""

    def release(self, buffer: Tensor) -> None: ...


class SharedBuffer:
    """A pool buffer with several holders (a write behind and a lease on the masters it holds): it goes back to the
    pool when the last holder releases it, from any thread.

    Args:
        pool: The buffer's pool.
        holders: How many holders must release it.
    """

    def __init__(self, pool: Releases, holders: int) -> None:
        self._pool, self._holders = pool, holders
        self._lock = threading.Lock()

    def add(self) -> None:
        """One more holder (a write from the buffer, started before the first holder released it)."""
        with self._lock:
            self._holders += 1

    def release(self, buffer: Tensor) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._pool.release(buffer)


class MasterLease:
    """A block's fp32 masters in a pool buffer (being read, or already there); :meth:`wait` gives views,
    :meth:`release` gives the buffer back.

    Args:
        pool: Where the buffer goes back.
        buffer: The buffer holding (or being filled with) the masters.
        future: The read filling it (done for masters a step left there).
        entries: Where the masters sit in the buffer.
        clock: Counts the time :meth:`wait` and :meth:`flat` block on the read (``read_wait``).
    """

    def __init__(self, pool: Releases, buffer: Tensor, future: Future[None], entries: list[Entry],
                 clock: Optional[IoClock] = None) -> None:
        self._pool, self._buffer, self._future, self._entries = pool, buffer, future, entries
        self._clock = clock
        self._released = False

    @classmethod
    def landed(cls, pool: Releases, buffer: Tensor, entries: list[Entry]) -> MasterLease:
        """A lease on masters already in ``buffer`` (no read to wait for)."""
        done: Future[None] = Future()
        done.set_result(None)
        return cls(pool, buffer, done, entries)

    def _landed(self) -> None:
        if self._clock is None:
            self._future.result()
        else:
            self._clock.wait(self._future, "read_wait")

    def wait(self) -> list[Tensor]:
        """The block's masters, in its parameter order (views into the pool buffer: copy before :meth:`release`)."""
        self._landed()
        return [entry.view_of(self._buffer) for entry in self._entries]

    def flat(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The block's masters as one flat tensor of ``numel`` elements of ``dtype`` (a view into the pool buffer):
        every master starts on :data:`~.records.ENTRY_ALIGNMENT` bytes, so for fp32 this is the host tier's flat
        layout."""
        self._landed()
        return self._buffer[: numel * dtype.itemsize].view(dtype)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._future.exception()  # never hand a buffer back while a read still fills it
            self._pool.release(self._buffer)
