"""Budget planner: which page holds which precision under a device byte budget.

Each page can sit at one of the store's levels; a level costs device bytes and has a predicted
damage (``damage.py``). The planner keeps the total within the budget while keeping the total
damage low, with the greedy of the multiple-choice knapsack:

* over budget, it demotes the page whose step down costs the least damage per byte freed;
* with room to spare, it promotes the page whose step up removes the most damage per byte;
* steps may skip levels: from a page's level the best ratio over *all* lower (or higher) levels is
  taken, which follows the lower convex hull of the page's (bytes, damage) curve;
* hysteresis: demotion goes down to ``(1 - hysteresis) * budget`` and promotion only starts once
  more than ``2 * hysteresis * budget`` is free, so a budget that wobbles by less than
  ``hysteresis * budget`` (e.g. a KV cache growing token by token) moves nothing;
* exchanges: when routing statistics change, a page is promoted at the expense of another only if
  that removes at least ``exchange_ratio`` times the damage it adds, so pages do not swap back
  and forth on noise.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["BudgetPlanner", "MoveCounts", "PageMover", "random_levels", "uniform_levels"]


class PageMover(Protocol):
    """What the planner needs from the page store."""

    def device_bytes(self) -> int:
        """Bytes on the device now, uploads in flight included."""

    def promotion_bytes(self, page_id: int, level: int) -> int:
        """Extra device bytes while ``page_id`` is promoted to ``level``."""

    def set_level(self, page_id: int, level: int) -> None:
        """Move ``page_id`` to ``level``."""


@dataclass
class MoveCounts:
    """Moves made by the planner.

    Args:
        promotions: Steps up.
        demotions: Steps down.
    """

    promotions: int = 0
    demotions: int = 0

    def __iadd__(self, other: MoveCounts) -> MoveCounts:
        self.promotions += other.promotions
        self.demotions += other.demotions
        return self


class BudgetPlanner:
    """Greedy damage-per-byte planner with hysteresis.

    Args:
        levels: The store's levels, highest first (index 0 is the original weights).
        bytes_table: ``[pages, levels]`` device bytes of every page at every level.
        hysteresis: Fraction of the budget kept as a dead band (see the module docstring).
        exchange_ratio: Minimum ratio of damage removed to damage added for an exchange.
        max_exchanges: Exchanges per call at most (bounds the bytes moved per call).
    """

    def __init__(
        self,
        levels: tuple[int, ...],
        bytes_table: torch.Tensor,
        *,
        hysteresis: float = 0.02,
        exchange_ratio: float = 2.0,
        max_exchanges: int = 64,
    ) -> None:
        if not 0.0 <= hysteresis < 0.5:
            raise ValueError(f"hysteresis={hysteresis} must be in [0, 0.5)")
        if exchange_ratio < 1.0:
            raise ValueError(f"exchange_ratio={exchange_ratio} must be >= 1 (below 1 exchanges would thrash)")
        self.levels = tuple(levels)
        self.bytes: list[list[int]] = bytes_table.tolist()
        self.damage: list[list[float]] = [[0.0] * len(self.levels) for _ in self.bytes]
        self.hysteresis = hysteresis
        self.exchange_ratio = exchange_ratio
        self.max_exchanges = max_exchanges
        self.min_bytes = sum(row[-1] for row in self.bytes)
        self.max_bytes = sum(row[0] for row in self.bytes)

    def set_damage(self, damage: torch.Tensor) -> None:
        """Replace the predicted damage table ``[pages, levels]``."""
        self.damage = damage.tolist()

    # ------------------------------------------------------------------ steps
    def _step_down(self, page: int, level: int) -> tuple[float, int] | None:
        """Cheapest step down from level index ``level``: (damage added per byte freed, target)."""
        sizes, damage = self.bytes[page], self.damage[page]
        best = None
        for target in range(level + 1, len(self.levels)):
            freed = sizes[level] - sizes[target]
            if freed <= 0:
                continue
            cost = (damage[target] - damage[level]) / freed
            if best is None or cost < best[0]:
                best = (cost, target)
        return best

    def _step_up(self, page: int, level: int) -> tuple[float, int] | None:
        """Best step up from level index ``level``: (damage removed per byte added, target)."""
        sizes, damage = self.bytes[page], self.damage[page]
        best = None
        for target in range(level - 1, -1, -1):
            added = sizes[target] - sizes[level]
            if added <= 0:
                continue
            gain = (damage[level] - damage[target]) / added
            if best is None or gain > best[0]:
                best = (gain, target)
        return best

    def _down_heap(self, current: list[int]) -> list[tuple[float, int, int, int]]:
        heap = []
        for page, level in enumerate(current):
            step = self._step_down(page, level)
            if step is not None:
                heap.append((step[0], page, level, step[1]))
        heapq.heapify(heap)
        return heap

    def _up_heap(self, current: list[int]) -> list[tuple[float, int, int, int]]:
        heap = []
        for page, level in enumerate(current):
            step = self._step_up(page, level)
            if step is not None:
                heap.append((-step[0], page, level, step[1]))
        heapq.heapify(heap)
        return heap

    # ------------------------------------------------------------------ policy
    def fill_target(self, budget: int | None) -> float:
        """Bytes that promotions may fill up to (and demotions go down to) under ``budget``."""
        if budget is None:
            return math.inf
        if budget >= self.max_bytes:  # everything fits: no dead band needed at the top
            return float(budget)
        return math.floor(budget * (1.0 - self.hysteresis))

    def rebalance(
        self,
        mover: PageMover,
        current: list[int],
        budget: int | None,
        *,
        force_fill: bool = False,
        exchange: bool = False,
    ) -> MoveCounts:
        """Bring the pages within ``budget`` and use spare room, moving as little as needed.

        Args:
            mover: The page store.
            current: Level index of every page (updated in place as pages move).
            budget: Device bytes allowed for expert pages (``None``: unlimited).
            force_fill: Promote even inside the dead band (initial placement).
            exchange: Also exchange precision between pages whose damage changed.

        Returns:
            The moves made.
        """
        counts = MoveCounts()
        target = self.fill_target(budget)
        used = mover.device_bytes()
        if budget is not None and used > budget:
            counts.demotions += self._demote_to(mover, current, target)
            # A page's cheapest step down may free more than needed (a skip over several levels):
            # the bytes freed beyond the target are filled again at once, so that the next call does
            # not find them free and promote (a budget falling steadily then never moves pages up).
            counts.promotions += self._promote_to(mover, current, target)
        elif force_fill or budget is None or budget >= self.max_bytes or budget - used > 2 * self.hysteresis * budget:
            counts.promotions += self._promote_to(mover, current, target)
        if exchange:
            counts += self._exchange(mover, current, target)
        return counts

    def plan(self, budget: int | None) -> list[int]:
        """Level index per page chosen from scratch: every page at the lowest level, then the best
        steps up by damage removed per byte until ``fill_target(budget)`` (no history involved)."""
        table = _TableMover(self.bytes, [len(self.levels) - 1] * len(self.bytes), self.levels)
        self._promote_to(table, table.current, self.fill_target(budget))
        return table.current

    def replan(self, mover: PageMover, current: list[int], budget: int | None) -> MoveCounts:
        """Move the pages to :meth:`plan`'s levels, demotions first so the budget holds throughout.

        Promotions that do not fit yet (uploads in flight still hold bytes) are left for a later call.
        """
        target_levels = self.plan(budget)
        fill = self.fill_target(budget)
        counts = MoveCounts()
        for page, level in enumerate(target_levels):
            if level > current[page]:
                self._move(mover, current, page, level)
                counts.demotions += 1
        for page, level in enumerate(target_levels):
            if level < current[page] and mover.device_bytes() + mover.promotion_bytes(page, self.levels[level]) <= fill:
                self._move(mover, current, page, level)
                counts.promotions += 1
        return counts

    def _move(self, mover: PageMover, current: list[int], page: int, level: int) -> None:
        mover.set_level(page, self.levels[level])
        current[page] = level

    def _demote_to(self, mover: PageMover, current: list[int], target: float) -> int:
        heap = self._down_heap(current)
        moves = 0
        while mover.device_bytes() > target and heap:
            _, page, level, to = heapq.heappop(heap)
            if current[page] != level:
                continue
            self._move(mover, current, page, to)
            moves += 1
            step = self._step_down(page, to)
            if step is not None:
                heapq.heappush(heap, (step[0], page, to, step[1]))
        return moves

    def _promote_to(self, mover: PageMover, current: list[int], target: float) -> int:
        heap = self._up_heap(current)
        moves = 0
        while heap:
            _, page, level, to = heapq.heappop(heap)
            if current[page] != level:
                continue
            if mover.device_bytes() + mover.promotion_bytes(page, self.levels[to]) > target:
                continue  # does not fit; the page stays where it is, smaller steps of others may fit
            self._move(mover, current, page, to)
            moves += 1
            step = self._step_up(page, to)
            if step is not None:
                heapq.heappush(heap, (-step[0], page, to, step[1]))
        return moves

    def _exchange(self, mover: PageMover, current: list[int], target: float) -> MoveCounts:
        counts = MoveCounts()
        up, down = self._up_heap(current), self._down_heap(current)
        for _ in range(self.max_exchanges):
            best_up = _peek_valid(up, current)
            if best_up is None:
                break
            neg_gain, winner, _, win_to = best_up
            best_down = _peek_valid(down, current, exclude=winner)
            if best_down is None:
                break
            cost, loser, lose_level, lose_to = best_down
            if -neg_gain <= 0.0 or -neg_gain <= self.exchange_ratio * max(cost, 0.0):
                break
            freed = self.bytes[loser][lose_level] - self.bytes[loser][lose_to]
            extra = mover.promotion_bytes(winner, self.levels[win_to])
            if mover.device_bytes() - freed + extra > target:
                break
            self._move(mover, current, loser, lose_to)
            self._move(mover, current, winner, win_to)
            counts.demotions += 1
            counts.promotions += 1
            for page, level in ((loser, lose_to), (winner, win_to)):
                if (step := self._step_down(page, level)) is not None:
                    heapq.heappush(down, (step[0], page, level, step[1]))
                if (step := self._step_up(page, level)) is not None:
                    heapq.heappush(up, (-step[0], page, level, step[1]))
        return counts


class _TableMover:
    """Planning stand-in for the page store: bytes from the table, moves only recorded."""

    def __init__(self, sizes: list[list[int]], current: list[int], levels: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.current = current
        self.index = {level: i for i, level in enumerate(levels)}
        self.used = sum(row[level] for row, level in zip(sizes, current))

    def device_bytes(self) -> int:
        return self.used

    def promotion_bytes(self, page_id: int, level: int) -> int:
        return self.sizes[page_id][self.index[level]] - self.sizes[page_id][self.current[page_id]]

    def set_level(self, page_id: int, level: int) -> None:
        # The planner updates `current` itself right after; only the bytes are tracked here.
        self.used += self.sizes[page_id][self.index[level]] - self.sizes[page_id][self.current[page_id]]


def _peek_valid(
    heap: list[tuple[float, int, int, int]], current: list[int], exclude: int | None = None
) -> tuple[float, int, int, int] | None:
    """Best entry of ``heap`` whose page is still at the entry's level, skipping page ``exclude``.

    Stale entries are dropped; an entry of ``exclude`` is kept in the heap.
    """
    held = []
    found = None
    while heap:
        entry = heap[0]
        if current[entry[1]] != entry[2]:
            heapq.heappop(heap)
        elif entry[1] == exclude:
            held.append(heapq.heappop(heap))
        else:
            found = entry
            break
    for entry in held:
        heapq.heappush(heap, entry)
    return found


def uniform_levels(bytes_table: torch.Tensor, budget: int) -> list[int]:
    """Uniform demotion baseline: every page one level, the same for all, as high as fits.

    Pages are demoted one level at a time in round-robin order (so levels differ by at most one
    step between pages) until the total fits ``budget``.

    Args:
        bytes_table: ``[pages, levels]`` device bytes, levels highest first.
        budget: Device bytes allowed.

    Returns:
        Level index per page.
    """
    sizes = bytes_table.tolist()
    current = [0] * len(sizes)
    used = sum(row[0] for row in sizes)
    num_levels = len(sizes[0]) if sizes else 0
    for level in range(1, num_levels):
        for page, row in enumerate(sizes):
            if used <= budget:
                return current
            used -= row[level - 1] - row[level]
            current[page] = level
    if used > budget:
        raise ValueError(f"budget {budget} is below the minimum of {used} bytes")
    return current


def random_levels(bytes_table: torch.Tensor, budget: int, generator: torch.Generator) -> list[int]:
    """Random demotion baseline: demote a random page by one level until the total fits.

    Args:
        bytes_table: ``[pages, levels]`` device bytes, levels highest first.
        budget: Device bytes allowed.
        generator: Source of randomness.

    Returns:
        Level index per page.
    """
    sizes = bytes_table.tolist()
    current = [0] * len(sizes)
    used = sum(row[0] for row in sizes)
    last = len(sizes[0]) - 1 if sizes else 0
    movable = list(range(len(sizes)))
    while used > budget:
        if not movable:
            raise ValueError(f"budget {budget} is below the minimum of {used} bytes")
        slot = int(torch.randint(len(movable), (1,), generator=generator))
        page = movable[slot]
        used -= sizes[page][current[page]] - sizes[page][current[page] + 1]
        current[page] += 1
        if current[page] == last:
            movable[slot] = movable[-1]
            movable.pop()
    return current
