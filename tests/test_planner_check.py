"""``memory_budget=``'s promise: a plan is timed once applied, a model it proves wrong is corrected and the placement
solved again (:mod:`lightning_superpipe.planning.check`), values unchanged, and more budget is never slower."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_superpipe import EmulatedLink, SuperpipeStrategy
from lightning_superpipe.emulation.link import EmulatedCopier
from lightning_superpipe.planning import check, planner
from lightning_superpipe.planning.check import PlanCheck, correct
from lightning_superpipe.planning.cost import predict
from lightning_superpipe.planning.planner import BudgetPlanner
from lightning_superpipe.planning.solver import minimum_plan, solve
from lightning_superpipe.streaming import activations as activations_module
from tests import tasks
from tests.batches import VOCAB
from tests.test_planner_solver import make_profile

# ------------------------------------------------------------------ the profile measures what the model assumes


def _profiled(**options: Any) -> SuperpipeStrategy:
    """A run with a budget too large to constrain anything (its profile, and the plan after it)."""
    strategy = SuperpipeStrategy(memory_budget="1GiB", **options)
    tasks.fit("llama", strategy, max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None)
    return strategy


def test_the_profiles_link_speed_is_what_queued_copies_get() -> None:
    # Each profiled copy runs alone and is waited for, so its time has a latency that copies queued on a stream do
    # not pay one after another: the speed is the slope of time over bytes, not the bytes over the seconds.
    # (Slow enough that bytes, not latency, make each copy's time: the bytes over the seconds were 3-6% low here.)
    bandwidth = 2e6
    link = EmulatedLink(mode="thread", bandwidth=bandwidth, max_delay_s=0.0, check=False, verify=False)
    profile = _profiled(link=link)._planner.profile
    assert profile.h2d_bytes_per_s == pytest.approx(bandwidth, rel=0.03)
    assert profile.d2h_bytes_per_s == pytest.approx(bandwidth, rel=0.03)


def test_the_profile_times_the_head_apart_from_the_rest_of_the_trunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loss is computed between the blocks' forward and their backward, the embedding before and after them:
    # 20 ms added to the loss is head time, and no more than that is.
    unchanged = _profiled()._planner.profile
    assert 0 < unchanged.head_s < unchanged.trunk_s
    loss = torch.nn.functional.cross_entropy

    def slow_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(0.02)
        return loss(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", slow_loss)
    slowed = _profiled()._planner.profile
    assert slowed.head_s > 0.02
    assert slowed.trunk_s - slowed.head_s < 0.02


def test_the_profile_times_what_offloading_costs_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every copy of an offloaded activation, out and back, made to cost the compute thread 20 ms: the profile's
    # figure per byte is that cost, each way, over the bytes. On a synchronous link it is the link's time: none.
    monkeypatch.setattr(activations_module, "OFFLOAD_MIN_BYTES", 4096)
    assert _profiled()._planner.profile.offload_compute_s_per_byte == 0
    delay, copies = 0.02, {"out": 0, "back": 0}
    to_host, to_device = EmulatedCopier.to_host, EmulatedCopier.to_device

    def slow_to_host(self: EmulatedCopier, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> Any:
        if what.startswith("offloaded activation"):
            copies["out"] += 1
            time.sleep(delay)
        return to_host(self, dst, src, what)

    def slow_to_device(self: EmulatedCopier, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                       what: str = "") -> Any:
        if "brought back" in what:
            copies["back"] += 1
            time.sleep(delay)
        return to_device(self, dst, src, after, what)

    monkeypatch.setattr(EmulatedCopier, "to_host", slow_to_host)
    monkeypatch.setattr(EmulatedCopier, "to_device", slow_to_device)
    strategy = _profiled(link=EmulatedLink(mode="thread", max_delay_s=0.0, check=False, verify=False))
    profile = strategy._planner.profile
    assert strategy.plan.activations == ["keep"] * len(profile.blocks)  # no offloading after the profiled steps
    assert copies["out"] == copies["back"] > 0
    per_step = copies["out"] / BudgetPlanner.PROFILED_STEPS
    expected = delay * per_step / sum(block.offloaded_bytes for block in profile.blocks)
    assert expected * 0.8 < profile.offload_compute_s_per_byte < expected * 1.5


@pytest.mark.parametrize("mode", ["lazy", "thread"])
def test_timing_offload_in_the_profile_changes_no_value_and_breaks_no_ordering(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trial copies each block's saved activations out and back on the real copy path, beside the census: under
    # the happens-before checker, with NaN in every destination until its copy runs, the run trains as plain does.
    monkeypatch.setattr(activations_module, "OFFLOAD_MIN_BYTES", 0)
    plain = tasks.fit("llama", "auto", accumulate_grad_batches=1, gradient_clip_val=None)
    strategy = SuperpipeStrategy(memory_budget="1GiB", link=EmulatedLink(mode=mode, seed=0, max_delay_s=2e-4))
    task = tasks.fit("llama", strategy, accumulate_grad_batches=1, gradient_clip_val=None)
    tried = [sample["profiler"].offload_trials for sample in strategy._planner._samples]
    assert len(tried) == BudgetPlanner.PROFILED_STEPS and all(len(blocks) == 3 for blocks in tried)
    torch.testing.assert_close(torch.tensor(task.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    assert tasks.max_relative_difference(task, plain) < 1e-5


# ------------------------------------------------------------------ the correction, on synthetic profiles


def _predicted(profile: Any, plan: Any) -> float:
    return predict(profile, plan.resident, plan.prefetch, plan.activations).step_s


@pytest.mark.parametrize(
    ("knobs", "term"),
    [
        (dict(resident_blocks=0, prefetch=1, activations="offload"), "offload_compute_s_per_byte"),
        (dict(resident_blocks=0, prefetch=1, activations="keep"), "copy_spread"),
        (dict(resident_blocks=0, prefetch=2, activations="keep"), "link_slowdown"),
        (dict(resident_blocks=3, prefetch=0, activations="keep"), "step_overhead_s"),
    ],
)
def test_a_correction_sets_the_term_the_plan_depends_on_so_that_it_predicts_what_was_measured(
    knobs: dict[str, Any], term: str
) -> None:
    # Frozen blocks (no gradients to copy) leave an all-resident plan nothing but the constant to correct.
    frozen = (0, 1, 2) if knobs["resident_blocks"] == 3 else ()
    profile = make_profile(3, frozen=frozen)
    plan = solve(profile, 2**40, **knobs)
    measured = 1.4 * plan.predicted_step_s
    corrected, words = correct(profile, plan, measured)
    assert _predicted(corrected, plan) == pytest.approx(measured, rel=1e-9)
    changed = [
        name
        for name in ("offload_compute_s_per_byte", "copy_spread", "link_slowdown", "step_overhead_s")
        if getattr(corrected, name) != getattr(profile, name)
    ]
    assert changed == [term] and words
    # Times only: every placement's bytes are what they were.
    assert predict(corrected, plan.resident, plan.prefetch, plan.activations).peak_bytes == plan.predicted_peak_bytes


def test_a_step_faster_than_predicted_never_fits_copies_faster_than_the_profile_timed_them() -> None:
    """A noisy fast step once fitted the link at 0.10x its profiled time: later plans would count on copies the
    link cannot give. Downward, the link stops at its profiled speed and the constant takes the rest."""
    profile = make_profile(3)
    plan = solve(profile, 2**40, resident_blocks=0, prefetch=2, activations="keep")
    measured = 0.5 * plan.predicted_step_s
    corrected, words = correct(profile, plan, measured)
    assert corrected.link_slowdown >= 1.0, words
    assert _predicted(corrected, plan) == pytest.approx(measured, rel=1e-9)
    # Once slowed (an earlier upward fit), a fast step brings the link back no further than its profiled speed.
    slowed = dataclasses.replace(profile, link_slowdown=3.0)
    back, _ = correct(slowed, plan, 0.9 * _predicted(slowed, plan))
    assert 1.0 <= back.link_slowdown < 3.0 and _predicted(back, plan) == pytest.approx(0.9 * _predicted(slowed, plan))


def _feed(plan_check: PlanCheck, times: list[float]) -> list[Any]:
    """Gives each step's time; returns the plans the check asked to apply."""
    applied = []
    for seconds in times:
        plan, _ = plan_check.step_done(seconds)
        if plan is not None:
            applied.append(plan)
    return applied


