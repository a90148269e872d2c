"""Which way each host optimizer step runs, and running it that way.

* ``overlapped``: during backward, block by block; exact where nothing after backward changes a gradient.
* ``speculative``: during backward, decided after it (commit, redo or discard, :mod:`.speculation`); it keeps the
  masters and optimizer state of what it stepped while backward runs.
* ``pipelined``: launched after the pre-step work, finished while the next forward runs (:mod:`.pipelined`); each
  block's next use waits for its step.
* ``serial``: after backward, the plain step.

:func:`choose_step_mode` picks one per step from the strategy's ``overlap_optimizer`` knob and what the run does
(clipping, a gradient scaler, hooks that may rewrite gradients, the optimizer, the host memory free, how often
clipping fired lately); :class:`OptimizerSteps` runs the step in it and counts.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe import host_memory
from lightning_superpipe.stepping.optimizers import (
    REGISTER_HINT,
    has_step_hooks,
    shadow_of,
    updates_each_parameter_alone,
)
from lightning_superpipe.stepping.overlap import OverlappedStep
from lightning_superpipe.stepping.param_groups import restricted
from lightning_superpipe.stepping.pipelined import KindSteps, PipelinedStep
from lightning_superpipe.stepping.speculation import (
    KeptState,
    PreStepWatch,
    SpeculativeUnscale,
    gradient_preparation,
)


class StepHomes(Protocol):
    """What the step modes need of the run's homes (:class:`~lightning_superpipe.memory.home.Homes`)."""

    last_micro_batch: bool
    keeps_gradients: bool
    keeps_previous_step: bool
    own_steps: Optional[tuple[str, str]]
    speculation_outcome: Optional[str]
    gradients_changed: Optional[bool]

    def speculate(self, unscale: Optional[Tensor], clip_value: Optional[float]) -> None: ...

    def launch_step(self, optimizer: Any) -> Optional[KindSteps]: ...


class SteppedEngine(Protocol):
    """What the step modes need of the engine (:class:`~lightning_superpipe.streaming.engine.StreamingEngine`): its
    overlapped and pipelined steps, its homes, and which parameters are outside the blocks."""

    overlap: OverlappedStep
    pending: PipelinedStep
    home_kind: StepHomes
    trunk_first: set[nn.Parameter]

    def disarm_overlap(self) -> None: ...

    def is_trunk(self, param: nn.Parameter) -> bool: ...

    def mark_stepped(self, index: int, params: Optional[list[nn.Parameter]] = None) -> None: ...

#: Above this share of recent steps whose gradients changed after backward (clipped, or skipped by the scaler),
#: ``"auto"`` pipelines instead of speculating: each such step pays a redo after backward.
REDO_RATE_LIMIT = 0.25

#: Why "auto" stops speculating (one wording, so that the info line is said once however the rate moves).
OFTEN = "clipping or the scaler changed the gradients of more than a quarter of the recent steps"

#: The share of the host memory free that the kept state of a speculative step may take.
KEPT_SHARE_OF_FREE = 0.5


#: The modes, in the order the report lists them.
MODES = ("overlapped", "speculative", "pipelined", "serial")


@dataclass(frozen=True)
class StepMode:
    """One step's mode (one of :data:`MODES`) and why; ``gradients_final``: nothing but Lightning's own clipping
    changes a gradient once backward delivered it (no hook, no plugin's own clipping), as the choice found."""

    mode: str
    reason: str
    gradients_final: bool = False


@dataclass(frozen=True)
class RunFacts:
    """What the choice needs that the trainer does not say: the homes, the sharding, the planner, memory.
    ``own_steps``: how the kind of home steps its blocks itself and keeps the previous step (:attr:`.Homes.own_steps`),
    ``None`` where the optimizer steps them."""

    sharded: bool = False
    measuring: bool = False
    own_steps: Optional[tuple[str, str]] = None
    changed_rate: float = 0.0
    kept_bytes: int = 0
    free_host_bytes: Optional[int] = None  # unknown (not Linux): no limit assumed


def choose_step_mode(trainer: Any, optimizer: Optimizer, knob: Any, facts: RunFacts) -> StepMode:
    """The mode of the next optimizer step (see the module's list); the first rule that applies decides."""
    refusal = _serial_reason(trainer, optimizer, knob, facts)
    if refusal is not None:
        return StepMode("serial", refusal)
    rewrites = _gradient_rewriters(trainer)
    mode = _mode_where_exact(trainer, optimizer, knob, facts, rewrites)
    return replace(mode, gradients_final=rewrites is None)


