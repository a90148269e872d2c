"""The device memory budget as the user wrote it: ``memory_budget=`` of ``SuperpipeStrategy``."""

from __future__ import annotations

import math
from typing import Union

import torch

from lightning_superpipe.units import parse_bytes

#: The share of free device memory ``"auto"`` plans for: the rest is for what neither the ledger nor the allocator
#: margin measured in profiling foresees (another process, fragmentation later in the run).
AUTO_FRACTION = 0.9

MemoryBudget = Union[int, float, str]


def resolve_budget(value: MemoryBudget, device: torch.device) -> int:
    """Bytes of device memory the plan may use.

    Args:
        value: An int (bytes), a string with a unit (``"12GiB"``, ``"800MiB"``, ``"1.5GB"``), a float in (0, 1]
            (that fraction of the device's free memory now), or ``"auto"`` (``AUTO_FRACTION`` of it).
        device: The compute device. "Free device memory" means nothing on a CPU device, so there only bytes are
            accepted.

    Raises:
        ValueError: With the user's call and what would be accepted.
    """
    call = f"SuperpipeStrategy(memory_budget={value!r})"
    if isinstance(value, bool):
        raise ValueError(f"{call} must be bytes (an int or a string such as '12GiB'), a fraction in (0, 1] or 'auto'.")
    fraction = None
    if isinstance(value, str) and value.strip().lower() == "auto":
        fraction = AUTO_FRACTION
    elif isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(
                f"{call}: a float is a fraction of the device's free memory and must be in (0, 1]; give bytes as an int"
                " or a string such as '12GiB'."
            )
        fraction = value
    if fraction is not None:
        if device.type != "cuda":
            raise ValueError(
                f"{call} takes a share of the device's free memory, which a {device.type} compute device does not have:"
                " give the budget in bytes, e.g. `memory_budget='2GiB'`."
            )
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    if isinstance(value, str):
        try:
            nbytes = parse_bytes(value)
        except ValueError:
            raise ValueError(f"{call}: expected bytes such as '12GiB', '800MiB' or '1.5GB', a fraction, or 'auto'.") from None
    elif isinstance(value, int):
        nbytes = value
    else:
        raise ValueError(f"{call} must be bytes (an int or a string such as '12GiB'), a fraction in (0, 1] or 'auto'.")
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ValueError(f"{call} must be a positive number of bytes.")
    return int(nbytes)
