"""The host optimizer step, block by block, while backward is still running.

Offloaded training usually leaves the device idle while the host steps the optimizer after backward. A block's
gradients are complete as soon as its backward has delivered them (the last block first), so its parameters can be
stepped then, on a host thread, while backward goes on with the blocks before it. :class:`OverlappedStep` does that
with the user's own optimizer, stepping it over one block's parameters at a time (its ``param_groups`` restricted
to them, so hyperparameters, state, schedules and checkpoints are those of the optimizer as configured), and
afterwards lets the optimizer's own step update only what is left (blocks not stepped, and the parameters outside
the blocks whose gradients complete only at the end, such as the input embedding). An untied head and the final
norm are complete as backward starts: they are stepped then, on the same thread. Each block's
transfer copy is brought up to date on the same thread right after its step, so that after backward only the copies
to the device remain.

Where something known only at the end of backward may change the step (clipping by the global norm, the gradient
scaler's check for infinities), the step is speculative: each block's masters and optimizer state are kept
(:class:`~.speculation.KeptState`) before it is stepped, and after backward the step is committed (the kept copies
dropped), redone from the kept state with the final gradients, or discarded (a step the scaler skips). Which mode a
step runs in is :mod:`.step_modes`' choice. The step is armed only for the micro-batch whose backward runs inside
``optimizer.step(closure)``, the last of an accumulation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.stepping.param_groups import restrict, restricted, unrestrict
from lightning_superpipe.stepping.speculation import KeptState


class OverlappedStep:
    """Steps the armed optimizer over each block's parameters as soon as the block's gradients are complete.

    Args:
        block_params: Each block's streamed parameters.
    """

    def __init__(self, block_params: Sequence[Sequence[nn.Parameter]]) -> None:
        self.block_params = block_params
        self._optimizer: Optional[Optimizer] = None
        self._owned: set[nn.Parameter] = set()
        self._stepped: set[nn.Parameter] = set()
        self._stepped_blocks: dict[int, list[nn.Parameter]] = {}
        self._futures: list[Future[None]] = []
        self._groups: Optional[list[list[nn.Parameter]]] = None
        self._kept: Optional[KeptState] = None
        self._prepare: Optional[Callable[[list[nn.Parameter]], None]] = None
        self._blocks_only = False
        self._measure: Optional[Callable[[list[nn.Parameter]], None]] = None
        self._step_too = True
        #: The thread every host step runs on, in the order submitted (the pipelined step's too).
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="superpipe-optimizer")
        #: Blocks stepped during backward, over the whole run.
        self.blocks_stepped = 0
        #: Parameters outside the blocks stepped during backward, over the whole run.
        self.trunk_params_stepped = 0
        #: Trunk parameters the homes step themselves (the disk tier's in its files): not stepped here.
        self.homed_trunk: frozenset[nn.Parameter] = frozenset()
        #: Called on the optimizer thread with a block's index and parameters as soon as they are stepped.
        self.on_stepped: Optional[Callable[[int, list[nn.Parameter]], None]] = None
        #: Steps one block instead of the optimizer restricted to it (the disk tier steps through its store).
        self.step_block: Optional[Callable[[Optimizer, int, list[nn.Parameter]], None]] = None
        #: At most this many blocks' steps wait for the optimizer thread (or run on it) when backward hands it another;
        #: ``None``: no bound. The disk tier's gradients live in memory until their block is stepped: a thread slower
        #: than backward (a step bound by the disk) would otherwise hold every block's gradients at once.
        self.waiting_blocks_limit: Optional[int] = None
        self._block_steps: deque[Future[None]] = deque()

    @property
    def armed(self) -> bool:
        """Whether blocks are stepped as their gradients complete (this micro-batch's backward)."""
        return self._optimizer is not None

    @property
    def speculating(self) -> bool:
        """Whether this backward's steps are speculative: kept, until :meth:`commit`, :meth:`redo` or
        :meth:`discard`."""
        return self._kept is not None

    def arm(
        self,
        optimizer: Optimizer,
        kept: Optional[KeptState] = None,
        prepare: Optional[Callable[[list[nn.Parameter]], None]] = None,
        blocks_only: bool = False,
        measure: Optional[Callable[[list[nn.Parameter]], None]] = None,
        step: bool = True,
    ) -> None:
        """Steps ``optimizer`` block by block in this backward. With ``kept``, each block's masters and state are kept
        first (a speculative step); ``prepare`` runs on each block's gradients first (unscaling, clipping by value),
        then ``measure`` (their norms, for clipping after backward). With ``blocks_only`` (the homes decide a
        speculative step themselves) the parameters outside the blocks are left to the optimizer's own step, and its
        groups stay whole: the homes took the blocks' gradients away. With ``step=False`` only ``measure`` runs (the
        step is taken after backward)."""
        self._optimizer = optimizer
        self._owned = {p for group in optimizer.param_groups for p in group["params"]}
        self._stepped, self._stepped_blocks = set(), {}
        self._kept, self._prepare, self._blocks_only = kept, prepare, blocks_only
        self._measure, self._step_too = measure, step

    def keep_ahead(self) -> None:
        """Starts keeping the state of every trainable parameter the optimizer owns on the optimizer thread, in the
        order backward will step them (the last block first), so that the copies run during forward instead of
        between a block's gradients and its step. Nothing changes them before their step."""
        if self._kept is None or self._optimizer is None:
            return
        order = [p for params in reversed(self.block_params) for p in params]
        inside = set(order)
        order += [p for group in self._optimizer.param_groups for p in group["params"] if p not in inside]
        params = [p for p in order if p in self._owned and p.requires_grad]
        if params:
            self._futures.append(self.executor.submit(self._kept.keep, params))

    def block_done(self, index: int) -> None:
        """Called once block ``index``'s gradients are all in ``.grad`` (on the thread that added them)."""
        if self._optimizer is None:
            return
        params = [p for p in self.block_params[index] if p in self._owned and p.grad is not None]
        if params and not self._step_too:
            if self._measure is not None:
                self._futures.append(self.executor.submit(self._measure, params))
        elif params:
            self._stepped.update(params)
            self._stepped_blocks[index] = params
            self._wait_for_room()
            future = self.executor.submit(self._step, index, params)
            self._futures.append(future)
            self._block_steps.append(future)

    def _wait_for_room(self) -> None:
        """Waits, on the thread that completes blocks, until fewer than :attr:`waiting_blocks_limit` blocks' steps are
        pending (an error of one is raised after backward, by :meth:`finish`, as without a bound)."""
        steps, limit = self._block_steps, self.waiting_blocks_limit
        while steps and (steps[0].done() or (limit is not None and len(steps) >= limit)):
            steps.popleft().exception()  # waits; returns the error instead of raising it

    def trunk_done(self, param: nn.Parameter) -> None:
        """Called once a parameter outside the blocks has its whole gradient in ``.grad`` (every use in forward
        delivered): an untied head and the final norm are complete as backward starts, so their step hides behind
        the blocks' backward instead of waiting for its end."""
        if self._optimizer is None or self._blocks_only or param not in self._owned or param.grad is None:
            return
        if param in self.homed_trunk:
            return
        if not self._step_too:
            if self._measure is not None:
                self._futures.append(self.executor.submit(self._measure, [param]))
            return
        if param in self._stepped:
            return
        self._stepped.add(param)
        self._futures.append(self.executor.submit(self._step_trunk, param))

    def finish(self) -> None:
        """After backward: waits for the block steps, and (unless they are speculative, when the decision does)
        leaves the optimizer's own step only what is left."""
        if self._optimizer is None:
            return
        self._wait()
        if self._kept is None and not self._blocks_only and self._step_too:
            self._leave_the_rest()

    def commit(self) -> None:
        """The speculative steps were the right ones: the kept state goes, the optimizer's step takes the rest."""
        assert self._kept is not None
        self._kept.clear()
        self._kept = None
        self._leave_the_rest()

    def redo(self) -> None:
        """The speculative steps were not the right ones (the gradients changed after them): each block's kept state
        comes back and the block is stepped again with ``.grad`` as it is now, in this thread; the optimizer's step
        takes the rest."""
        assert self._optimizer is not None and self._kept is not None
        self._kept.restore(self._stepped)
        self._kept = None
        blocks = set()
        for index, params in self._stepped_blocks.items():
            self._step_again(index, params, count=False)
            blocks.update(params)
        trunk = [p for p in self._stepped if p not in blocks]
        if trunk:
            self._step_only(trunk)
        self._leave_the_rest()

    def discard(self) -> None:
        """The step does not happen (a gradient scaler found infinities): the kept state comes back, and the next
        pass copies the restored masters (their version counters moved)."""
        if self._kept is not None:
            self._kept.restore(self._stepped)
            self._kept = None

    def _leave_the_rest(self) -> None:
        assert self._optimizer is not None
        self._groups = restrict(self._optimizer, {p for p in self._owned if p not in self._stepped})

    def disarm(self) -> None:
        """After the optimizer's step: its parameter groups are whole again."""
        self._wait()  # a backward that raised may leave steps behind
        if self._optimizer is not None and self._groups is not None:
            unrestrict(self._optimizer, self._groups)
        self.discard()  # an exception between backward and the decision leaves the step undone, as plain's
        self._optimizer, self._groups, self._prepare, self._measure, self._step_too = None, None, None, None, True

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    def _wait(self) -> None:
        futures, self._futures = self._futures, []
        self._block_steps.clear()
        for future in futures:
            future.result()

    def _before_step(self, params: list[nn.Parameter]) -> None:
        """On the optimizer thread, before ``params`` are stepped: their gradients prepared and measured, their
        state kept (a speculative step)."""
        if self._prepare is not None:
            self._prepare(params)
        if self._measure is not None:
            self._measure(params)
        if self._kept is not None:
            self._kept.keep(params)

    def _step(self, index: int, params: list[nn.Parameter]) -> None:
        self._before_step(params)
        self._step_again(index, params)

    def _step_again(self, index: int, params: list[nn.Parameter], count: bool = True) -> None:
        assert self._optimizer is not None
        if self.step_block is not None:
            self.step_block(self._optimizer, index, params)
        else:
            self._step_only(params)
        self.blocks_stepped += count
        if self.on_stepped is not None:
            self.on_stepped(index, params)

    def _step_trunk(self, param: nn.Parameter) -> None:
        self._before_step([param])
        self._step_only([param])
        self.trunk_params_stepped += 1

    def _step_only(self, params: list[nn.Parameter]) -> None:
        """The user's optimizer, stepped over ``params`` alone (its class's ``step``: the one Lightning calls may be
        wrapped for this step, :mod:`.step_modes`)."""
        optimizer = self._optimizer
        assert optimizer is not None
        with restricted(optimizer, set(params)):
            type(optimizer).step(optimizer)
