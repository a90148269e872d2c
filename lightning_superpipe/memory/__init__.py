"""Where blocks live between uses: the kinds of home behind one interface (:mod:`.home`): host memory (:mod:`.host`),
the node's shared memory, and the disk tier's files (:mod:`.disk_homes`, its store :mod:`.disk`). Frozen packed
weights (bitsandbytes' 4-bit ones) live in the host homes as bytes (:mod:`.packed`, :mod:`.bnb4bit`)."""

from lightning_superpipe.memory.disk import DiskStore
from lightning_superpipe.memory.disk_homes import DiskTier
from lightning_superpipe.memory.home import Home, Homes, ParamSlice
from lightning_superpipe.memory.host import BlockHome, HostHomes, check_host_memory
from lightning_superpipe.memory.host_memory import HostMemoryError
from lightning_superpipe.memory.pinned import HostArena

__all__ = [
    "BlockHome",
    "DiskStore",
    "DiskTier",
    "Home",
    "Homes",
    "HostArena",
    "HostHomes",
    "HostMemoryError",
    "ParamSlice",
    "check_host_memory",
]
