"""Starting to stream: the strategy's knobs checked, the blocks found, the homes (host or disk) and the engine built.

This is the body of :meth:`SuperpipeStrategy.model_to_device`, kept here so that the strategy stays glue: every
check runs before anything is allocated, so a bad knob leaves the model as it was. Under several devices
:func:`join_ranks` runs first, and the engine averages gradients across ranks (:mod:`.distributed`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.memory.disk import DiskTierError
from lightning_superpipe.memory.host import build_homes, check_host_memory, host_bytes_to_come, training_state_bytes
from lightning_superpipe.planning.budget import MemoryBudget
from lightning_superpipe.planning.planner import BudgetPlanner, static_costs
from lightning_superpipe.streaming.activations import ActivationsPolicy
from lightning_superpipe.streaming.blocks import BlockPolicy, assign_parameters, describe, describe_stacks, find_blocks
from lightning_superpipe.streaming.deferred_init import DeferredInit, UnfilledNewTensors
from lightning_superpipe.streaming.disk_tier import (
    BlockValuesHook,
    DiskTier,
    check_offload,
    check_training,
    disk_host_bytes,
    disk_tier_of,
    offload_call,
    rank_folder,
    weight_averaging_callbacks,
)
from lightning_superpipe.streaming.distributed import (
    GradientAverager,
    NodeShare,
    assign_owners,
    broadcast_from_rank_zero,
    check_same_setup,
    fingerprint,
    ready_on_every_rank,
)
from lightning_superpipe.streaming.engine import StreamingEngine, check_knobs
from lightning_superpipe.streaming.hooks import attach_hooks
from lightning_superpipe.streaming.session import StreamingSession


class EmptyInit(UnfilledNewTensors, _EmptyInit):
    """Lightning's mode for ``Trainer.init_module(empty_init=True)`` (the model's tensors left uninitialized, their
    pages never touched, for a checkpoint to fill), which also skips ``transformers``' init functions: since
    transformers 5, ``PreTrainedModel.initialize_weights`` swaps ``torch.nn.init``'s functions for those of
    ``transformers.initialization``, which Lightning's mode lets through (measured: a 214M-parameter Llama built
    under it touched all of its 0.86 GB). The weights are still tied as ``post_init`` ties them. Nor does it let
    ``Trainer(deterministic=True)`` fill the new tensors with NaN (``torch.utils.deterministic
    .fill_uninitialized_memory``), which would write every page of them too."""

    #: Skipped beside ``torch.nn.init``, which Lightning's mode skips.
    SKIPPED = "transformers.initialization"

    @override
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict] = None) -> Any:
        if self.enabled and getattr(func, "__module__", None) == self.SKIPPED:
            kwargs = kwargs or {}
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return super().__torch_function__(func, types, args, kwargs)


#: The strategy's knobs that :func:`start_streaming` takes, by attribute name.
KNOBS = ("memory_budget", "resident_blocks", "prefetch", "activations", "overlap_optimizer", "block_policy", "link",
         "offload_device", "offload_path", "host_buffer_bytes", "shard_optimizer")


def start_streaming(
    model: nn.Module,
    device: torch.device,
    *,
    transfer_dtype: Optional[torch.dtype],
    fitting: bool,
    memory_budget: Optional[MemoryBudget],
    resident_blocks: Optional[int],
    prefetch: Optional[int],
    activations: Optional[ActivationsPolicy],
    overlap_optimizer: Union[bool, str],
    block_policy: Optional[BlockPolicy],
    link: Any,
    offload_device: str = "cpu",
    offload_path: Optional[Union[str, os.PathLike[str]]] = None,
    host_buffer_bytes: Optional[int] = None,
    shard_optimizer: Union[bool, str] = False,
    trainer: Any = None,
    optimizers: tuple[Optimizer, ...] = (),
    resume: Optional[Path] = None,
    deferred: Optional[DeferredInit] = None,
    ranks: int = 1,
    rank: int = 0,
    local_ranks: int = 1,
    node: Optional[NodeShare] = None,
) -> StreamingSession:
    """Finds the blocks, checks the knobs, builds the homes and the engine, and hooks the blocks.

    Buffers (and torchmetrics states) go to ``device``; parameters stay home (host memory or the disk tier). With
    ``ranks`` above one, the engine averages the gradients across them (with ``shard_optimizer``, each block's to
    its owner rank only; with ``node``, ``shard_optimizer="node"``, the homes shared by the node's ranks); the disk
    tier of global rank ``rank`` keeps its files in a folder of its own, beside those of the node's ``local_ranks``.

    Raises:
        MisconfigurationException: A knob the user gave is wrong (the message quotes it); nothing was allocated.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    blocks = find_blocks(model, block_policy)
    disk = offload_device == "disk"
    call = offload_call(offload_device, offload_path, host_buffer_bytes)
    # Checked here rather than in the strategy's __init__: LightningCLI reports a constructor's error as a type
    # mismatch.
    try:
        if shard_optimizer not in (True, False, "node"):
            raise ValueError(f"SuperpipeStrategy(shard_optimizer={shard_optimizer!r}) must be True, False or 'node'.")
        if disk and ranks > 1 and shard_optimizer:
            raise ValueError(
                f"{call} keeps each rank's copy of the training state in files of its own, so"
                f" shard_optimizer={shard_optimizer!r} does not apply: leave it False, or use offload_device='cpu'"
                " to shard the optimizer state across ranks."
            )
        check_knobs(overlap_optimizer, resident_blocks, prefetch, activations, link, len(blocks))
        check_offload(offload_device, offload_path, host_buffer_bytes)
        if disk and fitting:
            check_training(trainer, optimizers, call)

    except ValueError as error:
        raise MisconfigurationException(str(error)) from error
    stacks = describe_stacks(model, blocks)
    block_params, trunk_params = assign_parameters(model, blocks, mixed_precision=transfer_dtype is not None)
    knobs = (resident_blocks, prefetch, activations)
    placement = (_or(resident_blocks, 1), _or(prefetch, 1), _or(activations, "recompute"))
    planner = None
    if memory_budget is not None:  # the plan starts from the placement that needs least memory
        planner = BudgetPlanner(memory_budget, device, *knobs)
        static = static_costs(block_params, trunk_params, transfer_dtype, fitting)
        placement = planner.first_placement(static, fitting)
    resident, ahead, modes = placement
    optimizer = optimizers[0] if disk and fitting else None
    if disk:
        trunk_numel = sum(p.numel() for p in trunk_params if p.requires_grad) if fitting else 0
        needed = disk_host_bytes(block_params, optimizer, ahead + 1, host_buffer_bytes) + 12 * trunk_numel
        check_host_memory(needed, "the disk tier's buffers, the trunk's gradients and optimizer state")
    else:
        check_host_memory(
            host_bytes_to_come(block_params, trunk_params, transfer_dtype, fitting, pinned=device.type == "cuda"),
            f"homes for {describe(blocks)}, gradients and optimizer state",
        )
    tier = None
    if disk:
        assert offload_path is not None
        names = {p: name for name, p in model.named_parameters()}
        streamed = {p for params in block_params for p in params}
        state_names = {name for name, p in model.named_parameters(remove_duplicate=False) if p in streamed}
        try:
            folder = Path(offload_path)
            if ranks > 1:  # every rank checks the node's space before any of them writes
                folder = rank_folder(offload_path, rank, local_ranks, block_params, optimizer, resume is None)
                ready_on_every_rank("check the disk tier's folders")
            tier = DiskTier.build(folder, block_params, names, state_names, optimizer, transfer_dtype,
                                  host_buffer_bytes, ahead + 1, resume, deferred)
        except DiskTierError as error:
            raise MisconfigurationException(f"{call}: {error}") from error
    if deferred is not None:  # the blocks are in their files: the rest of what configure_model built, in place
        deferred.materialize(model)
    try:
        at_home = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
        model._apply(lambda t: t if id(t) in at_home else t.to(device))
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    if node is not None:  # the engine's homes are built together by the node's ranks: all of them must be here
        ready_on_every_rank("start streaming")
    homes = (lambda arena: tier) if tier is not None else partial(build_homes, block_params, transfer_dtype, node=node)
    engine = StreamingEngine(
        block_params, trunk_params, device, resident_blocks=resident, prefetch=ahead, homes=homes, link=link,
        activations=modes,
    )
    if ranks > 1:
        parts = [(params, sum(p.numel() * p.element_size() for p in params)) for params in block_params if params]
        parts += [([param], param.numel() * param.element_size()) for param in trunk_params]
        # Owners among the node's ranks (the same on every node) when they share the homes, else among all.
        owners = assign_owners(parts, node.local_size if node is not None else ranks) if shard_optimizer else None
        engine.gradients.averager = GradientAverager(device, owners, node=node)
    hooks = attach_hooks(engine, model, blocks)
    if tier is not None:  # state_dict() during the run: the files' values; load_state_dict(): refused
        hooks.append(BlockValuesHook(tier, model))
        hooks[-1].attach()
        if optimizer is not None:
            tier.manual_optimization = not trainer.lightning_module.automatic_optimization
    return StreamingSession(engine, hooks, planner, stacks, overlap_optimizer)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def as_devices(devices: Sequence[Union[int, str, torch.device]]) -> list[torch.device]:
    """The devices the Trainer resolved, as ``torch.device``\\ s (an int is a CUDA index)."""
    return [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]


def join_ranks(
    model: nn.Module, strategy: Any, trainer: Any, knobs: dict[str, Any], deferred: Optional[DeferredInit] = None
) -> None:
    """Before a run on several ranks streams: the same model and knobs everywhere (else one error on every rank),
    what is not supported there yet refused, and rank 0's parameters and buffers given to every rank (those whose
    init calls are ``deferred`` are given rank 0's random draws instead, and stay uninitialized until the disk tier
    writes their blocks).

    Raises:
        RanksDisagreeError: The ranks differ (the message names what and where).
        MisconfigurationException: ``sync_batchnorm``, which converts no layers here.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    call = (f"`Trainer(strategy=SuperpipeStrategy(...), devices={len(strategy.parallel_devices)},"
            f" num_nodes={strategy.num_nodes})`")
    check_same_setup(fingerprint(model, knobs, str(strategy.precision_plugin.precision)), call)
    if strategy._layer_sync is not None and trainer.state.fn == "fit":
        raise MisconfigurationException(
            "`Trainer(strategy='superpipe', sync_batchnorm=True)` is not supported yet: each rank keeps its own"
            " BatchNorm statistics. Leave `sync_batchnorm` off."
        )
    if knobs.get("shard_optimizer") and str(strategy.precision_plugin.precision) == "16-mixed":
        raise MisconfigurationException(
            f"`SuperpipeStrategy(shard_optimizer={knobs['shard_optimizer']!r})` does not support"
            " `precision='16-mixed'` yet (its gradient scaler checks every gradient, and each rank keeps only its"
            " share); use 'bf16-mixed' or fp32."
        )
    averaging = weight_averaging_callbacks(trainer) if knobs.get("shard_optimizer") == "node" else []
    if averaging and trainer.state.fn == "fit":
        raise MisconfigurationException(
            f"`SuperpipeStrategy(shard_optimizer='node')` does not support the callback {type(averaging[0]).__name__}:"
            " it writes the averaged weights into the parameters on every rank, and the node's ranks share one copy of"
            " the blocks. Use `shard_optimizer=True` (each rank its own copy of the masters) with it."
        )
    if deferred is not None:
        deferred.adopt_rank_zero_draws()
    broadcast_from_rank_zero(model, strategy.root_device, skip=deferred.determines if deferred is not None else None)



def install_clipping(plugin: Any, engine: Optional[StreamingEngine]) -> None:
    """Points the precision plugin's ``clip_gradients`` where this strategy's gradients are.

    Lightning's mixed-precision plugin refuses to clip for optimizers that unscale inside ``step`` (fused AdamW, the
    fastest host optimizer), which matters only with a gradient scaler; ``bf16-mixed`` has none: the plain way then.
    Under the disk tier the blocks' gradients are on disk: the tier clips (:meth:`DiskTier.clip_gradients`), and a
    gradient scaler's ``unscale_`` also checks and unscales them (:meth:`DiskTier.unscale`). The strategy's teardown
    takes the instance attributes away again (:func:`uninstall_clipping`).
    """
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    averager = engine.gradients.averager if engine is not None else None
    tier = disk_tier_of(engine)
    if tier is not None:
        scaler = getattr(plugin, "scaler", None)
        plugin.clip_gradients = tier.clip_gradients
        if scaler is not None:
            unscale = scaler.unscale_

            def unscale_(optimizer: Optimizer) -> None:
                unscale(optimizer)
                tier.unscale(scaler, optimizer)

            scaler.unscale_ = unscale_
    elif averager is not None and averager.sharded:  # each rank holds only its share of the gradients
        plugin.clip_gradients = partial(_clip_shared, plugin, averager)
    elif isinstance(plugin, MixedPrecision) and plugin.scaler is None:
        plugin.clip_gradients = partial(Precision.clip_gradients, plugin)


def uninstall_clipping(plugin: Any) -> None:
    """Gives the precision plugin (and its gradient scaler) back their own methods."""
    vars(plugin).pop("clip_gradients", None)
    if getattr(plugin, "scaler", None) is not None:
        vars(plugin.scaler).pop("unscale_", None)


def _clip_shared(plugin: Any, averager: GradientAverager, optimizer: Optimizer, clip_val: float = 0.0,
                 gradient_clip_algorithm: Any = "norm") -> None:
    """``Precision.clip_gradients`` for gradients sharded across ranks: by value as usual (each rank its own), by
    norm with the global norm (:meth:`GradientAverager.clip_by_norm`)."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    if clip_val <= 0:
        return
    if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        Precision.clip_grad_by_value(plugin, optimizer, clip_val)
    else:
        averager.clip_by_norm(list(plugin.main_params(optimizer)), clip_val)


def strategy_report(
    engine: StreamingEngine, params: list[nn.Parameter], optimizers: Sequence[Optimizer], stacks: list[str],
    plan: Any, device: torch.device,
) -> dict[str, Any]:
    """The strategy's memory report (see :meth:`SuperpipeStrategy.memory_report`)."""
    report: dict[str, Any] = {
        **engine.memory_report(),
        **training_state_bytes(params, optimizers),
        "streamed_stacks": list(stacks),
    }
    if plan is not None:
        report["plan"] = plan.as_dict()
    if device.type == "cuda":
        report["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return report
