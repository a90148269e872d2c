"""Which blocks stay on the device: a count of resident blocks spread evenly, or the indices a plan chose."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Union


def clamp(name: str, value: int, limit: int, what: str) -> int:
    if value > limit:
        warnings.warn(f"SuperpipeStrategy({name}={value}) is more than {what} ({limit}); using {limit}.", stacklevel=3)
        return limit
    return value


def choose_resident(resident: Union[int, Sequence[int]], num_blocks: int) -> list[int]:
    """The resident blocks' indices from a count (evenly spaced, clamped to the number of blocks) or a list."""
    if isinstance(resident, int):
        return _evenly_spaced(num_blocks, clamp("resident_blocks", resident, num_blocks, "the number of blocks"))
    indices = sorted(set(resident))
    if any(not 0 <= index < num_blocks for index in indices):
        raise ValueError(f"Resident block indices {indices} are not all among the {num_blocks} blocks.")
    return indices


def _evenly_spaced(count: int, chosen: int) -> list[int]:
    if chosen <= 0:
        return []
    return sorted({min(count - 1, int((k + 0.5) * count / chosen)) for k in range(chosen)})
