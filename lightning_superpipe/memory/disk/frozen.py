"""The disk tier's frozen packed weights: a 4-bit base (bitsandbytes' ``Linear4bit`` weights, or the frozen matrices
``quantize_frozen`` quantized) in read-only files beside the tier's records.

A packed weight never trains (:mod:`~lightning_superpipe.memory.fourbit.packed`): its bytes (codes, scales, nested
scales, codebooks) are written once, block by block, to ``frozen{i:05d}.bin`` under the tier's folder, laid out as the
host tier lays them out after a block's masters (each weight's region, each of its tensors aligned in it), so that one
read of the file is the tail of the block's device buffer. The file is written to a temporary name, ``fsync``\\ ed, made
read-only and renamed into place: the step never writes it (it touches the masters' records only), a kill leaves it
whole or absent, and a later run writes a new file (a new inode) rather than into one a model still maps.

Once written, each weight's tensors point at copy-on-write views of its file (``torch.from_file(shared=False)``):
host memory holds none of the base (pages come in only where something reads them on the host, e.g. a state dict,
and are page cache the kernel may reclaim), and what reads the weight's values on the host (``state_dict``, the
dequantized values given back when a ``quantize_frozen`` run ends) reads them from the file. The device copies read
the file with ``pread`` into one of a few staging buffers (:meth:`FrozenFiles.copy_in`), and
``posix_fadvise(DONTNEED)`` keeps the page cache from growing by the base's size. The reads go ahead of the copies
(:meth:`FrozenFiles.read_ahead`, with the masters' reads ahead), on a thread of their own, into the staging buffers
not reserved for another block's read, each after the device copy that last read the buffer: the loop thread that
issues the copies does not wait for the disk (a 70B model's NF4 block is ~0.45 GB, ~0.2 s at 2-3 GB/s).

Checkpoints do not hold the base (it is no trainable state): a resumed run builds the model again and writes the
files again from its values (or, under ``configure_model`` with a deferred load, block by block as it reads them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.disk.buffers import _aligned_buffer, _byte_view
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.file_io import _fsync_dir
from lightning_superpipe.memory.fourbit.frozen4bit import frozen_matrices, quantized_bytes
from lightning_superpipe.memory.fourbit.packed import PackedSlice, packed_format, packed_slice, split_packed
from lightning_superpipe.memory.home import Arena, Event, Link

#: A dtype of each element size, to view bytes as a device buffer's elements (only their size matters).
_ELEMENTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def frozen_name(index: int) -> str:
    """The file of block ``index``'s frozen packed weights."""
    return f"frozen{index:05d}.bin"


