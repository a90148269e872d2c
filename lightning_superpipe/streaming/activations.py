"""Where a block's activations live between its forward and its backward: kept on the device, offloaded to the host,
or recomputed.

Recomputation (checkpointing the block) is one way to keep autograd from holding a block's device weights; it costs
about one more forward. The other is to intercept what autograd saves, with ``saved_tensors_hooks``
(:class:`BlockActivations`, one per block call, as torchtune's ``OffloadActivations``):

* a saved tensor that lives in the block's weight buffer (a weight, or a view of one: ``weight.t()``) is packed as a
  handle, and unpacking it in backward fetches the block again through the engine, prefetched one block ahead as a
  recomputation would be, so the slot is free for other blocks in between;
* any other saved tensor (an activation) stays on the device (``"keep"``) or, from a size up, is copied to host
  memory as the block's forward saves it and brought back one block ahead in backward (``"offload"``), with host
  buffers drawn from a pool (from the engine's arena, page-locked on CUDA) that steps after the first reuse.

Saved tensors that belong to the model anyway (resident weights, the trunk's copies) are neither counted nor moved.
The ledger counts the device bytes of kept and brought-back activations (each storage once), and the pool's host
bytes are reported. Under ``"recompute"`` it counts what the checkpoint holds: the block's inputs from its forward
until they are freed, and, from the recomputation until backward has used them, what the recomputed call saved
(:class:`RecomputedActivations`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from lightning_superpipe.memory.pinned import HostArena, page_rounded
from lightning_superpipe.planning.plan import MODES, ActivationsPolicy
from lightning_superpipe.streaming.copier import Copier, Event
from lightning_superpipe.streaming.ledger import DeviceLedger, MaterializedWeights


class BlockWeights(Protocol):
    """What the activations need of the engine (:class:`~lightning_superpipe.streaming.engine.StreamingEngine`): its
    copier, ledger and arena, which blocks' weights are where, and the calls that fetch a block's weights again."""

    device: torch.device
    copier: Copier
    ledger: DeviceLedger
    arena: HostArena
    materialized: MaterializedWeights
    resident_indices: frozenset[int]
    activation_modes: list[str]

    @property
    def homes(self) -> Sequence[Any]: ...

    def held_flat(self, index: int) -> Optional[Tensor]:
        """Block ``index``'s device buffer if it is there for the current computation, else ``None``."""
        ...

    def weights_again(self, index: int) -> Tensor:
        """Block ``index``'s device buffer for backward (fetched if it is not the one computing)."""
        ...

    def weights_first(self, index: int) -> None:
        """At ``prefetch=0``, starts block ``index``'s copy before copies queued after it."""
        ...

    def is_persistent(self, address: int) -> bool:
        """Whether a storage at ``address`` is model memory (a resident copy of the trunk)."""
        ...

#: Activations smaller than this stay on the device under ``"offload"``: their copies cost more than they free.
OFFLOAD_MIN_BYTES = 64 * 1024


def per_block_modes(policy: ActivationsPolicy, num_blocks: int) -> list[str]:
    """One placement per block from ``"recompute"``/``"keep"``/``"offload"`` or a sequence of them.

    Raises:
        ValueError: With the user's call, for anything else or a sequence of the wrong length.
    """
    if isinstance(policy, str):
        modes = [policy] * num_blocks
    elif isinstance(policy, Sequence):
        modes = list(policy)
        if len(modes) != num_blocks:
            raise ValueError(
                f"SuperpipeStrategy(activations=[...]) has {len(modes)} entries, but the model streams {num_blocks}"
                " blocks: give one of 'recompute', 'keep' or 'offload' per block, or one string for all."
            )
    else:
        modes = [policy]  # type: ignore[list-item]
    for mode in modes:
        if mode not in MODES:
            raise ValueError(
                f"SuperpipeStrategy(activations={policy!r}): {mode!r} is not one of 'recompute', 'keep' or 'offload'."
            )
    return modes


class _WeightView:
    """A saved view of block ``index``'s weight buffer, to be made again from wherever the block is in backward."""

    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index: int, tensor: Tensor) -> None:
        self.index = index
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()


class _Rebuilt:
    """A saved dense weight dequantized from a packed one (``quantize_frozen``), or a view of it: made again in
    backward from block ``index``'s weight buffer, wherever the block is then, by dequantizing ``piece`` again."""

    __slots__ = ("index", "piece", "size", "stride", "offset")

    def __init__(self, index: int, piece: Any, tensor: Tensor) -> None:
        self.index, self.piece = index, piece
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()


