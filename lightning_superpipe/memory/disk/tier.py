"""The disk tier's homes (``offload_device="disk"``): block masters stream from files, gradients are stepped or
spilled block by block, and nothing of the blocks' training state stays in host memory between uses.

Each streamed block's fp32 masters and optimizer state live in a :class:`~lightning_superpipe.memory.disk.DiskStore`
under ``offload_path``; the block parameters hold placeholders. Each block's home is a :class:`DiskHome`, which
knows a block's layout but holds no memory, and :class:`DiskTier`, their kind of home, does the rest:

* **Streaming**: a block's masters are read into a pool buffer (:meth:`DiskStore.prefetch_masters`), a few blocks
  beyond the device slots, and copied from there into the slot; with mixed precision they are cast on the fly into
  a host staging buffer of the transfer dtype first (no bf16 copy on disk: it would add 2 bytes per parameter of
  writes to every step). A read's buffer goes back to the pool once the copy no longer reads it (its event).
  :class:`~lightning_superpipe.memory.disk.reads.DiskReads` does this part.
* **Gradients**: when the overlapped step is armed (exact: no clipping, a per-parameter optimizer), each block is
  stepped through the store as soon as its gradients are complete (``step(blocks=[i], commit=False)``; gradients of
  earlier micro-batches spilled first are added on disk) and the step is committed after backward. Otherwise each
  block's gradients are spilled to its gradient file as they complete and dropped, and the blocks are stepped from
  disk after the closure, clipped by the global norm the spilled norms and the trunk's give, as
  ``torch.nn.utils.clip_grad_norm_`` computes it: at once, or pipelined (:meth:`DiskTier.launch_step`) on the
  optimizer thread while the next forward runs, which copies each block from the buffer its step left it in. The
  trunk's matrices (embeddings, head) are records of the store too, stepped from their files after backward
  (:mod:`.trunk`); its vectors (norms, biases) are stepped in memory.
  The user's ``zero_grad`` drops spilled gradients as it would drop ``.grad`` (:meth:`DiskTier.zero_grad`), which is
  what manual optimization needs; a step consumes them.
* **Several ranks**: each keeps its own store, stepped alike from the averaged gradients; under accumulation a
  block's spilled gradients come back into ``.grad`` for the last micro-batch's reduction
  (:meth:`DiskTier.before_reduce`).

The kind of home that checks and builds it is :class:`~lightning_superpipe.memory.disk.kind.DiskKind`; its hooks on
the user's ``zero_grad`` and ``state_dict`` are :mod:`.hooks`, its files beside each ``.ckpt`` :mod:`.checkpoints`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk import (
    ENTRY_ALIGNMENT,
    DiskStore,
    DiskTierError,
    MasterLease,
    checkpoints,
    limit_heap_retention,
)
from lightning_superpipe.memory.disk.clipping import clip_by_global_norm, scaler_found_inf, spilled_norms
from lightning_superpipe.memory.disk.frozen import FrozenFiles
from lightning_superpipe.memory.disk.home import DiskHome
from lightning_superpipe.memory.disk.hooks import BlockValuesHook, ZeroGradHook
from lightning_superpipe.memory.disk.reads import PIPELINED_STEP_READ_AHEAD, DiskReads
from lightning_superpipe.memory.disk.trunk import trunk_records
from lightning_superpipe.memory.fourbit.packed import packed_entries_left_out, split_packed
from lightning_superpipe.memory.home import Arena, Event, Homes, Hook, KindSteps, Link, StepHook

#: Blocks whose masters are read ahead beyond the device slots.
READ_AHEAD = 2


class InitialValues(Protocol):
    """The init calls still to run for the blocks' parameters (a ``DeferredInit`` of ``configure_model``)."""

    def initial_values(self, params: Mapping[str, nn.Parameter]) -> Any: ...


