"""Plain frozen matrices quantized to 4 bits by the strategy (``SuperpipeStrategy(quantize_frozen="nf4")``): a QLoRA
base without bitsandbytes code in the user's script.

Each frozen floating-point matrix of the streamed blocks is quantized once, as streaming starts, with bitsandbytes' own
quantizer (``bitsandbytes.functional.quantize_4bit``: blocks of 64 weights, NF4 or FP4 codes, and with double
quantization the blocks' scales quantized again, as Lightning's ``BitsandbytesPrecision("nf4-dq")`` does). It becomes
a packed weight (:mod:`.packed`): its codes and quantization state live in its block's home, cross the link as those
bytes, and on the device :meth:`Frozen4bit.rebuild` dequantizes them (``dequantize_4bit``) into a dense tensor of the
dtype the block computes in, which the hooks bind in place of the parameter. So whatever module uses the matrix
(``nn.Linear``, ``transformers``' ``Conv1D``, a custom ``F.linear(x, self.weight)``) computes as usual, with the
quantized values; the dense tensor is device memory the engine counts while it lives.

The ``nn.Parameter`` stays the module's own (same object, shape, dtype, ``requires_grad=False``); its storage becomes
a placeholder, one NaN expanded to its shape, so that host memory keeps no full-precision copy, a read that bypasses
the strategy's bindings shows NaN rather than plausible values, and an in-place write fails (an expanded tensor
refuses them). :func:`restore` writes the dequantized values back when the run ends.

The matrices are quantized flattened: bitsandbytes' CPU ``dequantize_4bit`` (0.50) gets a 2-D shape whose last
dimension is no multiple of the block size wrong (relative error 0.27 instead of 0.09 on a random 96 x 80 matrix),
the flat one right; for the other shapes both give the same values.

bitsandbytes is imported here only, and only when a matrix is quantized or dequantized.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.fourbit.bnb4bit import copied_state, get_path, set_path, state_paths
from lightning_superpipe.memory.fourbit.packed import PACKED_ATTR, packed_format

#: ``quantize_frozen``'s values, Lightning's ``BitsandbytesPrecision`` 4-bit mode names: (quant type, double quant).
MODES: dict[str, tuple[str, bool]] = {
    "nf4": ("nf4", False), "nf4-dq": ("nf4", True), "fp4": ("fp4", False), "fp4-dq": ("fp4", True),
}
#: Weights per scale: bitsandbytes' default, and QLoRA's.
BLOCKSIZE = 64
#: The dtypes bitsandbytes' quantizer takes; others (float64) are quantized from their float32 values.
QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be imported (looked up without importing it)."""
    return importlib.util.find_spec("bitsandbytes") is not None


