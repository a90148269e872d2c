"""Where activations live: every placement, and mixes of them, train exactly as plain Lightning does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.streaming import activations as activations_module
from lightning_superpipe.streaming.engine import StreamingEngine
from tests import batches, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


@pytest.fixture(autouse=True)
def offload_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test models are tiny: offload every saved activation, not only those of 64 KiB or more."""
    monkeypatch.setattr(activations_module, "OFFLOAD_MIN_BYTES", 0)


MIXED = ["keep", "offload", "recompute"]


_NUM_BLOCKS: dict[str, int] = {}


def _num_blocks(name: str) -> int:
    """How many blocks the strategy streams of family ``name`` (a one-step run's report, once per family)."""
    if name not in _NUM_BLOCKS:
        blocks = SuperpipeStrategy()
        tasks.fit_family(name, blocks, steps=1)
        _NUM_BLOCKS[name] = blocks.memory_report()["num_blocks"]
    return _NUM_BLOCKS[name]


@pytest.mark.parametrize("name", ["llama-eager-padded", "gpt2-padded", "t5-padded", "llava", "resnet", "qwen2_moe"])
@pytest.mark.parametrize("activations", ["keep", "offload", "mixed"])
def test_each_placement_trains_exactly_as_plain_lightning(name: str, activations: str) -> None:
    plain = tasks.plain_fit_family(name)  # once for the three placements and the three links
    modes: Any = activations
    if activations == "mixed":
        modes = [MIXED[i % 3] for i in range(_num_blocks(name))]
    strategy = SuperpipeStrategy(resident_blocks=1, prefetch=1, activations=modes)
    streamed = tasks.fit_family(name, strategy)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5  # BatchNorm's statistics included
    report = strategy.memory_report()
    assert report["peak_activation_bytes"] > 0
    assert (report["host_activation_bytes"] > 0) == (activations != "keep")


@pytest.mark.parametrize(("resident_blocks", "prefetch"), [(0, 0), (0, 2), (2, 1)])
@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_knobs_clipping_by_value_and_accumulation_do_not_change_results(
    resident_blocks: int, prefetch: int, activations: str
) -> None:
    options = dict(gradient_clip_algorithm="value")
    plain = tasks.plain_fit("sequential", **options)  # once for the six knob settings and the three links
    strategy = SuperpipeStrategy(resident_blocks=resident_blocks, prefetch=prefetch, activations=activations)
    streamed = tasks.fit("sequential", strategy, **options)
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


def test_lora_with_kept_activations_matches_plain() -> None:
    peft = pytest.importorskip("peft")

    def make() -> tasks.Task:
        task = tasks.Task(tasks.llama, "lm")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        task.model = peft.get_peft_model(task.model, config)
        return task

    plain = tasks.fit_task(make, "auto", batches.data("lm"))
    streamed = tasks.fit_task(make, SuperpipeStrategy(activations="keep"), batches.data("lm"))
    np.testing.assert_allclose(streamed.losses, plain.losses, rtol=1e-5)
    assert tasks.max_relative_difference(streamed, plain) < 1e-5


@pytest.mark.parametrize("activations", ["recompute", "keep", "offload"])
def test_blocks_run_once_per_micro_batch_unless_recomputed_and_slots_stay_unreferenced(activations: str) -> None:
    calls: list[int] = []
    extra_references: list[int] = []

    class Probe(tasks.pl.Callback):
        def on_train_start(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule) -> None:
            pl_module.model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))

        def on_before_backward(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            # Autograd holds handles, not views, of the streamed weights.
            extra_references.extend(tasks.extra_slot_references(trainer.strategy.engine))

    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1, activations=activations)
    tasks.trainer(strategy, max_steps=2, callbacks=[Probe()]).fit(tasks.build_task("llama"), batches.data("lm"))
    assert len(calls) == 4 * (2 if activations == "recompute" else 1)  # 4 micro-batches
    assert extra_references and max(extra_references) == 0
    report = strategy.memory_report()
    if activations != "offload":
        assert report["host_activation_bytes"] == 0
    assert len(report["peak_activation_bytes_per_block"]) == 3


