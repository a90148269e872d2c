"""The host tier: where every streamed block's parameters live between uses.

Each block's parameters are re-homed into one flat host buffer (pinned when the compute device is CUDA, so
copies to the device are truly asynchronous) and the ``nn.Parameter`` objects become views of it. One flat
buffer per block turns a block's transfer into a single large copy instead of dozens of small ones. When the
device computes in a narrower dtype than the fp32 masters (``bf16-mixed``, ``16-mixed``), a second flat
buffer holds the weights in that dtype, so only half the bytes cross the link.

With ``shard_optimizer="node"`` every rank of a node builds its homes in one region of shared memory
(:func:`build_homes`, :meth:`.HostArena.shared`): local rank 0 writes them, the others point their parameters at the
same pages, so a node holds one copy of the blocks whatever its number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.host_memory import (
    HostMemoryError,
    available_host_bytes,
    check_host_memory,
    rss_bytes,
    shared_rss_bytes,
)
from lightning_superpipe.memory.fourbit.frozen4bit import frozen_matrices, quantized_bytes, quantized_format
from lightning_superpipe.memory.fourbit.packed import (
    PackedFormat,
    PackedSlice,
    packed_bytes,
    packed_slice,
    split_packed,
    trainable_pieces,
)
from lightning_superpipe.memory.home import (
    ALIGNMENT,
    DeviceLayout,
    Event,
    HomeKind,
    Homes,
    HomesBuilder,
    HomesRun,
    Link,
    ParamSlice,
    aligned,
    device_layout,
)
from lightning_superpipe.memory.pinned import HostArena, NodeRanks, page_rounded

__all__ = [  # what other modules import from here, the layout types and host-memory checks included
    "ALIGNMENT",
    "BlockHome",
    "BlockLayout",
    "DeviceLayout",
    "HostHomes",
    "HostKind",
    "HostMemoryError",
    "ParamSlice",
    "available_host_bytes",
    "build_homes",
    "check_host_memory",
    "device_layout",
    "home_bytes",
    "host_bytes_to_come",
    "master_state",
    "rss_bytes",
    "shared_rss_bytes",
    "track_edits",
    "training_state_bytes",
    "transfer_bytes",
    "travels_in",
    "untrack_edits",
]


class EditTrackedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose in-place edits through ``.data`` bump its version counter.

    The device holds copies of the host masters, so the strategy must notice every change to a master: an
    optimizer step, ``load_state_dict``, a ``torch.no_grad()`` edit, and also the ``p.data.copy_(...)`` and
    ``p.data.clamp_(...)`` idioms (Lightning's ``WeightAveraging`` swaps weights that way), which a plain
    parameter hides from its version counter because ``.data`` is a new tensor with a counter of its own. Here
    ``.data`` is ``detach()``, which shares the counter. Host masters are never saved for backward (the device
    copies are), so the extra bumps cannot trip autograd's in-place checks.
    """

    @property  # type: ignore[override]
    def data(self) -> Tensor:
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return "Parameter containing:\n" + repr(self.detach())


def track_edits(param: nn.Parameter) -> None:
    """Makes ``.data`` edits of a plain ``nn.Parameter`` visible to its version counter (subclasses, e.g.
    quantized parameters, are left alone: their own ``.data`` may mean something else)."""
    if type(param) is nn.Parameter:
        param.__class__ = EditTrackedParameter


def untrack_edits(param: nn.Parameter) -> None:
    if type(param) is EditTrackedParameter:
        param.__class__ = nn.Parameter


def master_state(param: nn.Parameter) -> tuple[int, int]:
    """What changes when a master changes: its version counter (in-place edits) and its storage (``p.data = x``)."""
    return param._version, param.data_ptr()


