"""One tensor of a record (or of a gradient file) read into memory of its own, or written from it, through the pool's
buffers a buffer at a time: what the store does with a block too large for one buffer outside its step (gradients
spilled and taken back, a block read back whole, the export)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
from torch import Tensor

from lightning_superpipe.memory.disk.core import StoreCore
from lightning_superpipe.memory.disk.pieces import windows
from lightning_superpipe.memory.disk.records import Entry
from lightning_superpipe.memory.pinned import PAGE


class EntryIO(StoreCore):
    """Whole tensors of a record through pool buffers (a part of
    :class:`~lightning_superpipe.memory.disk.DiskStore`)."""

    def _chunk_bytes(self) -> int:
        """The bytes of a tensor one buffer carries: what is left of it after a page of slack on either side."""
        return max(PAGE, self.pool.buffer_bytes - 2 * PAGE)

    def _read_entry(self, path: Path, entry: Entry) -> Tensor:
        """``entry`` of the file ``path`` as a new tensor, read a buffer at a time."""
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        step = self._chunk_bytes()
        for start in range(0, entry.nbytes, step):
            count = min(step, entry.nbytes - start)
            lo, hi = windows(entry.offset + start, count)
            buffer = self.pool.acquire(self.pool.buffer_bytes)
            try:
                self.clock.wait(self.files.read(path, buffer, hi - lo, offset=lo), "read_wait")
                begin = entry.offset + start - lo
                out[start : start + count].copy_(buffer[begin : begin + count])
            finally:
                self.pool.release(buffer)
        return out.view(entry.dtype).view(entry.shape)

    def _write_entry(self, path: Path, entry: Entry, tensor: Tensor) -> list[Future[None]]:
        """Starts writing ``tensor`` as ``entry`` of the file ``path`` (made by ``files.begin``), a buffer at a time;
        each buffer goes back once its bytes are written (the entries of a gradient file share pages: only the
        entry's own bytes are written)."""
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        step = self._chunk_bytes()
        writes: list[Future[None]] = []
        for start in range(0, entry.nbytes, step):
            count = min(step, entry.nbytes - start)
            buffer = self.pool.acquire(self.pool.buffer_bytes)
            try:
                buffer[:count].copy_(data[start : start + count])
            except BaseException:
                self.pool.release(buffer)
                raise
            writes.append(
                self.files.write_range(
                    path, buffer, count, 0, entry.offset + start, written=lambda held=buffer: self.pool.release(held)
                )
            )
        return writes
