"""A pipelined optimizer step: launched after Lightning's pre-step work, finished while the next forward runs.

Where a step cannot be taken during backward (a hook may rewrite gradients, clipping fires on most steps, too little
host memory to keep the state a speculation needs), it need not hold up the loop either. :class:`PipelinedStep`
launches it on the optimizer thread, a block at a time in the order the next forward needs them (the parameters
outside the blocks that it uses before its first block, the blocks, then those it uses after them, such as a head,
whose device copies wait for their first use), and returns. The engine makes each block's next copy to the device
wait for that block's step (:meth:`PipelinedStep.wait_block`), so the steps of later blocks run while earlier ones
compute. Clipping's factor, where the step clips by norm, is multiplied into each block's gradients just before its
step.

Each launched step uses the hyperparameters in force at launch (a scheduler stepping meanwhile changes the next
step's; :func:`~.optimizers.shadow_of`). Whatever reads or writes weights, gradients or optimizer state before the
next forward waits for every pending step first (:meth:`PipelinedStep.settle`): checkpoints, state dicts,
validation, ``zero_grad``, the hooks of callbacks that may read weights (:func:`before_weight_readers`), the end
of the run.
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from time import perf_counter  # bound at import: a test's patch of time.perf_counter times its own code
from typing import Any, Callable, Optional, Protocol

from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.stepping.optimizers import shadow_of
from lightning_superpipe.stepping.speculation import scale_gradients
from lightning_superpipe.wrappers import BeforeCalls

#: Lightning callbacks that read no weights in the training loop's hooks (or read them through the strategy's
#: checkpoint calls, which wait themselves), by class name, so that their presence keeps the step pipelined.
WEIGHT_BLIND_CALLBACKS = (
    "ModelCheckpoint", "LearningRateMonitor", "ProgressBar", "TQDMProgressBar", "RichProgressBar", "Timer",
    "ModelSummary", "RichModelSummary", "EarlyStopping", "GradientAccumulationScheduler",
)

#: A callback whose class sets this attribute to ``True`` declares that its training-loop hooks read no weights.
READS_NO_WEIGHTS = "superpipe_reads_no_weights"

#: The training loop's hooks that run between an optimizer step and the next forward (or, after the last step, the
#: end of the run, whose teardown waits only after ``on_train_end``).
WINDOW_HOOKS = (
    "on_train_batch_end", "on_train_epoch_end", "on_train_epoch_start", "on_train_batch_start", "on_train_end",
)


class SyncedHome(Protocol):
    """What a pipelined step needs of a block's home (:class:`~lightning_superpipe.memory.home.Home`): its masters
    taken in once the block is stepped."""

    def mark_changed(self, param: nn.Parameter) -> None: ...

    def changed(self) -> Any: ...

    def sync(self, pieces: Any) -> None: ...


@dataclass(frozen=True)
class KindSteps:
    """A kind of home's own step of some blocks, pipelined: ``run(done)`` steps them in ``blocks``' order on the
    optimizer thread and calls ``done(index)`` as each block's new weights can be copied to the device."""

    blocks: list[int]
    run: Callable[[Callable[[int], None]], None]


