"""Planning: the placement of a memory budget, from measured costs (``SuperpipeStrategy(memory_budget=...)``).

:mod:`.budget` reads the budget the user wrote, :mod:`.profile` holds what one profiled step measured, :mod:`.cost`
predicts a placement's step time and device bytes from it, :mod:`.solver` finds the fastest placement that fits as a
mixed-integer program, and :mod:`.plan` is the result, with its table.
"""

# Only the modules that import nothing of streaming/: the strategy imports this package while streaming/ loads.
from lightning_superpipe.planning.budget import AUTO_FRACTION, Budget, MemoryBudget, parse_budget, resolve_budget
from lightning_superpipe.planning.plan import Plan

__all__ = ["AUTO_FRACTION", "Budget", "MemoryBudget", "Plan", "parse_budget", "resolve_budget"]
