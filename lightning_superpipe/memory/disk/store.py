"""The disk tier: block masters, optimizer state and spilled gradients in files, streamed through a bounded pool.

With Adam a full fine-tune keeps about 16 bytes per parameter on the host (fp32 master, gradient, two moments). The
disk tier keeps each streamed block's fp32 masters and its whole optimizer state (every tensor ``optimizer.state[p]``
holds, e.g. Adam's ``step``, ``exp_avg``, ``exp_avg_sq``, and any non-tensor values) in files under ``offload_path``,
and optionally its fp32 gradients, so host memory holds only a bounded pool of block buffers.

Files (all under one folder):

* ``block{i:05d}.{slot}.bin``, two slots per block: a block's record, its masters first (in the block's parameter
  order, each on a 256-byte boundary) and then its state tensors; the file is rounded up to 4 KiB for direct I/O.
* ``grad{i:05d}.bin``: a block's spilled fp32 gradients (same offsets as the masters); scratch, never committed.
* ``manifest.json``: the committed step: for every block, which slot holds it, the record's layout and the
  non-tensor state values. A step writes every stepped block to its *other* slot and ``fsync``s it, then writes the
  manifest to a temporary name, ``fsync``s it, renames it over the old one and ``fsync``s the folder. A kill at any
  moment leaves the folder at the previous step or the new one, never a mix: the old slots are not touched until
  the manifest that stops naming them is durable.

I/O: files are read and written with ``os.preadv``/``os.pwritev`` on worker threads, in chunks, into page-aligned
buffers from a :class:`BufferPool` (page-locked on CUDA), with ``O_DIRECT`` where the file system accepts it
(``ext4``, ``xfs``) and otherwise buffered, with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after each chunk so the
page cache does not grow by the files' size (``tmpfs`` refused ``O_DIRECT`` before Linux 6.6; file systems over
the network may). Nothing is memory-mapped: mapping grows the process's resident memory to the size of the file.
The step's reads ahead wait for their buffers on a reader thread, in block order, and a write hands its buffer back
once the bytes have left it, before its ``fsync``: the commit waits for the ``fsync``s, the next read only for the
buffer. :class:`IoClock` counts where the time goes (``DiskStore.io_seconds``).

How the engine is meant to use it (``offload_device="disk"``)::

    limit_heap_retention()                       # else glibc keeps freed block-sized tensors resident
    store = DiskStore.create(offload_path, [dict(block.named_parameters(prefix)) for ...], optimizer,
                             spill_grads=needs_spill, host_buffer_bytes=host_buffer_bytes)   # or DiskStore.open
    # The block parameters now hold placeholders (right shape and dtype, no memory); their values are in files.
    # Forward/backward: lease = store.prefetch_masters(i); views = lease.wait(); derive the device copy (cast to the
    #   compute dtype on the fly: no bf16 copy on disk, which would cost 2 bytes/parameter of writes per step);
    #   lease.release() once the copy is made.
    # Gradients: either leave them in ``p.grad`` (exact per-block stepping during backward) or, with clipping or
    #   accumulation, ``store.spill_grads(i, grads, accumulate=micro_batch > 0, wait=False, norms=last_micro)``
    #   and drop them from memory. Clipping by global norm: stack store.grad_norms(i) with the trunk's norms in
    #   parameter order, take clip_grad_norm_'s clamped coefficient and pass it as step(..., grad_scale=coef).
    store.step(optimizer, grads="param" or "disk")   # block by block: read, step the user's optimizer restricted
                                                     # to the block, write to the other slot; then commit
    # (or, stepping during backward where that is exact: store.step(optimizer, blocks=[i], commit=False) as each
    #  block's gradients complete, and store.commit() after the last; on an error the store is back at the last
    #  commit and the whole optimizer step must be redone)
    with restricted(optimizer, trunk_params): optimizer.step()    # the rest (the trunk) stays in memory
    scheduler.step()                                  # param groups and LR live in the optimizer, in memory
    # Checkpoint: manifest = store.snapshot(checkpoint_folder(ckpt_path) / unique_name) (hard links, no RAM), put
    #   it in the .ckpt; a fresh folder per save, so a kill mid-save leaves the previous .ckpt its copy.
    # Resume: DiskStore.restore(checkpoint_folder(ckpt_path), offload_path, blocks, optimizer).
    # Inference export: store.export_safetensors("model.safetensors", extra=trunk_state_dict).

Between steps ``optimizer.state`` holds nothing for block parameters: their state is in the files, and
``optimizer.state_dict()`` covers the trunk only (the store's manifest and files cover the rest).
"""

from __future__ import annotations

import base64
import ctypes
import errno
import inspect
import json
import math
import os
import pickle
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.param_groups import restricted
from lightning_superpipe.memory.pinned import PAGE, HostArena, page_rounded
from lightning_superpipe.units import format_bytes

FORMAT = "superpipe-disk-tier"
VERSION = 1
MANIFEST = "manifest.json"
#: Every tensor of a record starts on this many bytes (64 fp32 elements, the host tier's alignment), so kernels take
#: the same vectorized paths as for separately allocated tensors.
ENTRY_ALIGNMENT = 256
#: Default size of one read or write request; a block's I/O is split into chunks spread over the worker threads.
CHUNK_BYTES = 16 << 20
#: A wait for a free buffer longer than this means a caller holds too many (I/O itself takes far less).
ACQUIRE_TIMEOUT_S = 300.0
#: Room kept free beyond the tier's files for manifests and file-system overhead.
_MARGIN_BYTES = 16 << 20

PathLike = Union[str, "os.PathLike[str]"]


class DiskTierError(RuntimeError):
    """A disk tier file is missing, truncated, unreadable or unwritable; the message names the file."""


class DiskSpaceError(DiskTierError):
    """``offload_path`` lacks the space the tier needs (before training or during a write)."""


# ---------------------------------------------------------------------------------------------------------------------
# Preflight


