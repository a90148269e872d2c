"""What plain training holds in activations: the bytes autograd saves for backward in one training step's forward.

The memory table compares the strategy's device peak with plain training's, and plain training holds every saved
activation of the step at the end of its forward, on top of its weights, gradients and optimizer state. This module
measures them rather than estimating them: it runs the module's ``training_step`` once on a batch with gradients
enabled, under the same :class:`~lightning_superpipe.streaming.activations.ActivationCensus` the planner counts
``keep`` with (each storage once, parameters left out), and drops the graph without a backward. Nothing of the run
changes: no gradient is made, no optimizer steps, the RNG states, buffers and train/eval modes are put back and the
module's ``log`` calls are muted for the measurement.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import Tensor, nn

from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.streaming.activations import ActivationCensus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationCount:
    """The bytes one training step's forward saves for backward.

    Attributes:
        total_bytes: Every saved tensor that is not a parameter, each storage once.
        block_bytes: The part saved while a streamed block computed (what the strategy keeps, recomputes or offloads);
            the rest (embeddings, head, loss) stays on the device under either strategy.
    """

    total_bytes: int
    block_bytes: int = 0

    @property
    def outside_blocks_bytes(self) -> int:
        """Saved activations outside the streamed blocks."""
        return self.total_bytes - self.block_bytes


class _PlainPlacement:
    """Stands in for the engine's placement in an :class:`ActivationCensus` of a plain module: activations are the
    saved tensors that are not parameters; it notes which storages a block saved."""

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        self._weights = {param.untyped_storage().data_ptr() for param in module.parameters()}
        self.depth = 0  # > 0 while a block computes
        self.in_blocks: set[int] = set()
        self._handles = [hook for block in blocks for hook in self._watch(block)]

    def _watch(self, block: nn.Module) -> list[Any]:
        def enter(*args: Any) -> None:
            self.depth += 1

        def leave(*args: Any) -> None:
            self.depth -= 1

        return [block.register_forward_pre_hook(enter), block.register_forward_hook(leave, always_call=True)]

    def is_activation(self, index: int, tensor: Tensor) -> bool:
        address = tensor.untyped_storage().data_ptr()
        if address in self._weights:
            return False
        if self.depth > 0:
            self.in_blocks.add(address)
        return True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextmanager
def untouched(module: LightningModule) -> Iterator[None]:
    """Puts back what a forward outside the run could change: the RNG states (torch, CUDA, Python, NumPy), the
    buffers (running statistics), every submodule's train/eval mode; and mutes ``log``/``log_dict``."""
    states = _all_rng_states()
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    # Instance attributes shadow the methods: the measurement's loss must not reach the run's logged metrics.
    module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
        for submodule, training in modes:
            submodule.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        _set_all_rng_states(states)


@contextmanager
def attributes_kept(owner: Any) -> Iterator[None]:
    """Undoes what the body sets on ``owner`` (a data module or a module; nothing for a plain loader): attributes
    it adds are deleted, attributes it rebinds get their objects back. Changes inside those objects stay."""
    if not isinstance(owner, (LightningModule, LightningDataModule)):
        yield
        return
    before = dict(vars(owner))
    try:
        yield
    finally:
        for name in [name for name in vars(owner) if name not in before]:
            delattr(owner, name)
        for name, value in before.items():
            if vars(owner).get(name, _MISSING) is not value:
                setattr(owner, name, value)


_MISSING = object()


def _all_rng_states() -> tuple[dict[str, Any], Any]:
    """:func:`~lightning_superpipe.rng.rng_states` and NumPy's (a ``training_step`` or a sampler may draw from it)."""
    try:
        import numpy
    except ImportError:
        return rng_states(), None
    return rng_states(), numpy.random.get_state()


def _set_all_rng_states(states: tuple[dict[str, Any], Any]) -> None:
    set_rng_states(states[0])
    if states[1] is not None:
        import numpy

        numpy.random.set_state(states[1])


def count_saved_activations(module: LightningModule, batch: Any, blocks: Sequence[nn.Module] = ()) -> ActivationCount:
    """Runs ``module.training_step(batch, 0)`` once in train mode with gradients enabled and counts what it saves.

    The graph is dropped without a backward, so no gradient is made; see :func:`untouched` for what is put back.

    Args:
        module: The module, as plain training would run it (its weights where the batch is).
        batch: One training batch.
        blocks: The modules the strategy streams, to tell their activations from the rest.
    """
    placement = _PlainPlacement(module, blocks)
    census = ActivationCensus(placement, 0)  # type: ignore[arg-type]  # a stand-in for the engine's placement
    try:
        with untouched(module):
            module.train()
            with torch.enable_grad(), census:
                module.training_step(batch, 0)
    finally:
        placement.remove_hooks()
    in_blocks = sum(nbytes for address, nbytes in census.kept.items() if address in placement.in_blocks)
    return ActivationCount(total_bytes=sum(census.kept.values()), block_bytes=in_blocks)


def first_training_batch(trainer: Trainer, module: LightningModule) -> Any:
    """The first batch of the run's training loader, on the module's device; ``None`` when it cannot be had.

    Asks the trainer's training data source (the data module's or the module's ``train_dataloader``, or the loader
    given to ``fit``) once more, with the RNG states put back afterwards, so the run then draws the same first batch,
    and the attributes the call sets on the data module (or module) put back too: a data module that remembers its
    loader, to load a checkpoint's position into, must not remember this one.
    """
    source = getattr(trainer.fit_loop, "_data_source", None)  # Lightning's own handle on whichever of the three
    if source is None or not source.is_defined():
        return None
    states = _all_rng_states()
    try:
        with attributes_kept(source.instance):
            loader = source.dataloader()
        if isinstance(loader, (Sequence, dict)):  # several loaders: a combined batch, not worth rebuilding here
            return None
        iterator = iter(loader)
        batch = next(iterator)
        del iterator  # stops its workers, if any
    finally:
        _set_all_rng_states(states)
    return move_data_to_device(batch, next(module.parameters()).device)


def measure_plain_activations(
    trainer: Trainer, module: LightningModule, block_policy: Any = None
) -> tuple[ActivationCount | None, str]:
    """Plain training's saved activations on the run's first batch, before the strategy takes the module over.

    Args:
        trainer: The trainer, in its ``setup`` hook of ``fit``.
        module: The module, not yet set up by the strategy (on the host when it streams).
        block_policy: The superpipe strategy's ``blocks`` setting, to count its blocks' part; ``None`` for the default.

    Returns:
        The count, or ``None`` with the reason it was not measured.
    """
    params = list(module.parameters())
    if not params or any(param.is_meta for param in params):
        return None, "the weights are not built yet"
    try:
        batch = first_training_batch(trainer, module)
        if batch is None:
            return None, "no single training loader to take a batch from"
        blocks = _streamed_blocks(module, block_policy) if hasattr(trainer.strategy, "block_policy") else []
        return count_saved_activations(module, batch, blocks), ""
    except Exception as error:  # a report must not stop the run: say why the figure is missing instead
        log.warning("MemoryReport could not measure plain training's activations: %r", error)
        return None, f"could not run a training step outside the run ({type(error).__name__})"


def _streamed_blocks(module: nn.Module, block_policy: Any) -> list[nn.Module]:
    from lightning_superpipe.streaming.blocks import NoBlocksFoundError, find_blocks

    try:
        return find_blocks(module, block_policy)
    except NoBlocksFoundError:
        return []


__all__ = ["ActivationCount", "count_saved_activations", "first_training_batch", "measure_plain_activations",
           "untouched"]