class FrozenFiles:
    """The frozen packed weights of a disk tier's blocks, one read-only file per block.

    Args:
        folder: The tier's folder.
        itemsize: Bytes of an element of the blocks' device buffers (the transfer dtype's): the weights' regions are
            laid out in such elements, as the host tier lays them out.
    """

    def __init__(self, folder: Path, itemsize: int) -> None:
        self.folder = Path(folder)
        self.itemsize = itemsize
        #: Each written block's packed weights, their offsets relative to the start of the block's frozen region.
        self._slices: dict[int, list[PackedSlice]] = {}
        self._staging: list[list[Any]] = []  # [uint8 buffer, event of the copy reading it]
        self._next = 0
        self._link: Optional[Link] = None
        #: Reads ahead in flight or done, not yet copied: block -> (its staging buffer, the read). The engine's loop
        #: thread alone starts, takes and drops them; the reader thread only reads files into the buffers.
        self._ahead: dict[int, tuple[int, Future[None]]] = {}
        self._reader: Optional[ThreadPoolExecutor] = None
        #: Bytes read from the files for the device copies, over the run.
        self.bytes_read = 0
        #: Reads started ahead of their copies (:meth:`read_ahead`), over the run.
        self.reads_ahead = 0

    # ------------------------------------------------------------------ writing, once

    def write_block(self, index: int, params: Sequence[nn.Parameter]) -> None:
        """Writes the packed weights among block ``index``'s ``params`` to the block's file (nothing if it has none)
        and points their tensors at copy-on-write views of it.

        Raises:
            DiskTierError: The file cannot be written (the message names it and the error).
        """
        _, packed = split_packed(params)
        if not packed:
            return
        slices, offset = [], 0
        for param, format in packed:
            slices.append(packed_slice(param, format, offset, self.itemsize))
            offset += slices[-1].numel
        nbytes = offset * self.itemsize
        path = self.folder / frozen_name(index)
        scratch = _aligned_buffer(nbytes)
        scratch.zero_()  # the alignment gaps: defined
        for piece in slices:
            assert piece.format is not None
            for view, tensor in zip(piece.tensors_in(self._elements(scratch)), piece.format.tensors(piece.param)):
                view.copy_(tensor.detach())
        _write_read_only(path, scratch, nbytes)
        del scratch
        mapped = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
        for piece in slices:
            assert piece.format is not None
            piece.format.rehome(piece.param, piece.tensors_in(self._elements(mapped)))
        self._slices[index] = slices

    def _elements(self, data: Tensor) -> Tensor:
        """``data`` (``uint8``) viewed as elements of :attr:`itemsize` bytes, as slices' offsets count them."""
        return data.view(_ELEMENTS[self.itemsize])

    def write_missing(self, block_params: Sequence[Sequence[nn.Parameter]]) -> None:
        """Writes the blocks not written yet (those whose packed weights came whole, e.g. bitsandbytes' layers)."""
        for index, params in enumerate(block_params):
            if index not in self._slices:
                self.write_block(index, params)

    # ------------------------------------------------------------------ the layout, and the device copies

    def slices(self, index: int, start: int) -> list[PackedSlice]:
        """Block ``index``'s packed weights placed from element ``start`` of its device buffer (after its masters)."""
        return [replace(piece, offset=piece.offset + start) for piece in self._slices.get(index, [])]

    def numel(self, index: int) -> int:
        """Elements of block ``index``'s frozen region."""
        return sum(piece.numel for piece in self._slices.get(index, []))

    @property
    def largest_bytes(self) -> int:
        """Bytes of the largest block's frozen region."""
        return max((self.numel(index) for index in self._slices), default=0) * self.itemsize

    def attach(self, link: Link, arena: Arena, slots: int) -> None:
        """Connects to the engine's copier: one staging buffer per device slot and one more, each waited for before it
        is read into again (from ``arena``: page-locked with a CUDA device)."""
        self._drop_reads_ahead()
        self._link = link
        nbytes = self.largest_bytes
        if nbytes:
            self._staging = [[arena.empty(nbytes, torch.uint8), None] for _ in range(slots + 1)]
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="superpipe-frozen-reads")

    def read_ahead(self, indices: Iterable[int]) -> None:
        """Starts reading the frozen files of the blocks expected next (nearest first) on the reader thread, as far
        as the staging buffers not reserved for other blocks' reads allow; each read first waits for the device copy
        that last read its buffer."""
        if self._reader is None or not self._staging:
            return
        for index in indices:
            numel = self.numel(index)
            if not numel or index in self._ahead:
                continue
            slot = self._free_slot()
            if slot is None:
                return
            buffer, event = self._staging[slot]
            path, nbytes = self.folder / frozen_name(index), numel * self.itemsize
            self._ahead[index] = (slot, self._reader.submit(self._read_after, path, buffer, nbytes, event))
            self.reads_ahead += 1

    def _read_after(self, path: Path, buffer: Tensor, nbytes: int, event: Event) -> None:
        """On the reader thread: waits for the copy that last read ``buffer``, then reads ``path`` into it."""
        assert self._link is not None
        self._link.wait_on_host(event)
        _read(path, buffer, nbytes)

    def _free_slot(self) -> Optional[int]:
        """The next staging buffer in turn that no read ahead holds (the ring moves past it), or ``None``."""
        held = {slot for slot, _ in self._ahead.values()}
        for step in range(len(self._staging)):
            slot = (self._next + step) % len(self._staging)
            if slot not in held:
                self._next = (slot + 1) % len(self._staging)
                return slot
        return None

    def copy_in(self, dst: Tensor, index: int, after: Event, what: str) -> Event:
        """Reads block ``index``'s frozen region from its file and copies it into ``dst`` (the tail of the block's
        device buffer, of the transfer dtype); returns the copy's event (``after`` where there is nothing to copy).
        Uses the block's read ahead where one was started (raising its error), else reads the file now."""
        numel = self.numel(index)
        if not numel:
            return after
        assert self._link is not None
        nbytes = numel * self.itemsize
        if index in self._ahead:
            slot, read = self._ahead.pop(index)
            read.result()  # it waited for the buffer's last copy
        else:
            slot = self._free_slot()
            if slot is None:  # every buffer holds a read ahead of another block: the latest started gives way
                slot, read = self._ahead.pop(next(reversed(self._ahead)))
                _settle(read)
            self._link.wait_on_host(self._staging[slot][1])  # the copy that last read this buffer is done
            _read(self.folder / frozen_name(index), self._staging[slot][0], nbytes)
        staging = self._staging[slot]
        self.bytes_read += nbytes
        staging[1] = self._link.to_device(dst, staging[0][:nbytes].view(dst.dtype), after, what)
        return staging[1]

    def _drop_reads_ahead(self) -> None:
        """Waits for the reads ahead in flight and drops them all (their buffers are free again)."""
        ahead, self._ahead = self._ahead, {}
        for _, read in ahead.values():
            _settle(read)

    def memory_report(self) -> dict[str, int]:
        """``frozen_disk_bytes`` (the files), ``frozen_disk_bytes_read`` and ``frozen_disk_reads_ahead`` (over the
        run), ``frozen_staging_host_bytes`` and, as the host tier reports them, ``packed_weight_bytes`` (the weights'
        regions, alignment included) and ``packed_weight_numel`` (the weights they hold unpacked)."""
        if not self._slices:
            return {}
        files = [self.folder / frozen_name(index) for index in self._slices]
        pieces = [piece for slices in self._slices.values() for piece in slices]
        return {
            "frozen_disk_bytes": sum(f.stat().st_size for f in files if f.exists()),
            "frozen_disk_bytes_read": self.bytes_read,
            "frozen_disk_reads_ahead": self.reads_ahead,
            "frozen_staging_host_bytes": sum(buffer.numel() for buffer, _ in self._staging),
            "packed_weight_bytes": sum(piece.numel for piece in pieces) * self.itemsize,
            "packed_weight_numel": sum(piece.format.logical_numel(piece.param) for piece in pieces if piece.format),
        }

    def close(self) -> None:
        """Waits for the reads ahead in flight, stops the reader thread and lets the staging buffers go; the weights
        keep their views of the files (the model is whole after the run)."""
        self._drop_reads_ahead()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._staging = []


