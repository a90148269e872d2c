"""The host optimizer step overlapped with backward: bitwise the step after backward, and off where it would not be."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")

NO_CLIPPING = dict(gradient_clip_val=None)
# Five steps of the quick examples, not ten: the LR warm-up's four and one after it.
STEPS = 5


def _bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return a.state_dict().keys() == b.state_dict().keys() and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


@pytest.mark.parametrize(
    ("family", "optimizer", "activations"),
    [
        ("llama", "adamw", "recompute"),
        ("gpt2", "adamw-fused", "keep"),
        ("sequential", "sgd", "offload"),
        ("vit", "adamw", "recompute"),
    ],
)
def test_stepping_blocks_during_backward_is_bitwise_the_step_after_backward(
    family: str, optimizer: str, activations: str
) -> None:
    """AdamW (loop and fused) and SGD with momentum, an LR warm-up, two parameter groups, accumulation over two
    micro-batches (only the last backward of each step overlaps)."""
    options = dict(NO_CLIPPING, optimizer=optimizer, max_steps=STEPS)
    serial = tasks.fit(family, SuperpipeStrategy(activations=activations, overlap_optimizer=False), **options)
    strategy = SuperpipeStrategy(activations=activations)
    overlapped = tasks.fit(family, strategy, **options)
    assert overlapped.losses == serial.losses
    assert _bitwise_equal(overlapped, serial)
    report = strategy.memory_report()
    assert report["overlapped_block_steps"] == STEPS * report["num_blocks"]  # every block of every step


def test_a_family_of_each_kind_trains_as_plain_with_the_overlap_on() -> None:
    for name in ("t5-padded", "llava", "qwen2_moe"):
        strategy = SuperpipeStrategy()
        streamed = tasks.fit_family(name, strategy)
        plain = tasks.plain_fit_family(name)  # once for the three links
        assert tasks.max_relative_difference(streamed, plain) < 1e-5
        assert strategy.memory_report()["overlapped_block_steps"] > 0


class _ReadsGradients(tasks.pl.Callback):
    def on_before_optimizer_step(
        self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, optimizer: Any
    ) -> None:
        self.norm = sum(p.grad.norm() for p in pl_module.parameters() if p.grad is not None)


class _LBFGSTask(tasks.Task):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


@pytest.mark.parametrize(
    ("case", "mode", "said"),
    [
        ("clipping by norm", "speculative",
         "speculatively during backward: clipping by norm or the gradient scaler decide after backward"),
        ("a hook that reads gradients", "pipelined",
         "pipelined into the next forward: `on_before_optimizer_step` (overridden by _ReadsGradients) may rewrite"
         " gradients after backward"),
        ("LBFGS", "serial",
         "after backward: LBFGS is not known to update each parameter on its own (if it updates each parameter from"
         " that parameter's gradient and state alone, declare it with"
         " lightning_superpipe.register_per_parameter_optimizer(LBFGS))"),
    ],
)
def test_where_stepping_during_backward_would_change_results_the_step_takes_another_mode(
    case: str, mode: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Clipping by norm decides after backward: the step speculates (the first step's clip fires, every block is
    redone). A hook between backward and the step may rewrite gradients: the step is pipelined after it. LBFGS
    re-evaluates the closure: the step is after backward. Each is said once, with its reason, and exact."""
    options: dict[str, Any] = dict(NO_CLIPPING, max_steps=3)
    make = lambda: tasks.Task(tasks.sequential, "vector")  # noqa: E731
    if case == "clipping by norm":
        options.update(gradient_clip_val=0.5, max_steps=1)  # one step: the redo would make "auto" pipeline the next
    elif case == "a hook that reads gradients":
        options["callbacks"] = [_ReadsGradients()]
    else:
        make = lambda: _LBFGSTask(tasks.sequential, "vector")  # noqa: E731
        options["accumulate_grad_batches"] = 1
    plain = tasks.once(("overlap-mode", case), lambda: tasks.fit_task(make, "auto", batches.data("vector"), **options))
    strategy = SuperpipeStrategy()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        streamed = tasks.fit_task(make, strategy, batches.data("vector"), **options)
    report = strategy.memory_report()
    steps = options["max_steps"]
    assert report["optimizer_step_modes"] == {m: steps if m == mode else 0 for m in report["optimizer_step_modes"]}
    assert report["overlapped_block_steps"] == (report["num_blocks"] if mode == "speculative" else 0)
    assert report["speculative_steps_redone"] == (1 if mode == "speculative" else 0)
    assert streamed.losses == plain.losses
    assert _bitwise_equal(streamed, plain)
    lines = [r.getMessage() for r in caplog.records if "SuperpipeStrategy steps the optimizer" in r.getMessage()]
    assert lines == [f"SuperpipeStrategy steps the optimizer {said}."]  # once, with the reason


