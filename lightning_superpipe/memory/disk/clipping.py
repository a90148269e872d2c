"""Clipping and gradient scaling over the disk tier's spilled gradients: the global norm from each spilled
gradient's norm and the ones in memory, as ``torch.nn.utils.clip_grad_norm_`` computes it, and a ``16-mixed``
scaler's check of spilled gradients. :class:`~lightning_superpipe.memory.disk.tier.DiskTier` applies them (the
trunk's gradients in memory now, the spilled ones as they are stepped from disk)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk import DiskStore


def spilled_norms(store: DiskStore) -> dict[nn.Parameter, Optional[Tensor]]:
    """The 2-norm of each spilled gradient of ``store`` (of its sum over the micro-batches)."""
    for index, params in enumerate(store.params):
        if store.spilled(index) and not store.has_norms(index):
            # Spilled in an earlier micro-batch only: read back once for the norms.
            store.spill_grads(index, [None] * len(params), accumulate=True, norms=True)
    norms: dict[nn.Parameter, Optional[Tensor]] = {}
    for index, params in enumerate(store.params):
        if store.spilled(index):
            norms.update(zip(params, store.grad_norms(index)))
    return norms


def clip_by_global_norm(
    optimizer: Optimizer, spilled: Collection[nn.Parameter], norms: dict[nn.Parameter, Optional[Tensor]],
    unscale: Optional[Tensor], clip_val: float,
) -> Optional[Tensor]:
    """Clips by the global norm of the ``optimizer``'s gradients, in its parameter order as
    ``torch.nn.utils.clip_grad_norm_`` takes it: those in memory are scaled now; the factor for the ``spilled`` ones
    (whose ``norms`` are given, before an ``unscale`` a scaler applies as they are stepped) is returned, or ``None``
    where there is no gradient."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    in_memory: list[Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in spilled:
                norm = norms.get(param)
                if norm is not None:
                    if unscale is not None:  # a power of two: the unscaled gradient's norm exactly
                        norm = norm * unscale
                    groups.setdefault((torch.device("cpu"), param.dtype), []).append(norm)
            elif param.grad is not None:
                in_memory.append(param.grad)
                groups.setdefault((param.grad.device, param.grad.dtype), []).append(
                    torch.linalg.vector_norm(param.grad, 2.0)
                )
    every = [norm for group_norms in groups.values() for norm in group_norms]
    if not every:
        return None
    first = every[0].device
    total = torch.linalg.vector_norm(torch.stack([norm.to(first) for norm in every]), 2.0)
    scale = torch.clamp(clip_val / (total + 1e-6), max=1.0)
    for grad in in_memory:
        grad.mul_(scale.to(grad.device))
    return scale


def scaler_found_inf(scaler: Any, optimizer: Optimizer, norms: dict[nn.Parameter, Optional[Tensor]]) -> bool:
    """Completes ``GradScaler.unscale_(optimizer)``, which saw the gradients in memory only: a spilled gradient whose
    norm is not finite counts as the scaler's non-finite gradient (so ``scaler.step`` skips the step and
    ``scaler.update`` lowers the scale, as for one in memory). Whether any gradient was not finite. The scaler's
    per-optimizer state has held ``found_inf_per_device`` since torch 1.6."""
    found = any(n is not None and not bool(torch.isfinite(n)) for n in norms.values())
    per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    cpu = torch.device("cpu")
    if cpu not in per_device:  # also when every gradient is spilled: scaler.step needs one check at least
        per_device[cpu] = torch.zeros(1)
    if found:
        per_device[cpu].fill_(1.0)
    return any(bool(flag.item()) for flag in per_device.values())