class _Kept:
    """A saved activation left on the device, counted in the ledger while autograd holds it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class _Offloaded:
    """A saved activation copied to host memory; ``device`` holds it again once brought back for backward."""

    __slots__ = ("index", "host", "buffer", "shape", "copied", "device", "ready", "read", "__weakref__")

    def __init__(self, index: int, host: Tensor, buffer: Tensor, shape: torch.Size, copied: Event) -> None:
        self.index = index
        self.host, self.buffer, self.shape, self.copied = host, buffer, shape, copied
        self.device: Optional[Tensor] = None
        self.ready: Event = None
        self.read = [False]  # whether compute waited for the copy back (a list: its finalizer must not hold self)


class ActivationPlacement:
    """Keeps, offloads and brings back the activations of every block call of one engine.

    Args:
        engine: The streaming engine (its copier, ledger, arena, and the blocks' weight buffers).
    """

    def __init__(self, engine: BlockWeights) -> None:
        self.engine = engine
        self.copier: Copier = engine.copier
        self.ledger: DeviceLedger = engine.ledger
        self.arena: HostArena = engine.arena
        self._storages: dict[int, list[int]] = {}  # storage address -> [bytes, holders, block]: each counted once
        self._free: dict[int, list[tuple[Tensor, Event]]] = defaultdict(list)  # pool: page size -> (buffer, last read)
        self._offloaded: dict[int, list[weakref.ref[_Offloaded]]] = defaultdict(list)  # block -> not yet brought back
        self.host_bytes_in_use = 0
        self.peak_host_bytes = 0
        self._block_bytes: dict[int, int] = defaultdict(int)
        #: The most device bytes of saved activations each block held at once (for a planner).
        self.block_peaks: dict[int, int] = defaultdict(int)

    # ------------------------------------------------------------------ the hooks' two halves

    def is_activation(self, index: int, tensor: Tensor) -> bool:
        """Whether a tensor block ``index`` saves is an activation, not model memory (its weights, the trunk's)."""
        address = tensor.untyped_storage().data_ptr()
        flat = self.engine.held_flat(index)
        held = flat is not None and address == flat.untyped_storage().data_ptr()
        # Dense weights dequantized from packed ones are weights, counted as such (``quantize_frozen``).
        return not held and not self.engine.is_persistent(address) and not self.engine.materialized.holds(address)

    def pack(self, index: int, offload: bool, tensor: Tensor) -> Any:
        if not self.is_activation(index, tensor):
            address = tensor.untyped_storage().data_ptr()
            if index in self.engine.resident_indices or self.engine.is_persistent(address):
                return tensor  # resident weights, the trunk's copies: they outlive the step, nothing to free or fetch
            piece = self.engine.materialized.piece_of(address)
            if piece is not None:  # not in the weight buffer: dequantized from it, and dequantized again in backward
                return _Rebuilt(index, piece, tensor)
            return _WeightView(index, tensor)
        if offload and _travels(tensor):
            return self.offload(index, tensor)
        kept = _Kept(tensor)
        self._hold(index, tensor, kept)
        return kept

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _WeightView):
            flat = self.engine.weights_again(packed.index)
            return flat.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Rebuilt):
            dense = self.engine.materialized.rebuilt(packed.piece, self.engine.weights_again(packed.index))
            return dense.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Kept):
            return packed.tensor
        if isinstance(packed, _Offloaded):
            # Brought back already as backward reached the block (:meth:`bring_back_ahead`), unless its output had no
            # autograd node: then now, and the previous block's while this one computes.
            if packed.device is None:
                self._bring_back(packed)
            self._bring_back_block(packed.index - 1)
            self.copier.wait_on_compute(packed.ready)
            packed.read[0] = True
            assert packed.device is not None
            return packed.device
        return packed

    # ------------------------------------------------------------------ offloading

    def offload(self, index: int, tensor: Tensor, brought_back: bool = True) -> _Offloaded:
        """Copies ``tensor``, saved by block ``index``, to a host buffer of the pool. ``brought_back``: backward
        brings it back with its block (``False`` for a profile's trial, which brings its own back)."""
        # The same strides there and back: backward kernels then take the paths they take in plain training, and the
        # results are bitwise the same. A layout that overlaps itself (expanded) travels contiguous.
        if _overlaps_itself(tensor):
            tensor = tensor.contiguous()
        nbytes = _span_bytes(tensor)
        buffer = self._take(nbytes)
        host = buffer[:nbytes].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
        copied = self.copier.to_host(host, tensor, f"offloaded activation of block {index}")
        packed = _Offloaded(index, host, buffer, tensor.shape, copied)
        if brought_back:
            self._offloaded[index].append(weakref.ref(packed))
        weakref.finalize(packed, self._give, buffer, nbytes)
        return packed

    def bring_back_ahead(self, index: int, output: Any) -> None:
        """Brings block ``index``'s offloaded activations back, and block ``index - 1``'s, as soon as backward
        reaches the block's ``output`` (its tensors): the block's own are then all on their way before it unpacks the
        first, and the previous block's come while it computes, whatever its mode (unpacking alone would bring a
        block's back one by one, each waited for, where the block after it does not offload)."""
        modes = self.engine.activation_modes
        if modes[index] != "offload" and (index == 0 or modes[index - 1] != "offload"):
            return
        nodes = {id(tensor.grad_fn): tensor.grad_fn for tensor in tensors_in(output) if tensor.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(lambda grads: self._backward_reaches(index))

    def _backward_reaches(self, index: int) -> None:
        # Block ``index - 1``'s activations come while this block computes, not before its weights.
        self.engine.weights_first(index)
        self._bring_back_block(index)
        self._bring_back_block(index - 1)

    def _bring_back_block(self, index: int) -> None:
        for ref in self._offloaded.pop(index, []):
            packed = ref()
            if packed is not None and packed.device is None:
                self._bring_back(packed)

    def _bring_back(self, packed: _Offloaded) -> None:
        # The host copy must be complete before it is read back; it was issued during forward, long done by now.
        self.copier.wait_on_host(packed.copied)
        what = f"activation of block {packed.index} brought back"
        device, packed.ready = _copy_to_device(self.copier, self.engine.device, packed.host, what)
        packed.device = device
        self._hold(packed.index, device, packed)
        # Brought back with its block but never read by backward (a saved tensor no gradient needed): its memory is
        # freed with the packed object, and compute must still be ordered after the copy into it before reuse.
        weakref.finalize(packed, self._settle, packed.ready, packed.read)

    def _settle(self, ready: Event, read: list[bool]) -> None:
        if not read[0]:
            self.copier.wait_on_compute(ready)

    def _take(self, nbytes: int) -> Tensor:
        size = page_rounded(nbytes)
        free = self._free[size]
        if free:
            buffer, last_read = free.pop()
            self.copier.wait_on_host(last_read)  # the copy that brought it back has read it
        else:
            buffer = self.arena.empty(size, torch.uint8)
        self.host_bytes_in_use += size
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)
        return buffer

    def _give(self, buffer: Tensor, nbytes: int) -> None:
        size = page_rounded(nbytes)
        self.host_bytes_in_use -= size
        # A copy back to the device may still read the buffer: the next user waits for everything issued so far.
        self._free[size].append((buffer, self.copier.mark_compute()))

    # ------------------------------------------------------------------ counting

    def hold_inputs(self, index: int, tensors: Sequence[Tensor]) -> None:
        """Counts the activations among block ``index``'s inputs, which a checkpoint of it keeps until its backward,
        for as long as their storage lives."""
        for tensor in tensors:
            if self.is_activation(index, tensor):
                self.hold_storage(index, tensor)

    def hold_storage(self, index: int, tensor: Tensor) -> None:
        """Counts ``tensor``'s storage for block ``index`` until the storage is freed."""
        # Storages keep one Python object for as long as they live, so it dies with the memory.
        self._hold(index, tensor, tensor.untyped_storage())

    def _hold(self, index: int, tensor: Tensor, owner: object) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        entry = self._storages.get(address)
        if entry is None:
            entry = self._storages[address] = [storage.nbytes(), 0, index]
            self.ledger.add(_category(index), entry[0])
            self._block_bytes[index] += entry[0]
            self.block_peaks[index] = max(self.block_peaks[index], self._block_bytes[index])
        entry[1] += 1
        weakref.finalize(owner, self._release, address)

    def _release(self, address: int) -> None:
        entry = self._storages.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[address]
            self.ledger.remove(_category(entry[2]), entry[0])
            self._block_bytes[entry[2]] -= entry[0]

    # ------------------------------------------------------------------ outside the blocks

    def is_outside_activation(self, tensor: Tensor) -> bool:
        """Whether a tensor saved outside every block call is an activation on the device: not a weight (the
        trunk's resident copies, a block's buffer, a dense weight made from a packed one)."""
        if tensor.device != self.engine.device:
            return False
        address = tensor.untyped_storage().data_ptr()
        if self.engine.is_persistent(address) or self.engine.materialized.holds(address):
            return False
        return not any(
            flat is not None and flat.untyped_storage().data_ptr() == address
            for flat in map(self.engine.held_flat, range(len(self.engine.homes)))
        )

    def hold_outside(self, tensor: Tensor) -> None:
        """Counts a tensor saved outside the blocks (embeddings, final norm, head, loss) until its storage is
        freed: category ``"outside_activations"`` of the ledger (a storage a block counts already is counted once)."""
        self.hold_storage(OUTSIDE, tensor)

    @property
    def outside_bytes(self) -> int:
        """The device bytes saved outside the blocks and held now."""
        return self._block_bytes[OUTSIDE]

    def start_outside_window(self) -> None:
        """Starts measuring :attr:`outside_peak_bytes` afresh (a planner's profiled step)."""
        self.block_peaks[OUTSIDE] = self._block_bytes[OUTSIDE]

    @property
    def outside_peak_bytes(self) -> int:
        """The most device bytes saved outside the blocks at once, since :meth:`start_outside_window`."""
        return self.block_peaks[OUTSIDE]


