"""The one interface between the streaming engine and where blocks live between uses: their *homes*.

A block's home holds its parameters' values (the masters) and knows how to put them into a device buffer. The
engine asks a home for four things only: its layout (:attr:`Home.slices`, :attr:`Home.numel`, the dtype the weights
travel in), whether its masters changed since the last copy (:meth:`Home.changed`, :meth:`Home.sync`), a copy into a
device buffer (:meth:`Home.copy_in`), and nothing else. What happens around a pass, where a block's gradients go once
complete, and what the run reports belong to the *kind* of home, one :class:`Homes` object per run, whose hooks the
engine calls at fixed points and which does nothing by default.

Kinds of home:

* :class:`~lightning_superpipe.memory.host.HostHomes`: one flat host buffer per block (page-locked on CUDA), or one
  region the node's ranks share (``shard_optimizer="node"``); gradients accumulate in the host ``.grad``.
* :class:`~lightning_superpipe.memory.disk_homes.DiskTier` (``offload_device="disk"``): the masters and optimizer
  state in files, read through a bounded pool; gradients are stepped through the store or spilled to disk.

A new kind of home (4-bit frozen weights, say) is a :class:`Home` per block and a :class:`Homes` subclass that
overrides the hooks it needs; the engine does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn

#: An opaque marker of work issued on one stream of a link (``None``: nothing to wait for).
Event = Optional[Any]


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter sits inside its block's flat buffers."""

    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size

    def view_of(self, flat: Tensor) -> Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)

    @property
    def materialized_bytes(self) -> int:
        """Device bytes :meth:`view_of` allocates beyond the buffer: none, it is a view (see :class:`.PackedSlice`)."""
        return 0


@dataclass(frozen=True)
class DeviceLayout:
    """Where a block's streamed parameters sit in its device buffer while some of its parameters are withheld from
    streaming (computed elsewhere, e.g. experts paged by ``PagedMoECallback``): the others packed in order, each
    still starting on :data:`ALIGNMENT`, so that only their bytes cross the link and the slots shrink.

    Attributes:
        slices: The streamed parameters, with offsets into the device buffer.
        numel: Elements of the device buffer.
        ranges: ``(host offset, device offset, numel)`` of each copy: runs of adjacent streamed parameters.
    """

    slices: tuple[ParamSlice, ...]
    numel: int
    ranges: tuple[tuple[int, int, int], ...]


#: Every parameter starts on a multiple of this many elements (256 bytes in fp32): kernels take the same aligned
#: code paths as for separately allocated tensors, so results match plain training bit for bit.
ALIGNMENT = 64


