"""The strategy's own count of the bytes it holds on the compute device."""

from __future__ import annotations

#: What the strategy puts on the device: slots and resident blocks, the resident copies of the parameters outside
#: blocks, the gradients of each while they wait to leave, and the activations blocks save for backward when they
#: are kept or brought back rather than recomputed.
CATEGORIES = ("block_weights", "trunk_weights", "block_gradients", "trunk_gradients", "activations")


class DeviceLedger:
    """Counts every byte the strategy holds on the device, by category, and the most ever held at once.

    The count is the strategy's own bookkeeping, so it is exact on any device, CPU included, and independent of
    what else (activations, the user's tensors) shares the device.
    """

    def __init__(self) -> None:
        self.held = dict.fromkeys(CATEGORIES, 0)
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.held.values())

    @property
    def peak_gradient_bytes(self) -> int:
        """The most block gradients held at once."""
        return self.peaks["block_gradients"]

    def add(self, category: str, nbytes: int) -> None:
        self.held[category] += nbytes
        self.peaks[category] = max(self.peaks[category], self.held[category])
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)

    def remove(self, category: str, nbytes: int) -> None:
        self.held[category] -= nbytes
        assert self.held[category] >= 0, f"the device ledger's {category} went negative"
