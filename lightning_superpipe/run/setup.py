"""Starting to stream: the blocks found, what of the knobs needs them checked, the homes (of the kind
``offload_device`` chose) and the engine built.

This is the body of :meth:`SuperpipeStrategy.model_to_device`, kept here so that the strategy stays glue. The knobs
were checked on their own when the strategy was made (:mod:`.options`); what needs the model or the run is checked
here, before anything is allocated, so a bad knob leaves the model as it was. Under several devices
:func:`join_ranks` runs first, and the engine averages gradients across ranks (:mod:`.distributed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.averaging import weight_averaging_callbacks
from lightning_superpipe.construction.deferred_init import DeferredInit, UnfilledNewTensors
from lightning_superpipe.memory.fourbit.frozen4bit import quantized_format
from lightning_superpipe.memory.fourbit.frozen_quantization import (
    check_quantize_frozen,
    given_back_on_error,
    quantize_frozen,
)
from lightning_superpipe.memory.fourbit.packed import packed_format, split_packed
from lightning_superpipe.memory.fourbit.packed_state import clone_packed_entries
from lightning_superpipe.memory.fourbit.quantized_layers import check_quantized_layers
from lightning_superpipe.memory.home import HomeKind, HomesBuilder, HomesRun
from lightning_superpipe.memory.host import training_state_bytes
from lightning_superpipe.planning.planner import BudgetPlanner, static_costs
from lightning_superpipe.run.options import SuperpipeOptions
from lightning_superpipe.run.session import StreamingSession
from lightning_superpipe.streaming.blocks import (
    NoBlocksFoundError,
    assign_parameters,
    describe,
    describe_stacks,
    find_blocks,
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
from lightning_superpipe.streaming.hooks import attach_hooks


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

    Buffers (and torchmetrics states) go to ``device``; parameters stay home (of the kind ``options`` chose), with
    ``options.quantize_frozen`` the blocks' frozen matrices in 4 bits (their values given back when the run stops).
    With ``ranks`` above one, the engine averages the gradients across them (with ``options.shard_optimizer``, resolved
    from ``"auto"`` by the strategy, each block's to its owner rank only; with ``node``, ``"node"``, the homes shared
    by the node's ranks); the homes of global rank ``rank`` are told of the node's ``local_ranks``, and ``resume`` is
    the folder a checkpoint's homes are restored from (:meth:`.HomeKind.resume_folder`).

    Raises:
        MisconfigurationException: A knob the user gave does not suit the model or the run (the message quotes it),
            or the model holds quantized layers it cannot stream, or bitsandbytes 4-bit ones under knobs they do not
            support yet, or ``quantize_frozen`` meets what it does not support (:class:`.QuantizedLayerError`);
            nothing was allocated.
    """
    kind = options.home_kind
    assert kind is not None, "SuperpipeOptions refuses an offload_device no kind of home is registered as"
    blocks = blocks_or_none(model, options.blocks)
    check_for_run(options, kind, len(blocks), fitting=fitting, trainer=trainer, optimizers=optimizers, ranks=ranks)
    stacks = describe_stacks(model, blocks)
    block_params, trunk_params = assign_parameters(model, blocks, mixed_precision=transfer_dtype is not None)
    check_quantized_layers(model, block_params, options)
    check_block_dtypes(model, block_params)
    check_quantize_frozen(options, model, block_params)
    planner, (resident, ahead, modes) = first_placement(options, device, block_params, trunk_params, transfer_dtype,
                                                        fitting)
    run = HomesRun(options, model, block_params, trunk_params, device, transfer_dtype, fitting,
                   optimizers=optimizers, trainer=trainer, slots=ahead + 1,
                   what=describe(blocks), deferred=deferred, resume=resume, ranks=ranks, rank=rank,
                   local_ranks=local_ranks, node=node, barrier=ready_on_every_rank)
    kind.check_host_room(run)
    packed = {p for params in block_params for p in params if packed_format(p) and not quantized_format(p)}
    builder = kind.prepare(run)
    # Once nothing but building the homes can refuse the run; given back if that fails. Before the rest of a deferred
    # init runs in place: frozen matrices quantized from values made apart (a kind may write them block by block).
    frozen = quantize_frozen(model, block_params, options.quantize_frozen, transfer_dtype, deferred,
                             builder.write_frozen)
    with given_back_on_error(frozen):
        engine = build_engine(run, builder, (resident, ahead, modes), options.link, packed)
    if frozen is not None:
        frozen.started()
    if ranks > 1:
        engine.gradients.averager = averager_for(block_params, trunk_params, device, options, ranks, node)
    hooks = attach_hooks(engine, model, blocks)
    if frozen is not None:  # detached with the hooks when the run ends, before the engine closes
        hooks.append(frozen)
    hooks += engine.home_kind.run_hooks(model, trainer)
    return StreamingSession(engine, hooks, planner, stacks, options.overlap_optimizer)


