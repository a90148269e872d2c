"""The strategy through a whole Lightning life: validation, predict, checkpoints and resume, LoRA, bf16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import models

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


def test_validation_between_epochs_and_sanity_check_match_plain() -> None:
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=6, limit_val_batches=3, num_sanity_val_steps=2)

    def run(strategy: object) -> models.Task:
        task = models.build_task("gpt2")
        models.pl.seed_everything(8, verbose=False)
        models.trainer(strategy, **options).fit(task, models.data("lm"), models.data("lm", batches=3, seed=1))
        return task

    plain, streamed = run("auto"), run("superpipe")
    assert len(streamed.val_losses) == 2 + 2 * 3
    np.testing.assert_allclose(streamed.val_losses, plain.val_losses, rtol=1e-5)
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)


def test_predict_and_test_match_plain() -> None:
    task = models.build_task("vit")
    plain = models.trainer("auto").predict(task, models.data("image", batches=3))
    streamed = models.trainer(SuperpipeStrategy(resident_blocks=1, prefetch=2)).predict(task, models.data("image", batches=3))
    torch.testing.assert_close(torch.stack(streamed), torch.stack(plain), rtol=1e-6, atol=0)
    # The model is usable as before afterwards: hooks are gone and parameters are at home.
    assert all("forward" not in block.__dict__ for block in task.model.vit.layers)
    assert all(p.device.type == "cpu" for p in task.parameters())
    tested = models.trainer("superpipe").test
    with pytest.raises(Exception, match="test_step"):  # the task defines no test_step: Lightning's own error
        tested(task, models.data("image", batches=1))


def test_resume_from_checkpoint_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    options = dict(max_steps=-1, limit_train_batches=8)

    uninterrupted = models.build_task("llama")
    models.pl.seed_everything(8, verbose=False)
    models.trainer("superpipe", max_epochs=2, **options).fit(uninterrupted, models.data("lm"))

    first = models.build_task("llama")
    models.pl.seed_everything(8, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    models.trainer("superpipe", max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint], **options).fit(
        first, models.data("lm")
    )
    resumed = models.build_task("llama", seed=123)  # different initial weights: all must come from the file
    models.trainer("superpipe", max_epochs=2, **options).fit(resumed, models.data("lm"), ckpt_path=tmp_path / "last.ckpt")

    assert first.losses == uninterrupted.losses[:8]
    np.testing.assert_allclose(resumed.losses, uninterrupted.losses[8:], rtol=1e-6)
    assert models.max_relative_difference(resumed, uninterrupted) < 1e-6

    loaded = models.Task.load_from_checkpoint(tmp_path / "last.ckpt", build=models.llama, kind="lm")
    assert models.max_relative_difference(loaded, first) == 0.0


def test_lora_trains_adapters_only_and_matches_plain() -> None:
    peft = pytest.importorskip("peft")

    def run(strategy: object) -> models.Task:
        task = models.build_task("llama")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        task.model = peft.get_peft_model(task.model, config)
        frozen = {n: p.detach().clone() for n, p in task.named_parameters() if not p.requires_grad}
        models.pl.seed_everything(8, verbose=False)
        models.trainer(strategy).fit(task, models.data("lm"))
        task.frozen_before = frozen  # type: ignore[attr-defined]
        return task

    plain, streamed = run("auto"), run("superpipe")
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)
    assert models.max_relative_difference(streamed, plain) < 1e-5
    for name, param in streamed.named_parameters():
        if not param.requires_grad:
            assert param.grad is None
            assert torch.equal(param, streamed.frozen_before[name])  # type: ignore[attr-defined]
    adapters = [p for n, p in streamed.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # B starts at zero: it trained


def test_bf16_mixed_streams_bf16_and_keeps_fp32_masters() -> None:
    transfer_dtypes: set[torch.dtype] = set()

    class Spy(models.pl.Callback):
        def on_train_batch_end(self, trainer: models.pl.Trainer, *args: object) -> None:
            transfer_dtypes.update(slot.flat.dtype for slot in trainer.strategy.engine._slots)

    options = dict(precision="bf16-mixed", gradient_clip_val=1.0)
    plain = models.fit("llama", "auto", **options)
    streamed = models.fit("llama", SuperpipeStrategy(resident_blocks=0), callbacks=[Spy()], **options)
    assert transfer_dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in streamed.parameters())
    # Matrices travel in bf16, the rounding autocast applies anyway before each matmul; norms stay fp32 as in
    # plain autocast: the same step (2.07e-2 off when norms travelled in bf16 too).
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-6)
    assert models.max_relative_difference(streamed, plain) < 1e-6


def test_fused_adamw_clips_under_bf16_mixed() -> None:
    """bf16-mixed uses no gradient scaler, so the fastest host optimizer (fused AdamW) can clip; Lightning 2.6's
    mixed-precision plugin refuses it, the strategy lets it."""
    options = dict(precision="bf16-mixed", gradient_clip_val=0.5)
    loop = models.fit("llama", "superpipe", **options)
    fused = models.fit("llama", "superpipe", optimizer="adamw-fused", **options)
    np.testing.assert_allclose(fused.losses, loop.losses, rtol=1e-2)
    assert models.max_relative_difference(fused, loop) < 1e-2


def test_gradients_are_complete_when_on_after_backward_runs() -> None:
    """User code in `on_after_backward` (gradient logging, checks) sees the same gradients as with plain Lightning."""

    class GradientNorms(models.Task):
        def on_after_backward(self) -> None:
            self.norms.append([p.grad.norm().item() for p in self.parameters()])

    def run(strategy: object) -> list[list[float]]:
        models.pl.seed_everything(7, verbose=False)
        task = GradientNorms(models.gpt2, "lm")
        task.norms = []  # type: ignore[attr-defined]
        models.pl.seed_everything(8, verbose=False)
        models.trainer(strategy, max_steps=3).fit(task, models.data("lm"))
        return task.norms  # type: ignore[attr-defined]

    plain, streamed = run("auto"), run(SuperpipeStrategy(resident_blocks=0, prefetch=1))
    assert len(streamed) == 6
    np.testing.assert_allclose(streamed, plain, rtol=1e-5)


def test_a_compiled_model_streams_and_matches_plain() -> None:
    """`torch.compile` breaks its graph at the engine's entry points instead of tracing slots and events."""

    class Compiled(models.Task):
        def __init__(self) -> None:
            super().__init__(models.sequential, "vector")
            self.model = torch.compile(self.model, backend="eager")  # dynamo's tracing, no C++ build

    def run(strategy: object) -> models.Task:
        models.pl.seed_everything(7, verbose=False)
        task = Compiled()
        models.pl.seed_everything(8, verbose=False)
        models.trainer(strategy, max_steps=3).fit(task, models.data("vector"))
        return task

    plain, streamed = run("auto"), run("superpipe")
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-6)
    assert models.max_relative_difference(streamed, plain) < 1e-6