class DiskTier(Homes):
    """The disk tier's kind of home, the engine's side of a :class:`DiskStore`: reads ahead, copies in, steps or
    spills gradients, clips, commits.

    Args:
        store: The blocks' store (parameters parked).
        block_params: Each block's streamed parameters, in block order (as the store holds them).
        transfer_dtype: The dtype the weights travel in (``None``: the masters').
        state_names: The state-dict keys of the parameters in the store (tied aliases included).
        frozen: The blocks' frozen packed weights (a 4-bit base), written to their read-only files already.
        trunk: The trunk parameters the store holds, each a record after the blocks' (:mod:`.trunk`).
    """

    def __init__(
        self,
        store: DiskStore,
        block_params: Sequence[Sequence[nn.Parameter]],
        transfer_dtype: Optional[torch.dtype],
        state_names: set[str],
        frozen: Optional[FrozenFiles] = None,
        trunk: Sequence[nn.Parameter] = (),
    ) -> None:
        homes: list[Optional[DiskHome]] = []
        for index, params in enumerate(block_params):
            if not (params or (frozen is not None and frozen.numel(index))):
                homes.append(None)
                continue
            entries = store.master_entries(index)
            end = max((e.offset + _entry_aligned(e.nbytes) for e in entries), default=0)
            dtype = transfer_dtype or (params[0].dtype if params else torch.float32)
            start = end // (params[0].dtype if params else dtype).itemsize  # the masters' elements
            packed = frozen.slices(index, start) if frozen is not None else []
            homes.append(DiskHome(index, params, [e.offset for e in entries], end, dtype, self, packed))
        super().__init__(homes)
        self.frozen = frozen
        #: The state-dict keys of the frozen packed weights (in ``state_names`` too): a checkpoint holds none of them,
        #: nor their quantization state (bitsandbytes' ``<name>.absmax``, ...).
        self.frozen_names: set[str] = set()
        self.store = store
        self.state_names = state_names
        #: The trunk parameters in the store, and their records (after the blocks').
        self.trunk = trunk_records(len(block_params), trunk)
        #: Each parameter's record in the store (a block's, or a trunk parameter's) and position in it.
        self._place = {p: (i, j) for i, params in enumerate(store.params) for j, p in enumerate(params)}
        #: The device copies' reads (ahead, copied in, handed over by a pipelined step).
        self.reads = DiskReads(store)
        #: Manual optimization: any backward may be the last before a step (``self.clip_gradients`` needs norms).
        self.manual_optimization = False
        # Parameters whose gradients a step consumed (the tier keeps none after it) and no zero_grad has zeroed since.
        self._consumed: set[nn.Parameter] = set()
        self._stepping: set[nn.Parameter] = set()  # those of the blocks stepped during this backward
        self._mapped: dict[int, tuple[int, dict[str, Tensor]]] = {}  # block -> (step, masters mapped at that step)
        #: A checkpoint's state dict is being taken: the blocks' entries stay placeholders (the files go beside it).
        self.checkpointing = False
        self._grad_scale: Optional[Tensor] = None
        self._grad_unscale: Optional[Tensor] = None  # a gradient scaler's 1/scale, for the blocks' spilled gradients
        self._found_inf = False  # the scaler found a non-finite gradient: the step is skipped
        # This backward's steps are speculative: the 1/scale and the clip value they apply (speculate()).
        self._speculation: Optional[tuple[Optional[Tensor], Optional[float]]] = None
        self._grad_clip_value: Optional[float] = None
        self._completed: set[int] = set()  # blocks whose gradients of this backward were handed on
        self._launched: Optional[list[int]] = None  # the blocks of a pipelined step (launch_step)
        self._closed = False

    @classmethod
    def build(
        cls,
        path: Union[str, os.PathLike[str]],
        block_params: Sequence[Sequence[nn.Parameter]],
        names: Mapping[nn.Parameter, str],
        state_names: set[str],
        optimizer: Optional[Optimizer],
        transfer_dtype: Optional[torch.dtype],
        host_buffer_bytes: Optional[int],
        slots: int,
        resume: Optional[Path] = None,
        deferred: Optional[InitialValues] = None,
        frozen: Optional[FrozenFiles] = None,
        trunk: Sequence[nn.Parameter] = (),
    ) -> DiskTier:
        """Writes the blocks, and the ``trunk`` parameters each as a record of its own after them, into a fresh
        store under ``path`` (or restores a checkpoint's copy ``resume``) and parks their parameters. ``slots`` is how
        many device slots stream (the reads ahead go beyond them); ``deferred`` holds the init calls still to run for
        the blocks' parameters, each block's run into fresh tensors as it is written. The blocks' packed weights (a
        4-bit base) go to ``frozen``'s read-only files, not to the store (those of blocks ``frozen`` holds already are
        not written again).

        Raises:
            DiskTierError: The folder is too small, a file is missing, the bound is too small (names the bytes).
        """
        limit_heap_retention()  # else glibc keeps freed block-sized buffers and gradients resident
        if frozen is not None:  # the 4-bit base: once, into read-only files of its own (a step never writes them)
            frozen.write_missing(block_params)
        block_params = [split_packed(params)[0] for params in block_params]
        blocks = [{names[p]: p for p in params} for params in [*block_params, *([p] for p in trunk)]]
        options = dict(spill_grads=optimizer is not None, host_buffer_bytes=host_buffer_bytes,
                       read_ahead=slots + READ_AHEAD, min_buffers=2, sizing_blocks=len(block_params))
        if resume is not None:
            store = DiskStore.restore(resume, path, blocks, optimizer, **options)
        else:
            initial = None if deferred is None else (lambda index: deferred.initial_values(blocks[index]))
            store = DiskStore.create(path, blocks, optimizer, overwrite=True, initial=initial, **options)
        try:  # the store's pool holds two buffers at least (one read ahead, one for a spill or step)
            return cls(store, block_params, transfer_dtype, state_names, frozen, trunk)
        except BaseException:
            _unpark(store)
            store.close()
            raise

    #: Gradients leave host memory as each block completes (stepped through the store or spilled).
    keeps_gradients = False
    #: The blocks step through the store, from their spilled gradients; where exact, the overlapped step always pays.
    own_steps = ("the disk tier steps its blocks from what it spilled",
                 "the disk tier's other slot keeps the previous step")
    #: A speculative step writes each block's other slot; the manifest's commit is the decision.
    keeps_previous_step = True
    #: The blocks' gradients are spilled to disk, where the tier clips and unscales them.
    clips_gradients = True
    #: The homes read their files: the next pass makes the device copies, not a callback's hook.
    refreshes_for_callbacks = False

    def attach(self, link: Link, arena: Arena, overlap: StepHook, slots: int) -> None:
        """Connects the tier to its engine's copier, arena and overlapped step, whose per-block step goes through the
        store."""
        self.overlap = overlap
        overlap.step_block = self._step_block
        overlap.homed_trunk = frozenset(self.trunk)  # stepped from their files after backward, never during it
        overlap.waiting_blocks_limit = 1  # gradients live until stepped: one waits, one arrives (the host check's two)
        casts = [h for h in self.homes if h is not None and h.transfer_dtype != h.master_dtype]
        numel = max((h.master_numel for h in casts), default=0)  # the frozen weights travel as they are
        self.reads.attach(link, arena, numel, casts[0].transfer_dtype if casts else None, slots)
        if self.frozen is not None:
            self.frozen.attach(link, arena, slots)

    # ------------------------------------------------------------------ streaming

    def copy_in(self, dst: Tensor, index: int, after: Event, what: str) -> Event:
        """Copies block ``index``'s masters (cast to the transfer dtype) into the device buffer ``dst``, then its frozen
        packed weights, read from their file, after them (the link runs copies in order: the last event covers
        both)."""
        home = self.homes[index]
        assert home is not None
        masters, done = home.master_numel, after
        if masters:
            done = self.reads.copy_in(dst[:masters], index, masters, home.master_dtype, home.transfer_dtype, after,
                                      what)
        if self.frozen is None or home.numel == masters:
            return done
        return self.frozen.copy_in(dst[masters : home.numel], index, after, what)

    def read_ahead(self, indices: Iterable[int]) -> None:
        """Starts reading the frozen files (a 4-bit base) and the masters of the blocks expected next (nearest
        first), as far as the staging buffers and the pool allow."""
        indices = list(indices)
        if self.frozen is not None:
            self.frozen.read_ahead(indices)  # does not block: a thread of its own reads them
        self.reads.read_ahead(indices)

    def forget(self, index: int) -> None:
        """Drops a read ahead of block ``index``'s masters (its record changed; its frozen file never changes, so a
        read ahead of it stays)."""
        self.reads.forget([index])

    def check_withhold(self, params: frozenset[nn.Parameter]) -> None:
        """Refuses: each block is read from its files whole."""
        raise RuntimeError(
            "SuperpipeStrategy(offload_device='disk') streams each block from its files whole and cannot leave"
            " parameters out of it (e.g. experts paged by PagedMoECallback); evaluate with offload_device='cpu'."
        )

    def copies_done(self) -> None:
        """After backward, the copies done: the step reads and writes through the pool, which gets every buffer
        back."""
        self.reads.release_all()

    def before_step_wait(self) -> None:
        """Before the engine waits for a block's pipelined step: the buffers of finished copies go back to the pool,
        from which the step reads."""
        self.reads.release_copied()

    # ------------------------------------------------------------------ gradients

    def block_done(self, index: int) -> None:
        """Called once block ``index``'s gradients of this backward are all in ``.grad``: stepped through the store
        when the overlapped step is armed, else spilled to disk; either way they leave host memory."""
        assert self.overlap is not None
        self._completed.add(index)
        if self._consumed:  # empty in Lightning's loop, which zeroes before each backward
            late = [p for p in self.store.params[index] if p.grad is not None and p in self._consumed]
            if late:
                raise RuntimeError(self._not_zeroed(late[0], "backward added to its gradient"))
        if self.overlap.armed:  # stepped now: the gradients are consumed once the step is done
            # (what earlier micro-batches spilled of them, finish_step counts with every block's spilled gradients)
            self._stepping.update(p for p in self.store.params[index] if p.grad is not None)
            self.overlap.block_done(index)
        else:
            self._spill(index, norms=self.last_micro_batch or self.manual_optimization)

    def end_backward(self) -> None:
        """After backward, before the overlapped steps are awaited: a block whose gradients arrived but whose
        completion never came (a call whose output did not reach the loss) is handled now."""
        for index, params in enumerate(self.store.params[: len(self.homes)]):
            if index not in self._completed and any(p.grad is not None for p in params):
                self.block_done(index)
        self._completed = set()
        if self.last_micro_batch and not self.manual_optimization:
            self._spill_trunk()

    def _spill_trunk(self) -> None:
        """Spills the gradients of the trunk parameters in the files, with their norms, once no backward adds to them
        before the step (the last micro-batch's; in manual optimization, as clipping or the step begins): until then
        they accumulate in ``.grad``, where several ranks average them as the rest of the trunk."""
        for index in self.trunk.values():
            param = self.store.params[index][0]
            if param.grad is not None and param in self._consumed:
                raise RuntimeError(self._not_zeroed(param, "backward added to its gradient"))
            self._spill(index, norms=True)

    def holds_trunk(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is a trunk parameter whose master is in the tier's files."""
        return param in self.trunk

    def copy_trunk_in(self, dst: Tensor, param: nn.Parameter, after: Event, what: str) -> Event:
        """Copies the trunk parameter ``param``'s newest masters (stepped, or committed) into its device copy."""
        index = self.trunk[param]
        return self.reads.copy_in(dst.view(-1), index, param.numel(), param.dtype, param.dtype, after, what)

    def before_reduce(self, index: int) -> None:
        """Puts what earlier micro-batches spilled of block ``index``'s gradients back into ``.grad`` (one block in
        host memory at a time), before the last micro-batch's gradients are averaged across ranks: the reduction
        folds in the local sum, as DDP reduces the accumulated gradients, and the block is spilled afresh."""
        if self.store.spilled(index):
            for param, grad in zip(self.store.params[index], self.store.take_grads(index)):
                param.grad = grad

    def _spill(self, index: int, norms: bool) -> None:
        params = self.store.params[index]
        grads = [p.grad for p in params]
        if all(grad is None for grad in grads):
            return
        # Accumulation adds to what earlier micro-batches spilled, as autograd adds into ``.grad``.
        self.store.spill_grads(index, grads, accumulate=self.store.spilled(index), wait=False, norms=norms)
        for param in params:
            param.grad = None

    @contextmanager
    def placeholders_in_state_dict(self) -> Iterator[None]:
        """Around the state dict of a ``.ckpt``: its blocks' entries are dropped for the files linked beside it
        (:meth:`saving_checkpoint`), so they are not mapped (nor their slots handed over to readers)."""
        self.checkpointing = True
        try:
            yield
        finally:
            self.checkpointing = False

    def committed_master(self, param: nn.Parameter) -> Tensor:
        """``param``'s committed master (a block parameter), mapped from its block's file
        (:meth:`DiskStore.map_masters`, once per block and committed step)."""
        index = self._place[param][0]
        cached = self._mapped.get(index)
        if cached is None or cached[0] != self.store.step_count:
            cached = self._mapped[index] = (self.store.step_count, self.store.map_masters(index))
        return cached[1][self._name(param)]

    def _name(self, param: nn.Parameter) -> str:
        index, position = self._place[param]
        return self.store.names[index][position]

    def zero_grad(self, params: Iterable[nn.Parameter]) -> None:
        """The user zeroes these parameters' gradients (``optimizer.zero_grad()``, ``module.zero_grad()``: see
        :class:`~lightning_superpipe.memory.disk.hooks.ZeroGradHook`): what backward spilled of them is dropped,
        as ``.grad`` would be."""
        by_block: dict[int, set[int]] = {}
        for param in params:
            place = self._place.get(param)
            if place is not None:
                by_block.setdefault(place[0], set()).add(place[1])
                self._consumed.discard(param)
        for index, positions in by_block.items():
            if self.store.spilled(index):
                self.store.discard_grads(index, None if len(positions) == len(self.store.params[index]) else positions)

    def holds(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is a block parameter, its values in the tier's files."""
        return param in self._place

    def checked(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer step's closure, then (before anything is stepped) a refusal of a step over gradients the
        last step consumed, which the host tier would apply again (no ``zero_grad`` since: it names a parameter)."""

        def closure_then_check() -> Any:
            result = closure()
            self._spill_trunk()  # manual optimization: before the optimizer's own step (or a scaler) sees them
            if self._consumed:
                raise RuntimeError(self._not_zeroed(next(iter(self._consumed)), "the optimizer is stepping it again"))
            return result

        return closure_then_check

    def _not_zeroed(self, param: nn.Parameter, what: str) -> str:
        return (
            f"SuperpipeStrategy(offload_device='disk'): {what}, but no zero_grad came since the last optimizer step"
            f" consumed the gradient of {self._name(param)!r} (the tier keeps a block's gradients on disk only until"
            " the step that reads them). Call optimizer.zero_grad() between optimizer.step() and the next"
            " backward, as Lightning's loop does, or use offload_device='cpu' to keep gradients across steps."
        )

    def speculate(self, unscale: Optional[Tensor], clip_value: Optional[float]) -> None:
        """This backward's steps are speculative: each block's gradients are spilled (with their norms, for the global
        norm) before it is stepped from them, so that :meth:`finish_step` can step again from them if clipping or
        the scaler change the step."""
        self._speculation = (unscale, clip_value)

    def _step_block(self, optimizer: Optimizer, index: int, params: list[nn.Parameter]) -> None:
        """The overlapped step of one block, on the optimizer thread: through the store, written to the block's
        other slot, committed after backward."""
        speculation = self._speculation
        if speculation is not None:  # kept on disk for a redo, stepped from there
            self._spill(index, norms=True)
            unscale, clip_value = speculation
            self.store.step(optimizer, grads="disk", blocks=[index], commit=False, grad_scale=unscale,
                            grad_clip_value=clip_value)
        elif self.store.spilled(index):  # earlier micro-batches' gradients are on disk: add these there, step there
            self._spill(index, norms=False)
            self.store.step(optimizer, grads="disk", blocks=[index], commit=False)
        else:
            try:
                self.store.step(optimizer, grads="param", blocks=[index], commit=False)
            finally:
                for param in self.store.params[index]:
                    param.grad = None

    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float, None] = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        """Lightning's ``clip_gradients`` over spilled block gradients and the trunk's in memory.

        By norm (the default): the global norm, as ``torch.nn.utils.clip_grad_norm_`` computes it in parameter
        order, scales the trunk's gradients now and the blocks' in :meth:`finish_step` (``grad_scale``). By value:
        the trunk's gradients are clamped now, as ``torch.nn.utils.clip_grad_value_`` clamps them, and each block's
        as it is stepped from disk (element by element, so block by block is exact).
        """
        from lightning.pytorch.utilities.enums import GradClipAlgorithmType

        if clip_val is None or clip_val <= 0:
            return
        self._spill_trunk()  # manual optimization: counted, and clipped, with the blocks' spilled gradients
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            trunk = [p for group in optimizer.param_groups for p in group["params"]
                     if p not in self._place and p.grad is not None]
            if trunk:
                torch.nn.utils.clip_grad_value_(trunk, clip_val)
            self._grad_clip_value = float(clip_val)
            return
        scale = clip_by_global_norm(optimizer, self._place, self._block_norms(), self._grad_unscale, clip_val)
        if scale is not None:
            self._grad_scale = scale

    def _block_norms(self) -> dict[nn.Parameter, Optional[Tensor]]:
        """The 2-norm of each spilled gradient (of its sum over the micro-batches): the blocks' and the trunk's."""
        return spilled_norms(self.store)

    def unscale(self, scaler: Any, optimizer: Optimizer) -> None:
        """Completes ``GradScaler.unscale_(optimizer)``, which saw the gradients in memory only (see
        :func:`.clipping.scaler_found_inf`); the spilled gradients are unscaled as they are stepped from disk
        (1/scale, a power of two: bitwise what unscaling them in memory gives)."""
        self._grad_unscale = scaler._scale.double().reciprocal().float().cpu()  # as unscale_ computes it
        self._found_inf = scaler_found_inf(scaler, optimizer, self._block_norms())

    def launch_step(self, optimizer: Optimizer) -> Optional[KindSteps]:
        """The step is pipelined: the blocks' step from their spilled gradients, to run on the optimizer thread in
        block order, each block's new masters handed over to the next forward's copy (where every block with a
        home is stepped: the forward then reads none of them again), committed after the last block. ``None`` where
        :meth:`finish_step` decides after the optimizer's update (a skipped step, a speculation, blocks stepped
        during backward)."""
        if self._found_inf or self._speculation is not None or self.store.pending:
            return None
        scale, clip_value, _ = self._take_step_settings()
        spilled = self._spilled_blocks()
        trunk = [index for index in spilled if index >= len(self.homes)]
        spilled = [index for index in spilled if index < len(self.homes)]
        self._launched = spilled
        if trunk:  # now: the next forward starts with the embedding; the blocks' step commits it with them
            self.store.step(optimizer, grads="disk", blocks=trunk, commit=not spilled, grad_scale=scale,
                            grad_clip_value=clip_value)
        if not spilled:
            return None
        every_block = set(spilled) >= {i for i, home in enumerate(self.homes) if home is not None}

        def run(done: Callable[[int], None]) -> None:
            def stepped(index: int, lease: Optional[MasterLease]) -> None:
                if every_block:  # else the forward reads the others, which must leave it buffers
                    self.reads.hand_over(index, lease)
                elif lease is not None:
                    lease.release()
                done(index)

            try:
                self.store.step(optimizer, grads="disk", blocks=spilled, grad_scale=scale, grad_clip_value=clip_value,
                                read_ahead=PIPELINED_STEP_READ_AHEAD, stepped=stepped)
            except BaseException:
                self.reads.forget(spilled)  # the step is aborted: what it handed over was never committed
                raise

        return KindSteps(spilled, run)

    def finish_step(self, optimizer: Optimizer) -> list[int]:
        """After the optimizer's own step (the trunk): commits the blocks stepped during backward, and steps those
        whose gradients are on disk, or, where a gradient scaler skipped the step, drops their gradients. A
        speculative step is committed where clipping did not change a gradient (its factor exactly 1), else undone
        and stepped again from the spilled gradients. Returns the blocks stepped (or launched: :meth:`launch_step`)."""
        if self._launched is not None:
            launched, self._launched = self._launched, None
            return launched
        found_inf = self._found_inf
        scale, clip_value, speculation = self._take_step_settings()
        if found_inf:
            self.store.abort()
            self.store.discard_grads()
            self.speculation_outcome = "discarded" if speculation is not None else None
            return []
        stepped = self.store.pending
        if speculation is not None and stepped:
            if not self.gradients_changed:  # clipping's factor is exactly 1 (or None): it changes no bit
                self.speculation_outcome = "committed"
            else:
                self.store.abort()  # the other slots go; the spilled gradients stay, for the step below
                self.speculation_outcome, stepped = "redone", []
        elif stepped and clip_value is not None:  # the overlapped step is off while clipping: a clip from elsewhere
            self.store.abort()
            raise RuntimeError(
                f"SuperpipeStrategy(offload_device='disk'): blocks {stepped[:4]} were stepped during backward (the"
                " overlapped step), and the gradients were clipped by value afterwards. Clip through"
                " gradient_clip_val or configure_gradient_clipping, or pass overlap_optimizer=False."
            )
        # Those stepped during backward consumed their spilled gradients (their commit clears them): not again.
        spilled = [index for index in self._spilled_blocks() if index not in stepped]
        if spilled:  # one commit for every record of the step: those stepped during backward, the rest (the trunk's)
            self.store.step(optimizer, grads="disk", blocks=spilled, grad_scale=scale, grad_clip_value=clip_value)
        elif stepped:
            self.store.commit()
        return stepped + [index for index in spilled if index < len(self.homes)]

    def _spilled_blocks(self) -> list[int]:
        """The blocks whose gradients are in their files, in block order."""
        return [i for i in range(len(self.store.params)) if self.store.spilled(i)]

    def _take_step_settings(self) -> tuple[Optional[Tensor], Optional[float], Optional[Any]]:
        """What this optimizer step applies to the blocks' gradients, taken for it (the next step starts afresh):
        one factor (a scaler's ``1/scale`` times clipping's, as unscaling then clipping in memory gives), the clip
        value, and the speculation if any. Counts the gradients it consumes, and whether clipping or the scaler
        changed them (:attr:`gradients_changed`)."""
        unscale, self._grad_unscale = self._grad_unscale, None
        speculation, self._speculation = self._speculation, None
        self.speculation_outcome = None
        self._consumed |= self._stepping  # the host tier keeps them in .grad until zero_grad
        self._stepping = set()
        for index in range(len(self.store.params)):
            self._consumed.update(self.store.spilled_params(index))
        clip_scale, self._grad_scale = self._grad_scale, None
        self.gradients_changed = self._found_inf or (clip_scale is not None and not bool(clip_scale == 1))
        self._found_inf = False
        scale = clip_scale
        if unscale is not None:
            scale = unscale if scale is None else unscale * scale.to(unscale.device)
        clip_value, self._grad_clip_value = self._grad_clip_value, None
        return scale, clip_value, speculation

    # ------------------------------------------------------------------ checkpoints and reports

    def run_hooks(self, model: nn.Module, trainer: Any) -> list[Hook]:
        """``state_dict()`` during the run gives the files' values, ``load_state_dict()`` of block parameters is
        refused (:class:`~.hooks.BlockValuesHook`); while fitting, the tier learns whether the optimization is
        manual."""
        if trainer is not None:
            self.manual_optimization = not trainer.lightning_module.automatic_optimization
        hook = BlockValuesHook(self, model)
        hook.attach()
        return [hook]

    def zero_grad_hook(self, model: nn.Module, optimizers: Sequence[Any]) -> Optional[Hook]:
        """Where the tier spills gradients, the user's ``zero_grad`` calls drop them (:class:`~.hooks.ZeroGradHook`)."""
        return ZeroGradHook(self, model, optimizers) if self.store.spills else None

    @contextmanager
    def saving_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, os.PathLike[str]]) -> Iterator[None]:
        """The committed files are linked beside the ``.ckpt`` first, since a ``.ckpt`` implies them, and older
        copies go once the ``.ckpt`` is in place (:mod:`.checkpoints`)."""
        checkpoints.add_to_checkpoint(self.store, self.frozen_names, self.state_names, checkpoint, filepath)
        yield
        checkpoints.checkpoint_saved(checkpoint, filepath)

    @contextmanager
    def checkpoint_state_dict(self) -> Iterator[None]:
        """The blocks' entries are dropped for the files linked beside the ``.ckpt``
        (:meth:`placeholders_in_state_dict`), and those of a 4-bit base, in the tier's read-only files, are neither
        copied nor dequantized (the ``.ckpt`` holds none of them)."""
        with self.placeholders_in_state_dict(), packed_entries_left_out():
            yield

    def check_optimizer_state(self, optimizer: Any, state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> None:
        """Refuses a host tier's optimizer state for the blocks (:func:`.checkpoints.refuse_host_optimizer_state`)."""
        if checkpoints.DISK_KEY not in checkpoint:
            checkpoints.refuse_host_optimizer_state(self.holds, optimizer, state)

    def memory_report(self) -> dict[str, Any]:
        """``offload_device``, ``disk_bytes`` (the tier's files), ``disk_pool_host_bytes`` (the pool's buffers now)
        and ``peak_disk_pool_host_bytes``, ``disk_bytes_read`` and ``disk_bytes_written`` (over the run),
        ``disk_fused_reads`` (blocks a forward copied from the buffer their pipelined step left them in, not read
        again), ``disk_trunk_parameters`` and ``disk_trunk_bytes`` (the trunk parameters in the files, and their
        committed records' bytes), and ``disk_seconds``: where the tier's time went over the run
        (:class:`~lightning_superpipe.memory.disk.IoClock`: the disk busy, reads and writes in flight, ``fsync``, waits
        for pool buffers, for reads, for durable writes, and the step's arithmetic), and
        ``home_optimizer_state_bytes`` (the optimizer state in the files)."""
        folder = self.store.path
        files = [f for f in folder.iterdir() if f.name.startswith(("block", "grad"))] if folder.is_dir() else []
        return {
            "offload_device": "disk",
            "disk_bytes": sum(f.stat().st_size for f in files if f.exists()),
            "disk_pool_host_bytes": self.store.pool.allocated_bytes,
            "peak_disk_pool_host_bytes": self.store.pool.peak_bytes,
            "disk_bytes_read": self.store.bytes_read,
            "disk_bytes_written": self.store.bytes_written,
            "disk_fused_reads": self.reads.fused_reads,
            "disk_trunk_parameters": len(self.trunk),
            "disk_trunk_bytes": sum(self.store.records[index].file_bytes for index in self.trunk.values()),
            # The optimizer state of the parameters in the files, which the optimizer's own `state` does not hold.
            "home_optimizer_state_bytes": sum(
                entry.nbytes for record in self.store.records for entry in record.entries if entry.key is not None
            ),
            "disk_seconds": self.store.io_seconds(),
            **(self.frozen.memory_report() if self.frozen is not None else {}),
        }

    def close(self) -> None:
        """Puts the committed masters back into the parameters, mapped from their files (the model is whole again, as
        after a run on the host tier, without 4 bytes per parameter of host memory: measured, the strategy
        benchmark's teardown peaked at 1.69 GB reading them back, 0.86 GB of them masters) and closes the store;
        the files stay at the committed step."""
        if self._closed:
            return
        self._closed = True
        self._mapped = {}
        self.reads.release_all()
        self.store.pool.close()
        if self.frozen is not None:
            self.frozen.close()
        try:
            _unpark(self.store)
        finally:
            self.store.close()


def _entry_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the store's alignment of every tensor in a record."""
    return -(-nbytes // ENTRY_ALIGNMENT) * ENTRY_ALIGNMENT


def _unpark(store: DiskStore) -> None:
    """Points each block's parameters at its committed masters, mapped copy-on-write from its file
    (:meth:`DiskStore.map_masters`): the model is whole again without its bytes in host memory (pages come in as
    they are read, and may be reclaimed), and no later run writes those files. A block that cannot be mapped (a
    deleted file) keeps its placeholders, and the first such error is raised after the others are mapped."""
    store.abort()
    failure: Optional[DiskTierError] = None
    for index, params in enumerate(store.params):
        if not params:
            continue
        try:
            masters = store.map_masters(index)
        except DiskTierError as error:
            failure = failure or error
            continue
        for name, param in zip(store.names[index], params):
            param.data = masters[name]
    if failure is not None:
        raise failure
