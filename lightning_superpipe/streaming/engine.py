"""The streaming engine: which block's weights are on the device, when they arrive, where gradients go.

The device holds three things for the blocks:

* ``resident_blocks`` blocks permanently (evenly spaced, so that while a resident block computes the copy
  stream gets a whole block's compute time to bring the next streamed one);
* a pool of ``prefetch + 1`` slots, each the size of the largest block, allocated once: one slot for the block
  computing now and ``prefetch`` for the blocks predicted next;
* the trunk: the parameters outside blocks (embeddings, heads, norms), resident, as device copies of their host masters.

The engine predicts the order in which blocks are needed from the pass it is in: a training pass runs the blocks forward
and then, recomputing each from its checkpoint, backward; an evaluation pass runs them forward, again and again
(generation). While block ``i`` computes, the next blocks in that order are copied in.

Gradients leave the device as soon as a block's backward delivers them (:mod:`.gradients`); they are accumulated in fp32
into the ``.grad`` of the host parameters, so the optimizer, its state and the master weights never leave the host.

Whatever changes a host master (an optimizer step, ``load_state_dict``, a callback's edit, an EMA swap, each evaluation
of an LBFGS closure) is noticed at the start of the next pass from the parameters' version counters and storages, and
the device copies of what changed are made again (:meth:`StreamingEngine.sync_with_masters`).

The engine knows where the blocks live only through one interface, :mod:`lightning_superpipe.memory.home`: each block's
home copies it into a device buffer and says whether its masters changed; the kind of home (host memory, the node's
shared memory, the disk tier's files) decides what happens to complete gradients and reads ahead of the slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_superpipe.memory.home import DeviceLayout, Home, Homes, ParamSlice, device_layout
from lightning_superpipe.memory.host import master_state, track_edits, untrack_edits
from lightning_superpipe.memory.pinned import HostArena, page_rounded
from lightning_superpipe.stepping.overlap import OverlappedStep
from lightning_superpipe.stepping.pipelined import PipelinedStep
from lightning_superpipe.streaming.activations import ActivationPlacement, ActivationsPolicy, per_block_modes
from lightning_superpipe.streaming.copier import Event, OtherLink, make_copier
from lightning_superpipe.streaming.gradients import GradientReturn
from lightning_superpipe.streaming.ledger import DeviceLedger, MaterializedWeights
from lightning_superpipe.streaming.placement import choose_resident, clamp
from lightning_superpipe.streaming.schedule import BlockSchedule


@dataclass(eq=False)
class _Slot:
    """A device buffer that holds one block's weights at a time."""

    flat: Tensor
    number: int
    block: Optional[int] = None
    version: int = -1
    ready: Event = None  # the copy into ``flat`` finished
    free: Event = None  # compute finished reading ``flat``


