"""The disk tier's store: :class:`DiskStore` ties the parts of :mod:`lightning_superpipe.memory.disk` together:
its construction over a folder (new, continued or restored from a checkpoint's copy), reading blocks back,
gradient spills (:mod:`.spills`), the optimizer step (:mod:`.step`), checkpoints and the safetensors export."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

# Commits and links through their module: the kill -9 tests interpose on them there.
from lightning_superpipe.memory.disk import folder as disk_folder
from lightning_superpipe.memory.disk.buffers import _aligned_buffer
from lightning_superpipe.memory.disk.core import Sizing, StoreOptionArgs, StoreOptions, _park
from lightning_superpipe.memory.disk.errors import DiskTierError
from lightning_superpipe.memory.disk.export import write_safetensors
from lightning_superpipe.memory.disk.file_io import _check_length, _Files, _fsync_dir, _open
from lightning_superpipe.memory.disk.folder import (
    FORMAT,
    MANIFEST,
    VERSION,
    _check_manifest,
    _grad_name,
    _read_manifest,
    _slot_name,
)
from lightning_superpipe.memory.disk.lease import MasterLease
from lightning_superpipe.memory.disk.records import (
    Entry,
    Record,
    _decode_value,
    _layout,
    _master_bytes,
    _own_state,
    _tensor_of,
    probe_state_size,
)
from lightning_superpipe.memory.disk.space import PathLike, preflight, supports_direct_io
from lightning_superpipe.memory.disk.spills import GradientSpills
from lightning_superpipe.memory.disk.step import BlockSteps
from lightning_superpipe.memory.pinned import page_rounded

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11 on; only checkers read it here


#: Bytes of a block's record that writing step zero holds at a time.
STEP_ZERO_WINDOW = 64 << 20


@dataclass
class BlockState:
    """A copy of one block's masters and optimizer state, keyed by parameter name."""

    masters: dict[str, Tensor]
    state: dict[str, dict[str, Any]]


