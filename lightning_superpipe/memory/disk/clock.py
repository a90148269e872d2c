"""Where the disk tier's time goes: cheap wall-clock counters of its reads, writes, waits and arithmetic."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Literal

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
