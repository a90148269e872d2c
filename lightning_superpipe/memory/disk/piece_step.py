"""The optimizer step of a block too large for one pool buffer: its record read, stepped and written piece by piece
(:mod:`.pieces`), each piece's buffer given back once its bytes are written.

Each piece's masters, optimizer state and spilled gradients are read from the block's committed slot into a buffer,
the block's parameters in the piece (or a slice of one: 1-D views) and their ``optimizer.state`` pointed at them, the
optimizer stepped restricted to them, and the new values written at their places in the block's other slot, whose
layout is built as the pieces go (the masters where they were, then each parameter's state in parameter order, as
:func:`~.records._layout` lays it out). A slice starts from the parameter's scalar state as committed (Adam's
``step``), so every slice steps it alike; the last slice's is written. The slot is ``fdatasync``ed once every piece
is written, and committed by the manifest as a whole block's is: crash consistency is the same.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk.buffers import _aligned_buffer
from lightning_superpipe.memory.disk.core import StoreCore, _park
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.folder import _grad_name
from lightning_superpipe.memory.disk.lease import SharedBuffer
from lightning_superpipe.memory.disk.pieces import Part, windows
from lightning_superpipe.memory.disk.records import Entry, Record, _decode_value, _encode_value
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.stepping.param_groups import restricted


@dataclass
class _Loaded:
    """One piece read into a pool buffer: where each part's tensors lie in it, and the reads filling it."""

    buffer: Tensor
    jobs: list[Future[None]] = field(default_factory=list)
    #: Per part: the byte where its master starts, its state tensors' (by key) and its gradient's (``None``: none).
    places: list[tuple[Part, int, dict[str, int], Optional[int]]] = field(default_factory=list)
    #: The first byte no read fills: new state goes from here.
    end: int = 0

    def wait(self) -> None:
        errors = [job.exception() for job in self.jobs]
        for error in errors:
            if error is not None:
                raise error


class _NewRecord:
    """The block's new record as its pieces are written: entries placed in parameter order, the writes in flight."""

    def __init__(self, old: Record) -> None:
        self.masters = old.masters()
        self.states: list[Entry] = []
        self.values: dict[int, dict[str, Any]] = {}
        self.cursor = page_rounded(max((e.offset + e.nbytes for e in self.masters), default=0))
        self.placed: dict[int, dict[str, Entry]] = {}
        self.writes: list[Future[None]] = []

    def entries_of(self, part: Part, state: Mapping[str, Any]) -> dict[str, Entry]:
        """The new entries of ``part``'s parameter (of its master's shape), placed when its first part comes."""
        full = self.masters[part.param].shape
        placed = self.placed.get(part.param)
        if placed is None:
            placed = self.placed[part.param] = {}
            for key, value in state.items():
                if isinstance(value, Tensor):
                    shape = full if _per_element(value, part, full) else tuple(value.shape)
                    entry = Entry(part.param, key, value.dtype, shape, self.cursor)
                    self.cursor += page_rounded(entry.nbytes)
                    self.states.append(entry)
                    placed[key] = entry
        keys = {k for k, v in state.items() if isinstance(v, Tensor)}
        if keys != set(placed):
            raise DiskTierError(
                f"The optimizer's state of parameter {part.param} changed keys between slices ({sorted(placed)} then"
                f" {sorted(keys)}); this optimizer cannot be stepped in slices. Raise host_buffer_bytes."
            )
        return placed

    def record(self, slot: int) -> Record:
        return Record(slot, self.masters + self.states, self.values)