def _mode_where_exact(
    trainer: Any, optimizer: Optimizer, knob: Any, facts: RunFacts, rewrites: Optional[str]
) -> StepMode:
    """:func:`choose_step_mode`'s rules once the serial ones passed; ``rewrites``: who may change gradients after
    backward (:func:`_gradient_rewriters`)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    clip = trainer.gradient_clip_val or 0
    decides = bool(scaler is not None or (clip > 0 and trainer.gradient_clip_algorithm != "value"))
    if facts.own_steps is not None:  # the homes step their blocks and keep the previous step themselves
        from_kept, keeps_previous = facts.own_steps
        if knob == "pipelined":
            return StepMode("pipelined", "overlap_optimizer='pipelined'")
        if rewrites:
            return StepMode("pipelined", f"{rewrites} may rewrite gradients after backward ({from_kept})")
        if (decides or clip > 0) and knob != "speculative" and facts.changed_rate > REDO_RATE_LIMIT:
            return StepMode("pipelined", f"{OFTEN} ({from_kept})")
        if decides or clip > 0:
            return StepMode("speculative", f"clipping or the gradient scaler decide after backward ({keeps_previous})")
        return StepMode("overlapped", "nothing after backward changes a gradient")
    if not rewrites and not decides and knob != "pipelined":
        return StepMode("overlapped", "nothing after backward changes a gradient")
    if knob == "pipelined":
        return StepMode("pipelined", "overlap_optimizer='pipelined'")
    if rewrites:
        return StepMode("pipelined", f"{rewrites} may rewrite gradients after backward")
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        return StepMode("pipelined", f"{type(optimizer).__name__} unscales gradients inside its step")
    if knob == "speculative":
        return StepMode("speculative", "overlap_optimizer='speculative'")
    free = facts.free_host_bytes
    if free is not None and facts.kept_bytes > KEPT_SHARE_OF_FREE * free:
        # No figures in the reason: the info line is said once per reason, and free memory moves every step.
        return StepMode("pipelined", "keeping the state a speculative step needs would take more than half the free"
                        " host memory")
    if facts.changed_rate > REDO_RATE_LIMIT:
        return StepMode("pipelined", OFTEN)
    return StepMode("speculative", "clipping by norm or the gradient scaler decide after backward")


def _serial_reason(trainer: Any, optimizer: Optimizer, knob: Any, facts: RunFacts) -> Optional[str]:
    if knob is False:
        return "overlap_optimizer=False"
    if facts.measuring:
        return "the planner is timing the step"
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization steps after its backward"
    if not updates_each_parameter_alone(optimizer):
        name = type(optimizer).__name__
        return f"{name} is not known to update each parameter on its own ({REGISTER_HINT.format(name=name)})"
    if has_step_hooks(optimizer):
        return "the optimizer has step hooks, which would run once per block"
    if facts.sharded:
        return "the optimizer is sharded across ranks: each steps its share after backward and sends the new weights"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    pays = facts.own_steps is not None or knob != "auto"  # the homes' alternative reads the kept gradients back
    if not pays and trainer.strategy.root_device.type == "cpu" and torch.get_num_threads() >= cores:
        return (
            f"the compute device is the CPU and torch's {torch.get_num_threads()} threads use every core, so a host"
            " step beside compute would compete with it (`overlap_optimizer=True` overlaps anyway)"
        )
    return None


def _gradient_rewriters(trainer: Any) -> Optional[str]:
    """Who may change gradients between backward and the step, other than Lightning's own clipping: hooks there,
    ``configure_gradient_clipping``, a precision plugin's own clipping. ``None`` if no one."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = trainer.lightning_module
    for hook in ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"):
        users = [module] if is_overridden(hook, module, LightningModule) else []
        if hook != "configure_gradient_clipping":  # a LightningModule hook only
            users += [c for c in trainer.callbacks if is_overridden(hook, c, Callback)]
        if users:
            return f"`{hook}` (overridden by {type(users[0]).__name__})"
    plugin = trainer.precision_plugin
    for name in ("clip_grad_by_norm", "clip_grad_by_value"):
        if getattr(type(plugin), name) is not getattr(Precision, name):
            return f"{type(plugin).__name__}.{name}"
    return None


