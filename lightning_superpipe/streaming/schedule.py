"""The order in which a pass is expected to need the blocks, and where in it the pass is: what the engine copies in
ahead of compute.

A training pass runs the blocks forward and then backward (each recomputed or fetched again for its backward); an
evaluation pass runs them forward, again and again (generation), so its order wraps around.
"""

from __future__ import annotations

from collections.abc import Container, Iterator


class BlockSchedule:
    """The expected order of ``num_blocks`` blocks in the current pass, and a cursor on the block computing now.

    Args:
        num_blocks: How many blocks the model has.
    """

    def __init__(self, num_blocks: int) -> None:
        forward = list(range(num_blocks))
        self._training = forward + forward[::-1]
        self._forward = forward
        self._order: list[int] = []
        self._cyclic = False
        self._cursor = -1

    def start(self, training: bool) -> None:
        """A new pass: forward then backward in training, forward (repeated) otherwise; nothing computed yet."""
        self._order = self._training if training else self._forward
        self._cyclic = not training
        self._cursor = -1

    @property
    def started(self) -> bool:
        """Whether a block was acquired in this pass yet."""
        return self._cursor >= 0

    def is_current(self, index: int) -> bool:
        """Whether block ``index`` is the one the cursor is on (computing now)."""
        return 0 <= self._cursor < len(self._order) and self._order[self._cursor] == index

    def advance(self, index: int) -> None:
        """Moves the cursor to ``index``'s next expected position (re-synchronising if the model called the blocks in
        an order the pass did not predict)."""
        for position in self._positions_after_cursor():
            if self._order[position] == index:
                self._cursor = position
                return
        self._cursor = self._order.index(index) if index in self._order else -1

    def upcoming(self, skip: Container[int]) -> Iterator[int]:
        """Blocks expected after the cursor, nearest first, without repeats, leaving out those in ``skip``."""
        seen: set[int] = set()
        for position in self._positions_after_cursor():
            index = self._order[position]
            if index in seen or index in skip:
                continue
            seen.add(index)
            yield index

    def _positions_after_cursor(self) -> Iterator[int]:
        """Positions in the expected order after the cursor, wrapping around in a forward-only pass."""
        length = len(self._order)
        for step in range(1, length + 1):
            position = self._cursor + step
            if self._cyclic:
                position %= length
            elif position >= length:
                return
            yield position
