"""What the strategy holds on the device: the ledger's bound, and no reference to a block after it is done."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_superpipe  # noqa: F401
from lightning_superpipe import DeviceMemoryLogger, SuperpipeStrategy
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


class _Probe(tasks.pl.Callback):
    """Records the ledger after every micro-batch and checks the slot storages after each forward."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.gradient_peaks: list[int] = []
        self.extra_references: list[int] = []
        self.largest_block_bytes = 0

    def on_before_backward(
        self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Forward is done, backward has not started: autograd must hold no view of any slot (every streamed block
        # is checkpointed), so each slot's storage is referenced by the slot's own flat tensor alone (and by the
        # temporary storage object asked for the count).
        self.extra_references += tasks.extra_slot_references(trainer.strategy.engine)

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, *args: object) -> None:
        ledger = trainer.strategy.engine.ledger
        self.largest_block_bytes = trainer.strategy.engine.largest_block_bytes()
        self.trunk_bytes = trainer.strategy.engine.trunk_device_bytes()
        self.peaks.append(ledger.peak_bytes)
        self.gradient_peaks.append(ledger.peak_gradient_bytes)


@pytest.mark.parametrize(("resident_blocks", "prefetch"), [(0, 0), (1, 1), (0, 2), (2, 1)])
def test_ledger_stays_within_the_knobs_bound(resident_blocks: int, prefetch: int, emulated_link: str) -> None:
    probe = _Probe()
    strategy = SuperpipeStrategy(resident_blocks=resident_blocks, prefetch=prefetch)
    task = tasks.build_task("llama")
    tasks.trainer(strategy, max_steps=4, callbacks=[probe]).fit(task, batches.data("lm"))
    block_bytes = sum(p.numel() * 4 for p in task.model.model.layers[0].parameters())
    largest = probe.largest_block_bytes
    assert block_bytes <= largest <= block_bytes * 1.1  # alignment padding only
    # With synchronous copies a block's gradients are home before the next block's exist; with asynchronous ones
    # the previous block's are still on their way while the next block's are computed.
    gradient_blocks = 1 if emulated_link == "cpu" else 2
    # Block weights and gradients, plus the resident trunk and its gradients, plus what the checkpoints held (their
    # inputs, one block's recomputation: counted on their own, see test_strategy_activations).
    bound = (resident_blocks + prefetch + 1 + gradient_blocks) * largest + 2 * probe.trunk_bytes
    activations = strategy.memory_report()["peak_activation_bytes"]
    assert activations > 0
    assert max(probe.peaks) <= bound + activations
    assert strategy.memory_report()["peak_device_bytes"] == max(probe.peaks)  # still readable after fit
    # The gradients of a whole block did pass through, and no more blocks of them than said above were held.
    assert block_bytes * 0.99 <= max(probe.gradient_peaks) <= gradient_blocks * block_bytes
    assert probe.extra_references and max(probe.extra_references) == 0


@pytest.mark.parametrize("logger_callback", [False, True], ids=["alone", "with DeviceMemoryLogger"])
def test_memory_report_counts_host_bytes_and_is_logged_only_when_asked(logger_callback: bool) -> None:
    task = tasks.build_task("gpt2")
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    seen: dict[str, int] = {}
    logged: dict[str, Any] = {}

    class Snapshot(tasks.pl.Callback):
        def on_train_end(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule) -> None:
            seen.update(strategy.memory_report())
            logged.update(trainer.callback_metrics)

    callbacks = [Snapshot(), *([DeviceMemoryLogger()] if logger_callback else [])]
    tasks.trainer(strategy, max_steps=2, callbacks=callbacks).fit(task, batches.data("lm"))
    # The strategy adds nothing to what the user logs (the task logs its loss); the callback adds its two figures.
    ours = {key for key in logged if key.startswith("superpipe/")}
    assert ours == ({"superpipe/device_bytes", "superpipe/peak_device_bytes"} if logger_callback else set())
    blocks = task.model.transformer.h
    assert seen["num_blocks"] == len(blocks) == 3
    assert seen["resident_blocks"] == 0 and seen["prefetch"] == 1
    assert seen["largest_block_bytes"] >= sum(p.numel() * 4 for p in blocks[0].parameters())
    assert seen["host_bytes"] >= sum(p.numel() * 4 for p in blocks.parameters())
    assert seen["param_bytes"] == seen["trainable_param_bytes"] == sum(p.numel() * 4 for p in task.parameters())
    assert seen["optimizer_state_bytes"] >= 2 * seen["trainable_param_bytes"]  # AdamW: two moments
    assert seen["peak_device_bytes"] >= 2 * seen["largest_block_bytes"] + seen["trunk_device_bytes"]  # two slots
    if logger_callback:
        assert float(logged["superpipe/peak_device_bytes"]) == seen["peak_device_bytes"]


def test_backward_reads_weights_fetched_again_not_stale_copies() -> None:
    """Poison and empty every slot between forward and backward: gradients must not change, because backward
    recomputes each block with its weights fetched again, and nothing autograd kept points into a slot.

    (Poisoning without emptying would corrupt the block that legitimately stays in its slot from the end of
    forward to the start of backward, and NaN everything.)"""

    class Poison(tasks.pl.Callback):
        def on_before_backward(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            engine = trainer.strategy.engine
            engine._release_busy()
            engine.copier.synchronize()  # the poison must not race copies in flight into the slots
            for slot in engine._slots:
                slot.flat.fill_(float("nan"))
                slot.block = None
                slot.free = engine.copier.mark_compute()  # the next copy into the slot comes after the poison

    plain = tasks.plain_fit("llama")  # once for the three links
    streamed = tasks.fit("llama", SuperpipeStrategy(resident_blocks=0, prefetch=1), callbacks=[Poison()])
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


def test_the_weight_comparison_sees_nan() -> None:
    """The helpers the exactness tests rely on must fail on a broken model, NaN included."""
    tasks.self_check()
    task = tasks.build_task("llama")
    same = tasks.build_task("llama")
    assert tasks.max_relative_difference(task, same) == 0.0
    with torch.no_grad():
        same.model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    assert tasks.max_relative_difference(task, same) == float("inf")
    assert tasks.max_relative_difference(same, task) == float("inf")


def test_trunk_gradients_are_counted_and_leave_as_soon_as_complete() -> None:
    """An untied LM head's gradient is complete when backward reaches the last block, the final norm's right
    after: both leave the device before any block's gradients arrive; the embedding's leaves at the end. The
    ledger counts them all."""
    held_at_block_sends: list[int] = []

    class Spy(tasks.pl.Callback):
        def on_train_start(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            gradients = trainer.strategy.engine.gradients
            original = gradients.send_block

            def spying(index: int, pieces: object, grads: object) -> None:
                gradients._finish_copies()  # what the original does first: copies issued earlier are done
                held_at_block_sends.append(trainer.strategy.engine.ledger.held["trunk_gradients"])
                original(index, pieces, grads)  # type: ignore[arg-type]

            gradients.send_block = spying  # type: ignore[method-assign]

    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    task = tasks.build_task("llama")
    tasks.trainer(strategy, max_steps=2, callbacks=[Spy()]).fit(task, batches.data("lm"))
    report = strategy.memory_report()
    head = task.model.lm_head.weight.numel() * 4
    embedding = task.model.model.embed_tokens.weight.numel() * 4
    assert held_at_block_sends and max(held_at_block_sends) == 0
    assert head <= report["peak_trunk_gradient_bytes"] <= head + embedding
    assert report["peak_device_bytes"] >= report["trunk_device_bytes"] + head
    assert report["streamed_stacks"] == ["model.model.layers: 3 x LlamaDecoderLayer"]


def test_blocks_stream_on_every_pass() -> None:
    """With no resident blocks and no prefetch, each block is copied once in forward and once in backward."""
    loads: list[int] = []
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=0)

    class Count(tasks.pl.Callback):
        def on_train_start(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            engine = trainer.strategy.engine
            original = engine._load

            def counting_load(index: int, avoid: set[int]) -> object:
                loads.append(index)
                return original(index, avoid)

            engine._load = counting_load  # type: ignore[method-assign]

    tasks.trainer(strategy, max_steps=1, accumulate_grad_batches=1, callbacks=[Count()]).fit(
        tasks.build_task("llama"), batches.data("lm")
    )
    assert loads == [0, 1, 2, 1, 0]  # block 2 stays for its own backward; the last step's refresh is not counted
