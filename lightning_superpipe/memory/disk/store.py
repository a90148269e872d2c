"""The disk tier's store: :class:`DiskStore` over a folder of block records (see the package for the overview)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk.buffers import BufferPool, _aligned_buffer
from lightning_superpipe.memory.disk.clock import IoClock
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.export import write_safetensors
from lightning_superpipe.memory.disk.file_io import CHUNK_BYTES, _check_length, _Files, _fsync_dir, _open
from lightning_superpipe.memory.disk.folder import (
    FORMAT,
    MANIFEST,
    VERSION,
    _check_manifest,
    _commit,
    _grad_name,
    _link_or_copy,
    _read_manifest,
    _slot_name,
)
from lightning_superpipe.memory.disk.records import (
    Entry,
    Record,
    _decode_value,
    _fill,
    _layout,
    _master_bytes,
    _own_state,
    _signature,
    _tensor_of,
    probe_state_size,
)
from lightning_superpipe.memory.disk.space import PathLike, preflight, supports_direct_io
from lightning_superpipe.memory.param_groups import restricted
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.units import format_bytes

# ---------------------------------------------------------------------------------------------------------------------
# The store


@dataclass
class BlockState:
    """A copy of one block's masters and optimizer state, keyed by parameter name."""

    masters: dict[str, Tensor]
    state: dict[str, dict[str, Any]]


#: A block read ahead for the step: its index, its buffer, the read of its record and that of its spilled gradients.
_StepRead = tuple[int, Tensor, Future[None], Optional[Future[None]]]


class MasterLease:
    """A block's fp32 masters being read into a pool buffer; :meth:`wait` gives views, :meth:`release` returns it.

    Args:
        pool: The pool ``buffer`` came from.
        buffer: The buffer the read fills.
        future: The read.
        entries: Where the masters sit in the buffer.
        clock: Counts the time :meth:`wait` and :meth:`flat` block on the read (``read_wait``).
    """

    def __init__(self, pool: BufferPool, buffer: Tensor, future: Future[None], entries: list[Entry],
                 clock: Optional[IoClock] = None) -> None:
        self._pool, self._buffer, self._future, self._entries = pool, buffer, future, entries
        self._clock = clock
        self._released = False

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
        every master starts on :data:`ENTRY_ALIGNMENT` bytes, so for fp32 this is the host tier's flat layout."""
        self._landed()
        return self._buffer[: numel * dtype.itemsize].view(dtype)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._future.exception()  # never hand a buffer back while a read still fills it
            self._pool.release(self._buffer)