def test_the_ledger_counts_what_recomputation_holds_and_frees_it() -> None:
    held_after_step: list[int] = []

    class Probe(tasks.pl.Callback):
        def on_train_batch_end(self, trainer: tasks.pl.Trainer, *args: object) -> None:
            held_after_step.append(trainer.strategy.engine.ledger.held["activations"])

    reports = {}
    for activations in ("keep", "recompute"):
        strategy = SuperpipeStrategy(resident_blocks=0, activations=activations)
        tasks.trainer(strategy, max_steps=2, callbacks=[Probe()]).fit(tasks.build_task("llama"), batches.data("lm"))
        reports[activations] = strategy.memory_report()
    keep, recompute = reports["keep"], reports["recompute"]
    # A recomputed block saves what a kept one does, and the checkpoint held its inputs besides.
    for kept, recomputed in zip(keep["peak_activation_bytes_per_block"], recompute["peak_activation_bytes_per_block"]):
        assert recomputed >= kept > 0
    # At the worst moment one block is recomputed while the inputs of the blocks before it wait: more than one
    # block's share, less than keeping them all.
    assert (
        max(recompute["peak_activation_bytes_per_block"])
        < recompute["peak_activation_bytes"]
        < keep["peak_activation_bytes"]
    )
    assert held_after_step and set(held_after_step) == {0}  # nothing is counted after backward freed it


def test_offloading_keeps_fewer_activation_bytes_on_the_device_than_keeping() -> None:
    peaks = {}
    for activations in ("keep", "offload"):
        strategy = SuperpipeStrategy(resident_blocks=0, activations=activations)
        tasks.trainer(strategy, max_steps=2).fit(tasks.build_task("gpt2"), batches.data("lm"))
        peaks[activations] = strategy.memory_report()
    assert peaks["offload"]["peak_activation_bytes"] < 0.8 * peaks["keep"]["peak_activation_bytes"]
    assert peaks["offload"]["host_activation_bytes"] > 0 == peaks["keep"]["host_activation_bytes"]