STEPS = check.SETTLE_STEPS + check.TIMED_STEPS


def test_a_plan_within_the_tolerance_holds_and_one_as_far_off_as_the_issue_is_corrected() -> None:
    profile = make_profile(3, link=0.5)
    plan = solve(profile, 2**40)
    within = PlanCheck(profile, plan, lambda p: solve(p, 2**40))
    # A slow first step (settling), then steps slowed by other work but one: the fastest of the timed ones counts.
    timed = [1.5] * (check.TIMED_STEPS - 1) + [1.05]
    settling = [5 * plan.predicted_step_s] * check.SETTLE_STEPS
    assert _feed(within, settling + [slowdown * plan.predicted_step_s for slowdown in timed]) == []
    assert within.done and within.plan.measured_step_s == pytest.approx(1.05 * plan.predicted_step_s)
    assert within.plan.corrections == ()
    # Its predicted step is now what it measured: the promise is the measured figure, not one 5% off it.
    assert within.plan.predicted_step_s == pytest.approx(1.05 * plan.predicted_step_s, rel=1e-9)
    assert within.plan.resident == plan.resident and within.plan.activations == plan.activations
    # Issue 30: measured 1.26x the prediction (the offloading mix). Corrected, with the new prediction its own.
    off = solve(profile, 2**40, activations="offload", resident_blocks=0)
    missed = PlanCheck(profile, off, lambda p: solve(p, 2**40, activations="offload", resident_blocks=0))
    _feed(missed, [1.26 * off.predicted_step_s] * STEPS)
    assert len(missed.corrections) == 1 and "+26%" in missed.corrections[0]
    assert missed.done and missed.plan.predicted_step_s == pytest.approx(1.26 * off.predicted_step_s, rel=1e-9)
    # Faster than promised by more than the tolerance: the plan stays, and its prediction becomes what it measured.
    fast = PlanCheck(profile, off, lambda p: pytest.fail("a plan faster than promised is not solved for again"))
    assert _feed(fast, [0.7 * off.predicted_step_s] * STEPS) == []
    assert fast.done and len(fast.corrections) == 1 and "-30%" in fast.corrections[0]
    assert fast.plan.resident == off.resident and fast.plan.activations == off.activations
    assert fast.plan.predicted_step_s == pytest.approx(0.7 * off.predicted_step_s, rel=1e-9)


