"""A 4-bit frozen base under the disk tier (``offload_device="disk"`` with bitsandbytes' 4-bit layers, or with
``quantize_frozen``): where its read-only files go and what they add to the tier's host memory, counted before
anything is allocated.

The files themselves (written once, read for each device copy, never written by a step) are
:mod:`lightning_superpipe.memory.disk_frozen`'s :class:`~lightning_superpipe.memory.disk_frozen.FrozenFiles`; the
tier's homes place them after each block's masters (:class:`~lightning_superpipe.memory.disk_homes.DiskTier`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lightning_superpipe.memory.disk_frozen import FrozenFiles, frozen_region_bytes
from lightning_superpipe.memory.frozen4bit import quantized_bytes
from lightning_superpipe.memory.packed import packed_format, split_packed
from lightning_superpipe.streaming.disk_tier import make_rank_folder
from lightning_superpipe.streaming.frozen_quantization import frozen_matrices
from lightning_superpipe.streaming.options import SuperpipeOptions

__all__ = ["FrozenFiles", "frozen_files", "split_frozen"]


def block_itemsize(block_params: Sequence[Sequence[nn.Parameter]], transfer_dtype: Optional[torch.dtype]) -> int:
    """Bytes of an element of the blocks' device buffers: the transfer dtype's, or the floating parameters' own."""
    if transfer_dtype is not None:
        return transfer_dtype.itemsize
    floating = (p for params in block_params for p in split_packed(params)[0])
    return next(floating, torch.empty(0)).dtype.itemsize


def frozen_files(options: SuperpipeOptions, block_params: Sequence[Sequence[nn.Parameter]],
                 transfer_dtype: Optional[torch.dtype], rank: int, ranks: int) -> FrozenFiles:
    """Where the disk tier of this rank keeps the blocks' frozen packed weights (its folder, made if need be).

    Raises:
        DiskTierError: The rank's folder cannot be made.
    """
    assert options.offload_path is not None
    folder = make_rank_folder(options.offload_path, rank) if ranks > 1 else Path(options.offload_path)
    return FrozenFiles(folder, block_itemsize(block_params, transfer_dtype))


def split_frozen(block_params: Sequence[Sequence[nn.Parameter]], mode: Optional[str],
                 transfer_dtype: Optional[torch.dtype]) -> tuple[list[list[nn.Parameter]], list[int]]:
    """Each block's parameters that go to the tier's store (its masters), and the bytes of each block's frozen
    4-bit weights (packed already, or the matrices ``quantize_frozen`` in ``mode`` will quantize), which go to its
    frozen file."""
    itemsize = block_itemsize(block_params, transfer_dtype)
    masters, frozen_bytes = [], []
    for params in block_params:
        matrices = set(frozen_matrices(params)) if mode is not None else set()
        floating, _ = split_packed(params)
        masters.append([p for p in floating if p not in matrices])
        to_quantize = sum(quantized_bytes(p.numel(), mode) for p in matrices if packed_format(p) is None) if mode else 0
        frozen_bytes.append(frozen_region_bytes(params, itemsize) + to_quantize)
    return masters, frozen_bytes
