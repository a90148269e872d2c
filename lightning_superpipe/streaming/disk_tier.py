"""The disk tier inside the engine (``offload_device="disk"``): block masters stream from files, gradients are
stepped or spilled block by block, and nothing of the blocks' training state stays in host memory between uses.

Each streamed block's fp32 masters and optimizer state live in a :class:`~lightning_superpipe.memory.disk.DiskStore`
under ``offload_path``; the block parameters hold placeholders. The engine's homes become :class:`DiskHome`\\ s, which
know a block's layout but hold no memory, and :class:`DiskTier` does the rest:

* **Streaming**: a block's masters are read into a pool buffer (:meth:`DiskStore.prefetch_masters`), a few blocks
  beyond the device slots, and copied from there into the slot; with mixed precision they are cast on the fly into
  a host staging buffer of the transfer dtype first (no bf16 copy on disk: it would add 2 bytes per parameter of
  writes to every step). A read's buffer goes back to the pool once the copy no longer reads it (its event).
* **Gradients**: when the overlapped step is armed (exact: no clipping, a per-parameter optimizer), each block is
  stepped through the store as soon as its gradients are complete (``step(blocks=[i], commit=False)``; gradients of
  earlier micro-batches spilled first are added on disk) and the step is committed after backward. Otherwise each
  block's gradients are spilled to its gradient file as they complete and dropped, and the blocks are stepped from
  disk after the closure, clipped by the global norm the spilled norms and the trunk's give, as
  ``torch.nn.utils.clip_grad_norm_`` computes it. The trunk (embeddings, head) is stepped in memory, as today.
  The user's ``zero_grad`` drops spilled gradients as it would drop ``.grad`` (:class:`ZeroGradHook`), which is what
  manual optimization needs; a step consumes them.
* **Checkpoints**: the ``.ckpt`` holds the store's manifest; the committed files are hard-linked (or copied) into a
  new subfolder of :func:`~lightning_superpipe.memory.disk.checkpoint_folder` beside it, named in the manifest, and
  a resume restores them from there. Older subfolders go once the new ``.ckpt`` is written, so a kill during a save
  leaves the previous ``.ckpt`` with its files. The live files never write into a copy: a slot hard-linked into a
  checkpoint is replaced by a new file before it is written again (:class:`~lightning_superpipe.memory.disk.DiskStore`).
* **Several ranks**: each keeps its own store in ``offload_path/rank-<rank>`` (:func:`rank_folder`), stepped alike
  from the averaged gradients; under accumulation a block's spilled gradients come back into ``.grad`` for the last
  micro-batch's reduction (:meth:`DiskTier.take_spilled`). Rank 0's files go beside the ``.ckpt``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.disk import (
    ENTRY_ALIGNMENT,
    DiskStore,
    DiskTierError,
    MasterLease,
    checkpoint_folder,
    limit_heap_retention,
    preflight,
    probe_state_size,
)
from lightning_superpipe.memory.host import ParamSlice
from lightning_superpipe.memory.pinned import HostArena, page_rounded
from lightning_superpipe.streaming.copier import Copier, Event
from lightning_superpipe.streaming.deferred_init import DeferredInit
from lightning_superpipe.streaming.overlap import (
    REGISTER_HINT,
    OverlappedStep,
    has_step_hooks,
    per_parameter_optimizer_names,
    updates_each_parameter_alone,
)

#: Where a checkpoint keeps the disk tier's manifest.
DISK_KEY = "superpipe_disk_tier"
#: The key, in a checkpoint's manifest, of the subfolder beside the ``.ckpt`` that holds that save's files.
SNAPSHOT_KEY = "snapshot"
#: Blocks whose masters are read ahead beyond the device slots.
READ_AHEAD = 2


def check_training(trainer: Any, optimizers: Sequence[Optimizer], call: str) -> None:
    """Refuses, before the tier is built, what it cannot train exactly.

    Raises:
        ValueError: With the user's call and what to do instead.
    """
    averaging = weight_averaging_callbacks(trainer)
    refusal = None
    if averaging:
        refusal = (
            f"the callback {type(averaging[0]).__name__} is not supported: it averages the parameters into a copy of"
            " the whole model in host memory and writes the average back into them for validation, while the disk"
            " tier keeps the blocks' values in its files (the parameters hold placeholders during the run). Remove"
            " it, or, to keep weight averaging, train"
        )
    elif len(optimizers) != 1:
        refusal = f"one optimizer is supported, configure_optimizers returned {len(optimizers)}"
    elif not updates_each_parameter_alone(optimizers[0]):
        name = type(optimizers[0]).__name__
        refusal = (
            f"{name} is not known to update each parameter on its own, and the tier steps block by block (supported:"
            f" {per_parameter_optimizer_names()}, and subclasses of them that override only __init__; "
            f"{REGISTER_HINT.format(name=name)})"
        )
    elif has_step_hooks(optimizers[0]):
        refusal = "the optimizer has step hooks, which would run once per block"
    elif getattr(trainer.precision_plugin, "scaler", None) is not None and getattr(
        optimizers[0], "_step_supports_amp_scaling", False
    ):
        refusal = (
            f"{type(optimizers[0]).__name__} unscales the gradients inside its step under a gradient scaler"
            " (16-mixed), which the tier runs block by block; pass fused=False, or use precision='bf16-mixed'"
        )
    if refusal is not None:
        ending = " with offload_device='cpu'." if averaging else ". Use offload_device='cpu' for this run."
        raise ValueError(f"{call}: {refusal}{ending}")
    readers = gradient_readers(trainer)
    if readers:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"{call}: {', '.join(readers)} will see `p.grad is None` for the blocks' parameters: the disk tier moves"
            " each block's gradients to its files (or steps the block) as soon as they are complete. Gradients of"
            " the parameters outside the blocks are there as usual, and `self.clip_gradients(...)` clips them all."
            " Use offload_device='cpu' if the hook needs every gradient."
        )


def weight_averaging_callbacks(trainer: Any) -> list[Any]:
    """The trainer's callbacks that keep an average of the weights and swap it into the parameters
    (``EMAWeightAveraging``, any ``WeightAveraging``, ``StochasticWeightAveraging``)."""
    from lightning.pytorch import callbacks

    # WeightAveraging (and EMAWeightAveraging) came with Lightning 2.6.
    names = ("WeightAveraging", "StochasticWeightAveraging")
    kinds = tuple(getattr(callbacks, name) for name in names if hasattr(callbacks, name))
    return [c for c in trainer.callbacks if isinstance(c, kinds)]


def gradient_readers(trainer: Any) -> list[str]:
    """The user's overrides of the hooks that run between backward and the step (``on_after_backward``,
    ``on_before_optimizer_step``, and ``configure_gradient_clipping``, where ``self.clip_gradients`` does clip the
    blocks' gradients), on the LightningModule and its callbacks, as ``"Class.hook"``."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = trainer.lightning_module
    hooks = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
    found = [f"{type(module).__name__}.{hook}" for hook in hooks if is_overridden(hook, module, LightningModule)]
    for callback in trainer.callbacks:
        found += [f"{type(callback).__name__}.{hook}" for hook in hooks[:2] if is_overridden(hook, callback, Callback)]
    return found


