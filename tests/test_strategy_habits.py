"""Lightning habits that change weights, flags or buffers behind the optimizer's back: the strategy must train
exactly what plain Lightning trains (fp32, relative difference below 1e-5)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")

def _plain_and_streamed(key: Any, run: Callable[[Any], tasks.Task]) -> tuple[tasks.Finished, tasks.Task]:
    """``run("auto")`` (once per ``key`` for the three links) and ``run`` with the strategy. Resident blocks and the
    trunk keep device copies across steps; streamed blocks are copied at every use: both must see every change."""
    plain = tasks.once(("habits", key), lambda: run("auto"))
    return plain, run(SuperpipeStrategy(resident_blocks=1, prefetch=1))


def _assert_same(streamed: tasks.Task, plain: tasks.Finished) -> None:
    assert len(streamed.losses) == len(plain.losses) > 0
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


# ---------------------------------------------------------------------------------------------------- weights


class _ClipWeights(tasks.pl.Callback):
    """WGAN-style weight clipping after every step, through ``.data`` or under ``torch.no_grad()``."""

    def __init__(self, idiom: str) -> None:
        self.idiom = idiom

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: Any) -> None:
        for param in pl_module.parameters():
            if self.idiom == "data":
                param.data.clamp_(-0.05, 0.05)
            else:
                with torch.no_grad():
                    param.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("idiom", ["data", "no_grad"])
def test_weights_clipped_in_a_callback_are_what_the_next_step_computes_with(idiom: str) -> None:
    plain, streamed = _plain_and_streamed(
        ("clip", idiom), lambda s: tasks.fit("llama", s, callbacks=[_ClipWeights(idiom)])
    )
    _assert_same(streamed, plain)
    assert all(p.abs().max() <= 0.05 for p in streamed.parameters())


def test_an_ema_swapped_in_for_validation_is_what_validation_sees() -> None:
    """Lightning's EMA callback swaps the averaged weights in with ``param.data.copy_`` for validation and back."""
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=6, limit_val_batches=2, accumulate_grad_batches=1)

    plain, streamed = _plain_and_streamed("ema", lambda s: tasks.fit_task(
        lambda: tasks.Task(tasks.llama, "lm"), s, batches.data("lm"), batches.data("lm", batches=2, seed=1),
        callbacks=[EMAWeightAveraging(decay=0.5)], **options,
    ))
    _assert_same(streamed, plain)  # the final weights are the average, copied in at the end of training
    np.testing.assert_allclose(streamed.val_losses, plain.val_losses, rtol=1e-5)
    assert len(streamed.val_losses) == 4


def test_load_state_dict_by_hand_mid_run() -> None:
    """A callback rewinds the model to its initial weights after step 3: the next step must start from them."""

    class Rewind(tasks.pl.Callback):
        def on_train_start(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule) -> None:
            self.initial = {k: v.clone() for k, v in pl_module.state_dict().items()}

        def on_train_batch_end(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: Any
        ) -> None:
            if trainer.global_step == 3 and not hasattr(self, "done"):
                self.done = True
                pl_module.load_state_dict(self.initial)

    plain, streamed = _plain_and_streamed(
        "rewind", lambda s: tasks.fit("llama", s, callbacks=[Rewind()], accumulate_grad_batches=1)
    )
    _assert_same(streamed, plain)
    assert streamed.losses[3] == pytest.approx(streamed.losses[0], rel=0.05)  # back at the start (other batch)


def test_lbfgs_evaluates_its_closure_with_the_weights_it_just_set() -> None:
    """LBFGS calls the closure several times per step, changing the weights in between."""

    class LBFGSTask(tasks.Task):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5, history_size=4)

    options = dict(max_steps=2, accumulate_grad_batches=1, gradient_clip_val=None)
    plain, streamed = _plain_and_streamed("lbfgs", lambda s: tasks.fit_task(
        lambda: LBFGSTask(tasks.sequential, "vector"), s, batches.data("vector"), **options
    ))
    assert len(plain.losses) > 4  # several closure evaluations per step
    _assert_same(streamed, plain)


