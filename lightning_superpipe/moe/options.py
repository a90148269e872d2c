"""How experts are paged beyond their budget: :class:`PagingOptions` (codes, pages, planner), and the experts'
budgets as users write them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_superpipe.moe.host_pages import TOP_LEVEL
from lightning_superpipe.planning.budget import MemoryBudget, parse_budget

__all__ = ["DEFAULT_LEVELS", "PagingOptions", "resolve_expert_budget"]

DEFAULT_LEVELS: tuple[int, ...] = (TOP_LEVEL, 8, 4, 3, 2)


@dataclass(frozen=True)
class PagingOptions:
    """The codes, the pages and the planner of :func:`~lightning_superpipe.moe.page_experts` (the defaults suit
    evaluation; the budget itself is an argument of its own).

    Attributes:
        group_size: Input columns per quantization group; must divide hidden and intermediate size.
        levels: Allowed levels: 16 (the original weights) and bit counts among 8..1; 8 is required.
        rows_per_page: Rows per page within an expert projection (``None``: one page per expert and projection,
            the fewest pages). Finer pages let the planner spend bytes more selectively but multiply the pages to
            plan, move and rebuild; on the benchmark's model (error-compensated codes) 32-row blocks (5x the
            pages) lowered the KL at equal bytes by 15% at 20-25% of the 16-bit bytes, and did not help from 28%
            up (1.7x at 50%).
        hysteresis: Dead band of the planner, as a fraction of the budget.
        exchange_ratio: Damage ratio needed to move bits between pages when routing shifts.
        rebalance_every: Forward calls between planner runs that follow routing shifts (``None``: only when the
            budget changes).
        routing_half_life_tokens: Half-life of the running routing shares (``None``: cumulative).
        async_moves: On CUDA, upload on a side stream and keep computing at the old precision until a promotion
            lands.
        error_feedback: With calibration, round the codes again with each expert matrix's input Hessian (GPTQ's
            error feedback at every level at once, the codes staying nested) and count the errors' correlations
            in the damage. Needs the full second-moment matrices of every expert's inputs (kept only while they
            fit in 2 GiB; otherwise the codes stay round-to-nearest).
    """

    group_size: int = 64
    levels: Sequence[int] = DEFAULT_LEVELS
    rows_per_page: int | None = None
    hysteresis: float = 0.02
    exchange_ratio: float = 2.0
    rebalance_every: int | None = 64
    routing_half_life_tokens: float | None = 8192.0
    async_moves: bool = True
    error_feedback: bool = True


def resolve_expert_budget(value: MemoryBudget | None, whole: int | None, call: str) -> int | None:
    """Bytes of an experts' budget written as bytes (``6000000000``, ``"6GiB"``) or a percentage of ``whole``.

    Args:
        value: The budget as written (``None``: unlimited).
        whole: What a percentage is a share of (the experts' 16-bit size), or ``None`` where only bytes mean
            something.
        call: The user's call, quoted in errors.

    Raises:
        ValueError: For a form :func:`~lightning_superpipe.planning.parse_budget` refuses, ``"auto"``, or a
            percentage where only bytes mean something.
    """
    if value is None:
        return None
    budget = parse_budget(value, call, allow_auto=False)
    if budget.fraction is not None and whole is None:
        raise ValueError(f"{call}: give bytes (an int or a string such as '6GiB'), not a percentage.")
    return budget.bytes_of(whole or 0)