class DiskStore:
    """The disk tier of a set of blocks: their masters and optimizer state in files under one folder.

    Build it with :meth:`create` (writes the blocks' current values as step 0), :meth:`open` (continues the
    committed step of a folder) or :meth:`restore` (continues from a checkpoint's copy). Afterwards the block
    parameters hold placeholders of their shape and dtype with no memory; values are read with
    :meth:`prefetch_masters` and :meth:`read_block`, and changed only by :meth:`step`.

    Args:
        path: The folder.
        blocks: Each block's parameters by name (names unique across blocks).
        manifest: The committed manifest.
        optimizer: The optimizer that will step the blocks (sizes the buffers); may be ``None`` for inference.
        spill_grads: Reserve gradient files and buffer room for :meth:`spill_grads`.
        host_buffer_bytes: Bound on the pool's host bytes; default ``(read_ahead + 2)`` buffers of the largest block.
        read_ahead: Blocks read ahead of the one being stepped.
        io_workers: Threads issuing reads and writes.
        chunk_bytes: Size of one read or write request.
        direct_io: Use ``O_DIRECT``; ``None`` probes the folder's file system.
        pin: Page-lock the buffers; ``None`` when CUDA is available.
        separate_io_kinds: Reads and writes take turns on the disk, file by file, rather than run at once (see
            :class:`_KindGate`; off by default: slower in the tier's step on the disk measured).
    """

    def __init__(
        self,
        path: Path,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        manifest: Mapping[str, Any],
        optimizer: Optional[Optimizer],
        spill_grads: bool,
        host_buffer_bytes: Optional[int],
        read_ahead: int,
        io_workers: int,
        chunk_bytes: int,
        direct_io: Optional[bool],
        pin: Optional[bool],
        separate_io_kinds: bool = False,
    ) -> None:
        self.path = path
        self.names = [list(block) for block in blocks]
        self.params = [list(block.values()) for block in blocks]
        self.records = [Record.from_json(data) for data in manifest["blocks"]]
        self.step_count = int(manifest["step"])
        self.spills = spill_grads
        self.read_ahead = max(0, read_ahead)
        self.direct_io = supports_direct_io(path) if direct_io is None else direct_io
        self._grads_present: list[set[int]] = [set() for _ in blocks]
        #: Blocks stepped since the last commit: their new record, its write, whether it consumed spilled gradients.
        self._pending: dict[int, tuple[Record, Future[None], bool]] = {}
        #: Gradient writes that may still be in flight, by block.
        self._spill_writes: dict[int, Future[None]] = {}
        #: Per-parameter gradient norms of each block's last spill (``None``: not kept).
        self._grad_norms: dict[int, Optional[list[Optional[Tensor]]]] = {}
        self._state_size = probe_state_size(optimizer)
        largest = max((self._buffer_need(i) for i in range(len(blocks))), default=PAGE)
        if host_buffer_bytes is None:
            count = self.read_ahead + 2
        else:
            count = int(host_buffer_bytes) // page_rounded(largest)
            if count < 1:
                one, overlapping = page_rounded(largest), page_rounded(largest) * (self.read_ahead + 2)
                raise DiskTierError(
                    f"host_buffer_bytes={int(host_buffer_bytes)} ({format_bytes(int(host_buffer_bytes))}) cannot hold"
                    f" one block's buffer of {one} bytes ({format_bytes(one)}). Give at least {one}; {overlapping}"
                    f" ({self.read_ahead + 2} buffers) lets reads ahead and writes behind overlap the step."
                )
        #: Where the tier's time goes (:meth:`io_seconds`).
        self.clock = IoClock()
        self.pool = BufferPool(largest, count, pin=torch.cuda.is_available() if pin is None else pin,
                               bounded=host_buffer_bytes is not None, clock=self.clock)
        self.files = _Files(self.direct_io, io_workers, chunk_bytes, self.clock, separate_io_kinds)
        # The step's reads ahead wait here for their buffers, in block order, so that the thread stepping never
        # waits for a buffer it does not need yet (a write behind gives one back).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="superpipe-disk-ahead")
        for block in self.params:
            for param in block:
                _park(param)

    # -- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        *,
        spill_grads: bool = False,
        host_buffer_bytes: Optional[int] = None,
        read_ahead: int = 2,
        io_workers: int = 4,
        chunk_bytes: int = CHUNK_BYTES,
        direct_io: Optional[bool] = None,
        pin: Optional[bool] = None,
        separate_io_kinds: bool = False,
        overwrite: bool = False,
        initial: Optional[Callable[[int], Mapping[str, Tensor]]] = None,
    ) -> DiskStore:
        """Checks the folder, writes every block's current masters (and any optimizer state it already has) as
        step 0, commits, and moves the values out of memory. See the class for the other arguments.

        Args:
            initial: Block ``i``'s initial values by name, called once per block and dropped once written, for a
                model that does not fit in host memory (e.g. read from a checkpoint's shards): its parameters may
                then be placeholders of the right shape and dtype (``torch.zeros(()).expand(shape)``).

        Raises:
            DiskTierError: The folder is missing or unwritable, or already holds a tier (without ``overwrite``).
            DiskSpaceError: It lacks the space two slots of every block (and gradients) need.
        """
        folder = Path(path)
        _check_blocks(blocks)
        what = "two slots of every block's masters and optimizer state" + (", and its gradients" if spill_grads else "")
        preflight(folder, cls.bytes_needed([list(b.values()) for b in blocks], optimizer, spill_grads), what)
        if (folder / MANIFEST).exists():
            if not overwrite:
                raise DiskTierError(
                    f"{str(folder)!r} already holds a disk tier (committed step"
                    f" {_read_manifest(folder)['step']}). Continue it with DiskStore.open, or pass overwrite=True"
                    " to start over."
                )
            (folder / MANIFEST).unlink()
            _fsync_dir(folder)
        manifest = {"format": FORMAT, "version": VERSION, "step": 0,
                    "names": [list(b) for b in blocks], "blocks": []}
        states = [[_own_state(optimizer, p) for p in b.values()] for b in blocks]
        manifest["blocks"] = [Record(1, *_layout(list(b.values()), s)).to_json() for b, s in zip(blocks, states)]
        # The parameters still hold the values: write them with a writer of its own before the store parks them.
        files = _Files(supports_direct_io(folder) if direct_io is None else direct_io, io_workers, chunk_bytes)
        try:
            for index, (block, state) in enumerate(zip(blocks, states)):
                record = Record.from_json(manifest["blocks"][index])
                buffer = _aligned_buffer(record.file_bytes)
                buffer.zero_()
                params = list(block.values())
                if initial is not None:
                    params = _initial_values(index, block, initial(index))
                _fill(record, buffer, params, state)
                del params
                files.write(folder / _slot_name(index, record.slot), buffer, record.file_bytes, durable=True).result()
                if optimizer is not None:
                    for param in block.values():
                        optimizer.state.pop(param, None)
            _commit(folder, manifest)
        finally:
            files.close()
        return cls(folder, blocks, manifest, optimizer, spill_grads, host_buffer_bytes, read_ahead, io_workers,
                   chunk_bytes, direct_io, pin, separate_io_kinds)

    @staticmethod
    def bytes_needed(
        block_params: Sequence[Sequence[nn.Parameter]], optimizer: Optional[Optimizer] = None, spill_grads: bool = False
    ) -> int:
        """The bytes of a new store's files for blocks of these parameters: two slots of every block's record
        (masters and ``optimizer``'s state) and, with ``spill_grads``, its gradient file."""
        size = probe_state_size(optimizer)
        return sum(
            2 * page_rounded(_master_bytes(params) + sum(size.record_bytes(p.numel()) for p in params))
            + (page_rounded(_master_bytes(params)) if spill_grads else 0)
            for params in block_params
        )

    @classmethod
    def open(
        cls,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        *,
        spill_grads: bool = False,
        host_buffer_bytes: Optional[int] = None,
        read_ahead: int = 2,
        io_workers: int = 4,
        chunk_bytes: int = CHUNK_BYTES,
        direct_io: Optional[bool] = None,
        pin: Optional[bool] = None,
        separate_io_kinds: bool = False,
    ) -> DiskStore:
        """Continues the committed step of ``path``: checks that its manifest matches ``blocks`` (names, shapes,
        dtypes) and that every committed file is there at its full size. See the class for the arguments.

        Raises:
            DiskTierError: No committed manifest, a mismatch with ``blocks``, or a missing or truncated file.
        """
        folder = Path(path)
        _check_blocks(blocks)
        manifest = _read_manifest(folder)
        _check_manifest(folder, manifest, blocks)
        size = probe_state_size(optimizer)
        # The other slots are written by the next step: check that they fit beside the committed ones.
        needed = 0
        for index, (block, data) in enumerate(zip(blocks, manifest["blocks"])):
            record = Record.from_json(data)
            estimate = page_rounded(
                _master_bytes(list(block.values())) + sum(size.record_bytes(p.numel()) for p in block.values())
            )
            other = folder / _slot_name(index, 1 - record.slot)
            needed += max(0, max(estimate, record.file_bytes) - (other.stat().st_size if other.exists() else 0))
            if spill_grads and not (folder / _grad_name(index)).exists():
                needed += page_rounded(_master_bytes(list(block.values())))
        preflight(folder, needed, "the slots the next step writes")
        return cls(folder, blocks, manifest, optimizer, spill_grads, host_buffer_bytes, read_ahead, io_workers,
                   chunk_bytes, direct_io, pin, separate_io_kinds)

    @classmethod
    def restore(
        cls,
        snapshot: PathLike,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        **options: Any,
    ) -> DiskStore:
        """Continues from a checkpoint's copy (:meth:`snapshot`): hard-links (or, across file systems, copies) its
        files into ``path``, replacing the tier there, commits its manifest and opens it. The copy is never written:
        later steps write new files in ``path``. ``options`` are those of :meth:`open`."""
        source, folder = Path(snapshot), Path(path)
        manifest = _read_manifest(source)
        _check_manifest(source, manifest, blocks)
        preflight(folder, 0)
        if source.resolve() != folder.resolve():
            if (folder / MANIFEST).exists():
                (folder / MANIFEST).unlink()  # uncommit first: a kill mid-restore must not leave a mix
                _fsync_dir(folder)
            for index, data in enumerate(manifest["blocks"]):
                for slot in (0, 1):
                    (folder / _slot_name(index, slot)).unlink(missing_ok=True)
                name = _slot_name(index, int(data["slot"]))
                _link_or_copy(source / name, folder / name)
            _commit(folder, manifest)
        return cls.open(folder, blocks, optimizer, **options)

    def close(self) -> None:
        """Waits for I/O in flight and frees the buffers. The files stay at the committed step (blocks stepped and not
        committed are discarded): :meth:`open` continues them."""
        self.abort()
        for future in self._spill_writes.values():
            future.exception()
        self._spill_writes = {}
        self._reader.shutdown(wait=True)
        self.files.close()
        self.pool.close()

    def io_seconds(self) -> dict[str, float]:
        """Where the tier's time went since it was built, in seconds (:class:`IoClock`'s counters)."""
        return self.clock.seconds()

    # -- reading --------------------------------------------------------------------------------------------------

    def prefetch_masters(self, index: int) -> MasterLease:
        """Starts reading block ``index``'s masters into a pool buffer (what a forward streams to the device)."""
        record = self._current(index)
        entries = record.masters()
        nbytes = page_rounded(max(max((e.offset + e.nbytes for e in entries), default=0), 1))
        buffer = self.pool.acquire(nbytes)
        future = self.files.read(self._slot_path(index, record.slot), buffer, nbytes)
        return MasterLease(self.pool, buffer, future, entries, self.clock)

    def map_masters(self, index: int) -> dict[str, Tensor]:
        """Block ``index``'s committed masters by name, as copy-on-write views of its committed file (a private
        ``mmap``): no host memory until read, and then page cache the kernel may reclaim; writing into them copies
        the page and never reaches the file. No store writes into a file it did not create, or mapped so
        (:class:`_Files`), so the views keep the committed values while this store steps on, or the folder is
        reused or removed (an unlinked file lives while mapped).

        Raises:
            DiskTierError: The file is missing or shorter than its record.
        """
        record = self.records[index]
        path = self._slot_path(index, record.slot)
        fd = _open(path, os.O_RDONLY)  # a missing file's error, as a read gives it
        try:
            _check_length(path, os.fstat(fd).st_size, record.file_bytes)
        finally:
            os.close(fd)
        mapped = torch.from_file(str(path), shared=False, size=record.file_bytes, dtype=torch.uint8)
        self.files.hand_over(path)  # this store too writes the slot into a new file from now on
        return {self.names[index][e.param]: e.view_of(mapped) for e in record.masters()}

    def read_block(self, index: int) -> BlockState:
        """A copy of block ``index``'s masters and optimizer state (stepped since the last commit, or committed)."""
        record = self._current(index)
        buffer = self.pool.acquire(record.file_bytes)
        try:
            self.files.read(self._slot_path(index, record.slot), buffer, record.file_bytes).result()
            names = self.names[index]
            masters = {names[e.param]: e.view_of(buffer).clone() for e in record.masters()}
            state: dict[str, dict[str, Any]] = {}
            for entry in record.entries:
                if entry.key is not None:
                    state.setdefault(names[entry.param], {})[entry.key] = entry.view_of(buffer).clone()
            for param, values in record.values.items():
                for key, value in values.items():
                    state.setdefault(names[param], {})[key] = _decode_value(value)
            return BlockState(masters, state)
        finally:
            self.pool.release(buffer)

    # -- gradients ------------------------------------------------------------------------------------------------

    def spill_grads(
        self,
        index: int,
        grads: Sequence[Optional[Tensor]],
        accumulate: bool = False,
        wait: bool = True,
        norms: bool = False,
    ) -> Future[None]:
        """Writes block ``index``'s gradients (one per parameter, ``None`` for none) to its gradient file, adding them
        to those spilled before when ``accumulate`` (as autograd accumulates into ``.grad``). The file is scratch:
        it is not ``fsync``ed, and a crash loses only the step in progress.

        The gradients are copied into a pool buffer at once (the caller may free them on return); with ``wait=False``
        the write goes on in the background (the returned future; a failure is raised by it, or by the next spill or
        step of the block, which wait for it). With ``norms`` (the last micro-batch, when clipping by global norm)
        the 2-norm of each spilled (accumulated) gradient is kept for :meth:`grad_norms`.
        """
        if not self.spills:
            raise DiskTierError("This DiskStore was built without spill_grads=True; it has no gradient files.")
        if index in self._pending:
            raise DiskTierError(
                f"Block {index} was stepped and not committed yet; commit() before spilling new gradients."
            )
        params = self.params[index]
        if len(grads) != len(params):
            raise ValueError(f"Block {index} has {len(params)} parameters but {len(grads)} gradients were given.")
        previous = self._spill_writes.pop(index, None)
        if previous is not None:
            previous.result()  # the file must be whole before it is read back or written again
        entries = self.records[index].masters()
        nbytes = self._grad_bytes(index)
        path = self.path / _grad_name(index)
        present = self._grads_present[index]
        buffer = self.pool.acquire(nbytes)
        try:
            if accumulate and present:
                self.files.read(path, buffer, nbytes).result()
            for entry, grad in zip(entries, grads):
                view = entry.view_of(buffer)
                if grad is None:
                    if not (accumulate and entry.param in present):
                        view.zero_()
                    continue
                if grad.shape != view.shape or grad.dtype != view.dtype:
                    raise ValueError(
                        f"The gradient of {self.names[index][entry.param]} has shape {tuple(grad.shape)} and dtype"
                        f" {grad.dtype}; its parameter has {tuple(view.shape)} and {view.dtype}."
                    )
                if accumulate and entry.param in present:
                    view.add_(grad.detach().to("cpu"))
                else:
                    view.copy_(grad.detach())
            if not accumulate:
                present.clear()
            present.update(i for i, g in enumerate(grads) if g is not None)
            # What torch.nn.utils.clip_grad_norm_ computes per gradient, from the same fp32 values.
            self._grad_norms[index] = (
                [torch.linalg.vector_norm(e.view_of(buffer), 2.0) if e.param in present else None for e in entries]
                if norms else None
            )
        except BaseException:
            self.pool.release(buffer)
            raise
        future = self.files.write(path, buffer, nbytes, durable=False, written=lambda: self.pool.release(buffer))
        self._spill_writes[index] = future
        if wait:
            future.result()
        return future

    def take_grads(self, index: int) -> list[Optional[Tensor]]:
        """Reads block ``index``'s spilled gradients back into new host tensors (``None`` for a parameter without
        one) and forgets the spill: the caller holds them now (e.g. to fold them into a reduction across ranks), and
        the block's next spill starts its file afresh."""
        previous = self._spill_writes.pop(index, None)
        if previous is not None:
            previous.result()  # the file must be whole before it is read back
        present = self._grads_present[index]
        entries = self.records[index].masters()
        if not present:
            return [None] * len(entries)
        nbytes = self._grad_bytes(index)
        buffer = self.pool.acquire(nbytes)
        try:
            self.files.read(self.path / _grad_name(index), buffer, nbytes).result()
            grads = [entry.view_of(buffer).clone() if entry.param in present else None for entry in entries]
        finally:
            self.pool.release(buffer)
        present.clear()
        self._grad_norms.pop(index, None)
        return grads

    def spilled(self, index: int) -> bool:
        """Whether block ``index`` has spilled gradients that no committed step has consumed yet."""
        return bool(self._grads_present[index])

    def has_norms(self, index: int) -> bool:
        """Whether block ``index``'s last spill kept norms (:meth:`grad_norms` answers)."""
        return self._grad_norms.get(index) is not None

    @property
    def pending(self) -> list[int]:
        """Blocks stepped since the last commit (``step(commit=False)``)."""
        return list(self._pending)

    def master_entries(self, index: int) -> list[Entry]:
        """Where block ``index``'s masters sit in its record (and in a :class:`MasterLease`'s buffer)."""
        return self.records[index].masters()

    def grad_norms(self, index: int) -> list[Optional[Tensor]]:
        """The 2-norm of each of block ``index``'s spilled gradients (``None`` for a parameter without one), as the
        last :meth:`spill_grads` with ``norms=True`` computed them. Stack them with the other parameters' norms, in
        the order ``clip_grad_norm_`` would see them, for the global norm, and pass the clipping coefficient to
        :meth:`step` as ``grad_scale``.

        Raises:
            DiskTierError: The block's last spill did not keep norms.
        """
        kept = self._grad_norms.get(index)
        if kept is None:
            raise DiskTierError(f"Block {index}'s last spill_grads did not keep norms; pass norms=True to it.")
        return kept

    # -- the step -------------------------------------------------------------------------------------------------

    def step(
        self,
        optimizer: Optimizer,
        grads: Literal["param", "disk"] = "param",
        blocks: Optional[Sequence[int]] = None,
        commit: bool = True,
        grad_scale: Optional[Tensor] = None,
        grad_clip_value: Optional[float] = None,
    ) -> None:
        """Steps ``optimizer`` over the blocks with gradients, block by block, and commits the new step.

        Each block's record (and, with ``grads="disk"``, its spilled gradients) is read into a pool buffer, the
        block's parameters and their ``optimizer.state`` are pointed at it, the optimizer steps restricted to the
        block's parameters (its groups, hyperparameters and LR as configured), and the record is written to the
        block's other slot. Reads of the next blocks and the write of the previous one overlap the step. Once every
        written block is durable the manifest is committed. On any error nothing is committed: the folder stays at
        the previous step (blocks stepped since the last commit are discarded too), and the error names the file.

        Args:
            optimizer: The user's optimizer (its param groups hold the blocks' parameters).
            grads: ``"param"``: the gradients are in ``p.grad``; ``"disk"``: read those :meth:`spill_grads` wrote
                (consumed by the step).
            blocks: Step only these blocks, in this order (default: all with gradients), e.g. one block as soon as
                backward has completed its gradients.
            commit: Commit at once; with ``False`` the writes go on in the background and :meth:`commit` (after
                the last block of the optimizer step) makes them the new step.
            grad_scale: Multiplies every gradient before the step (``clip_grad_norm_``'s clamped coefficient, a
                0-dim tensor, for clipping by global norm with spilled gradients; see :meth:`grad_norms`).
            grad_clip_value: Clamps every gradient to ``[-grad_clip_value, grad_clip_value]`` before the step (after
                ``grad_scale``), as ``torch.nn.utils.clip_grad_value_`` does: clipping by value, element by element.
        """
        if grads not in ("param", "disk"):
            raise ValueError(f"grads must be 'param' or 'disk', not {grads!r}.")
        if grads == "disk" and not self.spills:
            raise DiskTierError("step(grads='disk') needs a DiskStore built with spill_grads=True.")
        owned = {p for group in optimizer.param_groups for p in group["params"]}
        candidates = range(len(self.params)) if blocks is None else blocks
        if grads == "disk":
            todo = [i for i in candidates if self._grads_present[i]]
        else:
            todo = [i for i in candidates if any(p.grad is not None and p in owned for p in self.params[i])]
        again = [i for i in todo if i in self._pending]
        if again:
            raise DiskTierError(
                f"Block {again[0]} was already stepped in this optimizer step; commit() the step before stepping it"
                " again."
            )
        # Up to ``target`` blocks are read ahead, the block being stepped included. The reads wait for their buffers
        # on the store's reader thread, not here: a block whose bytes have landed is stepped while the write of the
        # one before still holds the buffer the next read will take (measured on a virtual disk, 3 buffers of a
        # 214M-parameter Llama's layers: the thread stepping waited 1.8 s of a 3.2 s step for such buffers).
        target = min(1 + self.read_ahead, self.pool.count)
        reads: deque[tuple[int, Optional[Future[None]], Future[_StepRead]]] = deque()
        upcoming = iter(todo)
        try:
            for index in todo:
                while len(reads) < target:
                    following = next(upcoming, None)
                    if following is None:
                        break
                    # Taken here, on the caller's thread, with the rest of the store's bookkeeping.
                    spilled = self._spill_writes.pop(following, None) if grads == "disk" else None
                    reads.append((following, spilled,
                                  self._reader.submit(self._start_read, following, grads == "disk", spilled)))
                read_index, buffer, record_read, grad_read = self.clock.wait(reads.popleft()[2], "read_wait")
                assert read_index == index
                try:
                    self.clock.wait(record_read, "read_wait")
                    if grad_read is not None:
                        self.clock.wait(grad_read, "read_wait")
                    began = time.perf_counter()
                    record, holder = self._step_block(optimizer, index, buffer, grads == "disk", owned, grad_scale,
                                                      grad_clip_value)
                    self.clock.add("step_compute", time.perf_counter() - began)
                except BaseException:
                    self.pool.release(buffer)
                    raise
                if holder is buffer:
                    # The buffer goes back once the record's bytes have left it, before the fsync: the commit
                    # waits for the fsync (the future), the next read needs only the buffer.
                    future = self.files.write(self._slot_path(index, record.slot), holder, record.file_bytes,
                                              durable=True, written=lambda buffer=buffer: self.pool.release(buffer))
                else:
                    self.pool.release(buffer)
                    future = self.files.write(self._slot_path(index, record.slot), holder, record.file_bytes,
                                              durable=True)
                self._pending[index] = (record, future, grads == "disk")
        except BaseException:
            # The buffer of the block that failed is back already: every read still queued gets one in turn.
            while reads:
                following, spilled, ahead = reads.popleft()
                if ahead.cancel():
                    if spilled is not None:  # never waited for: the next spill or step of the block waits for it
                        self._spill_writes.setdefault(following, spilled)
                    continue
                if ahead.exception() is not None:
                    continue
                _, buffer, record_read, grad_read = ahead.result()
                for job in (record_read, grad_read):
                    if job is not None:
                        job.exception()
                self.pool.release(buffer)
            self.abort()
            raise
        if commit:
            self.commit()

    def commit(self) -> None:
        """Makes the blocks stepped since the last commit the folder's new step, once each is durable.

        Raises:
            DiskTierError: A write failed (the error names the file); the folder stays at the previous step.
        """
        try:
            for _, future, _ in self._pending.values():
                self.clock.wait(future, "write_wait")
            records = list(self.records)
            for index, (record, _, _) in self._pending.items():
                records[index] = record
            _commit(self.path, self._manifest(self.step_count + 1, records))
        except BaseException:
            self.abort()
            raise
        self.records = records
        self.step_count += 1
        for index, (_, _, consumed_grads) in self._pending.items():
            if consumed_grads:
                self._grads_present[index].clear()
        self._pending = {}

    def abort(self) -> None:
        """Discards the blocks stepped since the last commit (waiting for their writes): the store is back at the
        committed step, as after a crash. The caller's optimizer step has failed and must be repeated whole."""
        for _, future, _ in self._pending.values():
            future.exception()
        self._pending = {}

    def discard_grads(self, index: Optional[int] = None, params: Optional[Iterable[int]] = None) -> None:
        """Drops spilled gradients unstepped: every block's (a step a gradient scaler skips for non-finite ones), or
        block ``index``'s, or only those of its parameters at the positions ``params`` (a ``zero_grad`` of part of
        the block: the next spill writes theirs afresh, and adds to the others')."""
        indices = range(len(self.params)) if index is None else [index]
        for block in indices:
            present = self._grads_present[block]
            if params is None:
                future = self._spill_writes.pop(block, None)
                if future is not None:
                    future.exception()
                present.clear()
            else:
                present.difference_update(params)
            self._grad_norms.pop(block, None)

    def spilled_params(self, index: int) -> list[nn.Parameter]:
        """Block ``index``'s parameters whose gradients are spilled (and not consumed by a committed step)."""
        present = self._grads_present[index]
        return [param for position, param in enumerate(self.params[index]) if position in present]

    def _current(self, index: int) -> Record:
        """Block ``index``'s newest record: stepped but not committed yet (once written), else committed."""
        pending = self._pending.get(index)
        if pending is None:
            return self.records[index]
        pending[1].result()
        return pending[0]

    def _start_read(self, index: int, with_grads: bool, spilled: Optional[Future[None]]) -> _StepRead:
        """On the reader thread: takes a buffer for block ``index`` (waiting for one) and starts reading its record
        and, ``with_grads``, its spilled gradients (once their write ``spilled`` is done) into it."""
        record = self.records[index]
        buffer = self.pool.acquire(self._buffer_need(index))
        record_read: Optional[Future[None]] = None
        try:
            record_read = self.files.read(self._slot_path(index, record.slot), buffer, record.file_bytes)
            grad_read = None
            if with_grads:
                if spilled is not None:
                    spilled.result()  # the gradient file must be whole before it is read back
                grad_read = self.files.read(self.path / _grad_name(index), buffer, self._grad_bytes(index),
                                            start=self._grad_offset(index))
        except BaseException:
            if record_read is not None:
                record_read.exception()  # never hand a buffer back while a read still fills it
            self.pool.release(buffer)
            raise
        return index, buffer, record_read, grad_read

    def _step_block(
        self,
        optimizer: Optimizer,
        index: int,
        buffer: Tensor,
        grads_on_disk: bool,
        owned: set[nn.Parameter],
        grad_scale: Optional[Tensor],
        grad_clip_value: Optional[float] = None,
    ) -> tuple[Record, Tensor]:
        """Steps block ``index`` in ``buffer`` (its committed record) and lays the new record out in it (or, if it
        outgrew the buffer, in a new one). Returns the record and the buffer that holds it."""
        record, params = self.records[index], self.params[index]
        masters = record.masters()
        for entry, param in zip(masters, params):
            param.data = entry.view_of(buffer)
        if grads_on_disk:
            grad_base = buffer[self._grad_offset(index) :]
            present = self._grads_present[index]
            for entry, param in zip(masters, params):
                param.grad = entry.view_of(grad_base) if entry.param in present else None
        for param in params:
            optimizer.state.pop(param, None)
        for entry in record.entries:
            if entry.key is not None:
                optimizer.state[params[entry.param]][entry.key] = entry.view_of(buffer)
        for param_index, values in record.values.items():
            for key, value in values.items():
                optimizer.state[params[param_index]][key] = _decode_value(value)
        try:
            stepped = {p for p in params if p.grad is not None and p in owned}
            if grad_scale is not None:
                for param in params:
                    if param in stepped:
                        param.grad.mul_(grad_scale)  # type: ignore[union-attr]
            if grad_clip_value is not None:
                for param in params:
                    if param in stepped:
                        param.grad.clamp_(min=-grad_clip_value, max=grad_clip_value)  # type: ignore[union-attr]
            with restricted(optimizer, stepped):
                optimizer.step()
            states = [_own_state(optimizer, p) for p in params]
            entries, values = _layout(params, states)
            new = Record(1 - record.slot, entries, values)
            # The spilled gradients are consumed by now: the new record may take the whole buffer.
            if new.file_bytes > buffer.numel():
                # More state than the probe foretold: an unbounded pool grows for the blocks to come, and this
                # record is written from a buffer of its own.
                if self.pool.bounded:
                    raise DiskTierError(
                        f"Block {index}'s record grew to {format_bytes(new.file_bytes)} (its optimizer state), more"
                        f" than a buffer of host_buffer_bytes={self.pool.count * self.pool.buffer_bytes} holds"
                        f" ({self.pool.count} x {format_bytes(self.pool.buffer_bytes)}). Raise host_buffer_bytes to"
                        f" at least {self.pool.count * (new.file_bytes + self._grad_bytes(index))}, or leave it unset."
                    )
                self.pool.grow(new.file_bytes + (self._grad_bytes(index) if self.spills else 0))
                grown = _aligned_buffer(new.file_bytes)
                for entry in entries:
                    entry.view_of(grown).copy_(_tensor_of(entry, params, states))
                grown[new.nbytes :].zero_()
                return new, grown
            if [_signature(e) for e in entries] == [_signature(e) for e in record.entries]:
                for entry in entries:  # the optimizer may have replaced a tensor instead of updating it in place
                    tensor = _tensor_of(entry, params, states)
                    if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
                        entry.view_of(buffer).copy_(tensor)
            else:
                # The layout changed (the first step creates the state): place every tensor anew. Tensors of the
                # buffer that move are cloned first so that no copy overwrites one yet to be read; the masters lead
                # both layouts and stay where they are.
                tensors = [_tensor_of(e, params, states) for e in entries]
                moving = [_inside(t, buffer) and t.data_ptr() != e.view_of(buffer).data_ptr()
                          for e, t in zip(entries, tensors)]
                tensors = [t.clone() if move else t for t, move in zip(tensors, moving)]
                for entry, tensor in zip(entries, tensors):
                    if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
                        entry.view_of(buffer).copy_(tensor)
                buffer[new.nbytes : new.file_bytes].zero_()  # the file's padding: keep it defined
            return new, buffer
        finally:
            for param in params:
                optimizer.state.pop(param, None)
                _park(param)
                if grads_on_disk:
                    param.grad = None
        return new

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def snapshot(self, folder: PathLike) -> dict[str, Any]:
        """Copies the committed step into ``folder`` (created; e.g. :func:`checkpoint_folder` of a ``.ckpt``) by
        hard links where it shares the file system, else by copies, and commits a manifest there last. Holds no
        state in memory. Returns the manifest, small enough for the ``.ckpt``.

        Raises:
            DiskTierError: A committed file is missing.
            DiskSpaceError: Copying ran out of space (the tier itself is untouched).
        """
        if self._pending:
            raise DiskTierError("snapshot() between step(commit=False) and commit(): commit the step first.")
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        (target / MANIFEST).unlink(missing_ok=True)
        manifest = self._manifest(self.step_count, self.records)
        for index, record in enumerate(self.records):
            for slot in (0, 1):
                (target / _slot_name(index, slot)).unlink(missing_ok=True)
            name = _slot_name(index, record.slot)
            _link_or_copy(self.path / name, target / name)
        _commit(target, manifest)
        return manifest

    def export_safetensors(
        self, path: PathLike, extra: Optional[Mapping[str, Tensor]] = None, dtype: Optional[torch.dtype] = None
    ) -> None:
        """Writes the committed masters (and ``extra`` tensors, e.g. the trunk's) as one plain safetensors file,
        block by block (memory: one block), for inference. ``dtype`` casts floating-point tensors (e.g. bf16)."""
        extra = dict(extra or {})
        names = [n for block in self.names for n in block]
        clash = set(names) & set(extra)
        if clash:
            raise ValueError(f"extra repeats names the blocks already hold: {sorted(clash)[:5]}.")
        layout = [(self.names[i][e.param], e.dtype, e.shape) for i, r in enumerate(self.records) for e in r.masters()]
        layout += [(name, t.dtype, tuple(t.shape)) for name, t in extra.items()]

        def tensors() -> Iterator[Tensor]:
            for index in range(len(self.records)):
                lease = self.prefetch_masters(index)
                try:
                    yield from lease.wait()
                finally:
                    lease.release()
            yield from extra.values()

        write_safetensors(path, layout, tensors(), dtype, {"superpipe_step": str(self.step_count)})

    # -- helpers --------------------------------------------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.files.bytes_written

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


