"""The strategy's own count of the block bytes it holds on the compute device."""

from __future__ import annotations


class DeviceLedger:
    """Counts block weights and gradients held on the device, and the most ever held at once.

    The count is the strategy's own bookkeeping, so it is exact on any device, CPU included, and independent of
    what else (activations, the user's tensors) shares the device.
    """

    def __init__(self) -> None:
        self.weight_bytes = 0
        self.gradient_bytes = 0
        self.peak_bytes = 0
        self.peak_gradient_bytes = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes

    def add_weights(self, nbytes: int) -> None:
        self.weight_bytes += nbytes
        self._update_peak()

    def add_gradients(self, nbytes: int) -> None:
        self.gradient_bytes += nbytes
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self.gradient_bytes)
        self._update_peak()

    def remove_gradients(self, nbytes: int) -> None:
        self.gradient_bytes -= nbytes

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)
