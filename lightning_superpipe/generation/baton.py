"""Turn-taking between the micro-batches' generation threads: FlexGen's loop order token -> block -> micro-batch.

Each micro-batch runs ``transformers``' own ``generate`` in a thread of its own, so that every model family's input
preparation, masks (left padding, sliding windows), position ids and logits processing are exactly its own. Only
one thread runs at a time: a thread hands the baton on when it reaches a block, and the baton goes to the waiting
thread with the smallest ``(token step, block, micro-batch)``. Every micro-batch therefore runs block ``b`` of a
token before any runs block ``b + 1``, and the block's weights are on the device once for all of them.

A thread's start (its prompt's embedding) is ordered just before its own first turn at block 0, not before every
micro-batch's: the embeddings of all prompts are never on the device at once (what lets the hidden states of the
waiting micro-batches live in host memory at prefill).
"""

from __future__ import annotations

import threading
from typing import Optional

Key = tuple[int, int, int]
#: ``(step, block, micro_batch, phase)``: phase 0 is a thread's start, 1 an arrival at a block.
_Order = tuple[int, int, int, int]


class Baton:
    """Serialises the threads of ``count`` micro-batches in ``(step, block, micro_batch)`` order.

    Args:
        count: The number of micro-batch threads (all must :meth:`wait_turn` or :meth:`leave`).
    """

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition()
        self._alive = set(range(count))
        self._waiting: dict[int, _Order] = {}
        self._running: Optional[int] = None
        self._step = [0] * count
        self._last_block = [-1] * count
        self.failed: Optional[BaseException] = None

    def start(self, micro_batch: int) -> None:
        """Waits for this thread's first turn: right after the previous micro-batch's first turn at block 0."""
        self._wait((0, 0, micro_batch, 0), micro_batch)

    def arrive(self, micro_batch: int, block: int) -> Key:
        """Called when ``micro_batch`` reaches ``block``: hands the baton on and returns once it is this thread's turn.

        Returns:
            The ``(step, block, micro_batch)`` turn that now runs.
        """
        if block <= self._last_block[micro_batch]:
            self._step[micro_batch] += 1  # a new forward (the next token) started
        self._last_block[micro_batch] = block
        key = (self._step[micro_batch], block, micro_batch)
        self._wait(key + (1,), micro_batch)
        return key

    def waiting_keys(self) -> list[Key]:
        """The block turns the other threads wait for, in the order they will run (read by the running thread);
        threads waiting to start are left out."""
        with self._cond:
            return [order[:3] for order in sorted(self._waiting.values()) if order[3] == 1]

    def leave(self, micro_batch: int, error: Optional[BaseException] = None) -> None:
        """The thread of ``micro_batch`` is done (or failed, which releases every other thread)."""
        with self._cond:
            self._alive.discard(micro_batch)
            if error is not None and self.failed is None:
                self.failed = error
            if self._running == micro_batch:
                self._running = None
            self._cond.notify_all()

    def _wait(self, key: _Order, micro_batch: int) -> None:
        with self._cond:
            self._waiting[micro_batch] = key
            if self._running == micro_batch:
                self._running = None
            self._cond.notify_all()
            # Run only when no thread runs and every live thread is waiting: one that still runs could come back
            # with a smaller key.
            while not (
                self.failed is not None
                or (
                    self._running is None
                    and set(self._waiting) >= self._alive
                    and min(self._waiting.values()) == key
                )
            ):
                self._cond.wait()
            del self._waiting[micro_batch]
            if self.failed is not None:
                raise _Aborted() from self.failed
            self._running = micro_batch


class _Aborted(RuntimeError):
    """Raised in the other threads when one micro-batch's thread failed."""
