"""An emulated asynchronous device: the CUDA copy protocol on the CPU, with deferred copies and a checker.

On a CPU compute device every copy is done when it returns, so no test can notice a missing wait. Under
``SuperpipeStrategy(link=EmulatedLink(...))`` the engine takes its CUDA code paths (staging buffers, the gradient
worker, events) with copies that really are deferred:

* Each emulated stream (host-to-device, device-to-host) is a queue. ``mode="lazy"`` runs a copy only when an event
  at or after it is waited for or the link is synchronized: the latest a GPU could run it. ``mode="thread"`` runs
  each stream on its own thread, after a seeded random delay.
* A destination is filled with NaN when its copy is issued and receives the data only when the copy runs; the
  source is snapshotted at issue and compared when the copy runs, so a host write into a buffer that an in-flight
  copy still reads taints the destination, and reading it raises.
* A happens-before checker (a ``TorchDispatchMode`` on the compute thread and on the engine's threads) sees every
  tensor that every operator touches, by address range, so views at an offset and reused memory are covered (the
  blind spots of ``TORCH_CUDA_SANITIZER``). It raises :class:`OrderingViolation`, naming the buffer and both
  accesses, when compute or host code touches a buffer a copy writes before waiting for that copy's event (read
  after write), or when a copy into a buffer is issued after no event, or after one that does not cover compute's
  last use of that memory (write after read: on a GPU the queued kernels may still read it), or when device memory
  that a copy writes is freed and compute goes on before waiting for that copy (on a GPU the caching allocator hands
  the memory to the next allocation, which the copy then overwrites).
* ``bandwidth=`` makes each copy take the time it would take on a link of that speed (each stream one copy at a
  time); waiting for an event blocks until then, and :attr:`EmulatedLink.stats` counts the exposed waiting time.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _pop_mode, _push_mode

from lightning_superpipe.streaming.copier import Copier, Event
from lightning_superpipe.units import parse_bytes

_COMPUTE = "compute"
# Operators that touch no data: creating views, reading metadata.
_METADATA_OPS = {"detach", "alias", "lift_fresh", "empty_like", "size", "stride", "dim", "numel", "is_same_size"}


class OrderingViolation(RuntimeError):
    """Raised by the emulated link's checker: an access that a GPU would not order after the copy it depends on."""


