"""One block's home under the disk tier: its layout in the store's record (and in its frozen file), its values in the
files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.fourbit.packed import PackedSlice, trainable_pieces
from lightning_superpipe.memory.home import DeviceLayout, Event, Link, ParamSlice


class BlockFiles(Protocol):
    """What a block's home needs of the tier that reads it (:class:`~lightning_superpipe.memory.disk.tier.DiskTier`)."""

    def copy_in(self, dst: Tensor, index: int, after: Event, what: str) -> Event:
        """Copies block ``index``'s values, read from the files, into ``dst`` once ``after`` is done."""
        ...

    def forget(self, index: int) -> None:
        """Drops what was read ahead of block ``index`` (its record changed)."""
        ...


class DiskHome:
    """A block's home under the disk tier: the layout of :class:`~lightning_superpipe.memory.host.BlockHome` (one
    flat buffer, each parameter at its record offset, then its frozen packed weights, as the host tier lays them out),
    with the values in the store's files (the packed weights' in the block's read-only frozen file).

    Args:
        index: The block's index.
        params: Its streamed floating parameters (placeholders), in record order.
        offsets: Each master's byte offset in the record.
        end: The byte where the masters' region ends (aligned).
        transfer_dtype: The dtype the weights travel and compute in.
        tier: The tier that reads it.
        packed: Its packed weights, placed after the masters' region (:meth:`.FrozenFiles.slices`).
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        offsets: Sequence[int],
        end: int,
        transfer_dtype: torch.dtype,
        tier: BlockFiles,
        packed: Sequence[PackedSlice] = (),
    ) -> None:
        dtypes = {param.dtype for param in params}
        if len(dtypes) > 1 or not (dtypes or packed):
            raise TypeError(f"The parameters of one block must share a dtype to stream together, found {dtypes}.")
        self.index = index
        self.master_dtype = dtypes.pop() if dtypes else transfer_dtype
        itemsize = self.master_dtype.itemsize
        self.slices: list[ParamSlice] = [ParamSlice(p, offset // itemsize, p.numel(), p.shape)
                                         for p, offset in zip(params, offsets)]
        self.master_numel = end // itemsize
        self.slices += packed
        self.numel = self.master_numel + sum(piece.numel for piece in packed)
        self.transfer_dtype = transfer_dtype
        self._tier = tier
        self._changed = False

    @property
    def trainable(self) -> list[ParamSlice]:
        """The pieces whose parameters require gradients now (refusing a packed weight unfrozen during the run)."""
        return trainable_pieces(self.slices)

    @property
    def transfer_bytes(self) -> int:
        return self.numel * self.transfer_dtype.itemsize

    def mark_changed(self, param: nn.Parameter) -> None:
        """A step of the store changed the block (its slots and reads ahead are stale)."""
        self._changed = True

    def changed(self) -> list[ParamSlice]:
        return list(self.slices) if self._changed else []

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        """Nothing to copy on the host: the next read of the block reads the new record; reads ahead of the old
        one are dropped."""
        self._changed = False
        self._tier.forget(self.index)

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        """Copies the block's masters, read from the tier's files, into ``dst`` (:meth:`DiskTier.copy_in`); a block is
        read whole, so ``layout`` is always ``None`` (:meth:`DiskTier.check_withhold`)."""
        return self._tier.copy_in(dst, self.index, after, what)

    def release(self) -> None:
        """Nothing to give back: the parameters keep their class (the tier puts their values back on close)."""