def test_manual_optimization_with_two_backwards_per_step() -> None:
    class Manual(tasks.Task):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            tasks.two_backwards_and_a_step(self, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)

    options = dict(max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None)
    plain, streamed = _plain_and_streamed(
        "manual", lambda s: tasks.fit_task(lambda: Manual(tasks.gpt2, "lm"), s, batches.data("lm"), **options)
    )
    assert len(plain.losses) == 8
    _assert_same(streamed, plain)


def test_a_checkpoint_saved_mid_run_holds_the_weights_of_that_step(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    streamed = tasks.fit("llama", SuperpipeStrategy(), callbacks=[checkpoint], enable_checkpointing=True, max_steps=3)
    saved = torch.load(tmp_path / "step=3.ckpt", weights_only=True)["state_dict"]
    current = streamed.state_dict()
    assert saved.keys() == current.keys()
    assert all(torch.equal(saved[k], current[k]) for k in saved)


# ---------------------------------------------------------------------------------------------------- flags


def test_base_finetuning_unfreezes_layers_at_epoch_one() -> None:
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=4, accumulate_grad_batches=1)

    tasks.pl.seed_everything(7, verbose=False)
    initial = tasks.HeadFirstTask(tasks.llama, "lm")
    plain, streamed = _plain_and_streamed("unfreeze", lambda s: tasks.fit_task(
        lambda: tasks.HeadFirstTask(tasks.llama, "lm"), s, batches.data("lm"),
        callbacks=[tasks.UnfreezeLayersAtEpochOne()], **options
    ))
    _assert_same(streamed, plain)
    # The layers trained in epoch 1 (they moved 0.0 when the strategy read `requires_grad` only at set-up).
    assert tasks.max_relative_difference(streamed.model.model.layers, initial.model.model.layers) > 1e-3


def test_parameters_frozen_mid_run_stop_moving() -> None:
    class FreezeMlpAtStep2(tasks.pl.Callback):
        def on_train_batch_start(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: Any
        ) -> None:
            if trainer.global_step == 2:
                for name, param in pl_module.named_parameters():
                    if ".mlp." in name:
                        param.requires_grad_(False)
                        param.grad = None

        def on_train_batch_end(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: Any
        ) -> None:
            if trainer.global_step == 2:
                pl_module.frozen = {n: p.clone() for n, p in pl_module.named_parameters() if ".mlp." in n}

    plain, streamed = _plain_and_streamed("freeze", lambda s: tasks.fit(
        "llama", s, callbacks=[FreezeMlpAtStep2()], accumulate_grad_batches=1, gradient_clip_val=None
    ))
    _assert_same(streamed, plain)
    for name, param in streamed.named_parameters():
        if ".mlp." in name:
            assert param.grad is None
            assert torch.equal(param, streamed.frozen[name])  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------- unused


