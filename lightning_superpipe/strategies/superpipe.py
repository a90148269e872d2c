"""``SuperpipeStrategy``: train and evaluate models larger than the accelerator's memory on one device.

The model's home is host memory. Its blocks (decoder layers, vision stages) stream through the device just in
time, in forward and again in backward; gradients return to the host block by block; the optimizer steps the
host parameters, so its state never occupies the device. This module is thin glue between Lightning's hooks and
the streaming engine in :mod:`lightning_superpipe.streaming`.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Optional, TypeVar, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.memory.host import check_host_memory, host_bytes_to_come, training_state_bytes
from lightning_superpipe.planning.budget import MemoryBudget
from lightning_superpipe.planning.plan import Plan
from lightning_superpipe.planning.planner import BudgetPlanner, static_costs
from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.streaming.activations import ActivationsPolicy
from lightning_superpipe.streaming.blocks import BlockPolicy, assign_parameters, describe, describe_stacks, find_blocks
from lightning_superpipe.streaming.emulated import EmulatedLink
from lightning_superpipe.streaming.engine import StreamingEngine, check_knobs
from lightning_superpipe.streaming.hooks import Hook, attach_hooks

_RNG_KEY = "superpipe_rng_states"
T = TypeVar("T")
_MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class SuperpipeStrategy(SingleDeviceStrategy):
    """Streams a host-resident model's blocks through one device; optimizer and masters stay on the host.

    The knobs are described, with what each costs, in the README's table.

    Args:
        memory_budget: Device bytes to plan for (an int, ``"12GiB"``, a fraction of free device memory, ``"auto"``):
            the first steps are profiled and the fastest placement that fits is applied (:mod:`..planning`).
            ``None``: no planning.
        resident_blocks: Blocks kept on the device for the whole run (default 1, or the plan's).
        prefetch: Blocks copied in ahead of the one computing (default 1, or the plan's).
        activations: ``"recompute"`` (default), ``"keep"``, ``"offload"``, or one per block (or the plan's).
        overlap_optimizer: Step each block's parameters during backward where that is exact (``"auto"``: and pays).
        blocks: Which modules stream: module classes or a predicate; by default every outermost stack.
        device: The compute device; by default the one the Trainer resolves.
        link: An :class:`~lightning_superpipe.EmulatedLink` (tests: the CUDA code paths on a CPU device).
        accelerator: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        checkpoint_io: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        precision_plugin: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
    """

    strategy_name = "superpipe"

    def __init__(
        self,
        memory_budget: Optional[MemoryBudget] = None,
        resident_blocks: Optional[int] = None,
        prefetch: Optional[int] = None,
        activations: Optional[ActivationsPolicy] = None,
        overlap_optimizer: Union[bool, str] = "auto",
        blocks: Optional[BlockPolicy] = None,
        device: Optional[Union[str, torch.device]] = None,
        link: Optional[EmulatedLink] = None,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self.memory_budget = memory_budget
        self.resident_blocks = resident_blocks
        self.prefetch = prefetch
        self.activations = activations
        self.overlap_optimizer = overlap_optimizer
        self.block_policy = blocks
        self.link = link
        # Empty until the accelerator connector fills it with the devices the Trainer resolved.
        self._parallel_devices: list[torch.device] = [torch.device(device)] if device is not None else []
        self._engine: Optional[StreamingEngine] = None
        self._hooks: list[Hook] = []
        self._fitting = False
        self._last_report: Optional[dict[str, Any]] = None
        self._streamed_stacks: list[str] = []
        self._planner: Optional[BudgetPlanner] = None

    # ------------------------------------------------------------------ device selection

    @property
    def parallel_devices(self) -> list[torch.device]:
        """The devices the Trainer resolved; Lightning's connector sets them, and this strategy uses one."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Union[int, str, torch.device]]) -> None:
        if len(devices) > 1:
            raise MisconfigurationException(
                f"`Trainer(strategy='superpipe')` streams through one device, but the Trainer resolved {len(devices)}"
                f" ({', '.join(str(d) for d in devices)}). Use `Trainer(devices=1)`; several devices are not"
                " supported yet."
            )
        self._parallel_devices = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]
        if self._parallel_devices:
            self._root_device = self._parallel_devices[0]

    # ------------------------------------------------------------------ set-up and tear-down

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._let_fused_optimizers_clip_without_a_scaler()
        # Unlike the parent class, optimizer state is not moved to the device: it lives with the host masters.

    def _let_fused_optimizers_clip_without_a_scaler(self) -> None:
        """Lightning's mixed-precision plugin refuses to clip for optimizers that unscale inside ``step`` (fused
        AdamW, the fastest host optimizer), which matters only with a gradient scaler; ``bf16-mixed`` has none."""
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            plugin.clip_gradients = partial(Precision.clip_gradients, plugin)  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        """Puts buffers on the device and starts streaming; parameters stay in host memory."""
        assert self.model is not None
        self._stop_streaming()
        model = self.model
        blocks = find_blocks(model, self.block_policy)
        # Checked here rather than in __init__: LightningCLI reports a constructor's error as a type mismatch.
        try:
            check_knobs(self.overlap_optimizer, self.resident_blocks, self.prefetch, self.activations, self.link, len(blocks))
        except ValueError as error:
            raise MisconfigurationException(str(error)) from error
        self._streamed_stacks = describe_stacks(model, blocks)
        transfer_dtype = _MIXED_PRECISION_DTYPES.get(str(self.precision_plugin.precision))
        block_params, trunk_params = assign_parameters(model, blocks, mixed_precision=transfer_dtype is not None)
        knobs = (self.resident_blocks, self.prefetch, self.activations)
        placement = (_or(self.resident_blocks, 1), _or(self.prefetch, 1), _or(self.activations, "recompute"))
        if self.memory_budget is not None:  # the plan starts from the placement that needs least memory
            self._planner = BudgetPlanner(self.memory_budget, self.root_device, *knobs)
            static = static_costs(block_params, trunk_params, transfer_dtype, self._fitting)
            placement = self._planner.first_placement(static, self._fitting)
        check_host_memory(
            host_bytes_to_come(
                block_params, trunk_params, transfer_dtype, self._fitting, pinned=self.root_device.type == "cuda"
            ),
            f"homes for {describe(blocks)}, gradients and optimizer state",
        )
        # Buffers (and torchmetrics states) go to the device; parameters and their gradients are returned
        # unchanged, so they stay home.
        at_home = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
        model._apply(lambda t: t if id(t) in at_home else t.to(self.root_device))
        resident, prefetch, activations = placement
        self._engine = StreamingEngine(
            block_params, trunk_params, self.root_device, resident_blocks=resident, prefetch=prefetch,
            transfer_dtype=transfer_dtype, link=self.link, activations=activations,
        )
        self._hooks = attach_hooks(self._engine, model, blocks)
        if isinstance(model, LightningModule):
            model._device = self.root_device  # what `self.device` in the user's LightningModule should say

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._last_report = self.memory_report()
        self._stop_streaming()
        vars(self.precision_plugin).pop("clip_gradients", None)
        super().teardown()

    def _stop_streaming(self) -> None:
        for hook in self._hooks:
            hook.detach()
        self._hooks = []
        if self._engine is not None:
            self._engine.close()
        self._engine = None

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Builds the model in host memory: it never needs to fit on the device."""
        with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps

    @property
    def engine(self) -> StreamingEngine:
        if self._engine is None:
            raise RuntimeError("SuperpipeStrategy is not set up: it streams only inside `Trainer.fit/validate/test/predict`.")
        return self._engine

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self.engine.start_pass(training=True)
        if self._planner is not None:
            self._planner.start_micro_batch(self.engine)
        output = super().training_step(*args, **kwargs)
        # Straight from the ledger: the full report walks every parameter and optimizer state.
        ledger = self.engine.ledger
        assert self.lightning_module is not None
        for key, value in (("device_bytes", ledger.total_bytes), ("peak_device_bytes", ledger.peak_bytes)):
            self.lightning_module.log(f"superpipe/{key}", float(value), on_step=True, on_epoch=False)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # The parent's sequence, with the gradients brought home between autograd's backward and the precision
        # plugin's post-backward, which runs `on_after_backward`: user code there must see complete gradients.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        self.engine.finish_backward()
        if self._planner is not None:
            self._planner.end_backward(self.engine)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        planner = self._planner
        # The closure's backward steps block by block where that is exact; not while the planner times the step.
        if self.overlap_optimizer and (planner is None or planner.plan is not None):
            assert self._lightning_module is not None
            self.engine.overlap.arm_if_exact(self._lightning_module.trainer, optimizer, self.overlap_optimizer == "auto")
        start = time.perf_counter()
        try:
            output = super().optimizer_step(optimizer, planner.timed_closure(closure) if planner else closure, model, **kwargs)
        finally:
            self.engine.overlap.disarm()
        stepped = time.perf_counter()
        # The next forward must stream the weights this step produced.
        self.engine.refresh(changed=(p for group in optimizer.param_groups for p in group["params"]))
        if planner is not None:  # after the profiled steps, the engine takes the plan
            planner.after_step(self, optimizer, stepped - start, time.perf_counter() - stepped)
        return output

    @property
    def plan(self) -> Optional[Plan]:
        """The placement solved for ``memory_budget`` (after the profiled steps), or ``None``."""
        return self._planner.plan if self._planner is not None else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._forward_only("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._forward_only("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only("predict_step", *args, **kwargs)

    def _forward_only(self, step: str, *args: Any, **kwargs: Any) -> Any:
        self.engine.start_pass(training=False)
        try:
            return getattr(super(), step)(*args, **kwargs)
        finally:
            self.engine.finish_pass()

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        # Plain Lightning does not save the RNG state, so dropout after a resume differs from an uninterrupted run.
        checkpoint[_RNG_KEY] = rng_states()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if _RNG_KEY in checkpoint:
            set_rng_states(checkpoint[_RNG_KEY])
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._engine is not None:
            self._engine.copier.synchronize()  # no copy may still be reading the masters about to change
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._engine is not None:
            self._engine.refresh()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The parent moves optimizer state to the device; here it stays with the host parameters.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ memory report

    def memory_report(self) -> dict[str, Any]:
        """What the strategy holds where, in bytes, from its own ledger of every byte it puts on the device: the
        engine's figures (:meth:`StreamingEngine.memory_report`), ``param_bytes``, ``trainable_param_bytes``,
        ``optimizer_state_bytes``, ``streamed_stacks`` (e.g. ``['model.encoder.block: 2 x T5Block', ...]``),
        ``plan`` (with ``memory_budget``) and, on CUDA, ``cuda_max_allocated_bytes``. After the run, the figures it ended with."""
        if self._engine is None and self._last_report is not None:
            return dict(self._last_report)
        assert self.lightning_module is not None
        report: dict[str, Any] = {
            **self.engine.memory_report(),
            **training_state_bytes(list(self.lightning_module.parameters()), self.optimizers),
            "streamed_stacks": list(self._streamed_stacks),
        }
        if self.plan is not None:
            report["plan"] = self.plan.as_dict()
        if self.root_device.type == "cuda":
            report["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.root_device)
        return report

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__name__)


def _or(value: Optional[T], default: T) -> T:
    return default if value is None else value