def _modules_holding(model: nn.Module, tier: DiskTier) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Each module of ``model`` that holds block parameters (its own or its submodules'), with them by name in it."""
    held = [(m, [(n, p) for n, p in m.named_parameters() if p in tier._place]) for m in model.modules()]
    return [(module, params) for module, params in held if params]


class ZeroGradHook:
    """Tells the tier when the user zeroes gradients, which it must know because a block's gradients are in its
    files, not in ``.grad``: wraps ``zero_grad`` of the optimizer, of Lightning's wrapper of it (which calls
    ``Optimizer.zero_grad`` on itself, not on the optimizer), and of every module holding block parameters (the
    LightningModule's ``self.zero_grad()``). Each wrapper tells :meth:`DiskTier.zero_grad` which block parameters
    it zeroes, then runs the original.
    """

    def __init__(self, tier: DiskTier, model: nn.Module, optimizers: Sequence[Any]) -> None:
        # An optimizer's groups are read at each call: BaseFinetuning adds the blocks' group mid-run.
        targets: list[tuple[Any, Callable[[], Iterable[nn.Parameter]]]] = [
            (o, lambda o=o: (p for group in o.param_groups for p in group["params"])) for o in optimizers
        ]
        for module, held in _modules_holding(model, tier):
            params = [p for _, p in held]
            targets.append((module, lambda params=params: params))
        self._tier = tier
        self._targets = targets
        self._wrappers: list[tuple[Any, Callable[..., Any]]] = []

    def attach(self) -> None:
        if self._wrappers:
            return
        for owner, params_of in self._targets:
            original = owner.zero_grad

            def zero_grad(*args: Any, original: Callable[..., Any] = original,
                          params_of: Callable[[], Iterable[nn.Parameter]] = params_of, **kwargs: Any) -> Any:
                self._tier.zero_grad(params_of())
                return original(*args, **kwargs)

            vars(owner)["zero_grad"] = zero_grad
            self._wrappers.append((owner, zero_grad))

    def detach(self) -> None:
        for owner, wrapper in self._wrappers:
            if vars(owner).get("zero_grad") is wrapper:
                del vars(owner)["zero_grad"]
        self._wrappers = []


class BlockValuesHook:
    """``state_dict()`` and ``load_state_dict()`` during the run, where the block parameters hold placeholders: a
    state dict gets each block's committed masters, mapped copy-on-write from its file (no host memory until read;
    the store writes that slot into a new file from then on, so the values stay those of the step the state dict
    was taken at), and a load that would write block parameters is refused before anything is loaded (the tier's
    files are the weights; loading into placeholders would fail deep inside torch, or be lost).

    Hooks every module holding block parameters: the state-dict hook on their owners, the load pre-hook on every
    module above them too, so that a load is refused at the module it was called on.
    """

    def __init__(self, tier: DiskTier, model: nn.Module) -> None:
        self._tier = tier
        self._owners = [(m, [(n, p) for n, p in m._parameters.items() if p in tier._place]) for m in model.modules()]
        self._owners = [(m, owned) for m, owned in self._owners if owned]
        self._holders = [(m, [n for n, _ in held]) for m, held in _modules_holding(model, tier)]
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        for module, owned in self._owners:
            self._handles.append(module.register_state_dict_post_hook(partial(self._committed, owned)))
        for module, names in self._holders:
            self._handles.append(module.register_load_state_dict_pre_hook(partial(self._refuse_load, names)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _committed(self, owned: list[tuple[str, nn.Parameter]], module: nn.Module, state_dict: dict[str, Any],
                   prefix: str, local_metadata: Any) -> None:
        if self._tier.checkpointing:
            return
        for name, param in owned:
            key = prefix + name
            if key in state_dict and state_dict[key] is not param:  # keep_vars=True asks for the parameter itself
                state_dict[key] = self._tier.committed_master(param)

    def _refuse_load(self, names: list[str], module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                     *args: Any) -> None:
        loaded = next((prefix + name for name in names if prefix + name in state_dict), None)
        if loaded is not None:
            raise RuntimeError(
                f"SuperpipeStrategy(offload_device='disk'): load_state_dict during the run would write {loaded!r}, a"
                " block parameter whose values are in the tier's files (the parameter holds a placeholder). Load"
                " the weights before fit (or resume with trainer.fit(..., ckpt_path=...)), or after it, or use"
                " offload_device='cpu'. Nothing was loaded."
            )


class DiskHome:
    """A block's home under the disk tier: the layout of :class:`~lightning_superpipe.memory.host.BlockHome` (one
    flat buffer, each parameter at its record offset), with the values in the store's files.

    Args:
        index: The block's index.
        params: Its streamed parameters (placeholders), in record order.
        offsets: Each master's byte offset in the record.
        end: The byte where the masters' region ends (aligned).
        transfer_dtype: The dtype the weights travel and compute in.
        tier: The tier that reads it.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        offsets: Sequence[int],
        end: int,
        transfer_dtype: torch.dtype,
        tier: DiskTier,
    ) -> None:
        dtypes = {param.dtype for param in params}
        if len(dtypes) != 1:
            raise TypeError(f"The parameters of one block must share a dtype to stream together, found {dtypes}.")
        self.index = index
        self.master_dtype = dtypes.pop()
        itemsize = self.master_dtype.itemsize
        self.slices = [ParamSlice(p, offset // itemsize, p.numel(), p.shape) for p, offset in zip(params, offsets)]
        self.numel = end // itemsize
        self.transfer_dtype = transfer_dtype
        self._tier = tier
        self._changed = False

    @property
    def trainable(self) -> list[ParamSlice]:
        return [piece for piece in self.slices if piece.param.requires_grad]

    @property
    def transfer_bytes(self) -> int:
        return self.numel * self.transfer_dtype.itemsize

    def mark_changed(self, param: nn.Parameter) -> None:
        """A step of the store changed the block (its slots and reads ahead are stale)."""
        self._changed = True

    def changed(self) -> list[ParamSlice]:
        return list(self.slices) if self._changed else []

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        """Nothing to copy on the host: the next read of the block reads the new record; reads ahead of the old
        one are dropped."""
        self._changed = False
        self._tier.forget(self.index)

    def release(self) -> None:
        """Nothing to give back: the parameters keep their class (the tier puts their values back on close)."""


class DiskTier:
    """The engine's side of a :class:`DiskStore`: reads ahead, copies in, steps or spills gradients, clips, commits.

    Args:
        store: The blocks' store (parameters parked).
        block_params: Each block's streamed parameters, in block order (as the store holds them).
        transfer_dtype: The dtype the weights travel in (``None``: the masters').
        state_names: The state-dict keys of the block parameters (tied aliases included).
    """

    def __init__(
        self,
        store: DiskStore,
        block_params: Sequence[Sequence[nn.Parameter]],
        transfer_dtype: Optional[torch.dtype],
        state_names: set[str],
    ) -> None:
        self.store = store
        self.state_names = state_names
        self.homes: list[Optional[DiskHome]] = []
        for index, params in enumerate(block_params):
            if not params:
                self.homes.append(None)
                continue
            entries = store.master_entries(index)
            end = max(e.offset + _entry_aligned(e.nbytes) for e in entries)
            self.homes.append(DiskHome(index, params, [e.offset for e in entries], end,
                                       transfer_dtype or params[0].dtype, self))
        #: Each block parameter's block and position in it (as the store lists them).
        self._place = {p: (i, j) for i, params in enumerate(block_params) for j, p in enumerate(params)}
        self._lock = threading.Lock()
        self._ahead: dict[int, MasterLease] = {}
        self._in_flight: deque[tuple[Event, MasterLease]] = deque()
        self._staging: list[list[Any]] = []  # [buffer, event of the copy reading it]
        self._next_staging = 0
        self._cap = max(1, store.pool.count - 1)  # one buffer stays free for a spill or a step on another thread
        self.copier: Optional[Copier] = None
        self.arena: Optional[HostArena] = None
        self.overlap: Optional[OverlappedStep] = None
        #: The micro-batch running is the last of an accumulation (its backward runs inside the optimizer step).
        self.last_micro_batch = False
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
        self._grad_clip_value: Optional[float] = None
        self._completed: set[int] = set()  # blocks whose gradients of this backward were handed on
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
        deferred: Optional[DeferredInit] = None,
    ) -> DiskTier:
        """Writes the blocks into a fresh store under ``path`` (or restores a checkpoint's copy ``resume``) and parks
        their parameters. ``slots`` is how many device slots stream (the reads ahead go beyond them); ``deferred``
        holds the init calls still to run for the blocks' parameters, each block's run into fresh tensors as it
        is written.

        Raises:
            DiskTierError: The folder is too small, a file is missing, the bound is too small (names the bytes).
        """
        limit_heap_retention()  # else glibc keeps freed block-sized buffers and gradients resident
        blocks = [{names[p]: p for p in params} for params in block_params]
        options = dict(spill_grads=optimizer is not None, host_buffer_bytes=host_buffer_bytes,
                       read_ahead=slots + READ_AHEAD)
        if resume is not None:
            store = DiskStore.restore(resume, path, blocks, optimizer, **options)
        else:
            initial = None if deferred is None else (lambda index: deferred.initial_values(blocks[index]))
            store = DiskStore.create(path, blocks, optimizer, overwrite=True, initial=initial, **options)
        try:
            if store.pool.count < 2:
                raise DiskTierError(
                    f"host_buffer_bytes={host_buffer_bytes} holds {store.pool.count} buffer of"
                    f" {store.pool.buffer_bytes} bytes; the tier needs at least two (one read ahead, one for a"
                    f" spill or step): give at least {2 * store.pool.buffer_bytes}, or leave it unset."
                )
            return cls(store, block_params, transfer_dtype, state_names)
        except BaseException:
            _unpark(store)
            store.close()
            raise

    def attach(self, copier: Copier, arena: HostArena, overlap: OverlappedStep, slots: int) -> None:
        """Connects the tier to its engine's copier, arena and overlapped step."""
        self.copier, self.arena, self.overlap = copier, arena, overlap
        overlap.step_block = self._step_block
        casts = [h for h in self.homes if h is not None and h.transfer_dtype != h.master_dtype]
        if casts:
            numel = max(h.numel for h in casts)
            # Each copy out of a staging buffer is waited for before the buffer is written again: one per slot,
            # and one more so that the cast of the next block never waits for the copy just issued.
            self._staging = [[arena.empty(numel, casts[0].transfer_dtype), None] for _ in range(slots + 1)]

    # ------------------------------------------------------------------ streaming

    def copy_in(self, dst: Tensor, index: int, after: Event, what: str) -> Event:
        """Copies block ``index``'s masters (cast to the transfer dtype) into the device buffer ``dst``."""
        assert self.copier is not None
        home = self.homes[index]
        assert home is not None
        with self._lock:
            lease = self._ahead.pop(index, None)
        if lease is None:
            self._make_room()
            lease = self.store.prefetch_masters(index)
        try:
            source = lease.flat(home.numel, home.master_dtype)
            if home.transfer_dtype == home.master_dtype:
                event = self.copier.to_device(dst, source, after, what)
                if event is None:
                    lease.release()
                else:  # the copy reads the pool buffer until its event
                    self._in_flight.append((event, lease))
                return event
            staging = self._staging[self._next_staging]
            self._next_staging = (self._next_staging + 1) % len(self._staging)
            self.copier.wait_on_host(staging[1])  # the copy that last read this buffer is done
            flat = staging[0][: home.numel]
            flat.copy_(source)  # the cast on the fly
            lease.release()
            staging[1] = self.copier.to_device(dst, flat, after, what)
            return staging[1]
        except BaseException:
            lease.release()
            raise

    def read_ahead(self, indices: Iterable[int]) -> None:
        """Starts reading the masters of the blocks expected next (nearest first), as far as the pool allows."""
        # Buffers whose copies are known done go back without waiting (CUDA events answer ``query``).
        while self._in_flight and getattr(self._in_flight[0][0], "query", lambda: False)():
            self._in_flight.popleft()[1].release()
        with self._lock:
            for index in indices:
                if index in self._ahead:
                    continue
                if len(self._ahead) + len(self._in_flight) >= self._cap:
                    return
                self._ahead[index] = self.store.prefetch_masters(index)

    def forget(self, index: int) -> None:
        """Drops a read ahead of block ``index`` (its record changed)."""
        with self._lock:
            lease = self._ahead.pop(index, None)
        if lease is not None:
            lease.release()

    def release_all(self) -> None:
        """Gives every buffer back to the pool (the copies are done: the caller synchronized)."""
        while self._in_flight:
            self._in_flight.popleft()[1].release()
        with self._lock:
            leases, self._ahead = list(self._ahead.values()), {}
        for lease in leases:
            lease.release()

    def _make_room(self) -> None:
        """Frees a buffer for a read the engine needs now: the oldest copy's, once done, else the furthest read
        ahead."""
        assert self.copier is not None
        while len(self._ahead) + len(self._in_flight) >= self._cap:
            if self._in_flight:
                event, lease = self._in_flight.popleft()
                self.copier.wait_on_host(event)
                lease.release()
                continue
            with self._lock:
                if not self._ahead:
                    return
                furthest = list(self._ahead)[-1]
                lease = self._ahead.pop(furthest)
            lease.release()

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

    def finish_backward(self) -> None:
        """After backward, before the overlapped steps are awaited: a block whose gradients arrived but whose
        completion never came (a call whose output did not reach the loss) is handled now."""
        for index, params in enumerate(self.store.params):
            if index not in self._completed and any(p.grad is not None for p in params):
                self.block_done(index)
        self._completed = set()

    def take_spilled(self, index: int) -> None:
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
        (:meth:`add_to_checkpoint`), so they are not mapped (nor their slots handed over to readers)."""
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
        :class:`ZeroGradHook`): what backward spilled of them is dropped, as ``.grad`` would be."""
        by_block: dict[int, set[int]] = {}
        for param in params:
            place = self._place.get(param)
            if place is not None:
                by_block.setdefault(place[0], set()).add(place[1])
                self._consumed.discard(param)
        for index, positions in by_block.items():
            if self.store.spilled(index):
                self.store.discard_grads(index, None if len(positions) == len(self.store.params[index]) else positions)

    def checked(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer step's closure, then (before anything is stepped) a refusal of a step over gradients the
        last step consumed, which the host tier would apply again (no ``zero_grad`` since: it names a parameter)."""

        def closure_then_check() -> Any:
            result = closure()
            if self._consumed:
                raise RuntimeError(self._not_zeroed(next(iter(self._consumed)), "the optimizer is stepping it again"))
            return result

        return closure_then_check

    def _not_zeroed(self, param: nn.Parameter, what: str) -> str:
        return (
            f"SuperpipeStrategy(offload_device='disk'): {what}, but no zero_grad came since the last optimizer step"
            f" consumed the gradient of {self._name(param)!r} (the tier keeps a block's gradients on disk only until the step"
            " that reads them). Call optimizer.zero_grad() between optimizer.step() and the next backward, as"
            " Lightning's loop does, or use offload_device='cpu' to keep gradients across steps."
        )

    def _step_block(self, optimizer: Optimizer, index: int, params: list[nn.Parameter]) -> None:
        """The overlapped step of one block, on the optimizer thread: through the store, written to the block's
        other slot, committed after backward."""
        if self.store.spilled(index):  # earlier micro-batches' gradients are on disk: add these there, step from it
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
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            trunk = [p for group in optimizer.param_groups for p in group["params"]
                     if p not in self._place and p.grad is not None]
            if trunk:
                torch.nn.utils.clip_grad_value_(trunk, clip_val)
            self._grad_clip_value = float(clip_val)
            return
        block_norms = self._block_norms()
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        trunk_grads: list[Tensor] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param in self._place:
                    norm = block_norms.get(param)
                    if norm is not None:
                        if self._grad_unscale is not None:  # a power of two: the unscaled gradient's norm exactly
                            norm = norm * self._grad_unscale
                        groups.setdefault((torch.device("cpu"), param.dtype), []).append(norm)
                elif param.grad is not None:
                    trunk_grads.append(param.grad)
                    groups.setdefault((param.grad.device, param.grad.dtype), []).append(
                        torch.linalg.vector_norm(param.grad, 2.0)
                    )
        norms = [norm for group_norms in groups.values() for norm in group_norms]
        if not norms:
            return
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([norm.to(first) for norm in norms]), 2.0)
        scale = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for grad in trunk_grads:
            grad.mul_(scale.to(grad.device))
        self._grad_scale = scale

    def _block_norms(self) -> dict[nn.Parameter, Optional[Tensor]]:
        """The 2-norm of each spilled block gradient (of its sum over the micro-batches)."""
        for index, params in enumerate(self.store.params):
            if self.store.spilled(index) and not self.store.has_norms(index):
                # Spilled in an earlier micro-batch only: read back once for the norms.
                self.store.spill_grads(index, [None] * len(params), accumulate=True, norms=True)
        norms: dict[nn.Parameter, Optional[Tensor]] = {}
        for index, params in enumerate(self.store.params):
            if self.store.spilled(index):
                norms.update(zip(params, self.store.grad_norms(index)))
        return norms

    def unscale(self, scaler: Any, optimizer: Optimizer) -> None:
        """Completes ``GradScaler.unscale_(optimizer)``, which saw the trunk's gradients only: a spilled block
        gradient whose norm is not finite counts as the scaler's non-finite gradient (so ``scaler.step`` skips the
        step and ``scaler.update`` lowers the scale, as for one in memory), and the blocks' gradients are unscaled
        as they are stepped from disk (1/scale, a power of two: bitwise what unscaling them in memory gives).
        The scaler's per-optimizer state has held ``found_inf_per_device`` since torch 1.6."""
        found = any(n is not None and not bool(torch.isfinite(n)) for n in self._block_norms().values())
        self._grad_unscale = scaler._scale.double().reciprocal().float().cpu()  # as unscale_ computes it
        per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        cpu = torch.device("cpu")
        if cpu not in per_device:  # also when every gradient is a block's: scaler.step needs one check at least
            per_device[cpu] = torch.zeros(1)
        if found:
            per_device[cpu].fill_(1.0)
        self._found_inf = any(bool(flag.item()) for flag in per_device.values())

    def finish_step(self, optimizer: Optimizer) -> list[int]:
        """After the optimizer's own step (the trunk): commits the blocks stepped during backward, and steps those
        whose gradients are on disk, or, where a gradient scaler skipped the step, drops their gradients. Returns
        the blocks stepped."""
        unscale, self._grad_unscale = self._grad_unscale, None
        self._consumed |= self._stepping  # the host tier keeps them in .grad until zero_grad
        self._stepping = set()
        for index in range(len(self.store.params)):
            self._consumed.update(self.store.spilled_params(index))
        if self._found_inf:
            self._found_inf, self._grad_scale, self._grad_clip_value = False, None, None
            self.store.abort()
            self.store.discard_grads()
            return []
        stepped = self.store.pending
        scale, self._grad_scale = self._grad_scale, None
        if unscale is not None:  # one product of two factors, as unscaling then clipping in memory gives
            scale = unscale if scale is None else unscale * scale.to(unscale.device)
        clip_value, self._grad_clip_value = self._grad_clip_value, None
        if stepped:
            if clip_value is not None:  # the overlapped step is off while clipping; this is a clip from elsewhere
                self.store.abort()
                raise RuntimeError(
                    f"SuperpipeStrategy(offload_device='disk'): blocks {stepped[:4]} were stepped during backward (the"
                    " overlapped step), and the gradients were clipped by value afterwards. Clip through"
                    " gradient_clip_val or configure_gradient_clipping, or pass overlap_optimizer=False."
                )
            self.store.commit()
        spilled = [i for i in range(len(self.store.params)) if self.store.spilled(i)]
        if spilled:
            self.store.step(optimizer, grads="disk", blocks=spilled, grad_scale=scale, grad_clip_value=clip_value)
        return stepped + spilled

    # ------------------------------------------------------------------ checkpoints and reports

    def check_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """Refuses optimizer state for block parameters from a checkpoint of the host tier: loaded into the
        optimizer it would be dropped at the first step, which reads the blocks' state from the files.

        Raises:
            MisconfigurationException: Saying how to resume such a checkpoint.
        """
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(int(i) < len(params) and params[int(i)] in self._place for i in state.get("state", {})):
            raise MisconfigurationException(
                "This checkpoint was written with offload_device='cpu': it holds the blocks' optimizer state, which the"
                " disk tier keeps in its files and cannot take from a .ckpt yet. Resume it with offload_device='cpu',"
                " or load only its weights (e.g. `model.load_state_dict(ckpt['state_dict'])`) and start a new run."
            )

    def add_to_checkpoint(self, checkpoint: dict[str, Any], ckpt_path: Union[str, os.PathLike[str]]) -> None:
        """Hard-links (or copies) the committed files into a new subfolder of the folder beside ``ckpt_path`` and
        puts the manifest, with the subfolder's name, in ``checkpoint``, whose state dict loses the block parameters'
        placeholders (their values are in the files). Nothing of the blocks is materialized in memory.

        The subfolder is new for every save, so a ``.ckpt`` saved again under the same name (``last.ckpt``) keeps
        its previous copy until the new ``.ckpt`` is written: a kill while the files are linked, or before the
        ``.ckpt`` is renamed into place, leaves the old ``.ckpt`` with the files it names. :meth:`checkpoint_saved`
        removes the older subfolders once the new ``.ckpt`` is on disk.
        """
        folder = checkpoint_folder(ckpt_path)
        name = f"step-{self.store.step_count:09d}-{time.time_ns():x}"
        manifest = self.store.snapshot(folder / name)
        checkpoint[DISK_KEY] = {**manifest, SNAPSHOT_KEY: name}
        state = checkpoint.get("state_dict")
        if state is not None:
            checkpoint["state_dict"] = type(state)((k, v) for k, v in state.items() if k not in self.state_names)

    def checkpoint_saved(self, checkpoint: Mapping[str, Any], ckpt_path: Union[str, os.PathLike[str]]) -> None:
        """After the ``.ckpt`` is written: removes the other subfolders beside it (older saves under the same name,
        or what a killed save left); the live files are untouched (hard links)."""
        name = checkpoint.get(DISK_KEY, {}).get(SNAPSHOT_KEY)
        folder = checkpoint_folder(ckpt_path)
        if name is None or not folder.is_dir() or folder.is_symlink():
            return
        for entry in folder.iterdir():
            if entry.name != name and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.name != name and entry.name.startswith(("block", "manifest")):
                entry.unlink()  # the files of a single-folder copy (before snapshots had subfolders)

    def memory_report(self) -> dict[str, Any]:
        """``offload_device``, ``disk_bytes`` (the tier's files), ``disk_pool_host_bytes`` (the pool's buffers now)
        and ``peak_disk_pool_host_bytes``, ``disk_bytes_read`` and ``disk_bytes_written`` (over the run), and
        ``disk_seconds``: where the tier's time went over the run (:class:`~lightning_superpipe.memory.disk.IoClock`:
        the disk busy, reads and writes in flight, ``fsync``, waits for pool buffers, for reads, for durable writes,
        and the step's arithmetic)."""
        folder = self.store.path
        files = [f for f in folder.iterdir() if f.name.startswith(("block", "grad"))] if folder.is_dir() else []
        return {
            "offload_device": "disk",
            "disk_bytes": sum(f.stat().st_size for f in files if f.exists()),
            "disk_pool_host_bytes": self.store.pool.allocated_bytes,
            "peak_disk_pool_host_bytes": self.store.pool.peak_bytes,
            "disk_bytes_read": self.store.bytes_read,
            "disk_bytes_written": self.store.bytes_written,
            "disk_seconds": self.store.io_seconds(),
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
        self.release_all()
        self.store.pool.close()
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


def disk_host_bytes(
    block_params: Sequence[Sequence[nn.Parameter]], optimizer: Optional[Optimizer], slots: int,
    host_buffer_bytes: Optional[int],
) -> int:
    """Host bytes the tier will allocate: its pool (``host_buffer_bytes`` or its default) and the gradients of two
    blocks at once (one arriving, one being spilled or stepped)."""
    size = probe_state_size(optimizer)
    largest = max((sum(p.numel() for p in params) for params in block_params), default=0)
    record = page_rounded(int(largest * (4 + size.per_element)) + (4 * largest if optimizer is not None else 0))
    pool = host_buffer_bytes if host_buffer_bytes is not None else record * (slots + READ_AHEAD + 2)
    return pool + (2 * 4 * largest if optimizer is not None else 0)


def rank_folder(
    offload_path: Union[str, os.PathLike[str]], rank: int, local_ranks: int,
    block_params: Sequence[Sequence[nn.Parameter]], optimizer: Optional[Optimizer], fresh: bool,
) -> Path:
    """The folder of rank ``rank``'s files on several ranks, ``offload_path/rank-<rank>`` (created): each rank keeps
    its own copy of the blocks' training state, stepped alike from the averaged gradients, as each DDP rank keeps its
    own optimizer. A ``fresh`` tier checks first that the disk holds the copies of the node's ``local_ranks`` ranks
    (which share ``offload_path``); call it on every rank before any writes.

    Raises:
        DiskTierError: The folder cannot be made, or the disk is too small for the node's copies.
    """
    folder = Path(offload_path) / f"rank-{rank}"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as error:
        raise DiskTierError(f"Could not create the folder {str(folder)!r} for rank {rank}'s files: {error}.") from error
    if fresh:
        needed = DiskStore.bytes_needed(block_params, optimizer, spill_grads=optimizer is not None)
        preflight(folder, local_ranks * needed,
                  f"{local_ranks} ranks on this node, each with two slots of every block's record and its gradients")
    return folder


def resume_folder(ckpt_path: Union[str, os.PathLike[str]], manifest: Mapping[str, Any], offload_device: str) -> Path:
    """The folder of the disk tier's files of the checkpoint ``ckpt_path`` (through a symlinked ``last.ckpt`` too).

    Raises:
        MisconfigurationException: The strategy does not use the disk tier.
        DiskTierError: The folder is missing or holds another step than the checkpoint's.
    """
    if offload_device != "disk":
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        raise MisconfigurationException(
            f"The checkpoint {os.fspath(ckpt_path)!r} was written by SuperpipeStrategy(offload_device='disk'): its"
            " blocks are in the files beside it. Resume it with offload_device='disk' (and an offload_path)."
        )
    folder = checkpoint_folder(ckpt_path)
    if not folder.is_dir():
        folder = checkpoint_folder(os.path.realpath(ckpt_path))
    name = manifest.get(SNAPSHOT_KEY)
    if name is not None:
        folder = folder / name
    if not (folder / "manifest.json").is_file():
        raise DiskTierError(
            f"The checkpoint {os.fspath(ckpt_path)!r} was written by the disk tier, whose files belong in"
            f" {str(checkpoint_folder(ckpt_path))!r}{'' if name is None else f' (its subfolder {name!r})'}, which is"
            " missing or incomplete. Copy that folder beside the .ckpt (it travels with it)."
        )
    found = json.loads((folder / "manifest.json").read_text())
    if found.get("step") != manifest.get("step") or found.get("names") != manifest.get("names"):
        raise DiskTierError(
            f"{str(folder)!r} holds the disk tier at step {found.get('step')}, but the checkpoint"
            f" {os.fspath(ckpt_path)!r} was saved at step {manifest.get('step')}: they do not belong together."
        )
    return folder


def remove_snapshot(ckpt_path: Union[str, os.PathLike[str]]) -> None:
    """Removes the disk tier's folder of a checkpoint being removed (hard links: the live files stay)."""
    folder = checkpoint_folder(ckpt_path)
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)


def load_state_dict(module: nn.Module, checkpoint: Mapping[str, Any], strict: bool, streaming: bool) -> None:
    """Loads a disk-tier checkpoint's state dict, which lacks the block parameters (they are restored from the
    checkpoint's folder when streaming starts).

    Raises:
        RuntimeError: The tier is already streaming (a checkpoint is loaded before ``fit`` starts streaming), or, with
            ``strict``, keys other than the blocks' are missing or unexpected.
    """
    if streaming:
        raise RuntimeError(
            "A disk-tier checkpoint can be loaded only when a run starts (`Trainer.fit(ckpt_path=...)`), not while the"
            " blocks stream."
        )
    blocks = {name for block in checkpoint[DISK_KEY]["names"] for name in block}
    missing, unexpected = module.load_state_dict(checkpoint["state_dict"], strict=False)
    missing = [key for key in missing if key not in blocks]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the state dict of {type(module).__name__}: missing keys {missing[:5]}, unexpected"
            f" keys {list(unexpected)[:5]} (the blocks' parameters come from the disk tier's files)."
        )