def test_corrections_are_bounded_and_the_run_ends_on_the_fastest_placement_measured() -> None:
    profile = make_profile(3, link=0.5)
    placements = [
        dict(resident_blocks=r, prefetch=1, activations=mode)
        for r, mode in ((0, "offload"), (1, "keep"), (2, "recompute"), (0, "keep"))
    ]
    solved = iter(placements[1:])
    plan_check = PlanCheck(profile, solve(profile, 2**40, **placements[0]), lambda p: solve(p, 2**40, **next(solved)))
    slowdowns = iter([2.0, 1.5, 3.0, 2.5])  # every plan misses; the second is the fastest measured
    applied = []
    while not plan_check.done:
        slowdown = next(slowdowns)
        applied += _feed(plan_check, [slowdown * plan_check.plan.predicted_step_s] * STEPS)
    assert len(plan_check.checked) == 1 + check.MAX_CORRECTIONS
    assert len(plan_check.corrections) == 1 + check.MAX_CORRECTIONS  # the last one corrects, but solves no more
    fastest = min(plan_check.checked, key=lambda c: c.measured_s)
    assert len(fastest.plan.resident) == 1 and applied[-1].resident == fastest.plan.resident
    assert plan_check.plan.measured_step_s == fastest.measured_s
    assert plan_check.plan.predicted_step_s == pytest.approx(fastest.measured_s, rel=1e-9)  # refitted to it
    assert len(plan_check.plan.checks) == 1 + check.MAX_CORRECTIONS
    assert "correction 3" in plan_check.plan.table() and "measured step" in plan_check.plan.table()


