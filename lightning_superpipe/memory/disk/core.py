"""What every part of a :class:`~lightning_superpipe.memory.disk.DiskStore` shares: its options, its folder and
blocks, their committed records, the buffer pool and the file I/O, and where things sit in a block's buffer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypedDict

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk.buffers import BufferPool
from lightning_superpipe.memory.disk.clock import IoClock
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.file_io import CHUNK_BYTES, _Files
from lightning_superpipe.memory.disk.folder import FORMAT, VERSION, _slot_name
from lightning_superpipe.memory.disk.records import Record, _master_bytes, probe_state_size
from lightning_superpipe.memory.disk.space import supports_direct_io
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.units import format_bytes


@dataclass(frozen=True)
class StoreOptions:
    """How a store holds its blocks, the options :meth:`DiskStore.create`, :meth:`DiskStore.open` and
    :meth:`DiskStore.restore` take as keyword arguments.

    Args:
        spill_grads: Reserve gradient files and buffer room for :meth:`DiskStore.spill_grads`.
        host_buffer_bytes: Bound on the pool's host bytes; default ``(read_ahead + 2)`` buffers of the largest block.
        read_ahead: Blocks read ahead of the one being stepped.
        io_workers: Threads issuing reads and writes.
        chunk_bytes: Size of one read or write request.
        direct_io: Use ``O_DIRECT``; ``None`` probes the folder's file system.
        pin: Page-lock the buffers; ``None`` when CUDA is available.
        separate_io_kinds: Reads and writes take turns on the disk, file by file, rather than run at once (see
            :class:`~lightning_superpipe.memory.disk.file_io._KindGate`; off by default: slower in the tier's step
            on the disk measured).
    """

    spill_grads: bool = False
    host_buffer_bytes: Optional[int] = None
    read_ahead: int = 2
    io_workers: int = 4
    chunk_bytes: int = CHUNK_BYTES
    direct_io: Optional[bool] = None
    pin: Optional[bool] = None
    separate_io_kinds: bool = False


class StoreOptionArgs(TypedDict, total=False):
    """:class:`StoreOptions` as keyword arguments (``**options: Unpack[StoreOptionArgs]``), so that a checker sees the
    names and types the classmethods take."""

    spill_grads: bool
    host_buffer_bytes: Optional[int]
    read_ahead: int
    io_workers: int
    chunk_bytes: int
    direct_io: Optional[bool]
    pin: Optional[bool]
    separate_io_kinds: bool


class StoreCore:
    """The state the parts of a store share (built by :class:`~lightning_superpipe.memory.disk.DiskStore`, whose
    docstring describes it), and where a block's record, gradients and buffer sit.

    Args:
        path: The folder.
        blocks: Each block's parameters by name (names unique across blocks).
        manifest: The committed manifest.
        optimizer: The optimizer that will step the blocks (sizes the buffers); may be ``None`` for inference.
        options: How the store holds the blocks.

    Raises:
        DiskTierError: ``options.host_buffer_bytes`` cannot hold one block's buffer.
    """

    def __init__(self, path: Path, blocks: Sequence[Mapping[str, nn.Parameter]], manifest: Mapping[str, Any],
                 optimizer: Optional[Optimizer], options: StoreOptions) -> None:
        self.path = path
        self.names = [list(block) for block in blocks]
        self.params = [list(block.values()) for block in blocks]
        self.records = [Record.from_json(data) for data in manifest["blocks"]]
        self.step_count = int(manifest["step"])
        self.spills = options.spill_grads
        self.read_ahead = max(0, options.read_ahead)
        self.direct_io = supports_direct_io(path) if options.direct_io is None else options.direct_io
        self._grads_present: list[set[int]] = [set() for _ in blocks]
        #: Blocks stepped since the last commit: their new record, its write, whether it consumed spilled gradients.
        self._pending: dict[int, tuple[Record, Future[None], bool]] = {}
        #: Gradient writes that may still be in flight, by block.
        self._spill_writes: dict[int, Future[None]] = {}
        #: Per-parameter gradient norms of each block's last spill (``None``: not kept).
        self._grad_norms: dict[int, Optional[list[Optional[Tensor]]]] = {}
        self._state_size = probe_state_size(optimizer)
        largest = max((self._buffer_need(i) for i in range(len(blocks))), default=PAGE)
        count = self._buffer_count(largest, options.host_buffer_bytes)
        #: Where the tier's time goes (:meth:`io_seconds`).
        self.clock = IoClock()
        pin = torch.cuda.is_available() if options.pin is None else options.pin
        self.pool = BufferPool(largest, count, pin=pin, bounded=options.host_buffer_bytes is not None,
                               clock=self.clock)
        self.files = _Files(self.direct_io, options.io_workers, options.chunk_bytes, self.clock,
                            options.separate_io_kinds)
        # The step's reads ahead wait here for their buffers, in block order, so that the thread stepping never
        # waits for a buffer it does not need yet (a write behind gives one back).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="superpipe-disk-ahead")

    def _buffer_count(self, largest: int, host_buffer_bytes: Optional[int]) -> int:
        """How many buffers of ``largest`` bytes the pool holds: ``read_ahead + 2``, or what the bound allows."""
        if host_buffer_bytes is None:
            return self.read_ahead + 2
        count = int(host_buffer_bytes) // page_rounded(largest)
        if count < 1:
            one, overlapping = page_rounded(largest), page_rounded(largest) * (self.read_ahead + 2)
            raise DiskTierError(
                f"host_buffer_bytes={int(host_buffer_bytes)} ({format_bytes(int(host_buffer_bytes))}) cannot hold"
                f" one block's buffer of {one} bytes ({format_bytes(one)}). Give at least {one}; {overlapping}"
                f" ({self.read_ahead + 2} buffers) lets reads ahead and writes behind overlap the step."
            )
        return count

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.files.bytes_written

    def _current(self, index: int) -> Record:
        """Block ``index``'s newest record: stepped but not committed yet (once written), else committed."""
        pending = self._pending.get(index)
        if pending is None:
            return self.records[index]
        pending[1].result()
        return pending[0]

    def _slot_path(self, index: int, slot: int) -> Path:
        return self.path / _slot_name(index, slot)

    def _grad_bytes(self, index: int) -> int:
        return page_rounded(max(_master_bytes(self.params[index]), 1))

    def _grad_offset(self, index: int) -> int:
        """Where spilled gradients go in a step's buffer: after the largest record the block may have."""
        return page_rounded(max(self._record_estimate(index), self.records[index].file_bytes))

    def _record_estimate(self, index: int) -> int:
        params = self.params[index]
        return page_rounded(_master_bytes(params) + sum(self._state_size.record_bytes(p.numel()) for p in params))

    def _buffer_need(self, index: int) -> int:
        need = max(self._record_estimate(index), self.records[index].file_bytes)
        return need + (self._grad_bytes(index) if self.spills else 0)

    def _manifest(self, step: int, records: Sequence[Record]) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "step": step, "names": self.names,
                "blocks": [r.to_json() for r in records]}


def _park(param: nn.Parameter) -> None:
    """Points ``param`` at a placeholder of its shape and dtype that holds no memory (its value is on disk): NaN
    where the dtype has it, so that code reading the parameter's values during the run (a callback logging weight
    norms) gets NaN, not plausible zeros (``state_dict()`` gives the values)."""
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    param.data = torch.full((), fill, dtype=param.dtype).expand(param.shape)
