"""FlexGen's 4-bit group-wise compression of weights and KV cache, on the project's one group-wise quantizer.

Groups of 64 consecutive elements along one dimension, asymmetric min/max, ``q = round((x - min) / scale)`` with
``scale = (max - min) / 15`` (FlexGen's ``round((x - min) * 15 / (max - min))``), two codes per byte, scale and
minimum per group in float16: ``0.5 + 4 / 64 = 0.5625`` bytes per element. The quantizer is
:func:`lightning_superpipe.quantization.quantize_groupwise` with ``bits=4``; this module only moves the grouping
dimension last and packs nibbles. What crosses the link and sits in host memory is :class:`Packed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_superpipe.quantization import dequantize_nibbles, pack_nibbles, quantize_groupwise

#: FlexGen's group size.
GROUP_SIZE = 64
BITS = 4
#: Bytes per element of the packed form with float16 metadata and groups of 64.
BYTES_PER_ELEMENT = BITS / 8 + 2 * 2 / GROUP_SIZE


def group_size_for(size: int) -> Optional[int]:
    """The group size for a dimension of ``size``: 64 where it divides, the whole dimension when it is shorter (a
    small head_dim), ``None`` (not compressible) otherwise or when it is odd."""
    if size % GROUP_SIZE == 0:
        return GROUP_SIZE
    if size < GROUP_SIZE and size % 2 == 0:
        return size
    return None


@dataclass
class Packed:
    """A tensor in FlexGen's 4-bit form, its grouping dimension moved last.

    Attributes:
        codes: ``uint8`` ``[*moved_shape[:-1], moved_shape[-1] // 2]``, two codes per byte.
        scale: float16 ``[*moved_shape[:-1], groups]``.
        minimum: Same as ``scale``.
        dim: The dimension of the original tensor the groups run along.
        dtype: The original dtype, rebuilt by :func:`decompress`.
    """

    codes: Tensor
    scale: Tensor
    minimum: Tensor
    dim: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.codes, self.scale, self.minimum


def compress(tensor: Tensor, dim: int) -> Packed:
    """Packs ``tensor`` with groups along ``dim`` (weights: the output dimension; cache: head_dim).

    Raises:
        ValueError: If ``dim``'s size has no group size (see :func:`group_size_for`).
    """
    dim = dim % tensor.ndim
    size = tensor.shape[dim]
    group = group_size_for(size)
    if group is None:
        raise ValueError(f"cannot compress a dimension of size {size}: it needs a multiple of 64 or an even size < 64")
    moved = tensor.movedim(dim, -1)
    codes = quantize_groupwise(moved, group, meta_dtype=torch.float16, bits=BITS)
    return Packed(pack_nibbles(codes.codes), codes.scale, codes.minimum, dim, tensor.dtype)


def decompress(packed: Packed, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Rebuilds the tensor (in ``dtype``, default its original one) on the device the packed form is on."""
    moved = dequantize_nibbles(packed.codes, packed.scale, packed.minimum, dtype or packed.dtype)
    return moved.movedim(-1, packed.dim).contiguous()


def empty_like_packed(packed: Packed, device: torch.device) -> Packed:
    """An uninitialised :class:`Packed` of the same shapes on ``device`` (a copy's destination)."""
    return Packed(
        torch.empty_like(packed.codes, device=device),
        torch.empty_like(packed.scale, device=device),
        torch.empty_like(packed.minimum, device=device),
        packed.dim,
        packed.dtype,
    )


def relative_rms_error(approx: Tensor, exact: Tensor) -> float:
    """``rms(approx - exact) / rms(exact)``, FlexGen's measure of its quantizer."""
    exact = exact.float()
    return ((approx.float() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
