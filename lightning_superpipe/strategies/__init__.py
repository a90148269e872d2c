"""Lightning strategies, and the callback that logs what the superpipe strategy holds on the device."""

from lightning_superpipe.strategies.memory_logger import DeviceMemoryLogger
from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

__all__ = ["DeviceMemoryLogger", "SuperpipeStrategy"]