#: The index under which :class:`ActivationPlacement` counts what is saved outside every block call.
OUTSIDE = -1


def _category(index: int) -> str:
    """The ledger's category of activations counted under ``index`` (a block's, or :data:`OUTSIDE`)."""
    return "outside_activations" if index == OUTSIDE else "activations"


def tensors_in(tree: Any) -> list[Tensor]:
    """The tensors among ``tree``'s leaves (nested tuples, lists and dicts: a block's arguments or output)."""
    return [value for value in tree_flatten(tree)[0] if isinstance(value, Tensor)]


def _copy_to_device(copier: Copier, device: torch.device, host: Tensor, what: str) -> tuple[Tensor, Event]:
    """A new device tensor laid out as ``host``, and the copy of ``host`` into it, after the compute issued so far
    (the allocator may hand it memory that compute just used)."""
    tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return tensor, copier.to_device(tensor, host, copier.mark_compute(), what)


def _travels(tensor: Tensor) -> bool:
    """Whether ``"offload"`` copies ``tensor`` to the host (from :data:`OFFLOAD_MIN_BYTES` up; smaller stay)."""
    return tensor.numel() * tensor.element_size() >= OFFLOAD_MIN_BYTES


def _span_bytes(tensor: Tensor) -> int:
    """The bytes from ``tensor``'s first element to its last."""
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def _overlaps_itself(tensor: Tensor) -> bool:
    """Whether two elements of ``tensor`` share memory (a zero or too small stride), which ``copy_`` cannot write."""
    extent = 0
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] > 1), key=lambda d: d[1]):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


