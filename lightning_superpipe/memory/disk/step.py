"""The optimizer step through the store: block by block, each block's record (and spilled gradients) read into a
pool buffer, stepped there by the user's optimizer restricted to the block, and written to the block's other slot;
reads of the next blocks and the write of the one before overlap the step, and the manifest commits it.

Crash consistency: nothing is committed until every written block is durable (:meth:`BlockSteps.commit`), and on
any error the step's writes are waited for and discarded (:meth:`BlockSteps.abort`), so the folder stays at the
previous step; every buffer a failed step holds goes back to the pool.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

# The manifest commit through its module: the kill -9 tests interpose on it there.
from lightning_superpipe.memory.disk import folder as disk_folder
from lightning_superpipe.memory.disk.buffers import _aligned_buffer
from lightning_superpipe.memory.disk.core import _park
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.folder import _grad_name
from lightning_superpipe.memory.disk.lease import MasterLease, Releases, SharedBuffer
from lightning_superpipe.memory.disk.piece_step import PieceSteps, _step_restricted
from lightning_superpipe.memory.disk.records import (
    Record,
    _decode_value,
    _layout,
    _own_state,
    _signature,
    _tensor_of,
)
from lightning_superpipe.units import format_bytes

#: A block read ahead for the step: its index, its buffer, the read of its record and that of its spilled gradients.
#: ``None`` for a block stepped in pieces, which reads its pieces itself.
_StepRead = tuple[int, Optional[Tensor], Future[None], Optional[Future[None]]]


class BlockSteps(PieceSteps):
    """The optimizer step of a :class:`~lightning_superpipe.memory.disk.DiskStore` (one of its parts)."""

    @property
    def pending(self) -> list[int]:
        """Blocks stepped since the last commit (``step(commit=False)``)."""
        return list(self._pending)

    def step(
        self,
        optimizer: Optimizer,
        grads: Literal["param", "disk"] = "param",
        blocks: Optional[Sequence[int]] = None,
        commit: bool = True,
        grad_scale: Optional[Tensor] = None,
        grad_clip_value: Optional[float] = None,
        read_ahead: Optional[int] = None,
        stepped: Optional[Callable[[int, Optional[MasterLease]], None]] = None,
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
            read_ahead: Blocks read ahead of the one stepping (default: the store's ``read_ahead``); fewer leave
                buffers to a forward running beside the step.
            stepped: Called with each block's index once it is stepped (its write started, the manifest not yet
                committed), and a lease on its new masters in the buffer the step wrote them from (``None`` if the
                record outgrew it): the caller copies them from there instead of reading them again, and releases
                the lease (the buffer goes back to the pool once the write is done too).
        """
        if grads not in ("param", "disk"):
            raise ValueError(f"grads must be 'param' or 'disk', not {grads!r}.")
        on_disk = grads == "disk"
        if on_disk and not self.spills:
            raise DiskTierError("step(grads='disk') needs a DiskStore built with spill_grads=True.")
        owned = {p for group in optimizer.param_groups for p in group["params"]}
        todo = self._blocks_to_step(blocks, on_disk, owned)
        reads = _ReadsAhead(self, todo, on_disk, self.read_ahead if read_ahead is None else read_ahead)
        try:
            for index in todo:
                buffer, record_read, grad_read = reads.take(index)
                if buffer is None:  # too large for a buffer: read, stepped and written in pieces
                    self._step_in_pieces(optimizer, index, on_disk, owned, grad_scale, grad_clip_value)
                    if stepped is not None:
                        stepped(index, None)
                    continue
                self.clock.wait(record_read, "read_wait")
                if grad_read is not None:
                    self.clock.wait(grad_read, "read_wait")
                began = time.perf_counter()
                record, holder = self._step_block(optimizer, index, buffer, on_disk, owned, grad_scale,
                                                  grad_clip_value)
                self.clock.add("step_compute", time.perf_counter() - began)
                reads.hand_over()  # from here the write gives the buffer back
                lease = self._write_behind(index, record, buffer, holder, on_disk, keep=stepped is not None)
                if stepped is not None:
                    try:
                        stepped(index, lease)
                    except BaseException:
                        if lease is not None:
                            lease.release()
                        raise
        except BaseException:
            reads.give_back()
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
            disk_folder._commit(self.path, self._manifest(self.step_count + 1, records))
        except BaseException:
            self.abort()
            raise
        self.records = records
        self._plans = {}  # the state's size may have changed
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

    def _blocks_to_step(self, blocks: Optional[Sequence[int]], on_disk: bool, owned: set[nn.Parameter]) -> list[int]:
        """The blocks (of ``blocks``, default all) that have gradients for the optimizer owning ``owned``.

        Raises:
            DiskTierError: One of them was stepped since the last commit already.
        """
        candidates = range(len(self.params)) if blocks is None else blocks
        if on_disk:
            todo = [i for i in candidates if self._grads_present[i]]
        else:
            todo = [i for i in candidates if any(p.grad is not None and p in owned for p in self.params[i])]
        again = [i for i in todo if i in self._pending]
        if again:
            raise DiskTierError(
                f"Block {again[0]} was already stepped in this optimizer step; commit() the step before stepping it"
                " again."
            )
        return todo

    def _write_behind(self, index: int, record: Record, buffer: Tensor, holder: Tensor, consumed_grads: bool,
                      keep: bool = False) -> Optional[MasterLease]:
        """Starts writing block ``index``'s new ``record`` (in ``holder``) to its slot, durably, and gives
        ``buffer`` back to the pool as soon as no byte of it is needed any more. With ``keep``, returns a lease on
        the new masters in ``buffer`` (which then goes back once both the write and the lease are done with it), or
        ``None`` where the record outgrew it."""
        path = self._slot_path(index, record.slot)
        lease = None
        if holder is buffer:
            owner: Releases = self.pool
            if keep:
                owner = SharedBuffer(self.pool, holders=2)
                lease = MasterLease.landed(owner, buffer, record.masters())
            # The buffer goes back once the record's bytes have left it, before the fsync: the commit waits for
            # the fsync (the future), the next read needs only the buffer.
            future = self.files.write(path, holder, record.file_bytes, durable=True,
                                      written=lambda: owner.release(buffer))
        else:
            self.pool.release(buffer)
            future = self.files.write(path, holder, record.file_bytes, durable=True)
        self._pending[index] = (record, future, consumed_grads)
        return lease

    def _start_read(self, index: int, with_grads: bool, spilled: Optional[Future[None]]) -> _StepRead:
        """On the reader thread: takes a buffer for block ``index`` (waiting for one) and starts reading its record
        and, ``with_grads``, its spilled gradients (once their write ``spilled`` is done) into it."""
        if self._in_pieces(index):
            if with_grads and spilled is not None:
                spilled.result()
            done: Future[None] = Future()
            done.set_result(None)
            return index, None, done, None
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
        self._point_into(optimizer, index, buffer, grads_on_disk)
        try:
            _step_restricted(optimizer, params, owned, grad_scale, grad_clip_value)
            states = [_own_state(optimizer, p) for p in params]
            entries, values = _layout(params, states)
            new = Record(1 - record.slot, entries, values)
            # The spilled gradients are consumed by now: the new record may take the whole buffer.
            if new.file_bytes > buffer.numel():
                return new, self._outgrown(index, new, params, states)
            _lay_out_in_place(record, new, buffer, params, states)
            return new, buffer
        finally:
            for param in params:
                optimizer.state.pop(param, None)
                _park(param)
                if grads_on_disk:
                    param.grad = None

    def _point_into(self, optimizer: Optimizer, index: int, buffer: Tensor, grads_on_disk: bool) -> None:
        """Points block ``index``'s parameters, their ``optimizer.state`` and, ``grads_on_disk``, their gradients at
        the record (and gradients) read into ``buffer``."""
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

    def _outgrown(self, index: int, new: Record, params: Sequence[Tensor],
                  states: Sequence[Mapping[str, Any]]) -> Tensor:
        """A buffer of its own for block ``index``'s ``new`` record, which outgrew its pool buffer (more state than
        the probe foretold); an unbounded pool grows for the blocks to come.

        Raises:
            DiskTierError: The pool is bounded (``host_buffer_bytes``) below the record's size.
        """
        if self.pool.bounded:
            raise DiskTierError(
                f"Block {index}'s record grew to {format_bytes(new.file_bytes)} (its optimizer state), more"
                f" than a buffer of host_buffer_bytes={self.pool.count * self.pool.buffer_bytes} holds"
                f" ({self.pool.count} x {format_bytes(self.pool.buffer_bytes)}). Raise host_buffer_bytes to"
                f" at least {self.pool.count * (new.file_bytes + self._grad_bytes(index))}, or leave it unset."
            )
        self.pool.grow(new.file_bytes + (self._grad_bytes(index) if self.spills else 0))
        grown = _aligned_buffer(new.file_bytes)
        for entry in new.entries:
            entry.view_of(grown).copy_(_tensor_of(entry, params, states))
        grown[new.nbytes :].zero_()
        return grown