def frozen_region_bytes(params: Sequence[nn.Parameter], itemsize: int) -> int:
    """Bytes of the frozen region of a block of ``params`` already packed (what its file holds)."""
    _, packed = split_packed(params)
    return sum(packed_slice(param, format, 0, itemsize).numel for param, format in packed) * itemsize


def _settle(read: Future[None]) -> None:
    """Waits for a read ahead that no copy will use; its error, if any, is not this caller's (a copy of that block
    reads the file again, and raises it then)."""
    try:
        read.result()
    except Exception:  # noqa: BLE001 - see above
        pass


def _write_read_only(path: Path, data: Tensor, nbytes: int) -> None:
    """Writes ``nbytes`` of ``data`` as the file ``path``, durably, read-only, atomically (a temporary name renamed)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.unlink(missing_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
        try:
            view, done = _byte_view(data, nbytes), 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], done)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        _fsync_dir(path.parent)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise DiskTierError(f"Could not write the frozen 4-bit weights to {str(path)!r}: {error}.") from error


def _read(path: Path, buffer: Tensor, nbytes: int) -> None:
    """Reads the first ``nbytes`` of ``path`` into ``buffer`` (uint8), leaving the page cache as it was."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as error:
        raise DiskTierError(
            f"The disk tier's frozen 4-bit weights {str(path)!r} are missing: the run wrote them when it started and"
            " reads them for every copy of the block. Keep offload_path's files while the run goes on."
        ) from error
    try:
        view, done = _byte_view(buffer, nbytes), 0
        while done < nbytes:
            count = os.preadv(fd, [view[done:]], done)
            if count == 0:
                raise DiskTierError(f"The disk tier's frozen 4-bit weights {str(path)!r} are shorter than written.")
            done += count
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def block_itemsize(block_params: Sequence[Sequence[nn.Parameter]], transfer_dtype: Optional[torch.dtype]) -> int:
    """Bytes of an element of the blocks' device buffers: the transfer dtype's, or the floating parameters' own."""
    if transfer_dtype is not None:
        return transfer_dtype.itemsize
    floating = (p for params in block_params for p in split_packed(params)[0])
    return next(floating, torch.empty(0)).dtype.itemsize


def split_frozen(block_params: Sequence[Sequence[nn.Parameter]], mode: Optional[str],
                 transfer_dtype: Optional[torch.dtype]) -> tuple[list[list[nn.Parameter]], list[int]]:
    """Each block's parameters that go to the tier's store (its masters), and the bytes of each block's frozen
    4-bit weights (packed already, or the matrices ``quantize_frozen`` in ``mode`` will quantize), which go to its
    frozen file."""
    itemsize = block_itemsize(block_params, transfer_dtype)
    masters, frozen_bytes = [], []
    for params in block_params:
        matrices = set(frozen_matrices(params)) if mode is not None else set()
        floating, _ = split_packed(params)
        masters.append([p for p in floating if p not in matrices])
        to_quantize = sum(quantized_bytes(p.numel(), mode) for p in matrices if packed_format(p) is None) if mode else 0
        frozen_bytes.append(frozen_region_bytes(params, itemsize) + to_quantize)
    return masters, frozen_bytes
