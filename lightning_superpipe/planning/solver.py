"""The fastest placement that fits a memory budget, as a mixed-integer linear program (HiGHS, ``scipy.optimize.milp``).

:mod:`.program` builds and solves the program (its docstring has the notation, variables and constraints); this
module checks the pinned knobs, walks HiGHS's tolerances to the fastest placement that fits, settles ties among
equal placements and words the error for a budget nothing fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from lightning_superpipe.planning.cost import MODES, PEAK_PARTS, Prediction, check_profile, predict, slot_shape
from lightning_superpipe.planning.plan import Plan
from lightning_superpipe.planning.profile import Profile
from lightning_superpipe.planning.program import _ROUNDING, EQUAL, _Program
from lightning_superpipe.planning.terms import _describe_modes, _Knobs, _Placement, _residency_classes, _spread
from lightning_superpipe.units import format_bytes

# `predict` and `_Placement` are imported from here by callers and tests.
__all__ = ["InfeasibleBudget", "Prediction", "minimum_plan", "predict", "solve"]


class InfeasibleBudget(Exception):
    """No placement fits the memory budget.

    Attributes:
        budget_bytes: The budget.
        minimum_bytes: The least device memory any placement allowed by the pinned knobs needs.
        breakdown: That minimum's parts, as in :attr:`.cost.Prediction.breakdown`.
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, breakdown: dict[str, int]) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.breakdown = breakdown


def _knobs(
    profile: Profile,
    resident_blocks: Optional[int],
    prefetch: Optional[int],
    activations: Union[str, Sequence[str], None],
    max_prefetch: int,
) -> _Knobs:
    """The pinned knobs, checked against the profile's blocks."""
    check_profile(profile)
    count = len(profile.blocks)
    if resident_blocks is not None and (
        not isinstance(resident_blocks, int) or isinstance(resident_blocks, bool) or not 0 <= resident_blocks <= count
    ):
        raise ValueError(
            f"SuperpipeStrategy(resident_blocks={resident_blocks!r}): the model has {count} blocks, so it is an int"
            f" from 0 to {count}, or None to let the planner choose."
        )
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
        raise ValueError(
            f"SuperpipeStrategy(prefetch={prefetch!r}): an int of at least 0, or None to let the planner choose."
        )
    if not isinstance(max_prefetch, int) or max_prefetch < 0:
        raise ValueError(f"solve(max_prefetch={max_prefetch!r}): an int of at least 0.")
    modes = None
    if activations is not None:
        modes = [activations] * count if isinstance(activations, str) else list(activations)
        if len(modes) != count or any(mode not in MODES for mode in modes):
            raise ValueError(
                f"SuperpipeStrategy(activations={activations!r}): one of {', '.join(map(repr, MODES))} for every"
                f" block, a list of them with one per block ({count} blocks), or None to let the planner choose."
            )
    return _Knobs(resident_blocks, prefetch, modes)


def _no_worse(candidate: Prediction, step_s: float, peak_bytes: int) -> bool:
    """Whether ``candidate`` holds no more than ``peak_bytes`` and is as fast as ``step_s`` but for float rounding."""
    return candidate.peak_bytes <= peak_bytes and candidate.step_s <= step_s * (1 + _ROUNDING)


def _plan(profile: Profile, placement: _Placement, budget_bytes: int, knobs: _Knobs) -> Plan:
    """The plan of ``placement``, settled among the placements that predict the same time where the knobs are not
    pinned: with as little work beside compute as the budget allows (:func:`_less_work`), then at the shallowest
    prefetch (the engine refuses, warning, a prefetch deeper than the streamed blocks)."""
    resident, prefetch, modes = set(placement.resident), placement.prefetch, placement.modes
    step_s, prediction = placement.prediction.step_s, placement.prediction
    while True:
        resident, modes, prediction = _less_work(profile, resident, prefetch, modes, prediction, budget_bytes, knobs)
        shallower = [p for p in range(prefetch) if knobs.prefetch is None]
        candidates = ((p, predict(profile, resident, p, modes)) for p in shallower)
        found = next(((p, c) for p, c in candidates if _no_worse(c, step_s, prediction.peak_bytes)), None)
        if found is None:
            break
        # A shallower prefetch frees a slot, which may hold what the first pass could not.
        prefetch, prediction = found
    return Plan.from_prediction(frozenset(resident), prefetch, list(modes), budget_bytes, prediction)


