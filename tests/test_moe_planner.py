"""Budget planner: budget respected, damage-per-byte order, hysteresis, exchanges, baselines."""

import pytest
import torch

from lightning_superpipe.moe.planner import BudgetPlanner, random_levels, uniform_levels

LEVELS = (16, 8, 4, 3, 2)


class TableMover:
    """Page store stand-in: device bytes follow a bytes table, moves are counted."""

    def __init__(self, bytes_table: torch.Tensor, current: list[int]) -> None:
        self.sizes = bytes_table.tolist()
        self.current = list(current)
        self.moves = 0

    def device_bytes(self) -> int:
        return sum(row[level] for row, level in zip(self.sizes, self.current))

    def promotion_bytes(self, page_id: int, level: int) -> int:
        return self.sizes[page_id][LEVELS.index(level)] - self.sizes[page_id][self.current[page_id]]

    def set_level(self, page_id: int, level: int) -> None:
        self.current[page_id] = LEVELS.index(level)
        self.moves += 1


def _bytes_table(pages: int, numel: int = 1024) -> torch.Tensor:
    meta = numel // 64 * 4
    return torch.tensor([[numel * 2] + [numel * b // 8 + meta for b in LEVELS[1:]]] * pages)


def _damage(weights: torch.Tensor) -> torch.Tensor:
    """Damage growing ~4x per bit removed, scaled per page."""
    per_level = torch.tensor([0.0, 4.0**-8, 4.0**-4, 4.0**-3, 4.0**-2], dtype=torch.float64)
    return weights.double().unsqueeze(-1) * per_level


def _planner(pages: int = 24, hysteresis: float = 0.02, seed: int = 0) -> tuple[BudgetPlanner, TableMover, list[int]]:
    table = _bytes_table(pages)
    planner = BudgetPlanner(LEVELS, table, hysteresis=hysteresis)
    weights = torch.rand(pages, generator=torch.Generator().manual_seed(seed)) * 100 + 0.01
    planner.set_damage(_damage(weights))
    current = [len(LEVELS) - 1] * pages
    return planner, TableMover(table, current), current


def test_budget_is_respected_while_lowered_and_raised():
    planner, mover, current = _planner()
    planner.rebalance(mover, current, None, force_fill=True)
    assert mover.device_bytes() == planner.max_bytes
    budgets = torch.linspace(planner.max_bytes, planner.min_bytes, 15).long().tolist()
    for budget in budgets + budgets[::-1]:
        planner.rebalance(mover, current, budget)
        assert mover.device_bytes() <= budget
        assert current == mover.current
    assert mover.device_bytes() == planner.max_bytes  # back at the top: everything fits again


def test_pages_with_more_damage_keep_more_bits():
    planner, mover, current = _planner(pages=40)
    planner.rebalance(mover, current, int(0.3 * planner.max_bytes), force_fill=True)
    weights = torch.tensor([row[-1] for row in planner.damage])
    bits = torch.tensor([LEVELS[level] for level in current], dtype=torch.float64)
    order = weights.argsort()
    cold, hot = bits[order[:10]].mean(), bits[order[-10:]].mean()
    assert hot > cold
    # Greedy optimality on equal-size pages: a page never has fewer bits than a less damaged one.
    for lo, hi in zip(order[:-1], order[1:]):
        assert bits[hi] >= bits[lo]


def test_greedy_beats_uniform_levels_on_predicted_damage():
    planner, mover, current = _planner(pages=40)
    budget = int(0.3 * planner.max_bytes)
    planner.rebalance(mover, current, budget, force_fill=True)
    uniform = uniform_levels(_bytes_table(40), mover.device_bytes())
    damage = torch.tensor(planner.damage)
    planned = damage[torch.arange(40), torch.tensor(current)].sum()
    baseline = damage[torch.arange(40), torch.tensor(uniform)].sum()
    assert planned < baseline


def test_hysteresis_keeps_a_wobbling_budget_from_moving_pages():
    planner, mover, current = _planner(hysteresis=0.05)
    budget = int(0.4 * planner.max_bytes)
    planner.rebalance(mover, current, budget, force_fill=True)
    planner.rebalance(mover, current, budget - 1)  # settle below the new budget
    settled = mover.moves
    for step in range(20):
        wobble = budget - int(0.04 * budget) * (step % 2)
        planner.rebalance(mover, current, wobble)
        assert mover.device_bytes() <= wobble
    assert mover.moves == settled


def test_without_hysteresis_the_same_wobble_moves_pages():
    planner, mover, current = _planner(hysteresis=0.0)
    budget = int(0.4 * planner.max_bytes)
    planner.rebalance(mover, current, budget, force_fill=True)
    settled = mover.moves
    for step in range(20):
        planner.rebalance(mover, current, budget - int(0.04 * budget) * (step % 2))
    assert mover.moves > settled


def test_exchange_moves_bits_to_pages_that_became_hot_and_does_not_swap_back():
    planner, mover, current = _planner(pages=16, hysteresis=0.0)
    weights = torch.ones(16)
    planner.set_damage(_damage(weights))
    budget = int(0.35 * planner.max_bytes)
    planner.rebalance(mover, current, budget, force_fill=True)
    before = [LEVELS[level] for level in current]
    # Ties went to the first pages; the last four now become hot.
    assert max(before[12:]) < max(before)
    weights[12:] = 50.0
    planner.set_damage(_damage(weights))
    counts = planner.rebalance(mover, current, budget, exchange=True)
    after = [LEVELS[level] for level in current]
    assert counts.promotions > 0 and counts.demotions > 0
    assert min(after[12:]) > max(after[:12])
    assert mover.device_bytes() <= budget
    # Same statistics again: nothing left worth exchanging.
    again = planner.rebalance(mover, current, budget, exchange=True)
    assert again.promotions == again.demotions == 0


def test_uniform_levels_differ_by_at_most_one_step_and_fit():
    table = _bytes_table(10)
    budget = int(0.3 * table[:, 0].sum())
    levels = uniform_levels(table, budget)
    assert max(levels) - min(levels) <= 1
    assert table[torch.arange(10), torch.tensor(levels)].sum() <= budget
    with pytest.raises(ValueError, match="below the minimum"):
        uniform_levels(table, int(table[:, -1].sum()) - 1)


def test_random_levels_fit_and_are_reproducible():
    table = _bytes_table(10)
    budget = int(0.4 * table[:, 0].sum())
    first = random_levels(table, budget, torch.Generator().manual_seed(3))
    assert first == random_levels(table, budget, torch.Generator().manual_seed(3))
    assert table[torch.arange(10), torch.tensor(first)].sum() <= budget
    assert len(set(first)) > 1


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="hysteresis"):
        BudgetPlanner(LEVELS, _bytes_table(2), hysteresis=0.6)
    with pytest.raises(ValueError, match="exchange_ratio"):
        BudgetPlanner(LEVELS, _bytes_table(2), exchange_ratio=0.5)
