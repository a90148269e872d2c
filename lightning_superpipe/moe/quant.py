"""Group-wise asymmetric 8-bit quantization stored as bit planes.

A weight matrix ``[rows, cols]`` is cut into groups of ``group_size`` consecutive columns of one
row; each group gets its own ``scale`` and ``minimum`` so that
``w ~= minimum + scale * q`` with an 8-bit code ``q`` in ``[0, 255]``.

The codes are stored as eight *bit planes*: plane ``k`` holds bit ``7 - k`` (plane 0 is the most
significant bit) of every code, packed eight weights per byte. Keeping only the first ``b`` planes
keeps the top ``b`` bits of every code, i.e. which of ``2**b`` buckets of ``2**(8-b)`` codes the
weight falls in; :func:`dequantize` rebuilds such a weight at the middle of its bucket, which is
about as accurate as quantizing to ``b`` bits directly and much better than truncating. Putting
the lower planes back restores the 8-bit code exactly (``(hi << s) | lo``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "CODE_BITS",
    "GroupCodes",
    "dequantize",
    "dequantize_nibbles",
    "pack_bit_planes",
    "pack_nibbles",
    "quantize_groupwise",
    "unpack_codes",
    "unpack_nibbles",
]

CODE_BITS = 8
"""Bits of the full code; ``dequantize`` with all planes rebuilds exactly this precision."""

_FLOAT16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class GroupCodes:
    """Result of :func:`quantize_groupwise`.

    Args:
        codes: ``uint8`` codes, same shape as the weight.
        scale: Step between neighbouring codes, ``[*leading, rows, cols // group_size]``.
        minimum: Value of code 0, same shape as ``scale``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


def _check_group_size(cols: int, group_size: int) -> None:
    if group_size <= 0 or cols % group_size:
        raise ValueError(
            f"group_size={group_size} must be a positive divisor of the input dimension {cols}; "
            f"pick one that divides it (e.g. {_largest_divisor(cols, 128)})."
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def metadata_dtype(weight: torch.Tensor) -> torch.dtype:
    """Pick the dtype of the per-group scale and minimum for ``weight``.

    float16 halves the metadata bytes and keeps ~3 decimal digits, plenty next to 8-bit codes; it is
    only abandoned for weights outside its range.

    Args:
        weight: The weights that will be quantized.

    Returns:
        ``torch.float16`` or, if some weight is too large for it, ``torch.float32``.
    """
    low, high = torch.aminmax(weight.detach())  # a reduction: no weight-sized temporary
    return torch.float16 if max(-low.item(), high.item()) < _FLOAT16_MAX / 2 else torch.float32


def quantize_groupwise(
    weight: torch.Tensor, group_size: int, meta_dtype: torch.dtype = torch.float16, bits: int = CODE_BITS
) -> GroupCodes:
    """Quantize ``weight`` group-wise to asymmetric 8-bit codes.

    The codes are computed against the *stored* (rounded) scale and minimum so that dequantizing
    with the stored metadata is consistent.

    Args:
        weight: ``[..., cols]`` floating-point weights; groups run along the last dimension.
        group_size: Columns per group; must divide ``cols``.
        meta_dtype: dtype in which scale and minimum are stored.
        bits: Bits per code, 1 to 8 (8: the bit-plane codes; 4: FlexGen's scheme, see :func:`pack_nibbles`).

    Returns:
        The codes and per-group metadata.
    """
    if not 1 <= bits <= CODE_BITS:
        raise ValueError(f"quantize_groupwise(bits={bits}) must be 1 to {CODE_BITS}.")
    cols = weight.shape[-1]
    _check_group_size(cols, group_size)
    grouped = weight.detach().float().reshape(*weight.shape[:-1], cols // group_size, group_size)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scale = ((high - low) / (2**bits - 1)).to(meta_dtype)
    minimum = low.to(meta_dtype)
    # A constant group (or one whose range underflows the metadata dtype) gets scale 0 and codes 0:
    # every level then rebuilds it as its minimum, with no midpoint offset.
    step = scale.float().unsqueeze(-1)
    codes = torch.round((grouped - minimum.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0))
    codes = codes.clamp_(0, 2**bits - 1).to(torch.uint8).reshape(weight.shape)
    return GroupCodes(codes=codes, scale=scale, minimum=minimum)


def pack_bit_planes(codes: torch.Tensor) -> torch.Tensor:
    """Split 8-bit codes into packed bit planes.

    Args:
        codes: ``uint8`` tensor ``[*leading, n]`` with ``n`` divisible by 8.

    Returns:
        ``uint8`` tensor ``[*leading, 8, n // 8]``; plane ``k`` holds bit ``7 - k`` of each code and
        byte ``t`` of a plane packs weights ``8t .. 8t+7`` (weight ``8t + m`` in bit ``m``).
    """
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"bit planes pack 8 weights per byte; got {n} weights, not a multiple of 8")
    device = codes.device
    plane_shift = torch.arange(CODE_BITS - 1, -1, -1, dtype=torch.uint8, device=device).view(-1, 1, 1)
    lane_shift = torch.arange(8, dtype=torch.uint8, device=device)
    octets = codes.reshape(*codes.shape[:-1], 1, n // 8, 8)
    bits = (octets >> plane_shift) & 1  # [*leading, 8 planes, n/8, 8 lanes]
    return (bits << lane_shift).sum(dim=-1, dtype=torch.uint8)


_SPREAD: dict[torch.device, torch.Tensor] = {}


def _spread_table(device: torch.device) -> torch.Tensor:
    """``int64 [256]``: byte ``v`` spread over the 8 bytes of a word, byte ``m`` holding bit ``m`` of ``v``."""
    table = _SPREAD.get(device)
    if table is None:
        lanes = torch.arange(8)
        bits = (torch.arange(256).view(-1, 1) >> lanes) & 1
        table = _SPREAD[device] = (bits << (8 * lanes)).sum(dim=-1).to(device)
    return table


def unpack_codes(planes: torch.Tensor) -> torch.Tensor:
    """Join the top ``b`` packed bit planes back into ``b``-bit codes.

    Args:
        planes: ``uint8`` tensor ``[*leading, b, n // 8]`` holding planes ``0 .. b-1``.

    Returns:
        ``uint8`` tensor ``[*leading, n]`` of codes in ``[0, 2**b - 1]`` (the top ``b`` bits of the
        8-bit codes).
    """
    # Each plane byte is looked up as one 64-bit word holding its 8 weights' bits, one per byte
    # (little-endian: byte m is weight 8t + m), and the planes are joined with word-wide shifts:
    # 8 weights per operation instead of one, and no code ever carries into its neighbour (< 256).
    if planes.shape[-2] == 0:
        raise ValueError("unpack_codes needs at least one bit plane")
    table = _spread_table(planes.device)
    code = table[planes.select(-2, 0).long()]
    for k in range(1, planes.shape[-2]):
        code = code.bitwise_left_shift_(1).bitwise_or_(table[planes.select(-2, k).long()])
    if code.dtype != torch.int64 or not code.is_contiguous():
        code = code.to(torch.int64).contiguous()
    # Reinterpreting the words as bytes needs a little-endian host (x86, ARM as configured by torch).
    return code.view(torch.uint8).view(*planes.shape[:-2], planes.shape[-1] * 8)


def dequantize(
    planes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rebuild weights from their top ``b`` bit planes (``b = planes.shape[-2]``).

    With fewer than 8 planes each weight is rebuilt at the middle of its bucket of
    ``2**(8-b)`` codes; with all 8 it is rebuilt exactly at its code. Works on any number of
    leading (batch) dimensions at once: the paged experts rebuild all the pages of one level of a
    layer in one call.

    Args:
        planes: ``uint8`` ``[*leading, b, n // 8]`` top bit planes.
        scale: ``[*leading, rows, groups]`` per-group step.
        minimum: ``[*leading, rows, groups]`` per-group minimum.
        shape: ``[*leading, rows, cols]`` shape of the weights (``rows * cols == n``).
        dtype: dtype of the result.

    Returns:
        The dequantized weights, ``shape``, ``dtype``, on the planes' device.
    """
    bits = planes.shape[-2]
    shift = CODE_BITS - bits
    code = unpack_codes(planes)
    step = scale.float()
    low = minimum.float()
    if shift:
        # Middle of the bucket [hi << s, (hi << s) + 2**s - 1], folded into the per-group affine map
        # (a per-group cost) so that the per-weight work is one multiply-add straight from uint8.
        low = low + step * ((2**shift - 1) / 2)
        step = step * float(2**shift)
    groups = scale.shape[-1]
    grouped = code.view(*scale.shape, shape[-1] // groups)
    weight = torch.addcmul(low.unsqueeze(-1), grouped, step.unsqueeze(-1))
    return weight.view(shape).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte (FlexGen's layout: the even element in the high nibble).

    Args:
        codes: ``uint8`` ``[..., n]`` codes in ``[0, 15]``, ``n`` even.

    Returns:
        ``uint8`` ``[..., n // 2]``.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles packs 2 codes per byte; got {codes.shape[-1]} codes, not an even number")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8`` ``[..., n // 2]`` -> ``uint8`` ``[..., n]``."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nibbles(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rebuild ``minimum + scale * q`` from packed 4-bit codes (groups along the last dimension).

    Args:
        packed: ``uint8`` ``[..., cols // 2]`` from :func:`pack_nibbles`.
        scale: ``[..., cols // group_size]`` per-group step.
        minimum: Same shape as ``scale``.
        dtype: dtype of the result.

    Returns:
        ``[..., cols]`` weights on ``packed``'s device.
    """
    code = unpack_nibbles(packed)
    grouped = code.view(*scale.shape, code.shape[-1] // scale.shape[-1])
    # In the metadata's precision: fp16 on a GPU keeps the rebuild one fused pass (FlexGen rebuilds in fp16).
    work = scale.dtype if scale.device.type == "cuda" else torch.float32
    rebuilt = torch.addcmul(minimum.to(work).unsqueeze(-1), grouped.to(work), scale.to(work).unsqueeze(-1))
    return rebuilt.view(code.shape).to(dtype)
