"""What the disk tier holds in host memory, counted before anything is allocated, and the one error that refuses a
``host_buffer_bytes`` or a model that cannot fit.

The tier's host memory is its pool of buffers (``host_buffer_bytes``, or by default a few buffers of the largest
block's record, masters, optimizer state and gradients), the gradients of up to two blocks at once as they arrive
from the device (one arriving, one being spilled or stepped), the staging buffers of the cast to the transfer dtype
(one per device slot and one more, of the largest block, page-locked), and the trunk (the parameters outside the
blocks): the small ones (norms, biases) with their gradients and optimizer state, and of the large ones, which keep
their masters and optimizer state in the tier's files (:mod:`~lightning_superpipe.memory.disk.trunk`), the gradient
arriving in host memory until the step's spill. With a bound, the pool is independent of the model: records larger
than a buffer go in pieces (:mod:`~lightning_superpipe.memory.disk.pieces`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.host_memory import HostMemoryError, available_host_bytes
from lightning_superpipe.memory.disk import DiskStore, probe_state_size
from lightning_superpipe.memory.disk.tier import READ_AHEAD
from lightning_superpipe.memory.disk.trunk import trunk_on_disk
from lightning_superpipe.memory.pinned import PAGE
from lightning_superpipe.units import format_bytes


@dataclass(frozen=True)
class DiskHostBytes:
    """The disk tier's host bytes, by what holds them.

    Attributes:
        pool: The store's buffers (at most ``host_buffer_bytes``).
        least_pool: The least ``host_buffer_bytes`` the store works with.
        gradients: Two blocks' gradients arriving from the device.
        staging: The staging buffers of the cast to the transfer dtype.
        trunk: The trunk's host state: the small parameters' gradients and optimizer state, the gradients of those in
            the files.
    """

    pool: int
    least_pool: int
    gradients: int
    staging: int
    trunk: int

    @property
    def others(self) -> int:
        """Everything but the pool: what ``host_buffer_bytes`` does not bound."""
        return self.gradients + self.staging + self.trunk

    @property
    def total(self) -> int:
        return self.pool + self.others

    def describe(self) -> str:
        return (
            f"the pool's buffers {format_bytes(self.pool)}, two blocks' gradients arriving"
            f" {format_bytes(self.gradients)}, the cast's staging {format_bytes(self.staging)}, the trunk's gradients"
            f" and in-memory optimizer state {format_bytes(self.trunk)}"
        )


def disk_host_bytes(
    block_params: Sequence[Sequence[nn.Parameter]],
    trunk_params: Sequence[nn.Parameter],
    optimizer: Optional[Optimizer],
    transfer_dtype: Optional[torch.dtype],
    slots: int,
    host_buffer_bytes: Optional[int],
    pinned: bool = False,
) -> DiskHostBytes:
    """The host bytes the disk tier will hold for these blocks (``slots`` device slots stream them) and trunk, whose
    large parameters go to the files as records of their own when it trains (they count in the pool's buffers).
    ``pinned`` (a CUDA device): the trunk's gradients also cross a page-locked staging buffer of their size.

    Raises:
        DiskTierError: ``host_buffer_bytes`` is below the least pool the store works with (the message names it).
    """
    fitting = optimizer is not None
    on_disk = trunk_on_disk(trunk_params) if fitting else []
    buffer_bytes, count, least = DiskStore.pool_for(
        [*block_params, *([p] for p in on_disk)],
        optimizer,
        spill_grads=fitting,
        host_buffer_bytes=host_buffer_bytes,
        read_ahead=slots + READ_AHEAD,
        min_buffers=2,
        sizing_blocks=len(block_params),
    )
    largest = max((sum(p.numel() for p in params) for params in block_params), default=0)
    dtypes = [params[0].dtype for params in block_params if params]
    casts = transfer_dtype is not None and any(dtype != transfer_dtype for dtype in dtypes)
    staging = (slots + 1) * largest * transfer_dtype.itemsize if casts and transfer_dtype is not None else 0
    per_element = 4 + probe_state_size(optimizer).per_element if fitting else 0
    in_memory = [p for p in trunk_params if p.requires_grad and all(p is not q for q in on_disk)]
    trunk = int(per_element * sum(p.numel() for p in in_memory)) + sum(p.numel() * p.element_size() for p in on_disk)
    if pinned and fitting:
        trunk += sum(p.numel() * p.element_size() for p in trunk_params if p.requires_grad)
    return DiskHostBytes(buffer_bytes * count, least, 2 * 4 * largest if fitting else 0, staging, trunk)


def check_disk_host_room(parts: DiskHostBytes, host_buffer_bytes: Optional[int]) -> None:
    """Refuses, before anything is allocated, a disk tier whose host memory exceeds what is available, naming the
    ``host_buffer_bytes`` that would fit (or that the model does not fit with the least pool).

    Raises:
        HostMemoryError: With the bytes by part, those available and what to give.
    """
    available = available_host_bytes()
    if available is None or parts.total <= available:
        return
    room = (available - parts.others) // PAGE * PAGE
    if room >= parts.least_pool:
        advice = (
            f"Give host_buffer_bytes={room} ({format_bytes(room)}) or less; the least that works is"
            f" {parts.least_pool} ({format_bytes(parts.least_pool)})."
        )
    else:
        advice = (
            f"Even the least pool that works (host_buffer_bytes={parts.least_pool}) leaves"
            f" {format_bytes(parts.others + parts.least_pool)} to hold: free host memory, train fewer parameters"
            " (e.g. LoRA), or use a machine with more RAM."
        )
    given = "default" if host_buffer_bytes is None else f"host_buffer_bytes={host_buffer_bytes}"
    raise HostMemoryError(
        f"SuperpipeStrategy(offload_device='disk', {given}) needs about {format_bytes(parts.total)} of host memory"
        f" ({parts.describe()}) but only {format_bytes(available)} is available. {advice}"
    )