class DiskStore(GradientSpills, BlockSteps):
    """The disk tier of a set of blocks: their masters and optimizer state in files under one folder.

    Build it with :meth:`create` (writes the blocks' current values as step 0), :meth:`open` (continues the
    committed step of a folder) or :meth:`restore` (continues from a checkpoint's copy), each taking the keyword
    arguments of :class:`~lightning_superpipe.memory.disk.core.StoreOptions` (``spill_grads``, ``host_buffer_bytes``,
    ``read_ahead``, ``io_workers``, ``chunk_bytes``, ``direct_io``, ``pin``, ``separate_io_kinds``). Afterwards the
    block parameters hold placeholders of their shape and dtype with no memory; values are read with
    :meth:`prefetch_masters` and :meth:`read_block`, and changed only by :meth:`step`.

    Args:
        path: The folder.
        blocks: Each block's parameters by name (names unique across blocks).
        manifest: The committed manifest.
        optimizer: The optimizer that will step the blocks (sizes the buffers); may be ``None`` for inference.
        options: How the store holds the blocks (:class:`~lightning_superpipe.memory.disk.core.StoreOptions`).
    """

    def __init__(self, path: Path, blocks: Sequence[Mapping[str, nn.Parameter]], manifest: Mapping[str, Any],
                 optimizer: Optional[Optimizer], options: StoreOptions) -> None:
        super().__init__(path, blocks, manifest, optimizer, options)
        for block in self.params:
            for param in block:
                _park(param)

    # -- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        *,
        overwrite: bool = False,
        initial: Optional[Callable[[int], Mapping[str, Tensor]]] = None,
        **options: Unpack[StoreOptionArgs],
    ) -> DiskStore:
        """Checks the folder, writes every block's current masters (and any optimizer state it already has) as
        step 0, commits, and moves the values out of memory. See the class for the other arguments.

        Args:
            initial: Block ``i``'s initial values by name, called once per block and dropped once written, for a
                model that does not fit in host memory (e.g. read from a checkpoint's shards): its parameters may
                then be placeholders of the right shape and dtype (``torch.zeros(()).expand(shape)``).

        Raises:
            DiskTierError: The folder is missing or unwritable, or already holds a tier (without ``overwrite``).
            DiskSpaceError: It lacks the space two slots of every block (and gradients) need.
        """
        folder, settings = Path(path), StoreOptions(**options)
        _check_blocks(blocks)
        needed = cls.bytes_needed([list(b.values()) for b in blocks], optimizer, settings.spill_grads)
        what = "two slots of every block's masters and optimizer state"
        preflight(folder, needed, what + (", and its gradients" if settings.spill_grads else ""))
        if (folder / MANIFEST).exists():
            if not overwrite:
                raise DiskTierError(
                    f"{str(folder)!r} already holds a disk tier (committed step"
                    f" {_read_manifest(folder)['step']}). Continue it with DiskStore.open, or pass overwrite=True"
                    " to start over."
                )
            (folder / MANIFEST).unlink()
            _fsync_dir(folder)
        states = [[_own_state(optimizer, p) for p in b.values()] for b in blocks]
        manifest = {"format": FORMAT, "version": VERSION, "step": 0, "names": [list(b) for b in blocks],
                    "blocks": [Record(1, *_layout(list(b.values()), s)).to_json() for b, s in zip(blocks, states)]}
        _sizing(blocks, manifest, optimizer, settings).pool_shape(settings)  # a bound too small: before any write
        _write_step_zero(folder, blocks, states, manifest, optimizer, initial, settings)
        return cls(folder, blocks, manifest, optimizer, settings)

    @staticmethod
    def pool_for(
        block_params: Sequence[Sequence[nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        **options: Unpack[StoreOptionArgs],
    ) -> tuple[int, int, int]:
        """The size and number of the pool buffers a new store of blocks of these parameters would hold, and the
        least ``host_buffer_bytes`` it works with, allocating nothing (see
        :class:`~lightning_superpipe.memory.disk.core.StoreOptions`).

        Raises:
            DiskTierError: ``host_buffer_bytes`` is below that least (the message names it).
        """
        settings = StoreOptions(**options)
        records = [Record(1, *_layout(list(params), [_own_state(optimizer, p) for p in params]))
                   for params in block_params]
        sizing = Sizing(block_params, records, optimizer, settings)
        return (*sizing.pool_shape(settings), sizing.least_pool_bytes(settings))

    @staticmethod
    def bytes_needed(
        block_params: Sequence[Sequence[nn.Parameter]], optimizer: Optional[Optimizer] = None, spill_grads: bool = False
    ) -> int:
        """The bytes of a new store's files for blocks of these parameters: two slots of every block's record
        (masters and ``optimizer``'s state) and, with ``spill_grads``, its gradient file."""
        size = probe_state_size(optimizer)
        return sum(
            2 * page_rounded(_master_bytes(params) + sum(size.record_bytes(p.numel()) for p in params))
            + (page_rounded(_master_bytes(params)) if spill_grads else 0)
            for params in block_params
        )

    @classmethod
    def open(
        cls,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        **options: Unpack[StoreOptionArgs],
    ) -> DiskStore:
        """Continues the committed step of ``path``: checks that its manifest matches ``blocks`` (names, shapes,
        dtypes) and that every committed file is there at its full size. See the class for the arguments.

        Raises:
            DiskTierError: No committed manifest, a mismatch with ``blocks``, or a missing or truncated file.
        """
        folder, settings = Path(path), StoreOptions(**options)
        _check_blocks(blocks)
        manifest = _read_manifest(folder)
        _check_manifest(folder, manifest, blocks)
        size = probe_state_size(optimizer)
        # The other slots are written by the next step: check that they fit beside the committed ones.
        needed = 0
        for index, (block, data) in enumerate(zip(blocks, manifest["blocks"])):
            record = Record.from_json(data)
            estimate = page_rounded(
                _master_bytes(list(block.values())) + sum(size.record_bytes(p.numel()) for p in block.values())
            )
            other = folder / _slot_name(index, 1 - record.slot)
            needed += max(0, max(estimate, record.file_bytes) - (other.stat().st_size if other.exists() else 0))
            if settings.spill_grads and not (folder / _grad_name(index)).exists():
                needed += page_rounded(_master_bytes(list(block.values())))
        preflight(folder, needed, "the slots the next step writes")
        _sizing(blocks, manifest, optimizer, settings).pool_shape(settings)
        return cls(folder, blocks, manifest, optimizer, settings)

    @classmethod
    def restore(
        cls,
        snapshot: PathLike,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        **options: Unpack[StoreOptionArgs],
    ) -> DiskStore:
        """Continues from a checkpoint's copy (:meth:`snapshot`): hard-links (or, across file systems, copies) its
        files into ``path``, replacing the tier there, commits its manifest and opens it. The copy is never written:
        later steps write new files in ``path``. ``options`` are those of :meth:`open`."""
        source, folder = Path(snapshot), Path(path)
        manifest = _read_manifest(source)
        _check_manifest(source, manifest, blocks)
        settings = StoreOptions(**options)
        _sizing(blocks, manifest, optimizer, settings).pool_shape(settings)  # before the live folder changes
        preflight(folder, 0)
        if source.resolve() != folder.resolve():
            if (folder / MANIFEST).exists():
                (folder / MANIFEST).unlink()  # uncommit first: a kill mid-restore must not leave a mix
                _fsync_dir(folder)
            for index, data in enumerate(manifest["blocks"]):
                for slot in (0, 1):
                    (folder / _slot_name(index, slot)).unlink(missing_ok=True)
                name = _slot_name(index, int(data["slot"]))
                disk_folder._link_or_copy(source / name, folder / name)
            disk_folder._commit(folder, manifest)
        return cls.open(folder, blocks, optimizer, **options)

    def close(self) -> None:
        """Waits for I/O in flight and frees the buffers. The files stay at the committed step (blocks stepped and not
        committed are discarded): :meth:`open` continues them."""
        self.abort()
        for future in self._spill_writes.values():
            future.exception()
        self._spill_writes = {}
        self._reader.shutdown(wait=True)
        self.files.close()
        self.pool.close()

    def io_seconds(self) -> dict[str, float]:
        """Where the tier's time went since it was built, in seconds (:class:`IoClock`'s counters)."""
        return self.clock.seconds()

    # -- reading --------------------------------------------------------------------------------------------------

    def prefetch_masters(self, index: int, chunk: int = 0) -> MasterLease:
        """Starts reading block ``index``'s masters into a pool buffer (what a forward streams to the device): all of
        them, or where they exceed a buffer, the byte range ``chunk`` of :meth:`master_chunks` (its
        :meth:`MasterLease.flat` is that range of the flat masters)."""
        record = self._current(index)
        chunks = self._master_chunks(index)
        start, end = chunks[chunk]
        buffer = self.pool.acquire(end - start)
        future = self.files.read(self._slot_path(index, record.slot), buffer, end - start, offset=start)
        # A lease of the whole masters region views each of them by name; one of a range, only the flat bytes.
        return MasterLease(self.pool, buffer, future, record.masters() if len(chunks) == 1 else [], self.clock)

    def master_chunks(self, index: int) -> list[tuple[int, int]]:
        """Block ``index``'s masters region as byte ranges each a pool buffer holds (one range where it holds them
        all): what :meth:`prefetch_masters` reads as ``chunk``."""
        return self._master_chunks(index)

    def map_masters(self, index: int) -> dict[str, Tensor]:
        """Block ``index``'s committed masters by name, as copy-on-write views of its committed file (a private
        ``mmap``): no host memory until read, and then page cache the kernel may reclaim; writing into them copies
        the page and never reaches the file. No store writes into a file it did not create, or mapped so
        (:class:`_Files`), so the views keep the committed values while this store steps on, or the folder is
        reused or removed (an unlinked file lives while mapped).

        Raises:
            DiskTierError: The file is missing or shorter than its record.
        """
        record = self.records[index]
        path = self._slot_path(index, record.slot)
        fd = _open(path, os.O_RDONLY)  # a missing file's error, as a read gives it
        try:
            _check_length(path, os.fstat(fd).st_size, record.file_bytes)
        finally:
            os.close(fd)
        mapped = torch.from_file(str(path), shared=False, size=record.file_bytes, dtype=torch.uint8)
        self.files.hand_over(path)  # this store too writes the slot into a new file from now on
        return {self.names[index][e.param]: e.view_of(mapped) for e in record.masters()}

    def read_block(self, index: int) -> BlockState:
        """A copy of block ``index``'s masters and optimizer state (stepped since the last commit, or committed)."""
        record = self._current(index)
        if record.file_bytes > self.pool.buffer_bytes:
            return self._read_block_in_pieces(index, record)
        buffer = self.pool.acquire(record.file_bytes)
        try:
            self.files.read(self._slot_path(index, record.slot), buffer, record.file_bytes).result()
            names = self.names[index]
            masters = {names[e.param]: e.view_of(buffer).clone() for e in record.masters()}
            state: dict[str, dict[str, Any]] = {}
            for entry in record.entries:
                if entry.key is not None:
                    state.setdefault(names[entry.param], {})[entry.key] = entry.view_of(buffer).clone()
            for param, values in record.values.items():
                for key, value in values.items():
                    state.setdefault(names[param], {})[key] = _decode_value(value)
            return BlockState(masters, state)
        finally:
            self.pool.release(buffer)

    def _read_block_in_pieces(self, index: int, record: Record) -> BlockState:
        """:meth:`read_block` of a block larger than a buffer: each tensor read into memory of its own."""
        names, path = self.names[index], self._slot_path(index, record.slot)
        masters = {names[e.param]: self._read_entry(path, e) for e in record.masters()}
        state: dict[str, dict[str, Any]] = {}
        for entry in record.entries:
            if entry.key is not None:
                state.setdefault(names[entry.param], {})[entry.key] = self._read_entry(path, entry)
        for param, values in record.values.items():
            for key, value in values.items():
                state.setdefault(names[param], {})[key] = _decode_value(value)
        return BlockState(masters, state)

    def master_entries(self, index: int) -> list[Entry]:
        """Where block ``index``'s masters sit in its record (and in a :class:`MasterLease`'s buffer)."""
        return self.records[index].masters()

    def snapshot(self, folder: PathLike) -> dict[str, Any]:
        """Copies the committed step into ``folder`` (created; e.g. :func:`checkpoint_folder` of a ``.ckpt``) by
        hard links where it shares the file system, else by copies, and commits a manifest there last. Holds no
        state in memory. Returns the manifest, small enough for the ``.ckpt``.

        Raises:
            DiskTierError: A committed file is missing.
            DiskSpaceError: Copying ran out of space (the tier itself is untouched).
        """
        if self._pending:
            raise DiskTierError("snapshot() between step(commit=False) and commit(): commit the step first.")
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        (target / MANIFEST).unlink(missing_ok=True)
        manifest = self._manifest(self.step_count, self.records)
        for index, record in enumerate(self.records):
            for slot in (0, 1):
                (target / _slot_name(index, slot)).unlink(missing_ok=True)
            name = _slot_name(index, record.slot)
            disk_folder._link_or_copy(self.path / name, target / name)
        disk_folder._commit(target, manifest)
        return manifest

    def export_safetensors(
        self, path: PathLike, extra: Optional[Mapping[str, Tensor]] = None, dtype: Optional[torch.dtype] = None
    ) -> None:
        """Writes the committed masters (and ``extra`` tensors, e.g. the trunk's) as one plain safetensors file,
        block by block (memory: one block), for inference. ``dtype`` casts floating-point tensors (e.g. bf16)."""
        extra = dict(extra or {})
        names = [n for block in self.names for n in block]
        clash = set(names) & set(extra)
        if clash:
            raise ValueError(f"extra repeats names the blocks already hold: {sorted(clash)[:5]}.")
        layout = [(self.names[i][e.param], e.dtype, e.shape) for i, r in enumerate(self.records) for e in r.masters()]
        layout += [(name, t.dtype, tuple(t.shape)) for name, t in extra.items()]

        def tensors() -> Iterator[Tensor]:
            for index in range(len(self.records)):
                if len(self._master_chunks(index)) > 1:  # larger than a buffer: a tensor at a time
                    path = self._slot_path(index, self.records[index].slot)
                    yield from (self._read_entry(path, entry) for entry in self.records[index].masters())
                    continue
                lease = self.prefetch_masters(index)
                try:
                    yield from lease.wait()
                finally:
                    lease.release()
            yield from extra.values()

        write_safetensors(path, layout, tensors(), dtype, {"superpipe_step": str(self.step_count)})


def _write_step_zero(folder: Path, blocks: Sequence[Mapping[str, nn.Parameter]], states: Sequence[Sequence[dict]],
                     manifest: Mapping[str, Any], optimizer: Optional[Optimizer],
                     initial: Optional[Callable[[int], Mapping[str, Tensor]]], options: StoreOptions) -> None:
    """Writes every block's record as ``manifest`` lays it out (from its parameters and ``states``, or from
    ``initial``'s values), drops the blocks' state from ``optimizer`` and commits ``manifest`` as step 0."""
    # The parameters still hold the values: write them with a writer of its own before the store parks them.
    direct = supports_direct_io(folder) if options.direct_io is None else options.direct_io
    files = _Files(direct, options.io_workers, options.chunk_bytes)
    try:
        for index, (block, state) in enumerate(zip(blocks, states)):
            record = Record.from_json(manifest["blocks"][index])
            params = list(block.values())
            if initial is not None:
                params = _initial_values(index, block, initial(index))
            _write_record(files, folder / _slot_name(index, record.slot), record, params, state)
            del params
            if optimizer is not None:
                for param in block.values():
                    optimizer.state.pop(param, None)
        disk_folder._commit(folder, manifest)
    finally:
        files.close()


def _write_record(files: _Files, path: Path, record: Record, params: Sequence[Tensor],
                  states: Sequence[Mapping[str, Any]]) -> None:
    """Writes ``record`` of these values as the new file ``path``, durably, :data:`STEP_ZERO_WINDOW` bytes at a
    time: a block larger than that takes no copy of its whole record in host memory."""
    window = min(record.file_bytes, STEP_ZERO_WINDOW)
    scratch = _aligned_buffer(window)
    sources = [(e, _tensor_of(e, params, states).detach().contiguous().reshape(-1).view(torch.uint8))
               for e in record.entries]
    files.begin(path, record.file_bytes)
    for start in range(0, record.file_bytes, window):
        end = min(start + window, record.file_bytes)
        scratch[: end - start].zero_()  # the padding between tensors and at the end: defined
        for entry, data in sources:
            low, high = max(start, entry.offset), min(end, entry.offset + entry.nbytes)
            if low < high:
                scratch[low - start : high - start].copy_(data[low - entry.offset : high - entry.offset])
        files.write_range(path, scratch, end - start, 0, start).result()
    files.finish(path, record.file_bytes, [], durable=True).result()


def _initial_values(index: int, block: Mapping[str, nn.Parameter], values: Mapping[str, Tensor]) -> list[Tensor]:
    if set(values) != set(block):
        raise ValueError(
            f"initial({index}) gave the tensors {sorted(values)[:4]}, but block {index} has {sorted(block)[:4]}."
        )
    for name, param in block.items():
        if values[name].shape != param.shape or values[name].dtype != param.dtype:
            raise ValueError(
                f"initial({index})[{name!r}] is {tuple(values[name].shape)} {values[name].dtype}; the parameter is"
                f" {tuple(param.shape)} {param.dtype}."
            )
    return [values[name].detach() for name in block]


def _sizing(blocks: Sequence[Mapping[str, nn.Parameter]], manifest: Mapping[str, Any], optimizer: Optional[Optimizer],
            settings: StoreOptions) -> Sizing:
    return Sizing([list(b.values()) for b in blocks], [Record.from_json(d) for d in manifest["blocks"]], optimizer,
                  settings)


def _check_blocks(blocks: Sequence[Mapping[str, nn.Parameter]]) -> None:
    seen: set[str] = set()
    for block in blocks:
        for name, param in block.items():
            if name in seen:
                raise ValueError(f"The parameter name {name!r} appears in two blocks; names must be unique.")
            seen.add(name)
            if param.device.type != "cpu":
                raise ValueError(f"{name} is on {param.device}; the disk tier takes host (CPU) parameters.")
