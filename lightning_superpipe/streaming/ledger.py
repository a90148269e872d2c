"""The strategy's own count of the bytes it holds on the compute device, and the engine's report of them."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from lightning_superpipe.memory.home import ParamSlice

if TYPE_CHECKING:
    from lightning_superpipe.streaming.engine import StreamingEngine

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


def engine_report(engine: StreamingEngine) -> dict[str, Any]:
    """The engine's part of the strategy's memory report, from its ledger, its arena and its homes' kind.

    Returns:
        ``peak_device_bytes`` (the most held on the device at once: block weights, the resident weights outside
        blocks, the gradients of both while they wait to leave, and the activations saved for backward, in the
        blocks and outside them), ``device_bytes`` (held now),
        ``peak_block_gradient_bytes`` and ``peak_trunk_gradient_bytes`` (the most gradients of each kind at
        once), ``peak_dequantized_weight_bytes`` (``quantize_frozen``'s dense matrices, most at once; held
        inside ``device_bytes`` and ``peak_device_bytes`` too), ``largest_block_bytes``, ``num_blocks``,
        ``resident_blocks``, ``prefetch``,
        ``trunk_device_bytes`` (weights outside blocks, resident), ``host_bytes`` (what the engine allocated on
        the host: homes, transfer copies, staging), ``shared_host_bytes`` (the part of it every rank of the node
        maps, ``shard_optimizer="node"``: count it once per node), ``pinned_host_bytes`` (the page-locked part
        of it),
        ``peak_activation_bytes`` (saved activations kept or brought back on the device, most at once),
        ``peak_outside_activation_bytes`` (what training steps saved outside the blocks: embeddings, head, loss;
        most at once),
        ``host_activation_bytes`` (offloaded activations in host memory, most at once) and
        ``peak_activation_bytes_per_block``, ``overlapped_block_steps`` (blocks the optimizer stepped during
        backward, over the run), ``overlapped_trunk_steps`` (parameters outside the blocks stepped so) and,
        the homes' own figures (:meth:`~lightning_superpipe.memory.home.Homes.memory_report`; the host tier's
        ``packed_weight_bytes`` and ``packed_weight_numel`` where blocks hold bitsandbytes 4-bit weights; the disk
        tier's: bytes on disk, the pool's host bytes, bytes read and written).
    """
    return {
        "peak_device_bytes": engine.ledger.peak_bytes,
        "device_bytes": engine.ledger.total_bytes,
        "peak_block_gradient_bytes": engine.ledger.peaks["block_gradients"],
        "peak_trunk_gradient_bytes": engine.ledger.peaks["trunk_gradients"],
        "peak_dequantized_weight_bytes": engine.ledger.peaks["dequantized_weights"],
        "largest_block_bytes": engine.largest_block_bytes(),
        "num_blocks": len(engine.homes),
        "resident_blocks": len(engine.resident_indices),
        "prefetch": engine.prefetch,
        "trunk_device_bytes": engine.trunk_device_bytes(),
        "host_bytes": engine.host_bytes(),
        "shared_host_bytes": engine.arena.shared_bytes,
        "pinned_host_bytes": engine.pinned_bytes(),
        "peak_activation_bytes": engine.ledger.peaks["activations"],
        "peak_outside_activation_bytes": engine.ledger.peaks["outside_activations"],
        "host_activation_bytes": engine.activations.peak_host_bytes,
        "peak_activation_bytes_per_block": [engine.activations.block_peaks[i] for i in range(len(engine.homes))],
        "overlapped_block_steps": engine.overlap.blocks_stepped,
        "overlapped_trunk_steps": engine.overlap.trunk_params_stepped,
        **engine.home_kind.memory_report(),
    }
