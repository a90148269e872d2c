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
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.home import (
    ALIGNMENT,
    DeviceLayout,
    Event,
    Homes,
    Link,
    ParamSlice,
    aligned,
    device_layout,
)
from lightning_superpipe.memory.host_memory import (
    HostMemoryError,
    available_host_bytes,
    check_host_memory,
    rss_bytes,
    shared_rss_bytes,
)
from lightning_superpipe.memory.pinned import HostArena, NodeRanks, page_rounded

__all__ = [  # what other modules import from here, the layout types and host-memory checks included
    "ALIGNMENT",
    "BlockHome",
    "DeviceLayout",
    "HostHomes",
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


class BlockHome:
    """The host home of one block's parameters.

    Args:
        params: The block's parameters, without duplicates. They must share one dtype.
        transfer_dtype: The dtype the weights travel and compute in on the device.
        arena: Where the flat buffers come from (page-locked with a CUDA compute device).
    """

    def __init__(self, params: Sequence[nn.Parameter], transfer_dtype: torch.dtype, arena: HostArena) -> None:
        dtypes = {param.dtype for param in params}
        if len(dtypes) != 1:
            raise TypeError(f"The parameters of one block must share a dtype to stream together, found {dtypes}.")
        self.master_dtype = dtypes.pop()
        self.slices: list[ParamSlice] = []
        offset = 0
        for param in params:
            self.slices.append(ParamSlice(param, offset, param.numel(), param.shape))
            offset += aligned(param.numel())
        self.numel = offset
        # A home shared by the node's ranks is written by local rank 0 only; the others' parameters (equal to rank
        # 0's, broadcast before) just point at it.
        writes = arena.writable
        self.master = arena.empty(self.numel, self.master_dtype)
        if writes:
            self.master.zero_()  # the alignment gaps are copied too; keep them defined
        for piece in self.slices:
            if writes:
                piece.view_of(self.master).copy_(piece.param.detach())
            # The optimizer, checkpoints and the user keep using the same Parameter objects; only their storage
            # moves into the flat buffer.
            piece.param.data = piece.view_of(self.master)
            track_edits(piece.param)
        if transfer_dtype == self.master_dtype:
            self.transfer = self.master
        else:
            self.transfer = arena.empty(self.numel, transfer_dtype)
            if writes:
                self.transfer.copy_(self.master)
        self._seen = {piece.param: master_state(piece.param) for piece in self.slices}

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        """Copies the transfer buffer into the device buffer ``dst``: one copy, or with ``layout`` one per run of the
        parameters that still stream (the link runs them in order: the last copy's event covers the others)."""
        if layout is None:
            return link.to_device(dst, self.transfer, after, what)
        done = after  # nothing to copy: the buffer is ready when it is free
        for host, device, numel in layout.ranges:
            done = link.to_device(dst[device : device + numel], self.transfer[host : host + numel], after, what)
        return done

    @property
    def trainable(self) -> list[ParamSlice]:
        """The pieces whose parameters require gradients now (the flag may change between steps)."""
        return [piece for piece in self.slices if piece.param.requires_grad]

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

    def release(self) -> None:
        """Gives the parameters back their plain class (their storage stays in the flat buffer)."""
        for piece in self.slices:
            untrack_edits(piece.param)


class HostHomes(Homes):
    """The host tier: each block's home a :class:`BlockHome` in host memory (the node's shared region with ``node``),
    its gradients accumulated in the host ``.grad``. Every hook of :class:`~.home.Homes` keeps its default."""


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
    nbytes = sum(home_bytes(params, transfer_dtype or params[0].dtype) for params in block_params if params)
    with arena.shared(nbytes, node) if node is not None else nullcontext():
        return HostHomes(
            [BlockHome(params, transfer_dtype or params[0].dtype, arena) if params else None for params in block_params]
        )


def transfer_bytes(params: Sequence[nn.Parameter], transfer_dtype: torch.dtype) -> int:
    """The bytes one copy of a :class:`BlockHome` of ``params`` moves to the device (its flat transfer buffer)."""
    return sum(aligned(param.numel()) for param in params) * transfer_dtype.itemsize


def home_bytes(params: Sequence[nn.Parameter], transfer_dtype: torch.dtype) -> int:
    """The arena bytes a :class:`BlockHome` of ``params`` takes: its masters and, if separate, its transfer copy."""
    numel = sum(aligned(param.numel()) for param in params)
    master = page_rounded(numel * params[0].element_size())
    return master if transfer_dtype == params[0].dtype else master + page_rounded(numel * transfer_dtype.itemsize)


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
    nbytes = max((home_bytes(block, block[0].dtype) for block in block_params if block), default=0)
    if transfer_dtype is not None:
        nbytes += sum(p.numel() for p in params) * transfer_dtype.itemsize
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