def test_a_plan_that_holds_but_measured_slower_than_an_earlier_one_gives_way_to_it() -> None:
    profile = make_profile(3, link=0.5)
    first = solve(profile, 2**40, resident_blocks=0, prefetch=1, activations="offload")
    missed = 2 * first.predicted_step_s
    # The plan solved again promises a slow step and keeps that promise: slower than the first one measured.
    slow = dataclasses.replace(solve(profile, 2**40, resident_blocks=0, prefetch=0), predicted_step_s=10 * missed)
    plan_check = PlanCheck(profile, first, lambda p: slow)
    applied = _feed(plan_check, [missed] * STEPS + [10 * missed] * STEPS)
    assert [plan.prefetch for plan in applied] == [0, 1]  # the slow plan, then back to the first placement
    assert plan_check.done and plan_check.plan.measured_step_s == missed
    assert plan_check.plan.activations == first.activations and plan_check.plan.prefetch == first.prefetch
    assert plan_check.plan.predicted_step_s == pytest.approx(missed, rel=1e-9)  # the corrected model's, as measured


def _checked_sweep(link: float, budgets: int = 6) -> list[tuple[int, float, float]]:
    """Each budget's run, from the least placement's peak to the whole model's, on a synthetic 4-block profile whose
    steps take what a truth model says: the profile with what its samples missed (offloading's interference, 0.6 ms
    of compute per MiB each way, where the profile measured none; copies straying 50% from their median time). The
    check corrects the planner's model from those timings. Returns per budget ``(budget, the step the run ends on,
    the fastest step that fits)``."""
    profile = make_profile(4, link=link, trunk_update=True)
    truth = dataclasses.replace(profile, offload_compute_s_per_byte=0.6e-3 / 2**20, copy_spread=0.5)
    least = minimum_plan(profile).predicted_peak_bytes
    whole = predict(profile, range(4), 1, ["keep"] * 4).peak_bytes
    rows = []
    for k in range(budgets):
        budget = least + (whole - least) * k // (budgets - 1)
        plan_check = PlanCheck(profile, solve(profile, budget), lambda p, budget=budget: solve(p, budget))
        while not plan_check.done:
            plan_check.step_done(_predicted(truth, plan_check.plan))
        ended = plan_check.plan
        assert ended.measured_step_s == _predicted(truth, ended)
        assert ended.predicted_step_s == pytest.approx(ended.measured_step_s, rel=check.TOLERANCE)
        rows.append((budget, ended.measured_step_s, solve(truth, budget).predicted_step_s))
    return rows


