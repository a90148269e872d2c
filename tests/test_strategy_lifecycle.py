"""The strategy through a whole Lightning life: validation, predict, checkpoints and resume, LoRA, bf16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


def test_validation_between_epochs_and_sanity_check_match_plain() -> None:
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=6, limit_val_batches=3, num_sanity_val_steps=2)

    def run(strategy: object) -> tasks.Task:
        task = tasks.build_task("gpt2")
        tasks.pl.seed_everything(8, verbose=False)
        tasks.trainer(strategy, **options).fit(task, batches.data("lm"), batches.data("lm", batches=3, seed=1))
        return task

    plain, streamed = tasks.once("lifecycle-validation", lambda: run("auto")), run("superpipe")  # plain: once
    assert len(streamed.val_losses) == 2 + 2 * 3
    np.testing.assert_allclose(streamed.val_losses, plain.val_losses, rtol=1e-5)
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)


def test_predict_and_test_match_plain() -> None:
    task = tasks.build_task("vit")
    plain = tasks.trainer("auto").predict(task, batches.data("image", batches=3))
    streamed = tasks.trainer(SuperpipeStrategy(resident_blocks=1, prefetch=2)).predict(
        task, batches.data("image", batches=3)
    )
    torch.testing.assert_close(torch.stack(streamed), torch.stack(plain), rtol=1e-6, atol=0)
    # The model is usable as before afterwards: hooks are gone and parameters are at home.
    assert all("forward" not in block.__dict__ for block in task.model.vit.layers)
    assert all(p.device.type == "cpu" for p in task.parameters())
    tested = tasks.trainer("superpipe").test
    with pytest.raises(Exception, match="test_step"):  # the task defines no test_step: Lightning's own error
        tested(task, batches.data("image", batches=1))


def test_resume_from_checkpoint_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    options = dict(max_steps=-1, limit_train_batches=8)

    uninterrupted = tasks.build_task("llama")
    tasks.pl.seed_everything(8, verbose=False)
    tasks.trainer("superpipe", max_epochs=2, **options).fit(uninterrupted, batches.data("lm"))

    first = tasks.build_task("llama")
    tasks.pl.seed_everything(8, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    tasks.trainer("superpipe", max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint], **options).fit(
        first, batches.data("lm")
    )
    resumed = tasks.build_task("llama", seed=123)  # different initial weights: all must come from the file
    tasks.trainer("superpipe", max_epochs=2, **options).fit(
        resumed, batches.data("lm"), ckpt_path=tmp_path / "last.ckpt"
    )

    assert first.losses == uninterrupted.losses[:8]
    np.testing.assert_allclose(resumed.losses, uninterrupted.losses[8:], rtol=1e-6)
    assert tasks.max_relative_difference(resumed, uninterrupted) < 1e-6

    loaded = tasks.Task.load_from_checkpoint(tmp_path / "last.ckpt", build=tasks.llama, kind="lm")
    assert tasks.max_relative_difference(loaded, first) == 0.0


def test_lora_trains_adapters_only_and_matches_plain() -> None:
    peft = pytest.importorskip("peft")

    def run(strategy: object) -> tasks.Task:
        task = tasks.build_task("llama")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        task.model = peft.get_peft_model(task.model, config)
        frozen = {n: p.detach().clone() for n, p in task.named_parameters() if not p.requires_grad}
        tasks.pl.seed_everything(8, verbose=False)
        tasks.trainer(strategy).fit(task, batches.data("lm"))
        task.frozen_before = frozen  # type: ignore[attr-defined]
        return task

    plain, streamed = tasks.once("lifecycle-lora", lambda: run("auto")), run("superpipe")  # plain: once
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    for name, param in streamed.named_parameters():
        if not param.requires_grad:
            assert param.grad is None
            assert torch.equal(param, streamed.frozen_before[name])  # type: ignore[attr-defined]
    adapters = [p for n, p in streamed.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # B starts at zero: it trained


def test_bf16_mixed_streams_bf16_and_keeps_fp32_masters() -> None:
    transfer_dtypes: set[torch.dtype] = set()

    class Spy(tasks.pl.Callback):
        def on_train_batch_end(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            transfer_dtypes.update(slot.flat.dtype for slot in trainer.strategy.engine._slots)

    options = dict(precision="bf16-mixed", gradient_clip_val=1.0)
    plain = tasks.plain_fit("llama", **options)  # once for the three links
    streamed = tasks.fit("llama", SuperpipeStrategy(resident_blocks=0), callbacks=[Spy()], **options)
    assert transfer_dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in streamed.parameters())
    # Matrices travel in bf16, the rounding autocast applies anyway before each matmul; norms stay fp32 as in
    # plain autocast: the same step (2.07e-2 off when norms travelled in bf16 too).
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-6)
    assert tasks.max_relative_difference(streamed, plain) < 1e-6


def test_fused_adamw_clips_under_bf16_mixed() -> None:
    """bf16-mixed uses no gradient scaler, so the fastest host optimizer (fused AdamW) can clip; Lightning 2.6's
    mixed-precision plugin refuses it, the strategy lets it (four steps, each clipped by norm)."""
    options = dict(precision="bf16-mixed", gradient_clip_val=0.5, max_steps=4)
    loop = tasks.fit("llama", "superpipe", **options)
    fused = tasks.fit("llama", "superpipe", optimizer="adamw-fused", **options)
    np.testing.assert_allclose(fused.losses, loop.losses, rtol=1e-2)
    assert tasks.max_relative_difference(fused, loop) < 1e-2


def test_gradients_are_complete_when_on_after_backward_runs() -> None:
    """User code in `on_after_backward` (gradient logging, checks) sees the same gradients as with plain Lightning."""

    class GradientNorms(tasks.Task):
        def on_after_backward(self) -> None:
            self.norms.append([p.grad.norm().item() for p in self.parameters()])

    def run(strategy: object) -> list[list[float]]:
        tasks.pl.seed_everything(7, verbose=False)
        task = GradientNorms(tasks.gpt2, "lm")
        task.norms = []  # type: ignore[attr-defined]
        tasks.pl.seed_everything(8, verbose=False)
        tasks.trainer(strategy, max_steps=3).fit(task, batches.data("lm"))
        return task.norms  # type: ignore[attr-defined]

    plain, streamed = run("auto"), run(SuperpipeStrategy(resident_blocks=0, prefetch=1))
    assert len(streamed) == 6
    np.testing.assert_allclose(streamed, plain, rtol=1e-5)


def test_a_compiled_model_streams_and_matches_plain() -> None:
    """`torch.compile` breaks its graph at the engine's entry points instead of tracing slots and events."""

    class Compiled(tasks.Task):
        def __init__(self) -> None:
            super().__init__(tasks.sequential, "vector")
            self.model = torch.compile(self.model, backend="eager")  # dynamo's tracing, no C++ build

    def run(strategy: object) -> tasks.Task:
        tasks.pl.seed_everything(7, verbose=False)
        task = Compiled()
        tasks.pl.seed_everything(8, verbose=False)
        tasks.trainer(strategy, max_steps=3).fit(task, batches.data("vector"))
        return task

    plain, streamed = run("auto"), run("superpipe")
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-6)
    assert tasks.max_relative_difference(streamed, plain) < 1e-6
