"""Memory tiers below the device: host memory (and, later, disk)."""

from lightning_superpipe.memory.host import BlockHome, HostMemoryError, check_host_memory
from lightning_superpipe.memory.pinned import HostArena

__all__ = ["BlockHome", "HostArena", "HostMemoryError", "check_host_memory"]