def free_bytes(path: PathLike) -> int:
    """Bytes an unprivileged writer may still allocate on the file system holding ``path``."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def preflight(path: PathLike, needed_bytes: int, what: str = "two slots of every block's record") -> None:
    """Checks before training that ``path`` exists, is a writable folder and has ``needed_bytes`` free.

    Raises:
        DiskTierError: The folder is missing or not writable.
        DiskSpaceError: It has less than ``needed_bytes`` (plus a small margin) free.
    """
    folder = Path(path)
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise DiskTierError(
            f"The disk tier's offload_path {str(folder)!r} {problem}. Create it (e.g. `mkdir -p {folder}`) on a fast"
            f" local disk with at least {format_bytes(needed_bytes)} free, or pass another offload_path."
        )
    probe = folder / f".superpipe-write-probe-{os.getpid()}"  # several ranks may probe one folder
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"superpipe")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise DiskTierError(
            f"The disk tier's offload_path {str(folder)!r} is not writable ({error.strerror or error}). Give this"
            " process write access to it or pass another offload_path."
        ) from error
    available = free_bytes(folder)
    if needed_bytes + _MARGIN_BYTES > available:
        raise DiskSpaceError(
            f"The disk tier needs {format_bytes(needed_bytes)} ({needed_bytes} bytes: {what}) and"
            f" {format_bytes(_MARGIN_BYTES)} of room in offload_path {str(folder)!r}, but only"
            f" {format_bytes(available)} ({available} bytes) are free there. Free space, or point offload_path at a"
            " larger disk."
        )


def supports_direct_io(path: PathLike) -> bool:
    """Whether files in the folder ``path`` accept ``O_DIRECT`` reads and writes of page-aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(path) / f".superpipe-direct-probe-{os.getpid()}"
    buffer = _aligned_buffer(PAGE)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False  # e.g. tmpfs before Linux 6.6: EINVAL at open
    try:
        view = _byte_view(buffer, PAGE)
        os.pwritev(fd, [view], 0)
        os.preadv(fd, [view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def limit_heap_retention(threshold_bytes: int = 1 << 20) -> bool:
    """Makes glibc return freed allocations of ``threshold_bytes`` or more to the system at once.

    glibc raises its ``mmap`` threshold dynamically up to 32 MiB, after which freed tensors below that size stay in
    the heap: measured here, streaming blocks of 32 MiB tensors through the tier kept 250-800 MB resident beyond the
    pool (the optimizer's first-step state, gradients the caller made and dropped). A fixed threshold keeps RSS at
    the pool's size; it costs a page fault per page of each large allocation made afterwards. Process-wide: the
    strategy calls it when it builds a disk tier. Returns whether it applied (``False`` off glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # M_MMAP_THRESHOLD in malloc.h
    return bool(mallopt(m_mmap_threshold, int(threshold_bytes)))


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer state sizes


@dataclass(frozen=True)
class StateSize:
    """The optimizer state one parameter takes: ``per_element`` bytes per element of the parameter, plus
    ``fixed_tensors`` small tensors (e.g. Adam's ``step``), each padded to :data:`ENTRY_ALIGNMENT` in a record."""

    per_element: float
    fixed_tensors: int

    def record_bytes(self, numel: int) -> int:
        return _aligned(int(self.per_element * numel)) + self.fixed_tensors * ENTRY_ALIGNMENT


def probe_state_size(optimizer: Optional[Optimizer]) -> StateSize:
    """How much state ``optimizer`` keeps per parameter, measured by stepping a fresh optimizer of the same class and
    defaults over a small probe parameter (state is created lazily, so the real one has none before its first step).
    Falls back to Adam's size (two fp32 moments and a step) for an optimizer that cannot be probed so."""
    if optimizer is None:
        return StateSize(0.0, 0)
    numel = 4096
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        probe = nn.Parameter(torch.zeros(numel))
        probe.grad = torch.full((numel,), 1e-3)
        fresh = type(optimizer)([probe], **defaults)
        fresh.step()
        per_element, fixed = 0.0, 0
        for value in fresh.state[probe].values():
            if isinstance(value, Tensor):
                if value.numel() == numel:
                    per_element += value.element_size()
                else:
                    fixed += 1
        return StateSize(per_element, fixed)
    except Exception:  # an optimizer that needs a closure or other constructor arguments: assume Adam-like
        return StateSize(8.0, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Records


@dataclass
class Entry:
    """One tensor of a block's record: a master (``key`` is ``None``) or a state tensor of parameter ``param``."""

    param: int
    key: Optional[str]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def view_of(self, buffer: Tensor) -> Tensor:
        """This entry's tensor inside a record held in the uint8 ``buffer``."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"param": self.param, "key": self.key, "dtype": _dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        return cls(int(data["param"]), data["key"], _DTYPES[data["dtype"]], tuple(data["shape"]), int(data["offset"]))


@dataclass
class Record:
    """Where a block's committed record lives (its slot) and how it is laid out."""

    slot: int
    entries: list[Entry]
    #: Non-tensor state per parameter index, encoded for JSON (see :func:`_encode_value`).
    values: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def file_bytes(self) -> int:
        return page_rounded(max(self.nbytes, 1))

    def masters(self) -> list[Entry]:
        return [e for e in self.entries if e.key is None]

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "file_bytes": self.file_bytes, "entries": [e.to_json() for e in self.entries],
                "values": {str(k): v for k, v in self.values.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        return cls(int(data["slot"]), [Entry.from_json(e) for e in data["entries"]],
                   {int(k): dict(v) for k, v in data["values"].items()})


def _layout(params: Sequence[Tensor], states: Sequence[Mapping[str, Any]]) -> tuple[list[Entry], dict[int, dict]]:
    """The record of a block: masters first (so a forward reads a prefix), then each parameter's state tensors."""
    entries: list[Entry] = []
    offset = 0
    for index, param in enumerate(params):
        entries.append(Entry(index, None, param.dtype, tuple(param.shape), offset))
        offset += _aligned(entries[-1].nbytes)
    values: dict[int, dict[str, Any]] = {}
    for index, state in enumerate(states):
        for key, value in state.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"The disk tier stores optimizer state under string keys; this optimizer uses the key {key!r}"
                    f" ({type(key).__name__}). Use offload_device='cpu' with this optimizer."
                )
            if isinstance(value, Tensor):
                if value.device.type != "cpu":
                    raise TypeError(
                        f"Optimizer state {key!r} is on {value.device}; the disk tier keeps host optimizer state only."
                    )
                entries.append(Entry(index, key, value.dtype, tuple(value.shape), offset))
                offset += _aligned(entries[-1].nbytes)
            else:
                values.setdefault(index, {})[key] = _encode_value(value)
    return entries, values


def _master_bytes(params: Sequence[Tensor]) -> int:
    return sum(_aligned(p.numel() * p.element_size()) for p in params)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ENTRY_ALIGNMENT) * ENTRY_ALIGNMENT


def _encode_value(value: Any) -> dict[str, Any]:
    """A non-tensor state value for the manifest: as JSON when it survives the round trip, else pickled."""
    try:
        decoded = json.loads(json.dumps(value))
        if decoded == value and type(decoded) is type(value):  # a tuple would come back as a list
            return {"json": value}
    except (TypeError, ValueError):
        pass
    return {"pickle": base64.b64encode(pickle.dumps(value)).decode("ascii")}


def _decode_value(data: Mapping[str, Any]) -> Any:
    if "json" in data:
        return data["json"]
    return pickle.loads(base64.b64decode(data["pickle"]))


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64)
}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"The disk tier cannot store tensors of dtype {dtype}.")
    return name


# ---------------------------------------------------------------------------------------------------------------------
# Where the time goes

#: The counters of :class:`IoClock`, in the order :meth:`IoClock.seconds` gives them.
CLOCK_COUNTERS = ("busy", "read_busy", "write_busy", "fsync", "pool_wait", "read_wait", "write_wait", "step_compute")


