"""A block's record in pieces: which parameters (or slices of one) a pool buffer holds at a time, so that the pool's
host bytes are bounded by ``host_buffer_bytes`` whatever the block's size.

A piece is a run of whole parameters whose masters, optimizer state and gradients fit one buffer together, or one
slice of a parameter too large for a buffer, on :data:`SLICE_ELEMENTS` elements. Slicing is exact only for an
optimizer that updates every element from that element's values alone (and per-parameter scalars such as Adam's
``step``, which each slice starts from the same value): :data:`SLICEABLE` lists those of ``torch.optim`` (measured
bitwise against whole tensors, ``foreach``, ``fused`` and plain loops alike); any other steps whole parameters, so
that a buffer must hold the largest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch.optim import Optimizer

from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.units import format_bytes

#: A slice of a parameter starts on a multiple of this many elements: a page of bytes for every dtype a record holds,
#: so that each slice of each tensor is read and written on pages of its own.
SLICE_ELEMENTS = PAGE

#: Optimizers whose step of a slice of a parameter equals that slice of the whole parameter's step, bitwise.
SLICEABLE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
)

#: Pages each tensor of a part may take beyond its bytes: its last page rounded up, and a page more where it starts
#: mid-page (a record of 256-byte entries, written before records were laid out on pages).
_SLACK_PAGES = 2


def sliceable(optimizer: Optional[Optimizer]) -> bool:
    """Whether ``optimizer`` may step a parameter slice by slice: a class of :data:`SLICEABLE`, or a subclass that
    keeps its ``step``."""
    if optimizer is None:
        return True
    return any(type(optimizer).step is kind.step for kind in SLICEABLE)


@dataclass(frozen=True)
class Part:
    """Elements ``[start, stop)`` of a block's parameter ``param`` (by position), as one piece holds them."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParamCost:
    """What a part of one parameter takes in a buffer: ``per_element`` bytes per element in ``tensors`` tensors
    (master, state, gradient)."""

    numel: int
    per_element: float
    tensors: int

    def bytes(self, numel: int) -> int:
        return page_rounded(int(self.per_element * numel)) + _SLACK_PAGES * self.tensors * PAGE


def least_piece_bytes(costs: Sequence[ParamCost], can_slice: bool) -> int:
    """The smallest buffer every piece of these parameters fits: a slice of :data:`SLICE_ELEMENTS` elements of each
    (or, ``can_slice`` false, each whole parameter)."""
    return max((c.bytes(min(c.numel, SLICE_ELEMENTS) if can_slice else c.numel) for c in costs), default=PAGE)


def plan_pieces(costs: Sequence[ParamCost], buffer_bytes: int, can_slice: bool, what: str) -> list[list[Part]]:
    """The pieces of a block whose parameters cost ``costs``, in parameter order, each fitting ``buffer_bytes``.

    Raises:
        DiskTierError: A parameter does not fit and cannot be sliced (``what`` names the block).
    """
    pieces: list[list[Part]] = []
    current: list[Part] = []
    used = 0
    for position, cost in enumerate(costs):
        whole = cost.bytes(cost.numel)
        if whole <= buffer_bytes - used:
            current.append(Part(position, 0, cost.numel))
            used += whole
            continue
        if current:
            pieces.append(current)
            current, used = [], 0
        if whole <= buffer_bytes:
            current, used = [Part(position, 0, cost.numel)], whole
            continue
        step = _slice_elements(cost, buffer_bytes)
        if not can_slice or step < SLICE_ELEMENTS:
            least = least_piece_bytes([cost], can_slice)
            how = "" if can_slice else " whole (this optimizer is not stepped in slices)"
            raise DiskTierError(
                f"{what}'s parameter {position} ({cost.numel} elements) needs buffers of at least"
                f" {format_bytes(least)} to be stepped{how}; the pool's are {format_bytes(buffer_bytes)}. Raise"
                " host_buffer_bytes."
            )
        pieces.extend([Part(position, start, min(start + step, cost.numel))] for start in range(0, cost.numel, step))
    if current:
        pieces.append(current)
    return pieces


def _slice_elements(cost: ParamCost, buffer_bytes: int) -> int:
    """The most elements of a slice that fits ``buffer_bytes``, on :data:`SLICE_ELEMENTS`."""
    room = buffer_bytes - _SLACK_PAGES * cost.tensors * PAGE
    if room <= 0 or cost.per_element <= 0:
        return 0
    return int(room // cost.per_element) // SLICE_ELEMENTS * SLICE_ELEMENTS


def windows(offset: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned file range ``[lo, hi)`` around ``nbytes`` at byte ``offset`` (what a direct read takes)."""
    lo = offset - offset % PAGE
    return lo, page_rounded(offset + nbytes)
