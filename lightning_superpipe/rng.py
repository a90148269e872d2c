"""The random-number states a resumed run needs to continue like an uninterrupted one (dropout, data order).

Plain Lightning checkpoints do not hold them, so after a resume dropout draws other masks than the uninterrupted run.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_states() -> dict[str, Any]:
    """The RNG states dropout and data order draw from; no numpy state, so ``torch.load(weights_only=True)``
    still reads the checkpoint."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
