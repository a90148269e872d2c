"""A plan's predicted step time is a promise: once applied, the plan is timed, and a model it proves wrong is
corrected.

The profile times each copy alone (synchronously) and derives what the copies of a placement cost from the link's
speeds; it times what offloading costs compute on the side, one block at a time. Some costs only show when a
placement runs: many blocks' copies sharing the link and competing with compute at once, timing noise in the
profile's two samples. So after the planner applies a plan,
:class:`PlanCheck` times the steps that follow: ``SETTLE_STEPS`` (the first steps after a re-placement fill fresh
buffers) and then ``TIMED_STEPS``, the fastest of which is the plan's measured step (other work on the machine, the
collector, a page fault only ever slow a step down: the fastest is the plan's own time). Five, not three: over 20
steps of one placement on a quiet 2-core machine (plain Lightning's too), the fastest of each 3 consecutive steps
moved by 17-24%, of each 5 by 2-13%, and the median of each 5 by 9-19%. Where it exceeds the prediction by more than
``TOLERANCE``, :func:`correct` sets one term of the model (:class:`~.profile.Profile`) so that the model predicts
what was measured (and where it is more than ``TOLERANCE`` below, the same way down, copies never faster than the
profile timed them, and the plan stays), choosing by what the plan runs:

1. a plan that offloads activations: ``offload_compute_s_per_byte``, the compute each offloaded byte costs;
2. else a plan that streams at prefetch 1 on an asynchronous link: ``copy_spread``, how far a copy strays from its
   median time (a late copy stalls compute at prefetch 1; a deeper prefetch hides it);
3. else a plan whose copies can bind (streamed or refreshed blocks): ``link_slowdown``, every copy slower alike;
4. else ``step_overhead_s``, a constant per step (it changes no choice).

A term that cannot reach the measured step (the plan does not depend on it enough) gives way to the next.

The placement is then solved for again with the corrected model and applied, and checked in turn, at most
``MAX_CORRECTIONS`` times. The run ends on the fastest placement measured (the last one unless a correction made
things worse), with the model refitted to it, so that its predicted step is what it measured: at most ``(1 +
MAX_CORRECTIONS) * (SETTLE_STEPS + TIMED_STEPS)`` steps after the profiled ones. Every placement computes the same
values (a re-placement moves buffers, not numbers), so the check changes no result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from lightning_superpipe.planning.cost import predict
from lightning_superpipe.planning.plan import Plan
from lightning_superpipe.planning.profile import Profile

#: A measured step more than this fraction above the prediction corrects the model.
TOLERANCE = 0.10
#: Steps after a re-placement before the timed ones (the second after a re-placement was still up to 20% slow).
SETTLE_STEPS = 2
#: Steps timed per check; the fastest is the measured step.
TIMED_STEPS = 5
#: The most times the model is corrected and the placement solved for again.
MAX_CORRECTIONS = 2
#: Bisection steps when fitting a term (to about 2**-40 of its range).
_BISECTIONS = 40

Solver = Callable[[Profile], Plan]


def _placement(plan: Plan) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    return tuple(sorted(plan.resident)), plan.prefetch, tuple(plan.activations)


def _predicted(profile: Profile, plan: Plan) -> float:
    return predict(profile, plan.resident, plan.prefetch, plan.activations).step_s


def _fit(profile: Profile, plan: Plan, measured_s: float, name: str) -> Optional[Profile]:
    """``profile`` with the term ``name`` moved from its value so that ``plan`` is predicted at ``measured_s``, or
    ``None`` where no value of it gets there (the plan does not depend on it enough). The prediction rises with each
    term, so a bisection finds it."""
    current = getattr(profile, name)
    if name == "step_overhead_s":
        return dataclasses.replace(profile, step_overhead_s=current + measured_s - _predicted(profile, plan))

    def at(value: float) -> float:
        return _predicted(dataclasses.replace(profile, **{name: value}), plan)

    if at(current) < measured_s:
        # Upward, in growing steps (compute per offloaded byte: the measured step per offloaded byte; a slowdown: a
        # factor of the current one).
        offloaded = sum(b.offloaded_bytes for b, mode in zip(profile.blocks, plan.activations) if mode == "offload")
        # (a spread: a quarter at least, as the profile's may be 0).
        step = measured_s / max(offloaded, 1) if name == "offload_compute_s_per_byte" else current
        step = max(step, 0.25) if name == "copy_spread" else step
        low, high = current, current + step
        for _ in range(30):
            if at(high) >= measured_s:
                break
            low, high, step = high, high + 2 * step, 2 * step
        else:
            return None
    else:
        # Downward, to no cost (no compute per offloaded byte, no spread), but copies never faster than the profile
        # timed them alone: a step faster than predicted is noise or overlap the model misses, and a link fitted
        # faster than it is (0.10x, once, on a loaded machine) would promise every later plan copies it cannot have.
        low, high = (0.0 if name in ("offload_compute_s_per_byte", "copy_spread") else min(current, 1.0)), current
        if at(low) > measured_s:
            return None
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if at(middle) < measured_s else (low, middle)
    return dataclasses.replace(profile, **{name: high})


def correct(profile: Profile, plan: Plan, measured_s: float) -> tuple[Profile, str]:
    """The profile corrected so that ``plan``'s placement is predicted at ``measured_s`` (see the module for which
    term), and the correction in words."""
    offloads = "offload" in plan.activations
    streams = len(plan.resident) < len(plan.activations)
    copies = streams or any(b.gradient_bytes for b in profile.blocks)
    spread = profile.asynchronous and plan.prefetch == 1 and streams
    terms = (("offload_compute_s_per_byte", offloads), ("copy_spread", spread), ("link_slowdown", copies))
    for name, applies in terms:
        fitted = _fit(profile, plan, measured_s, name) if applies else None
        if fitted is not None:
            if name == "link_slowdown":
                return fitted, f"copies take {fitted.link_slowdown:.2f}x their profiled time"
            if name == "copy_spread":
                return fitted, (
                    f"a copy strays {fitted.copy_spread:.0%} from its median time, which a prefetch of 1 exposes"
                )
            per_mib = fitted.offload_compute_s_per_byte * 2**20 * 1e3
            return fitted, f"offloading activations costs {per_mib:.2f} ms of compute per MiB, each way"
    fitted = _fit(profile, plan, measured_s, "step_overhead_s")
    assert fitted is not None
    return fitted, f"{fitted.step_overhead_s * 1e3:.1f} ms a step that no term of the model accounts for"


@dataclass(frozen=True)
class Checked:
    """A placement that was applied and timed."""

    plan: Plan
    measured_s: float


class PlanCheck:
    """Times the steps of each plan applied and corrects the model where one misses (see the module).

    Args:
        profile: What the first plan was solved from.
        plan: The plan applied.
        solver: Solves for the plan of a (corrected) profile, with the run's budget and pinned knobs.
    """

    def __init__(self, profile: Profile, plan: Plan, solver: Solver) -> None:
        self.profile = profile
        self.plan = plan
        self._solver = solver
        self._times: list[float] = []
        self.checked: list[Checked] = []
        self.corrections: list[str] = []
        self.done = False

    @staticmethod
    def cost() -> str:
        """The check's cost, in words."""
        checks = 1 + MAX_CORRECTIONS
        return (
            f"{SETTLE_STEPS} + {TIMED_STEPS} steps per plan, at most {checks} plans"
            f" ({checks * (SETTLE_STEPS + TIMED_STEPS)} steps)"
        )

    def step_done(self, seconds: float) -> tuple[Optional[Plan], Optional[str]]:
        """Takes one step's time. Returns the plan to apply now, if it changed, and a line to say, if any."""
        if self.done:
            return None, None
        self._times.append(seconds)
        if len(self._times) < SETTLE_STEPS + TIMED_STEPS:
            return None, None
        measured = min(self._times[SETTLE_STEPS:])
        self._times = []
        plan = self.plan
        self.checked.append(Checked(plan, measured))
        excess = measured / plan.predicted_step_s - 1
        said = (
            f"measured {measured * 1e3:.1f} ms a step against {plan.predicted_step_s * 1e3:.1f} ms predicted"
            f" ({excess:+.0%}, the fastest of {TIMED_STEPS} steps)"
        )
        if abs(excess) <= TOLERANCE:
            return self._end(f"SuperpipeStrategy's plan holds: {said}.")
        self.profile, correction = correct(self.profile, plan, measured)
        self.corrections.append(f"{said}: {correction}")
        if excess < 0:
            # Faster than promised: the promise holds; the model now predicts what was measured, the plan stays.
            line = f"SuperpipeStrategy's plan holds, faster than predicted: {said}; {correction}."
            return self._end(line, fitted=True)
        # Past the last correction allowed, the model keeps it (for the final plan's figures) but solves no more.
        again = self._solver(self.profile) if len(self.corrections) <= MAX_CORRECTIONS else None
        if again is None or _placement(again) in {_placement(c.plan) for c in self.checked}:
            why = "no more corrections" if again is None else "solved again, it gives a placement already measured"
            line = f"SuperpipeStrategy corrected its cost model ({correction}) after {said}; {why}."
            return self._end(line, fitted=True)
        self.plan = self._with_history(again, None)
        return self.plan, (
            f"SuperpipeStrategy corrected its cost model after {said}: {correction}. Solved again"
            f" (correction {len(self.corrections)} of at most {MAX_CORRECTIONS}):"
        )

    def _replan(self, plan: Plan) -> Plan:
        """``plan``'s placement with the corrected model's figures."""
        prediction = predict(self.profile, plan.resident, plan.prefetch, plan.activations)
        return Plan.from_prediction(plan.resident, plan.prefetch, plan.activations, plan.budget_bytes, prediction)

    def _end(self, line: str, fitted: bool = False) -> tuple[Optional[Plan], str]:
        """Ends the check on the placement just measured, or on an earlier one that measured faster, with the model
        fitted to what it measured (its predicted step is what it measures; within the tolerance too, not a
        prediction up to 10% off). ``fitted``: the model was just fitted to the placement just measured. Returns the
        plan to apply if the placement changes, and the line to say."""
        current = self.checked[-1]
        best = min(self.checked, key=lambda c: c.measured_s)
        if best is not current or not fitted:
            self.profile, _ = correct(self.profile, best.plan, best.measured_s)
        plan = self._replan(best.plan)
        if best is not current:
            line += f" It keeps the fastest placement measured, {best.measured_s * 1e3:.1f} ms a step."
        self.plan = self._with_history(plan, best.measured_s)
        self.done = True
        return (self.plan if best is not current else None), line

    def _with_history(self, plan: Plan, measured: Optional[float]) -> Plan:
        history = [
            {
                "resident": sorted(c.plan.resident),
                "prefetch": c.plan.prefetch,
                "activations": list(c.plan.activations),
                "predicted_step_s": c.plan.predicted_step_s,
                "predicted_peak_bytes": c.plan.predicted_peak_bytes,
                "measured_step_s": c.measured_s,
            }
            for c in self.checked
        ]
        return dataclasses.replace(
            plan, measured_step_s=measured, corrections=tuple(self.corrections), checks=tuple(history)
        )


__all__ = ["MAX_CORRECTIONS", "TIMED_STEPS", "TOLERANCE", "PlanCheck", "correct"]
