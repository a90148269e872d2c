"""Starting to stream: the blocks found, what of the knobs needs them checked, the homes (host or disk) and the engine
built.

This is the body of :meth:`SuperpipeStrategy.model_to_device`, kept here so that the strategy stays glue. The knobs
were checked on their own when the strategy was made (:mod:`.options`); what needs the model or the run is checked
here, before anything is allocated, so a bad knob leaves the model as it was. Under several devices
:func:`join_ranks` runs first, and the engine averages gradients across ranks (:mod:`.distributed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.memory.disk import DiskTierError
from lightning_superpipe.memory.disk_trunk import trunk_on_disk
from lightning_superpipe.memory.frozen4bit import quantized_bytes, quantized_format
from lightning_superpipe.memory.host import build_homes, check_host_memory, host_bytes_to_come, training_state_bytes
from lightning_superpipe.memory.packed import packed_format, split_packed
from lightning_superpipe.planning.planner import BudgetPlanner, static_costs
from lightning_superpipe.streaming.blocks import (
    NoBlocksFoundError,
    assign_parameters,
    describe,
    describe_stacks,
    find_blocks,
)
from lightning_superpipe.streaming.deferred_init import DeferredInit, UnfilledNewTensors
from lightning_superpipe.streaming.disk_tier import (
    BlockValuesHook,
    DiskTier,
    check_disk_host_room,
    check_training,
    disk_host_bytes,
    disk_tier_of,
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
from lightning_superpipe.streaming.engine import StreamingEngine
from lightning_superpipe.streaming.frozen_files import FrozenFiles, frozen_files, split_frozen
from lightning_superpipe.streaming.frozen_quantization import (
    check_quantize_frozen,
    frozen_matrices,
    given_back_on_error,
    quantize_frozen,
)
from lightning_superpipe.streaming.hooks import attach_hooks
from lightning_superpipe.streaming.options import SuperpipeOptions
from lightning_superpipe.streaming.packed_state import clone_packed_entries
from lightning_superpipe.streaming.quantized_layers import check_quantized_layers
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


def start_streaming(
    model: nn.Module,
    device: torch.device,
    options: SuperpipeOptions,
    *,
    transfer_dtype: Optional[torch.dtype],
    fitting: bool,
    trainer: Any = None,
    optimizers: tuple[Optimizer, ...] = (),
    resume: Optional[Path] = None,
    deferred: Optional[DeferredInit] = None,
    ranks: int = 1,
    rank: int = 0,
    local_ranks: int = 1,
    node: Optional[NodeShare] = None,
) -> StreamingSession:
    """Finds the blocks, checks what of the knobs needs the model and the run, builds the homes and the engine, and
    hooks the blocks.

    Buffers (and torchmetrics states) go to ``device``; parameters stay home (host memory or the disk tier), with
    ``options.quantize_frozen`` the blocks' frozen matrices in 4 bits (their values given back when the run stops).
    With ``ranks`` above one, the engine averages the gradients across them (with ``options.shard_optimizer``, resolved
    from ``"auto"`` by the strategy, each block's to its owner rank only; with ``node``, ``"node"``, the homes shared
    by the node's ranks); the disk tier of global rank ``rank`` keeps its files in a folder of its own, beside those
    of the node's ``local_ranks``.

    Raises:
        MisconfigurationException: A knob the user gave does not suit the model or the run (the message quotes it),
            or the model holds quantized layers it cannot stream, or bitsandbytes 4-bit ones under knobs they do not
            support yet, or ``quantize_frozen`` meets what it does not support (:class:`.QuantizedLayerError`);
            nothing was allocated.
    """
    blocks = blocks_or_none(model, options.blocks)
    check_for_run(options, len(blocks), fitting=fitting, trainer=trainer, optimizers=optimizers, ranks=ranks)
    stacks = describe_stacks(model, blocks)
    block_params, trunk_params = assign_parameters(model, blocks, mixed_precision=transfer_dtype is not None)
    check_quantized_layers(model, block_params, options)
    check_block_dtypes(model, block_params)
    check_quantize_frozen(options, model, block_params)
    planner, (resident, ahead, modes) = first_placement(options, device, block_params, trunk_params, transfer_dtype,
                                                        fitting)
    disk = options.offload_device == "disk"
    optimizer = optimizers[0] if disk and fitting else None
    check_host_room(options, describe(blocks), block_params, trunk_params, device, transfer_dtype, fitting, optimizer,
                    ahead + 1, model, deferred)
    packed = {p for params in block_params for p in params if packed_format(p) and not quantized_format(p)}
    files = frozen_files(options, block_params, transfer_dtype, rank, ranks) if disk else None
    # Once nothing but building the homes can refuse the run; given back if that fails. Before the rest of a deferred
    # init runs in place: frozen matrices quantized from values made apart (the disk tier's files: block by block).
    frozen = quantize_frozen(model, block_params, options.quantize_frozen, transfer_dtype, deferred,
                             files.write_block if files is not None else None)
    with given_back_on_error(frozen):
        tier = None
        if disk:
            tier = build_tier(options, model, block_params, optimizer, transfer_dtype, ahead + 1, resume, deferred,
                              ranks=ranks, rank=rank, local_ranks=local_ranks, frozen=files, trunk=trunk_params)
        move_the_rest(model, device, deferred, tier)
        # torch.save refuses the views of other dtypes that packed weights are in their homes: state dicts hold copies.
        clone_packed_entries(model, packed)
        if node is not None:  # the engine's homes are built together by the node's ranks: all of them must be here
            ready_on_every_rank("start streaming")
        homes = (lambda arena: tier) if tier is not None else partial(build_homes, block_params, transfer_dtype,
                                                                        node=node)
        engine = StreamingEngine(
            block_params, trunk_params, device, resident_blocks=resident, prefetch=ahead, homes=homes,
            link=options.link, activations=modes,
        )
    if frozen is not None:
        frozen.started()
    if ranks > 1:
        engine.gradients.averager = averager_for(block_params, trunk_params, device, options, ranks, node)
    hooks = attach_hooks(engine, model, blocks)
    if frozen is not None:  # detached with the hooks when the run ends, before the engine closes
        hooks.append(frozen)
    if tier is not None:  # state_dict() during the run: the files' values; load_state_dict(): refused
        hooks.append(BlockValuesHook(tier, model))
        hooks[-1].attach()
        if optimizer is not None:
            tier.manual_optimization = not trainer.lightning_module.automatic_optimization
    return StreamingSession(engine, hooks, planner, stacks, options.overlap_optimizer)


def blocks_or_none(model: nn.Module, policy: Optional[Any]) -> list[nn.Module]:
    """The blocks of ``model`` under ``policy``. With no policy given and no stack of layers found, none, said once:
    the model then runs whole on the device, as under a single-device strategy."""
    try:
        return find_blocks(model, policy)
    except NoBlocksFoundError as error:
        if policy is not None:
            raise
        rank_zero_info(f"{error} Until then nothing streams: {type(model).__name__} stays on the device whole, as"
                       " under a single-device strategy.")
        return []


def check_block_dtypes(model: nn.Module, block_params: Sequence[Sequence[nn.Parameter]]) -> None:
    """Refuses, before anything is allocated, a block whose floating parameters do not share a dtype (a bf16 base
    under adapters peft made in float32): each block streams from one flat buffer of one dtype.

    Raises:
        MisconfigurationException: Naming two of the parameters and what to do.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    names = {p: name for name, p in model.named_parameters()}
    for index, params in enumerate(block_params):
        floating, _ = split_packed(params)
        first = {}
        for param in floating:
            first.setdefault(param.dtype, param)
        if len(first) > 1:
            (a_dtype, a), (b_dtype, b) = list(first.items())[:2]
            raise MisconfigurationException(
                f"SuperpipeStrategy streams each block from one buffer of one dtype, but block {index} holds"
                f" {names.get(a, 'a parameter')!r} in {a_dtype} and {names.get(b, 'another')!r} in {b_dtype} (a"
                " 16-bit base under adapters peft made in float32, say). Give the block one dtype before `fit`:"
                " `model.to(torch.bfloat16)` after `get_peft_model` (or `get_peft_model(...,"
                " autocast_adapter_dtype=False)`), or load the base in float32 and train with"
                " precision='bf16-mixed', which streams it in bfloat16. Nothing was allocated."
            )


def check_for_run(
    options: SuperpipeOptions, num_blocks: int, *, fitting: bool, trainer: Any, optimizers: Sequence[Optimizer],
    ranks: int,
) -> None:
    """What of the knobs the constructor could not check: against the model's ``num_blocks``, the folder of the disk
    tier, sharding on several ``ranks`` with it, and what the tier cannot train.

    Raises:
        MisconfigurationException: With the user's call.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    call = options.offload_call
    disk, shard_optimizer = options.offload_device == "disk", options.shard_optimizer
    try:
        if disk and ranks > 1 and shard_optimizer:
            raise ValueError(
                f"{call} keeps each rank's copy of the training state in files of its own, so"
                f" shard_optimizer={shard_optimizer!r} does not apply: leave it False, or use offload_device='cpu'"
                " to shard the optimizer state across ranks."
            )
        options.check_for_model(num_blocks)
        options.check_offload_path()
        if disk and fitting:
            check_training(trainer, optimizers, call)
    except ValueError as error:
        raise MisconfigurationException(str(error)) from error


def first_placement(
    options: SuperpipeOptions, device: torch.device, block_params: list[list[nn.Parameter]],
    trunk_params: list[nn.Parameter], transfer_dtype: Optional[torch.dtype], fitting: bool,
) -> tuple[Optional[BudgetPlanner], tuple[Any, Any, Any]]:
    """The planner (with ``memory_budget``) and the placement to start from: the knobs as given, with their defaults,
    or, with a budget, the placement that needs least memory."""
    knobs = (options.resident_blocks, options.prefetch, options.activations)
    placement = (_or(knobs[0], 1), _or(knobs[1], 1), _or(knobs[2], "recompute"))
    if options.memory_budget is None:
        return None, placement
    planner = BudgetPlanner(options.memory_budget, device, *knobs)
    static = static_costs(block_params, trunk_params, transfer_dtype, fitting)
    return planner, planner.first_placement(static, fitting)


def check_host_room(
    options: SuperpipeOptions, what: str, block_params: list[list[nn.Parameter]], trunk_params: list[nn.Parameter],
    device: torch.device, transfer_dtype: Optional[torch.dtype], fitting: bool, optimizer: Optional[Optimizer],
    slots: int, model: Optional[nn.Module] = None, deferred: Optional[DeferredInit] = None,
) -> None:
    """Refuses, before anything is allocated, a run whose host memory is too small: for the homes of the blocks
    (``what``; with ``quantize_frozen`` their frozen matrices in 4 bits), gradients and optimizer state, and what the
    ``deferred`` init of ``model`` will fill in place; or, with the disk tier, its buffers for ``slots`` device
    slots.

    Raises:
        HostMemoryError: With the bytes needed and available.
    """
    if options.offload_device == "disk":
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        # A 4-bit base is in files of its own, read through staging buffers of the largest block's frozen bytes.
        masters, frozen_bytes = split_frozen(block_params, options.quantize_frozen, transfer_dtype)
        try:  # the pool, the gradients arriving, the cast's staging and the trunk's state
            parts = disk_host_bytes(masters, trunk_params if fitting else [], optimizer, transfer_dtype, slots,
                                    options.host_buffer_bytes, pinned=device.type == "cuda")
        except DiskTierError as error:  # a bound below the least pool
            raise MisconfigurationException(f"{options.offload_call}: {error}") from error
        parts = replace(parts, staging=parts.staging + (slots + 1) * max(frozen_bytes, default=0))
        check_disk_host_room(parts, options.host_buffer_bytes)
    else:
        mode = options.quantize_frozen
        frozen = {p for params in block_params for p in frozen_matrices(params)} if mode is not None else set()
        streamed = [[p for p in params if p not in frozen] for params in block_params]
        needed = host_bytes_to_come(streamed, trunk_params, transfer_dtype, fitting, pinned=device.type == "cuda")
        needed += sum(quantized_bytes(p.numel(), mode) for p in frozen if not quantized_format(p))
        if deferred is not None and model is not None:  # all but the frozen matrices, quantized from values apart
            needed += deferred.pending_bytes(t for t in [*model.parameters(), *model.buffers()] if t not in frozen)
        kept = ""
        if fitting and options.overlap_optimizer == "speculative":  # "auto" speculates only where memory allows
            params = [p for block in block_params for p in block] + list(trunk_params)
            needed += 12 * sum(p.numel() for p in params if p.requires_grad)
            kept = (" and the state a speculative optimizer step keeps while backward runs;"
                    " overlap_optimizer='pipelined' keeps none")
        check_host_memory(needed, f"homes for {what}, gradients and optimizer state{kept}")


def build_tier(
    options: SuperpipeOptions, model: nn.Module, block_params: list[list[nn.Parameter]],
    optimizer: Optional[Optimizer], transfer_dtype: Optional[torch.dtype], slots: int, resume: Optional[Path],
    deferred: Optional[DeferredInit], *, ranks: int, rank: int, local_ranks: int, frozen: Optional[FrozenFiles] = None,
    trunk: Sequence[nn.Parameter] = (),
) -> DiskTier:
    """The disk tier's store under ``offload_path`` (on several ranks, this rank's folder in it, once every rank
    checked the node's space), written from the model or restored from ``resume``; of the ``trunk`` parameters, those
    that go to its files when it trains (:func:`~lightning_superpipe.memory.disk_trunk.trunk_on_disk`), each a
    record after the blocks'.

    Raises:
        MisconfigurationException: The folder cannot hold it (the message quotes the user's call).
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    assert options.offload_path is not None
    trunk = trunk_on_disk(trunk) if optimizer is not None else []  # matrices that train; the rest stays in memory
    names = {p: name for name, p in model.named_parameters()}
    streamed = {p for params in block_params for p in params} | set(trunk)
    state_names = {name for name, p in model.named_parameters(remove_duplicate=False) if p in streamed}
    masters = [split_packed(params)[0] for params in block_params]  # the 4-bit base goes to ``frozen``'s files
    in_store = {p for params in masters for p in params} | set(trunk)
    try:
        folder = Path(options.offload_path)
        if ranks > 1:  # every rank checks the node's space before any of them writes
            records = [*masters, *([p] for p in trunk)]
            folder = rank_folder(options.offload_path, rank, local_ranks, records, optimizer, resume is None)
            ready_on_every_rank("check the disk tier's folders")
        tier = DiskTier.build(folder, block_params, names, state_names, optimizer, transfer_dtype,
                              options.host_buffer_bytes, slots, resume, deferred, frozen, trunk)
        tier.frozen_names = {name for name, p in model.named_parameters(remove_duplicate=False)
                             if p in streamed and p not in in_store}
        return tier
    except DiskTierError as error:
        raise MisconfigurationException(f"{options.offload_call}: {error}") from error


def move_the_rest(model: nn.Module, device: torch.device, deferred: Optional[DeferredInit],
                  tier: Optional[DiskTier]) -> None:
    """Everything of ``model`` but its parameters (and their gradients) to ``device``: buffers, torchmetrics states.
    With the init calls ``deferred``, the rest of what ``configure_model`` built is made first, in place; a failure
    closes the ``tier``."""
    if deferred is not None:  # the blocks are in their files: the rest of what configure_model built, in place
        deferred.materialize(model)
    try:
        at_home = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
        model._apply(lambda t: t if id(t) in at_home else t.to(device))
    except BaseException:
        if tier is not None:
            tier.close()
        raise


def averager_for(
    block_params: list[list[nn.Parameter]], trunk_params: list[nn.Parameter], device: torch.device,
    options: SuperpipeOptions, ranks: int, node: Optional[NodeShare],
) -> GradientAverager:
    """What averages the gradients across ``ranks``; with ``shard_optimizer``, each block's and each trunk
    parameter's to its owner (balanced by bytes)."""
    parts = [(params, sum(p.numel() * p.element_size() for p in params)) for params in block_params if params]
    parts += [([param], param.numel() * param.element_size()) for param in trunk_params]
    # Owners among the node's ranks (the same on every node) when they share the homes, else among all.
    owners = assign_owners(parts, node.local_size if node is not None else ranks) if options.shard_optimizer else None
    return GradientAverager(device, owners, node=node)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def as_devices(devices: Sequence[Union[int, str, torch.device]]) -> list[torch.device]:
    """The devices the Trainer resolved, as ``torch.device``\\ s (an int is a CUDA index)."""
    return [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]


def join_ranks(
    model: nn.Module, strategy: Any, trainer: Any, options: SuperpipeOptions, deferred: Optional[DeferredInit] = None
) -> None:
    """Before a run on several ranks streams: the same model and knobs (``options``, with ``shard_optimizer``
    resolved) everywhere (else one error on every rank), what is not supported there yet refused, and rank 0's
    parameters and buffers given to every rank (those whose init calls are ``deferred`` are given rank 0's random
    draws instead, and stay uninitialized until the disk tier writes their blocks).

    Raises:
        RanksDisagreeError: The ranks differ (the message names what and where).
        MisconfigurationException: ``sync_batchnorm``, which converts no layers here; a sharding the run refuses.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    call = (f"`Trainer(strategy=SuperpipeStrategy(...), devices={len(strategy.parallel_devices)},"
            f" num_nodes={strategy.num_nodes})`")
    check_same_setup(fingerprint(model, options.knobs(), str(strategy.precision_plugin.precision)), call)
    if strategy._layer_sync is not None and trainer.state.fn == "fit":
        raise MisconfigurationException(
            "`Trainer(strategy='superpipe', sync_batchnorm=True)` is not supported yet: each rank keeps its own"
            " BatchNorm statistics. Leave `sync_batchnorm` off."
        )
    shard_optimizer = options.shard_optimizer
    if shard_optimizer and str(strategy.precision_plugin.precision) == "16-mixed":
        raise MisconfigurationException(
            f"`SuperpipeStrategy(shard_optimizer={shard_optimizer!r})` does not support"
            " `precision='16-mixed'` yet (its gradient scaler checks every gradient, and each rank keeps only its"
            " share); use 'bf16-mixed' or fp32."
        )
    averaging = weight_averaging_callbacks(trainer) if shard_optimizer == "node" else []
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
    plan: Any, device: torch.device, profile: Any = None,
) -> dict[str, Any]:
    """The strategy's memory report (see :meth:`SuperpipeStrategy.memory_report`); with the planner's ``profile``,
    ``profiled_activation_bytes``: what a step saves for backward, as the profiled step counted it (every block's
    as ``"keep"`` would hold it, each storage once, and what it saved outside the blocks), which is what plain
    training saves."""
    report: dict[str, Any] = {
        **engine.memory_report(),
        **training_state_bytes(params, optimizers),
        "streamed_stacks": list(stacks),
    }
    # What the optimizer's `state` holds, and what the homes keep of it elsewhere (files).
    report["optimizer_state_bytes"] += report.get("home_optimizer_state_bytes", 0)
    if plan is not None:
        report["plan"] = plan.as_dict()
    if profile is not None:
        report["profiled_activation_bytes"] = (
            sum(block.kept_bytes for block in profile.blocks) + profile.outside_activation_bytes
        )
    if device.type == "cuda":
        report["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return report