class PieceSteps(StoreCore):
    """The step of a block in pieces (a part of :class:`~lightning_superpipe.memory.disk.DiskStore`)."""

    def _step_in_pieces(
        self,
        optimizer: Optimizer,
        index: int,
        on_disk: bool,
        owned: set[nn.Parameter],
        grad_scale: Optional[Tensor],
        grad_clip_value: Optional[float],
    ) -> None:
        """Steps block ``index`` piece by piece into its other slot and leaves it pending, as a whole block's step
        does; on an error every buffer goes back once no read or write uses it."""
        old = self.records[index]
        path = self._slot_path(index, 1 - old.slot)
        self.files.begin(path, max(self._record_estimate(index), old.file_bytes))
        new = _NewRecord(old)
        fixed: dict[int, dict[str, Tensor]] = {}
        plan = self._plan(index)
        upcoming: Optional[_Loaded] = None
        try:
            for number, piece in enumerate(plan):
                loaded = upcoming or self._load_piece(index, piece, on_disk, fixed, wait=True)
                assert loaded is not None  # waited for a buffer
                upcoming = None
                try:
                    if number + 1 < len(plan):  # the next piece's read, where a buffer is free now
                        upcoming = self._load_piece(index, plan[number + 1], on_disk, fixed, wait=False)
                    for job in loaded.jobs:
                        job.exception() if job.done() else self.clock.wait(job, "read_wait")
                    loaded.wait()
                except BaseException:
                    _give_back(self.pool, loaded)  # the step of the piece gives it back from here on
                    raise
                self._step_piece(optimizer, index, loaded, on_disk, owned, grad_scale, grad_clip_value, fixed, new)
        except BaseException:
            if upcoming is not None:
                _give_back(self.pool, upcoming)
            for job in new.writes:
                job.exception()
            raise
        record = new.record(1 - old.slot)
        done = self.files.finish(path, record.file_bytes, new.writes, durable=True)
        self._pending[index] = (record, done, on_disk)

    def _load_piece(
        self, index: int, piece: Sequence[Part], on_disk: bool, fixed: dict[int, dict[str, Tensor]], wait: bool
    ) -> Optional[_Loaded]:
        """Takes a buffer (``None`` where ``wait`` is false and none is free) and starts reading ``piece`` of block
        ``index`` into it: its masters, its state tensors, and ``on_disk`` its gradients; each parameter's scalar
        state is read once, into ``fixed``."""
        buffer = self.pool.acquire(self.pool.buffer_bytes) if wait else self.pool.try_acquire()
        if buffer is None:
            return None
        record = self.records[index]
        slot = self._slot_path(index, record.slot)
        masters = record.masters()
        loaded = _Loaded(buffer)
        try:
            for part in piece:
                master = self._read_into(loaded, slot, masters[part.param], part)
                states: dict[str, int] = {}
                for entry in record.entries:
                    if entry.param != part.param or entry.key is None:
                        continue
                    if entry.shape == masters[part.param].shape:
                        states[entry.key] = self._read_into(loaded, slot, entry, part)
                    elif part.param not in fixed or entry.key not in fixed[part.param]:
                        fixed.setdefault(part.param, {})[entry.key] = self._read_small(slot, entry)
                grad = None
                if on_disk and part.param in self._grads_present[index]:
                    grad = self._read_into(loaded, self.path / _grad_name(index), masters[part.param], part)
                loaded.places.append((part, master, states, grad))
        except BaseException:
            _give_back(self.pool, loaded)
            raise
        return loaded

    def _read_into(self, loaded: _Loaded, path: Any, entry: Entry, part: Part) -> int:
        """Starts reading ``part``'s slice of ``entry`` (pages around it) at the loaded buffer's end; returns where
        the slice starts in the buffer."""
        itemsize = entry.dtype.itemsize
        offset, nbytes = entry.offset + part.start * itemsize, part.numel * itemsize
        lo, hi = windows(offset, nbytes)
        if hi > lo:
            loaded.jobs.append(self.files.read(path, loaded.buffer, hi - lo, start=loaded.end, offset=lo))
        place = loaded.end + offset - lo
        loaded.end += hi - lo
        return place

    def _read_small(self, path: Any, entry: Entry) -> Tensor:
        """A small state tensor (a parameter's scalar state) read whole into memory of its own."""
        lo, hi = windows(entry.offset, entry.nbytes)
        scratch = _aligned_buffer(max(hi - lo, PAGE))
        self.files.read(path, scratch, hi - lo, offset=lo).result()
        start = entry.offset - lo
        return scratch[start : start + entry.nbytes].view(entry.dtype).view(entry.shape).clone()

    def _step_piece(
        self,
        optimizer: Optimizer,
        index: int,
        loaded: _Loaded,
        on_disk: bool,
        owned: set[nn.Parameter],
        grad_scale: Optional[Tensor],
        grad_clip_value: Optional[float],
        fixed: dict[int, dict[str, Tensor]],
        new: _NewRecord,
    ) -> None:
        """Steps the loaded piece in its buffer and starts writing it; the buffer goes back once the writes are
        done with it."""
        record, params = self.records[index], self.params[index]
        buffer = loaded.buffer
        kept_grads: dict[int, Optional[Tensor]] = {}
        holder = SharedBuffer(self.pool, holders=1)
        try:
            self._point_piece(optimizer, index, loaded, on_disk, fixed, kept_grads)
            began = time.perf_counter()
            _step_restricted(
                optimizer, [params[part.param] for part, *_ in loaded.places], owned, grad_scale, grad_clip_value
            )
            self.clock.add("step_compute", time.perf_counter() - began)
            for part, master, _, _ in loaded.places:
                self._write_part(index, part, master, loaded, dict(optimizer.state[params[part.param]]), new, holder)
        finally:
            holder.release(buffer)
            masters = record.masters()
            for part, *_ in loaded.places:
                param = params[part.param]
                optimizer.state.pop(param, None)
                _park(param, masters[part.param].shape)
                if on_disk:
                    param.grad = None
                elif part.param in kept_grads:
                    param.grad = kept_grads[part.param]

    def _point_piece(
        self,
        optimizer: Optimizer,
        index: int,
        loaded: _Loaded,
        on_disk: bool,
        fixed: dict[int, dict[str, Tensor]],
        kept_grads: dict[int, Optional[Tensor]],
    ) -> None:
        """Points the loaded piece's parameters (a slice: a 1-D view), their state and, ``on_disk``, their gradients
        at the buffer; a slice's gradient in memory is its slice of ``.grad`` (the whole kept in ``kept_grads``)."""
        record, params = self.records[index], self.params[index]
        buffer = loaded.buffer
        for part, master, states, grad in loaded.places:
            param = params[part.param]
            full = record.masters()[part.param].shape
            shape = full if part.numel == _numel(full) else (part.numel,)
            param.data = _view(buffer, master, param.dtype, shape)
            optimizer.state.pop(param, None)
            for entry in record.entries:
                if entry.param == part.param and entry.key is not None:
                    if entry.key in states:
                        optimizer.state[param][entry.key] = _view(buffer, states[entry.key], entry.dtype, shape)
                    else:  # every slice starts from the committed value
                        optimizer.state[param][entry.key] = fixed[part.param][entry.key].clone()
            for key, value in record.values.get(part.param, {}).items():
                optimizer.state[param][key] = _decode_value(value)
            if on_disk:
                param.grad = None if grad is None else _view(buffer, grad, param.dtype, shape)
            elif shape != full:
                kept_grads[part.param] = param.grad
                if param.grad is not None:
                    param.grad = param.grad.detach().reshape(-1)[part.start : part.stop]

    def _write_part(
        self,
        index: int,
        part: Part,
        master: int,
        loaded: _Loaded,
        state: Mapping[str, Any],
        new: _NewRecord,
        holder: SharedBuffer,
    ) -> None:
        """Starts writing ``part``'s new master and state at their places in the new slot."""
        entry = new.masters[part.param]
        last = part.stop == _numel(entry.shape)
        path = self._slot_path(index, 1 - self.records[index].slot)
        self._write_slice(path, loaded.buffer, master, entry, part, last, holder, new)
        placed = new.entries_of(part, state)
        for key, target in placed.items():
            tensor = state[key]
            if target.shape == entry.shape and tensor.numel() == part.numel:
                place = _place_of(tensor, loaded)
                self._write_slice(path, loaded.buffer, place, target, part, last, holder, new)
            elif last:  # a parameter's scalar state: the last slice's (every slice stepped it alike)
                scratch = _aligned_buffer(page_rounded(max(target.nbytes, 1)))
                scratch.zero_()
                scratch[: target.nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
                new.writes.append(self.files.write_range(path, scratch, scratch.numel(), 0, target.offset))
        if last:
            values = {k: _encode_value(v) for k, v in state.items() if not isinstance(v, Tensor)}
            if values:
                new.values[part.param] = values

    def _write_slice(
        self,
        path: Any,
        buffer: Tensor,
        place: int,
        entry: Entry,
        part: Part,
        last: bool,
        holder: SharedBuffer,
        new: _NewRecord,
    ) -> None:
        """Starts writing ``part``'s slice of ``entry``, at ``place`` in ``buffer``, to its place in the new slot;
        a state tensor's last slice pads its last page with zeros (masters share pages: theirs go buffered)."""
        itemsize = entry.dtype.itemsize
        offset, nbytes = entry.offset + part.start * itemsize, part.numel * itemsize
        if last and entry.key is not None and offset % PAGE == 0 and place % PAGE == 0:  # a state tensor's own page
            padded = page_rounded(nbytes)
            if padded <= buffer.numel() - place:
                buffer[place + nbytes : place + padded].zero_()
                nbytes = padded
        if nbytes == 0:
            return
        holder.add()
        new.writes.append(
            self.files.write_range(path, buffer, nbytes, place, offset, written=lambda: holder.release(buffer))
        )


def _per_element(value: Tensor, part: Part, shape: tuple[int, ...]) -> bool:
    """Whether a state tensor of ``part`` (of a parameter of ``shape``) holds one value per element of it (else it is
    the parameter's scalar state)."""
    if part.numel == _numel(shape):
        return tuple(value.shape) == shape
    return value.numel() == part.numel


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _place_of(tensor: Tensor, loaded: _Loaded) -> int:
    """Where ``tensor`` (a state slice) lies in the loaded buffer: the optimizer updated it in place, or it is new and
    is copied to the buffer's free end (a page of its own)."""
    buffer = loaded.buffer
    start = tensor.data_ptr() - buffer.data_ptr()
    nbytes = tensor.numel() * tensor.element_size()
    if 0 <= start and start + nbytes <= buffer.numel() and tensor.is_contiguous():
        return start
    place = page_rounded(loaded.end)
    if place + page_rounded(nbytes) > buffer.numel():
        raise DiskTierError(
            f"The optimizer's new state ({nbytes} bytes for a piece) outgrew the pool's buffer of {buffer.numel()}"
            " bytes. Raise host_buffer_bytes, or leave it unset."
        )
    buffer[place : place + nbytes].view(tensor.dtype).copy_(tensor.detach().reshape(-1))
    loaded.end = place + page_rounded(nbytes)
    return place


def _view(buffer: Tensor, start: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    return buffer[start : start + _numel(shape) * dtype.itemsize].view(dtype).view(tuple(shape))


def _give_back(pool: Any, loaded: _Loaded) -> None:
    """Gives the loaded buffer back once no read fills it."""
    for job in loaded.jobs:
        job.exception()
    pool.release(loaded.buffer)


def _step_restricted(
    optimizer: Optimizer,
    params: Sequence[nn.Parameter],
    owned: set[nn.Parameter],
    grad_scale: Optional[Tensor],
    grad_clip_value: Optional[float],
) -> None:
    """Steps ``optimizer`` over those of ``params`` it owns that have gradients, scaled by ``grad_scale`` and then
    clamped to ``grad_clip_value`` first (as clipping would)."""
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