class ActivationCensus(torch.autograd.graph.saved_tensors_hooks):
    """Counts what one block call saves for backward, as each placement would hold it (for a planner's profile: the
    call is run once more under these hooks, and its result dropped, so nothing it saves is ever unpacked).

    Args:
        placement: The engine's placement, which tells activations from model memory.
        index: The block.
    """

    def __init__(self, placement: ActivationPlacement, index: int) -> None:
        def pack(tensor: Tensor) -> Tensor:
            if placement.is_activation(index, tensor):
                self.count(tensor)
            # An alias without the autograd history: a saved output that holds its own node is a reference cycle
            # through C++ that no garbage collection frees, and would keep the call's activations for the whole
            # run. The alias keeps each storage alive while the call runs, so no address is counted twice.
            return tensor.detach()

        super().__init__(pack, lambda tensor: tensor)
        self.kept: dict[int, int] = {}  # storage address -> bytes: what "keep" holds, each storage once
        self.small: dict[int, int] = {}  # the same for what "offload" leaves on the device
        self.offloaded_bytes = 0  # what "offload" copies out and back, each saved tensor on its own

    def count(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        self.kept[storage.data_ptr()] = storage.nbytes()
        if _travels(tensor):
            # A layout that overlaps itself travels contiguous (as ``_offload`` sends it).
            self.offloaded_bytes += (
                tensor.numel() * tensor.element_size() if _overlaps_itself(tensor) else _span_bytes(tensor)
            )
        else:
            self.small[storage.data_ptr()] = storage.nbytes()


class BlockActivations(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks of one block call under ``"keep"`` or ``"offload"`` (see the module)."""

    def __init__(self, placement: ActivationPlacement, index: int, offload: bool) -> None:
        super().__init__(lambda tensor: placement.pack(index, offload, tensor), placement.unpack)


class OutsideActivations(torch.autograd.graph.saved_tensors_hooks):
    """Counts what a training step saves for backward outside every block call (embeddings, a final norm, the head's
    logits, the loss): around the whole step, these hooks are the ones autograd calls wherever no block's own are
    active. Nothing moves: each saved activation is counted in the ledger (``"outside_activations"``) while its
    storage lives, so the ledger's peak is everything the run holds on the device, and a planner knows the part
    that no placement changes.

    Args:
        placement: The engine's placement.
    """

    def __init__(self, placement: ActivationPlacement) -> None:
        def pack(tensor: Tensor) -> Tensor:
            if placement.is_outside_activation(tensor):
                placement.hold_outside(tensor)
            # An alias without autograd history, as the census's: a saved output that holds its own node would be a
            # reference cycle through C++ if backward never ran.
            return tensor.detach()

        super().__init__(pack, lambda tensor: tensor)


class RecomputedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Counts what block ``index``'s recomputation saves for its backward, and hands every tensor on to the hooks it
    runs under (the checkpoint's, which keep the tensors until backward uses them).

    Args:
        placement: The engine's placement, whose ledger counts the bytes.
        index: The block being recomputed.
    """

    def __init__(self, placement: ActivationPlacement, index: int) -> None:
        # The innermost hooks are the only ones autograd calls: these must call the checkpoint's in turn.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (lambda tensor: tensor, lambda tensor: tensor)

        def counting_pack(tensor: Tensor) -> Any:
            if placement.is_activation(index, tensor):
                placement.hold_storage(index, tensor)  # before ``pack``: its last call may end the recomputation
            return pack(tensor)

        super().__init__(counting_pack, unpack)


class OffloadTrial(torch.autograd.graph.saved_tensors_hooks):
    """Sends what one block call saves through ``"offload"``'s copies, for a planner's profile to time: each saved
    activation from :data:`OFFLOAD_MIN_BYTES` up is copied to a host buffer of the pool as the call saves it
    (:meth:`ActivationPlacement.offload`, the path ``"offload"`` takes), and :meth:`bring_back` copies them all to
    the device again, as backward would. Nothing is ever unpacked: the call's result is dropped, and the tensors
    brought back are only waited for (:meth:`finish`), like the census's outside the ledger.

    Args:
        placement: The engine's placement (its copier and host pool).
        index: The block.
    """

    def __init__(self, placement: ActivationPlacement, index: int) -> None:
        self._placement = placement
        self._index = index
        self._offloaded: list[_Offloaded] = []
        self._back: list[tuple[Tensor, Event]] = []

        def pack(tensor: Tensor) -> Tensor:
            if placement.is_activation(index, tensor) and _travels(tensor):
                self._offloaded.append(placement.offload(index, tensor, brought_back=False))
            return tensor.detach()  # as the census's: no reference cycle through the saved output's own node

        super().__init__(pack, lambda tensor: tensor)

    def copies_out_done(self) -> None:
        """Waits until every copy out has reached the host (backward reads them long after)."""
        for packed in self._offloaded:
            self._placement.copier.wait_on_host(packed.copied)

    def bring_back(self) -> None:
        """Issues the copies back to the device of everything the call sent out (as ``"offload"``'s backward does,
        one block ahead), without waiting for them."""
        copier, device = self._placement.copier, self._placement.engine.device
        what = f"activation of block {self._index} brought back for the profile"
        for packed in self._offloaded:
            self._back.append(_copy_to_device(copier, device, packed.host, what))

    def finish(self) -> None:
        """Orders compute after the copies back (their memory is then freed) and gives the host buffers back."""
        for _, ready in self._back:
            self._placement.copier.wait_on_compute(ready)
        self._back.clear()
        self._offloaded.clear()