@pytest.mark.parametrize("link", [1.0, 0.5], ids=["balanced", "copy-bound"])
def test_with_fake_timings_more_budget_never_ends_slower_and_each_run_near_the_fastest_that_fits(
    link: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30's property without a clock: at two link speeds, the step a run ends on never grows with the budget
    and is within 5% of the fastest placement that fits; without the check's corrections it is not."""
    rows = _checked_sweep(link)
    steps = [step for _, step, _ in rows]
    assert all(later <= min(steps[: i + 1]) * (1 + 1e-9) for i, later in enumerate(steps[1:])), steps
    assert all(step <= 1.05 * fastest for _, step, fastest in rows), rows
    # Without corrections the runs end on the first plans, solved from what the profile saw.
    monkeypatch.setattr(check, "correct", lambda profile, plan, measured: (profile, "none"))
    monkeypatch.setattr(check, "TOLERANCE", float("inf"))
    uncorrected = _checked_sweep(link)
    assert any(step > 1.05 * fastest for _, step, fastest in uncorrected), uncorrected


def test_ranks_take_rank_zeros_profile_and_the_slowest_ranks_steps_so_their_checks_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks whose clocks differ (each its own noise): checking with the slowest rank's step time, they take the
    same corrections and end on the same plan; each with its own times, they do not."""
    profile = make_profile(3, link=0.5)
    times = {0: [1.05, 1.3, 1.2], 1: [1.3, 1.05, 1.25]}  # per rank, each plan's step over its prediction

    def run(rank: int, agreed: bool) -> tuple[Any, ...]:
        monkeypatch.setattr(planner, "_several_ranks", lambda: agreed)
        monkeypatch.setattr(planner.dist, "get_world_size", lambda: 2, raising=False)
        plan_check = PlanCheck(profile, solve(profile, 2**40), lambda p: solve(p, 2**40))
        for factors in zip(times[0], times[1]):
            if plan_check.done:
                break
            # Each rank's step time for this plan; all_gather_object gives every rank both.
            both = [f * plan_check.plan.predicted_step_s for f in factors]
            monkeypatch.setattr(
                planner.dist, "all_gather_object", lambda out, seconds, both=both: out.__setitem__(slice(None), both),
                raising=False,
            )
            for _ in range(STEPS):
                plan_check.step_done(planner.slowest_rank(both[rank]))
        final = plan_check.plan
        return tuple(sorted(final.resident)), final.prefetch, tuple(final.activations), final.corrections

    assert run(0, agreed=True) == run(1, agreed=True)
    assert run(0, agreed=False) != run(1, agreed=False)
    # Rank 0's profile on every rank.
    monkeypatch.setattr(planner, "_several_ranks", lambda: True)
    monkeypatch.setattr(planner.dist, "broadcast_object_list", lambda shared, src: shared.__setitem__(0, "rank 0's"))
    assert planner.rank_zero_value("mine") == "rank 0's"


def test_the_copy_spread_is_measured_over_the_profiled_weights_copies() -> None:
    """Mean distance of each copy's time per byte from the median's, over the copies of at least half the largest
    one's bytes: 4 block copies at 1, 1, 1.5 and 0.5 ms per MB (median 1: spread (0 + 0 + 0.5 + 0.5) / 4)."""
    profiler = planner.StepProfiler.__new__(planner.StepProfiler)
    profiler.copies = {"h2d": [(10**6, 1e-3), (10**6, 1e-3), (10**6, 1.5e-3), (10**6, 0.5e-3), (10, 1.0)], "d2h": []}
    assert planner._copy_spread(profiler) == pytest.approx(0.25)
    profiler.copies["h2d"] = profiler.copies["h2d"][:2]
    assert planner._copy_spread(profiler) == 0.0  # too few copies to tell


# ------------------------------------------------------------------ values unchanged through re-placements


@pytest.fixture
def forced_replacements(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every check corrects (its clock says each step took ten times the one before, so every plan misses by far the
    model fitted to the last), one step timed per plan, and each solve gives the next of three placements unlike each
    other: the run re-places its blocks after every check."""

    def clock() -> Iterator[float]:  # read at each checked step's start and end
        now = 0.0
        for took in itertools.count():
            yield now
            now += 10.0**took
            yield now

    ticks = clock()
    monkeypatch.setattr(planner, "_clock", lambda engine: next(ticks))
    monkeypatch.setattr(check, "TIMED_STEPS", 1)
    monkeypatch.setattr(check, "SETTLE_STEPS", 1)
    placements = [
        dict(resident_blocks=1, prefetch=0, activations="offload"),
        dict(resident_blocks=0, prefetch=2, activations="keep"),
        dict(resident_blocks=2, prefetch=1, activations=["recompute", "offload", "keep"]),
    ]
    solved = iter(placements)
    monkeypatch.setattr(BudgetPlanner, "_solve", lambda self, profile: solve(profile, 2**40, **next(solved)))
    return placements


def _assert_replaced(strategy: SuperpipeStrategy, placements: list[dict[str, Any]]) -> None:
    plan = strategy.plan
    applied = [(len(c["resident"]), c["prefetch"], c["activations"]) for c in plan.checks]
    assert len(plan.checks) == 1 + check.MAX_CORRECTIONS == len(placements)
    for knobs, (resident, prefetch, modes) in zip(placements, applied[1:]):
        expected = knobs["activations"] if isinstance(knobs["activations"], list) else [knobs["activations"]] * 3
        assert (resident, prefetch, modes) == (knobs["resident_blocks"], knobs["prefetch"], expected)
    report = strategy.memory_report()
    assert report["resident_blocks"] == len(plan.resident) and plan.measured_step_s is not None


# 2 profiled steps, then 3 plans of 2 steps each, then the fastest measured.
_REPLACED_STEPS = 2 + 3 * 2 + 2


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("clipped", [True, False], ids=["clipped-accumulated", "unclipped"])
def test_re_placements_after_corrections_train_as_plain_lightning(
    forced_replacements: list[dict[str, Any]], clipped: bool
) -> None:
    options = {} if clipped else dict(accumulate_grad_batches=1, gradient_clip_val=None)
    plain = tasks.fit("llama", "auto", max_steps=_REPLACED_STEPS, **options)
    strategy = SuperpipeStrategy(memory_budget="1GiB")
    task = tasks.fit("llama", strategy, max_steps=_REPLACED_STEPS, **options)
    _assert_replaced(strategy, forced_replacements)
    assert len(task.losses) == len(plain.losses)
    torch.testing.assert_close(torch.tensor(task.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    assert tasks.max_relative_difference(task, plain) < 1e-5
    # And bitwise the streamed run without a budget: a re-placement moves buffers, never numbers.
    streamed = tasks.fit("llama", SuperpipeStrategy(), max_steps=_REPLACED_STEPS, **options)
    assert task.losses == streamed.losses and tasks.max_relative_difference(task, streamed) == 0.0


@pytest.mark.usefixtures("emulated_link")
def test_re_placements_on_the_disk_tier_train_as_the_host_tier(
    forced_replacements: list[dict[str, Any]], tmp_path: Path
) -> None:
    host = tasks.fit("llama", "superpipe", max_steps=_REPLACED_STEPS)
    (tmp_path / "tier").mkdir()
    strategy = SuperpipeStrategy(memory_budget="1GiB", offload_device="disk", offload_path=tmp_path / "tier")
    task = tasks.fit("llama", strategy, max_steps=_REPLACED_STEPS)
    _assert_replaced(strategy, forced_replacements)
    assert task.losses == host.losses and tasks.max_relative_difference(task, host) == 0.0


# ------------------------------------------------------------------ more budget is never slower


def assert_never_slower(step_s_by_budget: dict[int, float], tolerance: float) -> None:
    """Each budget's step at most ``1 + tolerance`` times the step of every smaller budget.

    Raises:
        AssertionError: Naming the two budgets and their steps.
    """
    budgets = sorted(step_s_by_budget)
    for i, smaller in enumerate(budgets):
        for larger in budgets[i + 1 :]:
            ratio = step_s_by_budget[larger] / step_s_by_budget[smaller]
            assert ratio <= 1 + tolerance, (
                f"a budget of {larger} bytes ends on a step of {step_s_by_budget[larger] * 1e3:.1f} ms, {ratio:.2f}x"
                f" the {step_s_by_budget[smaller] * 1e3:.1f} ms of {smaller} bytes"
            )


#: Noise on a shared machine moves the fastest of five steps by several percent; the issue's case was 1.26x.
MONOTONE_TOLERANCE = 0.15


def test_the_monotonicity_check_fails_on_the_issues_case() -> None:
    assert_never_slower({25 * 2**20: 0.232, 30 * 2**20: 0.240}, MONOTONE_TOLERANCE)
    with pytest.raises(AssertionError, match=r"1\.26x"):
        assert_never_slower({25 * 2**20: 0.232, 30 * 2**20: 0.292, 40 * 2**20: 0.230}, MONOTONE_TOLERANCE)


def _wide_llama() -> torch.nn.Module:
    """6 blocks of about 0.8 MiB: a block's copy on the capped link takes about its forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=4)
    config = LlamaConfig(vocab_size=VOCAB, **sizes)
    return LlamaForCausalLM(config)


def _timed_run(budget: int, bandwidth: float, steps: int) -> SuperpipeStrategy:
    # Timing only (no checker, no NaN fills): what the compute thread does is what a GPU run would do.
    link = EmulatedLink(mode="thread", bandwidth=bandwidth, max_delay_s=0.0, check=False, verify=False)
    strategy = SuperpipeStrategy(memory_budget=budget, link=link)
    ids = torch.randint(0, VOCAB, (2 * steps, 64), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids), batch_size=2)
    tasks.fit_task(
        lambda: tasks.Task(_wide_llama, "lm", optimizer="adamw-fused"),
        strategy,
        data,
        max_steps=steps,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        deterministic=False,
    )
    return strategy


def _final_step_s(budget: int, bandwidth: float) -> float:
    """The measured step of the plan a budget's run ends on (the fastest of its check's steps)."""
    checks = 1 + check.MAX_CORRECTIONS
    strategy = _timed_run(budget, bandwidth, BudgetPlanner.PROFILED_STEPS + checks * STEPS)
    assert strategy.plan.measured_step_s is not None, "the check did not end within its bounded steps"
    return strategy.plan.measured_step_s


@pytest.mark.skipif(not os.environ.get("SUPERPIPE_TIMING_TESTS"), reason="wall-clock timing: flaky on a loaded CI"
                    " machine (it failed there once); run with SUPERPIPE_TIMING_TESTS=1, and see bench_planner.py")
@pytest.mark.parametrize("copies_per_forward", [1.0, 2.0], ids=["copy-as-forward", "copy-twice-forward"])
def test_a_larger_budget_never_ends_on_a_slower_plan(copies_per_forward: float) -> None:
    probe = _timed_run(2**40, 1e12, BudgetPlanner.PROFILED_STEPS + 1)
    profile = probe._planner.profile
    block = profile.blocks[len(profile.blocks) // 2]
    bandwidth = block.weight_bytes / (copies_per_forward * block.forward_s)
    capped = dataclasses.replace(profile, h2d_bytes_per_s=bandwidth, d2h_bytes_per_s=bandwidth)
    least = int(1.1 * minimum_plan(capped).predicted_peak_bytes)
    whole = int(1.1 * predict(capped, range(len(profile.blocks)), 1, ["keep"] * len(profile.blocks)).peak_bytes)
    budgets = [least + (whole - least) * k // 3 for k in range(4)]
    measured = {budget: _final_step_s(budget, bandwidth) for budget in budgets}
    try:
        assert_never_slower(measured, MONOTONE_TOLERANCE)
    except AssertionError:
        # Noise only ever slows a run down: a budget measured again keeps the faster of its two runs.
        measured = {budget: min(step_s, _final_step_s(budget, bandwidth)) for budget, step_s in measured.items()}
        assert_never_slower(measured, MONOTONE_TOLERANCE)