def build_engine(run: HomesRun, builder: HomesBuilder, placement: tuple[Any, int, Any], link: Any,
                 packed: set[nn.Parameter]) -> StreamingEngine:
    """The homes (``builder``'s) and the engine over them at ``placement`` (resident blocks, prefetch, activations),
    the rest of the model (buffers, torchmetrics states) moved to the device between the two, and the ``packed``
    weights' state-dict entries made copies; whatever the homes built goes again if this fails."""
    resident, ahead, modes = placement
    try:
        builder.before_engine()
        move_the_rest(run.model, run.device, run.deferred)
        # torch.save refuses the views of other dtypes that packed weights are in their homes: state dicts hold copies.
        clone_packed_entries(run.model, packed)
        if run.node is not None:  # the engine's homes are built together by the node's ranks: all of them must be here
            ready_on_every_rank("start streaming")
        return StreamingEngine(run.block_params, run.trunk_params, run.device, resident_blocks=resident,
                               prefetch=ahead, homes=builder.homes, link=link, activations=modes)
    except BaseException:
        builder.discard()
        raise


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
    options: SuperpipeOptions, kind: HomeKind, num_blocks: int, *, fitting: bool, trainer: Any,
    optimizers: Sequence[Optimizer], ranks: int,
) -> None:
    """What of the knobs the constructor could not check: against the model's ``num_blocks``, and what the ``kind`` of
    home needs of the run (its folder, the optimizer, sharding on several ``ranks``).

    Raises:
        MisconfigurationException: With the user's call.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    try:
        options.check_for_model(num_blocks)
        kind.check_run(options, fitting=fitting, trainer=trainer, optimizers=optimizers, ranks=ranks)
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


def move_the_rest(model: nn.Module, device: torch.device, deferred: Optional[DeferredInit]) -> None:
    """Everything of ``model`` but its parameters (and their gradients) to ``device``: buffers, torchmetrics states.
    With the init calls ``deferred``, the rest of what ``configure_model`` built is made first, in place."""
    if deferred is not None:  # the blocks are in their homes: the rest of what configure_model built, in place
        deferred.materialize(model)
    at_home = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
    model._apply(lambda t: t if id(t) in at_home else t.to(device))


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
    draws instead, and stay uninitialized until their homes are written).

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
    A kind of home that keeps the blocks' gradients outside ``.grad`` clips them itself
    (:attr:`.Homes.clips_gradients`), and a gradient scaler's ``unscale_`` also checks and unscales them there
    (:meth:`.Homes.unscale`). The strategy's teardown takes the instance attributes away again
    (:func:`uninstall_clipping`).
    """
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    averager = engine.gradients.averager if engine is not None else None
    homes = engine.home_kind if engine is not None else None
    if homes is not None and homes.clips_gradients:
        scaler = getattr(plugin, "scaler", None)
        plugin.clip_gradients = homes.clip_gradients
        if scaler is not None:
            unscale = scaler.unscale_

            def unscale_(optimizer: Optimizer) -> None:
                unscale(optimizer)
                homes.unscale(scaler, optimizer)

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