class OptimizerSteps:
    """Runs each optimizer step of the run in the mode :func:`choose_step_mode` picks, and counts them.

    Args:
        engine: The streaming engine (its overlapped step, pipelined steps and homes).
        knob: The strategy's ``overlap_optimizer``.
        plugin: The run's precision plugin (its clipping and scaler are watched; host tier only).
    """

    def __init__(self, engine: SteppedEngine, knob: Any, plugin: Any) -> None:
        self.engine = engine
        self.knob = knob
        self.watch = PreStepWatch(plugin)
        self.counts: Counter[str] = Counter()
        self.exposed_s = 0.0
        self._kept: Optional[KeptState] = None  # reused while steps are speculative
        self._said: set[tuple[str, str]] = set()

    def install(self) -> None:
        self.watch.install()

    def uninstall(self) -> None:
        self.watch.uninstall()
        if self._kept is not None:
            self._kept.release()

    def choose(self, trainer: Any, optimizer: Optimizer, sharded: bool, measuring: bool) -> StepMode:
        facts = RunFacts(
            sharded=sharded, measuring=measuring, own_steps=self.engine.home_kind.own_steps,
            changed_rate=self.watch.changed_rate,
            kept_bytes=kept_bytes(optimizer), free_host_bytes=host_memory.available_host_bytes(),
        )
        return choose_step_mode(trainer, optimizer, self.knob, facts)

    def run(self, trainer: Any, optimizer: Optimizer, step: Callable[[], Any], mode: StepMode) -> Any:
        """Runs ``step()`` (Lightning's optimizer step: the closure's forward and backward, the pre-step work, the
        update) in ``mode``. Returns what ``step`` returns."""
        self._say(mode)
        engine, watch = self.engine, self.watch
        quiet = mode.gradients_final and watch.scaler is None  # nothing but clipping touches gradients after backward
        watch.start_step(defer_scaling=mode.mode == "pipelined" and quiet)
        engine.home_kind.last_micro_batch = True
        kept: Optional[KeptState] = None
        homes = engine.home_kind
        by_homes = mode.mode == "speculative" and homes.keeps_previous_step
        if mode.mode in ("overlapped", "speculative"):
            scaler = watch.scaler if mode.mode == "speculative" else None
            unscale = SpeculativeUnscale(scaler) if scaler is not None else None
            clip_value = (trainer.gradient_clip_val if trainer.gradient_clip_algorithm == "value" else None) or None
            if by_homes:  # the homes unscale, clamp, keep and decide (at their commit)
                homes.speculate(unscale.inv_scale if unscale is not None else None, clip_value)
                engine.overlap.arm(optimizer, blocks_only=True)
            else:
                watch.unscale = unscale
                kept = self._kept_state(optimizer) if mode.mode == "speculative" else None
                engine.overlap.arm(optimizer, kept, gradient_preparation(unscale, clip_value),
                                   measure=self._measure(trainer))
                engine.overlap.keep_ahead()  # during the closure's forward, on the optimizer thread
        elif mode.mode == "pipelined" and quiet and homes.keeps_gradients:
            # Nothing changes a block's gradients once complete: their norms are taken in backward (a kind that
            # takes the gradients away, the disk tier, steps and measures its blocks itself: launch_step).
            engine.overlap.arm(optimizer, measure=self._measure(trainer), step=False)
        decided: list[bool] = []
        own_step = vars(optimizer).get("step")
        if mode.mode == "pipelined" or (mode.mode == "speculative" and not by_homes):
            original = own_step or type(optimizer).step.__get__(optimizer)
            vars(optimizer)["step"] = self._intercept(optimizer, original, mode.mode, decided)
        try:
            output = step()
        finally:
            if own_step is None:
                vars(optimizer).pop("step", None)
            else:
                vars(optimizer)["step"] = own_step
            undecided = engine.overlap.speculating
            engine.disarm_overlap()  # an undecided speculation (the scaler skipped the step) is discarded
            watch.unscale = None
        if kept is None and self._kept is not None:  # not speculating now: the buffers go
            self._kept.release()
        self.counts[mode.mode] += 1
        self.counts["discarded"] += int(undecided)
        if not homes.keeps_previous_step:  # else the homes say (homes_decided)
            skipped = mode.mode in ("speculative", "pipelined") and not decided
            watch.record(watch.changed_gradients or skipped)
        return output

    def _measure(self, trainer: Any) -> Optional[Callable[[list[Any]], None]]:
        """What takes each block's gradient norms in backward, where clipping by norm will want them."""
        clips = (trainer.gradient_clip_val or 0) > 0 and trainer.gradient_clip_algorithm != "value"
        return self.watch.norms.take if clips and self.watch.installed else None

    def _kept_state(self, optimizer: Optimizer) -> KeptState:
        if self._kept is None or self._kept.optimizer is not optimizer:
            peak = self._kept.peak_bytes if self._kept is not None else 0
            self._kept = KeptState(optimizer)
            self._kept.peak_bytes = peak
        return self._kept

    def homes_decided(self, homes: StepHomes) -> None:
        """Counts how the homes ended their speculative step (``finish_step``), if they decided one, and whether
        clipping or the scaler changed the gradients, if they saw."""
        if homes.speculation_outcome is not None:
            self.counts[homes.speculation_outcome] += 1
        if homes.gradients_changed is not None:
            self.watch.record(homes.gradients_changed)

    def _intercept(
        self, optimizer: Optimizer, original: Callable[..., Any], mode: str, decided: list[bool]
    ) -> Callable[..., Any]:
        """``optimizer.step`` for this step: the closure (forward, backward, hooks, clipping) first, as the
        optimizer's own step runs it; then the decision, or the pipelined launch instead of the update."""

        def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            decided.append(True)
            if mode == "pipelined":
                self._launch(optimizer, kwargs)
                with restricted(optimizer, set()):  # what the step does besides updating (counters, hooks)
                    original(**kwargs)
                return loss
            if self.watch.changed_gradients:
                self.engine.overlap.redo()
                self.counts["redone"] += 1
            else:
                self.engine.overlap.commit()
                self.counts["committed"] += 1
            original(**kwargs)
            return loss

        return step

    def _launch(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> None:
        engine = self.engine
        owned = {p for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        in_order = enumerate(engine.overlap.block_params)  # the next forward's order
        blocks = [(index, [p for p in params if p in owned]) for index, params in in_order]
        blocks = [(index, params) for index, params in blocks if params]
        in_blocks = {p for _, params in blocks for p in params}
        trunk = [p for group in optimizer.param_groups for p in group["params"] if p in owned and p not in in_blocks]
        # What the next forward uses before its first block is stepped first; the rest (a head) after the blocks.
        seen_first = engine.trunk_first
        late = [p for p in trunk if seen_first and p not in seen_first and engine.is_trunk(p)]
        deferred = set(late)
        first = [p for p in trunk if p not in deferred]
        # The disk tier's blocks, from their files, by a stand-in with the hyperparameters in force now.
        everything = [p for group in optimizer.param_groups for p in group["params"]]
        kind_steps = engine.home_kind.launch_step(shadow_of(optimizer, everything))
        engine.pending.launch(optimizer, first, blocks, kwargs, late_trunk=late, scale=self.watch.deferred_scale,
                              kind_steps=kind_steps)
        for index in [index for index, _ in blocks] + (kind_steps.blocks if kind_steps is not None else []):
            engine.mark_stepped(index)  # the optimizer thread brings its home up to date; its copies are made anew

    def report(self) -> dict[str, Any]:
        """The counts for the memory report."""
        counts = self.counts
        steps = sum(counts[m] for m in MODES)
        return {
            "optimizer_step_modes": {m: counts[m] for m in MODES},
            "speculative_steps_committed": counts["committed"],
            "speculative_steps_redone": counts["redone"],
            "speculative_steps_discarded": counts["discarded"],
            "speculation_kept_peak_bytes": self._kept.peak_bytes if self._kept is not None else 0,
            "pipelined_wait_s": self.engine.pending.waited_s,
            "optimizer_exposed_s": (self.exposed_s + self.engine.pending.waited_s) / steps if steps else 0.0,
        }

    def _say(self, mode: StepMode) -> None:
        key = (mode.mode, mode.reason)
        if key in self._said or mode.reason == "the planner is timing the step":
            return
        self._said.add(key)
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        where = {
            "overlapped": "during backward", "speculative": "speculatively during backward",
            "pipelined": "pipelined into the next forward", "serial": "after backward",
        }[mode.mode]
        rank_zero_info(f"SuperpipeStrategy steps the optimizer {where}: {mode.reason}.")


def kept_bytes(optimizer: Optimizer) -> int:
    """Bytes a speculative step of ``optimizer`` keeps: each trainable parameter's master and optimizer state (before
    the first step, an Adam-like state of two moments is assumed)."""
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue
            nbytes = param.numel() * param.element_size()
            state = optimizer.state.get(param)
            # A pipelined step may be adding a first step's state on its thread: list() reads it in one go.
            tensors = [v for v in list((state or {}).values()) if isinstance(v, torch.Tensor)]
            total += nbytes + (sum(t.numel() * t.element_size() for t in tensors) if state else 2 * nbytes)
    return total