@dataclass(frozen=True)
class BlockLayout:
    """How a :class:`BlockHome` lays out a block: its floating parameters first (the masters, whose gradients the
    block's gradient buffer holds), then its packed weights (:mod:`.packed`), which travel as bytes.

    Attributes:
        floating: The floating parameters, in order.
        packed: The packed weights and their formats, in order.
        master_dtype: The floating parameters' dtype (the transfer dtype when there are none).
        master_numel: Elements of the floating parameters' region (aligned).
        numel: Elements of the whole flat buffer in the transfer dtype (aligned).
    """

    floating: list[nn.Parameter]
    packed: list[tuple[nn.Parameter, PackedFormat]]
    master_dtype: torch.dtype
    master_numel: int
    numel: int

    @classmethod
    def of(cls, params: Sequence[nn.Parameter], transfer_dtype: Optional[torch.dtype]) -> BlockLayout:
        """The layout of a block of ``params`` whose weights travel in ``transfer_dtype`` (``None``: their own).

        Raises:
            TypeError: The floating parameters do not share a dtype.
        """
        floating, packed = split_packed(params)
        dtypes = {param.dtype for param in floating}
        if len(dtypes) > 1:
            raise TypeError(f"The parameters of one block must share a dtype to stream together, found {dtypes}.")
        master_dtype = dtypes.pop() if dtypes else (transfer_dtype or torch.float32)
        itemsize = (transfer_dtype or master_dtype).itemsize
        master_numel = sum(aligned(param.numel()) for param in floating)
        numel = master_numel + sum(packed_bytes(param, format, itemsize) // itemsize for param, format in packed)
        return cls(floating, packed, master_dtype, master_numel, numel)

    def bytes(self, transfer_dtype: Optional[torch.dtype]) -> tuple[int, int]:
        """The bytes of the masters' buffer and of the transfer buffer (0 when it is the masters' own)."""
        transfer_dtype = transfer_dtype or self.master_dtype
        if transfer_dtype == self.master_dtype:
            return self.numel * self.master_dtype.itemsize, 0
        return self.master_numel * self.master_dtype.itemsize, self.numel * transfer_dtype.itemsize


class BlockHome:
    """The host home of one block's parameters.

    Packed weights (bitsandbytes' 4-bit ones, :mod:`.packed`) have no masters: their bytes live in the transfer
    buffer only, after the floating parameters, and cross the link as they are (never cast).

    Args:
        params: The block's parameters, without duplicates. The floating ones must share one dtype.
        transfer_dtype: The dtype the weights travel and compute in on the device.
        arena: Where the flat buffers come from (page-locked with a CUDA compute device).
    """

    def __init__(self, params: Sequence[nn.Parameter], transfer_dtype: torch.dtype, arena: HostArena) -> None:
        layout = BlockLayout.of(params, transfer_dtype)
        self.master_dtype = layout.master_dtype
        self.master_numel, self.numel = layout.master_numel, layout.numel
        self.slices: list[ParamSlice] = []
        offset = 0
        for param in layout.floating:
            self.slices.append(ParamSlice(param, offset, param.numel(), param.shape))
            offset += aligned(param.numel())
        self.packed: list[PackedSlice] = []
        for param, format in layout.packed:
            self.packed.append(packed_slice(param, format, offset, transfer_dtype.itemsize))
            offset += self.packed[-1].numel
        self.slices += self.packed
        # A home shared by the node's ranks is written by local rank 0 only; the others' parameters (equal to rank
        # 0's, broadcast before) just point at it.
        writes = arena.writable
        same = transfer_dtype == self.master_dtype
        self.master = arena.empty(self.numel if same else self.master_numel, self.master_dtype)
        if writes:
            self.master.zero_()  # the alignment gaps are copied too; keep them defined
        for piece in self.slices[: len(layout.floating)]:
            if writes:
                piece.view_of(self.master).copy_(piece.param.detach())
            # The optimizer, checkpoints and the user keep using the same Parameter objects; only their storage
            # moves into the flat buffer.
            piece.param.data = piece.view_of(self.master)
            track_edits(piece.param)
        if same:
            self.transfer = self.master
        else:
            self.transfer = arena.empty(self.numel, transfer_dtype)
            if writes:
                self.transfer[: self.master_numel].copy_(self.master)
                self.transfer[self.master_numel :].zero_()
        for packed in self.packed:
            packed.move_into(self.transfer, writes)
        self._seen = {piece.param: master_state(piece.param) for piece in self.slices}
        #: Bytes copied to the device over the run, and the packed weights' share of them.
        self.copied_bytes = self.copied_packed_bytes = 0
        self._packed_numel = sum(piece.numel for piece in self.packed)  # per copy, counted without a walk

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        """Copies the transfer buffer into the device buffer ``dst``: one copy, or with ``layout`` one per run of the
        parameters that still stream (the link runs them in order: the last copy's event covers the others)."""
        itemsize = self.transfer.element_size()
        if layout is None:
            self.copied_bytes += self.numel * itemsize
            self.copied_packed_bytes += self._packed_numel * itemsize
            return link.to_device(dst, self.transfer, after, what)
        done = after  # nothing to copy: the buffer is ready when it is free
        for host, device, numel in layout.ranges:
            done = link.to_device(dst[device : device + numel], self.transfer[host : host + numel], after, what)
        self.copied_bytes += layout.numel * itemsize
        self.copied_packed_bytes += sum(p.numel for p in layout.slices if isinstance(p, PackedSlice)) * itemsize
        return done

    @property
    def trainable(self) -> list[ParamSlice]:
        """The pieces whose parameters require gradients now (the flag may change between steps).

        Raises:
            RuntimeError: A packed weight requires gradients (unfrozen during the run): it streams as 4-bit bytes.
        """
        return trainable_pieces(self.slices)

    @property
    def transfer_dtype(self) -> torch.dtype:
        """The dtype the block's weights travel and compute in."""
        return self.transfer.dtype

    @property
    def transfer_bytes(self) -> int:
        """Bytes that cross the link for one copy of this block."""
        return self.numel * self.transfer.element_size()

    def mark_changed(self, param: nn.Parameter) -> None:
        """Counts ``param``'s master as changed even if its version counter says otherwise (CPU fused optimizers
        write parameters without bumping it)."""
        self._seen[param] = (-1, -1)

    def changed(self) -> list[ParamSlice]:
        """The pieces whose masters changed since :meth:`sync` last ran (reads only)."""
        return [piece for piece in self.slices if master_state(piece.param) != self._seen[piece.param]]

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        """Takes the changed masters of ``pieces`` into the home: a parameter whose storage was replaced
        (``p.data = x``, ``module.to(...)``) is copied back into its place in the flat buffer and pointed at it
        again, and the transfer copy is brought up to date. No copy may be reading the home meanwhile."""
        for piece in pieces:
            if isinstance(piece, PackedSlice):
                self._sync_packed(piece)
                continue
            param, home_view = piece.param, piece.view_of(self.master)
            if param.data_ptr() != home_view.data_ptr():
                if param.shape != piece.shape or param.dtype != self.master_dtype:
                    raise RuntimeError(
                        f"A streamed parameter of shape {tuple(piece.shape)} and dtype {self.master_dtype} was"
                        f" replaced by a tensor of shape {tuple(param.shape)} and dtype {param.dtype} during the run;"
                        " SuperpipeStrategy cannot stream a parameter whose shape or dtype changes. Change the model"
                        " before `Trainer.fit` (or between runs), not inside it."
                    )
                home_view.copy_(param.detach())
                param.data = home_view
            if self.transfer is not self.master:
                piece.view_of(self.transfer).copy_(home_view)
            self._seen[param] = master_state(param)

    def _sync_packed(self, piece: PackedSlice) -> None:
        """A packed weight's values were edited in place (they are in the home already); one whose tensors were
        replaced cannot be followed."""
        if not piece.holds(self.transfer):
            raise RuntimeError(
                f"A streamed {piece.format.name if piece.format else 'packed'} weight of shape {tuple(piece.shape)}"
                " (or its quantization state) was replaced by other tensors during the run; SuperpipeStrategy streams"
                " the frozen quantized weights it set up with. Change the model before `Trainer.fit`, not inside it."
            )
        self._seen[piece.param] = master_state(piece.param)

    def release(self) -> None:
        """Gives the parameters back their plain class (their storage stays in the flat buffer)."""
        for piece in self.slices:
            untrack_edits(piece.param)


class HostHomes(Homes):
    """The host tier: each block's home a :class:`BlockHome` in host memory (the node's shared region with ``node``),
    its gradients accumulated in the host ``.grad``. Every hook of :class:`~.home.Homes` but the report keeps its
    default."""

    def memory_report(self) -> dict[str, Any]:
        """``streamed_block_bytes``: the blocks' bytes copied to the device over the run. Where blocks hold packed
        weights (bitsandbytes 4-bit, or frozen matrices ``quantize_frozen`` quantized):
        ``streamed_packed_weight_bytes``, their share of it, ``packed_weight_bytes``, their bytes in the homes
        (alignment included), which is also what of them crosses the link per copy of every block, and
        ``packed_weight_numel``, the weights they hold unpacked (a 16-bit copy of them would take twice that)."""
        homes = [home for home in self.homes if isinstance(home, BlockHome)]
        streamed = {"streamed_block_bytes": sum(home.copied_bytes for home in homes)}
        packed = [piece for home in homes for piece in home.packed]
        if not packed:
            return streamed
        return {
            **streamed,
            "streamed_packed_weight_bytes": sum(home.copied_packed_bytes for home in homes),
            "packed_weight_bytes": sum(piece.numel * home.transfer.element_size()
                                       for home in self.homes if isinstance(home, BlockHome) for piece in home.packed),
            "packed_weight_numel": sum(piece.format.logical_numel(piece.param) for piece in packed if piece.format),
        }


def build_homes(
    block_params: Sequence[Sequence[nn.Parameter]],
    transfer_dtype: Optional[torch.dtype],
    arena: HostArena,
    node: Optional[NodeRanks] = None,
) -> HostHomes:
    """The blocks' homes (``None`` for a block with nothing to stream), from ``arena``; with ``node``, all in one region
    that every rank of the node maps (:meth:`.HostArena.shared`), written by local rank 0.

    Args:
        block_params: The parameters that stream with each block.
        transfer_dtype: The dtype the weights travel in (``None``: the parameters' own).
        arena: Where the buffers come from.
        node: The node's ranks that share the homes (``shard_optimizer="node"``), or ``None``.
    """
    dtypes = [travels_in(params, transfer_dtype) if params else None for params in block_params]
    nbytes = sum(home_bytes(params, dtype) for params, dtype in zip(block_params, dtypes) if dtype is not None)
    with arena.shared(nbytes, node) if node is not None else nullcontext():
        return HostHomes([BlockHome(params, dtype, arena) if dtype is not None else None
                          for params, dtype in zip(block_params, dtypes)])


class HostKind(HomeKind):
    """``offload_device="cpu"``, the default: every block's home in host memory (:func:`build_homes`), or, with
    ``shard_optimizer="node"`` on several ranks, in one region the node's ranks share; the optimizer's state and the
    gradients in host memory too."""

    name = "cpu"
    summary = "masters, gradients and optimizer state in host memory"
    title = "the host tier"
    purpose = "keep the training state in host memory"

    def check_host_room(self, run: HomesRun) -> None:
        """Refuses a run whose host memory is too small for the homes of the blocks (with ``quantize_frozen``, their
        frozen matrices in 4 bits), gradients and optimizer state, what the deferred init calls will fill in place,
        and, for a speculative optimizer step, the state it keeps.

        Raises:
            HostMemoryError: With the bytes needed and available.
        """
        mode = run.knobs.quantize_frozen
        block_params = run.block_params
        frozen = {p for params in block_params for p in frozen_matrices(params)} if mode is not None else set()
        streamed = [[p for p in params if p not in frozen] for params in block_params]
        needed = host_bytes_to_come(streamed, run.trunk_params, run.transfer_dtype, run.fitting,
                                    pinned=run.device.type == "cuda")
        needed += sum(quantized_bytes(p.numel(), mode) for p in frozen if not quantized_format(p))
        if run.deferred is not None:  # all but the frozen matrices, quantized from values apart
            model = run.model
            needed += run.deferred.pending_bytes(t for t in [*model.parameters(), *model.buffers()] if t not in frozen)
        kept = ""
        if run.fitting and run.knobs.overlap_optimizer == "speculative":  # "auto" speculates only where memory allows
            params = [p for block in block_params for p in block] + list(run.trunk_params)
            needed += 12 * sum(p.numel() for p in params if p.requires_grad)
            kept = (" and the state a speculative optimizer step keeps while backward runs;"
                    " overlap_optimizer='pipelined' keeps none")
        check_host_memory(needed, f"homes for {run.what}, gradients and optimizer state{kept}")

    def prepare(self, run: HomesRun) -> HomesBuilder:
        """The blocks' homes are built from the engine's arena (:func:`build_homes`)."""
        return _HostBuilder(run)


class _HostBuilder(HomesBuilder):
    def __init__(self, run: HomesRun) -> None:
        self._run = run

    def homes(self, arena: HostArena) -> Homes:
        run = self._run
        return build_homes(run.block_params, run.transfer_dtype, arena, node=run.node)


def travels_in(params: Sequence[nn.Parameter], transfer_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a block of ``params`` travels in: ``transfer_dtype``, or (``None``) its floating parameters' own."""
    return transfer_dtype or BlockLayout.of(params, None).master_dtype


def transfer_bytes(params: Sequence[nn.Parameter], transfer_dtype: torch.dtype) -> int:
    """The bytes one copy of a :class:`BlockHome` of ``params`` moves to the device (its flat transfer buffer)."""
    return BlockLayout.of(params, transfer_dtype).numel * transfer_dtype.itemsize


def home_bytes(params: Sequence[nn.Parameter], transfer_dtype: torch.dtype) -> int:
    """The arena bytes a :class:`BlockHome` of ``params`` takes: its masters and, if separate, its transfer copy."""
    master, transfer = BlockLayout.of(params, transfer_dtype).bytes(transfer_dtype)
    return page_rounded(master) + (page_rounded(transfer) if transfer else 0)


def host_bytes_to_come(
    block_params: list[list[nn.Parameter]],
    trunk_params: list[nn.Parameter],
    transfer_dtype: Optional[torch.dtype],
    training: bool,
    pinned: bool,
) -> int:
    """Host bytes the run will allocate beyond the model it already holds.

    Re-homing a block briefly holds it twice (page-locked on CUDA, as are the trunk's masters); mixed precision adds
    a transfer copy of every block; training adds fp32 gradients and (Adam-like) two moments for every trainable
    parameter, and on CUDA two staging buffers of a block's gradients and one of each trainable trunk parameter.
    """
    params = [p for block in block_params for p in block]
    nbytes = max((home_bytes(block, travels_in(block, None)) for block in block_params if block), default=0)
    if transfer_dtype is not None:
        nbytes += sum(BlockLayout.of(block, transfer_dtype).bytes(transfer_dtype)[1] for block in block_params if block)
    if pinned:
        nbytes += sum(page_rounded(p.numel() * p.element_size()) for p in trunk_params)
    if training:
        trainable = [p for p in [*params, *trunk_params] if p.requires_grad]
        nbytes += 3 * sum(p.numel() * 4 for p in trainable)
        if pinned:
            itemsize = transfer_dtype.itemsize if transfer_dtype is not None else 4
            largest = max((sum(p.numel() for p in block if p.requires_grad) for block in block_params), default=0)
            nbytes += 2 * page_rounded(largest * itemsize) + sum(page_rounded(p.numel() * 4) for p in trunk_params)
    return nbytes


def training_state_bytes(params: Sequence[nn.Parameter], optimizers: Sequence[Any]) -> dict[str, int]:
    """``param_bytes``, ``trainable_param_bytes`` and ``optimizer_state_bytes`` (every tensor the optimizers hold)."""
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_param_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer_state_bytes": sum(
            t.numel() * t.element_size()
            for optimizer in optimizers
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, Tensor)
        ),
    }
