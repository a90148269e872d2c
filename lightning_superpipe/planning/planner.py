"""``SuperpipeStrategy(memory_budget=...)``: profile the first steps, solve for the placement, apply it.

The order of events in a run with a budget:

1. Before anything is allocated, the bytes that any placement needs (the weights outside blocks and their
   gradients, one slot of the largest block and its gradients) are checked against the budget
   (:func:`check_static`); a budget below them is refused there.
2. The first :attr:`BudgetPlanner.PROFILED_STEPS` optimizer steps run in the placement that needs least memory
   (no resident block, every block recomputed, nothing prefetched: one slot), the host step
   after backward. The first micro-batch of each is profiled (:class:`~.profile.StepProfiler`): compute per block,
   copies, what each activation placement would hold; and so is the optimizer step. Profiling changes no value:
   every placement computes the same losses and gradients, and the census of activations runs on the side with
   the RNG put back.
3. From the fastest of the profiled samples (the first step also pays for warm-up), the placement that predicts the
   shortest step within the budget is solved for (:func:`~.solver.solve`), the engine is re-placed
   (``StreamingEngine.replan``), and the plan's table is printed once. A budget that only the activations make
   impossible is refused here, with the least budget that works.
4. The plan applied is timed over the next steps (:mod:`.check`); one measured more than ``check.TOLERANCE`` above
   its prediction corrects the model with what was measured, and the placement is solved for again, a bounded number
   of times. :attr:`BudgetPlanner.plan` is then the plan the run ends on, with its measured step and the corrections.

An evaluation-only run (``Trainer.validate/test/predict``) has no backward to profile: it keeps as many blocks
resident as fit beside one prefetched slot (forward-only passes hold no activations between blocks), which is the
fastest placement a forward pass allows.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from time import perf_counter  # bound at import: a test's patch of time.perf_counter times its own code
from typing import Any, Callable, Optional, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_superpipe.memory.host import transfer_bytes, travels_in
from lightning_superpipe.planning.budget import MemoryBudget, resolve_budget
from lightning_superpipe.planning.check import PlanCheck
from lightning_superpipe.planning.cost import predict
from lightning_superpipe.planning.engine_view import PlannedEngine
from lightning_superpipe.planning.plan import ActivationsPolicy, Plan
from lightning_superpipe.planning.profile import BlockCosts, Profile, StepProfiler
from lightning_superpipe.planning.solver import InfeasibleBudget, solve
from lightning_superpipe.units import format_bytes

T = TypeVar("T")


class BudgetExceededError(torch.OutOfMemoryError, MisconfigurationException):
    """No placement holds a batch within ``memory_budget``: the device memory the run may use is the budget, so this
    is an out-of-memory error, raised before the memory is taken (a ``torch.OutOfMemoryError``, which Lightning's
    batch-size finder backs off from), and a misconfiguration (a ``MisconfigurationException``)."""


@dataclass(frozen=True)
class StaticCosts:
    """Device bytes known before anything is allocated."""

    trunk_bytes: int
    trunk_gradient_bytes: int
    block_bytes: list[int]
    largest_gradient_bytes: int
    #: The share of the parameters' elements that train, and the widest element the blocks travel in (bytes): what
    #: the advice of a refused budget can suggest (LoRA where most train, 16 bits where they travel in 32).
    trainable_share: float = 0.0
    widest_itemsize: int = 2

    def least_bytes(self, slots: int) -> int:
        """What the placement with no resident block and ``slots`` slots holds before any activation."""
        return (self.trunk_bytes + self.trunk_gradient_bytes + slots * max(self.block_bytes, default=0)
                + self.largest_gradient_bytes)


def static_costs(
    block_params: Sequence[Sequence[nn.Parameter]],
    trunk_params: Sequence[nn.Parameter],
    transfer_dtype: Optional[torch.dtype],
    training: bool,
) -> StaticCosts:
    """The device bytes of weights and gradients, from the parameters alone."""

    def dtype_of(params: Sequence[nn.Parameter]) -> torch.dtype:
        return travels_in(params, transfer_dtype)

    trainable = [[p for p in block if p.requires_grad] for block in block_params]
    every = [p for block in block_params for p in block] + list(trunk_params)
    numel = sum(p.numel() for p in every)
    return StaticCosts(
        trainable_share=sum(p.numel() for p in every if p.requires_grad) / numel if numel else 0.0,
        widest_itemsize=max((dtype_of(block).itemsize for block in block_params if block), default=2),
        trunk_bytes=sum(p.numel() * p.element_size() for p in trunk_params),
        trunk_gradient_bytes=_gradient_bytes(trunk_params) if training else 0,
        block_bytes=[transfer_bytes(block, dtype_of(block)) if block else 0 for block in block_params],
        largest_gradient_bytes=max(
            (transfer_bytes(t, dtype_of(t)) for t in trainable if t), default=0
        ) if training else 0,
    )


class BudgetPlanner:
    """Plans one run's placement from its memory budget (see the module).

    Args:
        memory_budget: The budget as the user wrote it (:func:`~.budget.resolve_budget`).
        device: The compute device.
        resident_blocks: A resident-block count the user pinned, or ``None``.
        prefetch: A prefetch depth the user pinned, or ``None``.
        activations: A placement (or one per block) the user pinned, or ``None``.

    Raises:
        MisconfigurationException: For a budget that means nothing on ``device``.
    """

    #: Optimizer steps profiled before the plan is solved; the fastest sample counts.
    PROFILED_STEPS = 2

    def __init__(
        self,
        memory_budget: MemoryBudget,
        device: torch.device,
        resident_blocks: Optional[int],
        prefetch: Optional[int],
        activations: Optional[ActivationsPolicy],
    ) -> None:
        self.call = f"SuperpipeStrategy(memory_budget={memory_budget!r})"
        try:
            self.budget_bytes = resolve_budget(memory_budget, device)
        except ValueError as error:
            raise MisconfigurationException(str(error)) from error
        self.pinned: dict[str, Any] = {"resident_blocks": resident_blocks, "prefetch": prefetch,
                                       "activations": activations}
        self.plan: Optional[Plan] = None
        #: What the plan was solved from (after the profiled steps).
        self.profile: Optional[Profile] = None
        self._static: Optional[StaticCosts] = None
        self._profiler: Optional[StepProfiler] = None
        self._samples: list[dict[str, Any]] = []
        self._closure_s = 0.0
        self._profiling_step = False
        #: Times the plan once applied, and corrects it (after the profiled steps).
        self.check: Optional[PlanCheck] = None
        self._step_start: Optional[float] = None
        #: The most tensor elements of a batch profiled so far: a larger batch is profiled again.
        self._profiled_elements = 0
        #: Times an applied plan's measured peak went over the budget and the model was corrected.
        self.peak_corrections = 0

    # ------------------------------------------------------------------ before allocating

    def first_placement(self, static: StaticCosts, training: bool) -> tuple[int, int, str]:
        """The placement to start in: how many blocks are resident (evenly spaced), prefetch and activations.

        Raises:
            MisconfigurationException: If no placement can fit the budget, naming what the least one holds.
        """
        self._static = static
        least = static.least_bytes(slots=1)
        if least > self.budget_bytes:
            raise MisconfigurationException(
                f"{self.call} is {format_bytes(self.budget_bytes)}, and any placement of this model needs more than"
                f" {format_bytes(least)} before its activations: the weights outside blocks"
                f" ({format_bytes(static.trunk_bytes)}), their gradients ({format_bytes(static.trunk_gradient_bytes)}),"
                f" one slot of the largest block ({format_bytes(max(static.block_bytes, default=0))}) and that"
                f" block's gradients ({format_bytes(static.largest_gradient_bytes)}). Raise the budget to at least"
                f" {format_bytes(least)} plus the activations{_lighter(static)}."
            )
        if training:
            # One slot: the activations are not known yet, and the profiler times every copy on its own anyway, so
            # a deeper prefetch would measure nothing more and hold a block more.
            return 0, 0, "recompute"
        # Forward only: as many resident blocks as fit beside the slots, evenly spaced by the engine.
        resident_room = self.budget_bytes - static.least_bytes(slots=2)
        count = 0
        for nbytes in sorted(static.block_bytes):
            if nbytes > resident_room:
                break
            resident_room -= nbytes
            count += 1
        if self.pinned["resident_blocks"] is not None:
            count = min(count, self.pinned["resident_blocks"])
        return count, 1, "recompute"

    # ------------------------------------------------------------------ profiling

    @property
    def profiling(self) -> bool:
        """Whether the run is still in its profiled steps (the optimizer then steps after backward)."""
        return self.plan is None

    def see_batch(self, engine: PlannedEngine, batch: Any) -> None:
        """Before a micro-batch's pass: a batch of more elements than any profiled (a longer sequence, a larger batch
        from Lightning's batch-size finder) may hold more activations than the plan has room for, so the run goes back
        to the least placement and profiles again."""
        elements = sum(tensor.numel() for tensor in _tensors_in(batch))
        if elements <= self._profiled_elements:
            return
        first, profiled = self._profiled_elements == 0, self._profiled_elements
        if not first and self.profile is not None:
            self._refuse_if_too_large(self.profile, elements / profiled, elements)
        self._profiled_elements = elements
        if first or (self.plan is None and not self._samples and not self._profiling_step):
            return
        self._restart(engine)
        rank_zero_info(
            f"SuperpipeStrategy: a batch of {elements} elements is larger than any it planned for; {self.call}"
            " profiles it again in the least placement."
        )

    def _refuse_if_too_large(self, profile: Profile, ratio: float, elements: int) -> None:
        """Refuses a batch ``ratio`` times the profiled one whose activations, grown as many times, leave no
        placement within the budget: it would go over the budget in the least placement as it is profiled (a
        lower bound where activations grow faster than the batch, as attention's may with the sequence).

        Raises:
            BudgetExceededError: Before the batch's pass, the plan for the smaller batch staying as it was.
        """
        try:
            solve(grown_activations(profile, ratio), self.budget_bytes, **self.pinned)
        except InfeasibleBudget as error:
            raise BudgetExceededError(
                f"{self.call}: a batch of {elements} elements, {ratio:.3g} times the one profiled, would hold"
                f" {ratio:.3g} times its activations: {error} (Raised as torch.OutOfMemoryError before the batch runs,"
                " as CUDA's out of memory error would be, so that Lightning's batch-size finder backs off.)"
            ) from error

    def _restart(self, engine: PlannedEngine) -> None:
        """Back to the least placement, profiling from the next micro-batch on."""
        if self._profiler is not None:
            self._profiler.pause()
            self._profiler.stop()
        self.plan, self.profile, self.check, self._profiler = None, None, None, None
        self._samples, self._closure_s, self._profiling_step, self._step_start = [], 0.0, False, None
        engine.pending.settle()  # a pipelined step still writes the masters the new buffers are filled from
        engine.replan([], 0, "recompute")

    def start_micro_batch(self, engine: PlannedEngine) -> None:
        """Profiles the first micro-batch of each profiled step; while the plan is checked, starts the step's
        clock."""
        if self.check is not None and not self.check.done and self._step_start is None:
            self._step_start = _clock(engine)
        if self.plan is not None or self._profiling_step:
            return
        self._profiling_step = True
        self._profiler = StepProfiler(engine, len(engine.homes))
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(engine.device)
        self._profiler.start()

    def end_backward(self, engine: PlannedEngine) -> None:
        if self._profiler is None or self._profiler.engine.profiler is None:
            return
        self._profiler.pause()
        sample: dict[str, Any] = {"profiler": self._profiler, "ledger_peak": engine.ledger.peak_bytes}
        if engine.device.type == "cuda":
            sample["cuda_peak"] = torch.cuda.max_memory_allocated(engine.device)
        self._samples.append(sample)

    def timed_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer's closure (forward and backward), timed during profiled steps."""
        if self.plan is not None:
            return closure

        def timed() -> Any:
            start = perf_counter()
            try:
                return closure()
            finally:
                self._closure_s += perf_counter() - start

        return timed

    def after_step(self, engine: PlannedEngine, step_s: float, refresh_s: float, *, micro_batches: int,
                   overlap: bool) -> None:
        """Records a profiled step's host time (``step_s`` covers ``optimizer_step``, closure included); after the
        last profiled step, solves for the plan, gives it to the engine and prints its table. ``micro_batches``: the
        step's accumulation; ``overlap``: whether the optimizer will step during backward once the plan runs.

        Raises:
            MisconfigurationException: If no placement fits the budget with the measured activations.
        """
        if self.plan is not None:
            if self._within_budget(engine):
                self._checked_step(engine)
            engine.ledger.start_window()
            return
        if not self._samples:
            return
        sample = self._samples[-1]
        # The refresh's copies are in the model (the trunk's and changed blocks' copies); only its host work is here.
        copies_s = self._profiler.stop() if self._profiler is not None else 0.0
        self._profiler = None
        sample.setdefault("optimizer_s", step_s - self._closure_s)
        sample.setdefault("refresh_s", max(0.0, refresh_s - copies_s))
        self._closure_s = 0.0
        self._profiling_step = False
        if len(self._samples) < self.PROFILED_STEPS:
            return
        # Every rank solves from rank 0's profile and times each checked step as the slowest rank's: the ranks then
        # take the same plan and the same corrections (each rank's own timings would differ by noise).
        self.profile = rank_zero_value(self._profile(engine, micro_batches, overlap))
        self._apply(engine, self._solve_or_refuse(engine, self.profile), "SuperpipeStrategy's plan for {call}:")

    def _solve_or_refuse(self, engine: PlannedEngine, profile: Profile) -> Plan:
        """The plan of ``profile``; where none fits, the run is back in the least placement, profiling afresh from
        the next batch, and the error is raised.

        Raises:
            BudgetExceededError: If no placement fits the budget with the measured activations.
        """
        try:
            return solve(profile, self.budget_bytes, **self.pinned)
        except InfeasibleBudget as error:
            # Lightning's batch-size finder goes on with a smaller batch: that one is profiled as a first one.
            self._restart(engine)
            self._profiled_elements = 0
            raise BudgetExceededError(
                f"{self.call}: {error} (Raised as torch.OutOfMemoryError, as CUDA's out of memory error would be"
                " for this batch, so that Lightning's batch-size finder backs off.)"
            ) from error

    def _apply(self, engine: PlannedEngine, plan: Plan, title: str) -> None:
        """Places the engine as ``plan`` says, checks it from now on, and prints its table under ``title``."""
        engine.pending.settle()  # a pipelined step still writes the masters the new buffers are filled from
        engine.replan(sorted(plan.resident), plan.prefetch, plan.activations)
        assert self.profile is not None
        self.plan = plan
        self.check = PlanCheck(self.profile, plan, self._solve)
        engine.ledger.start_window()
        rank_zero_info(f"{title.format(call=self.call)}\n{plan.table()}\nIt is checked once applied:"
                       f" {PlanCheck.cost()}.")

    def _within_budget(self, engine: PlannedEngine) -> bool:
        """After a step in the plan: its measured peak joins the plan; where it went over the budget, the model's
        margin takes the excess and the placement is solved for again and applied (before the next step).
        Returns whether the plan stayed.

        Raises:
            BudgetExceededError: If no placement fits the budget with the corrected margin.
        """
        assert self.plan is not None and self.profile is not None
        measured = engine.ledger.window_peak_bytes
        if engine.device.type == "cuda":  # what the allocator holds too (its rounding, what is not saved)
            measured = max(measured, torch.cuda.max_memory_allocated(engine.device))
        measured = slowest_rank(measured)
        peak = max(measured, self.plan.measured_peak_bytes or 0)
        self.plan = dataclasses.replace(self.plan, measured_peak_bytes=peak)
        if self.check is not None:
            self.check.plan = dataclasses.replace(self.check.plan, measured_peak_bytes=peak)
        if measured <= self.budget_bytes:
            return True
        self.profile, correction = correct_peak(self.profile, self.plan, measured)
        self.peak_corrections += 1
        self._step_start = None
        title = (
            f"SuperpipeStrategy measured a peak of {format_bytes(measured)} against {format_bytes(self.budget_bytes)}"
            f" for {{call}} ({format_bytes(self.plan.predicted_peak_bytes)} predicted): {correction}, and the"
            " placement is solved for again:"
        )
        self._apply(engine, self._solve_or_refuse(engine, self.profile), title)
        return False

    def _solve(self, profile: Profile) -> Plan:
        """The plan of ``profile`` for this run's budget and pinned knobs (a corrected profile fits it too: the
        corrections change times, not bytes)."""
        return solve(profile, self.budget_bytes, **self.pinned)

    def _checked_step(self, engine: PlannedEngine) -> None:
        """Gives a step's time to the check; applies the plan it solved for again, if any."""
        if self.check is None or self._step_start is None:
            return
        seconds = slowest_rank(_clock(engine) - self._step_start)
        self._step_start = None
        plan, line = self.check.step_done(seconds)
        self.plan = self.check.plan
        if plan is not None:
            engine.pending.settle()  # a pipelined step still writes the masters the new buffers are filled from
            engine.replan(sorted(plan.resident), plan.prefetch, plan.activations)
            self.plan = self.check.plan = dataclasses.replace(plan, measured_peak_bytes=None)
        if line is not None:
            rank_zero_info(line + (f"\n{plan.table()}" if plan is not None else ""))

    def _profile(self, engine: PlannedEngine, micro_batches: int, overlap: bool) -> Profile:
        best = {name: min(s[name] for s in self._samples) for name in ("optimizer_s", "refresh_s")}
        profilers = [s["profiler"] for s in self._samples]

        def fastest(values: Callable[[StepProfiler], Sequence[float]], index: int) -> float:
            return min(values(p)[index] for p in profilers)

        numel = [sum(piece.numel for piece in home.trainable) if home is not None else 0 for home in engine.homes]
        trunk_numel = sum(p.numel() for p in engine.trunk_parameters() if p.requires_grad)
        total_numel = max(1, sum(numel) + trunk_numel)
        # The host step is per element for SGD/Adam-like optimizers: each block's share is its share of elements.
        per_element_s = best["optimizer_s"] / total_numel
        itemsize = {i: home.transfer_dtype.itemsize for i, home in enumerate(engine.homes) if home is not None}
        blocks = [
            BlockCosts(
                forward_s=fastest(lambda p: p.forward_s, i),
                backward_s=fastest(lambda p: p.backward_s, i),
                recompute_s=fastest(lambda p: p.recompute_s, i),
                weight_bytes=home.transfer_bytes if home is not None else 0,
                gradient_bytes=numel[i] * itemsize.get(i, 0),
                kept_bytes=max(p.kept_bytes[i] for p in profilers),
                offloaded_bytes=max(p.offloaded_bytes[i] for p in profilers),
                small_bytes=max(p.small_bytes[i] for p in profilers),
                input_bytes=max(p.input_bytes[i] for p in profilers),
                saved_input_bytes=min(p.saved_input_bytes[i] for p in profilers),
                optimizer_s=numel[i] * per_element_s,
            )
            for i, home in enumerate(engine.homes)
        ]
        blocks = _alike_blocks_alike(blocks)
        h2d = _speed(profilers, "h2d", engine.copier.asynchronous)
        d2h = _speed(profilers, "d2h", engine.copier.asynchronous) or h2d
        ledger_peak = max(s["ledger_peak"] for s in self._samples)
        margin = max(s["cuda_peak"] for s in self._samples) - ledger_peak if "cuda_peak" in self._samples[0] else 0
        return Profile(
            blocks=blocks,
            trunk_s=min(p.trunk_s for p in profilers),
            head_s=min(p.head_s for p in profilers),
            trunk_optimizer_s=trunk_numel * per_element_s + best["refresh_s"],
            h2d_bytes_per_s=h2d or float("inf"),
            d2h_bytes_per_s=d2h or float("inf"),
            asynchronous=engine.copier.asynchronous,
            overlap_optimizer=overlap,
            micro_batches=micro_batches,
            trunk_bytes=engine.trunk_device_bytes(),
            # Bounds, not measurements, as what the gradients hold at once depends on timing: every trunk gradient,
            # and the largest block's gradients twice where copies are asynchronous (one block leaves while the next
            # one's exist already).
            trunk_gradient_bytes=self._static.trunk_gradient_bytes,
            block_gradient_bytes=(2 if engine.copier.asynchronous else 1) * self._static.largest_gradient_bytes,
            margin_bytes=max(0, margin),
            trunk_update_bytes=self._static.trunk_gradient_bytes,
            trunk_gradient_bytes_in_blocks=_gradient_bytes(
                {id(p): p for profiler in profilers for p in profiler.used_after_blocks.values()}.values()
            ),
            copy_spread=min(_copy_spread(p) for p in profilers),
            outside_activation_bytes=max(p.outside_bytes for p in profilers),
            outside_activation_bytes_in_blocks=max(p.outside_bytes_in_blocks for p in profilers),
            trunk_gradient_bytes_held_in_blocks=(
                None if engine.copier.asynchronous else max(p.trunk_gradient_bytes_in_blocks for p in profilers)
            ),
            offload_compute_s_per_byte=_offload_compute_per_byte(profilers),
        )


#: The :class:`~.profile.BlockCosts` fields that grow with the batch.
_ACTIVATIONS = ("kept_bytes", "offloaded_bytes", "small_bytes", "input_bytes", "saved_input_bytes")


def grown_activations(profile: Profile, ratio: float) -> Profile:
    """``profile`` with every activation figure (the blocks' and those saved outside them) ``ratio`` times as large."""
    return dataclasses.replace(
        profile,
        blocks=[dataclasses.replace(block, **{name: int(getattr(block, name) * ratio) for name in _ACTIVATIONS})
                for block in profile.blocks],
        outside_activation_bytes=int(profile.outside_activation_bytes * ratio),
        outside_activation_bytes_in_blocks=int(profile.outside_activation_bytes_in_blocks * ratio),
    )


def correct_peak(profile: Profile, plan: Plan, measured: int) -> tuple[Profile, str]:
    """The profile corrected so that ``plan``'s placement is predicted to hold ``measured`` bytes at its peak, and
    the correction in words: the activations grown by the least factor that gets there (what a placement holds
    beyond its weights is its activations, and those of another placement grow alike), or where they cannot (too few
    of them at the peak), the margin by the difference."""

    def peak(factor: float) -> int:
        return predict(grown_activations(profile, factor), plan.resident, plan.prefetch, plan.activations).peak_bytes

    low, high = 1.0, 2.0
    while peak(high) < measured and high < 2**10:
        low, high = high, 2 * high
    if peak(high) >= measured:
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if peak(middle) < measured else (low, middle)
        return grown_activations(profile, high), f"the model's activations grow {high:.3f}x"
    excess = measured - peak(1.0)
    return dataclasses.replace(profile, margin_bytes=profile.margin_bytes + excess), (
        f"the model's margin grows by {format_bytes(excess)}"
    )


def _tensors_in(tree: Any) -> list[Tensor]:
    """The tensors among ``tree``'s leaves (a batch: a tensor, or nested tuples, lists and dicts of them)."""
    return [value for value in tree_flatten(tree)[0] if isinstance(value, Tensor)]


def _lighter(static: StaticCosts) -> str:
    """What else would lower a refused budget's least placement, as the end of its sentence: train fewer parameters
    where most train, 16-bit weights where they travel in 32 bits."""
    ways = []
    if static.trainable_share > 0.5:
        ways.append("train fewer parameters (e.g. LoRA)")
    if static.widest_itemsize >= 4:
        ways.append("train in 16 bits (`precision='bf16-true'`)")
    return f", or {' or '.join(ways)}" if ways else ""


def _gradient_bytes(params: Iterable[Tensor]) -> int:
    """The bytes of the gradients of ``params`` that train (each as its parameter's dtype)."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_zero_value(value: T) -> T:
    """``value`` as rank 0 has it, on every rank (itself without a process group of several ranks)."""
    if not _several_ranks():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def slowest_rank(seconds: float) -> float:
    """The most ``seconds`` of any rank, on every rank: a data-parallel step waits for its slowest rank."""
    if not _several_ranks():
        return seconds
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seconds)
    return max(everyone)


def _clock(engine: PlannedEngine) -> float:
    """Now, once the device has done what was asked of it."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return perf_counter()


def _alike_blocks_alike(blocks: list[BlockCosts]) -> list[BlockCosts]:
    """Gives blocks of the same bytes (the layers of one stack) the median of their times: they do the same work,
    timing noise would only make the solver tell them apart."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, block in enumerate(blocks):
        key = (block.weight_bytes, block.gradient_bytes, block.kept_bytes, block.offloaded_bytes, block.small_bytes,
               block.input_bytes, block.saved_input_bytes)
        groups.setdefault(key, []).append(index)
    alike = list(blocks)
    for members in groups.values():
        times = {
            name: statistics.median(getattr(blocks[i], name) for i in members)
            for name in ("forward_s", "backward_s", "recompute_s", "optimizer_s")
        }
        for i in members:
            alike[i] = dataclasses.replace(blocks[i], **times)
    return alike


def _copy_spread(profiler: StepProfiler) -> float:
    """How far a weights' copy's time per byte strays from the median one's, on average, as a fraction of it: over
    the host-to-device copies of at least half the largest one's bytes (the blocks' weights; smaller copies are
    latency more than bandwidth). 0 with fewer than three such copies."""
    copies = profiler.copies["h2d"]
    largest = max((nbytes for nbytes, _ in copies), default=0)
    per_byte = [seconds / nbytes for nbytes, seconds in copies if nbytes >= largest / 2 and nbytes > 0]
    if len(per_byte) < 3:
        return 0.0
    middle = statistics.median(per_byte)
    return statistics.fmean(abs(r - middle) for r in per_byte) / middle if middle > 0 else 0.0


def _offload_compute_per_byte(profilers: Sequence[StepProfiler]) -> float:
    """The compute each offloaded byte costs, each way, from the blocks' offload trials (:class:`OffloadTiming`):
    per block, the fastest of each timing over the profiled steps; the compute the copies added out and back, summed
    over the blocks, over twice their bytes. 0 where no block was tried (nothing to offload, or a synchronous link)."""
    added_s, nbytes = 0.0, 0
    for index in {index for profiler in profilers for index in profiler.offload_trials}:
        trials = [profiler.offload_trials[index] for profiler in profilers if index in profiler.offload_trials]
        fastest = {name: min(getattr(trial, name) for trial in trials)
                   for name in ("forward_s", "out_s", "computed_s", "back_s")}
        added_s += fastest["out_s"] - fastest["forward_s"] + fastest["back_s"] - fastest["computed_s"]
        nbytes += trials[0].offloaded_bytes
    return max(0.0, added_s / (2 * nbytes)) if nbytes else 0.0


def _speed(profilers: Sequence[StepProfiler], direction: str, asynchronous: bool) -> float:
    """Bytes per second of one direction of the link over the profiled copies (0 if none was made).

    Each profiled copy ran alone and was waited for, so its time includes a latency (issuing it, waking the waiter)
    that copies queued on a stream do not pay one after another. Where copies run beside compute, the speed is
    therefore the slope of time over bytes: a least-squares line through the fastest copy of each size (other work
    on the machine only slows a copy down), over the sizes of at least 1/64 of the largest (the smaller are latency
    alone). On a synchronous link, where each copy's latency adds to the step, it is the bytes over the seconds of
    the faster sample."""
    copies = [(nbytes, seconds) for profiler in profilers for nbytes, seconds in profiler.copies[direction]]
    largest = max((nbytes for nbytes, _ in copies), default=0)
    fastest: dict[int, float] = {}
    for nbytes, seconds in copies:
        if nbytes >= largest / 64 and seconds > 0:
            fastest[nbytes] = min(seconds, fastest.get(nbytes, math.inf))
    if asynchronous and len(fastest) >= 2:
        slope, latency = np.polyfit(list(fastest), list(fastest.values()), 1)
        if slope > 0 and latency >= 0:
            return float(1 / slope)
    speeds = [
        sum(nbytes for nbytes, _ in p.copies[direction]) / p.copy_s[direction] for p in profilers if p.copy_s[direction]
    ]
    return max(speeds, default=0.0)


__all__ = ["BudgetExceededError", "BudgetPlanner", "InfeasibleBudget", "StaticCosts", "static_costs"]
