"""The one interface of a kind of home: where blocks live between uses, and all a run needs of that place.

A block's home holds its parameters' values (the masters) and knows how to put them into a device buffer. The
engine asks a home for four things only: its layout (:attr:`Home.slices`, :attr:`Home.numel`, the dtype the weights
travel in), whether its masters changed since the last copy (:meth:`Home.changed`, :meth:`Home.sync`), a copy into a
device buffer (:meth:`Home.copy_in`), and nothing else. What happens around a pass, where a block's gradients go once
complete, how they are clipped, what a checkpoint holds of them and what the run reports belong to the run's
:class:`Homes`, one object of the kind per run, whose hooks the engine and the run call at fixed points and which do
nothing by default.

A :class:`HomeKind` is the kind itself, chosen by name (``SuperpipeStrategy(offload_device=NAME)``) from one
registry (:func:`register_home_kind`): the knobs only it reads, the checks of a run before anything is allocated
(host memory among them), the building of the run's homes (:meth:`HomeKind.prepare`), and what it keeps beside a
checkpoint when no run streams. The kinds of the package register themselves the same way
(:mod:`lightning_superpipe.memory`):

* ``"cpu"``, :class:`~lightning_superpipe.memory.host.HostKind`: one flat host buffer per block (page-locked on
  CUDA), or one region the node's ranks share (``shard_optimizer="node"``); gradients accumulate in the host
  ``.grad``.
* ``"disk"``, :class:`~lightning_superpipe.memory.disk.kind.DiskKind`: the masters and optimizer state in files,
  read through a bounded pool; gradients are stepped through the store or spilled to disk.

Either may hold frozen weights in a 4-bit form (:mod:`lightning_superpipe.memory.fourbit`), which travel as bytes.
A new kind is a :class:`Home` per block, a :class:`Homes` subclass that overrides the hooks it needs, and a
:class:`HomeKind` subclass that builds them, registered; nothing else changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.pinned import HostArena, NodeRanks
from lightning_superpipe.stepping.pipelined import KindSteps

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


class Hook(Protocol):
    """Something the run puts on the user's objects for its length: attaching or detaching it twice is harmless."""

    def attach(self) -> None: ...

    def detach(self) -> None: ...


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


