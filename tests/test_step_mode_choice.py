"""How each optimizer step's mode is chosen (:func:`lightning_superpipe.stepping.step_modes.choose_step_mode`), rule
by rule, without training: a real Trainer with its precision plugin and callbacks, the LightningModule connected to
its strategy as ``fit`` connects it, a real optimizer, and the facts the strategy would pass. The runs that show each
mode exact are in tests/test_step_modes.py.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_superpipe.memory.disk.tier import DiskTier
from lightning_superpipe.stepping.step_modes import (
    KEPT_SHARE_OF_FREE,
    REDO_RATE_LIMIT,
    RunFacts,
    StepMode,
    choose_step_mode,
    kept_bytes,
)
from tests import tasks

GIB = 2**30

#: How the disk tier steps its blocks itself (its homes' own steps).
DISK_STEPS = DiskTier.own_steps


class _ReadsGradients(tasks.pl.Callback):
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.norm = sum(p.grad.norm() for p in pl_module.parameters() if p.grad is not None)


class _ScalesGradients(tasks.Task):
    def on_after_backward(self) -> None:
        for param in self.parameters():
            if param.grad is not None:
                param.grad.mul_(0.5)


class _ClipsItsOwnWay(tasks.Task):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


class _Manual(tasks.Task):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def _choose(
    knob: Any = "auto", facts: RunFacts | None = None, task: type[tasks.Task] = tasks.Task,
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.AdamW(params, foreach=False),
    **trainer_options: Any,
) -> StepMode:
    """The mode of a step of ``task`` (the quick ``sequential`` example) under ``tasks.trainer(**trainer_options)``
    (clipping by norm 0.5 unless they say otherwise)."""
    module = task(tasks.sequential, "vector")
    trainer = tasks.trainer("auto", **trainer_options)
    trainer.strategy.connect(module)
    return choose_step_mode(trainer, optimizer(module.parameters()), knob, facts or RunFacts())


def _scaled(**options: Any) -> dict[str, Any]:
    """``16-mixed`` with a gradient scaler on the CPU (Lightning's flag would give ``bf16-mixed`` there)."""
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))], **options)


