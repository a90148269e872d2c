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
from lightning_superpipe.memory.disk.pieces import ParamCost, Part, least_piece_bytes, plan_pieces, sliceable
from lightning_superpipe.memory.disk.records import Record, _master_bytes, probe_state_size
from lightning_superpipe.memory.disk.space import supports_direct_io
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.units import format_bytes

#: Most buffers a pool of pieces holds: more overlap reads ahead and writes behind, fewer keep pieces large.
PIECE_BUFFERS = 4


@dataclass(frozen=True)
class StoreOptions:
    """How a store holds its blocks, the options :meth:`DiskStore.create`, :meth:`DiskStore.open` and
    :meth:`DiskStore.restore` take as keyword arguments.

    Args:
        spill_grads: Reserve gradient files and buffer room for :meth:`DiskStore.spill_grads`.
        host_buffer_bytes: Bound on the pool's host bytes; default ``(read_ahead + 2)`` buffers of the largest block.
            Where it holds fewer than ``min_buffers`` whole blocks' buffers, blocks go in pieces.
        read_ahead: Blocks read ahead of the one being stepped.
        io_workers: Threads issuing reads and writes.
        chunk_bytes: Size of one read or write request.
        direct_io: Use ``O_DIRECT``; ``None`` probes the folder's file system.
        pin: Page-lock the buffers; ``None`` when CUDA is available.
        separate_io_kinds: Reads and writes take turns on the disk, file by file, rather than run at once (see
            :class:`~lightning_superpipe.memory.disk.file_io._KindGate`; off by default: slower in the tier's step
            on the disk measured).
        min_buffers: Where ``host_buffer_bytes`` holds fewer whole blocks' buffers than this, the pool holds smaller
            buffers and the blocks that do not fit one are read, stepped and written in pieces
            (:mod:`~lightning_superpipe.memory.disk.pieces`).
        sizing_blocks: The first blocks whose records size the buffers (``None``: all): the disk tier's streamed
            blocks, so that a larger record after them (a large vocabulary's embedding) goes in pieces instead of
            making every buffer its size.
    """

    spill_grads: bool = False
    host_buffer_bytes: Optional[int] = None
    read_ahead: int = 2
    io_workers: int = 4
    chunk_bytes: int = CHUNK_BYTES
    direct_io: Optional[bool] = None
    pin: Optional[bool] = None
    separate_io_kinds: bool = False
    min_buffers: int = 1
    sizing_blocks: Optional[int] = None


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
    min_buffers: int
    sizing_blocks: Optional[int]