# ---------------------------------------------------------------------------------------------------------------------
# Module helpers



def _park(param: nn.Parameter) -> None:
    """Points ``param`` at a placeholder of its shape and dtype that holds no memory (its value is on disk): NaN
    where the dtype has it, so that code reading the parameter's values during the run (a callback logging weight
    norms) gets NaN, not plausible zeros (``state_dict()`` gives the values)."""
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    param.data = torch.full((), fill, dtype=param.dtype).expand(param.shape)



def _inside(tensor: Tensor, buffer: Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()



def _initial_values(index: int, block: Mapping[str, nn.Parameter], values: Mapping[str, Tensor]) -> list[Tensor]:
    if set(values) != set(block):
        raise ValueError(
            f"initial({index}) gave the tensors {sorted(values)[:4]}, but block {index} has {sorted(block)[:4]}."
        )
    for name, param in block.items():
        if values[name].shape != param.shape or values[name].dtype != param.dtype:
            raise ValueError(
                f"initial({index})[{name!r}] is {tuple(values[name].shape)} {values[name].dtype}; the parameter is"
                f" {tuple(param.shape)} {param.dtype}."
            )
    return [values[name].detach() for name in block]


def _check_blocks(blocks: Sequence[Mapping[str, nn.Parameter]]) -> None:
    seen: set[str] = set()
    for block in blocks:
        for name, param in block.items():
            if name in seen:
                raise ValueError(f"The parameter name {name!r} appears in two blocks; names must be unique.")
            seen.add(name)
            if param.device.type != "cpu":
                raise ValueError(f"{name} is on {param.device}; the disk tier takes host (CPU) parameters.")


