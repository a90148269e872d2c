"""Byte quantities as users write them (``"12GiB"``, ``"800MiB"``, ``"8GB/s"``) and as reports print them."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(?:([kmgt]i?)?b(?:ytes?)?)?\s*")


def parse_bytes(text: str, per_second: bool = False) -> float:
    """``"12GiB"`` -> 12 * 2**30; ``"1.5 GB"`` -> 1.5e9; ``"4096"`` -> 4096. With ``per_second``, a trailing ``/s``
    or ``ps`` is allowed (``"8GB/s"``).

    Raises:
        ValueError: For anything else (the caller words the message).
    """
    lowered = text.lower()
    if per_second:
        lowered = re.sub(r"(?:/s|ps)\s*$", "", lowered)
    match = _QUANTITY.fullmatch(lowered)
    if not match:
        raise ValueError(text)
    return float(match.group(1)) * _UNITS[match.group(2) or ""]


def format_bytes(nbytes: float) -> str:
    """``2.31 GiB``, ``12.0 MiB``, ``512 KiB``, ``100 B``: binary units, three significant figures."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}" if nbytes / size < 100 else f"{nbytes / size:.0f} {unit}"
    return f"{nbytes:.0f} B"