class IoClock:
    """Cheap wall-clock counters of where the tier's time goes, in seconds over the store's life.

    * ``busy``: wall time with at least one read or write of a tier file in flight (the disk in use); bytes over
      it, against the raw disk, is the tier's I/O efficiency, fair also while reads and writes share the disk;
    * ``read_busy`` / ``write_busy``: wall time with at least one read / one write in flight (each includes the
      time its requests waited behind the other kind's, on the worker threads and on the disk);
    * ``fsync``: time inside ``fsync`` calls, summed (they run on worker threads, beside other I/O);
    * ``pool_wait``: time any thread waited for a free pool buffer, summed;
    * ``read_wait``: time a consumer (the engine's copy to the device, the step) waited for a block's bytes;
    * ``write_wait``: time a commit waited for the step's writes to be durable;
    * ``step_compute``: the optimizer's arithmetic and the new record's layout inside :meth:`DiskStore.step`.

    A counter costs a ``perf_counter`` call and a lock per whole-file read or write, none per byte.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = {"read": 0, "write": 0}
        self._since = {"any": 0.0, "read": 0.0, "write": 0.0}
        self._seconds = dict.fromkeys(CLOCK_COUNTERS, 0.0)

    def begin(self, kind: Literal["read", "write"]) -> None:
        """A read or write of a whole file starts."""
        now = time.perf_counter()
        with self._lock:
            if not self._open["read"] + self._open["write"]:
                self._since["any"] = now
            if not self._open[kind]:
                self._since[kind] = now
            self._open[kind] += 1

    def end(self, kind: Literal["read", "write"]) -> None:
        """The read or write begun last with ``kind`` (or an earlier one) is done."""
        now = time.perf_counter()
        with self._lock:
            self._open[kind] -= 1
            if not self._open[kind]:
                self._seconds[f"{kind}_busy"] += now - self._since[kind]
            if not self._open["read"] + self._open["write"]:
                self._seconds["busy"] += now - self._since["any"]

    def add(self, counter: str, seconds: float) -> None:
        """Adds ``seconds`` to ``counter`` (one of :data:`CLOCK_COUNTERS`)."""
        with self._lock:
            self._seconds[counter] += seconds

    def wait(self, future: Future[Any], counter: str) -> Any:
        """``future.result()``, counting the time it blocked under ``counter``."""
        if future.done():
            return future.result()
        began = time.perf_counter()
        try:
            return future.result()
        finally:
            self.add(counter, time.perf_counter() - began)

    def seconds(self) -> dict[str, float]:
        """Every counter, the busy ones including I/O still in flight up to now."""
        now = time.perf_counter()
        with self._lock:
            seconds = dict(self._seconds)
            for kind in ("read", "write"):
                if self._open[kind]:
                    seconds[f"{kind}_busy"] += now - self._since[kind]
            if self._open["read"] + self._open["write"]:
                seconds["busy"] += now - self._since["any"]
        return seconds


# ---------------------------------------------------------------------------------------------------------------------
# Buffers


def _aligned_buffer(nbytes: int) -> Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + nbytes]


def _byte_view(buffer: Tensor, nbytes: int, start: int = 0) -> memoryview:
    """A writable memoryview of ``nbytes`` of the uint8 CPU ``buffer`` from ``start`` (what ``preadv`` fills)."""
    if start + nbytes > buffer.numel():
        raise ValueError(f"A view of {nbytes} bytes at {start} exceeds a buffer of {buffer.numel()} bytes.")
    array = (ctypes.c_char * nbytes).from_address(buffer.data_ptr() + start)
    return memoryview(array).cast("B")


class BufferPool:
    """A bounded set of equal page-aligned host buffers (page-locked with CUDA), handed out and returned.

    Args:
        buffer_bytes: Size of each buffer (rounded up to pages).
        count: How many buffers the pool holds at most.
        pin: Page-lock the buffers with ``cudaHostRegister`` (a CUDA compute device).
        bounded: Whether ``count * buffer_bytes`` is a user's bound: then a record larger than a buffer is an error,
            otherwise buffers grow to fit it.
        clock: Counts the time callers wait for a free buffer (``pool_wait``).
    """

    def __init__(self, buffer_bytes: int, count: int, pin: bool, bounded: bool,
                 clock: Optional[IoClock] = None) -> None:
        if count < 1:
            raise ValueError("A buffer pool needs at least one buffer.")
        self.buffer_bytes = page_rounded(max(buffer_bytes, 1))
        self.count = count
        self.pin = pin
        self.bounded = bounded
        self._free: list[tuple[Tensor, HostArena]] = []
        self._allocated = 0
        #: The most host bytes the pool's buffers held at once.
        self.peak_bytes = 0
        self._owners: dict[int, HostArena] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._clock = clock

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the pool's buffers hold now."""
        with self._cond:
            return self._allocated * self.buffer_bytes

    def acquire(self, nbytes: int) -> Tensor:
        """A free buffer of at least ``nbytes`` (uint8), waiting for one to be released if all are in use."""
        with self._cond:
            if nbytes > self.buffer_bytes:
                if self.bounded:
                    raise DiskTierError(
                        f"A block's record needs {format_bytes(nbytes)} but host_buffer_bytes allows buffers of"
                        f" {format_bytes(self.buffer_bytes)} ({self.count} of them); raise host_buffer_bytes to at"
                        f" least {page_rounded(nbytes) * self.count} bytes."
                    )
                self._grow(nbytes)
            began = time.perf_counter()
            waited = False
            while not self._free and self._allocated >= self.count:
                waited = True
                if not self._cond.wait(timeout=ACQUIRE_TIMEOUT_S):
                    raise DiskTierError(
                        f"All {self.count} disk tier buffers have been in use for {ACQUIRE_TIMEOUT_S:.0f} s: a caller"
                        " holds more leases (prefetch_masters) than the pool has buffers without releasing one."
                        " Release each lease once its block is copied, or raise host_buffer_bytes."
                    )
            if waited and self._clock is not None:
                self._clock.add("pool_wait", time.perf_counter() - began)
            if self._free:
                buffer, arena = self._free.pop()
            else:
                arena = HostArena(pin=self.pin)
                buffer = arena.empty(self.buffer_bytes, torch.uint8)
                self._allocated += 1
                self.peak_bytes = max(self.peak_bytes, self._allocated * self.buffer_bytes)
            self._owners[buffer.data_ptr()] = arena
            return buffer

    def grow(self, nbytes: int) -> None:
        """Makes every buffer handed out from now on hold at least ``nbytes`` (an unbounded pool only)."""
        with self._cond:
            if nbytes > self.buffer_bytes:
                self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        self.buffer_bytes = page_rounded(nbytes)  # smaller buffers are dropped as they come back
        for buffer, arena in self._free:
            self._drop(buffer, arena)
        self._free = []

    def release(self, buffer: Tensor) -> None:
        """Returns ``buffer`` to the pool (from any thread)."""
        with self._cond:
            arena = self._owners.pop(buffer.data_ptr())
            if buffer.numel() < self.buffer_bytes or self._closed:
                self._drop(buffer, arena)
            else:
                self._free.append((buffer, arena))
            self._cond.notify()

    def close(self) -> None:
        """Frees the free buffers (and unpins them); buffers still out are freed when released."""
        with self._cond:
            self._closed = True
            for buffer, arena in self._free:
                self._drop(buffer, arena)
            self._free = []

    def _drop(self, buffer: Tensor, arena: HostArena) -> None:
        arena.close()
        self._allocated -= 1


# ---------------------------------------------------------------------------------------------------------------------
# File I/O (module-level functions, so tests can interpose on single writes)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError as error:
        raise DiskTierError(
            f"The disk tier's file {str(path)!r} is missing (deleted while in use?). The tier cannot continue from"
            " this folder; restore it from a checkpoint's copy (DiskStore.restore)."
        ) from error
    except OSError as error:
        raise _io_error("opening", path, error) from error


def _io_error(doing: str, path: Path, error: OSError) -> DiskTierError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            left = f" ({format_bytes(free_bytes(path.parent))} free)"
        except OSError:
            left = ""
        return DiskSpaceError(
            f"The disk is full while {doing} the disk tier's file {str(path)!r}{left}. The last committed step in"
            f" {str(path.parent)!r} is intact: free space (or move offload_path to a larger disk) and resume from it."
        )
    return DiskTierError(f"{doing.capitalize()} the disk tier's file {str(path)!r} failed: {error}.")


def _check_length(path: Path, size: int, nbytes: int) -> None:
    """Refuses a tier file of ``size`` bytes that should hold ``nbytes`` (truncated)."""
    if size < nbytes:
        raise DiskTierError(
            f"The disk tier's file {str(path)!r} has {size} bytes but {nbytes} were expected (truncated?). Restore"
            " the folder from a checkpoint's copy (DiskStore.restore)."
        )