def parse_bandwidth(value: Union[None, int, float, str]) -> Optional[float]:
    """Bytes per second from ``8e9``, ``"8GB/s"``, ``"500 MiB/s"``; ``None`` stays ``None`` (no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"EmulatedLink(bandwidth={value!r}) must be bytes per second or a string such as '8GB/s'.")
    if isinstance(value, str):
        try:
            value = parse_bytes(value, per_second=True)
        except ValueError:
            raise ValueError(
                f"EmulatedLink(bandwidth={value!r}): expected e.g. '8GB/s', '500MiB/s' or a number."
            ) from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"EmulatedLink(bandwidth={value!r}) must be a positive number of bytes per second.")
    return float(value)


@dataclass
class LinkStats:
    """What an emulated link did: copies, bytes, and the time threads spent waiting for copies."""

    copies: int = 0
    bytes: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    violations: list[str] = field(default_factory=list)


class EmulatedLink:
    """Emulates an asynchronous host-device link for a CPU compute device.

    Args:
        mode: ``"lazy"`` runs each copy as late as a GPU could; ``"thread"`` runs each stream on a thread of its
            own after a random delay.
        seed: Seeds the delays of ``"thread"``.
        max_delay_s: The longest random delay before a copy runs in ``"thread"`` mode.
        bandwidth: Bytes per second (a number, or a string such as ``"8GB/s"``); each copy then takes
            ``bytes / bandwidth`` seconds, one at a time per stream. ``None``: copies take no modelled time.
        check: Run the happens-before checker (it slows every operator down; the deferred copies and NaN
            fills still catch most bugs without it).
        verify: Fill each destination with NaN and snapshot each source when a copy is issued (a reader that did
            not wait, or a write into a copy's source, shows); ``False`` for timing only (benchmarks), where that
            work on the compute thread would be cost a GPU does not have.
    """

    def __init__(
        self,
        mode: str = "lazy",
        seed: int = 0,
        max_delay_s: float = 1e-3,
        bandwidth: Union[None, int, float, str] = None,
        check: bool = True,
        verify: bool = True,
    ) -> None:
        if mode not in ("lazy", "thread"):
            raise ValueError(f"EmulatedLink(mode={mode!r}) must be 'lazy' or 'thread'.")
        if not isinstance(max_delay_s, (int, float)) or max_delay_s < 0:
            raise ValueError(f"EmulatedLink(max_delay_s={max_delay_s!r}) must be zero or more seconds.")
        self.mode = mode
        self.seed = seed
        self.max_delay_s = float(max_delay_s)
        self.bandwidth = parse_bandwidth(bandwidth)
        self.check = check
        self.verify = verify
        self.stats = LinkStats()

    def copier(self, device: torch.device) -> EmulatedCopier:
        if device.type != "cpu":
            raise ValueError(
                f"SuperpipeStrategy(link=EmulatedLink(...)) emulates an asynchronous device on the CPU, but the compute"
                f" device is {device}. Remove `link=` to use the real {device.type} link."
            )
        return EmulatedCopier(device, self)

    def __repr__(self) -> str:
        return f"EmulatedLink(mode={self.mode!r}, seed={self.seed}, bandwidth={self.bandwidth})"


@dataclass(eq=False)
class _Copy:
    stream: str
    seq: int
    dst: Tensor
    source: Tensor  # what the copy reads, to compare with the snapshot when it runs
    snapshot: Tensor
    what: str
    done_at: float  # when the modelled link finishes it (0: no bandwidth model)
    not_before: float  # thread mode: the random delay
    inference: bool  # issued under inference mode (a CUDA copy may write an inference tensor from any stream)


@dataclass(frozen=True)
class _EmulatedEvent:
    stream: str
    seq: int
    done_at: float = 0.0


@dataclass
class _Range:
    """A buffer that copies write: its address range, its last copy (stream, sequence number) and whether the data
    the last copy that ran left there is unreliable."""

    start: int
    end: int
    storage: int  # the storage it belongs to: memory freed and handed to another storage is not this buffer
    what: str
    last_copy: Optional[tuple[str, int]] = None
    tainted_by: str = ""
    # Set when the storage is freed: a later storage may reuse both its memory and its StorageImpl's address.
    freed: bool = False


class EmulatedCopier(Copier):
    """The :class:`~lightning_superpipe.streaming.copier.CudaCopier` protocol on the CPU (see the module)."""

    asynchronous = True
    pin_memory = False

    def __init__(self, device: torch.device, link: EmulatedLink) -> None:
        super().__init__(device)
        self.link = link
        self._lock = threading.RLock()
        self._ran = threading.Condition(self._lock)
        self._queues: dict[str, deque[_Copy]] = {"h2d": deque(), "d2h": deque()}
        self._issued = {"h2d": 0, "d2h": 0}
        self._executed = {"h2d": 0, "d2h": 0}
        self._busy_until = {"h2d": 0.0, "d2h": 0.0}
        self._random = random.Random(link.seed)
        # Per thread: the highest copy of each stream that thread has waited for.
        self._waited: dict[int, dict[str, int]] = {}
        # Compute may have run before the checker watched: a copy into fresh memory must be ordered after it.
        self._clock = 1
        self._ranges: list[_Range] = []
        # Device buffers whose storage died with a copy into them that compute may not have waited for.
        self._freed_in_flight: list[_Range] = []
        # Compute's accesses by storage: start -> (end, clock, operator), for write-after-read checks.
        self._history: dict[int, tuple[int, int, str]] = {}
        self._closed = False
        self._failure: Optional[BaseException] = None  # thread mode: a copy that raised on its stream's thread
        self._checker = _Checker(self) if link.check else None
        self._main_thread = threading.get_ident()
        if self._checker is not None:
            _push_mode(self._checker)
        self._threads: list[threading.Thread] = []
        if link.mode == "thread":
            for stream in self._queues:
                thread = threading.Thread(
                    target=self._run_stream, args=(stream,), name=f"emulated-{stream}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    # ------------------------------------------------------------------ the copier interface

    def to_device(self, dst: Tensor, src: Tensor, after: Event = None, what: str = "") -> Event:
        self._check_write_after_read(dst, after, what)
        return self._issue("h2d", dst, src, what)

    def to_host(self, dst: Tensor, src: Tensor, what: str = "") -> Event:
        # As on CUDA, the device-to-host stream waits for all compute issued so far, which produced ``src``.
        return self._issue("d2h", dst, src, what)

    def mark_compute(self) -> Event:
        with self._lock:
            self._clock += 1
            return _EmulatedEvent(_COMPUTE, self._clock)

    def wait_on_compute(self, event: Event) -> None:
        self._wait(event)

    def wait_on_host(self, event: Event) -> None:
        self._wait(event)

    def synchronize(self) -> None:
        with self._lock:
            last = {stream: _EmulatedEvent(stream, self._issued[stream]) for stream in self._queues}
            done_at = max(self._busy_until.values())
        for event in last.values():
            self._wait(event, count=False)
        _sleep_until(done_at)

    def thread_initializer(self) -> Optional[Callable[[], None]]:
        checker = self._checker
        return (lambda: _push_mode(checker)) if checker is not None else None

    def close(self) -> None:
        try:
            if self._failure is None:  # else a waiter raised it already, and the failed stream runs nothing more
                self.synchronize()
        finally:
            with self._lock:
                self._closed = True
                self._ran.notify_all()
            for thread in self._threads:
                thread.join()
            if self._checker is not None and threading.get_ident() == self._main_thread:
                _pop_checker(self._checker)

    # ------------------------------------------------------------------ issuing and running copies

    def _issue(self, stream: str, dst: Tensor, src: Tensor, what: str) -> _EmulatedEvent:
        with self._lock, _unwatched():
            snapshot = src.detach().clone() if self.link.verify else src.detach()
            if dst.is_floating_point() and self.link.verify:
                dst.fill_(float("nan"))  # what a reader that did not wait finds
            self._issued[stream] += 1
            nbytes = dst.numel() * dst.element_size()
            now = time.perf_counter()
            done_at = 0.0
            if self.link.bandwidth is not None:
                start = max(now, self._busy_until[stream])
                done_at = self._busy_until[stream] = start + nbytes / self.link.bandwidth
            delay = self._random.uniform(0.0, self.link.max_delay_s) if self.link.mode == "thread" else 0.0
            copy = _Copy(
                stream, self._issued[stream], dst, src, snapshot, what or "a buffer", done_at, now + delay,
                torch.is_inference_mode_enabled(),
            )
            self._queues[stream].append(copy)
            self._ran.notify_all()  # wakes the stream's thread
            self._range_of(dst, copy.what).last_copy = (stream, copy.seq)
            self.link.stats.copies += 1
            self.link.stats.bytes += nbytes
            return _EmulatedEvent(stream, copy.seq, done_at)

    def _run_one(self, stream: str) -> None:
        """Runs the oldest queued copy of ``stream`` (the lock is held)."""
        copy = self._queues[stream].popleft()
        with _unwatched():
            # A host write into the source while the copy was in flight: on a GPU the copy would read a mix. Harmless
            # if nothing reads the result before a later copy replaces it (the engine re-copies what it saw change).
            changed = self.link.verify and not _same_bits(copy.source, copy.snapshot)
            self._range_of(copy.dst, copy.what).tainted_by = (
                f"the host wrote the source of copy #{copy.seq} on {stream} into {copy.what} while it was in flight"
                if changed
                else ""
            )
            with torch.inference_mode(copy.inference):  # the issuer's mode: it is thread-local, and so was its check
                copy.dst.copy_(copy.snapshot)
        self._executed[stream] = copy.seq
        self._ran.notify_all()

    def _run_stream(self, stream: str) -> None:
        """Thread mode: runs ``stream``'s copies in order, each after its random delay."""
        with self._lock:
            while True:
                while not self._queues[stream] and not self._closed:
                    self._ran.wait()
                if not self._queues[stream]:
                    return
                pause = self._queues[stream][0].not_before - time.perf_counter()
                if pause > 0:
                    self._ran.wait(pause)
                    continue
                try:
                    self._run_one(stream)
                except BaseException as error:  # waiters raise it instead of waiting for ever
                    self._failure = error
                    self._ran.notify_all()
                    return

    def _wait(self, event: Event, count: bool = True) -> None:
        if event is None:
            return
        assert isinstance(event, _EmulatedEvent), f"not an event of this emulated link: {event!r}"
        started = time.perf_counter()
        with self._lock:
            if event.stream != _COMPUTE:
                while self._executed[event.stream] < event.seq:
                    if self._failure is not None:
                        raise RuntimeError(f"a copy on the emulated {event.stream} stream failed") from self._failure
                    if self.link.mode == "lazy":
                        self._run_one(event.stream)
                    else:
                        self._ran.wait()
                waited = self._waited.setdefault(threading.get_ident(), {})
                waited[event.stream] = max(waited.get(event.stream, 0), event.seq)
        _sleep_until(event.done_at)
        if count:
            self.link.stats.waits += 1
            self.link.stats.wait_seconds += time.perf_counter() - started

    # ------------------------------------------------------------------ the happens-before checker

    def _range_of(self, tensor: Tensor, what: str) -> _Range:
        start, end = _extent(tensor)
        storage = tensor.untyped_storage()._cdata
        for known in self._ranges:
            if known.start == start and known.end == end and known.storage == storage and not known.freed:
                known.what = what
                return known
        # A new buffer at an address an old one used (freed, reused): the old one's entry goes.
        self._ranges = [r for r in self._ranges if r.end <= start or r.start >= end]
        known = _Range(start, end, storage, what)
        self._ranges.append(known)
        # Storages keep one Python object for as long as they live: its end is the buffer's.
        weakref.finalize(tensor.untyped_storage(), _storage_freed, weakref.ref(self), known)
        return known

    def _check_freed_in_flight(self) -> None:
        """Compute goes on: no device buffer may have been freed while a copy into it can still run, unless some
        thread waited for that copy (on a GPU the memory goes to the next allocation on the compute stream, and the
        copy overwrites it; compute waiting for the copy orders that allocation's use after it, a host thread waiting
        for it saw it done). A copy still queued holds its destination here: it is freed where nothing else does."""
        ranges, self._freed_in_flight = self._freed_in_flight, []
        freed = [(r.last_copy[1], r.what) for r in ranges if r.last_copy is not None]
        freed += [(copy.seq, copy.what) for copy in self._queues["h2d"] if _held_only_by(copy)]
        if not freed:
            return
        waited = max((streams.get("h2d", 0) for streams in self._waited.values()), default=0)
        for seq, what in freed:
            if waited < seq:
                self._violation(
                    f"{what} was freed while copy #{seq} on h2d into it could still run, and compute went on without"
                    " waiting for it; on a GPU the caching allocator may hand that memory to the next allocation,"
                    " which the copy then overwrites. Wait on the copy's event before dropping the buffer."
                )

    def _check_write_after_read(self, dst: Tensor, after: Event, what: str) -> None:
        if self._checker is None or self._closed:
            return
        start, end = _extent(dst)
        with self._lock:
            last = max(
                ((clock, op) for s, (e, clock, op) in self._history.items() if s < end and e > start),
                default=(1, "compute before the link was watched"),  # fresh memory: whatever ran before
            )
            covered = after.seq if isinstance(after, _EmulatedEvent) and after.stream == _COMPUTE else 0
            if covered < last[0]:
                ordered = "after no event" if after is None else f"after compute event {covered}"
                self._violation(
                    f"write after read: a copy into {what or 'a buffer'} was issued {ordered}, but compute used that"
                    f" memory at compute clock {last[0]} ({last[1]}); on a GPU the copy could overwrite it before the"
                    " queued kernels read it. Issue the copy after `mark_compute()` recorded past that use."
                )

    def _check_access(self, tensors: list[Tensor], op: str) -> None:
        thread = threading.get_ident()
        with self._lock:
            if self._closed:  # a checker left on some thread's mode stack watches nothing any more
                return
            self._clock += 1
            waited = self._waited.get(thread, {})
            if thread == self._main_thread:
                self._check_freed_in_flight()
            for tensor in tensors:
                start, end = _extent(tensor)
                if end <= start:
                    continue
                storage = tensor.untyped_storage()._cdata
                stale = [
                    r for r in self._ranges if r.start < end and r.end > start and (r.storage != storage or r.freed)
                ]
                if stale:  # freed since its copy ran, and handed to another storage
                    self._ranges = [r for r in self._ranges if r not in stale]
                for known in self._ranges:
                    if known.start >= end or known.end <= start:
                        continue
                    if known.last_copy is not None and waited.get(known.last_copy[0], 0) < known.last_copy[1]:
                        stream, seq = known.last_copy
                        self._violation(
                            f"read after write: {op} touched {known.what} on thread"
                            f" {threading.current_thread().name} without waiting for copy #{seq} on {stream} into it;"
                            " wait on that copy's event first."
                        )
                    if known.tainted_by:
                        self._violation(f"{op} read {known.what}, whose data is unreliable: {known.tainted_by}.")
                if thread == self._main_thread:
                    storage = tensor.untyped_storage()
                    base = storage.data_ptr()
                    self._history[base] = (base + storage.nbytes(), self._clock, op)

    def _violation(self, message: str) -> None:
        self.link.stats.violations.append(message)
        raise OrderingViolation(f"EmulatedLink: {message}")


class _Checker(TorchDispatchMode):
    """Reports every tensor an operator touches to the copier's happens-before checks."""

    def __init__(self, copier: EmulatedCopier) -> None:
        super().__init__()
        self.copier = copier

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not getattr(func, "is_view", False) and name not in _METADATA_OPS:
            touched: list[Tensor] = []
            _cpu_tensors((args, kwargs, output), touched)
            if touched:
                self.copier._check_access(touched, f"compute ({func})")
        return output


def _storage_freed(copier: Callable[[], Optional[EmulatedCopier]], known: _Range) -> None:
    """``known``'s storage died (on whatever thread dropped it last)."""
    known.freed = True
    live = copier()
    if live is not None and known.last_copy is not None and known.last_copy[0] == "h2d":
        live._freed_in_flight.append(known)


class _Holder:
    def __init__(self, value: object) -> None:
        self.value = value


def _refs_when_held_once() -> int:
    """What ``sys.getrefcount`` says of an object that one attribute alone holds (2 on CPython 3.11: it and the
    call's argument)."""
    holder = _Holder(object())
    return sys.getrefcount(holder.value)


_HELD_ONCE = _refs_when_held_once()


def _held_only_by(copy: _Copy) -> bool:
    """Whether a queued copy is all that holds its destination: the tensor object, its ``TensorImpl`` and the
    storage (one tensor, and the storage's own Python object, which ``_range_of`` made)."""
    return (
        sys.getrefcount(copy.dst) <= _HELD_ONCE
        and copy.dst._use_count() <= 1
        and torch._C._storage_Use_Count(copy.dst.untyped_storage()._cdata) <= 2
    )


def _cpu_tensors(values: Any, found: list[Tensor]) -> None:
    """The host tensors among an operator's arguments and results (nested lists, tuples and dicts too): what
    ``tree_flatten`` finds, at a fraction of its cost on the hot path of every operator."""
    for value in values:
        if isinstance(value, Tensor):
            if value.device.type == "cpu":
                found.append(value)
        elif isinstance(value, (list, tuple)):
            _cpu_tensors(value, found)
        elif isinstance(value, dict):
            _cpu_tensors(value.values(), found)


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same bytes: ``torch.equal`` says a NaN differs from itself (gradients under a
    gradient scaler's overflowing scales hold NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8)
    )


def _extent(tensor: Tensor) -> tuple[int, int]:
    """The address range a (possibly strided) tensor covers."""
    if tensor.numel() == 0:
        return 0, 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + span * tensor.element_size()


@contextmanager
def _unwatched() -> Iterator[None]:
    """The link's own reads and writes are not compute."""
    with _disable_current_modes():
        yield


def _pop_checker(checker: _Checker) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    stack = _get_current_dispatch_mode_stack()
    if stack and stack[-1] is checker:
        _pop_mode()


def _sleep_until(moment: float) -> None:
    pause = moment - time.perf_counter()
    if pause > 0:
        time.sleep(pause)
