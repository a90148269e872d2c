"""A model streaming through a device for one Lightning run: what :func:`~.setup.start_streaming` built (the engine,
the hooks on the model, the planner, where the blocks are), and the calls the strategy's hooks make into it.

:class:`~lightning_superpipe.SuperpipeStrategy` is glue: each of its Lightning hooks calls one method here (a
training step starts, autograd's backward is done, the optimizer steps, an evaluation step runs), so that what the
engine, the planner, the disk tier and the ranks do around a step is read in one place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.planning.planner import BudgetPlanner
from lightning_superpipe.streaming.disk_tier import ZeroGradHook, disk_tier_of
from lightning_superpipe.streaming.distributed import share_stepped, share_stepped_on_node
from lightning_superpipe.streaming.engine import StreamingEngine
from lightning_superpipe.streaming.hooks import Hook
from lightning_superpipe.streaming.overlap import overlap_refusal


@dataclass
class StreamingSession:
    """The engine and what serves it for one run; :meth:`stop` takes the hooks off and closes the engine.

    Attributes:
        engine: The streaming engine.
        hooks: The hooks on the model (and, under the disk tier, on ``zero_grad``).
        planner: Plans the placement for ``memory_budget`` from the first steps, or ``None``.
        stacks: Where the blocks are, e.g. ``['model.layers: 2 x LlamaDecoderLayer']``.
        overlap_optimizer: The strategy's knob (``True``, ``False`` or ``"auto"``).
    """

    engine: StreamingEngine
    hooks: list[Hook]
    planner: Optional[BudgetPlanner]
    stacks: list[str]
    overlap_optimizer: Union[bool, str] = "auto"
    _stopped: bool = field(default=False, repr=False)

    def watch_zero_grad(self, model: nn.Module, optimizers: Sequence[Any]) -> None:
        """Under the disk tier while fitting: hooks the user's ``zero_grad`` calls, which the tier must see
        (:class:`~lightning_superpipe.streaming.disk_tier.ZeroGradHook`). ``optimizers``: the optimizer and
        Lightning's wrappers of it, once the precision plugin has connected (it makes new wrappers)."""
        tier = disk_tier_of(self.engine)
        if tier is None or not optimizers or not tier.store.spills:
            return
        hook = ZeroGradHook(tier, model, optimizers)
        hook.attach()
        self.hooks.append(hook)

    def start_training_step(self) -> None:
        self.engine.start_pass(training=True)
        if self.planner is not None:
            self.planner.start_micro_batch(self.engine)

    def log_device_bytes(self, module: Any) -> None:
        """Logs the device bytes held now and at the peak (``superpipe/device_bytes``, ``superpipe/peak_device_bytes``)
        from the ledger: the full report walks every parameter and optimizer state."""
        ledger = self.engine.ledger
        for key, value in (("device_bytes", ledger.total_bytes), ("peak_device_bytes", ledger.peak_bytes)):
            module.log(f"superpipe/{key}", float(value), on_step=True, on_epoch=False)

    def finish_autograd_backward(self) -> None:
        """Between autograd's backward and the precision plugin's post-backward (``on_after_backward``): the
        gradients are brought home, so that user code there sees them complete."""
        self.engine.finish_backward()
        if self.planner is not None:
            self.planner.end_backward(self.engine)

    def optimizer_step(
        self, trainer: Any, optimizer: Optimizer, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]
    ) -> Any:
        """Lightning's optimizer step, ``step(closure)`` (the precision plugin's, which runs the closure's forward
        and backward), with around it: the overlapped step armed where it is exact, the disk tier's blocks stepped
        or committed after it, the sharded optimizer's new weights exchanged, the device copies marked stale, and
        the planner timing it. Returns what ``step`` returns."""
        engine, planner = self.engine, self.planner
        averager = engine.gradients.averager
        sharded = averager is not None and averager.sharded
        # Not while the planner times the step; not with shard_optimizer, where each rank steps its share after
        # backward and the ranks then exchange the new weights.
        overlap = bool(self.overlap_optimizer) and (planner is None or planner.plan is not None) and not sharded
        engine.arm_overlap(trainer, optimizer, self.overlap_optimizer == "auto", overlap)
        closure = engine.home_kind.checked(closure)  # the disk tier refuses a step over gradients already consumed
        start = time.perf_counter()
        try:
            output = step(planner.timed_closure(closure) if planner is not None else closure)
        finally:
            engine.disarm_overlap()
        engine.home_kind.finish_step(optimizer)  # the disk tier's blocks: committed, or stepped from spilled gradients
        params = {p for group in optimizer.param_groups for p in group["params"]}
        if sharded:  # every block's new masters (with "node": the trunk's) from its owner
            assert averager is not None
            if averager.node is not None:
                share_stepped_on_node(engine, params, averager)
            else:
                share_stepped(engine.homes, engine.trunk_parameters(), params, averager)
        stepped = time.perf_counter()
        engine.refresh(changed=params)  # the next forward must stream the weights this step produced
        if planner is not None:  # after the profiled steps, the engine takes the plan
            overlap = bool(self.overlap_optimizer) and overlap_refusal(
                trainer, optimizer, self.overlap_optimizer == "auto"
            ) is None
            planner.after_step(engine, stepped - start, time.perf_counter() - stepped,
                               micro_batches=trainer.accumulate_grad_batches, overlap=overlap)
        return output

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        """Around a validation, test or predict step."""
        self.engine.start_pass(training=False)
        try:
            yield
        finally:
            self.engine.finish_pass()

    def stop(self) -> None:
        """Detaches every hook and closes the engine (its device memory, the disk tier's files); twice is harmless."""
        if self._stopped:
            return
        self._stopped = True
        for hook in self.hooks:
            hook.detach()
        self.hooks = []
        self.engine.close()
