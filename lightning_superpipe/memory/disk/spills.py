"""Gradients spilled to files: a block's fp32 gradients written to its gradient file (added to those spilled before
when accumulating), read back by the step or by a caller, their norms kept for clipping by global norm.

The gradient file is scratch: never ``fsync``ed nor committed, so a crash loses only the step in progress."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.disk.entry_io import EntryIO
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.folder import _grad_name


class GradientSpills(EntryIO):
    """The gradient files of a :class:`~lightning_superpipe.memory.disk.DiskStore` (one of its parts)."""

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
        if nbytes > self.pool.buffer_bytes:
            future = self._spill_in_pieces(index, grads, accumulate, norms)
            self._spill_writes[index] = future
            if wait:
                future.result()
            return future
        buffer = self.pool.acquire(nbytes)
        try:
            if accumulate and present:
                self.files.read(path, buffer, nbytes).result()
            self._gather_grads(index, buffer, grads, accumulate)
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
        path = self.path / _grad_name(index)
        if nbytes > self.pool.buffer_bytes:
            grads = [self._read_entry(path, entry) if entry.param in present else None for entry in entries]
        else:
            buffer = self.pool.acquire(nbytes)
            try:
                self.files.read(path, buffer, nbytes).result()
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

    def _spill_in_pieces(self, index: int, grads: Sequence[Optional[Tensor]], accumulate: bool,
                         norms: bool) -> Future[None]:
        """:meth:`spill_grads` of a block whose gradients do not fit a buffer: each gradient (added to what was
        spilled of it, read back into memory of its own) written a buffer at a time; its norm taken whole."""
        entries = self.records[index].masters()
        for entry, grad in zip(entries, grads):
            if grad is not None:
                _check_grad(self.names[index][entry.param], grad, entry.shape, entry.dtype)
        path = self.path / _grad_name(index)
        present = self._grads_present[index]
        self.files.begin(path, self._grad_bytes(index), scratch=True)
        writes: list[Future[None]] = []
        kept: list[Optional[Tensor]] = []
        try:
            for entry, grad in zip(entries, grads):
                had = accumulate and entry.param in present
                value = None
                if grad is not None:
                    value = grad.detach().to("cpu").contiguous()
                    if had:  # spilled + new, as the whole block's spill adds them
                        value = self._read_entry(path, entry).add_(value)
                    writes.extend(self._write_entry(path, entry, value))
                elif had and norms:
                    value = self._read_entry(path, entry)
                kept.append(torch.linalg.vector_norm(value, 2.0) if norms and value is not None else None)
        except BaseException:
            for job in writes:
                job.exception()
            raise
        if not accumulate:
            present.clear()
        present.update(i for i, g in enumerate(grads) if g is not None)
        self._grad_norms[index] = kept if norms else None
        return self.files.finish(path, self._grad_bytes(index), writes, durable=False)

    def _gather_grads(self, index: int, buffer: Tensor, grads: Sequence[Optional[Tensor]], accumulate: bool) -> None:
        """Copies block ``index``'s ``grads`` into ``buffer`` (which holds its spilled gradients when
        ``accumulate``), adding them to those already spilled when ``accumulate``.

        Raises:
            ValueError: A gradient's shape or dtype differs from its parameter's.
        """
        present = self._grads_present[index]
        for entry, grad in zip(self.records[index].masters(), grads):
            view = entry.view_of(buffer)
            if grad is None:
                if not (accumulate and entry.param in present):
                    view.zero_()
                continue
            _check_grad(self.names[index][entry.param], grad, tuple(view.shape), view.dtype)
            if accumulate and entry.param in present:
                view.add_(grad.detach().to("cpu"))
            else:
                view.copy_(grad.detach())


def _check_grad(name: str, grad: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Refuses a gradient whose shape or dtype differs from its parameter's.

    Raises:
        ValueError: Naming the parameter.
    """
    if tuple(grad.shape) != tuple(shape) or grad.dtype != dtype:
        raise ValueError(
            f"The gradient of {name} has shape {tuple(grad.shape)} and dtype {grad.dtype}; its parameter has"
            f" {tuple(shape)} and {dtype}."
        )