def test_auto_does_not_overlap_where_compute_already_uses_every_host_core(caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU compute device whose cores torch's threads all use, a host step during backward only competes with
    compute (measured: slower); `True` overlaps anyway, `False` never, anything else is refused."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            auto = SuperpipeStrategy()
            tasks.fit("sequential", auto, max_steps=2, **NO_CLIPPING)
        forced = SuperpipeStrategy(overlap_optimizer=True)
        tasks.fit("sequential", forced, max_steps=2, **NO_CLIPPING)
    finally:
        torch.set_num_threads(threads)
    assert auto.memory_report()["overlapped_block_steps"] == 0
    assert any(f"torch's {cores} threads use every core" in r.getMessage() for r in caplog.records)
    assert forced.memory_report()["overlapped_block_steps"] == 2 * 4
    refused = r"overlap_optimizer='yes'\) must be 'auto', True, False, 'speculative' or 'pipelined'\."
    with pytest.raises(MisconfigurationException, match=refused):
        tasks.fit("sequential", SuperpipeStrategy(overlap_optimizer="yes"), max_steps=1)


def test_each_stepped_block_takes_its_new_weights_into_its_transfer_copy_during_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With bf16-mixed the blocks travel in bf16: the overlapped step converts each block right after stepping it,
    on the optimizer thread, and the refresh after backward only copies; the weights are bitwise the serial run's."""
    from lightning_superpipe.memory.host import BlockHome

    synced_on: list[tuple[str, int]] = []
    sync = BlockHome.sync

    def recording_sync(self: BlockHome, pieces: Any) -> None:
        if pieces:
            synced_on.append((threading.current_thread().name, len(pieces)))
        sync(self, pieces)

    monkeypatch.setattr(BlockHome, "sync", recording_sync)
    options = dict(NO_CLIPPING, precision="bf16-mixed", max_steps=3)
    serial = tasks.fit("llama", SuperpipeStrategy(resident_blocks=1, overlap_optimizer=False), **options)
    assert synced_on and all(not name.startswith("superpipe-optimizer") for name, _ in synced_on)
    synced_on.clear()
    strategy = SuperpipeStrategy(resident_blocks=1)
    overlapped = tasks.fit("llama", strategy, **options)
    assert strategy.memory_report()["overlapped_block_steps"] == 3 * 3
    assert [name.startswith("superpipe-optimizer") for name, _ in synced_on] == [True] * 9
    assert overlapped.losses == serial.losses
    assert _bitwise_equal(overlapped, serial)


def test_parameters_outside_the_blocks_are_stepped_as_soon_as_their_gradients_are_complete() -> None:
    """Every use of a parameter outside the blocks counted in forward has delivered its gradient: an untied head and
    the final norm as backward starts, the embeddings and a tied head (GPT-2's, used twice) at its end. Each is then
    stepped on the optimizer thread, bitwise as the serial step."""
    for family in ("llama", "gpt2"):
        serial = tasks.fit(family, SuperpipeStrategy(overlap_optimizer=False), max_steps=STEPS, **NO_CLIPPING)
        strategy = SuperpipeStrategy()
        overlapped = tasks.fit(family, strategy, max_steps=STEPS, **NO_CLIPPING)
        assert overlapped.losses == serial.losses
        assert _bitwise_equal(overlapped, serial)
        blocks = {id(p) for layer in _layers(overlapped) for p in layer.parameters()}
        outside = {id(p) for p in overlapped.parameters() if p.requires_grad and id(p) not in blocks}
        assert strategy.memory_report()["overlapped_trunk_steps"] == STEPS * len(outside), family


def _layers(task: tasks.Task) -> Any:
    model = task.model
    return model.model.layers if hasattr(model, "model") else model.transformer.h


@pytest.mark.parametrize("limit", [1, None], ids=["bounded", "unbounded"])
def test_blocks_waiting_for_the_optimizer_thread_are_bounded_where_the_homes_ask(limit: Any) -> None:
    """The disk tier's gradients live until their block is stepped: with ``waiting_blocks_limit=1`` (what it sets),
    backward hands the optimizer thread a block only once the previous one is stepped, so one block waits while the
    next arrives, whatever the thread's speed. Without it (the host tier's persistent gradients) blocks queue up."""
    from lightning_superpipe.stepping.overlap import OverlappedStep

    blocks = [[torch.nn.Parameter(torch.ones(4))] for _ in range(6)]
    optimizer = torch.optim.SGD([p for params in blocks for p in params], lr=0.1)
    overlap = OverlappedStep(blocks)
    overlap.waiting_blocks_limit = limit
    stepped, queued = [], []
    release = threading.Event()

    def slow_step(opt: Any, index: int, params: list[torch.nn.Parameter]) -> None:
        release.wait(0.05)  # a step slower than backward (the disk's)
        stepped.append(index)

    overlap.step_block = slow_step
    overlap.arm(optimizer)
    try:
        for index in reversed(range(len(blocks))):
            blocks[index][0].grad = torch.ones(4)
            overlap.block_done(index)
            queued.append(len(blocks) - index - len(stepped))  # handed over and not stepped yet
        overlap.finish()
    finally:
        overlap.close()
    assert stepped == list(reversed(range(len(blocks))))
    if limit is None:
        assert max(queued) > 1
    else:
        assert max(queued) == 1