class Frozen4bit:
    """One frozen matrix in 4 bits: a :class:`~.packed.PackedFormat` of its own parameter, holding the packed codes and
    the quantization state (pointed at its block's home once it has one).

    Args:
        data: The packed codes (``uint8``, two per byte).
        state: bitsandbytes' ``QuantState`` of the flattened matrix (absmax, code; with double quantization the
            offset and the nested state of the scales).
        mode: The ``quantize_frozen`` mode it was made with.
        dtype: The parameter's own dtype: what :func:`restore` writes back and a state dict holds.
        compute_dtype: What :meth:`rebuild` dequantizes into: the dtype the block's weights compute in on the device.
        shape: The matrix's shape.
    """

    def __init__(self, data: Tensor, state: Any, mode: str, dtype: torch.dtype, compute_dtype: torch.dtype,
                 shape: torch.Size) -> None:
        self.data, self.state, self.mode = data, state, mode
        self.dtype, self.compute_dtype, self.shape = dtype, compute_dtype, shape
        self.name = f"quantize_frozen={mode!r}"
        #: Stays in 4 bits when its run ends: its values were never whole in host memory (:func:`quantize`'s
        #: ``values`` came from a deferred init), so giving them back could exhaust it.
        self.kept = False
        self._paths = state_paths(state)  # fixed: the state's tensors, in the order :meth:`tensors` gives them

    def tensors(self, param: nn.Parameter) -> list[Tensor]:
        """The packed codes, then the quantization state's tensors."""
        return [self.data, *(get_path(self.state, path) for path in self._paths)]

    def rebuild(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> Tensor:
        """The matrix dequantized from ``tensors`` (views of a device slot) into a new dense tensor of the compute
        dtype, on their device; nothing of this format changes."""
        state = copied_state(self.state)
        for path, tensor in zip(self._paths, tensors[1:]):
            set_path(state, path, tensor)
        state.dtype = self.compute_dtype
        return _dequantize(tensors[0], state).reshape(self.shape)

    def rehome(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> None:
        """Points the codes and the state's tensors at ``tensors`` (views of the home, the same values)."""
        self.data = tensors[0]
        for path, tensor in zip(self._paths, tensors[1:]):
            set_path(self.state, path, tensor)

    def logical_numel(self, param: nn.Parameter) -> int:
        """The matrix's elements."""
        return math.prod(self.shape)

    def materialized_bytes(self, param: nn.Parameter) -> int:
        """The dense tensor :meth:`rebuild` allocates."""
        return math.prod(self.shape) * self.compute_dtype.itemsize

    def dequantized(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The matrix's values, dequantized where its packed tensors are (host memory), in ``dtype`` (default: the
        parameter's own), as a new tensor."""
        state = copied_state(self.state)
        # Straight into the parameter's dtype where bitsandbytes can (float64 goes through float32).
        state.dtype = self.dtype if self.dtype in QUANTIZABLE else torch.float32
        return _dequantize(self.data, state).reshape(self.shape).to(dtype or self.dtype)


def _dequantize(data: Tensor, state: Any) -> Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(data, state)


def placeholder(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """What a quantized parameter holds instead of its values: one NaN, expanded (no memory, no in-place writes)."""
    return torch.full((), float("nan"), dtype=dtype).expand(shape)


def quantize(param: nn.Parameter, mode: str, compute_dtype: torch.dtype, values: Optional[Tensor] = None) -> Frozen4bit:
    """Quantizes ``param``'s values in 4 bits (``mode``, a key of :data:`MODES`), attaches the result to it as its
    packed format (:data:`~.packed.PACKED_ATTR`) and replaces its storage by a :func:`placeholder`.

    Args:
        param: A frozen floating-point matrix (or higher-dimensional weight) in host memory.
        mode: ``"nf4"``, ``"nf4-dq"``, ``"fp4"`` or ``"fp4-dq"``.
        compute_dtype: The dtype its block computes in on the device (what it is dequantized into there).
        values: Its values, where they are not in its own storage yet (a deferred init's, made apart from it).

    Returns:
        Its format.
    """
    quant_type, double = MODES[mode]
    values = (param.detach() if values is None else values).reshape(-1)
    if values.dtype not in QUANTIZABLE:
        values = values.float()
    data, state = quantize_4bit(values.contiguous(), quant_type, double)
    format = Frozen4bit(data, state, mode, param.dtype, compute_dtype, param.shape)
    setattr(param, PACKED_ATTR, format)
    param.data = placeholder(param.shape, param.dtype)
    return format


#: Elements quantized at a time: bitsandbytes' CPU quantizer allocates about 6x its input in temporaries (measured:
#: 81 MB for a 12.6 MB bfloat16 matrix), which a large matrix would add to the peak host memory.
CHUNK = 1 << 20


def quantize_4bit(values: Tensor, quant_type: str, double: bool) -> tuple[Tensor, Any]:
    """``bitsandbytes.functional.quantize_4bit(values, blocksize=64, compress_statistics=double,
    quant_type=quant_type)`` of a flat tensor, :data:`CHUNK` elements at a time: the same codes and state (each block
    of 64 is quantized on its own; the scales' double quantization, which is not, runs once on all of them, as
    bitsandbytes' does)."""
    import bitsandbytes.functional as bnb

    if values.numel() <= CHUNK:
        return bnb.quantize_4bit(values, blocksize=BLOCKSIZE, compress_statistics=double, quant_type=quant_type)
    codes, scales = [], []
    for start in range(0, values.numel(), CHUNK):
        chunk_codes, chunk_scales = torch.ops.bitsandbytes.quantize_4bit.default(
            values[start:start + CHUNK], BLOCKSIZE, quant_type, torch.uint8
        )
        codes.append(chunk_codes)
        scales.append(chunk_scales)
    data, absmax = torch.cat(codes), torch.cat(scales)
    del codes, scales
    code = bnb.get_4bit_type(quant_type, device=values.device)
    state = dict(shape=values.shape, dtype=values.dtype, blocksize=BLOCKSIZE, code=code, quant_type=quant_type)
    if not double:
        return data, bnb.QuantState(absmax=absmax, **state)
    offset = absmax.mean()
    nested, nested_state = bnb.quantize_blockwise(absmax - offset, blocksize=256)
    return data, bnb.QuantState(absmax=nested, offset=offset, state2=nested_state, **state)


def quantized_format(param: nn.Parameter) -> Optional[Frozen4bit]:
    """``param``'s format if the strategy quantized it (:func:`quantize`) and it has not got its values back."""
    format = getattr(param, PACKED_ATTR, None)
    return format if isinstance(format, Frozen4bit) else None


def restore(param: nn.Parameter) -> None:
    """Gives a parameter :func:`quantize` quantized its values back: the dequantized ones, in its own dtype, in a
    tensor of its own (the full-precision bytes it held before, the quantization's rounding in them)."""
    format = quantized_format(param)
    if format is None:
        return
    param.data = format.dequantized()
    delattr(param, PACKED_ATTR)


def quantized_bytes(numel: int, mode: str) -> int:
    """The host bytes :func:`quantize` keeps for a matrix of ``numel`` elements in ``mode``: the codes (two per byte)
    and the scales (one float32 per block of 64 weights, or with double quantization one byte per block plus a
    float32 per 256 blocks and the 256-entry code of the scales' quantizer)."""
    blocks = -(-numel // BLOCKSIZE)
    codes = -(-numel // 2) + 16 * 4  # and the 16-entry code of NF4 or FP4
    if not MODES[mode][1]:
        return codes + 4 * blocks
    return codes + blocks + 4 * -(-blocks // 256) + 256 * 4 + 4


def frozen_matrices(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """What ``quantize_frozen`` quantizes of a block's ``params``: the frozen floating-point ones of two or more
    dimensions (biases, norms and anything trainable stay as they are), and those an earlier run kept in 4 bits."""
    return [p for p in params if not p.requires_grad and p.is_floating_point() and p.dim() >= 2
            and (packed_format(p) is None or quantized_format(p) is not None)]
