"""A model streaming through a device for one Lightning run: what :func:`~.setup.start_streaming` built (the engine,
the hooks on the model, the planner, where the blocks are), and the calls the strategy's hooks make into it.

:class:`~lightning_superpipe.SuperpipeStrategy` is glue: each of its Lightning hooks calls one method here (a
training step starts, autograd's backward is done, the optimizer steps, an evaluation step runs), so that what the
engine, the planner, the kind of home and the ranks do around a step is read in one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter  # bound at import: a test's patch of time.perf_counter times its own code
from typing import Any, Callable, Optional, Union

from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.memory.home import Hook
from lightning_superpipe.planning.planner import BudgetPlanner
from lightning_superpipe.stepping.pipelined import before_weight_readers
from lightning_superpipe.stepping.step_modes import OptimizerSteps
from lightning_superpipe.streaming.activations import OutsideActivations
from lightning_superpipe.streaming.distributed import share_stepped, share_stepped_on_node
from lightning_superpipe.streaming.engine import StreamingEngine
from lightning_superpipe.wrappers import BeforeCalls


@dataclass
class StreamingSession:
    """The engine and what serves it for one run; :meth:`stop` takes the hooks off and closes the engine.

    Attributes:
        engine: The streaming engine.
        hooks: The hooks on the model (and the kind of home's, on ``zero_grad`` say).
        planner: Plans the placement for ``memory_budget`` from the first steps, or ``None``.
        stacks: Where the blocks are, e.g. ``['model.layers: 2 x LlamaDecoderLayer']``.
        overlap_optimizer: The strategy's knob (``True``, ``False`` or ``"auto"``).
    """

    engine: StreamingEngine
    hooks: list[Hook]
    planner: Optional[BudgetPlanner]
    stacks: list[str]
    overlap_optimizer: Union[bool, str] = "auto"
    steps: Optional[OptimizerSteps] = None
    _stopped: bool = field(default=False, repr=False)
    _backward_end: float = field(default=0.0, repr=False)

    def watch_zero_grad(self, model: nn.Module, optimizers: Sequence[Any]) -> None:
        """While fitting: hooks the user's ``zero_grad`` calls where the kind of home must see them
        (:meth:`.Homes.zero_grad_hook`). ``optimizers``: the optimizer and Lightning's wrappers of it, once the
        precision plugin has connected (it makes new wrappers)."""
        hook = self.engine.home_kind.zero_grad_hook(model, optimizers) if optimizers else None
        if hook is None:
            return
        hook.attach()
        self.hooks.append(hook)

    def watch_backward(self, plugin: Any) -> None:
        """Brings the gradients home between autograd's backward and the precision plugin's ``post_backward``, which
        runs ``on_after_backward``: user code there must see them complete. Lightning's ``Strategy.backward`` calls
        the plugin's ``backward`` and then its ``post_backward``, so the plugin's ``backward`` gets a wrapper (one of
        :attr:`hooks`, taken off by :meth:`stop`); the strategy keeps Lightning's own ``backward``."""
        hook = BeforeCalls([(plugin, "backward", None, self.finish_autograd_backward)])
        hook.attach()
        self.hooks.append(hook)

    def start_fit(self, trainer: Any, model: nn.Module, optimizers: Sequence[Any]) -> None:
        """As fitting starts: the optimizer steps get their modes, and whatever may read weights, gradients or
        optimizer state before a pipelined step is done waits for it (``zero_grad``; the training loop's hooks of
        callbacks and of the LightningModule that may read weights)."""
        self.steps = OptimizerSteps(self.engine, self.overlap_optimizer, trainer.precision_plugin)
        if not self.engine.home_kind.clips_gradients and not self._sharded():  # those clip and unscale their own way
            self.steps.install()
        for hook in (BeforeCalls([(owner, "zero_grad", self.settle) for owner in [*optimizers, model]]),  # reads .grad
                     before_weight_readers(trainer, self.settle_for_callbacks)):
            hook.attach()
            self.hooks.append(hook)

    def steps_report(self) -> dict[str, Any]:
        """The optimizer steps' modes and counts (:meth:`.OptimizerSteps.report`), once fitting started."""
        return self.steps.report() if self.steps is not None else {}

    def settle(self) -> None:
        """Waits for the pending (pipelined) optimizer steps."""
        self.engine.pending.settle()

    def settle_for_callbacks(self) -> None:
        """Before a callback's hook that may read the weights or call the model between steps: the pending steps
        done, and the device copies made from what they wrote (after a pipelined step the next pass would make
        them: a call from the callback would compute with the resident blocks' and the trunk's old weights)."""
        pending = self.engine.pending.launched
        self.settle()
        if pending and self.engine.home_kind.refreshes_for_callbacks:
            self.engine.sync_with_masters()

    @contextmanager
    def training_step(self, batch: Any) -> Iterator[None]:
        """Around the LightningModule's ``training_step``: starts the pass, lets the planner see the batch, and
        counts what the step saves for backward outside the blocks (:class:`~.activations.OutsideActivations`)."""
        if self.planner is not None:
            self.planner.see_batch(self.engine, batch)
        self.engine.start_pass(training=True)
        if self.planner is not None:
            self.planner.start_micro_batch(self.engine)
        with OutsideActivations(self.engine.activations):
            yield

    def finish_autograd_backward(self) -> None:
        """Between autograd's backward and the precision plugin's post-backward (``on_after_backward``): the
        gradients are brought home, so that user code there sees them complete."""
        self._backward_end = perf_counter()
        self.engine.finish_backward()
        if self.planner is not None:
            self.planner.end_backward(self.engine)

    def optimizer_step(
        self, trainer: Any, optimizer: Optimizer, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]
    ) -> Any:
        """Lightning's optimizer step, ``step(closure)`` (the precision plugin's, which runs the closure's forward and
        backward), run in the mode :mod:`.step_modes` picks (during backward, speculative, pipelined, after backward),
        with around it: the kind of home's own step of its blocks, or its commit, after it, the sharded optimizer's new
        weights exchanged, the device copies marked stale, and the planner timing it. Returns what ``step`` returns."""
        # Not waiting for a pipelined step here: Lightning calls this before the closure's forward, which waits per
        # block; backward and `zero_grad` wait for the rest.
        engine, planner = self.engine, self.planner
        averager = engine.gradients.averager
        sharded = self._sharded()
        if self.steps is None:  # a step outside `fit` (a user's loop calling the strategy)
            self.steps = OptimizerSteps(engine, self.overlap_optimizer, trainer.precision_plugin)
        # Serial while the planner times the step; with shard_optimizer, each rank steps its share after backward.
        measuring = planner is not None and planner.plan is None
        mode = self.steps.choose(trainer, optimizer, sharded, measuring=measuring)
        closure = engine.home_kind.checked(closure)  # e.g. a step over gradients the kind already consumed refused
        timed = planner.timed_closure(closure) if planner is not None else closure
        start = perf_counter()
        output = self.steps.run(trainer, optimizer, lambda: step(timed), mode)
        engine.home_kind.finish_step(optimizer)  # the kind's own step of its blocks, committed or taken now
        self.steps.homes_decided(engine.home_kind)
        params = {p for group in optimizer.param_groups for p in group["params"]}
        if sharded:  # every block's new masters (with "node": the trunk's) from its owner
            assert averager is not None
            if averager.node is not None:
                share_stepped_on_node(engine, params, averager)
            else:
                share_stepped(engine.homes, engine.trunk_parameters(), params, averager)
        stepped = perf_counter()
        # The next forward must stream the weights this step produced (a pipelined step's: once each is done).
        engine.refresh(changed=params, prepare=mode.mode != "pipelined")
        now = perf_counter()
        self.steps.exposed_s += now - max(self._backward_end, start)
        if planner is not None:  # after the profiled steps, the engine takes the plan
            after = self.steps.choose(trainer, optimizer, sharded, measuring=False) if measuring else mode
            planner.after_step(engine, stepped - start, now - stepped,
                               micro_batches=trainer.accumulate_grad_batches, overlap=after.mode != "serial")
        return output

    def _sharded(self) -> bool:
        averager = self.engine.gradients.averager
        return averager is not None and averager.sharded

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        """Around a validation, test or predict step."""
        self.settle()
        self.engine.start_pass(training=False)
        try:
            yield
        finally:
            self.engine.finish_pass()

    def stop(self) -> None:
        """Detaches every hook and closes the engine (its device memory, the homes); twice is harmless."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.settle()
        finally:
            self._stop_hooks()

    def _stop_hooks(self) -> None:
        if self.steps is not None:
            self.steps.uninstall()
        for hook in reversed(self.hooks):  # last on, first off: a wrapper may wrap an earlier one
            hook.detach()
        self.hooks = []
        self.engine.close()