def _read_chunk(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            count = os.preadv(fd, [view[done:]], offset + done)
        except OSError as error:
            raise _io_error("reading", path, error) from error
        if count == 0:
            raise DiskTierError(
                f"The disk tier's file {str(path)!r} ended at byte {offset + done} while {offset + len(view)} were"
                " expected (truncated?). Restore the folder from a checkpoint's copy (DiskStore.restore)."
            )
        done += count


def _write_chunk(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            done += os.pwritev(fd, [view[done:]], offset + done)
        except OSError as error:
            raise _io_error("writing", path, error) from error


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _KindGate:
    """Lets whole-file reads run beside reads and writes beside writes, never a read beside a write, in the order
    they asked (so that neither kind starves).

    For a disk that serves one kind at a time better. Measured on a virtual disk (``O_DIRECT``, 1 GiB files, five
    rounds): reads alone 1.7 GB/s, ``fsync``ed writes alone 2.6 GB/s, the two one after the other 2.05-2.09 GB/s,
    and a read and a write at once 1.4-2.1 GB/s together (1.6 typically). Yet in the tier's step (24 records of
    107 MB read with their gradients and written back, 3 buffers) taking turns was 4-13% slower than not, in two
    alternating rounds (3.54-3.64 s against 3.07-3.17 s, then 4.75-4.89 against 4.57-4.62): the step's I/O
    came in bursts of one kind, three blocks' reads then three blocks' writes, the disk's queue shallow at the end
    of each. Hence ``separate_io_kinds=False`` by default. A write's ``fsync`` runs outside its turn: the bytes are
    on the device by then.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[list[str]] = deque()
        self._kind = ""
        self._active = 0

    def enter(self, kind: str) -> None:
        """Waits until no file of the other kind is in flight and every earlier caller has entered."""
        with self._cond:
            ticket = [kind]
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket or (self._active and self._kind != kind):
                self._cond.wait()
            self._waiting.popleft()
            self._kind = kind
            self._active += 1
            self._cond.notify_all()  # the next caller may be of the same kind and enter beside this one

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()


class _Files:
    """Reads and writes whole files between page-aligned buffers and disk, split into chunks on worker threads.

    Args:
        direct: Open the files with ``O_DIRECT``.
        workers: Threads issuing the chunks' ``preadv``/``pwritev`` calls.
        chunk_bytes: Size of one request.
        clock: Counts the time reads and writes are in flight, and ``fsync``'s (a fresh one when ``None``).
        separate_kinds: Let reads and writes take turns on the disk (:class:`_KindGate`) rather than run at once.
    """

    def __init__(self, direct: bool, workers: int, chunk_bytes: int, clock: Optional[IoClock] = None,
                 separate_kinds: bool = False) -> None:
        self.direct = direct
        self._gate = _KindGate() if separate_kinds else None
        self.chunk_bytes = page_rounded(chunk_bytes)
        self.clock = clock if clock is not None else IoClock()
        self._chunks = ThreadPoolExecutor(workers, thread_name_prefix="superpipe-disk-io")
        # Whole-file jobs wait on their chunks; a separate pool so that a job never waits behind another job.
        self._jobs = ThreadPoolExecutor(max(2, workers), thread_name_prefix="superpipe-disk-job")
        self._lock = threading.Lock()
        #: Files this instance wrote: any other is unlinked before its first write, since a parameter of an
        #: earlier store may map it (:meth:`DiskStore.map_masters`) or a checkpoint may link it.
        self._created: set[Path] = set()
        self.bytes_read = 0
        self.bytes_written = 0
        #: ``(kind, start, end, bytes)`` of every whole-file read and write, for benchmarks (``None``: not kept).
        #: A write's interval ends once it is durable (its ``fsync``, when asked for, included).
        self.intervals: Optional[list[tuple[str, float, float, int]]] = None

    def hand_over(self, path: Path) -> None:
        """``path`` is mapped by a reader now: it is never written again, a write makes a new file instead."""
        with self._lock:
            self._created.discard(path)

    def close(self) -> None:
        self._jobs.shutdown(wait=True)
        self._chunks.shutdown(wait=True)

    def read(self, path: Path, buffer: Tensor, nbytes: int, start: int = 0) -> Future[None]:
        """Reads the first ``nbytes`` (a multiple of the page size) of ``path`` into ``buffer[start:]``."""
        return self._jobs.submit(self._read, path, buffer, nbytes, start)

    def write(
        self, path: Path, buffer: Tensor, nbytes: int, durable: bool, written: Optional[Callable[[], None]] = None
    ) -> Future[None]:
        """Writes ``buffer[:nbytes]`` as the whole file ``path`` (``fsync``ed when ``durable``; the future is done
        once it is). ``written`` is called once no byte of ``buffer`` is read any more, before the ``fsync`` (and
        also when the write fails), so the buffer may take the next read while the file is made durable: the
        ``fsync`` flushes the file, not the buffer (with ``O_DIRECT`` the bytes left the buffer when ``pwritev``
        returned; buffered, they are in the page cache)."""
        return self._jobs.submit(self._write, path, buffer, nbytes, durable, written)

    def _begin(self, kind: Literal["read", "write"]) -> float:
        """Waits for the disk to take a file of ``kind`` and starts counting it in flight; returns when."""
        if self._gate is not None:
            self._gate.enter(kind)
        self.clock.begin(kind)
        return time.perf_counter()

    def _end(self, kind: Literal["read", "write"], gate: bool = True) -> None:
        self.clock.end(kind)
        if gate and self._gate is not None:
            self._gate.leave()

    def _read(self, path: Path, buffer: Tensor, nbytes: int, start: int) -> None:
        began = self._begin("read")
        try:
            fd = _open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                _check_length(path, os.fstat(fd).st_size, nbytes)
                self._chunked(_read_chunk, fd, path, buffer, nbytes, start)
            finally:
                os.close(fd)
        finally:
            self._end("read")
        with self._lock:
            self.bytes_read += nbytes
            if self.intervals is not None:
                self.intervals.append(("read", began, time.perf_counter(), nbytes))

    def _write(self, path: Path, buffer: Tensor, nbytes: int, durable: bool,
               written: Optional[Callable[[], None]] = None) -> None:
        handed_back = written is None

        def hand_back() -> None:
            nonlocal handed_back
            if not handed_back:
                handed_back = True
                written()  # type: ignore[misc]

        began = self._begin("write")
        gated = True
        try:
            try:
                if path not in self._created or os.stat(path).st_nlink > 1:
                    # Not ours, or hard-linked into a checkpoint's folder: write a new file rather than into an inode
                    # that a checkpoint's copy, or the parameters of an earlier run (a private mapping), still read.
                    os.unlink(path)
            except FileNotFoundError:
                pass
            with self._lock:
                self._created.add(path)
            fd = _open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0))
            try:
                try:
                    if os.fstat(fd).st_size != nbytes:
                        os.ftruncate(fd, nbytes)
                    # Reserve the blocks first: a full disk fails here, before any byte of the record is written.
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as error:
                    raise _io_error("writing", path, error) from error
                self._chunked(_write_chunk, fd, path, buffer, nbytes, 0)
                hand_back()
                # The bytes are on the device: reads may go while it makes them durable.
                if self._gate is not None:
                    self._gate.leave()
                gated = False
                if durable:
                    synced = time.perf_counter()
                    try:
                        # The data and what reading it needs (size, extents): not the timestamps fsync adds, which
                        # cost 1.57 against 0.95 s of a 5 s step in the strategy benchmark. The new directory
                        # entries are made durable by the commit.
                        os.fdatasync(fd)
                    except OSError as error:
                        raise _io_error("writing", path, error) from error
                    finally:
                        self.clock.add("fsync", time.perf_counter() - synced)
                if not self.direct:
                    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # written back: drop it from the cache
            finally:
                os.close(fd)
        finally:
            self._end("write", gate=gated)
            hand_back()
        with self._lock:
            self.bytes_written += nbytes
            if self.intervals is not None:
                self.intervals.append(("write", began, time.perf_counter(), nbytes))

    def _chunked(self, function: Any, fd: int, path: Path, buffer: Tensor, nbytes: int, start: int) -> None:
        def run(offset: int) -> None:
            length = min(self.chunk_bytes, nbytes - offset)
            function(fd, _byte_view(buffer, length, start + offset), offset, path)
            if not self.direct and function is _read_chunk:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

        futures = [self._chunks.submit(run, offset) for offset in range(0, nbytes, self.chunk_bytes)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error


# ---------------------------------------------------------------------------------------------------------------------
# The store


@dataclass
class BlockState:
    """A copy of one block's masters and optimizer state, keyed by parameter name."""

    masters: dict[str, Tensor]
    state: dict[str, dict[str, Any]]


#: A block read ahead for the step: its index, its buffer, the read of its record and that of its spilled gradients.
_StepRead = tuple[int, Tensor, Future[None], Optional[Future[None]]]


class MasterLease:
    """A block's fp32 masters being read into a pool buffer; :meth:`wait` gives views, :meth:`release` returns it.

    Args:
        pool: The pool ``buffer`` came from.
        buffer: The buffer the read fills.
        future: The read.
        entries: Where the masters sit in the buffer.
        clock: Counts the time :meth:`wait` and :meth:`flat` block on the read (``read_wait``).
    """

    def __init__(self, pool: BufferPool, buffer: Tensor, future: Future[None], entries: list[Entry],
                 clock: Optional[IoClock] = None) -> None:
        self._pool, self._buffer, self._future, self._entries = pool, buffer, future, entries
        self._clock = clock
        self._released = False

    def _landed(self) -> None:
        if self._clock is None:
            self._future.result()
        else:
            self._clock.wait(self._future, "read_wait")

    def wait(self) -> list[Tensor]:
        """The block's masters, in its parameter order (views into the pool buffer: copy before :meth:`release`)."""
        self._landed()
        return [entry.view_of(self._buffer) for entry in self._entries]

    def flat(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The block's masters as one flat tensor of ``numel`` elements of ``dtype`` (a view into the pool buffer):
        every master starts on :data:`ENTRY_ALIGNMENT` bytes, so for fp32 this is the host tier's flat layout."""
        self._landed()
        return self._buffer[: numel * dtype.itemsize].view(dtype)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._future.exception()  # never hand a buffer back while a read still fills it
            self._pool.release(self._buffer)


def checkpoint_folder(ckpt_path: PathLike) -> Path:
    """The folder beside a ``.ckpt`` that holds the disk tier's files of that checkpoint."""
    return Path(f"{os.fspath(ckpt_path)}.disk-tier")


class DiskStore:
    """The disk tier of a set of blocks: their masters and optimizer state in files under one folder.

    Build it with :meth:`create` (writes the blocks' current values as step 0), :meth:`open` (continues the
    committed step of a folder) or :meth:`restore` (continues from a checkpoint's copy). Afterwards the block
    parameters hold placeholders of their shape and dtype with no memory; values are read with
    :meth:`prefetch_masters` and :meth:`read_block`, and changed only by :meth:`step`.

    Args:
        path: The folder.
        blocks: Each block's parameters by name (names unique across blocks).
        manifest: The committed manifest.
        optimizer: The optimizer that will step the blocks (sizes the buffers); may be ``None`` for inference.
        spill_grads: Reserve gradient files and buffer room for :meth:`spill_grads`.
        host_buffer_bytes: Bound on the pool's host bytes; default ``(read_ahead + 2)`` buffers of the largest block.
        read_ahead: Blocks read ahead of the one being stepped.
        io_workers: Threads issuing reads and writes.
        chunk_bytes: Size of one read or write request.
        direct_io: Use ``O_DIRECT``; ``None`` probes the folder's file system.
        pin: Page-lock the buffers; ``None`` when CUDA is available.
        separate_io_kinds: Reads and writes take turns on the disk, file by file, rather than run at once (see
            :class:`_KindGate`; off by default: slower in the tier's step on the disk measured).
    """

    def __init__(
        self,
        path: Path,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        manifest: Mapping[str, Any],
        optimizer: Optional[Optimizer],
        spill_grads: bool,
        host_buffer_bytes: Optional[int],
        read_ahead: int,
        io_workers: int,
        chunk_bytes: int,
        direct_io: Optional[bool],
        pin: Optional[bool],
        separate_io_kinds: bool = False,
    ) -> None:
        self.path = path
        self.names = [list(block) for block in blocks]
        self.params = [list(block.values()) for block in blocks]
        self.records = [Record.from_json(data) for data in manifest["blocks"]]
        self.step_count = int(manifest["step"])
        self.spills = spill_grads
        self.read_ahead = max(0, read_ahead)
        self.direct_io = supports_direct_io(path) if direct_io is None else direct_io
        self._grads_present: list[set[int]] = [set() for _ in blocks]
        #: Blocks stepped since the last commit: their new record, its write, whether it consumed spilled gradients.
        self._pending: dict[int, tuple[Record, Future[None], bool]] = {}
        #: Gradient writes that may still be in flight, by block.
        self._spill_writes: dict[int, Future[None]] = {}
        #: Per-parameter gradient norms of each block's last spill (``None``: not kept).
        self._grad_norms: dict[int, Optional[list[Optional[Tensor]]]] = {}
        self._state_size = probe_state_size(optimizer)
        largest = max((self._buffer_need(i) for i in range(len(blocks))), default=PAGE)
        if host_buffer_bytes is None:
            count = self.read_ahead + 2
        else:
            count = int(host_buffer_bytes) // page_rounded(largest)
            if count < 1:
                one, overlapping = page_rounded(largest), page_rounded(largest) * (self.read_ahead + 2)
                raise DiskTierError(
                    f"host_buffer_bytes={int(host_buffer_bytes)} ({format_bytes(int(host_buffer_bytes))}) cannot hold"
                    f" one block's buffer of {one} bytes ({format_bytes(one)}). Give at least {one}; {overlapping}"
                    f" ({self.read_ahead + 2} buffers) lets reads ahead and writes behind overlap the step."
                )
        #: Where the tier's time goes (:meth:`io_seconds`).
        self.clock = IoClock()
        self.pool = BufferPool(largest, count, pin=torch.cuda.is_available() if pin is None else pin,
                               bounded=host_buffer_bytes is not None, clock=self.clock)
        self.files = _Files(self.direct_io, io_workers, chunk_bytes, self.clock, separate_io_kinds)
        # The step's reads ahead wait here for their buffers, in block order, so that the thread stepping never
        # waits for a buffer it does not need yet (a write behind gives one back).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="superpipe-disk-ahead")
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
        spill_grads: bool = False,
        host_buffer_bytes: Optional[int] = None,
        read_ahead: int = 2,
        io_workers: int = 4,
        chunk_bytes: int = CHUNK_BYTES,
        direct_io: Optional[bool] = None,
        pin: Optional[bool] = None,
        separate_io_kinds: bool = False,
        overwrite: bool = False,
        initial: Optional[Callable[[int], Mapping[str, Tensor]]] = None,
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
        folder = Path(path)
        _check_blocks(blocks)
        what = "two slots of every block's masters and optimizer state" + (", and its gradients" if spill_grads else "")
        preflight(folder, cls.bytes_needed([list(b.values()) for b in blocks], optimizer, spill_grads), what)
        if (folder / MANIFEST).exists():
            if not overwrite:
                raise DiskTierError(
                    f"{str(folder)!r} already holds a disk tier (committed step"
                    f" {_read_manifest(folder)['step']}). Continue it with DiskStore.open, or pass overwrite=True"
                    " to start over."
                )
            (folder / MANIFEST).unlink()
            _fsync_dir(folder)
        manifest = {"format": FORMAT, "version": VERSION, "step": 0,
                    "names": [list(b) for b in blocks], "blocks": []}
        states = [[_own_state(optimizer, p) for p in b.values()] for b in blocks]
        manifest["blocks"] = [Record(1, *_layout(list(b.values()), s)).to_json() for b, s in zip(blocks, states)]
        # The parameters still hold the values: write them with a writer of its own before the store parks them.
        files = _Files(supports_direct_io(folder) if direct_io is None else direct_io, io_workers, chunk_bytes)
        try:
            for index, (block, state) in enumerate(zip(blocks, states)):
                record = Record.from_json(manifest["blocks"][index])
                buffer = _aligned_buffer(record.file_bytes)
                buffer.zero_()
                params = list(block.values())
                if initial is not None:
                    params = _initial_values(index, block, initial(index))
                _fill(record, buffer, params, state)
                del params
                files.write(folder / _slot_name(index, record.slot), buffer, record.file_bytes, durable=True).result()
                if optimizer is not None:
                    for param in block.values():
                        optimizer.state.pop(param, None)
            _commit(folder, manifest)
        finally:
            files.close()
        return cls(folder, blocks, manifest, optimizer, spill_grads, host_buffer_bytes, read_ahead, io_workers,
                   chunk_bytes, direct_io, pin, separate_io_kinds)

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
        *,
        spill_grads: bool = False,
        host_buffer_bytes: Optional[int] = None,
        read_ahead: int = 2,
        io_workers: int = 4,
        chunk_bytes: int = CHUNK_BYTES,
        direct_io: Optional[bool] = None,
        pin: Optional[bool] = None,
        separate_io_kinds: bool = False,
    ) -> DiskStore:
        """Continues the committed step of ``path``: checks that its manifest matches ``blocks`` (names, shapes,
        dtypes) and that every committed file is there at its full size. See the class for the arguments.

        Raises:
            DiskTierError: No committed manifest, a mismatch with ``blocks``, or a missing or truncated file.
        """
        folder = Path(path)
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
            if spill_grads and not (folder / _grad_name(index)).exists():
                needed += page_rounded(_master_bytes(list(block.values())))
        preflight(folder, needed, "the slots the next step writes")
        return cls(folder, blocks, manifest, optimizer, spill_grads, host_buffer_bytes, read_ahead, io_workers,
                   chunk_bytes, direct_io, pin, separate_io_kinds)

    @classmethod
    def restore(
        cls,
        snapshot: PathLike,
        path: PathLike,
        blocks: Sequence[Mapping[str, nn.Parameter]],
        optimizer: Optional[Optimizer] = None,
        **options: Any,
    ) -> DiskStore:
        """Continues from a checkpoint's copy (:meth:`snapshot`): hard-links (or, across file systems, copies) its
        files into ``path``, replacing the tier there, commits its manifest and opens it. The copy is never written:
        later steps write new files in ``path``. ``options`` are those of :meth:`open`."""
        source, folder = Path(snapshot), Path(path)
        manifest = _read_manifest(source)
        _check_manifest(source, manifest, blocks)
        preflight(folder, 0)
        if source.resolve() != folder.resolve():
            if (folder / MANIFEST).exists():
                (folder / MANIFEST).unlink()  # uncommit first: a kill mid-restore must not leave a mix
                _fsync_dir(folder)
            for index, data in enumerate(manifest["blocks"]):
                for slot in (0, 1):
                    (folder / _slot_name(index, slot)).unlink(missing_ok=True)
                name = _slot_name(index, int(data["slot"]))
                _link_or_copy(source / name, folder / name)
            _commit(folder, manifest)
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

    def prefetch_masters(self, index: int) -> MasterLease:
        """Starts reading block ``index``'s masters into a pool buffer (what a forward streams to the device)."""
        record = self._current(index)
        entries = record.masters()
        nbytes = page_rounded(max(max((e.offset + e.nbytes for e in entries), default=0), 1))
        buffer = self.pool.acquire(nbytes)
        future = self.files.read(self._slot_path(index, record.slot), buffer, nbytes)
        return MasterLease(self.pool, buffer, future, entries, self.clock)

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

    # -- gradients ------------------------------------------------------------------------------------------------

    def spill_grads(
        self,
        index: int,
        grads: Sequence[Optional[Tensor]],
        accumulate: bool = False,
        wait: bool = True,
        norms: bool = False,
    ) -> Future[None]:
        """Writes block ``index``'s gradients (one per parameter, ``None`` for none) to its gradient file, adding them
        to those spilled before when ``accumulate`` (as autograd accumulates into ``.grad``). The file is scratch:
        it is not ``fsync``ed, and a crash loses only the step in progress.

        The gradients are copied into a pool buffer at once (the caller may free them on return); with ``wait=False``
        the write goes on in the background (the returned future; a failure is raised by it, or by the next spill or
        step of the block, which wait for it). With ``norms`` (the last micro-batch, when clipping by global norm)
        the 2-norm of each spilled (accumulated) gradient is kept for :meth:`grad_norms`.
        """
        if not self.spills:
            raise DiskTierError("This DiskStore was built without spill_grads=True; it has no gradient files.")
        if index in self._pending:
            raise DiskTierError(
                f"Block {index} was stepped and not committed yet; commit() before spilling new gradients."
            )
        params = self.params[index]
        if len(grads) != len(params):
            raise ValueError(f"Block {index} has {len(params)} parameters but {len(grads)} gradients were given.")
        previous = self._spill_writes.pop(index, None)
        if previous is not None:
            previous.result()  # the file must be whole before it is read back or written again
        entries = self.records[index].masters()
        nbytes = self._grad_bytes(index)
        path = self.path / _grad_name(index)
        present = self._grads_present[index]
        buffer = self.pool.acquire(nbytes)
        try:
            if accumulate and present:
                self.files.read(path, buffer, nbytes).result()
            for entry, grad in zip(entries, grads):
                view = entry.view_of(buffer)
                if grad is None:
                    if not (accumulate and entry.param in present):
                        view.zero_()
                    continue
                if grad.shape != view.shape or grad.dtype != view.dtype:
                    raise ValueError(
                        f"The gradient of {self.names[index][entry.param]} has shape {tuple(grad.shape)} and dtype"
                        f" {grad.dtype}; its parameter has {tuple(view.shape)} and {view.dtype}."
                    )
                if accumulate and entry.param in present:
                    view.add_(grad.detach().to("cpu"))
                else:
                    view.copy_(grad.detach())
            if not accumulate:
                present.clear()
            present.update(i for i, g in enumerate(grads) if g is not None)
            # What torch.nn.utils.clip_grad_norm_ computes per gradient, from the same fp32 values.
            self._grad_norms[index] = (
                [torch.linalg.vector_norm(e.view_of(buffer), 2.0) if e.param in present else None for e in entries]
                if norms else None
            )
        except BaseException:
            self.pool.release(buffer)
            raise
        future = self.files.write(path, buffer, nbytes, durable=False, written=lambda: self.pool.release(buffer))
        self._spill_writes[index] = future
        if wait:
            future.result()
        return future

    def take_grads(self, index: int) -> list[Optional[Tensor]]:
        """Reads block ``index``'s spilled gradients back into new host tensors (``None`` for a parameter without
        one) and forgets the spill: the caller holds them now (e.g. to fold them into a reduction across ranks), and
        the block's next spill starts its file afresh."""
        previous = self._spill_writes.pop(index, None)
        if previous is not None:
            previous.result()  # the file must be whole before it is read back
        present = self._grads_present[index]
        entries = self.records[index].masters()
        if not present:
            return [None] * len(entries)
        nbytes = self._grad_bytes(index)
        buffer = self.pool.acquire(nbytes)
        try:
            self.files.read(self.path / _grad_name(index), buffer, nbytes).result()
            grads = [entry.view_of(buffer).clone() if entry.param in present else None for entry in entries]
        finally:
            self.pool.release(buffer)
        present.clear()
        self._grad_norms.pop(index, None)
        return grads

    def spilled(self, index: int) -> bool:
        """Whether block ``index`` has spilled gradients that no committed step has consumed yet."""
        return bool(self._grads_present[index])

    def has_norms(self, index: int) -> bool:
        """Whether block ``index``'s last spill kept norms (:meth:`grad_norms` answers)."""
        return self._grad_norms.get(index) is not None

    @property
    def pending(self) -> list[int]:
        """Blocks stepped since the last commit (``step(commit=False)``)."""
        return list(self._pending)

    def master_entries(self, index: int) -> list[Entry]:
        """Where block ``index``'s masters sit in its record (and in a :class:`MasterLease`'s buffer)."""
        return self.records[index].masters()

    def grad_norms(self, index: int) -> list[Optional[Tensor]]:
        """The 2-norm of each of block ``index``'s spilled gradients (``None`` for a parameter without one), as the
        last :meth:`spill_grads` with ``norms=True`` computed them. Stack them with the other parameters' norms, in
        the order ``clip_grad_norm_`` would see them, for the global norm, and pass the clipping coefficient to
        :meth:`step` as ``grad_scale``.

        Raises:
            DiskTierError: The block's last spill did not keep norms.
        """
        kept = self._grad_norms.get(index)
        if kept is None:
            raise DiskTierError(f"Block {index}'s last spill_grads did not keep norms; pass norms=True to it.")
        return kept

    # -- the step -------------------------------------------------------------------------------------------------

    def step(
        self,
        optimizer: Optimizer,
        grads: Literal["param", "disk"] = "param",
        blocks: Optional[Sequence[int]] = None,
        commit: bool = True,
        grad_scale: Optional[Tensor] = None,
        grad_clip_value: Optional[float] = None,
    ) -> None:
        """Steps ``optimizer`` over the blocks with gradients, block by block, and commits the new step.

        Each block's record (and, with ``grads="disk"``, its spilled gradients) is read into a pool buffer, the
        block's parameters and their ``optimizer.state`` are pointed at it, the optimizer steps restricted to the
        block's parameters (its groups, hyperparameters and LR as configured), and the record is written to the
        block's other slot. Reads of the next blocks and the write of the previous one overlap the step. Once every
        written block is durable the manifest is committed. On any error nothing is committed: the folder stays at
        the previous step (blocks stepped since the last commit are discarded too), and the error names the file.

        Args:
            optimizer: The user's optimizer (its param groups hold the blocks' parameters).
            grads: ``"param"``: the gradients are in ``p.grad``; ``"disk"``: read those :meth:`spill_grads` wrote
                (consumed by the step).
            blocks: Step only these blocks, in this order (default: all with gradients), e.g. one block as soon as
                backward has completed its gradients.
            commit: Commit at once; with ``False`` the writes go on in the background and :meth:`commit` (after
                the last block of the optimizer step) makes them the new step.
            grad_scale: Multiplies every gradient before the step (``clip_grad_norm_``'s clamped coefficient, a
                0-dim tensor, for clipping by global norm with spilled gradients; see :meth:`grad_norms`).
            grad_clip_value: Clamps every gradient to ``[-grad_clip_value, grad_clip_value]`` before the step (after
                ``grad_scale``), as ``torch.nn.utils.clip_grad_value_`` does: clipping by value, element by element.
        """
        if grads not in ("param", "disk"):
            raise ValueError(f"grads must be 'param' or 'disk', not {grads!r}.")
        if grads == "disk" and not self.spills:
            raise DiskTierError("step(grads='disk') needs a DiskStore built with spill_grads=True.")
        owned = {p for group in optimizer.param_groups for p in group["params"]}
        candidates = range(len(self.params)) if blocks is None else blocks
        if grads == "disk":
            todo = [i for i in candidates if self._grads_present[i]]
        else:
            todo = [i for i in candidates if any(p.grad is not None and p in owned for p in self.params[i])]
        again = [i for i in todo if i in self._pending]
        if again:
            raise DiskTierError(
                f"Block {again[0]} was already stepped in this optimizer step; commit() the step before stepping it"
                " again."
            )
        # Up to ``target`` blocks are read ahead, the block being stepped included. The reads wait for their buffers
        # on the store's reader thread, not here: a block whose bytes have landed is stepped while the write of the
        # one before still holds the buffer the next read will take (measured on a virtual disk, 3 buffers of a
        # 214M-parameter Llama's layers: the thread stepping waited 1.8 s of a 3.2 s step for such buffers).
        target = min(1 + self.read_ahead, self.pool.count)
        reads: deque[tuple[int, Optional[Future[None]], Future[_StepRead]]] = deque()
        upcoming = iter(todo)
        try:
            for index in todo:
                while len(reads) < target:
                    following = next(upcoming, None)
                    if following is None:
                        break
                    # Taken here, on the caller's thread, with the rest of the store's bookkeeping.
                    spilled = self._spill_writes.pop(following, None) if grads == "disk" else None
                    reads.append((following, spilled,
                                  self._reader.submit(self._start_read, following, grads == "disk", spilled)))
                read_index, buffer, record_read, grad_read = self.clock.wait(reads.popleft()[2], "read_wait")
                assert read_index == index
                try:
                    self.clock.wait(record_read, "read_wait")
                    if grad_read is not None:
                        self.clock.wait(grad_read, "read_wait")
                    began = time.perf_counter()
                    record, holder = self._step_block(optimizer, index, buffer, grads == "disk", owned, grad_scale,
                                                      grad_clip_value)
                    self.clock.add("step_compute", time.perf_counter() - began)
                except BaseException:
                    self.pool.release(buffer)
                    raise
                if holder is buffer:
                    # The buffer goes back once the record's bytes have left it, before the fsync: the commit
                    # waits for the fsync (the future), the next read needs only the buffer.
                    future = self.files.write(self._slot_path(index, record.slot), holder, record.file_bytes,
                                              durable=True, written=lambda buffer=buffer: self.pool.release(buffer))
                else:
                    self.pool.release(buffer)
                    future = self.files.write(self._slot_path(index, record.slot), holder, record.file_bytes,
                                              durable=True)
                self._pending[index] = (record, future, grads == "disk")
        except BaseException:
            # The buffer of the block that failed is back already: every read still queued gets one in turn.
            while reads:
                following, spilled, ahead = reads.popleft()
                if ahead.cancel():
                    if spilled is not None:  # never waited for: the next spill or step of the block waits for it
                        self._spill_writes.setdefault(following, spilled)
                    continue
                if ahead.exception() is not None:
                    continue
                _, buffer, record_read, grad_read = ahead.result()
                for job in (record_read, grad_read):
                    if job is not None:
                        job.exception()
                self.pool.release(buffer)
            self.abort()
            raise
        if commit:
            self.commit()

    def commit(self) -> None:
        """Makes the blocks stepped since the last commit the folder's new step, once each is durable.

        Raises:
            DiskTierError: A write failed (the error names the file); the folder stays at the previous step.
        """
        try:
            for _, future, _ in self._pending.values():
                self.clock.wait(future, "write_wait")
            records = list(self.records)
            for index, (record, _, _) in self._pending.items():
                records[index] = record
            _commit(self.path, self._manifest(self.step_count + 1, records))
        except BaseException:
            self.abort()
            raise
        self.records = records
        self.step_count += 1
        for index, (_, _, consumed_grads) in self._pending.items():
            if consumed_grads:
                self._grads_present[index].clear()
        self._pending = {}

    def abort(self) -> None:
        """Discards the blocks stepped since the last commit (waiting for their writes): the store is back at the
        committed step, as after a crash. The caller's optimizer step has failed and must be repeated whole."""
        for _, future, _ in self._pending.values():
            future.exception()
        self._pending = {}

    def discard_grads(self, index: Optional[int] = None, params: Optional[Iterable[int]] = None) -> None:
        """Drops spilled gradients unstepped: every block's (a step a gradient scaler skips for non-finite ones), or
        block ``index``'s, or only those of its parameters at the positions ``params`` (a ``zero_grad`` of part of
        the block: the next spill writes theirs afresh, and adds to the others')."""
        indices = range(len(self.params)) if index is None else [index]
        for block in indices:
            present = self._grads_present[block]
            if params is None:
                future = self._spill_writes.pop(block, None)
                if future is not None:
                    future.exception()
                present.clear()
            else:
                present.difference_update(params)
            self._grad_norms.pop(block, None)

    def spilled_params(self, index: int) -> list[nn.Parameter]:
        """Block ``index``'s parameters whose gradients are spilled (and not consumed by a committed step)."""
        present = self._grads_present[index]
        return [param for position, param in enumerate(self.params[index]) if position in present]

    def _current(self, index: int) -> Record:
        """Block ``index``'s newest record: stepped but not committed yet (once written), else committed."""
        pending = self._pending.get(index)
        if pending is None:
            return self.records[index]
        pending[1].result()
        return pending[0]

    def _start_read(self, index: int, with_grads: bool, spilled: Optional[Future[None]]) -> _StepRead:
        """On the reader thread: takes a buffer for block ``index`` (waiting for one) and starts reading its record
        and, ``with_grads``, its spilled gradients (once their write ``spilled`` is done) into it."""
        record = self.records[index]
        buffer = self.pool.acquire(self._buffer_need(index))
        record_read: Optional[Future[None]] = None
        try:
            record_read = self.files.read(self._slot_path(index, record.slot), buffer, record.file_bytes)
            grad_read = None
            if with_grads:
                if spilled is not None:
                    spilled.result()  # the gradient file must be whole before it is read back
                grad_read = self.files.read(self.path / _grad_name(index), buffer, self._grad_bytes(index),
                                            start=self._grad_offset(index))
        except BaseException:
            if record_read is not None:
                record_read.exception()  # never hand a buffer back while a read still fills it
            self.pool.release(buffer)
            raise
        return index, buffer, record_read, grad_read

    def _step_block(
        self,
        optimizer: Optimizer,
        index: int,
        buffer: Tensor,
        grads_on_disk: bool,
        owned: set[nn.Parameter],
        grad_scale: Optional[Tensor],
        grad_clip_value: Optional[float] = None,
    ) -> tuple[Record, Tensor]:
        """Steps block ``index`` in ``buffer`` (its committed record) and lays the new record out in it (or, if it
        outgrew the buffer, in a new one). Returns the record and the buffer that holds it."""
        record, params = self.records[index], self.params[index]
        masters = record.masters()
        for entry, param in zip(masters, params):
            param.data = entry.view_of(buffer)
        if grads_on_disk:
            grad_base = buffer[self._grad_offset(index) :]
            present = self._grads_present[index]
            for entry, param in zip(masters, params):
                param.grad = entry.view_of(grad_base) if entry.param in present else None
        for param in params:
            optimizer.state.pop(param, None)
        for entry in record.entries:
            if entry.key is not None:
                optimizer.state[params[entry.param]][entry.key] = entry.view_of(buffer)
        for param_index, values in record.values.items():
            for key, value in values.items():
                optimizer.state[params[param_index]][key] = _decode_value(value)
        try:
            stepped = {p for p in params if p.grad is not None and p in owned}
            if grad_scale is not None:
                for param in params:
                    if param in stepped:
                        param.grad.mul_(grad_scale)  # type: ignore[union-attr]
            if grad_clip_value is not None:
                for param in params:
                    if param in stepped:
                        param.grad.clamp_(min=-grad_clip_value, max=grad_clip_value)  # type: ignore[union-attr]
            with restricted(optimizer, stepped):
                optimizer.step()
            states = [_own_state(optimizer, p) for p in params]
            entries, values = _layout(params, states)
            new = Record(1 - record.slot, entries, values)
            # The spilled gradients are consumed by now: the new record may take the whole buffer.
            if new.file_bytes > buffer.numel():
                # More state than the probe foretold: an unbounded pool grows for the blocks to come, and this
                # record is written from a buffer of its own.
                if self.pool.bounded:
                    raise DiskTierError(
                        f"Block {index}'s record grew to {format_bytes(new.file_bytes)} (its optimizer state), more"
                        f" than a buffer of host_buffer_bytes={self.pool.count * self.pool.buffer_bytes} holds"
                        f" ({self.pool.count} x {format_bytes(self.pool.buffer_bytes)}). Raise host_buffer_bytes to"
                        f" at least {self.pool.count * (new.file_bytes + self._grad_bytes(index))}, or leave it unset."
                    )
                self.pool.grow(new.file_bytes + (self._grad_bytes(index) if self.spills else 0))
                grown = _aligned_buffer(new.file_bytes)
                for entry in entries:
                    entry.view_of(grown).copy_(_tensor_of(entry, params, states))
                grown[new.nbytes :].zero_()
                return new, grown
            if [_signature(e) for e in entries] == [_signature(e) for e in record.entries]:
                for entry in entries:  # the optimizer may have replaced a tensor instead of updating it in place
                    tensor = _tensor_of(entry, params, states)
                    if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
                        entry.view_of(buffer).copy_(tensor)
            else:
                # The layout changed (the first step creates the state): place every tensor anew. Tensors of the
                # buffer that move are cloned first so that no copy overwrites one yet to be read; the masters lead
                # both layouts and stay where they are.
                tensors = [_tensor_of(e, params, states) for e in entries]
                moving = [_inside(t, buffer) and t.data_ptr() != e.view_of(buffer).data_ptr()
                          for e, t in zip(entries, tensors)]
                tensors = [t.clone() if move else t for t, move in zip(tensors, moving)]
                for entry, tensor in zip(entries, tensors):
                    if tensor.data_ptr() != entry.view_of(buffer).data_ptr():
                        entry.view_of(buffer).copy_(tensor)
                buffer[new.nbytes : new.file_bytes].zero_()  # the file's padding: keep it defined
            return new, buffer
        finally:
            for param in params:
                optimizer.state.pop(param, None)
                _park(param)
                if grads_on_disk:
                    param.grad = None
        return new

    # -- checkpoints ----------------------------------------------------------------------------------------------

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
            _link_or_copy(self.path / name, target / name)
        _commit(target, manifest)
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
                lease = self.prefetch_masters(index)
                try:
                    yield from lease.wait()
                finally:
                    lease.release()
            yield from extra.values()

        write_safetensors(path, layout, tensors(), dtype, {"superpipe_step": str(self.step_count)})

    # -- helpers --------------------------------------------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.files.bytes_written

    def _slot_path(self, index: int, slot: int) -> Path:
        return self.path / _slot_name(index, slot)

    def _grad_bytes(self, index: int) -> int:
        return page_rounded(max(_master_bytes(self.params[index]), 1))

    def _grad_offset(self, index: int) -> int:
        """Where spilled gradients go in a step's buffer: after the largest record the block may have."""
        return page_rounded(max(self._record_estimate(index), self.records[index].file_bytes))

    def _record_estimate(self, index: int) -> int:
        params = self.params[index]
        return page_rounded(_master_bytes(params) + sum(self._state_size.record_bytes(p.numel()) for p in params))

    def _buffer_need(self, index: int) -> int:
        need = max(self._record_estimate(index), self.records[index].file_bytes)
        return need + (self._grad_bytes(index) if self.spills else 0)

    def _manifest(self, step: int, records: Sequence[Record]) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "step": step, "names": self.names,
                "blocks": [r.to_json() for r in records]}


# ---------------------------------------------------------------------------------------------------------------------
# Module helpers


def _slot_name(index: int, slot: int) -> str:
    return f"block{index:05d}.{slot}.bin"


def _grad_name(index: int) -> str:
    return f"grad{index:05d}.bin"


def _park(param: nn.Parameter) -> None:
    """Points ``param`` at a placeholder of its shape and dtype that holds no memory (its value is on disk): NaN
    where the dtype has it, so that code reading the parameter's values during the run (a callback logging weight
    norms) gets NaN, not plausible zeros (``state_dict()`` gives the values)."""
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    param.data = torch.full((), fill, dtype=param.dtype).expand(param.shape)


def _own_state(optimizer: Optional[Optimizer], param: nn.Parameter) -> dict[str, Any]:
    if optimizer is None or param not in optimizer.state:
        return {}
    return dict(optimizer.state[param])


def _tensor_of(entry: Entry, params: Sequence[Tensor], states: Sequence[Mapping[str, Any]]) -> Tensor:
    return params[entry.param].detach() if entry.key is None else states[entry.param][entry.key]


def _signature(entry: Entry) -> tuple[Any, ...]:
    return entry.param, entry.key, entry.dtype, entry.shape, entry.offset


def _inside(tensor: Tensor, buffer: Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()


def _fill(record: Record, buffer: Tensor, params: Sequence[Tensor], states: Sequence[Mapping[str, Any]]) -> None:
    for entry in record.entries:
        entry.view_of(buffer).copy_(_tensor_of(entry, params, states))


def write_safetensors(
    path: PathLike,
    layout: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    tensors: Iterable[Tensor],
    dtype: Optional[torch.dtype] = None,
    metadata: Optional[Mapping[str, str]] = None,
    written: Optional[Callable[[Tensor], None]] = None,
) -> None:
    """Writes a safetensors file one tensor at a time (``safetensors``' own writer holds every tensor's bytes at
    once): the header from ``layout`` (name, dtype, shape of each), then each of ``tensors`` in that order, cast to
    ``dtype`` where it is floating-point, each handed to ``written`` once its bytes are out. The file appears whole or
    not at all (written beside, ``fsync``ed, renamed).

    Raises:
        DiskTierError: Naming the file, where writing it failed (a missing folder, a full disk).
    """

    def out_dtype(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, d, shape in layout:
        nbytes = math.prod(shape) * out_dtype(d).itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[out_dtype(d)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    iterator = iter(tensors)
    try:
        with open(temporary, "wb") as out:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for name, _, shape in layout:
                tensor = next(iterator, None)
                if tensor is None or tuple(tensor.shape) != tuple(shape):
                    found = "no tensor" if tensor is None else f"shape {tuple(tensor.shape)}"
                    raise ValueError(f"write_safetensors: {name} has {found}, not shape {tuple(shape)}.")
                _write_tensor(out, tensor.detach().to("cpu", out_dtype(tensor.dtype)))
                if written is not None:
                    written(tensor)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise _io_error("writing", target, error) from error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # a generator's clean-up (a lease it holds) runs now, also after a failure


#: ``madvise`` advice that reclaims pages now (Linux 5.4): clean file pages are dropped, to be read again if touched.
_MADV_PAGEOUT = 21


class MappedFiles:
    """This process's private file mappings (``/proc/self/maps``, read when built), so that a reader of tensors mapped
    from files (:meth:`DiskStore.map_masters`: the parameters after a disk-tier run) can give their pages back once
    read: mapped pages count in the resident set until reclaimed. Anonymous memory (a model in RAM) is never
    advised: reclaiming it would push it to swap."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    # Private file mappings only: a shared one (the node's homes in /dev/shm) may be another
                    # process's working memory.
                    private = len(fields) == 6 and fields[1].endswith("p")
                    if private and fields[5].startswith("/") and int(fields[4]) != 0:
                        start, end = (int(address, 16) for address in fields[0].split("-"))
                        self._ranges.append((start, end))
        except OSError:
            pass  # not Linux: nothing to give back
        self._ranges.sort()
        self._libc = ctypes.CDLL(None, use_errno=True) if self._ranges else None

    def maps(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s bytes (a contiguous tensor's) lie in a file mapping."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(low <= start and end <= high for low, high in self._ranges)

    def release(self, tensor: Tensor) -> None:
        """Reclaims the pages of a contiguous ``tensor`` if it is file-mapped (its values stay: they are read again
        from the file, or from swap for pages written since, when touched). Silently nothing on older kernels."""
        if self._libc is None or not tensor.is_contiguous() or not self.maps(tensor):
            return
        start = tensor.data_ptr()
        first = start - start % PAGE
        length = start + tensor.numel() * tensor.element_size() - first
        self._libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_PAGEOUT)


def _write_tensor(out: Any, tensor: Tensor) -> None:
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    if flat.numel():
        out.write(_byte_view(flat, flat.numel()))


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


def _check_blocks(blocks: Sequence[Mapping[str, nn.Parameter]]) -> None:
    seen: set[str] = set()
    for block in blocks:
        for name, param in block.items():
            if name in seen:
                raise ValueError(f"The parameter name {name!r} appears in two blocks; names must be unique.")
            seen.add(name)
            if param.device.type != "cpu":
                raise ValueError(f"{name} is on {param.device}; the disk tier takes host (CPU) parameters.")


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DiskTierError(
            f"{str(folder)!r} holds no committed disk tier ({MANIFEST} is missing): nothing to open. Create one with"
            " DiskStore.create, or restore a checkpoint's copy with DiskStore.restore."
        ) from error
    except (OSError, ValueError) as error:
        raise DiskTierError(f"The disk tier's manifest {str(path)!r} cannot be read: {error}.") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DiskTierError(f"{str(path)!r} is not a version-{VERSION} superpipe disk tier manifest.")
    return manifest


def _check_manifest(folder: Path, manifest: Mapping[str, Any], blocks: Sequence[Mapping[str, nn.Parameter]]) -> None:
    """Raises :class:`DiskTierError` unless the manifest describes ``blocks`` and its committed files are whole."""
    names = [list(b) for b in blocks]
    if manifest["names"] != names:
        raise DiskTierError(
            f"The disk tier in {str(folder)!r} was written for other blocks ({len(manifest['names'])} blocks, first"
            f" names {manifest['names'][0][:2] if manifest['names'] else []}) than the model's ({len(names)} blocks,"
            f" {names[0][:2] if names else []}). Open it with the model it was written for."
        )
    for index, (block, data) in enumerate(zip(blocks, manifest["blocks"])):
        record = Record.from_json(data)
        params = list(block.values())
        for entry in record.masters():
            param = params[entry.param]
            if tuple(param.shape) != entry.shape or param.dtype != entry.dtype:
                raise DiskTierError(
                    f"{names[index][entry.param]} is {tuple(param.shape)} {param.dtype} in the model but"
                    f" {entry.shape} {entry.dtype} in the disk tier in {str(folder)!r}."
                )
        path = folder / _slot_name(index, record.slot)
        try:
            size = path.stat().st_size
        except FileNotFoundError as error:
            raise DiskTierError(
                f"The disk tier's file {str(path)!r} (block {index} of committed step {manifest['step']}) is missing."
                " Restore the folder from a checkpoint's copy (DiskStore.restore)."
            ) from error
        _check_length(path, size, record.file_bytes)


def _replace(source: Path, target: Path) -> None:
    os.replace(source, target)


def _commit(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Makes ``manifest`` the folder's committed step, atomically and durably."""
    _fsync_dir(folder)  # the directory entries of files created by this step first
    temporary = folder / (MANIFEST + ".tmp")
    path = folder / MANIFEST
    try:
        with open(temporary, "w") as out:
            json.dump(manifest, out)
            out.flush()
            os.fsync(out.fileno())
        _replace(temporary, path)
        _fsync_dir(folder)
    except OSError as error:
        raise _io_error("committing", path, error) from error


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
        return
    except FileNotFoundError as error:
        raise DiskTierError(f"The disk tier's file {str(source)!r} is missing; it cannot be copied.") from error
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise _io_error("linking", target, error) from error
    try:  # another file system: copy, durably
        with open(source, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK_BYTES)
            dst.flush()
            os.fsync(dst.fileno())
            os.posix_fadvise(dst.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as error:
        target.unlink(missing_ok=True)
        raise _io_error("copying", target, error) from error
