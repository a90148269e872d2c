"""``SuperpipeStrategy``: train and evaluate models larger than the accelerator's memory, on one device or several.

The model's home is host memory. Its blocks (decoder layers, vision stages) stream through the device just in
time, in forward and again in backward; gradients return to the host block by block; the optimizer steps the
host parameters, so its state never occupies the device. This module is thin glue between Lightning's hooks and
the streaming engine in :mod:`lightning_superpipe.streaming`. ``offload_device`` chooses the kind of home the blocks
live in (:mod:`lightning_superpipe.memory.home`): host memory, or files (the disk tier), or a kind registered by the
user. On several devices or nodes
it is Lightning's ``DDPStrategy`` without the ``DistributedDataParallel`` wrapper: each rank streams its own copy and
the gradients are averaged block by block on the way back (:mod:`lightning_superpipe.streaming.distributed`).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.construction.deferred_init import DeferredInit
from lightning_superpipe.emulation.link import EmulatedLink
from lightning_superpipe.memory.home import kind_that_wrote
from lightning_superpipe.planning.budget import MemoryBudget
from lightning_superpipe.planning.plan import Plan
from lightning_superpipe.planning.planner import BudgetPlanner
from lightning_superpipe.run.checkpoints import (
    blocks_left_to_files,
    load_model_state,
    load_optimizer_states,
    save_checkpoint,
)
from lightning_superpipe.run.options import DEFAULT_OFFLOAD_DEVICE, SuperpipeOptions
from lightning_superpipe.run.session import StreamingSession
from lightning_superpipe.run.setup import (
    EmptyInit,
    install_clipping,
    start_streaming,
    strategy_report,
    uninstall_clipping,
)
from lightning_superpipe.stepping.optimizers import put_state_in_group_order
from lightning_superpipe.strategies.ranks import MIXED_PRECISION_DTYPES, RanksStrategy
from lightning_superpipe.streaming.activations import ActivationsPolicy
from lightning_superpipe.streaming.blocks import BlockPolicy
from lightning_superpipe.streaming.engine import StreamingEngine


def _knob(name: str) -> property:
    """A read-only attribute of the strategy that gives the knob ``name`` as the user wrote it (its options')."""
    return property(lambda self: getattr(self.options, name), doc=f"``SuperpipeOptions.{name}``, as written.")


class SuperpipeStrategy(RanksStrategy):
    """Streams a host-resident model's blocks through each rank's device; optimizer and masters stay on the host.

    The knob reference (``docs/reference/knobs.md``) says what each knob costs. Every argument is a keyword, the knobs
    first; a knob's value is checked here, so a bad one fails in the constructor (what needs the model or the run,
    when streaming starts). With one device on one node it runs in this process, with no process group; with more,
    Lightning launches one process per device (its subprocess launcher, ``torchrun``, SLURM) and each streams its own
    copy, the gradients averaged across ranks.

    Args:
        memory_budget: Device bytes to plan for (an int, ``"12GiB"``, a share of free device memory such as ``"90%"``,
            ``"auto"``): the first steps are profiled and the fastest placement that fits is applied
            (:mod:`..planning`), then timed, and the model corrected and solved again where it misses.
            ``None``: no planning.
        resident_blocks: Blocks kept on the device for the whole run (default 1, or the plan's).
        prefetch: Blocks copied in ahead of the one computing (default 1, or the plan's).
        activations: ``"recompute"`` (default), ``"keep"``, ``"offload"``, or one per block (or the plan's).
        overlap_optimizer: Step each block's parameters during backward where that is exact (``"auto"``: and pays).
        blocks: Which modules stream: module classes or a predicate; by default every outermost stack.
        link: An :class:`~lightning_superpipe.EmulatedLink` (tests: the CUDA code paths on a CPU device).
        offload_device: Where the blocks' masters and optimizer state live: ``"cpu"`` (host memory, the default),
            ``"disk"`` (files under ``offload_path``, streamed through a bounded pool of host buffers), or the name of
            a kind of home registered with :func:`~lightning_superpipe.register_home_kind`.
        offload_path: The disk tier's folder (``offload_device="disk"``), on a fast local disk.
        host_buffer_bytes: Bound on the disk tier's pool of host buffers (default: a few of the largest block's);
            below two whole blocks' buffers, each block is stepped and read in pieces (a parameter, or a slice of one).
        shard_optimizer: On several ranks. ``True``: each block's gradients and optimizer state on one rank, which
            steps it and broadcasts the new weights (ZeRO stage 2); the masters stay on every rank. ``"node"``: that,
            and one copy of the blocks' masters per node, in shared memory that the node's ranks stream from, each
            block stepped by one rank of each node. ``False``: every rank holds everything. ``"auto"`` (default):
            ``"node"``, or where the run refuses it (a weight-averaging callback, no ``/dev/shm`` or too little of
            it) ``True``, or where that is refused too (``16-mixed``, the disk tier) ``False``, with an info line
            saying why. Nothing on one device.
        quantize_frozen: ``"nf4"``, ``"nf4-dq"``, ``"fp4"`` or ``"fp4-dq"`` (Lightning's ``BitsandbytesPrecision``
            4-bit modes; bitsandbytes installed): every frozen matrix of the blocks (``requires_grad=False`` when the
            run starts) is quantized once with bitsandbytes' quantizer, kept in host memory and streamed as its 4-bit
            codes and scales, and dequantized on the device for each use; trainable parameters stay as they are.
            After the run the matrices hold their dequantized values
            (:mod:`lightning_superpipe.memory.fourbit.frozen4bit`). ``None`` (default): streamed as they are.
        device: The compute device; by default the one the Trainer resolves.
        accelerator: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (through :class:`.RanksStrategy`),
            as are the next four.
        checkpoint_io: DDP's.
        precision_plugin: DDP's.
        cluster_environment: DDP's.
        process_group_backend: DDP's.
        timeout: How long a collective waits for the other ranks before it fails (DDP's ``timeout``).

    Raises:
        KnobError: A knob's value is wrong (a ``ValueError`` whose message quotes the call).
    """

    strategy_name = "superpipe"

    def __init__(
        self,
        *,
        memory_budget: Optional[MemoryBudget] = None,
        resident_blocks: Optional[int] = None,
        prefetch: Optional[int] = None,
        activations: Optional[ActivationsPolicy] = None,
        overlap_optimizer: Union[bool, str] = "auto",
        blocks: Optional[BlockPolicy] = None,
        link: Optional[EmulatedLink] = None,
        offload_device: str = DEFAULT_OFFLOAD_DEVICE,
        offload_path: Optional[Union[str, os.PathLike[str]]] = None,
        host_buffer_bytes: Optional[int] = None,
        shard_optimizer: Union[bool, str] = "auto",
        quantize_frozen: Optional[str] = None,
        device: Optional[Union[str, torch.device]] = None,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        # First, so that a bad knob fails before Lightning's parts are made.
        self.options = SuperpipeOptions(
            memory_budget=memory_budget, resident_blocks=resident_blocks, prefetch=prefetch, activations=activations,
            overlap_optimizer=overlap_optimizer, blocks=blocks, link=link, offload_device=offload_device,
            offload_path=offload_path, host_buffer_bytes=host_buffer_bytes, shard_optimizer=shard_optimizer,
            quantize_frozen=quantize_frozen,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=[torch.device(device)] if device is not None else None,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout,
        )
        self._run_options: Optional[SuperpipeOptions] = None  # the knobs of the last run: shard_optimizer resolved
        self._resume: Optional[Path] = None  # the folder a checkpoint's homes are restored from
        self._deferred: Optional[DeferredInit] = None  # init calls of `configure_model` (model_sharded_context)
        self._streaming: Optional[StreamingSession] = None
        self._planner: Optional[BudgetPlanner] = None  # kept after the run, for `plan` and its profile
        self._fitting = False
        self._last_report: Optional[dict[str, Any]] = None

    @override
    def __getstate__(self) -> dict[str, Any]:
        """What a copy gets (``copy.deepcopy``, pickling the Trainer; a callback that holds the Trainer is copied with
        it): the knobs and what the last run left, without the run in progress, whose engine, threads and device
        memory stay with this strategy."""
        return {**super().__getstate__(), "_streaming": None, "averager": None}

    # ------------------------------------------------------------------ the knobs, as written (read-only)

    memory_budget = _knob("memory_budget")
    resident_blocks = _knob("resident_blocks")
    prefetch = _knob("prefetch")
    activations = _knob("activations")
    overlap_optimizer = _knob("overlap_optimizer")
    block_policy = _knob("blocks")
    link = _knob("link")
    offload_device = _knob("offload_device")
    offload_path = _knob("offload_path")
    host_buffer_bytes = _knob("host_buffer_bytes")
    #: As written (``"auto"`` by default); the run's resolved value is in :attr:`run_options`.
    shard_optimizer = _knob("shard_optimizer")
    quantize_frozen = _knob("quantize_frozen")

    @override
    def _configure_launcher(self) -> None:
        # The Trainer has chosen the device: knobs that depend on it fail now, before the model or the data.
        self.options.validate_for(self.root_device)
        super()._configure_launcher()

    @property
    def run_options(self) -> SuperpipeOptions:
        """The knobs of the current (or last) run, with ``shard_optimizer="auto"`` resolved; before one, as written."""
        return self._run_options if self._run_options is not None else self.options

    # ------------------------------------------------------------------ set-up and tear-down

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        with self._deferred if self._deferred is not None else nullcontext():  # a cast runs the init calls it reads
            self.model = self.precision_plugin.convert_module(self.model)
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self._run_options = self.resolve_sharding(self.options, trainer)
        # Several: the same model and knobs, rank 0's values (its draws, for the init calls deferred).
        self.join_ranks(trainer, self._run_options, self._deferred,
                        by_default=self.options.shard_optimizer != self._run_options.shard_optimizer)
        kind = self.options.home_kind
        early = self._fitting and kind is not None and kind.needs_optimizers  # e.g. files sized by optimizer state
        if early:
            self.setup_optimizers(trainer)
        self.on_every_rank(self.model_to_device, "start streaming")
        if self._fitting and not early:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        install_clipping(self.precision_plugin, self._engine)  # fused AdamW under bf16-mixed; homes that clip
        if self._streaming is not None:  # the gradients home before `on_after_backward`
            self._streaming.watch_backward(self.precision_plugin)
        if self._fitting and self._streaming is not None:  # `zero_grad` is watched on Lightning's new wrappers too
            optimizers = [*self.optimizers, *self._lightning_optimizers]
            self._streaming.watch_zero_grad(self.model, optimizers)
            self._streaming.start_fit(trainer, self.model, optimizers)
        # Unlike the parent class, optimizer state is not moved to the device: it lives with the host masters.

    @override
    def model_to_device(self) -> None:
        """Puts buffers on the device and starts streaming; parameters stay in host memory."""
        assert self.model is not None
        self._stop_streaming()
        model = self.model
        trainer = self.lightning_module.trainer if self._fitting and self.lightning_module is not None else None
        with self._deferred.settled(model) if self._deferred is not None else nullcontext():
            self._streaming = start_streaming(
                model, self.root_device, self.run_options, fitting=self._fitting, trainer=trainer,
                optimizers=tuple(self.optimizers), resume=self._resume,
                transfer_dtype=MIXED_PRECISION_DTYPES.get(str(self.precision_plugin.precision)),
                ranks=self.world_size if self.several_ranks else 1, rank=self.global_rank,
                local_ranks=len(self.parallel_devices), node=self.node, deferred=self._deferred,
            )
        self._resume = self._deferred = None
        self._planner = self._streaming.planner
        self.averager = self._streaming.engine.gradients.averager  # several ranks: the engine averages
        if isinstance(model, LightningModule):
            model._device = self.root_device  # what `self.device` in the user's LightningModule should say

    @override
    def teardown(self) -> None:
        if self._streaming is not None:
            self._last_report = self.memory_report()
        self._stop_streaming()
        uninstall_clipping(self.precision_plugin)
        super().teardown()

    def _stop_streaming(self) -> None:
        if self._streaming is not None:
            self._streaming.stop()
        self._streaming = None
        self.averager = None

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Builds the model in host memory: it never needs to fit on the device."""
        with EmptyInit(enabled=bool(empty_init)), torch.device("cpu"), self.precision_plugin.tensor_init_context():
            yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model`` (only there): under a kind of home that :attr:`~.HomeKind.records_init` (the
        disk tier) or with ``quantize_frozen``, the init functions of the modules built in it (and
        :func:`~lightning_superpipe.load_safetensors`' reads) are recorded and replayed one block at a time as the
        blocks are written to their homes or their frozen matrices quantized, so that the model never sits whole in
        host memory; the values are those of an eager build (:mod:`.deferred_init`)."""
        kind = self.options.home_kind
        if not (kind is not None and kind.records_init) and self.quantize_frozen is None:
            yield
            return
        self._deferred = self._deferred or DeferredInit()
        with self._deferred:
            yield

    # ------------------------------------------------------------------ steps

    @property
    def streaming(self) -> StreamingSession:
        """The run's engine, hooks and planner (:class:`~lightning_superpipe.run.session.StreamingSession`)."""
        if self._streaming is None:
            raise RuntimeError(
                "SuperpipeStrategy is not set up: it streams only inside `Trainer.fit/validate/test/predict`."
            )
        return self._streaming

    @property
    def engine(self) -> StreamingEngine:
        return self.streaming.engine

    @property
    def _engine(self) -> Optional[StreamingEngine]:
        """The run's engine, or ``None`` outside a run."""
        return self._streaming.engine if self._streaming is not None else None

    def _settle(self) -> None:
        """Waits for pending (pipelined) optimizer steps: what follows reads weights, gradients or optimizer state."""
        if self._streaming is not None:
            self._streaming.settle()

    # Outside a run (its teardown took the hooks off) the model is a plain module in host memory, and Lightning's
    # own step calls (a loop run by hand after `fit`) run as under a single-device strategy.

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._streaming is None:
            return super().training_step(*args, **kwargs)
        with self._streaming.training_step(args[0] if args else kwargs.get("batch")):
            return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._settle()  # a pipelined step reads `.grad`, which backward adds to
        super().pre_backward(closure_loss)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        assert self._lightning_module is not None
        parent = super().optimizer_step
        if self._streaming is None:
            return parent(optimizer, closure, model, **kwargs)
        return self._streaming.optimizer_step(
            self._lightning_module.trainer, optimizer, closure, lambda run: parent(optimizer, run, model, **kwargs)
        )

    @property
    def plan(self) -> Optional[Plan]:
        """The placement solved for ``memory_budget`` (after the profiled steps), or ``None``; once the check of
        the applied plan has timed it, with ``measured_step_s``, ``corrections`` and ``checks``."""
        return self._planner.plan if self._planner is not None else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._forward_only():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._forward_only():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_only():
            return super().predict_step(*args, **kwargs)

    def _forward_only(self) -> AbstractContextManager[None]:
        return self._streaming.forward_only() if self._streaming is not None else nullcontext()

    # ------------------------------------------------------------------ checkpoints (:mod:`..run.checkpoints`)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        self._settle()
        parent = super().save_checkpoint
        save_checkpoint(checkpoint, filepath, self._engine, writes=self.is_global_zero,
                        add_rng_states=self.add_rng_states,
                        write=lambda written: parent(written, filepath, storage_options=storage_options))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._settle()
        with blocks_left_to_files(self._engine):
            return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self._settle()
        put_state_in_group_order(getattr(optimizer, "_optimizer", optimizer))  # block steps made it in another order
        return super().optimizer_state(optimizer)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        kind = self.options.home_kind
        if kind is not None and self.is_global_zero:  # what the homes keep beside the .ckpt goes with it
            kind.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.restore_rng_states(checkpoint)
        writer, kind = kind_that_wrote(checkpoint), self.options.home_kind
        if writer is not None and kind is not None:  # its homes are beside the .ckpt: restored when streaming starts
            self._resume = writer.resume_folder(checkpoint_path, checkpoint, kind)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        parent = super().load_model_state_dict
        load_model_state(self.lightning_module, checkpoint, strict, self._engine, self._deferred,
                         lambda state, strict: parent(state, strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load_optimizer_states(self.optimizers, checkpoint, self._engine, self.keep_own_optimizer_state)

    # ------------------------------------------------------------------ memory report

    def memory_report(self) -> dict[str, Any]:
        """What the strategy holds where, in bytes, from its own ledger of every byte it puts on the device: the
        engine's figures (:meth:`StreamingEngine.memory_report`), ``param_bytes``, ``trainable_param_bytes``,
        ``optimizer_state_bytes``, ``streamed_stacks`` (e.g. ``['model.encoder.block: 2 x T5Block', ...]``),
        ``plan`` (with ``memory_budget``) and, on CUDA, ``cuda_max_allocated_bytes``. After the run, the figures it
        ended with."""
        if self._streaming is None and self._last_report is not None:
            return dict(self._last_report)
        assert self.lightning_module is not None
        params, streaming = list(self.lightning_module.parameters()), self.streaming
        streaming.settle()  # the optimizer state it counts
        engine, stacks = streaming.engine, streaming.stacks
        profile = self._planner.profile if self._planner is not None else None
        report = strategy_report(engine, params, self.optimizers, stacks, self.plan, self.root_device, profile)
        return {**report, **streaming.steps_report()}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__name__)