class _Branchy(nn.Module):
    """Each block has a branch that the data never takes: its parameters get no gradient in plain training."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(24, 24)
        self.unused = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.unused if x.abs().sum() < 0 else self.used
        return torch.relu(branch(x)) + x


def _branchy_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 24), nn.Sequential(*[_Branchy() for _ in range(3)]), nn.Linear(24, 3), nn.Linear(3, 3)
    )


class _SkipLastHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _branchy_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model[2](self.model[1](self.model[0](x)))  # the last head (trunk) is never used


def test_unused_parameters_get_no_gradient_and_are_not_moved_by_weight_decay() -> None:
    def make() -> tasks.Task:
        task = tasks.Task(_SkipLastHead, "vector")
        task.initial = {k: v.clone() for k, v in task.state_dict().items()}  # type: ignore[attr-defined]
        return task

    plain, streamed = _plain_and_streamed(
        "unused", lambda s: tasks.fit_task(make, s, batches.data("vector"), max_steps=4)
    )
    _assert_same(streamed, plain)
    unused = [n for n in streamed.state_dict() if ".unused." in n or n.startswith("model.model.3.")]
    assert len(unused) == 8
    for name, param in streamed.named_parameters():
        if name in unused:
            assert param.grad is None
            assert torch.equal(param.detach(), streamed.initial[name])  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------- buffers


class _ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Sequential(*[_ConvBlock(8) for _ in range(3)]),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def test_batchnorm_statistics_in_streamed_blocks_update_once_per_forward() -> None:
    options = dict(max_steps=-1, max_epochs=1, limit_train_batches=6, limit_val_batches=2)
    plain, streamed = _plain_and_streamed("batchnorm", lambda s: tasks.fit_task(
        lambda: tasks.Task(_conv_net, "vector"), s, _images(), _images(batches=2, seed=1), **options
    ))
    _assert_same(streamed, plain)  # includes running_mean, running_var and num_batches_tracked
    tracked = [int(b) for n, b in streamed.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked == [6] * 4  # 6 micro-batches; the recomputation in backward did not count again
    np.testing.assert_allclose(streamed.val_losses, plain.val_losses, rtol=1e-5)  # evaluation uses the statistics


def _images(batches: int = 6, seed: int = 0) -> Any:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 4, 3, 8, 8, generator=generator)
    y = torch.randint(0, 5, (batches * 4,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


# ---------------------------------------------------------------------------------------------------- pruning


class _PruneAtEpochEnd(tasks.pl.Callback):
    """``torch.nn.utils.prune`` at the end of each epoch, as ``ModelPruning`` does: the first time renames each
    parameter (``weight`` -> ``weight_orig``) beside a new mask; the second replaces the hook and the mask."""

    def __init__(self, module_names: tuple[str, ...]) -> None:
        self.module_names = module_names

    def on_train_epoch_end(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule) -> None:
        linears = [module for name, module in pl_module.named_modules()
                   if isinstance(module, nn.Linear) and name.startswith(self.module_names)]
        assert linears, self.module_names
        for module in linears:
            nn.utils.prune.l1_unstructured(module, "weight", amount=0.3)
            nn.utils.prune.ln_structured(module, "weight", amount=0.2, n=2, dim=0)  # a container of both


@pytest.mark.parametrize(
    "where", [("model.model.layers",), ("model.lm_head",), ("model.model.layers", "model.lm_head")],
    ids=["blocks", "trunk", "both"],
)
def test_parameters_pruned_mid_run_train_as_plain(where: tuple[str, ...]) -> None:
    options = dict(max_steps=-1, max_epochs=3, limit_train_batches=4, accumulate_grad_batches=1)
    plain, streamed = _plain_and_streamed(("prune", where), lambda s: tasks.fit(
        "llama", s, callbacks=[_PruneAtEpochEnd(where)], **options
    ))
    _assert_same(streamed, plain)
    masks = [key for key in streamed.state_dict() if key.endswith("weight_mask")]
    assert masks and all((streamed.state_dict()[key] == 0).any() for key in masks)


def test_model_pruning_callback_prunes_streamed_blocks_and_makes_it_permanent() -> None:
    """Lightning's ``ModelPruning`` (its lottery-ticket reset off: it makes the pruned weights share storage with
    its copy of the initial ones, which the strategy's host homes do not follow)."""
    from lightning.pytorch.callbacks import ModelPruning

    def prune() -> ModelPruning:
        return ModelPruning("l1_unstructured", amount=0.25, use_lottery_ticket_hypothesis=False,
                            make_pruning_permanent=True)

    options = dict(max_steps=-1, max_epochs=3, limit_train_batches=4, accumulate_grad_batches=1)
    plain, streamed = _plain_and_streamed("model pruning", lambda s: tasks.fit("llama", s, callbacks=[prune()],
                                                                               **options))
    _assert_same(streamed, plain)
    state = streamed.state_dict()
    assert not [key for key in state if key.endswith(("_orig", "_mask"))]  # made permanent at the end
    weights = [value for key, value in state.items() if key.startswith("model.model.layers") and "proj" in key]
    assert weights and all((value == 0).float().mean() > 0.2 for value in weights)