class _ReadsAhead:
    """The reads ahead of one step: up to ``1 + read_ahead`` blocks (the one being stepped included, bounded by the
    pool), each waiting for its buffer on the store's reader thread, not on the thread stepping (measured on a virtual
    disk, 3 buffers of a 214M-parameter Llama's layers: that thread waited 1.8 s of a 3.2 s step for buffers that
    a write behind still held).

    Every buffer it handed out and was not handed over, and every buffer still coming, goes back with
    :meth:`give_back`.
    """

    def __init__(self, store: BlockSteps, todo: Sequence[int], on_disk: bool, read_ahead: int) -> None:
        self._store, self._on_disk = store, on_disk
        self._target = min(1 + read_ahead, store.pool.count)
        self._upcoming: Iterator[int] = iter(todo)
        self._queue: deque[tuple[int, Optional[Future[None]], Future[_StepRead]]] = deque()
        #: The buffer of the block being stepped, until its write takes it over.
        self._held: Optional[Tensor] = None

    def take(self, index: int) -> tuple[Optional[Tensor], Future[None], Optional[Future[None]]]:
        """Block ``index``'s buffer and the reads filling it (the next in order), once the reader thread has a
        buffer for it; the reads of the blocks after it are started first."""
        while len(self._queue) < self._target:
            following = next(self._upcoming, None)
            if following is None:
                break
            # Taken here, on the caller's thread, with the rest of the store's bookkeeping.
            spilled = self._store._spill_writes.pop(following, None) if self._on_disk else None
            ahead = self._store._reader.submit(self._store._start_read, following, self._on_disk, spilled)
            self._queue.append((following, spilled, ahead))
        read_index, buffer, record_read, grad_read = self._store.clock.wait(self._queue.popleft()[2], "read_wait")
        assert read_index == index
        self._held = buffer
        return buffer, record_read, grad_read

    def hand_over(self) -> None:
        """The buffer taken last is the write's to give back now."""
        self._held = None

    def give_back(self) -> None:
        """After a failure: gives back the buffer taken last (first, so that every read still queued gets one in
        turn) and, as each queued read lands, its buffer; a spilled gradients' write a cancelled read never waited
        for is left for the block's next spill or step to wait for."""
        if self._held is not None:
            self._store.pool.release(self._held)
            self._held = None
        while self._queue:
            following, spilled, ahead = self._queue.popleft()
            if ahead.cancel():
                if spilled is not None:
                    self._store._spill_writes.setdefault(following, spilled)
                continue
            if ahead.exception() is not None:
                continue
            _, buffer, record_read, grad_read = ahead.result()
            for job in (record_read, grad_read):
                if job is not None:
                    job.exception()  # never hand a buffer back while a read still fills it
            if buffer is not None:
                self._store.pool.release(buffer)


