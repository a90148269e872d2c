"""Frozen weights that travel as the bytes they are: packed quantized weights and their quantization state.

A 4-bit weight (bitsandbytes' ``Params4bit``, QLoRA's frozen base) is not one floating tensor: it is packed integers
and a quantization state (scales, nested scales, a codebook) that its layer's own kernels read from attributes of
its own tensor classes. Such a weight never trains and is never cast: its tensors cross the link byte for byte, in
one *region* of its block's flat buffer, after the block's floating parameters, each tensor (a *part*) at an aligned
byte offset in the region and viewed there with its own dtype and shape.

On the device the weight is the same class again, rebuilt around views of the region (:meth:`PackedSlice.view_of`):
the hooks bind it into its module as they bind any streamed parameter, and the layer's kernel computes with it. So
the engine and the hooks stay generic: a :class:`PackedSlice` is a :class:`~.home.ParamSlice` whose view of a flat
buffer is the rebuilt weight rather than a plain view.

Which weights are packed, and how to take one apart and rebuild it, is a *format*'s business (:class:`PackedFormat`);
:func:`packed_format` finds the format of a parameter (bitsandbytes' 4-bit: :mod:`.bnb4bit`; a plain frozen matrix the
strategy quantized itself carries its own under :data:`PACKED_ATTR`: :mod:`.frozen4bit`), importing none of the
formats' packages: a model without such weights never loads them. A rebuilt weight need not be views only: a format
may dequantize into a dense tensor (:meth:`PackedFormat.materialized_bytes` says how many bytes that allocates).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.home import ALIGNMENT, ParamSlice


class PackedFormat(Protocol):
    """How one kind of packed weight is taken apart into tensors and rebuilt around views of them."""

    #: What users call the format, for messages and the memory report.
    name: str

    def tensors(self, param: nn.Parameter) -> list[Tensor]:
        """The tensors that make ``param`` up, the packed data first, in an order :meth:`rebuild` knows."""
        ...

    def rebuild(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> Tensor:
        """A weight like ``param`` whose tensors are ``tensors`` (views of a device buffer); ``param`` unchanged."""
        ...

    def rehome(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> None:
        """Points ``param``'s own tensors at ``tensors`` (views of its home, holding the same values)."""
        ...

    def logical_numel(self, param: nn.Parameter) -> int:
        """How many weights ``param`` holds (its unpacked matrix's elements)."""
        ...

    def materialized_bytes(self, param: nn.Parameter) -> int:
        """Device bytes :meth:`rebuild` allocates beyond the views it is given (0: views only; a dense dequantized
        copy: its bytes), which the engine counts for as long as they live."""
        ...


