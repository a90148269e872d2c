"""Memory tiers below the device: host memory (and, later, disk)."""

from lightning_superpipe.memory.host import BlockHome, HostMemoryError, check_host_memory

__all__ = ["BlockHome", "HostMemoryError", "check_host_memory"]