def _less_work(
    profile: Profile,
    resident: set[int],
    prefetch: int,
    modes: list[str],
    prediction: Prediction,
    budget_bytes: int,
    knobs: _Knobs,
) -> tuple[set[int], list[str], Prediction]:
    """Among the placements predicted as fast as ``prediction``, one with less work beside compute where the budget
    holds it: ``"keep"`` for offloaded blocks, then for recomputed ones, then more resident blocks (evenly spaced).

    Where copies bound the step, offloading (or streaming) a block and keeping it can predict the same time: the model
    has the link busy either way. But an offloaded block's copies interfere with compute and with the weights' copies
    in ways no profiled copy shows, and a resident block's weights do not cross the link at all, so where the model
    cannot tell them apart the budget goes to the placement with fewer copies rather than to less memory. Each step
    is taken only if predict keeps the step time (but for float rounding) and the peak within ``budget_bytes``.
    """
    step_s = prediction.step_s
    modes = list(modes)

    def fits(candidate: Prediction) -> bool:
        return _no_worse(candidate, step_s, budget_bytes)

    if knobs.activations is None:
        for mode in ("offload", "recompute"):
            changed = True
            while changed:  # one block kept can move the peak's moment, and make room for another
                changed = False
                for i in [i for i, m in enumerate(modes) if m == mode]:
                    candidate = predict(profile, resident, prefetch, modes[:i] + ["keep"] + modes[i + 1 :])
                    if fits(candidate):
                        modes[i], prediction, changed = "keep", candidate, True
    if knobs.resident_blocks is None:
        for members in _residency_classes(profile):
            while True:
                held = len(resident.intersection(members))
                if held == len(members):
                    break
                more = resident.difference(members) | _spread(members, held + 1)
                candidate = predict(profile, more, prefetch, modes)
                if not fits(candidate):
                    break
                resident, prediction = more, candidate
    return resident, modes, prediction


def _infeasible(profile: Profile, budget_bytes: int, smallest: Plan, knobs: _Knobs) -> InfeasibleBudget:
    """The error for a budget below the ``smallest`` plan's peak, with that peak's parts and what would get under
    it."""
    minimum = smallest.predicted_peak_bytes
    parts = []
    for name in PEAK_PARTS:
        nbytes = smallest.breakdown[name]
        if name == "slots" and nbytes:
            slots, size = slot_shape(profile, smallest.resident, smallest.prefetch)
            parts.append(f"slots {slots} x {format_bytes(size)}")
        elif nbytes:
            parts.append(f"{name.replace('_', ' ')} {format_bytes(nbytes)}")
    budget_text, minimum_text = format_bytes(budget_bytes), format_bytes(minimum)
    if budget_text == minimum_text:
        budget_text, minimum_text = f"{budget_text} ({budget_bytes} bytes)", f"{minimum_text} ({minimum} bytes)"
    pinned = knobs.pinned()
    message = (
        f"memory_budget={budget_text} cannot hold the model: the least it can run in is {minimum_text}"
        f" ({', '.join(parts) or 'nothing'}) with resident_blocks={len(smallest.resident)},"
        f" prefetch={smallest.prefetch}, {_describe_modes(smallest.activations)}"
        + (f", as pinned by {', '.join(pinned)}" if pinned else "")
        + ". Raise the budget"
        + (", unpin those knobs" if pinned else "")
        + ", or lower the tokens per micro-batch."
    )
    return InfeasibleBudget(message, budget_bytes, minimum, dict(smallest.breakdown))