def _with_step_hook(params: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(params, foreach=False)
    optimizer.register_step_post_hook(lambda *args: None)
    return optimizer


NO_CLIPPING = dict(gradient_clip_val=None)
SHORT = RunFacts(kept_bytes=3 * GIB, free_host_bytes=4 * GIB)  # a speculation would keep 3 of the 4 GiB free

CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (arguments of _choose, mode, the reason or a part of it)
    "nothing changes gradients": (dict(**NO_CLIPPING), "overlapped", "nothing after backward changes a gradient"),
    "clipping by value": (dict(gradient_clip_algorithm="value"), "overlapped", "nothing after backward changes"),
    "speculating decides nothing": (dict(knob="speculative", **NO_CLIPPING), "overlapped", "nothing after backward"),
    "clipping by norm": (dict(), "speculative", "clipping by norm or the gradient scaler decide after backward"),
    "a gradient scaler": (_scaled(**NO_CLIPPING), "speculative", "clipping by norm or the gradient scaler decide"),
    "asked to pipeline": (dict(knob="pipelined", **NO_CLIPPING), "pipelined", "overlap_optimizer='pipelined'"),
    "asked to speculate": (dict(knob="speculative"), "speculative", "overlap_optimizer='speculative'"),
    "True is auto": (dict(knob=True), "speculative", "clipping by norm or the gradient scaler decide"),
    "memory is short": (
        dict(facts=SHORT), "pipelined",
        "keeping the state a speculative step needs would take more than half the free host memory",
    ),
    "memory is just enough": (
        dict(facts=RunFacts(kept_bytes=2 * GIB, free_host_bytes=4 * GIB)), "speculative", "clipping by norm",
    ),
    "asked to speculate, memory short": (dict(knob="speculative", facts=SHORT), "speculative", "'speculative'"),
    "clipping fires often": (
        dict(facts=RunFacts(changed_rate=0.5)), "pipelined",
        "clipping or the scaler changed the gradients of more than a quarter of the recent steps",
    ),
    "clipping fires at the limit": (dict(facts=RunFacts(changed_rate=REDO_RATE_LIMIT)), "speculative", "clipping by"),
    "a hook reads gradients": (
        dict(callbacks=[_ReadsGradients()]), "pipelined",
        "`on_before_optimizer_step` (overridden by _ReadsGradients) may rewrite gradients after backward",
    ),
    "the module rewrites gradients": (
        dict(task=_ScalesGradients, **NO_CLIPPING), "pipelined", "`on_after_backward` (overridden by _ScalesGradients)",
    ),
    "the module clips its own way": (
        dict(task=_ClipsItsOwnWay), "pipelined", "`configure_gradient_clipping` (overridden by _ClipsItsOwnWay)",
    ),
    "the optimizer unscales in its step": (
        _scaled(optimizer=lambda params: torch.optim.AdamW(params, fused=True), **NO_CLIPPING), "pipelined",
        "AdamW unscales gradients inside its step",
    ),
    "False": (dict(knob=False), "serial", "overlap_optimizer=False"),
    "manual optimization": (dict(task=_Manual), "serial", "manual optimization steps after its backward"),
    "LBFGS": (
        dict(optimizer=lambda params: torch.optim.LBFGS(params)), "serial",
        "LBFGS is not known to update each parameter on its own",
    ),
    "step hooks": (dict(optimizer=_with_step_hook), "serial", "the optimizer has step hooks"),
    "sharded": (dict(facts=RunFacts(sharded=True)), "serial", "the optimizer is sharded across ranks"),
    "the planner measures": (dict(facts=RunFacts(measuring=True)), "serial", "the planner is timing the step"),
    "the disk tier, clipping": (
        dict(facts=RunFacts(own_steps=DISK_STEPS)), "speculative",
        "clipping or the gradient scaler decide after backward (the disk tier's other slot keeps the previous step)",
    ),
    "the disk tier, asked to pipeline": (
        dict(knob="pipelined", facts=RunFacts(own_steps=DISK_STEPS)), "pipelined", "overlap_optimizer='pipelined'",
    ),
    "the disk tier, clipping fires often": (
        dict(facts=RunFacts(own_steps=DISK_STEPS, changed_rate=0.5)), "pipelined",
        "more than a quarter of the recent steps (the disk tier steps its blocks from what it spilled)",
    ),
    "the disk tier, asked to speculate, clipping fires often": (
        dict(knob="speculative", facts=RunFacts(own_steps=DISK_STEPS, changed_rate=0.5)), "speculative", "other slot",
    ),
    "the disk tier, a hook": (
        dict(facts=RunFacts(own_steps=DISK_STEPS), callbacks=[_ReadsGradients()]), "pipelined",
        "may rewrite gradients after backward (the disk tier steps its blocks from what it spilled)",
    ),
    "the disk tier, nothing to decide": (
        dict(facts=RunFacts(own_steps=DISK_STEPS), **NO_CLIPPING), "overlapped", "nothing after backward",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rule_of_the_choice(case: str) -> None:
    arguments, mode, reason = CASES[case]
    chosen = _choose(**arguments)
    assert chosen.mode == mode, chosen
    assert reason in chosen.reason, chosen


def test_the_memory_rule_compares_the_state_a_speculation_keeps_with_half_the_free_memory() -> None:
    """Before the first step an Adam-like state of two moments is assumed: 12 bytes a fp32 parameter, kept."""
    model = tasks.sequential()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    params = sum(p.numel() for p in model.parameters())
    assert kept_bytes(optimizer) == 12 * params
    model(torch.randn(2, 12)).sum().backward()
    optimizer.step()
    # Then the masters and the state as it is: two moments and a step count (a 4-byte scalar) a parameter.
    assert kept_bytes(optimizer) == 12 * params + 4 * len(optimizer.state)
    assert KEPT_SHARE_OF_FREE == 0.5


def test_auto_steps_after_backward_where_compute_uses_every_host_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU compute device whose cores torch's threads all use, a host step beside compute only competes with it:
    "auto" steps after backward; ``True`` and the explicit modes do not mind."""
    cores = 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    chosen = _choose()
    assert chosen.mode == "serial" and f"torch's {cores} threads use every core" in chosen.reason
    assert "`overlap_optimizer=True` overlaps anyway" in chosen.reason
    assert _choose(knob=True).mode == "speculative"
    assert _choose(knob="pipelined").mode == "pipelined"
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
    assert _choose().mode == "speculative"
