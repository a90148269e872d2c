"""The strategy on a CUDA device: pinned homes, asynchronous copies, and real device memory. Skipped without a GPU."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = dict(accelerator="gpu", deterministic=False)

# cuBLAS keeps a workspace per (handle, stream), 32 MiB on sm90 (and with CUBLAS_WORKSPACE_CONFIG=:4096:8), taken
# from the caching allocator: one for the forward thread, one for the autograd thread, one to spare (cuBLASLt).
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
CUBLAS_WORKSPACES = 3


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float) -> None:
    """``np.testing.assert_allclose`` treats NaN as equal to NaN: two runs that both diverged would pass."""
    actual_array, expected_array = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual_array.size > 0 and np.isfinite(actual_array).all(), f"non-finite or no losses: {actual}"
    assert np.isfinite(expected_array).all(), f"non-finite reference losses: {expected}"
    np.testing.assert_allclose(actual_array, expected_array, rtol=rtol, equal_nan=False)


def test_cuda_training_matches_plain_and_homes_are_pinned() -> None:
    seen: dict[str, bool] = {}

    class Inspect(tasks.pl.Callback):
        def on_train_batch_end(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: object
        ) -> None:
            engine = trainer.strategy.engine
            seen["homes_pinned"] = all(h.master.is_pinned() for h in engine.homes if h is not None)
            seen["params_on_host"] = all(p.device.type == "cpu" for p in pl_module.parameters())
            seen["buffers_on_device"] = all(b.device.type == "cuda" for b in pl_module.buffers())

    plain = tasks.fit("llama", "auto", **CUDA)
    streamed = tasks.fit("llama", SuperpipeStrategy(resident_blocks=0, prefetch=1), callbacks=[Inspect()], **CUDA)
    assert seen == {"homes_pinned": True, "params_on_host": True, "buffers_on_device": True}
    # cuBLAS may pick other kernels for the two runs: agreement to float32 noise, not bit for bit.
    assert_losses_close(streamed.losses, plain.losses, rtol=1e-4)
    assert tasks.max_relative_difference(streamed, plain) < 1e-3  # inf on NaN or inf


def test_cuda_bf16_mixed_trains_close_to_plain() -> None:
    options = dict(precision="bf16-mixed", **CUDA)
    plain = tasks.fit("gpt2", "auto", **options)
    streamed = tasks.fit("gpt2", "superpipe", **options)
    assert_losses_close(streamed.losses, plain.losses, rtol=2e-2)


def _deep_stack(width: int = 1024, depth: int = 24) -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))

    return nn.Sequential(nn.Linear(12, width), nn.Sequential(*[block() for _ in range(depth)]), nn.Linear(width, 3))


def test_cuda_device_memory_stays_within_the_ledger() -> None:
    """24 blocks of 32 MiB: plain training holds weights, gradients and AdamW state (16 bytes per parameter) on the
    device; superpipe holds what its ledger counts (three blocks of weights, the trunk, gradients leaving) plus
    what no ledger sees: cuBLAS workspaces, the gradients of the block computing while the previous block's are
    still being copied out (autograd allocates them before the engine counts them), activations."""

    def peak(strategy: object) -> tuple[int, list[float]]:
        # What this run added to the device: an earlier run's leftovers (Trainer and module reference each other,
        # so only the collector frees them) and workspaces made before do not count.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        task = tasks.Task(_deep_stack, "vector")
        tasks.trainer(strategy, max_steps=2, accumulate_grad_batches=1, **CUDA).fit(
            task, batches.data("vector", batches=4)
        )
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, task.losses

    plain, plain_losses = peak("auto")
    strategy = SuperpipeStrategy(resident_blocks=1, prefetch=1)
    streamed, streamed_losses = peak(strategy)
    assert np.isfinite(plain_losses).all() and np.isfinite(streamed_losses).all(), (plain_losses, streamed_losses)
    assert len(streamed_losses) == len(plain_losses) > 0
    report = strategy.memory_report()
    counted, block_bytes = report["peak_device_bytes"], report["largest_block_bytes"]  # fp32: gradients = weights
    unseen = CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES + block_bytes + 8 * 2**20  # + activations, rounding
    figures = f"streamed {streamed / 2**20:.1f} MiB, counted {counted / 2**20:.1f} MiB, plain {plain / 2**20:.1f} MiB"
    assert counted <= streamed, f"the ledger counts more than was allocated: {figures}"
    assert streamed <= counted + unseen, f"more than the ledger, the workspaces and a block of gradients: {figures}"
    assert streamed < 0.25 * plain, figures


def test_cuda_generate_under_the_strategy_matches_plain() -> None:
    """``generate()`` puts its inputs on ``model.device`` (the host, for a streamed model): the strategy still runs
    the model on the GPU and returns the same greedy tokens."""

    class Generate(tasks.Task):
        def predict_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            prompt = batch[0][:, :4]  # type: ignore[index]
            return self.model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False).cpu()

    task = Generate(tasks.llama, "lm")
    task.eval()
    plain = tasks.trainer("auto", **CUDA).predict(task, batches.data("lm", batches=2))
    streamed = tasks.trainer("superpipe", **CUDA).predict(task, batches.data("lm", batches=2))
    assert all(torch.equal(a, b) for a, b in zip(streamed, plain))
    assert streamed[0].shape[1] == 10