class Homes:
    """The homes of a run's blocks, of one kind, and the hooks the engine and the run call around them.

    Each hook has one job and does nothing by default, as the host tier needs; a kind of home overrides the hooks it
    needs. The engine calls them at fixed points: :meth:`attach` once, :meth:`read_ahead` whenever it starts copies,
    :meth:`block_done` when a block's gradients of a backward are complete, :meth:`end_backward` and
    :meth:`copies_done` when backward ends, :meth:`launch_step` (pipelined) or :meth:`finish_step` around the
    optimizer's update, :meth:`before_step_wait` before waiting for a pipelined step, :meth:`close` at the end. The
    run calls the rest: :meth:`run_hooks` once streaming starts, :meth:`zero_grad_hook` as fitting starts,
    :meth:`clip_gradients` and :meth:`unscale` where the kind :attr:`clips_gradients`, and the checkpoint hooks
    (:meth:`saving_checkpoint`, :meth:`checkpoint_state_dict`, :meth:`check_optimizer_state`).

    Args:
        homes: Each block's home, ``None`` for a block with nothing to stream.
    """

    #: Each block's gradients stay in host ``.grad`` buffers between steps (``False``: the kind takes them away in
    #: :meth:`block_done`, and the engine lets the buffers go).
    keeps_gradients: bool = True
    #: Where the kind steps its blocks itself from the gradients it keeps (``None``: the optimizer steps them from
    #: ``.grad``): how it does, and how it keeps the previous step, as the step modes' reasons say it (the
    #: overlapped step then always pays where it is exact: the alternative reads the kept gradients back).
    own_steps: Optional[tuple[str, str]] = None
    #: The kind keeps the previous step itself while a speculative step runs (the disk tier: the other slot of each
    #: block's record) and decides it in :meth:`finish_step`, so the engine keeps nothing in host memory for it.
    keeps_previous_step: bool = False
    #: The kind clips and unscales the blocks' gradients itself (:meth:`clip_gradients`, :meth:`unscale`): they are
    #: not all in ``.grad`` when Lightning's precision plugin would clip them.
    clips_gradients: bool = False
    #: After a pipelined step, the device copies are made again before a callback's hook may read the weights
    #: (``False``: the kind's homes read slower storage, and the next pass makes them).
    refreshes_for_callbacks: bool = True

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

    def run_hooks(self, model: nn.Module, trainer: Any) -> list[Hook]:
        """Once streaming started: hooks of the kind's own on the user's ``model`` (attached already), which the run
        detaches when it ends; ``trainer`` is the fitting Trainer, ``None`` outside ``fit``."""
        return []

    def zero_grad_hook(self, model: nn.Module, optimizers: Sequence[Any]) -> Optional[Hook]:
        """As fitting starts: a hook (not attached yet) on the user's ``zero_grad`` calls of ``optimizers`` (and
        Lightning's wrappers of them) and ``model``, for a kind that keeps gradients outside ``.grad``; ``None``."""
        return None

    def clip_gradients(self, optimizer: Any, clip_val: Union[int, float, None] = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        """Lightning's ``Precision.clip_gradients``, for a kind that :attr:`clips_gradients`."""
        raise NotImplementedError(f"{type(self).__name__} leaves clipping to the precision plugin.")

    def unscale(self, scaler: Any, optimizer: Any) -> None:
        """Completes ``GradScaler.unscale_(optimizer)`` (which saw the gradients in ``.grad`` only), for a kind that
        :attr:`clips_gradients`."""
        raise NotImplementedError(f"{type(self).__name__} leaves unscaling to the gradient scaler.")

    def saving_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, os.PathLike[str]]
                          ) -> AbstractContextManager[None]:
        """Around the write of a ``.ckpt`` at ``filepath`` (on the rank that writes it): the kind adds to
        ``checkpoint`` what a resume needs of it (the disk tier: its files, linked beside the ``.ckpt``)."""
        return nullcontext()

    def checkpoint_state_dict(self) -> AbstractContextManager[None]:
        """Around the model's state dict for a ``.ckpt``: the kind leaves out what it keeps beside the file."""
        return nullcontext()

    def check_optimizer_state(self, optimizer: Any, state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> None:
        """Refuses optimizer ``state`` from ``checkpoint`` that the kind could not use, before it is loaded."""

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


class Knobs(Protocol):
    """The strategy's knobs a kind of home reads (:class:`~lightning_superpipe.run.options.SuperpipeOptions`)."""

    @property
    def offload_path(self) -> Optional[Union[str, os.PathLike[str]]]: ...

    @property
    def host_buffer_bytes(self) -> Optional[int]: ...

    @property
    def shard_optimizer(self) -> Union[bool, str]: ...

    @property
    def overlap_optimizer(self) -> Union[bool, str]: ...

    @property
    def quantize_frozen(self) -> Optional[str]: ...

    @property
    def offload_call(self) -> str:
        """The user's call of the homes' knobs, as error messages quote it."""
        ...


class InitCalls(Protocol):
    """The init calls ``configure_model`` recorded, still to run (a ``DeferredInit``)."""

    def pending_bytes(self, tensors: Iterable[Tensor]) -> int: ...

    def initial_values(self, block: Mapping[str, Tensor]) -> dict[str, Tensor]: ...


@dataclass
class HomesRun:
    """A run as a kind of home sees it when it checks and builds the homes.

    Attributes:
        knobs: The strategy's knobs.
        model: The model.
        block_params: Each block's streamed parameters, in block order.
        trunk_params: The parameters outside the blocks (resident on the device as copies).
        device: The compute device.
        transfer_dtype: The dtype the weights travel in (``None``: their own).
        fitting: Whether the run trains.
        optimizers: The run's optimizers (set up before the homes where the kind :attr:`~HomeKind.needs_optimizers`).
        trainer: The fitting Trainer, or ``None``.
        slots: How many device slots stream (resident and in flight).
        what: The blocks, as messages name them (``'2 x LlamaDecoderLayer'``).
        deferred: The init calls ``configure_model`` recorded, or ``None``.
        resume: The folder a checkpoint's homes are restored from (:meth:`HomeKind.resume_folder`), or ``None``.
        ranks: How many ranks the run has.
        rank: This rank's global rank.
        local_ranks: The ranks on this node.
        node: The node's ranks that share the homes (``shard_optimizer="node"``), or ``None``.
        barrier: Waits for every rank to reach the point named (a failure on any is an error on all).
    """

    knobs: Knobs
    model: nn.Module
    block_params: list[list[nn.Parameter]]
    trunk_params: list[nn.Parameter]
    device: torch.device
    transfer_dtype: Optional[torch.dtype]
    fitting: bool
    optimizers: tuple[Any, ...] = ()
    trainer: Any = None
    slots: int = 1
    what: str = "the blocks"
    deferred: Optional[InitCalls] = None
    resume: Optional[Path] = None
    ranks: int = 1
    rank: int = 0
    local_ranks: int = 1
    node: Optional[NodeRanks] = None
    barrier: Callable[[str], None] = lambda what: None


class HomesBuilder:
    """One run's way to its homes, made by :meth:`HomeKind.prepare` once the run's checks passed.

    The run calls :meth:`before_engine` once the frozen matrices are quantized, then :meth:`homes` from the engine
    (with its host arena), and :meth:`discard` if the run fails before the engine took the homes.
    """

    #: Where ``quantize_frozen`` writes each block's 4-bit weights as it makes them (``write(index, params)``), for a
    #: kind that keeps them outside host memory; ``None``: they stay in the parameters until the homes take them.
    write_frozen: Optional[Callable[[int, Sequence[nn.Parameter]], None]] = None

    def before_engine(self) -> None:
        """Builds what must exist before the rest of the model is made (the disk tier writes its files)."""

    def homes(self, arena: HostArena) -> Homes:
        """The run's homes, from the engine's host ``arena``."""
        raise NotImplementedError

    def discard(self) -> None:
        """The run failed before the engine took the homes: what :meth:`before_engine` built goes."""


class HomeKind:
    """A kind of home: what a run that chooses it (``SuperpipeStrategy(offload_device=NAME)``) needs of it besides the
    homes themselves. Registered by :func:`register_home_kind`; every method but :meth:`prepare` has a default.

    Attributes:
        name: The ``offload_device`` value that chooses the kind.
        summary: What it keeps where, as the knob's error message lists the kinds.
        title: How messages name it (``"the disk tier"``).
        purpose: What choosing it is for, as messages advise it (``"keep the training state in files"``).
        own_knobs: The knobs only this kind reads (fields of ``SuperpipeOptions``): refused under another kind.
        records_init: ``configure_model``'s init calls are recorded and run block by block as the kind builds the
            homes (the model never sits whole in host memory).
        needs_optimizers: The optimizers are set up before the homes are built (the kind sizes its files by them).
        sharding_refusal: Why ``shard_optimizer`` does not apply under the kind (``None``: it does).
    """

    name: str = ""
    summary: str = ""
    title: str = ""
    purpose: str = ""
    own_knobs: tuple[str, ...] = ()
    records_init: bool = False
    needs_optimizers: bool = False
    sharding_refusal: Optional[str] = None

    def check_knobs(self, knobs: Knobs) -> None:
        """Checks the kind's own knobs, when the strategy is made.

        Raises:
            ValueError: With the user's call.
        """

    def check_run(self, knobs: Knobs, *, fitting: bool, trainer: Any, optimizers: Sequence[Any], ranks: int) -> None:
        """Refuses, before anything is allocated, a run the kind cannot serve (its folder, the optimizer, the
        callbacks, several ``ranks``).

        Raises:
            ValueError: With the user's call and what to do instead.
        """

    def check_host_room(self, run: HomesRun) -> None:
        """Refuses, before anything is allocated, a run whose host memory is too small for the homes and what the
        run keeps beside them.

        Raises:
            HostMemoryError: With the bytes needed and available.
        """

    def prepare(self, run: HomesRun) -> HomesBuilder:
        """The way to this run's homes; nothing is built until the run asks (:class:`HomesBuilder`)."""
        raise NotImplementedError(f"{type(self).__name__} must say how its homes are built.")

    def wrote(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether ``checkpoint`` keeps the blocks of a run on this kind (beside the ``.ckpt``, not in it)."""
        return False

    def resume_folder(self, ckpt_path: Union[str, os.PathLike[str]], checkpoint: Mapping[str, Any],
                      chosen: HomeKind) -> Optional[Path]:
        """Where a run on the ``chosen`` kind restores the homes of ``checkpoint`` (one this kind :meth:`wrote`)
        from, when streaming starts.

        Raises:
            MisconfigurationException: The ``chosen`` kind cannot resume it.
        """
        return None

    def load_model_state(self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool,
                         streaming: bool) -> None:
        """Loads the state dict of ``checkpoint`` (one this kind :meth:`wrote`) into ``module``, the blocks left for
        :meth:`resume_folder`."""
        raise NotImplementedError(f"{type(self).__name__} writes no checkpoint of its own.")

    def checkpoint_weights(self, ckpt_path: Union[str, os.PathLike[str]], checkpoint: Mapping[str, Any]
                           ) -> tuple[dict[str, Tensor], list[str]]:
        """The weights ``checkpoint`` (one this kind :meth:`wrote`) keeps beside the ``.ckpt``, by name, and the
        modules whose weights a run builds again instead (a 4-bit base): its model without a resume."""
        return {}, []

    def remove_checkpoint(self, ckpt_path: Union[str, os.PathLike[str]]) -> None:
        """The ``.ckpt`` at ``ckpt_path`` is being removed: what the kind keeps beside it goes too."""


_KINDS: dict[str, HomeKind] = {}


def register_home_kind(kind: HomeKind) -> HomeKind:
    """Makes ``kind`` a choice of ``SuperpipeStrategy(offload_device=kind.name)`` (a kind registered under the same
    name before is replaced); returns it.

    Raises:
        ValueError: ``kind.name`` is not a non-empty string.
    """
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"A kind of home needs a name, the offload_device value that chooses it; {kind!r} has"
                         f" {kind.name!r}.")
    _KINDS[kind.name] = kind
    return kind


def unregister_home_kind(name: str) -> None:
    """Takes the kind ``name`` out of the choices (nothing if there is none)."""
    _KINDS.pop(name, None)


def home_kinds() -> list[HomeKind]:
    """The registered kinds, in the order they were registered."""
    return list(_KINDS.values())


def home_kind(name: str) -> Optional[HomeKind]:
    """The kind registered as ``name``, or ``None``."""
    return _KINDS.get(name) if isinstance(name, str) else None


def kind_that_wrote(checkpoint: Mapping[str, Any]) -> Optional[HomeKind]:
    """The kind whose homes ``checkpoint`` keeps beside the ``.ckpt``, or ``None`` (all of it is in the file)."""
    return next((kind for kind in _KINDS.values() if kind.wrote(checkpoint)), None)
