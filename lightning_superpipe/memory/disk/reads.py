"""The disk tier's reads for the device copies: block masters read ahead into pool buffers (a few blocks beyond the
device slots), copied from there into a slot (cast on the fly into a host staging buffer under mixed precision),
and each buffer given back once the copy no longer reads it. A pipelined step hands over the buffers it stepped
blocks in, so that the next forward copies the new masters from there instead of reading them again.

:class:`~lightning_superpipe.memory.disk.tier.DiskTier` owns one :class:`DiskReads`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from lightning_superpipe.memory.disk import DiskStore, MasterLease
from lightning_superpipe.memory.home import Arena, Event, Link

#: Blocks a pipelined step reads ahead of the one it steps: fewer than the store's default, so that the buffers it
#: hands over to the next forward (the fused read) and the forward's copies in flight leave it room.
PIPELINED_STEP_READ_AHEAD = 1


class DiskReads:
    """Reads ahead and copies in for the disk tier's blocks, through the store's pool.

    Args:
        store: The blocks' store.
    """

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self.copier: Optional[Link] = None
        self._lock = threading.Lock()  # the optimizer thread hands buffers over while the loop reads ahead
        self._ahead: dict[int, MasterLease] = {}
        self._in_flight: deque[tuple[Event, MasterLease]] = deque()
        self._staging: list[list[Any]] = []  # [buffer, event of the copy reading it]
        self._next_staging = 0
        self._cap = max(1, store.pool.count - 1)  # one buffer stays free for a spill or a step on another thread
        # A pipelined step hands over the buffer it stepped a block in and goes on with the block it read ahead, and
        # reads the one after it: what it hands over (and the copies from those in flight) must leave it those.
        self._handover_cap = store.pool.count - 1 - PIPELINED_STEP_READ_AHEAD
        self._handed: set[int] = set()  # blocks in ``_ahead`` whose buffers a pipelined step handed over
        #: Copies that took a block's new masters from the buffer its pipelined step left them in (one read of the
        #: block where there would be two: the step's and the forward's), over the run.
        self.fused_reads = 0

    def attach(self, link: Link, arena: Arena, staging_numel: int, staging_dtype: Any, slots: int) -> None:
        """Connects to the engine's copier; ``staging_numel > 0`` allocates the staging buffers of the on-the-fly
        cast: each copy out of one is waited for before it is written again, so one per slot and one more, so that
        the cast of the next block never waits for the copy just issued."""
        self.copier = link
        if staging_numel:
            self._staging = [[arena.empty(staging_numel, staging_dtype), None] for _ in range(slots + 1)]

    def copy_in(self, dst: Any, index: int, numel: int, master_dtype: Any, transfer_dtype: Any, after: Event,
                what: str) -> Event:
        """Copies block ``index``'s masters (``numel`` of ``master_dtype``, cast to ``transfer_dtype``) into the
        device buffer ``dst``: from a read ahead or a handed-over step's buffer, else read now."""
        assert self.copier is not None
        with self._lock:
            lease = self._ahead.pop(index, None)
            if index in self._handed:
                self._handed.discard(index)
                self.fused_reads += 1
        chunks = self.store.master_chunks(index)
        if len(chunks) > 1:
            return self._copy_in_chunks(dst, index, chunks, lease, numel, master_dtype, transfer_dtype, after, what)
        if lease is None:
            self._make_room()
            lease = self.store.prefetch_masters(index)
        try:
            source = lease.flat(numel, master_dtype)
            if transfer_dtype == master_dtype:
                event = self.copier.to_device(dst, source, after, what)
                if event is None:
                    lease.release()
                else:  # the copy reads the pool buffer until its event
                    self._in_flight.append((event, lease))
                return event
            staging = self._staging[self._next_staging]
            self._next_staging = (self._next_staging + 1) % len(self._staging)
            self.copier.wait_on_host(staging[1])  # the copy that last read this buffer is done
            flat = staging[0][:numel]
            flat.copy_(source)  # the cast on the fly
            lease.release()
            staging[1] = self.copier.to_device(dst, flat, after, what)
            return staging[1]
        except BaseException:
            lease.release()
            raise

    def _copy_in_chunks(self, dst: Any, index: int, chunks: Sequence[tuple[int, int]], first: Optional[MasterLease],
                        numel: int, master_dtype: Any, transfer_dtype: Any, after: Event, what: str) -> Event:
        """:meth:`copy_in` of a block whose masters exceed a pool buffer: a buffer's worth at a time (``first``: the
        first chunk, read ahead), each into its range of the slot, or of the staging buffer of the cast, which is
        copied to the device whole."""
        assert self.copier is not None
        itemsize = master_dtype.itemsize
        staging = None
        if transfer_dtype != master_dtype:
            staging = self._staging[self._next_staging]
            self._next_staging = (self._next_staging + 1) % len(self._staging)
            self.copier.wait_on_host(staging[1])  # the copy that last read this buffer is done
        flat_dst = dst.view(-1)
        event: Event = None
        for number, (start, end) in enumerate(chunks):
            lease = first if number == 0 else None
            if lease is None:
                self._make_room()
                lease = self.store.prefetch_masters(index, number)
            try:
                low, high = start // itemsize, min(end // itemsize, numel)
                source = lease.flat(high - low, master_dtype)
                if staging is not None:
                    staging[0][low:high].copy_(source)  # the cast on the fly
                    lease.release()
                    continue
                event = self.copier.to_device(flat_dst[low:high], source, after, what)
            except BaseException:
                lease.release()
                raise
            if event is None:
                lease.release()
            else:  # the copy reads the pool buffer until its event
                self._in_flight.append((event, lease))
        if staging is not None:
            staging[1] = event = self.copier.to_device(dst, staging[0][:numel], after, what)
        return event

    def read_ahead(self, indices: Iterable[int]) -> None:
        """Starts reading the masters of the blocks expected next (nearest first), as far as the pool allows (of a
        block whose masters exceed a buffer, the first buffer's worth)."""
        # Buffers whose copies are known done go back without waiting (CUDA events answer ``query``).
        while self._in_flight and getattr(self._in_flight[0][0], "query", lambda: False)():
            self._in_flight.popleft()[1].release()
        for index in indices:
            with self._lock:
                if index in self._ahead:
                    continue
                if len(self._ahead) + len(self._in_flight) >= self._cap:
                    return
            # Not under the lock: the read may wait for a buffer that a pipelined step gives back only after
            # handing its previous one over, which takes the lock.
            lease = self.store.prefetch_masters(index)
            with self._lock:
                self._ahead[index] = lease

    def hand_over(self, index: int, lease: Optional[MasterLease]) -> None:
        """On the optimizer thread: a pipelined step's new masters of block ``index``, left in the buffer it stepped
        the block in, for the next forward's copy; released at once where that would leave the step short of
        buffers."""
        if lease is None:
            return
        with self._lock:
            room = len(self._ahead) + len(self._in_flight) < self._handover_cap
            stale = self._ahead.pop(index, None) if room else None
            if room:
                self._ahead[index] = lease
                self._handed.add(index)
        for unused in (stale, None if room else lease):
            if unused is not None:
                unused.release()

    def forget(self, indices: Sequence[int]) -> None:
        """Drops what was read ahead (or handed over) of these blocks (their record changed, or a step failed)."""
        with self._lock:
            leases = [self._ahead.pop(index) for index in indices if index in self._ahead]
            self._handed.difference_update(indices)
        for lease in leases:
            lease.release()

    def release_copied(self) -> None:
        """Waits for the copies in flight and gives their buffers back (before waiting for a pipelined step, which
        may need them)."""
        while self._in_flight:
            self._release_oldest_copy()

    def _release_oldest_copy(self) -> None:
        """Waits for the oldest copy in flight and gives its buffer back."""
        assert self.copier is not None
        event, lease = self._in_flight.popleft()
        self.copier.wait_on_host(event)
        lease.release()

    def release_all(self) -> None:
        """Gives every buffer back to the pool (the copies are done: the caller synchronized)."""
        while self._in_flight:
            self._in_flight.popleft()[1].release()
        with self._lock:
            leases, self._ahead = list(self._ahead.values()), {}
            self._handed.clear()
        for lease in leases:
            lease.release()

    def _make_room(self) -> None:
        """Frees a buffer for a read the engine needs now: the oldest copy's, once done, else the furthest read
        ahead."""
        assert self.copier is not None
        while len(self._ahead) + len(self._in_flight) >= self._cap:
            if self._in_flight:
                self._release_oldest_copy()
                continue
            with self._lock:
                if not self._ahead:
                    return
                furthest = list(self._ahead)[-1]
                lease = self._ahead.pop(furthest)
                self._handed.discard(furthest)
            lease.release()