def test_bad_placements_are_refused_with_the_users_call() -> None:
    with pytest.raises(MisconfigurationException, match=r"activations='stash'\): 'stash' is not one of"):
        tasks.trainer(SuperpipeStrategy(activations="stash")).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )
    with pytest.raises(MisconfigurationException, match=r"has 2 entries, but the model streams 4 blocks"):
        tasks.trainer(SuperpipeStrategy(activations=["keep", "offload"])).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_bf16_mixed_and_resume_keep_their_guarantees(activations: str, tmp_path: Any, emulated_link: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    mixed = dict(precision="bf16-mixed", gradient_clip_val=1.0)
    # The recomputing run of this link, once for both placements.
    recomputed = tasks.once(
        ("bf16-recomputed", emulated_link), lambda: tasks.fit("llama", SuperpipeStrategy(resident_blocks=0), **mixed)
    )
    placed = tasks.fit("llama", SuperpipeStrategy(resident_blocks=0, activations=activations), **mixed)
    # The same bf16 weights and kernels; only where the saved tensors wait differs.
    np.testing.assert_allclose(placed.losses, recomputed.losses, rtol=1e-6)
    assert tasks.max_relative_difference(placed, recomputed) < 1e-6

    options = dict(max_steps=-1, limit_train_batches=8)
    whole = tasks.fit_task(
        lambda: tasks.Task(tasks.llama, "lm"), SuperpipeStrategy(activations=activations), batches.data("lm"),
        max_epochs=2, **options,
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    tasks.fit_task(
        lambda: tasks.Task(tasks.llama, "lm"), SuperpipeStrategy(activations=activations), batches.data("lm"),
        max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint], **options,
    )
    resumed = tasks.build_task("llama", seed=123)
    tasks.trainer(SuperpipeStrategy(activations=activations), max_epochs=2, **options).fit(
        resumed, batches.data("lm"), ckpt_path=tmp_path / "last.ckpt"
    )
    np.testing.assert_allclose(resumed.losses, whole.losses[8:], rtol=1e-6)
    assert tasks.max_relative_difference(resumed, whole) < 1e-6


@pytest.mark.parametrize("name", ["llama-eager-padded", "gpt2-padded"])
@pytest.mark.parametrize("resident_blocks", [0, 1])
def test_offloaded_activations_are_on_their_way_back_before_their_block_reads_them(
    name: str, resident_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offloading alone, between blocks that keep or recompute: a block's activations come back as backward reaches
    # it, and the previous block's while it computes, never one by one as each is read (each copy then waited for).
    read_before_sent_back: list[int] = []
    unpack = activations_module.ActivationPlacement.unpack

    def watched(self: Any, packed: Any) -> Any:
        if isinstance(packed, activations_module._Offloaded) and packed.device is None:
            read_before_sent_back.append(packed.index)
        return unpack(self, packed)

    monkeypatch.setattr(activations_module.ActivationPlacement, "unpack", watched)
    modes = [["recompute", "offload", "keep"][i % 3] for i in range(_num_blocks(name))]
    plain = tasks.plain_fit_family(name)
    strategy = SuperpipeStrategy(resident_blocks=resident_blocks, prefetch=1, activations=modes)
    streamed = tasks.fit_family(name, strategy)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    assert strategy.memory_report()["host_activation_bytes"] > 0
    assert read_before_sent_back == []


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("modes", ["offload", "keep", "recompute"])
def test_at_prefetch_0_a_blocks_weights_go_before_the_activations_that_come_back_while_it_computes(
    name: str, modes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At prefetch 0 a block's weights are copied when its backward starts, the moment block ``i - 1``'s activations
    # are sent back: queued behind them on one link, the block would wait for both.
    copies: list[tuple[str, int]] = []
    copy_in, bring_back = StreamingEngine._copy_in, activations_module.ActivationPlacement._bring_back

    def weights(self: Any, dst: Any, index: int, *args: Any) -> Any:
        copies.append(("weights", index))
        return copy_in(self, dst, index, *args)

    def activations(self: Any, packed: Any) -> None:
        copies.append(("activations", packed.index))
        bring_back(self, packed)

    # And the schedule's cursor only moves forward within a pass (acquiring a block twice would move it back).
    cursors: list[list[int]] = []
    start_pass, acquire_flat = StreamingEngine.start_pass, StreamingEngine.acquire_flat

    def started(self: Any, training: bool) -> None:
        cursors.append([])
        start_pass(self, training)

    def acquired(self: Any, index: int) -> Any:
        flat = acquire_flat(self, index)
        cursors[-1].append(self.schedule._cursor)
        return flat

    monkeypatch.setattr(StreamingEngine, "_copy_in", weights)
    monkeypatch.setattr(activations_module.ActivationPlacement, "_bring_back", activations)
    monkeypatch.setattr(StreamingEngine, "start_pass", started)
    monkeypatch.setattr(StreamingEngine, "acquire_flat", acquired)
    blocks = 3  # the examples' layers: block 0's activations come back while block 1, streamed, computes
    placement = ["offload"] * blocks if modes == "offload" else ["offload", modes, "offload"]
    plain = tasks.plain_fit(name, max_steps=3)
    streamed = tasks.fit(name, SuperpipeStrategy(resident_blocks=0, prefetch=0, activations=placement), max_steps=3)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    checked = 0
    for position, (kind, index) in enumerate(copies):
        if kind == "activations" and index < blocks - 1:
            before = [block for what, block in copies[:position] if what == "weights"]
            assert before[-1] == index + 1, f"block {index}'s activations went back before block {index + 1}'s weights"
            checked += 1
    assert checked > 0
    assert all(positions == sorted(positions) for positions in cursors) and any(cursors)