def _lay_out_in_place(record: Record, new: Record, buffer: Tensor, params: Sequence[Tensor],
                      states: Sequence[Mapping[str, Any]]) -> None:
    """Lays the ``new`` record out in ``buffer``, which holds the stepped ``record``."""
    entries = new.entries
    if [_signature(e) for e in entries] == [_signature(e) for e in record.entries]:
        for entry in entries:  # the optimizer may have replaced a tensor instead of updating it in place
            tensor = _tensor_of(entry, params, states)
            if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
                entry.view_of(buffer).copy_(tensor)
        return
    # The layout changed (the first step creates the state): place every tensor anew. Tensors of the buffer that
    # move are cloned first so that no copy overwrites one yet to be read; the masters lead both layouts and stay
    # where they are.
    tensors = [_tensor_of(e, params, states) for e in entries]
    moving = [_inside(t, buffer) and t.data_ptr() != e.view_of(buffer).data_ptr() for e, t in zip(entries, tensors)]
    tensors = [t.clone() if move else t for t, move in zip(tensors, moving)]
    for entry, tensor in zip(entries, tensors):
        if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
            entry.view_of(buffer).copy_(tensor)
    buffer[new.nbytes : new.file_bytes].zero_()  # the file's padding: keep it defined


def _inside(tensor: Tensor, buffer: Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()