def solve(
    profile: Profile,
    budget_bytes: int,
    *,
    resident_blocks: Optional[int] = None,
    prefetch: Optional[int] = None,
    activations: Union[str, Sequence[str], None] = None,
    max_prefetch: int = 2,
) -> Plan:
    """The placement with the least predicted step time that fits ``budget_bytes``; among those, the one with the
    fewest copies and recomputations the budget holds (:func:`_less_work`: ``"keep"`` rather than offload or
    recompute, resident rather than streamed), then the shallowest prefetch.

    Args:
        profile: The measured costs.
        budget_bytes: The device memory the plan may use.
        resident_blocks: If given, exactly this many blocks are resident (the solver picks which).
        prefetch: If given, the prefetch depth; more than there are streamed blocks is allowed (the engine allocates
            a slot per streamed block at most).
        activations: If given, one mode for every block, or one per block.
        max_prefetch: The deepest prefetch the solver considers when ``prefetch`` is not pinned.

    Raises:
        InfeasibleBudget: If no placement the pinned knobs allow fits, with the least one that would.
        ValueError: For knobs the model does not have.
    """
    knobs = _knobs(profile, resident_blocks, prefetch, activations, max_prefetch)
    program = _Program(profile, knobs, max_prefetch)
    found = program.best("time", [("peak", budget_bytes)])
    if found is not None and found.prediction.peak_bytes <= budget_bytes:
        # Every placement that fits is feasible to HiGHS too, so none that fits is faster.
        return _plan(profile, found, budget_bytes, knobs)
    smallest = program.best("peak", [])
    assert smallest is not None, "without a budget some placement always exists"
    if smallest.prediction.peak_bytes > budget_bytes:
        raise _infeasible(profile, budget_bytes, _plan(profile, smallest, smallest.prediction.peak_bytes, knobs), knobs)
    # HiGHS holds a limit to a tolerance relative to its row's size, and took a placement a few bytes over the
    # budget, so none that fits is faster. The fastest that fits is found in two walks:
    # - the peak limit goes below the budget by twice as much as the placement taken went over, until one fits;
    # - that left out any placement with a peak between the limit and the budget, so the least peak among the
    #   placements faster than the one found (HiGHS minimises exactly where it limits loosely) says whether one of
    #   them fits; while one does, it is the one found. Where HiGHS lets in one no faster, the time limit goes below
    #   in the same way; and the answer that none fits counts only from a limit below the one found by more than
    #   HiGHS's tolerance on it (`_Program.time_band`).
    bound = budget_bytes
    while found is not None and found.prediction.peak_bytes > budget_bytes:
        bound -= 2 * (found.prediction.peak_bytes - bound)
        found = program.best("time", [("peak", bound)], tie_break=False)
    found = found or smallest
    cap = found.prediction.step_s * (1 - EQUAL)
    while True:
        faster = program.best("peak", [("time", cap)], tie_break=False)
        if faster is not None and faster.prediction.step_s >= found.prediction.step_s:
            cap -= 2 * (faster.prediction.step_s - cap)
        elif faster is not None and faster.prediction.peak_bytes <= budget_bytes:
            found = faster
            cap = found.prediction.step_s * (1 - EQUAL)
        elif cap > found.prediction.step_s - program.time_band:
            # With the one found on the limit's edge, HiGHS has been seen to return more than the least peak: the
            # answer counts only from a limit past its tolerance.
            cap = found.prediction.step_s - program.time_band
        else:
            break
    # The tie-break, as in `_Program.best`.
    limits = [("peak", float(budget_bytes)), ("time", found.prediction.step_s * (1 + EQUAL))]
    tied = program.best("peak", limits, tie_break=False)
    if tied is not None and all(tied.figure(name) <= most for name, most in limits):
        found = min(found, tied, key=lambda placement: placement.prediction.peak_bytes)
    return _plan(profile, found, budget_bytes, knobs)


def minimum_plan(
    profile: Profile,
    *,
    resident_blocks: Optional[int] = None,
    prefetch: Optional[int] = None,
    activations: Union[str, Sequence[str], None] = None,
    max_prefetch: int = 2,
) -> Plan:
    """The placement with the least predicted peak under the pinned knobs (as in :func:`solve`), and among those the
    fastest: what :func:`solve` gives at that peak, which is its ``budget_bytes``.

    Raises:
        ValueError: For knobs the model does not have.
    """
    knobs = _knobs(profile, resident_blocks, prefetch, activations, max_prefetch)
    smallest = _Program(profile, knobs, max_prefetch).best("peak", [])
    assert smallest is not None, "without a budget some placement always exists"
    return _plan(profile, smallest, smallest.prediction.peak_bytes, knobs)
