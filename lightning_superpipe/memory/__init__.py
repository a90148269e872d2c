"""Where blocks live between uses: the kinds of home behind one interface (:mod:`.home`), chosen by name from one
registry. Two are registered here, as any other is (:func:`register_home_kind`): host memory, or the node's shared
memory (:mod:`.host`), and the disk tier's files (:mod:`.disk`). Frozen weights in a 4-bit form live in either as
bytes (:mod:`.fourbit`)."""

from lightning_superpipe.host_memory import HostMemoryError
from lightning_superpipe.memory.disk import DiskStore
from lightning_superpipe.memory.disk.kind import DiskKind
from lightning_superpipe.memory.disk.tier import DiskTier
from lightning_superpipe.memory.home import (
    Home,
    HomeKind,
    Homes,
    HomesBuilder,
    HomesRun,
    ParamSlice,
    home_kinds,
    register_home_kind,
    unregister_home_kind,
)
from lightning_superpipe.memory.host import BlockHome, HostHomes, HostKind, check_host_memory
from lightning_superpipe.memory.pinned import HostArena

register_home_kind(HostKind())
register_home_kind(DiskKind())

__all__ = [
    "BlockHome",
    "DiskKind",
    "DiskStore",
    "DiskTier",
    "Home",
    "HomeKind",
    "Homes",
    "HomesBuilder",
    "HomesRun",
    "HostArena",
    "HostHomes",
    "HostKind",
    "HostMemoryError",
    "ParamSlice",
    "check_host_memory",
    "home_kinds",
    "register_home_kind",
    "unregister_home_kind",
]
