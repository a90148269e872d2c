"""The way back: gradients from the device into the fp32 ``.grad`` of the host parameters.

A block's gradients are copied into a host staging buffer as soon as its backward delivers them (on CUDA
asynchronously, on their own stream). Adding them into ``.grad`` is host work of the order of the block's size,
longer than a block's backward on a fast GPU; done on the autograd thread it would starve the device. On CUDA a
single worker thread does it instead, while the autograd thread goes on launching the next block (with a CPU
compute device there is nothing to overlap with, and the adds run in line). Two staging buffers
alternate, so one block can be copied while the previous one is being added.

Gradients land in persistent fp32 buffers (one flat buffer per block, like the weights), so that steps after the
first allocate no host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.host import BlockHome, ParamSlice
from lightning_superpipe.streaming.copier import Copier, Event
from lightning_superpipe.streaming.ledger import DeviceLedger


class GradientReturn:
    """Carries gradients off the device and accumulates them into host ``.grad``, as autograd would.

    Args:
        copier: Issues the device-to-host copies.
        ledger: Counts block gradients while they occupy the device.
        homes: The blocks' host homes (``None`` for a block with nothing to stream).
        trunk_params: The resident parameters, whose gradients return too.
    """

    def __init__(
        self,
        copier: Copier,
        ledger: DeviceLedger,
        homes: Sequence[Optional[BlockHome]],
        trunk_params: Sequence[nn.Parameter],
    ) -> None:
        self.copier = copier
        self.ledger = ledger
        self.homes = homes
        pin = copier.pin_memory
        trainable = [home for home in homes if home is not None and home.trainable]
        staging_numel = max((home.numel for home in trainable), default=0)
        staging_dtype = trainable[0].transfer.dtype if trainable else torch.float32
        # Staging only where copies are asynchronous; on a CPU device gradients are added from where they are.
        staging_numel = staging_numel if copier.asynchronous else 0
        self._block_staging = [torch.empty(staging_numel, dtype=staging_dtype, pin_memory=pin) for _ in range(2)]
        self._staging_users: list[Optional[Future[None]]] = [None, None]
        self._next_staging = 0
        self._trunk_staging = {
            param: torch.empty(param.shape, dtype=param.dtype, pin_memory=pin)
            for param in trunk_params
            if param.requires_grad and copier.asynchronous
        }
        self._block_grad_homes: dict[int, Tensor] = {}
        self._trunk_grad_homes: dict[nn.Parameter, Tensor] = {}
        self._in_flight: Optional[tuple[Event, int]] = None  # the last block copy: its event and device bytes
        self._futures: list[Future[None]] = []
        self._trunk_sums: dict[nn.Parameter, Tensor] = {}
        # With a CPU compute device there is nothing to overlap with: the host adds in line.
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="superpipe-gradients") if copier.asynchronous else None
        )

    def send_block(self, index: int, grads: Sequence[Optional[Tensor]]) -> None:
        """Takes the gradients of block ``index``'s trainable parameters (in ``home.trainable`` order) off the
        device."""
        # The previous block's gradients leave the device before this block's are counted: at most one block's
        # gradients occupy it.
        self._finish_copy()
        home = self.homes[index]
        assert home is not None
        slot = self._next_staging
        self._next_staging ^= 1
        if self._staging_users[slot] is not None:
            self._staging_users[slot].result()  # the worker is done reading this staging buffer
        pieces, staged, nbytes, done, offset = [], [], 0, None, 0
        for piece, grad in zip(home.trainable, grads):
            if grad is None:
                continue
            if self.copier.asynchronous:
                view = self._block_staging[slot][offset : offset + grad.numel()].view(grad.shape)
                offset += grad.numel()
                done = self.copier.to_host(view, grad)
            else:
                view = grad  # already in host memory, and added below before autograd lets go of it
            pieces.append(piece)
            staged.append(view)
            nbytes += grad.numel() * grad.element_size()
        self.ledger.add_gradients(nbytes)
        self._in_flight = (done, nbytes)
        future = self._submit(pieces, staged, done, self._grad_home(index))
        self._staging_users[slot] = future
        self._futures.append(future)

    def send_trunk(self, param: nn.Parameter, grad: Tensor) -> None:
        """Takes one gradient of a resident parameter; they leave the device summed, when the backward ends.

        Autograd sums the gradients of a parameter used several times (tied, or called twice) before adding them
        into ``.grad``; summing them the same way keeps gradient accumulation exact. Plain training keeps these
        gradients on the device too.
        """
        previous = self._trunk_sums.get(param)
        self._trunk_sums[param] = grad if previous is None else previous + grad

    def finish(self) -> None:
        """Waits until every gradient of this backward is in ``.grad`` (re-raising the worker's errors)."""
        self._finish_copy()
        for param, grad in self._trunk_sums.items():
            piece = ParamSlice(param, 0, param.numel(), param.shape)
            staged, done = grad, None
            if self.copier.asynchronous:
                staged = self._trunk_staging[param]
                done = self.copier.to_host(staged, grad)
            if param not in self._trunk_grad_homes:
                self._trunk_grad_homes[param] = torch.zeros(param.numel(), dtype=param.dtype)
            self._futures.append(self._submit([piece], [staged], done, self._trunk_grad_homes[param]))
        self._trunk_sums.clear()
        for future in self._futures:
            future.result()
        self._futures.clear()
        self._staging_users = [None, None]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def host_bytes(self) -> int:
        """Host bytes of staging buffers (gradients themselves are counted as the parameters' ``.grad``)."""
        staging = self._block_staging + list(self._trunk_staging.values())
        return sum(t.numel() * t.element_size() for t in staging)

    def _finish_copy(self) -> None:
        if self._in_flight is not None:
            done, nbytes = self._in_flight
            self.copier.wait_on_host(done)
            self.ledger.remove_gradients(nbytes)
            self._in_flight = None

    def _grad_home(self, index: int) -> Tensor:
        """The block's persistent gradient buffer, laid out like its weights."""
        if index not in self._block_grad_homes:
            home = self.homes[index]
            assert home is not None
            self._block_grad_homes[index] = torch.zeros(home.numel, dtype=home.master_dtype)
        return self._block_grad_homes[index]

    def _submit(self, pieces: list[ParamSlice], staged: list[Tensor], done: Event, grad_home: Tensor) -> Future[None]:
        if self._worker is not None:
            return self._worker.submit(self._accumulate, pieces, staged, done, grad_home)
        self._accumulate(pieces, staged, done, grad_home)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _accumulate(self, pieces: list[ParamSlice], staged: list[Tensor], done: Event, grad_home: Tensor) -> None:
        """Runs on the worker: ``.grad += staged``, or ``.grad = staged`` (in the masters' dtype) for the first
        micro-batch after ``zero_grad``."""
        self.copier.wait_on_host(done)
        for piece, grad in zip(pieces, staged):
            param = piece.param
            if param.grad is None:
                param.grad = piece.view_of(grad_home)
                param.grad.copy_(grad)
            else:
                param.grad.add_(grad)
