"""Reading and writing the tier's files: whole files between page-aligned buffers and disk, in chunks on worker
threads, with ``O_DIRECT`` where the file system takes it.

The chunk functions are module-level so that tests can interpose on single writes
(``monkeypatch.setattr(file_io, "_write_chunk", ...)``)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Optional

from torch import Tensor

from lightning_superpipe.memory.disk import space  # free_bytes through its module: tests fake a full disk there
from lightning_superpipe.memory.disk.buffers import _byte_view
from lightning_superpipe.memory.disk.clock import IoClock
from lightning_superpipe.memory.disk.errors import DiskSpaceError, DiskTierError
from lightning_superpipe.memory.pinned import PAGE, page_rounded
from lightning_superpipe.units import format_bytes

#: Default size of one read or write request; a block's I/O is split into chunks spread over the worker threads.
CHUNK_BYTES = 16 << 20


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
            left = f" ({format_bytes(space.free_bytes(path.parent))} free)"
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


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Sizes the file open as ``fd`` to ``nbytes`` and reserves its blocks, so that a full disk fails here, before
    any byte of the record is written."""
    try:
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
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

    def read(self, path: Path, buffer: Tensor, nbytes: int, start: int = 0, offset: int = 0) -> Future[None]:
        """Reads ``nbytes`` (a multiple of the page size) of ``path`` from byte ``offset`` (a page boundary) into
        ``buffer[start:]``."""
        return self._jobs.submit(self._read, path, buffer, nbytes, start, offset)

    def begin(self, path: Path, nbytes: int, scratch: bool = False) -> None:
        """Makes ``path`` a file of ``nbytes`` with its blocks reserved, for :meth:`write_range` to fill (a new file,
        as :meth:`write` makes one; a ``scratch`` file of this store's, such as a gradient file, is kept as is when
        it has that size already). A full disk fails here, before any byte is written."""
        if scratch and path in self._created and path.exists() and path.stat().st_size == nbytes:
            return
        self._unlink_unless_ours(path)
        fd = _open(path, os.O_WRONLY | os.O_CREAT)
        try:
            _reserve(fd, path, nbytes)
        finally:
            os.close(fd)

    def write_range(self, path: Path, buffer: Tensor, nbytes: int, start: int, offset: int,
                    written: Optional[Callable[[], None]] = None) -> Future[None]:
        """Writes ``buffer[start : start + nbytes]`` at byte ``offset`` of ``path`` (made by :meth:`begin`), with
        ``O_DIRECT`` where the store uses it and the range, its place in the buffer and its length are on pages,
        else buffered; ``written`` is called once the bytes have left the buffer (or the write failed)."""
        return self._jobs.submit(self._write_range, path, buffer, nbytes, start, offset, written)

    def finish(self, path: Path, nbytes: int, ranges: list[Future[None]], durable: bool) -> Future[None]:
        """Once the ``ranges`` written into ``path`` are done, sizes it to ``nbytes`` and ``fdatasync``s it when
        ``durable`` (the future is done once it is; it raises the first failure of the ranges')."""
        return self._jobs.submit(self._finish, path, nbytes, ranges, durable)

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

    def _read(self, path: Path, buffer: Tensor, nbytes: int, start: int, offset: int = 0) -> None:
        began = self._begin("read")
        try:
            fd = _open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                _check_length(path, os.fstat(fd).st_size, offset + nbytes)
                self._chunked(_read_chunk, fd, path, buffer, nbytes, start, offset)
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
            self._unlink_unless_ours(path)
            fd = _open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0))
            try:
                _reserve(fd, path, nbytes)
                self._chunked(_write_chunk, fd, path, buffer, nbytes, 0)
                hand_back()
                # The bytes are on the device: reads may go while it makes them durable.
                if self._gate is not None:
                    self._gate.leave()
                gated = False
                if durable:
                    self._make_durable(fd, path)
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

    def _unlink_unless_ours(self, path: Path) -> None:
        """Unlinks ``path`` unless this instance made it and no checkpoint links it, and counts it as ours from now:
        a write makes a new file rather than write into an inode that a checkpoint's copy, or the parameters of an
        earlier run (a private mapping), still read."""
        try:
            if path not in self._created or os.stat(path).st_nlink > 1:
                os.unlink(path)
        except FileNotFoundError:
            pass
        with self._lock:
            self._created.add(path)

    def _write_range(self, path: Path, buffer: Tensor, nbytes: int, start: int, offset: int,
                     written: Optional[Callable[[], None]]) -> None:
        aligned = not (offset % PAGE or nbytes % PAGE or (buffer.data_ptr() + start) % PAGE)
        direct = self.direct and aligned
        began = self._begin("write")
        try:
            fd = _open(path, os.O_WRONLY | (os.O_DIRECT if direct else 0))
            try:
                self._chunked(_write_chunk, fd, path, buffer, nbytes, start, offset)
            finally:
                os.close(fd)
        finally:
            self._end("write")
            if written is not None:
                written()
        with self._lock:
            self.bytes_written += nbytes
            if self.intervals is not None:
                self.intervals.append(("write", began, time.perf_counter(), nbytes))

    def _finish(self, path: Path, nbytes: int, ranges: list[Future[None]], durable: bool) -> None:
        errors = [job.exception() for job in ranges]
        for error in errors:
            if error is not None:
                raise error
        fd = _open(path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_size != nbytes:
                try:
                    os.ftruncate(fd, nbytes)
                except OSError as error:
                    raise _io_error("writing", path, error) from error
            if durable:
                self._make_durable(fd, path)
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # ranges written buffered, if any
        finally:
            os.close(fd)

    def _make_durable(self, fd: int, path: Path) -> None:
        """``fdatasync``s the file open as ``fd``, counting the time under ``fsync``."""
        synced = time.perf_counter()
        try:
            # The data and what reading it needs (size, extents): not the timestamps fsync adds, which cost 1.57
            # against 0.95 s of a 5 s step in the strategy benchmark. The new directory entries are made durable by
            # the commit.
            os.fdatasync(fd)
        except OSError as error:
            raise _io_error("writing", path, error) from error
        finally:
            self.clock.add("fsync", time.perf_counter() - synced)

    def _chunked(self, function: Any, fd: int, path: Path, buffer: Tensor, nbytes: int, start: int,
                 at: int = 0) -> None:
        def run(offset: int) -> None:
            length = min(self.chunk_bytes, nbytes - offset)
            function(fd, _byte_view(buffer, length, start + offset), at + offset, path)
            if not self.direct and function is _read_chunk:
                os.posix_fadvise(fd, at + offset, length, os.POSIX_FADV_DONTNEED)

        futures = [self._chunks.submit(run, offset) for offset in range(0, nbytes, self.chunk_bytes)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
