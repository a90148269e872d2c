"""Budgets as users write them: ``memory_budget=`` of ``SuperpipeStrategy`` and ``GenerationPolicy``, and the paged
experts' ``expert_budget=``.

Every budget takes the same forms, read by :func:`parse_budget`:

==================  ==============================================================================
Form                Meaning
==================  ==============================================================================
``123_456_789``     bytes (an int)
``"12GiB"``         bytes with a unit (``"800MiB"``, ``"1.5GB"``, ``"4096"``)
``"90%"``           a share of a whole the budget names (free device memory; the experts' 16-bit size)
``"auto"``          ``AUTO_FRACTION`` of free device memory (device budgets only)
==================  ==============================================================================

A bare float is refused: ``1`` and ``1.0`` would otherwise differ by nine orders of magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightning_superpipe.units import parse_bytes

#: The share of free device memory ``"auto"`` plans for: the rest is for what neither the ledger nor the allocator
#: margin measured in profiling foresees (another process, fragmentation later in the run).
AUTO_FRACTION = 0.9

#: A budget as written: bytes (an int), or a string: ``"12GiB"``, ``"90%"``, ``"auto"``.
MemoryBudget = Union[int, str]

_FORMS = "bytes (an int or a string such as '12GiB'), a percentage such as '90%'"


@dataclass(frozen=True)
class Budget:
    """A parsed budget: a number of bytes, or a share of a whole that is known only later.

    Attributes:
        nbytes: Bytes, when written as bytes.
        fraction: The share in (0, 1], when written as a percentage (or ``"auto"``).
    """

    nbytes: Optional[int] = None
    fraction: Optional[float] = None

    def bytes_of(self, whole: float) -> int:
        """Bytes of this budget when a share is taken of ``whole`` bytes."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(whole * self.fraction)


def parse_budget(value: object, call: str, allow_auto: bool = True) -> Budget:
    """Reads a budget in any accepted form (see the module).

    Args:
        value: The budget as the user wrote it.
        call: The user's call, e.g. ``"SuperpipeStrategy(memory_budget='90%')"``, quoted in errors.
        allow_auto: Whether ``"auto"`` means something for this budget.

    Raises:
        ValueError: With ``call`` and the accepted forms; a bare float is told to be written as ``"90%"`` or bytes.
    """
    forms = _FORMS + (" or 'auto'" if allow_auto else "")
    if isinstance(value, float):
        percent = f"{value * 100:g}%" if 0 < value <= 1 else "90%"
        raise ValueError(f"{call}: a bare float is ambiguous (bytes or a share?); write a share as a percentage string,"
                         f" e.g. '{percent}', or bytes as an int or a string such as '12GiB'.")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{call} must be {forms}.")
    if isinstance(value, int):
        return Budget(nbytes=_positive_bytes(value, call))
    text = value.strip().lower()
    if text == "auto":
        if not allow_auto:
            raise ValueError(f"{call}: 'auto' means nothing for this budget; give {_FORMS}.")
        return Budget(fraction=AUTO_FRACTION)
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError(f"{call}: expected a percentage such as '90%', got {value!r}.") from None
        if not 0 < percent <= 100:
            raise ValueError(f"{call}: a percentage must be in (0%, 100%].")
        return Budget(fraction=percent / 100)
    try:
        nbytes = parse_bytes(value)
    except ValueError:
        raise ValueError(f"{call}: expected bytes such as '12GiB', '800MiB' or '1.5GB', a percentage such as '90%'"
                         f"{', or auto' if allow_auto else ''}.") from None
    if 0 < nbytes < 1:  # "0.9" from a command line: meant as a share
        raise ValueError(f"{call}: {value!r} is less than a byte; write a share as a percentage, e.g. "
                         f"'{nbytes * 100:g}%'.")
    return Budget(nbytes=_positive_bytes(nbytes, call))


def _positive_bytes(nbytes: float, call: str) -> int:
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ValueError(f"{call} must be a positive number of bytes.")
    return int(nbytes)


def resolve_budget(value: object, device: torch.device, call: Optional[str] = None) -> int:
    """Bytes of device memory a device budget (``memory_budget=``) allows.

    Args:
        value: The budget as written (:func:`parse_budget`); a percentage or ``"auto"`` is a share of the device's
            free memory now.
        device: The compute device. "Free device memory" means nothing on a CPU device, so there only bytes are
            accepted.
        call: The user's call, quoted in errors (default: ``SuperpipeStrategy(memory_budget=...)``).

    Raises:
        ValueError: With the user's call and what would be accepted.
    """
    call = call or f"SuperpipeStrategy(memory_budget={value!r})"
    budget = parse_budget(value, call)
    if budget.nbytes is not None:
        return budget.nbytes
    if device.type != "cuda":
        raise ValueError(
            f"{call} takes a share of the device's free memory, which a {device.type} compute device does not have:"
            " give the budget in bytes, e.g. `memory_budget='2GiB'`."
        )
    free, _ = torch.cuda.mem_get_info(device)
    return budget.bytes_of(free)


__all__ = ["AUTO_FRACTION", "Budget", "MemoryBudget", "parse_budget", "resolve_budget"]
