"""In fp32, training through the superpipe strategy gives plain Lightning's losses and weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


def _relative(a: list[float], b: list[float]) -> float:
    a_, b_ = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a_ - b_) / np.abs(b_)))


@pytest.mark.parametrize("family", ["gpt2", "llama", "vit", "sequential"])
def test_losses_and_weights_match_plain_lightning(family: str) -> None:
    """10 optimizer steps of AdamW with two parameter groups, an LR warm-up, clipping by norm, accumulation over
    two micro-batches and dropout on."""
    plain = tasks.plain_fit(family)  # once for the three links
    streamed = tasks.fit(family, "superpipe")
    assert len(plain.losses) == 20  # 10 steps x 2 micro-batches
    assert _relative(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    # Training changed the weights, so the comparison above compared something.
    assert tasks.max_relative_difference(streamed, tasks.build_task(family)) > 1e-3


@pytest.mark.parametrize(("resident_blocks", "prefetch"), [(0, 0), (0, 2), (2, 1), (4, 0)])
def test_knobs_do_not_change_results(resident_blocks: int, prefetch: int) -> None:
    plain = tasks.plain_fit("sequential", gradient_clip_algorithm="value")  # once for every knob and link
    streamed = tasks.fit(
        "sequential",
        SuperpipeStrategy(resident_blocks=resident_blocks, prefetch=prefetch),
        gradient_clip_algorithm="value",
    )
    assert _relative(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


def test_sgd_with_momentum_and_no_accumulation() -> None:
    options = dict(optimizer="sgd", accumulate_grad_batches=1, gradient_clip_val=None)
    plain = tasks.plain_fit("llama", **options)
    streamed = tasks.fit("llama", "superpipe", **options)
    assert len(plain.losses) == 10
    assert _relative(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


def test_tied_weights_stay_tied_and_optimizer_state_stays_on_the_host() -> None:
    task = tasks.build_task("gpt2")
    trainer = tasks.trainer("superpipe", max_steps=3)
    trainer.fit(task, batches.data("lm"))
    model = task.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.device.type == "cpu" for p in task.parameters())
    optimizer = trainer.optimizers[0]
    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert states and all(t.device.type == "cpu" for t in states)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in task.parameters())
