"""The host arena: exact, page-aligned, counted host buffers (page-locked with a CUDA device)."""

from __future__ import annotations

import pytest
import torch

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.pinned import PAGE, HostArena, caching_allocator_bytes, page_rounded
from tests import batches, tasks


def test_buffers_are_page_aligned_exact_and_counted() -> None:
    arena = HostArena(pin=False)
    a = arena.empty(1000, torch.float32)
    b = arena.empty(3, torch.bfloat16)
    assert a.numel() == 1000 and a.dtype == torch.float32 and b.numel() == 3 and b.dtype == torch.bfloat16
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0
    assert arena.requested_bytes == 4000 + 6
    assert arena.allocated_bytes == 2 * PAGE  # one chunk each, rounded to a page, no power of two
    arena.reserve(10 * PAGE)  # many small buffers share one chunk
    small = [arena.empty(100, torch.float32) for _ in range(10)]
    assert arena.allocated_bytes == 12 * PAGE
    assert len({t.data_ptr() for t in small}) == 10 and all(t.data_ptr() % PAGE == 0 for t in small)
    assert arena.pinned_bytes == 0  # nothing page-locked without CUDA
    a.fill_(1.0)
    small[0].fill_(2.0)
    assert a.sum() == 1000 and small[0].sum() == 200  # distinct memory


def test_the_caching_allocator_rounds_to_powers_of_two_and_the_arena_to_pages() -> None:
    block = 218_112_000 * 4  # a Llama-3-8B decoder layer in fp32
    assert caching_allocator_bytes(block) == 2**30
    assert page_rounded(block) - block < PAGE
    assert caching_allocator_bytes(4097) == 8192 and caching_allocator_bytes(4096) == 4096


def test_the_report_counts_every_host_byte_the_engine_allocated() -> None:
    strategy = SuperpipeStrategy(resident_blocks=0)
    task = tasks.build_task("llama")
    tasks.trainer(strategy, max_steps=1).fit(task, batches.data("lm"))
    report = strategy.memory_report()
    homes = sum(
        page_rounded(sum(-(-p.numel() // 64) * 64 for p in layer.parameters()) * 4) for layer in task.model.model.layers
    )
    assert report["host_bytes"] == homes  # fp32 on a CPU device: no transfer copies, no staging
    assert report["pinned_host_bytes"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_homes_trunk_and_staging_are_page_locked_and_released() -> None:
    strategy = SuperpipeStrategy(resident_blocks=0)
    task = tasks.build_task("llama")
    seen: dict[str, object] = {}

    class Inspect(tasks.pl.Callback):
        def on_train_batch_end(
            self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: object
        ) -> None:
            seen["pinned"] = all(p.is_pinned() for p in pl_module.parameters())
            seen["report"] = strategy.memory_report()

    tasks.trainer(strategy, accelerator="gpu", max_steps=1, callbacks=[Inspect()]).fit(task, batches.data("lm"))
    report = seen["report"]
    assert seen["pinned"] is True
    assert report["pinned_host_bytes"] == report["host_bytes"] > 0  # type: ignore[index]
    assert not any(p.is_pinned() for p in task.parameters())  # unregistered on teardown
