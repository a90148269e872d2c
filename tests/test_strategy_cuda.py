"""The strategy on a CUDA device: pinned homes, asynchronous copies, and real device memory. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import models

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = dict(accelerator="gpu", deterministic=False)


def test_cuda_training_matches_plain_and_homes_are_pinned() -> None:
    seen: dict[str, bool] = {}

    class Inspect(models.pl.Callback):
        def on_train_batch_end(self, trainer: models.pl.Trainer, pl_module: models.pl.LightningModule, *args: object) -> None:
            engine = trainer.strategy.engine
            seen["homes_pinned"] = all(h.master.is_pinned() for h in engine.homes if h is not None)
            seen["params_on_host"] = all(p.device.type == "cpu" for p in pl_module.parameters())
            seen["buffers_on_device"] = all(b.device.type == "cuda" for b in pl_module.buffers())

    plain = models.fit("llama", "auto", **CUDA)
    streamed = models.fit("llama", SuperpipeStrategy(resident_blocks=0, prefetch=1), callbacks=[Inspect()], **CUDA)
    assert seen == {"homes_pinned": True, "params_on_host": True, "buffers_on_device": True}
    # cuBLAS may pick other kernels for the two runs: agreement to float32 noise, not bit for bit.
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-4)
    assert models.max_relative_difference(streamed, plain) < 1e-3


def test_cuda_bf16_mixed_trains_close_to_plain() -> None:
    options = dict(precision="bf16-mixed", **CUDA)
    plain = models.fit("gpt2", "auto", **options)
    streamed = models.fit("gpt2", "superpipe", **options)
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=2e-2)


def _deep_stack(width: int = 1024, depth: int = 24) -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))

    return nn.Sequential(nn.Linear(12, width), nn.Sequential(*[block() for _ in range(depth)]), nn.Linear(width, 3))


def test_cuda_device_memory_stays_within_a_few_blocks() -> None:
    """24 blocks of 32 MB: plain training holds weights, gradients and AdamW state (16 bytes per parameter) on the
    device; superpipe holds three slots of weights and one block of gradients."""

    def peak(strategy: object) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        task = models.Task(_deep_stack, "vector")
        models.trainer(strategy, max_steps=2, accumulate_grad_batches=1, **CUDA).fit(task, models.data("vector", batches=4))
        return torch.cuda.max_memory_allocated()

    plain, streamed = peak("auto"), peak(SuperpipeStrategy(resident_blocks=1, prefetch=1))
    block_bytes = sum(p.numel() * 4 for p in _deep_stack(depth=1)[1].parameters())
    assert streamed < 0.25 * plain
    assert streamed < 6 * block_bytes  # three slots, one block of gradients, allocator slack


def test_cuda_generate_under_the_strategy_matches_plain() -> None:
    """``generate()`` puts its inputs on ``model.device`` (the host, for a streamed model): the strategy still runs
    the model on the GPU and returns the same greedy tokens."""

    class Generate(models.Task):
        def predict_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            prompt = batch[0][:, :4]  # type: ignore[index]
            return self.model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False).cpu()

    task = Generate(models.llama, "lm")
    task.eval()
    plain = models.trainer("auto", **CUDA).predict(task, models.data("lm", batches=2))
    streamed = models.trainer("superpipe", **CUDA).predict(task, models.data("lm", batches=2))
    assert all(torch.equal(a, b) for a, b in zip(streamed, plain))
    assert streamed[0].shape[1] == 10
