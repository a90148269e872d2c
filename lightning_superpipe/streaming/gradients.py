"""The way back: gradients from the device into the fp32 ``.grad`` of the host parameters.

A block's gradients are copied into a host staging buffer as soon as its backward delivers them (on CUDA
asynchronously, on their own stream). Adding them into ``.grad`` is host work of the order of the block's size,
longer than a block's backward on a fast GPU; done on the autograd thread it would starve the device. On CUDA a
single worker thread does it instead, while the autograd thread goes on launching the next block (with a CPU
compute device there is nothing to overlap with, and the adds run in line). Two staging buffers
alternate, so one block can be copied while the previous one is being added.

The parameters outside blocks (the trunk: embeddings, heads) are counted as they are used in forward; a trunk
gradient leaves the device as soon as every use has delivered its part (an untied head's early in backward, an
embedding's at its end), summed on the device first as autograd sums the gradients of a parameter used twice.

Only gradients that exist travel: a parameter that took no part in the loss (an expert no token was routed to, a
branch not taken) keeps ``.grad`` as it was, as in plain training, and which parameters are trainable is read
from their ``requires_grad`` at every step.

Gradients land in persistent fp32 buffers (one flat buffer per block, like the weights), so that steps after the
first allocate no host memory.

Under several devices an :class:`~.distributed.GradientAverager` (``averager``) averages each block's gradients, and
each trunk parameter's, across ranks on the device before they leave it; the averaged result, which already holds
what ``.grad`` held, replaces ``.grad`` (:mod:`.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.host import ParamSlice
from lightning_superpipe.memory.pinned import HostArena
from lightning_superpipe.streaming.copier import Copier, Event
from lightning_superpipe.streaming.distributed import GradientAverager, Reduction
from lightning_superpipe.streaming.ledger import DeviceLedger


class GradientReturn:
    """Carries gradients off the device and accumulates them into host ``.grad``, as autograd would.

    Args:
        copier: Issues the device-to-host copies.
        ledger: Counts gradients while they occupy the device.
        homes: The blocks' host homes (``None`` for a block with nothing to stream).
        arena: Where staging buffers come from (page-locked with a CUDA compute device).
        keep_grad_homes: Keep each block's gradient buffer between steps (the host tier); ``False`` (the disk tier)
            lets it go once the block's gradients are complete, when ``on_block_complete`` takes them away.
    """

    def __init__(
        self,
        copier: Copier,
        ledger: DeviceLedger,
        homes: Sequence[Optional[Any]],
        arena: HostArena,
        keep_grad_homes: bool = True,
    ) -> None:
        self.copier = copier
        self.keep_grad_homes = keep_grad_homes
        self.arena = arena
        self.ledger = ledger
        self.homes = homes
        # Staging only where copies are asynchronous (on a CPU device gradients are added from where they are),
        # sized on first use, since which parameters train may change between steps.
        self._block_staging: list[Optional[Tensor]] = [None, None]
        self._staging_users: list[Optional[Future[None]]] = [None, None]
        self._next_staging = 0
        self._trunk_staging: dict[nn.Parameter, Tensor] = {}
        self._trunk_staging_users: dict[nn.Parameter, Future[None]] = {}
        self._block_grad_homes: dict[int, Tensor] = {}
        self._trunk_grad_homes: dict[nn.Parameter, Tensor] = {}
        self._in_flight: list[tuple[Event, str, int]] = []  # copies whose device source is still counted
        self._futures: list[Future[None]] = []
        self._trunk_sums: dict[nn.Parameter, Tensor] = {}
        self._trunk_pending: dict[nn.Parameter, int] = {}
        self._block_pending: dict[int, int] = {}
        #: Called with a block's index once all its gradients of this backward are in ``.grad``.
        self.on_block_complete: Optional[Callable[[int], None]] = None
        #: Called with a parameter outside the blocks once every use in forward delivered its gradient into ``.grad``.
        self.on_trunk_complete: Optional[Callable[[nn.Parameter], None]] = None
        #: Averages gradients across ranks before they leave the device (several devices); ``None`` on one.
        self.averager: Optional[GradientAverager] = None
        #: Called with a block's index before its gradients are averaged across ranks: the disk tier puts what the
        #: earlier micro-batches spilled back into ``.grad``, which the reduction folds in.
        self.before_reduce: Optional[Callable[[int], None]] = None
        self._reducing: list[tuple[Reduction, list[ParamSlice], Callable[[Reduction], None]]] = []
        self._last_future: dict[Any, Future[None]] = {}  # per block index or trunk parameter: its latest addition
        # With a CPU compute device there is nothing to overlap with: the host adds in line.
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="superpipe-gradients", initializer=copier.thread_initializer())
            if copier.asynchronous
            else None
        )

    def send_block(self, index: int, pieces: Sequence[ParamSlice], grads: Sequence[Optional[Tensor]]) -> None:
        """Takes the gradients of block ``index``'s ``pieces`` (``None`` for a parameter that got none) off the
        device."""
        self._block_pending[index] = pending = self._block_pending.get(index, 0) - 1
        complete = partial(self.on_block_complete, index) if pending == 0 and self.on_block_complete else None
        if complete is not None and not self.keep_grad_homes:
            complete = partial(self._let_go, index, complete)
        if self.averager is not None and self.averager.sync:
            if self.before_reduce is not None:
                self.before_reduce(index)
            nbytes = sum(grad.numel() * grad.element_size() for grad in grads if grad is not None)
            self.ledger.add("block_gradients", nbytes)
            ship = partial(self._ship_averaged_block, index, list(pieces), complete)
            self._average(index, list(pieces), grads, "block_gradients", nbytes, ship)
            return
        present = [(piece, grad) for piece, grad in zip(pieces, grads) if grad is not None]
        nbytes = sum(grad.numel() * grad.element_size() for _, grad in present)
        # This block's gradients exist on the device already, while the previous block's may still be on their way
        # to the host (the allocator keeps their memory until the copy ran): up to two blocks' gradients at once.
        self.ledger.add("block_gradients", nbytes)
        self._ship_block(index, present, complete, nbytes)

    def _ship_block(
        self,
        index: int,
        present: list[tuple[ParamSlice, Tensor]],
        complete: Optional[Callable[[], None]],
        nbytes: int,
        flags: Optional[Tensor] = None,
    ) -> None:
        """Copies ``present`` gradients to the host and accumulates them (with ``flags``, averaged ones: replaces
        ``.grad`` where the flag says some rank had a gradient). ``nbytes`` of them are counted on the device."""
        self._finish_copies()
        if not present:
            if complete is not None:
                complete()
            return
        done: Event = None
        staged_flags = flags
        if self.copier.asynchronous:
            numel = sum(grad.numel() for _, grad in present) + (flags.numel() if flags is not None else 0)
            staging, slot = self._staging(numel, present[0][1].dtype)
            staged, offset = [], 0
            for _, grad in present:
                view = staging[offset : offset + grad.numel()].view(grad.shape)
                offset += grad.numel()
                done = self.copier.to_host(view, grad, f"gradient staging {slot}")
                staged.append(view)
            if flags is not None:
                staged_flags = staging[offset : offset + flags.numel()]
                done = self.copier.to_host(staged_flags, flags, f"gradient staging {slot} flags")
        else:
            staged = [grad for _, grad in present]  # already in host memory, and added below before autograd lets go
        arrived = [piece for piece, _ in present]
        future = self._submit(
            partial(self._accumulate, arrived, staged, done, self._grad_home(index), complete, staged_flags)
        )
        self._leaving(done, "block_gradients", nbytes)
        if self.copier.asynchronous:
            self._staging_users[slot] = future
        self._futures.append(future)
        self._last_future[index] = future

    def _ship_averaged_block(
        self, index: int, pieces: list[ParamSlice], complete: Optional[Callable[[], None]], reduction: Reduction
    ) -> None:
        assert self.averager is not None
        if not self.averager.owns(pieces[0].param):  # shard_optimizer: another rank keeps and steps this block
            self._disown(pieces, "block_gradients", reduction)
            self._block_grad_homes.pop(index, None)
            if complete is not None:
                complete()
            return
        self._ship_block(index, list(zip(pieces, reduction.views)), complete, reduction.nbytes, reduction.flags)

    def _disown(self, pieces: list[ParamSlice], category: str, reduction: Reduction) -> None:
        """Drops what this rank accumulated of gradients another rank owns (``shard_optimizer``): no ``.grad``, so
        the optimizer keeps no state for them here either."""
        self.ledger.remove(category, reduction.nbytes)
        for piece in pieces:
            piece.param.grad = None

    def _average(
        self,
        key: Any,
        pieces: list[ParamSlice],
        grads: Sequence[Optional[Tensor]],
        category: str,
        counted: int,
        ship: Callable[[Reduction], None],
    ) -> None:
        """Starts averaging ``grads`` (what ``.grad`` holds folded in) across ranks; ``ship`` takes the result once
        it is there. ``counted`` bytes of ``grads`` are on the ledger; the reduction's buffer replaces them."""
        assert self.averager is not None
        self._drain()  # the previous block's reduction lands first: at most two blocks of gradients on the device
        if any(piece.param.grad is not None for piece in pieces):
            earlier = self._last_future.get(key)  # an earlier call of this block in this backward still adding
            if earlier is not None:
                earlier.result()
        priors = [piece.param.grad for piece in pieces]
        shapes = [piece.shape for piece in pieces]
        owner = self.averager.owner(pieces[0].param)  # shard_optimizer: the rank that keeps them; else every rank
        reduction = self.averager.start(grads, priors, shapes, pieces[0].param.dtype, owner)
        self.ledger.add(category, reduction.nbytes)
        self.ledger.remove(category, counted)
        self._reducing.append((reduction, pieces, ship))
        if not self.averager.deferred:
            self._drain()

    def _drain(self) -> None:
        """Ships every reduction in flight, in the order they started (waiting for gloo's)."""
        reducing, self._reducing = self._reducing, []
        for reduction, _, ship in reducing:
            reduction.wait()
            with reduction.context():
                ship(reduction)

    def expect_block(self, index: int) -> None:
        """Counts one call of block ``index`` in forward whose backward will deliver gradients."""
        self._block_pending[index] = self._block_pending.get(index, 0) + 1

    def expect_trunk(self, param: nn.Parameter) -> None:
        """Counts one use of a resident parameter in forward: its gradient is complete when every use delivered."""
        self._trunk_pending[param] = self._trunk_pending.get(param, 0) + 1

    def send_trunk(self, param: nn.Parameter, grad: Optional[Tensor]) -> None:
        """Takes one use's gradient of a resident parameter; the sum leaves the device once all uses delivered.

        Autograd sums the gradients of a parameter used several times (tied, or called twice) before adding them
        into ``.grad``; summing them the same way keeps gradient accumulation exact.
        """
        pending = self._trunk_pending.get(param, 0) - 1
        self._trunk_pending[param] = pending
        if grad is not None:
            previous = self._trunk_sums.get(param)
            if previous is None:
                self.ledger.add("trunk_gradients", grad.numel() * grad.element_size())
                self._trunk_sums[param] = grad
            else:
                self._trunk_sums[param] = previous + grad
        if pending <= 0:
            self._ship_trunk(param, complete=True)

    def finish(self) -> None:
        """Waits until every gradient of this backward is in ``.grad`` (re-raising the worker's errors)."""
        # Uses whose output never reached the loss deliver nothing: what the others delivered is complete now. Under
        # several devices every parameter used in forward is reduced, in forward's order, gradient or not, so that
        # every rank issues the same collectives.
        remaining = list(self._trunk_sums)
        if self.averager is not None and self.averager.sync:
            remaining = list(self._trunk_pending) + [p for p in remaining if p not in self._trunk_pending]
        for param in remaining:
            self._ship_trunk(param)
        self._drain()
        self._trunk_pending.clear()
        self._block_pending.clear()
        self._last_future.clear()
        self._finish_copies()
        for future in self._futures:
            future.result()
        self._futures.clear()
        self._staging_users = [None, None]
        self._trunk_staging_users.clear()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _ship_trunk(self, param: nn.Parameter, complete: bool = False) -> None:
        grad = self._trunk_sums.pop(param, None)
        self._trunk_pending.pop(param, None)
        piece = ParamSlice(param, 0, param.numel(), param.shape)
        if self.averager is not None and self.averager.sync:
            counted = grad.numel() * grad.element_size() if grad is not None else 0
            ship = partial(self._ship_averaged_trunk, param, piece, complete)
            self._average(param, [piece], [grad], "trunk_gradients", counted, ship)
            return
        if grad is None:
            return
        self._copy_trunk(param, piece, grad, complete, grad.numel() * grad.element_size())

    def _ship_averaged_trunk(
        self, param: nn.Parameter, piece: ParamSlice, complete: bool, reduction: Reduction
    ) -> None:
        assert self.averager is not None
        if not self.averager.owns(param):
            self._disown([piece], "trunk_gradients", reduction)
            self._trunk_grad_homes.pop(param, None)
            return
        self._copy_trunk(param, piece, reduction.views[0], complete, reduction.nbytes, reduction.flags)

    def _copy_trunk(
        self, param: nn.Parameter, piece: ParamSlice, grad: Tensor, complete: bool, nbytes: int,
        flags: Optional[Tensor] = None,
    ) -> None:
        done: Event = None
        staged, staged_flags = grad, flags
        if self.copier.asynchronous:
            user = self._trunk_staging_users.get(param)
            if user is not None:
                user.result()  # the worker is done reading this staging buffer
            numel = param.numel() + (flags.numel() if flags is not None else 0)
            buffer = self._trunk_staging.get(param)
            if buffer is None or buffer.dtype != grad.dtype or buffer.numel() < numel:
                buffer = self.arena.empty(numel, grad.dtype)
                self._trunk_staging[param] = buffer
            staged = buffer[: param.numel()].view(param.shape)
            done = self.copier.to_host(staged, grad, f"trunk gradient staging {tuple(param.shape)}")
            if flags is not None:
                staged_flags = buffer[param.numel() : numel]
                done = self.copier.to_host(staged_flags, flags, f"trunk gradient staging {tuple(param.shape)} flags")
        if param not in self._trunk_grad_homes:
            self._trunk_grad_homes[param] = torch.zeros(param.numel(), dtype=param.dtype)
        then = partial(self.on_trunk_complete, param) if complete and self.on_trunk_complete else None
        future = self._submit(
            partial(self._accumulate, [piece], [staged], done, self._trunk_grad_homes[param], then, staged_flags)
        )
        self._leaving(done, "trunk_gradients", nbytes)
        self._trunk_staging_users[param] = future
        self._futures.append(future)
        self._last_future[param] = future

    def _staging(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        """The next of the two staging buffers, once the worker is done with it, grown if it is too small."""
        slot = self._next_staging
        self._next_staging ^= 1
        user = self._staging_users[slot]
        if user is not None:
            user.result()
        buffer = self._block_staging[slot]
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self.arena.empty(numel, dtype)
            self._block_staging[slot] = buffer
        return buffer, slot

    def _leaving(self, done: Event, category: str, nbytes: int) -> None:
        """Counts gradients off the device once their copy is done: now for a synchronous copy, else when
        :meth:`_finish_copies` has waited for it."""
        if done is None and not self.copier.asynchronous:
            self.ledger.remove(category, nbytes)
        else:
            self._in_flight.append((done, category, nbytes))

    def _finish_copies(self) -> None:
        for done, category, nbytes in self._in_flight:
            self.copier.wait_on_host(done)
            self.ledger.remove(category, nbytes)
        self._in_flight.clear()

    def _let_go(self, index: int, then: Callable[[], None]) -> None:
        """Forgets block ``index``'s gradient buffer (its ``.grad`` views keep it until ``then`` drops them)."""
        self._block_grad_homes.pop(index, None)
        then()

    def _grad_home(self, index: int) -> Tensor:
        """The block's persistent gradient buffer, laid out like its masters (not its frozen packed weights)."""
        if index not in self._block_grad_homes:
            home = self.homes[index]
            assert home is not None
            self._block_grad_homes[index] = torch.zeros(home.master_numel, dtype=home.master_dtype)
        return self._block_grad_homes[index]

    def _submit(self, work: Callable[[], None]) -> Future[None]:
        """Runs ``work`` on the worker, or in line where there is none."""
        if self._worker is not None:
            return self._worker.submit(work)
        work()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _accumulate(
        self,
        pieces: list[ParamSlice],
        staged: list[Tensor],
        done: Event,
        grad_home: Tensor,
        then: Optional[Callable[[], None]] = None,
        flags: Optional[Tensor] = None,
    ) -> None:
        """Runs on the worker: ``.grad += staged``, or ``.grad = staged`` (in the masters' dtype) for the first
        micro-batch after ``zero_grad``; then ``then`` (the block's gradients are complete).

        With ``flags`` (averaged gradients, which already hold what ``.grad`` held) ``.grad = staged``, for the
        parameters whose flag says some rank had a gradient; the others keep ``.grad`` as it was."""
        self.copier.wait_on_host(done)
        used = flags.tolist() if flags is not None else None
        for number, (piece, grad) in enumerate(zip(pieces, staged)):
            param = piece.param
            if used is not None and not used[number]:
                continue
            if param.grad is None:
                param.grad = piece.view_of(grad_home)
                param.grad.copy_(grad)
            elif used is not None:
                param.grad.copy_(grad)
            else:
                param.grad.add_(grad)
        if then is not None:
            then()