class StreamingEngine:
    """Moves the weights of ``blocks`` between their homes and the compute device.

    The engine knows the blocks' homes only through :class:`~lightning_superpipe.memory.home.Homes` (what ``homes``
    builds): whether they are in host memory, shared by the node's ranks or in files is the homes' business.

    Args:
        block_params: The parameters that stream with each block, in block order.
        trunk_params: The parameters that stay resident on the device (outside blocks, or tied).
        device: The compute device.
        resident_blocks: How many blocks stay on the device permanently (evenly spaced), or which.
        prefetch: How many blocks are copied in ahead of the one computing.
        homes: Builds the blocks' homes from the engine's host arena (e.g. :func:`~lightning_superpipe.memory.host.
            build_homes`; a kind of home's :meth:`~lightning_superpipe.memory.home.HomesBuilder.homes`).
        link: An ``EmulatedLink`` to emulate an asynchronous device on the CPU; ``None`` for the real link.
        activations: Where each block's activations live between forward and backward (:mod:`.activations`).
    """

    def __init__(
        self,
        block_params: Sequence[Sequence[nn.Parameter]],
        trunk_params: Sequence[nn.Parameter],
        device: torch.device,
        resident_blocks: Union[int, Sequence[int]],
        prefetch: int,
        homes: Callable[[HostArena], Homes],
        link: Optional[OtherLink] = None,
        activations: ActivationsPolicy = "recompute",
    ) -> None:
        self.device = device
        self.activation_modes = per_block_modes(activations, len(block_params))
        self.copier = make_copier(device, link)
        self.homes: list[Optional[Home]] = []
        self._trunk: dict[nn.Parameter, Tensor] = {}
        try:
            self.ledger = DeviceLedger()
            self.materialized = MaterializedWeights(self.ledger)
            resident = choose_resident(resident_blocks, len(block_params))
            streamed = len(block_params) - len(resident)
            self.prefetch = clamp("prefetch", prefetch, streamed, "the number of streamed blocks")
            self.arena = HostArena(pin=self.copier.pin_memory)
            self.home_kind = homes(self.arena)
            self.homes = self.home_kind.homes
            # A block's version grows whenever its masters change; a slot holding an older version is stale.
            self._block_version = [0] * len(block_params)
            # Parameters that do not stream for now (computed elsewhere: paged experts), and the device layout of
            # each block that has some (the others use their home's layout).
            self._withheld: frozenset[nn.Parameter] = frozenset()
            self._layouts: dict[int, DeviceLayout] = {}
            self._resident: dict[int, Tensor] = {}
            self._resident_ready: dict[int, Event] = {}
            self._slots: list[_Slot] = []
            self._allocate_blocks(resident)
            self._busy: Optional[_Slot] = None
            self._build_trunk(trunk_params)
            self._home_of = {piece.param: home for home in self.homes if home is not None for piece in home.slices}
            self._wire_gradients(block_params)
            self.activations = ActivationPlacement(self)
            #: A planner's ``StepProfiler`` while it measures a step, told by the hooks what compute is doing.
            self.profiler: Any = None
            self._synced_in_backward: set[int] = set()  # blocks whose homes the overlapped step already synced
            self.schedule = BlockSchedule(len(block_params))
            self._start_copies()
        except BaseException:
            self.close()  # nothing half-built stays behind: threads, the emulated link's checker, parameter classes
            raise

    def _build_trunk(self, trunk_params: Sequence[nn.Parameter]) -> None:
        """The trunk's device copies (in its masters' dtype, as plain mixed precision keeps them), its masters moved
        into the page-locked arena where copies are asynchronous, and their edits tracked."""
        if self.copier.pin_memory:  # asynchronous copies need page-locked sources (those in the homes are theirs)
            pinned_params = [p for p in trunk_params if not self.home_kind.holds_trunk(p)]
            self.arena.reserve(sum(page_rounded(p.numel() * p.element_size()) for p in pinned_params))
            for param in pinned_params:
                pinned = self.arena.empty(param.numel(), param.dtype).view(param.shape)
                pinned.copy_(param.detach())
                param.data = pinned
        self._trunk = {param: torch.empty_like(param, device=self.device) for param in trunk_params}
        self.ledger.add("trunk_weights", self.trunk_device_bytes())
        self._trunk_ready: Event = None
        for param in trunk_params:
            track_edits(param)
        self._trunk_seen: dict[nn.Parameter, tuple[int, int]] = {}
        self._deferred_trunk: set[nn.Parameter] = set()
        #: Trunk parameters a training pass used before its first block.
        self.trunk_first: set[nn.Parameter] = set()
        self._trunk_names = {p: f"trunk parameter {i} {tuple(p.shape)}" for i, p in enumerate(self._trunk)}
        self._persistent = {copy.untyped_storage().data_ptr() for copy in self._trunk.values()}

    def _wire_gradients(self, block_params: Sequence[Sequence[nn.Parameter]]) -> None:
        """The way gradients go home: off the device (:class:`.GradientReturn`), then to the homes' kind, which hands
        a complete block to the overlapped step (or steps or spills it itself)."""
        kind = self.home_kind
        self.gradients = GradientReturn(
            self.copier, self.ledger, self.homes, self.arena, keep_grad_homes=kind.keeps_gradients
        )
        self.overlap = OverlappedStep(block_params)
        self.pending = PipelinedStep(self.overlap.executor, self.homes, kind.before_step_wait)  # on the same thread
        self.gradients.on_block_complete = kind.block_done
        self.gradients.on_trunk_complete = self.overlap.trunk_done
        self.gradients.before_reduce = kind.before_reduce
        self.overlap.on_stepped = self._sync_stepped_block
        kind.attach(self.copier, self.arena, self.overlap, len(self._slots))

    def _start_copies(self) -> None:
        """The first copies into the fresh buffers: the allocator may have handed out memory that compute still reads
        (queued kernels of an earlier engine, freed activations), so they wait for compute issued so far."""
        allocated = self.copier.mark_compute()
        self._fill_blocks(allocated)
        for param in self._trunk:
            self._trunk_ready = self._copy_trunk(param, allocated)
        self.refresh()

    def _allocate_blocks(self, resident: Sequence[int]) -> None:
        """Allocates the device buffers of the blocks: one per resident block, and ``prefetch + 1`` slots of the
        largest streamed block (fewer if fewer blocks stream)."""
        for index in resident:
            home = self.homes[index]
            if home is not None:
                buffer = torch.empty(self._streamed_numel(index), dtype=home.transfer_dtype, device=self.device)
                self._resident[index] = buffer
                self.ledger.add("block_weights", buffer.numel() * buffer.element_size())
        self.resident_indices = frozenset(self._resident)
        # Blocks that never take a slot: the resident ones, and those with nothing to stream.
        self._unslotted = self.resident_indices | {i for i, home in enumerate(self.homes) if home is None}
        streamed = [i for i, home in enumerate(self.homes) if home is not None and i not in self._resident]
        if not streamed:
            return
        slot_numel = max(self._streamed_numel(i) for i in streamed)
        dtypes = {self.homes[i].transfer_dtype for i in streamed}  # type: ignore[union-attr]
        if len(dtypes) > 1:
            raise TypeError(
                f"SuperpipeStrategy streams blocks through slots of one dtype, but the blocks' weights have"
                f" {sorted(str(d) for d in dtypes)}. Give the model one dtype (e.g. `model.to(torch.bfloat16)`,"
                " or `precision='bf16-mixed'` with fp32 weights), or keep the odd blocks out of `blocks=`."
            )
        slot_dtype = dtypes.pop()
        for _ in range(min(self.prefetch + 1, len(streamed))):
            flat = torch.empty(slot_numel, dtype=slot_dtype, device=self.device)
            self._slots.append(_Slot(flat, len(self._slots)))
            self.ledger.add("block_weights", flat.numel() * flat.element_size())

    def _fill_blocks(self, allocated: Event) -> None:
        """Starts the first copies into freshly allocated block buffers, after ``allocated`` (compute issued before
        the allocation, which may still read that memory): the resident blocks now, the slots when loaded."""
        for slot in self._slots:
            slot.free = allocated
        for index, buffer in self._resident.items():
            self._resident_ready[index] = self._copy_in(buffer, index, allocated, f"resident block {index}")

    def replan(self, resident: Sequence[int], prefetch: int, activations: ActivationsPolicy) -> None:
        """Places the blocks anew between steps (a planner's decision): which are resident, how many stream
        ahead, where each one's activations live. The host homes stay; only the device buffers are made again.

        Args:
            resident: Indices of the blocks to keep on the device.
            prefetch: Blocks copied in ahead of the one computing.
            activations: One placement for all blocks, or one per block.
        """
        modes = per_block_modes(activations, len(self.homes))
        resident = choose_resident(list(resident), len(self.homes))
        self._release_busy()
        self.copier.synchronize()  # no copy may still write the buffers about to go
        for buffer in self._resident.values():
            self.ledger.remove("block_weights", buffer.numel() * buffer.element_size())
        for slot in self._slots:
            self.ledger.remove("block_weights", slot.flat.numel() * slot.flat.element_size())
        self._resident, self._resident_ready, self._slots = {}, {}, []
        self.activation_modes = modes
        self.prefetch = clamp("prefetch", prefetch, len(self.homes) - len(resident), "the number of streamed blocks")
        self._allocate_blocks(resident)
        self._fill_blocks(self.copier.mark_compute())  # fresh memory that compute may have read until now
        self._prepare(training=True)

    # ------------------------------------------------------------------ passes

    def start_pass(self, training: bool) -> None:
        """Starts a pass: takes in whatever changed the host masters since the last one, and sets the order in
        which blocks are expected: forward then backward in training, forward (repeated) otherwise."""
        self.copier.begin_pass()
        self._prepare(training)

    def _prepare(self, training: bool) -> None:
        self._release_busy()
        self.sync_with_masters()
        self.schedule.start(training)
        self._prefetch()

    def finish_pass(self) -> None:
        """Ends a forward-only pass: the block computing last is done."""
        self._release_busy()

    def finish_backward(self) -> None:
        """Ends a training pass: every gradient is in ``.grad`` and no copy reads host memory any more (the
        optimizer is about to write it)."""
        self._release_busy()
        self.gradients.finish()
        self.home_kind.end_backward()
        self.overlap.finish()
        self.copier.synchronize()
        self.home_kind.copies_done()

    def close(self) -> None:
        """Waits for outstanding work, stops the gradient worker and gives the parameters their class back."""
        try:
            if hasattr(self, "gradients"):  # not when set-up failed before it
                self.gradients.close()
            if hasattr(self, "overlap"):
                self.overlap.close()  # after the pending steps, which run on its thread
        finally:
            try:
                self.copier.close()
                if hasattr(self, "home_kind"):  # the parameters get their class, or their committed values, back
                    self.home_kind.close()
            finally:
                if hasattr(self, "arena"):
                    self.arena.close()
        for param in self._trunk:
            untrack_edits(param)

    def refresh(self, changed: Iterable[nn.Parameter] = (), prepare: bool = True) -> None:
        """Makes the device copies match the host masters after they changed (an optimizer step, a load) and
        starts bringing in the first block, with which whatever runs next (a training step, validation) starts.

        Args:
            changed: Parameters to count as changed whatever their version counters say: torch's fused CPU
                optimizers (``AdamW(fused=True)``) write parameters without bumping the counter.
            prepare: Start the first copies now; ``False`` after a pipelined step, whose blocks are not stepped yet
                (the next pass starts them, waiting for each block's step).
        """
        synced = {self.homes[index] for index in self._synced_in_backward}
        for param in changed:
            if param in self._trunk_seen:
                self._trunk_seen[param] = (-1, -1)
            elif param in self._home_of and self._home_of[param] not in synced:
                self._home_of[param].mark_changed(param)
        # Not a new pass: the events keep the stream the last pass ran on, whose tail may still read the copies.
        if prepare:
            self._prepare(training=True)

    def sync_with_masters(self) -> None:
        r"""Makes the device copies of every master that changed since they were made again.

        A change is a new version counter (any in-place edit: optimizer steps, ``load_state_dict``,
        ``torch.no_grad()`` edits, ``.data`` edits of plain ``nn.Parameter``\\s) or a new storage (``p.data = x``).
        Checking costs a look at each parameter, not at its data.
        """
        self.pending.wait_trunk()  # a pipelined step writes the trunk's masters first (but those used after blocks)
        self._deferred_trunk = set(self.pending.late_trunk)  # copied at their first use (trunk_tensor)
        pending = frozenset(self.pending.pending_blocks)  # the optimizer thread's homes for now
        changed = [(index, home, [] if index in pending else home.changed())
                   for index, home in enumerate(self.homes) if home is not None]
        synced, self._synced_in_backward = self._synced_in_backward, set()
        changed = [(index, home, pieces) for index, home, pieces in changed if pieces or index in synced]
        trunk = [p for p in self._trunk if p not in self._deferred_trunk and master_state(p) != self._trunk_seen[p]]
        if not changed and not trunk:
            return
        # No copy may still read the host buffers about to be written, and the device may still be reading the
        # old copies (the tail of the last backward).
        self.copier.synchronize()
        computed = self.copier.mark_compute()
        # The host-to-device stream runs copies in the order they are issued: the trunk's first (the embedding is
        # the first thing a pass needs), then the blocks in the order they compute.
        for param in trunk:
            copy = self._trunk[param]
            if param.shape != copy.shape or param.dtype != copy.dtype:
                raise RuntimeError(
                    f"A parameter outside the streamed blocks changed from shape {tuple(copy.shape)} and dtype"
                    f" {copy.dtype} to {tuple(param.shape)} and {param.dtype} during the run; SuperpipeStrategy keeps"
                    " a device copy of it and cannot follow. Change the model before `Trainer.fit`, not inside it."
                )
            self._trunk_ready = self._copy_trunk(param, computed)
        for index, home, pieces in changed:
            if index not in pending:  # the thread stepping a pending block brings its home up to date itself
                home.sync(pieces)
            self._block_version[index] += 1
            if index in self._resident:
                buffer = self._resident[index]
                self._resident_ready[index] = self._copy_in(buffer, index, computed, f"resident block {index}")

    def _sync_stepped_block(self, index: int, params: list[nn.Parameter]) -> None:
        """On the optimizer thread, right after the overlapped step of block ``index``: its new masters go into its
        transfer copy while backward goes on with the blocks before it. No copy reads this block's home again
        before backward ends (its weights came in for its own backward, which is over)."""
        home = self.homes[index]
        assert home is not None
        for param in params:
            home.mark_changed(param)  # CPU fused optimizers write without bumping the version counter
        home.sync(home.changed())
        self._synced_in_backward.add(index)

    def mark_stepped(self, index: int, params: Optional[list[nn.Parameter]] = None) -> None:
        """Block ``index``'s masters were stepped after backward: by this process (``params``, whose new values go into
        the home's transfer copy now), or (``None``) by another rank sharing the home (``shard_optimizer="node"``),
        which wrote it. Either way the next pass makes the block's device copies again, without writing the home."""
        if params is not None:
            self._sync_stepped_block(index, params)
        else:
            self._synced_in_backward.add(index)

    # ------------------------------------------------------------------ weights

    @torch.compiler.disable
    def acquire(self, index: int) -> list[Tensor]:
        """Returns block ``index``'s weights on the device, one view per streamed parameter, and starts the copies
        of the blocks expected next.

        The block stays in its slot until another block is acquired or the pass ends, since in backward the
        autograd engine still reads its recomputed weights after the recomputation returns.
        """
        return self.materialized.weights_in(self.streamed_slices(index), self.acquire_flat(index))

    @torch.compiler.disable
    def acquire_flat(self, index: int) -> Tensor:
        """Block ``index``'s flat device buffer (see :meth:`acquire`)."""
        self.copier.refuse_capture()
        self.schedule.advance(index)
        home = self.homes[index]
        assert home is not None, f"block {index} has no streamed parameters"
        if index in self._resident:
            self._release_busy()
            self.copier.wait_on_compute(self._resident_ready.pop(index, None))
            flat = self._resident[index]
        else:
            slot = self._slot_holding(index)
            if slot is not self._busy:
                self._release_busy()
            if slot is None:
                slot = self._load(index, avoid=set())
            self._busy = slot
            self.copier.wait_on_compute(slot.ready)
            slot.ready = None
            flat = slot.flat
        self._prefetch()
        return flat

    def weights_first(self, index: int) -> None:
        """At ``prefetch=0``, starts block ``index``'s copy now (the block before it is done), for a caller about to
        queue copies the block needs after its weights: else they would go first, and the block wait for both."""
        streamed = index not in self._resident and self.homes[index] is not None
        if self.prefetch == 0 and streamed and self._slot_holding(index) is None:
            self._release_busy()
            self._load(index, avoid=set())

    def held(self, index: int) -> list[Tensor]:
        """Block ``index``'s weights where they are for the current computation (see :meth:`held_flat`)."""
        flat = self.held_flat(index)
        assert flat is not None, f"block {index} is not on the device"
        return self.materialized.weights_in(self.streamed_slices(index), flat)

    def held_flat(self, index: int) -> Optional[Tensor]:
        """Block ``index``'s flat device buffer if it is on the device for the current computation (resident, or in
        the slot computing now), else ``None``."""
        if index in self._resident:
            return self._resident[index]
        busy = self._busy
        return busy.flat if busy is not None and busy.block == index and self._holds_current(busy) else None

    def weights_again(self, index: int) -> Tensor:
        """Block ``index``'s flat device buffer for backward: the one computing if it is this block, else fetched
        (prefetched ahead in the training order, as for a recomputation)."""
        held = self.held_flat(index)
        if held is not None and self.schedule.is_current(index):
            return held  # the block computing now: no new acquisition, the prefetch cursor stays
        return self.acquire_flat(index)

    @torch.compiler.disable
    def trunk_tensor(self, param: nn.Parameter) -> Tensor:
        """The device copy of a resident (trunk) parameter (made now if a pipelined step deferred it)."""
        if param in self._deferred_trunk:
            self.pending.wait_trunk_param(param)
            self._deferred_trunk.discard(param)
            self.copier.wait_on_compute(self._copy_trunk(param, self.copier.mark_compute()))
        if not self.schedule.started:  # used before any block in a pass (an embedding): a pipelined step's first
            self.trunk_first.add(param)
        if self._trunk_ready is not None:
            self.copier.wait_on_compute(self._trunk_ready)
            self._trunk_ready = None
        return self._trunk[param]

    def _copy_trunk(self, param: nn.Parameter, after: Event) -> Event:
        """Copies ``param``'s master into its device copy (after ``after``) and notes the master's state."""
        self._trunk_seen[param] = master_state(param)
        if self.home_kind.holds_trunk(param):  # its master is in the homes' keeping (files, say)
            return self.home_kind.copy_trunk_in(self._trunk[param], param, after, self._trunk_names[param])
        return self.copier.to_device(self._trunk[param], param.detach(), after, self._trunk_names[param])

    def trunk_parameters(self) -> list[nn.Parameter]:
        """The parameters outside blocks, resident on the device as copies."""
        return list(self._trunk)

    def is_trunk(self, param: nn.Parameter) -> bool:
        return param in self._trunk

    def _prefetch(self) -> None:
        window: list[int] = []
        upcoming = self.schedule.upcoming
        for index in upcoming(self._unslotted):
            if len(window) == self.prefetch:
                break
            window.append(index)
        keep = set(window)
        if self._busy is not None and self._busy.block is not None:
            keep.add(self._busy.block)
        for index in window:
            if self._slot_holding(index) is None and self._load(index, avoid=keep) is None:
                break
        # Homes in slower storage start reading further ahead than the slots, up to the first block whose pipelined
        # step is still pending (its step reads it, and needs the buffers more than the blocks after it).
        pending = self.pending.pending_blocks
        unslotted = (i for i in upcoming(self._unslotted) if self._slot_holding(i) is None)
        self.home_kind.read_ahead(itertools.takewhile(lambda i: i not in pending, unslotted))

    def _slot_holding(self, index: int) -> Optional[_Slot]:
        for slot in self._slots:
            if slot.block == index and slot.version == self._block_version[index]:
                return slot
        return None

    def _load(self, index: int, avoid: set[int]) -> Optional[_Slot]:
        """Starts copying block ``index`` into a slot that is not busy and holds no block in ``avoid``."""
        for slot in sorted(self._slots, key=self._holds_current):  # stale slots first
            if slot is self._busy or (self._holds_current(slot) and slot.block in avoid):
                continue
            slot.block, slot.version = index, self._block_version[index]
            dst = slot.flat[: self._streamed_numel(index)]
            slot.ready = self._copy_in(dst, index, slot.free, f"slot {slot.number} (block {index})")
            return slot
        return None

    def _copy_in(self, dst: Tensor, index: int, after: Event, what: str) -> Event:
        """Copies block ``index``'s weights from its home into the device buffer ``dst`` (once a pipelined step of
        the block is done)."""
        self.pending.wait_block(index)
        home = self.homes[index]
        assert home is not None
        return home.copy_in(dst, self.copier, after, what, self._layouts.get(index))

    # ------------------------------------------------------------------ withheld parameters

    def withhold(self, params: Iterable[nn.Parameter]) -> None:
        """Stops streaming ``params`` until :meth:`release_withheld`: something else computes with them for a while
        (``PagedMoECallback`` pages the experts on the device for an evaluation). Their bytes no longer cross the
        link and the block buffers shrink to what the other parameters need; the hooks neither bind nor check them,
        nor deliver gradients for them. The parameters' masters stay where they are.

        Args:
            params: Parameters of the streamed blocks.

        Raises:
            ValueError: A parameter does not stream with a block (outside the blocks, or tied).
            RuntimeError: The blocks' homes cannot leave parameters out (they read blocks whole).
        """
        params = frozenset(params)
        outside = [param for param in params if param not in self._home_of]
        if outside:
            raise ValueError(
                f"{len(outside)} of the {len(params)} parameters to withhold do not stream with a block (e.g. one of"
                f" shape {tuple(outside[0].shape)}): only block parameters can stop streaming. Put the modules that"
                " hold them inside the streamed blocks (`SuperpipeStrategy(blocks=...)`)."
            )
        if params:
            self.home_kind.check_withhold(params)
        self._relayout(self._withheld | params)

    def release_withheld(self) -> None:
        """Streams every block parameter again (after :meth:`withhold`)."""
        self._relayout(frozenset())

    @property
    def withheld(self) -> frozenset[nn.Parameter]:
        """The parameters withheld from streaming now (:meth:`withhold`); empty nearly always."""
        return self._withheld

    def streamed_slices(self, index: int) -> Sequence[ParamSlice]:
        """Block ``index``'s streamed parameters and where each sits in its device buffer."""
        layout = self._layouts.get(index)
        return layout.slices if layout is not None else self.homes[index].slices  # type: ignore[union-attr]

    def _streamed_numel(self, index: int) -> int:
        layout = self._layouts.get(index)
        return layout.numel if layout is not None else self.homes[index].numel  # type: ignore[union-attr]

    def _relayout(self, withheld: frozenset[nn.Parameter]) -> None:
        """Lays the blocks' device buffers out anew for ``withheld`` and makes them again (placement unchanged)."""
        if withheld == self._withheld:
            return
        self._withheld = withheld
        self._layouts = {
            index: device_layout(home.slices, withheld)
            for index, home in enumerate(self.homes)
            if home is not None and any(piece.param in withheld for piece in home.slices)
        }
        self.replan(sorted(self.resident_indices), self.prefetch, self.activation_modes)

    def disarm_overlap(self) -> None:
        """After the optimizer step: the groups are whole again; the next micro-batch is not the last yet."""
        self.home_kind.last_micro_batch = False
        self.overlap.disarm()

    def _holds_current(self, slot: _Slot) -> bool:
        return slot.block is not None and slot.version == self._block_version[slot.block]

    def _release_busy(self) -> None:
        if self._busy is not None:
            self._busy.free = self.copier.mark_compute()
            self._busy = None

    # ------------------------------------------------------------------ accounting

    def host_bytes(self) -> int:
        """Host bytes the engine allocated: block homes, their transfer copies, gradient staging and, when pinning,
        the trunk's masters (all from the arena, page-rounded)."""
        return self.arena.allocated_bytes

    def pinned_bytes(self) -> int:
        """Page-locked host bytes (0 unless the compute device is CUDA)."""
        return self.arena.pinned_bytes

    def memory_report(self) -> dict[str, Any]:
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
            "peak_device_bytes": self.ledger.peak_bytes,
            "device_bytes": self.ledger.total_bytes,
            "peak_block_gradient_bytes": self.ledger.peaks["block_gradients"],
            "peak_trunk_gradient_bytes": self.ledger.peaks["trunk_gradients"],
            "peak_dequantized_weight_bytes": self.ledger.peaks["dequantized_weights"],
            "largest_block_bytes": self.largest_block_bytes(),
            "num_blocks": len(self.homes),
            "resident_blocks": len(self.resident_indices),
            "prefetch": self.prefetch,
            "trunk_device_bytes": self.trunk_device_bytes(),
            "host_bytes": self.host_bytes(),
            "shared_host_bytes": self.arena.shared_bytes,
            "pinned_host_bytes": self.pinned_bytes(),
            "peak_activation_bytes": self.ledger.peaks["activations"],
            "peak_outside_activation_bytes": self.ledger.peaks["outside_activations"],
            "host_activation_bytes": self.activations.peak_host_bytes,
            "peak_activation_bytes_per_block": [self.activations.block_peaks[i] for i in range(len(self.homes))],
            "overlapped_block_steps": self.overlap.blocks_stepped,
            "overlapped_trunk_steps": self.overlap.trunk_params_stepped,
            **self.home_kind.memory_report(),
        }

    def is_persistent(self, address: int) -> bool:
        """Whether a storage at ``address`` is one of the trunk's resident copies (model memory, not activations)."""
        return address in self._persistent

    def trunk_device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._trunk.values())

    def largest_block_bytes(self) -> int:
        """Bytes of the largest block's device copy (what streams of it: without withheld parameters)."""
        return max(
            (self._streamed_numel(i) * home.transfer_dtype.itemsize for i, home in enumerate(self.homes) if home),
            default=0,
        )