class Sizing:
    """How large a store's buffers are, from its blocks' parameters, their records and the optimizer (nothing is
    allocated: :meth:`pool_shape` checks ``host_buffer_bytes`` before a store writes a byte).

    Args:
        params: Each block's parameters.
        records: Each block's committed record.
        optimizer: The optimizer that will step the blocks (sizes their state); may be ``None``.
        options: How the store holds the blocks.
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], records: Sequence[Record],
                 optimizer: Optional[Optimizer], options: StoreOptions) -> None:
        self.params = [list(block) for block in params]
        self.records = list(records)
        self.spills = options.spill_grads
        self.read_ahead = max(0, options.read_ahead)
        self._state_size = probe_state_size(optimizer)
        self._sliceable = sliceable(optimizer)

    def pool_shape(self, options: StoreOptions) -> tuple[int, int]:
        """The pool's buffer size and count: ``read_ahead + 2`` buffers of the largest block's bytes, or
        as many as ``host_buffer_bytes`` holds; where it holds fewer than ``min_buffers``, up to
        :data:`PIECE_BUFFERS` buffers that share it, and the blocks larger than one go in pieces.

        Raises:
            DiskTierError: The bound cannot hold ``min_buffers`` (at least two) buffers of the smallest piece.
        """
        sizing = len(self.params) if options.sizing_blocks is None else min(options.sizing_blocks, len(self.params))
        largest = max((self._buffer_need(i) for i in range(sizing)), default=PAGE)
        bound = options.host_buffer_bytes
        if bound is None:
            return largest, self.read_ahead + 2
        whole = int(bound) // page_rounded(largest)
        least_count = max(1, options.min_buffers)
        if whole >= least_count:
            return largest, whole
        least_count = max(2, least_count)
        least = self.least_pool_bytes(options) // least_count
        count = max(least_count, min(PIECE_BUFFERS, int(bound) // (4 * least)))
        buffer_bytes = int(bound) // count // PAGE * PAGE
        if buffer_bytes < least:
            need = least_count * least
            sliced = "a slice" if self._sliceable else "the largest parameter (this optimizer is stepped whole)"
            raise DiskTierError(
                f"host_buffer_bytes={int(bound)} ({format_bytes(int(bound))}) cannot hold {least_count} buffers of"
                f" the smallest piece of a block's record ({sliced}: {format_bytes(least)}). Give at least {need}"
                f" ({format_bytes(need)}); {page_rounded(largest) * (self.read_ahead + 2)} holds"
                f" {self.read_ahead + 2} whole blocks' buffers, so that reads ahead and writes behind overlap the step."
            )
        return buffer_bytes, count

    def least_pool_bytes(self, options: StoreOptions) -> int:
        """The least ``host_buffer_bytes`` a pool works with: ``min_buffers`` (two at least) buffers of the smallest
        piece of every block (a slice of a parameter, or where the optimizer is not stepped in slices, the largest
        parameter), whatever the blocks' sizes."""
        return max(2, options.min_buffers) * least_piece_bytes(self._param_costs(), self._sliceable)

    def _param_costs(self, index: Optional[int] = None) -> list[ParamCost]:
        """What each parameter of block ``index`` (default: of every block) takes in a buffer, per element: its
        master, its state (what the record holds, or what the probed optimizer will create) and its gradient."""
        blocks = range(len(self.params)) if index is None else [index]
        costs = []
        for block in blocks:
            record = self.records[block]
            for position, param in enumerate(self.params[block]):
                held = [e.dtype.itemsize for e in record.entries
                        if e.param == position and e.key is not None and e.shape == tuple(param.shape)]
                state = max(sum(held), self._state_size.per_element)
                tensors = (2 if self.spills else 1) + max(len(held), -int(-state // 4))  # 4-byte state: the most
                costs.append(ParamCost(param.numel(), param.element_size() * (2 if self.spills else 1) + state,
                                       tensors))
        return costs

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



class StoreCore(Sizing):
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
        super().__init__([list(block.values()) for block in blocks],
                         [Record.from_json(data) for data in manifest["blocks"]], optimizer, options)
        self.path = path
        self.names = [list(block) for block in blocks]
        self.step_count = int(manifest["step"])
        self.direct_io = supports_direct_io(path) if options.direct_io is None else options.direct_io
        self._grads_present: list[set[int]] = [set() for _ in blocks]
        #: Blocks stepped since the last commit: their new record, its write, whether it consumed spilled gradients.
        self._pending: dict[int, tuple[Record, Future[None], bool]] = {}
        #: Gradient writes that may still be in flight, by block.
        self._spill_writes: dict[int, Future[None]] = {}
        #: Per-parameter gradient norms of each block's last spill (``None``: not kept).
        self._grad_norms: dict[int, Optional[list[Optional[Tensor]]]] = {}
        self._plans: dict[int, list[list[Part]]] = {}
        buffer_bytes, count = self.pool_shape(options)
        #: Where the tier's time goes (:meth:`io_seconds`).
        self.clock = IoClock()
        pin = torch.cuda.is_available() if options.pin is None else options.pin
        self.pool = BufferPool(buffer_bytes, count, pin=pin, bounded=options.host_buffer_bytes is not None,
                               clock=self.clock)
        self.files = _Files(self.direct_io, options.io_workers, options.chunk_bytes, self.clock,
                            options.separate_io_kinds)
        # The step's reads ahead wait here for their buffers, in block order, so that the thread stepping never
        # waits for a buffer it does not need yet (a write behind gives one back).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="superpipe-disk-ahead")

    def _in_pieces(self, index: int) -> bool:
        """Whether block ``index`` is read, stepped and written in pieces (its buffer need exceeds a pool buffer)."""
        return self._buffer_need(index) > self.pool.buffer_bytes

    def _plan(self, index: int) -> list[list[Part]]:
        """Block ``index``'s pieces for the pool's buffers (planned again once its record's state changes size)."""
        plan = self._plans.get(index)
        if plan is None:
            plan = self._plans[index] = plan_pieces(self._param_costs(index), self.pool.buffer_bytes,
                                                    self._sliceable, f"Block {index}")
        return plan

    def _master_chunks(self, index: int) -> list[tuple[int, int]]:
        """Block ``index``'s masters region of its record cut into byte ranges of at most a pool buffer, on pages."""
        entries = self.records[index].masters()
        end = page_rounded(max(max((e.offset + e.nbytes for e in entries), default=0), 1))
        size = self.pool.buffer_bytes
        return [(start, min(start + size, end)) for start in range(0, end, size)]

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

    def _manifest(self, step: int, records: Sequence[Record]) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "step": step, "names": self.names,
                "blocks": [r.to_json() for r in records]}


def _park(param: nn.Parameter, shape: Optional[Sequence[int]] = None) -> None:
    """Points ``param`` at a placeholder of its shape and dtype that holds no memory (its value is on disk): NaN
    where the dtype has it, so that code reading the parameter's values during the run (a callback logging weight
    norms) gets NaN, not plausible zeros (``state_dict()`` gives the values). ``shape``: the parameter's own, where
    it points at a slice of itself now."""
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    param.data = torch.full((), fill, dtype=param.dtype).expand(param.shape if shape is None else tuple(shape))
