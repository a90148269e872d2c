"""The strategy's own count of the bytes it holds on the compute device."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Optional

from torch import Tensor

from lightning_superpipe.memory.home import ParamSlice

#: What a run puts on the device: slots and resident blocks, the resident copies of the parameters outside
#: blocks, the gradients of each while they wait to leave, the activations blocks save for backward when they
#: are kept or brought back rather than recomputed, what a training step saves outside the blocks (embeddings,
#: head, loss), and the dense weights made from packed ones (``quantize_frozen``'s dequantized matrices) while
#: they live.
CATEGORIES = ("block_weights", "trunk_weights", "block_gradients", "trunk_gradients", "activations",
              "outside_activations", "dequantized_weights")


class DeviceLedger:
    """Counts every byte the strategy holds on the device, by category, and the most ever held at once.

    The count is the strategy's own bookkeeping, so it is exact on any device, CPU included, and independent of
    what else (activations, the user's tensors) shares the device.
    """

    def __init__(self) -> None:
        self.held = dict.fromkeys(CATEGORIES, 0)
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        #: The most held at once since :meth:`start_window` (a planner's check of one step).
        self.window_peak_bytes = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.held.values())

    @property
    def peak_gradient_bytes(self) -> int:
        """The most block gradients held at once."""
        return self.peaks["block_gradients"]

    def add(self, category: str, nbytes: int) -> None:
        self.held[category] += nbytes
        self.peaks[category] = max(self.peaks[category], self.held[category])
        total = self.total_bytes
        self.peak_bytes = max(self.peak_bytes, total)
        self.window_peak_bytes = max(self.window_peak_bytes, total)

    def start_window(self) -> None:
        """Starts :attr:`window_peak_bytes` again from what is held now."""
        self.window_peak_bytes = self.total_bytes

    def remove(self, category: str, nbytes: int) -> None:
        self.held[category] -= nbytes
        assert self.held[category] >= 0, f"the device ledger's {category} went negative"


class MaterializedWeights:
    """Counts the dense weights the engine rebuilds from packed ones (:attr:`.PackedSlice.materialized_bytes`: a
    ``quantize_frozen`` matrix dequantized on the device) for as long as each lives: from its rebuild until nothing
    holds it any more (the module's binding ends with the block's call; in backward, autograd drops what the
    recomputation saved once the block's backward is done).

    Args:
        ledger: The engine's ledger (category ``"dequantized_weights"``).
    """

    def __init__(self, ledger: DeviceLedger) -> None:
        self.ledger = ledger
        self._live: dict[int, int] = {}  # storage address -> bytes
        self._pieces: dict[int, ParamSlice] = {}  # storage address -> the packed piece it was rebuilt from

    def weights_in(self, pieces: Sequence[ParamSlice], flat: Tensor) -> list[Tensor]:
        """A block's weights made from its device buffer ``flat``: views, or for packed weights whatever their format
        rebuilds (dense dequantized matrices, counted from now on)."""
        tensors = [piece.view_of(flat) for piece in pieces]
        for piece, tensor in zip(pieces, tensors):
            if piece.materialized_bytes:
                self.hold(tensor, piece)
        return tensors

    def piece_of(self, address: int) -> Optional[ParamSlice]:
        """The packed piece a live dense weight at ``address`` was rebuilt from (``None``: no such weight)."""
        return self._pieces.get(address)

    def rebuilt(self, piece: ParamSlice, flat: Tensor) -> Tensor:
        """``piece``'s dense weight made again from the block's device buffer ``flat`` (the same values: dequantizing
        is deterministic), counted while it lives: what backward reads in place of one saved in forward."""
        tensor = piece.view_of(flat)
        self.hold(tensor, piece)
        return tensor

    def hold(self, tensor: Tensor, piece: Optional[ParamSlice] = None) -> None:
        """Counts ``tensor``'s storage until it is freed (rebuilt from ``piece``, if given)."""
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        self._live[address] = nbytes
        if piece is not None:
            self._pieces[address] = piece
        self.ledger.add("dequantized_weights", nbytes)
        # A storage keeps one Python object for as long as it lives, so the finalizer runs as the memory goes.
        weakref.finalize(storage, self._release, address, nbytes)

    def holds(self, address: int) -> bool:
        """Whether a storage at ``address`` is a live dense weight (model memory, not an activation)."""
        return address in self._live

    def _release(self, address: int, nbytes: int) -> None:
        self._live.pop(address, None)
        self._pieces.pop(address, None)
        self.ledger.remove("dequantized_weights", nbytes)