@dataclass(frozen=True)
class BytePart:
    """Where one tensor of a packed weight sits in its region: ``nbytes`` bytes from byte ``start``."""

    start: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size

    def view_of(self, region: Tensor) -> Tensor:
        """The tensor, viewed with its dtype and shape in ``region`` (the region's bytes, ``uint8``)."""
        return region[self.start : self.start + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class PackedSlice(ParamSlice):
    """A packed weight's place in its block's flat buffers: ``numel`` elements of the flat buffer's dtype from
    ``offset``, holding its tensors' bytes (:attr:`parts`). Its :meth:`view_of` is the weight rebuilt by its format.

    Attributes:
        parts: Where each of the weight's tensors sits in the region, in the format's order.
        format: Takes the weight apart and rebuilds it.
    """

    parts: tuple[BytePart, ...] = ()
    format: Optional[PackedFormat] = None

    def region(self, flat: Tensor) -> Tensor:
        """The weight's bytes in ``flat`` (``uint8``)."""
        return flat[self.offset : self.offset + self.numel].view(torch.uint8)

    def tensors_in(self, flat: Tensor) -> list[Tensor]:
        """The weight's tensors, viewed in ``flat``."""
        region = self.region(flat)
        return [part.view_of(region) for part in self.parts]

    def view_of(self, flat: Tensor) -> Tensor:  # type: ignore[override]
        """The weight rebuilt around views of ``flat`` (a device slot, or its home)."""
        assert self.format is not None
        return self.format.rebuild(self.param, self.tensors_in(flat))

    def move_into(self, flat: Tensor, write: bool) -> None:
        """Copies the weight's tensors into its region of ``flat`` (its home's buffer) if ``write`` (else another rank
        of the node wrote them there), and points the weight at them, so that host memory holds them once."""
        assert self.format is not None
        views = self.tensors_in(flat)
        if write:
            for view, tensor in zip(views, self.format.tensors(self.param)):
                view.copy_(tensor.detach())
        self.format.rehome(self.param, views)

    @property
    def materialized_bytes(self) -> int:
        """Device bytes :meth:`view_of` allocates beyond views of the buffer (a dense dequantized copy), or 0."""
        assert self.format is not None
        return self.format.materialized_bytes(self.param)

    def holds(self, flat: Tensor) -> bool:
        """Whether the weight's tensors are still the views of ``flat`` it was pointed at (nothing replaced them)."""
        assert self.format is not None
        return all(
            tensor.data_ptr() == view.data_ptr()
            for tensor, view in zip(self.format.tensors(self.param), self.tensors_in(flat))
        )


#: The attribute of a plain ``nn.Parameter`` that the strategy packed itself (quantized a frozen matrix): its format,
#: which also holds its packed tensors. Gone again when the parameter gets its values back.
PACKED_ATTR = "_superpipe_packed"


#: Whether a state dict being taken leaves the packed weights' entries as they are (no copies, no dequantized values):
#: the disk tier's ``.ckpt``, which drops them (its 4-bit base lives in read-only files, and is no trainable state).
_ENTRIES_LEFT_OUT: ContextVar[bool] = ContextVar("superpipe_packed_entries_left_out", default=False)


@contextmanager
def packed_entries_left_out() -> Iterator[None]:
    """Within it, the state-dict hooks of packed weights (copies of bitsandbytes' entries, ``quantize_frozen``'s
    dequantized values) leave the entries as they are, costing no host memory: the caller drops them."""
    token = _ENTRIES_LEFT_OUT.set(True)
    try:
        yield
    finally:
        _ENTRIES_LEFT_OUT.reset(token)


def packed_entries_are_left_out() -> bool:
    """Whether a state dict taken now leaves the packed weights' entries out (:func:`packed_entries_left_out`)."""
    return _ENTRIES_LEFT_OUT.get()


def packed_format(param: nn.Parameter) -> Optional[PackedFormat]:
    """The format of ``param`` if it is a packed weight that streams as bytes, else ``None``."""
    own = getattr(param, PACKED_ATTR, None)
    if own is not None:
        return own
    if type(param).__module__.startswith("bitsandbytes"):
        from lightning_superpipe.memory.fourbit.bnb4bit import BNB_4BIT, is_params4bit

        return BNB_4BIT if is_params4bit(param) else None
    return None


def trainable_pieces(slices: Sequence[ParamSlice]) -> list[ParamSlice]:
    """The pieces of ``slices`` whose parameters require gradients now (the flag may change between steps).

    Raises:
        RuntimeError: A packed weight requires gradients (unfrozen during the run): it streams as 4-bit bytes.
    """
    pieces = [piece for piece in slices if piece.param.requires_grad]
    packed = next((piece for piece in pieces if isinstance(piece, PackedSlice)), None)
    if packed is not None:
        raise RuntimeError(
            f"A streamed {packed.format.name if packed.format else 'packed'} weight of shape {tuple(packed.shape)}"
            " was set to require gradients during the run; SuperpipeStrategy streams it as the frozen 4-bit bytes"
            " it set up with. Choose what trains before `Trainer.fit` (quantize_frozen quantizes only what is"
            " frozen then)."
        )
    return pieces


def packed_slice(param: nn.Parameter, format: PackedFormat, offset: int, itemsize: int) -> PackedSlice:
    """``param``'s slice at ``offset`` (elements of ``itemsize`` bytes) of its block's flat buffer: each of its tensors
    at a multiple of :data:`~.home.ALIGNMENT` elements, so that kernels read them as aligned as fresh tensors."""
    step = ALIGNMENT * itemsize
    parts, start = [], 0
    for tensor in format.tensors(param):
        nbytes = tensor.numel() * tensor.element_size()
        parts.append(BytePart(start, nbytes, tensor.dtype, tensor.shape))
        start += -(-nbytes // step) * step
    return PackedSlice(param, offset, max(start // itemsize, ALIGNMENT), param.shape, tuple(parts), format)


def split_packed(params: Sequence[nn.Parameter]) -> tuple[list[nn.Parameter], list[tuple[nn.Parameter, PackedFormat]]]:
    """``params`` split into the floating ones and the packed ones (with their formats), each in order."""
    floating: list[nn.Parameter] = []
    packed: list[tuple[nn.Parameter, PackedFormat]] = []
    for param in params:
        format = packed_format(param)
        if format is None:
            floating.append(param)
        else:
            packed.append((param, format))
    return floating, packed


def packed_bytes(param: nn.Parameter, format: PackedFormat, itemsize: int) -> int:
    """Bytes of ``param``'s region in a flat buffer of ``itemsize``-byte elements (alignment included)."""
    return packed_slice(param, format, 0, itemsize).numel * itemsize
