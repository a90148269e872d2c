"""Starting to stream: the strategy's knobs checked, the blocks found, the homes (host or disk) and the engine built.

This is the body of :meth:`SuperpipeStrategy.model_to_device`, kept here so that the strategy stays glue: every
check runs before anything is allocated, so a bad knob leaves the model as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk import DiskTierError
from lightning_superpipe.memory.host import check_host_memory, host_bytes_to_come, training_state_bytes
from lightning_superpipe.planning.budget import MemoryBudget
from lightning_superpipe.planning.planner import BudgetPlanner, static_costs
from lightning_superpipe.streaming.activations import ActivationsPolicy
from lightning_superpipe.streaming.blocks import BlockPolicy, assign_parameters, describe, describe_stacks, find_blocks
from lightning_superpipe.streaming.disk_tier import (
    DiskTier,
    check_offload,
    check_training,
    disk_host_bytes,
    offload_call,
)
from lightning_superpipe.streaming.engine import StreamingEngine, check_knobs
from lightning_superpipe.streaming.hooks import Hook, attach_hooks


#: The strategy's knobs that :func:`start_streaming` takes, by attribute name.
KNOBS = ("memory_budget", "resident_blocks", "prefetch", "activations", "overlap_optimizer", "block_policy", "link",
         "offload_device", "offload_path", "host_buffer_bytes")


@dataclass
class Streaming:
    """What :func:`start_streaming` built: the engine, the hooks on the blocks, the planner, where the blocks are."""

    engine: StreamingEngine
    hooks: list[Hook]
    planner: Optional[BudgetPlanner]
    stacks: list[str]


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
    trainer: Any = None,
    optimizers: tuple[Optimizer, ...] = (),
    resume: Optional[Path] = None,
) -> Streaming:
    """Finds the blocks, checks the knobs, builds the homes and the engine, and hooks the blocks.

    Buffers (and torchmetrics states) go to ``device``; parameters stay home (host memory or the disk tier).

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
        check_knobs(overlap_optimizer, resident_blocks, prefetch, activations, link, len(blocks))
        check_offload(offload_device, offload_path, host_buffer_bytes)
        if disk and memory_budget is not None:
            raise ValueError(f"{call}: memory_budget is not supported with the disk tier yet; give resident_blocks"
                             " and prefetch instead.")
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
            tier = DiskTier.build(offload_path, block_params, names, state_names, optimizer, transfer_dtype,
                                  host_buffer_bytes, ahead + 1, resume)
        except DiskTierError as error:
            raise MisconfigurationException(f"{call}: {error}") from error
    try:
        at_home = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
        model._apply(lambda t: t if id(t) in at_home else t.to(device))
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    engine = StreamingEngine(
        block_params, trunk_params, device, resident_blocks=resident, prefetch=ahead,
        transfer_dtype=transfer_dtype, link=link, activations=modes, tier=tier,
    )
    return Streaming(engine, attach_hooks(engine, model, blocks), planner, stacks)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def single_device(devices: Sequence[Union[int, str, torch.device]]) -> list[torch.device]:
    """The devices the Trainer resolved, as ``torch.device``\\ s (an int is a CUDA index).

    Raises:
        ValueError: More than one: the strategy streams through one device.
    """
    if len(devices) > 1:
        raise ValueError(
            f"`Trainer(strategy='superpipe')` streams through one device, but the Trainer resolved {len(devices)}"
            f" ({', '.join(str(d) for d in devices)}). Use `Trainer(devices=1)`; several devices are not"
            " supported yet."
        )
    return [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]


def install_clipping(plugin: Any, engine: Optional[StreamingEngine]) -> None:
    """Points the precision plugin's ``clip_gradients`` where this strategy's gradients are.

    Lightning's mixed-precision plugin refuses to clip for optimizers that unscale inside ``step`` (fused AdamW, the
    fastest host optimizer), which matters only with a gradient scaler; ``bf16-mixed`` has none: the plain way then.
    Under the disk tier the blocks' gradients are on disk: the tier clips (:meth:`DiskTier.clip_gradients`). The
    strategy's teardown takes the instance attribute away again.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    if engine is not None and engine.tier is not None:
        plugin.clip_gradients = engine.tier.clip_gradients
    elif isinstance(plugin, MixedPrecision) and plugin.scaler is None:
        plugin.clip_gradients = partial(Precision.clip_gradients, plugin)


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