def aligned(numel: int) -> int:
    """``numel`` rounded up to :data:`ALIGNMENT`."""
    return -(-numel // ALIGNMENT) * ALIGNMENT


def device_layout(slices: Sequence[ParamSlice], withheld: Container[nn.Parameter]) -> DeviceLayout:
    """The device layout of a block whose home holds ``slices`` when the parameters in ``withheld`` do not stream."""
    kept: list[ParamSlice] = []
    ranges: list[tuple[int, int, int]] = []
    offset = 0
    for piece in slices:
        if piece.param in withheld:
            continue
        span = aligned(piece.numel)
        kept.append(replace(piece, offset=offset))  # a subclass (a packed weight) stays one
        if ranges and ranges[-1][0] + ranges[-1][2] == piece.offset:  # adjacent at home too: one copy
            host, device, numel = ranges[-1]
            ranges[-1] = (host, device, numel + span)
        else:
            ranges.append((piece.offset, offset, span))
        offset += span
    return DeviceLayout(tuple(kept), offset, tuple(ranges))


class Link(Protocol):
    """What a home needs of the engine's copier (:mod:`lightning_superpipe.streaming.copier`)."""

    pin_memory: bool

    def to_device(self, dst: Tensor, src: Tensor, after: Event = None, what: str = "") -> Event: ...

    def wait_on_host(self, event: Event) -> None: ...


class Arena(Protocol):
    """What a kind of home needs of the engine's host arena (:class:`~lightning_superpipe.memory.pinned.HostArena`)."""

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor: ...


class StepHook(Protocol):
    """What a kind of home needs of the engine's overlapped optimizer step (:mod:`~lightning_superpipe.streaming.
    overlap`): whether it is armed for this backward, the call that steps a complete block, and the place to plug a
    kind's own per-block step in."""

    armed: bool
    #: Steps one complete block's parameters in the kind's own way (``None``: the optimizer steps them in place).
    step_block: Optional[Callable[[Any, int, list[nn.Parameter]], None]]
    #: Parameters outside the blocks that the kind steps itself (the disk tier's trunk in its files): never during
    #: backward.
    homed_trunk: frozenset[nn.Parameter]

    def block_done(self, index: int) -> None: ...


class Home(Protocol):
    """One block's home, as the engine sees it.

    Attributes:
        slices: The block's streamed parameters and where each sits in its flat buffer.
        numel: Elements of the block's flat buffer (aligned).
        master_numel: Elements of its first part, the pieces with masters (floating parameters, the only ones that
            can train): the size of the block's gradient buffer. Frozen packed weights (:mod:`.packed`), which travel
            as bytes, follow up to ``numel``.
        master_dtype: The dtype of the masters, in which the block's gradients accumulate on the host.
        transfer_dtype: The dtype the weights travel and compute in on the device.
    """

    slices: Sequence[ParamSlice]
    numel: int
    master_numel: int
    master_dtype: torch.dtype

    @property
    def transfer_dtype(self) -> torch.dtype: ...

    @property
    def transfer_bytes(self) -> int:
        """Bytes that cross the link for one copy of this block."""
        ...

    @property
    def trainable(self) -> list[ParamSlice]:
        """The pieces whose parameters require gradients now."""
        ...

    def mark_changed(self, param: nn.Parameter) -> None:
        """Counts ``param``'s master as changed whatever its version counter says."""
        ...

    def changed(self) -> list[ParamSlice]:
        """The pieces whose masters changed since the last :meth:`sync` (reads only)."""
        ...

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        """Takes the changed masters of ``pieces`` in; no copy reads the home meanwhile."""
        ...

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        """Copies the block's weights into the device buffer ``dst`` (laid out as ``layout`` when some parameters are
        withheld), once compute's last use of ``dst`` (``after``) is done; returns the copy's event."""
        ...

    def release(self) -> None:
        """The run is over: gives back what the home changed on its parameters."""
        ...


@dataclass(frozen=True)
class KindSteps:
    """A kind of home's own step of some blocks, pipelined: ``run(done)`` steps them in ``blocks``' order on the
    optimizer thread and calls ``done(index)`` as each block's new weights can be copied to the device."""

    blocks: list[int]
    run: Callable[[Callable[[int], None]], None]


class Homes:
    """The homes of a run's blocks, of one kind, and the hooks the engine calls around them.

    Each hook has one job and does nothing by default, as the host tier needs; a kind of home overrides the hooks it
    needs. The engine calls them at fixed points: :meth:`attach` once, :meth:`read_ahead` whenever it starts copies,
    :meth:`block_done` when a block's gradients of a backward are complete, :meth:`end_backward` and
    :meth:`copies_done` when backward ends, :meth:`launch_step` (pipelined) or :meth:`finish_step` around the
    optimizer's update, :meth:`before_step_wait` before waiting for a pipelined step, :meth:`close` at the end.

    Args:
        homes: Each block's home, ``None`` for a block with nothing to stream.
    """

    #: Each block's gradients stay in host ``.grad`` buffers between steps (``False``: the kind takes them away in
    #: :meth:`block_done`, and the engine lets the buffers go).
    keeps_gradients: bool = True
    #: The overlapped step always pays where it is exact (the alternative costs more than host time).
    overlap_always_pays: bool = False
    #: The kind keeps the previous step itself while a speculative step runs (the disk tier: the other slot of each
    #: block's record) and decides it in :meth:`finish_step`, so the engine keeps nothing in host memory for it.
    keeps_previous_step: bool = False

    def __init__(self, homes: Sequence[Optional[Home]]) -> None:
        self.homes: list[Optional[Home]] = list(homes)
        self.overlap: Optional[StepHook] = None
        #: The micro-batch running is the last of an accumulation (its backward runs inside the optimizer step).
        self.last_micro_batch = False
        #: How :meth:`finish_step` ended a speculative step (``"committed"``, ``"redone"``, ``"discarded"``).
        self.speculation_outcome: Optional[str] = None
        #: Whether clipping or a scaler changed the last step's gradients after backward (``None``: the kind did not
        #: see; the engine's watch does where the kind does not clip itself).
        self.gradients_changed: Optional[bool] = None

    def attach(self, link: Link, arena: Arena, overlap: StepHook, slots: int) -> None:
        """Connects the homes to the engine's link, host arena and overlapped step; ``slots`` device slots stream."""
        self.overlap = overlap

    def holds_trunk(self, param: nn.Parameter) -> bool:
        """Whether the kind keeps the master of ``param``, a parameter outside the blocks, itself (its device copy is
        then made by :meth:`copy_trunk_in`, not from the parameter)."""
        return False

    def copy_trunk_in(self, dst: Tensor, param: nn.Parameter, after: Event, what: str) -> Event:
        """Copies the master of ``param`` (one :meth:`holds_trunk` holds) into its device copy ``dst`` once
        ``after`` is done; returns the copy's event."""
        raise NotImplementedError(f"{type(self).__name__} keeps no parameter outside the blocks.")

    def check_withhold(self, params: frozenset[nn.Parameter]) -> None:
        """Raises if ``params`` cannot stop streaming with their blocks (:meth:`.StreamingEngine.withhold`)."""

    def read_ahead(self, indices: Iterable[int]) -> None:
        """The blocks expected next and not in a device slot yet, nearest first: a kind that reads its homes from
        slower storage starts reading them."""

    def block_done(self, index: int) -> None:
        """Block ``index``'s gradients of this backward are all in ``.grad``: handed to the overlapped step, which
        steps the block now if it is armed."""
        if self.overlap is not None:
            self.overlap.block_done(index)

    def before_reduce(self, index: int) -> None:
        """Before block ``index``'s gradients are averaged across ranks (several devices)."""

    def end_backward(self) -> None:
        """Backward is over, before the overlapped steps are awaited."""

    def copies_done(self) -> None:
        """Backward is over and no copy reads host memory any more."""

    def checked(self, closure: Any) -> Any:
        """The optimizer's closure, wrapped with the kind's checks before a step (the host tier has none)."""
        return closure

    def speculate(self, unscale: Optional[Tensor], clip_value: Optional[float]) -> None:
        """This backward's block steps are speculative (a kind that :attr:`keeps_previous_step`): each block's
        gradients are multiplied by ``unscale`` (a scaler's ``1/scale``) and clamped to ``clip_value`` as it steps,
        and :meth:`finish_step` commits them or steps again."""

    def launch_step(self, optimizer: Any) -> Optional[KindSteps]:
        """The optimizer step is pipelined and the optimizer's own update is next (the pre-step work is done): a kind
        that steps its blocks itself returns that step, to run on the optimizer thread (``None``: the optimizer steps
        the blocks from ``.grad``, as the host tier needs). ``optimizer`` is a stand-in for the user's, with the
        hyperparameters in force now, which that thread may step (the loop goes on with the real one)."""
        return None

    def before_step_wait(self) -> None:
        """The engine is about to wait for a block's pipelined step: the kind gives back what that step may need
        (buffers whose copies are done)."""

    def finish_step(self, optimizer: Any) -> list[int]:
        """After the optimizer's step: the kind steps or commits what the optimizer did not see; returns the blocks
        it stepped."""
        return []

    def memory_report(self) -> dict[str, Any]:
        """The kind's own figures for the strategy's memory report. ``home_optimizer_state_bytes``, where the kind
        keeps optimizer state of its own outside the optimizer's ``state`` (in files), joins the strategy's
        ``optimizer_state_bytes``."""
        return {}

    def close(self) -> None:
        """The run is over: each home gives back what it changed on its parameters."""
        for home in self.homes:
            if home is not None:
                home.release()