class PipelinedStep:
    """The optimizer steps launched on the optimizer thread and not yet waited for.

    Args:
        executor: The optimizer thread (one worker: steps run in the order launched).
        homes: The blocks' homes; a block's transfer copy is brought up to date on the thread after its step.
        before_wait: Called before the loop blocks on a block's step (the kind of home gives back what the step
            may need: :meth:`~lightning_superpipe.memory.home.Homes.before_step_wait`).
    """

    def __init__(self, executor: Executor, homes: Sequence[Optional[SyncedHome]],
                 before_wait: Callable[[], None] = lambda: None) -> None:
        self._executor = executor
        self._homes = homes
        self._before_wait = before_wait
        self._blocks: dict[int, Future[None]] = {}
        self._trunk: list[Future[None]] = []
        self._kind_steps: list[Future[None]] = []  # the kind's own steps (a commit follows their last block)
        self._late: dict[nn.Parameter, Future[None]] = {}
        self._scale: Optional[Tensor] = None
        #: Seconds the training loop waited for pending steps, over the run.
        self.waited_s = 0.0

    @property
    def pending_blocks(self) -> KeysView[int]:
        """Blocks launched and not yet waited for (their homes are written by the optimizer thread): a live view, not
        a copy, since the engine asks at every block it acquires."""
        return self._blocks.keys()

    def launch(
        self,
        optimizer: Optimizer,
        trunk: list[nn.Parameter],
        blocks: list[tuple[int, list[nn.Parameter]]],
        step_kwargs: dict[str, Any],
        late_trunk: Sequence[nn.Parameter] = (),
        scale: Optional[Tensor] = None,
        kind_steps: Optional[KindSteps] = None,
    ) -> None:
        """Launches ``trunk``'s step, then each block's, then the kind of home's own step of its blocks
        (``kind_steps``: the disk tier's, from its files), then each of ``late_trunk`` (used after the blocks: a
        head), in that order, with the hyperparameters in force now. ``step_kwargs`` (a scaler's
        ``grad_scale``/``found_inf`` for an optimizer that unscales in its step) are copied: the scaler updates them
        after this call returns. With ``scale`` (clipping's factor) each step multiplies its parameters' gradients
        by it first."""
        kwargs = {key: value.clone() if isinstance(value, Tensor) else value for key, value in step_kwargs.items()}
        self._scale = scale
        if trunk:
            self._trunk.append(self._executor.submit(self._step, shadow_of(optimizer, trunk), kwargs, None))
        for index, params in blocks:
            self._blocks[index] = self._executor.submit(self._step, shadow_of(optimizer, params), kwargs, index)
        if kind_steps is not None and kind_steps.blocks:
            futures: dict[int, Future[None]] = {index: Future() for index in kind_steps.blocks}
            self._blocks.update(futures)
            self._kind_steps.append(self._executor.submit(_run_kind_steps, kind_steps, futures))
        for param in late_trunk:
            self._late[param] = self._executor.submit(self._step, shadow_of(optimizer, [param]), kwargs, None)

    @property
    def launched(self) -> bool:
        """Whether any step is launched and not yet waited for."""
        return bool(self._blocks or self._trunk or self._late or self._kind_steps)

    @property
    def late_trunk(self) -> frozenset[nn.Parameter]:
        """Parameters outside the blocks whose pending step the next pass waits for at their first use."""
        return frozenset(self._late)

    def wait_trunk_param(self, param: nn.Parameter) -> None:
        """Waits for the pending step of ``param``, one of :attr:`late_trunk`."""
        future = self._late.pop(param, None)
        if future is not None:
            self._wait(future)

    def wait_block(self, index: int) -> None:
        """Waits for block ``index``'s pending step, if it has one (re-raising its error)."""
        future = self._blocks.pop(index, None)
        if future is not None:
            self._wait(future)

    def wait_trunk(self) -> None:
        """Waits for the pending step of the parameters outside the blocks."""
        futures, self._trunk = self._trunk, []
        for future in futures:
            self._wait(future)

    def settle(self) -> None:
        """Waits for every pending step."""
        self.wait_trunk()
        for index in sorted(self._blocks):
            self.wait_block(index)
        for param in list(self._late):
            self.wait_trunk_param(param)
        futures, self._kind_steps = self._kind_steps, []
        for future in futures:
            self._wait(future)

    def _wait(self, future: Future[None]) -> None:
        done, start = future.done(), perf_counter()
        if not done:
            self._before_wait()
        future.result()
        if not done:
            self.waited_s += perf_counter() - start

    def _step(self, shadow: Optimizer, kwargs: dict[str, Any], index: Optional[int]) -> None:
        if self._scale is not None:
            scale_gradients([p for group in shadow.param_groups for p in group["params"]], self._scale)
        type(shadow).step(shadow, **kwargs)
        if index is not None:
            home = self._homes[index]
            assert home is not None
            for group in shadow.param_groups:
                for param in group["params"]:
                    home.mark_changed(param)  # torch's fused CPU optimizers write without bumping the version
            home.sync(home.changed())


def _run_kind_steps(kind_steps: KindSteps, futures: dict[int, Future[None]]) -> None:
    """On the optimizer thread: runs a kind of home's step of its blocks, settling each block's future as the kind
    says it is done (or with the step's error)."""

    def done(index: int) -> None:
        future = futures.get(index)
        if future is not None and not future.done():
            future.set_result(None)

    try:
        kind_steps.run(done)
    except BaseException as error:
        for future in futures.values():
            if not future.done():
                future.set_exception(error)
        raise
    for future in futures.values():
        if not future.done():
            future.set_result(None)


def weight_readers(trainer: Any, hook: str) -> list[Any]:
    """The callbacks (and the LightningModule) that override ``hook`` and are not known to read no weights."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    readers = []
    module = trainer.lightning_module
    if module is not None and is_overridden(hook, module, LightningModule):
        readers.append(module)
    for callback in trainer.callbacks:
        if not is_overridden(hook, callback, Callback) or getattr(callback, READS_NO_WEIGHTS, False):
            continue
        owner = next(k for k in type(callback).__mro__ if hook in vars(k))
        if owner.__name__ not in WEIGHT_BLIND_CALLBACKS:
            readers.append(callback)
    return readers


def before_weight_readers(trainer: Any, settle: Callable[[], None]) -> BeforeCalls:
    """Waits for the pending steps (``settle``) before each hook of :data:`WINDOW_HOOKS` that a callback or the
    LightningModule which may read weights overrides (``EMAWeightAveraging``, a user's callback); the Trainer's
    callbacks stay as the user gave them."""
    return BeforeCalls([(reader, hook, settle) for hook in WINDOW_HOOKS for reader in weight_readers(trainer, hook)])
