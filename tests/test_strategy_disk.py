"""``SuperpipeStrategy(offload_device="disk")``: the blocks' masters and optimizer state in files, streamed through a
bounded pool; training equals the host tier's bitwise (and plain Lightning's), checkpoints resume exactly from the
tier's files beside the ``.ckpt``, and bad knobs are refused before anything is allocated."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_superpipe import EmulatedLink, OrderingViolation, SuperpipeStrategy  # registers "superpipe"
from lightning_superpipe.memory import disk
from lightning_superpipe.memory.disk import CLOCK_COUNTERS, space
from lightning_superpipe.memory.disk.checkpoints import DISK_KEY
from lightning_superpipe.memory.disk.reads import DiskReads
from lightning_superpipe.memory.disk.tier import DiskTier
from lightning_superpipe.planning.solver import minimum_plan, predict
from lightning_superpipe.stepping.optimizers import PER_PARAMETER_OPTIMIZERS
from tests import batches, tasks


def _relative(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


def _disk(path: Path, **knobs: Any) -> SuperpipeStrategy:
    path.mkdir(exist_ok=True)
    return SuperpipeStrategy(offload_device="disk", offload_path=path, **knobs)


def _assert_same(streamed: tasks.Task, host: tasks.Task) -> None:
    """Bitwise equal to the host tier: every loss and every weight."""
    assert streamed.losses == host.losses
    assert tasks.max_relative_difference(streamed, host) == 0.0


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_clipping_and_accumulation_spill_and_equal_the_host_tier_bitwise(tmp_path: Path, family: str) -> None:
    """AdamW with two groups, an LR warm-up, clipping by norm 0.5 and accumulation over 2 micro-batches, dropout on:
    every block's gradients are spilled, the global norm comes from the spilled norms and the trunk's. Stepped after
    backward (``overlap_optimizer=False``), and by default: speculatively during backward into each block's other
    slot, undone and stepped again from the spilled gradients (clipping fires here), then pipelined."""
    host = tasks.fit(family, "superpipe")
    plain = tasks.fit(family, "auto")
    for knob in (False, "auto"):
        streamed = tasks.fit(family, _disk(tmp_path / f"tier-{knob}", overlap_optimizer=knob))
        _assert_same(streamed, host)
        assert _relative(streamed.losses, plain.losses) < 1e-5
        assert tasks.max_relative_difference(streamed, plain) < 1e-5
        assert tasks.max_relative_difference(streamed, tasks.build_task(family)) > 1e-3  # it trained
        report = streamed.trainer.strategy.memory_report()
        modes = report["optimizer_step_modes"]
        if knob is False:
            assert report["overlapped_block_steps"] == 0 and modes["serial"] == 10
        else:  # one speculative step, redone; clipping keeps firing, so the rest pipelined into the next forward
            assert modes["speculative"] == report["speculative_steps_redone"] == 1 and modes["pipelined"] == 9
        assert report["offload_device"] == "disk" and report["disk_bytes_written"] > 0


def _masters_read_bytes(block: torch.nn.Module) -> int:
    """Bytes a read of ``block``'s masters takes from its record: each master on the record's alignment, the whole
    rounded up to pages."""
    from lightning_superpipe.memory.pinned import page_rounded

    align = disk.ENTRY_ALIGNMENT
    return page_rounded(sum(-(-p.numel() * p.element_size() // align) * align for p in block.parameters()))


@pytest.mark.usefixtures("emulated_link")
def test_a_pipelined_step_hands_its_buffers_to_the_next_forward_and_equals_the_host_tier_bitwise(
    tmp_path: Path,
) -> None:
    """``overlap_optimizer="pipelined"``: the blocks step from their spilled gradients on the optimizer thread while
    the next forward runs, each block's copy waiting for its step only, and that copy takes the new masters from the
    buffer the step left them in: one read of the block a step, not two. Clipping fires on every step (the factor
    multiplied in on the thread), accumulation 2, an LR warm-up stepped every step: bitwise the host tier's; the
    disk reads fall by at least the masters of each fused copy."""
    host = tasks.fit("llama", "superpipe")
    serial = tasks.fit("llama", _disk(tmp_path / "serial", overlap_optimizer=False))
    pipelined = tasks.fit("llama", _disk(tmp_path / "pipelined", overlap_optimizer="pipelined"))
    _assert_same(pipelined, host)
    _assert_same(serial, host)
    report, before = pipelined.trainer.strategy.memory_report(), serial.trainer.strategy.memory_report()
    assert report["optimizer_step_modes"]["pipelined"] == 10 and before["optimizer_step_modes"]["serial"] == 10
    layers = pipelined.model.model.layers
    fused = report["disk_fused_reads"]
    assert 0 < fused <= 9 * len(layers)  # each forward after a step: 9 of the 10 steps
    if not isinstance(pipelined.trainer.strategy.link, EmulatedLink):  # no copy in flight holds a buffer
        assert fused == 9 * len(layers)
    assert before["disk_fused_reads"] == 0
    saved = before["disk_bytes_read"] - report["disk_bytes_read"]
    assert saved >= fused * _masters_read_bytes(layers[0])
    assert report["disk_bytes_written"] == before["disk_bytes_written"]


def _pool_buffer_bytes(folder: Path) -> int:
    """The size of one of the disk tier's pool buffers for the llama example (a block's record and gradients)."""
    sizes: list[int] = []

    class Probe(tasks.pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            sizes.append(trainer.strategy.engine.home_kind.store.pool.buffer_bytes)

    tasks.fit("llama", _disk(folder), max_steps=1, callbacks=[Probe()])
    return sizes[0]


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("buffers", [2, 3])
def test_a_pipelined_step_in_the_smallest_pools_neither_waits_for_ever_nor_changes_a_bit(
    tmp_path: Path, buffers: int
) -> None:
    """With two pool buffers a pipelined step hands nothing over (it needs one to step a block in and one to read the
    next) and the forward reads each block itself, beside the step; with three it hands one over at a time. Either
    way the run ends as the host tier's, bitwise."""
    buffer_bytes = _pool_buffer_bytes(tmp_path / "probe")
    host = tasks.fit("llama", "superpipe", max_steps=4)
    strategy = _disk(tmp_path / "tier", overlap_optimizer="pipelined", host_buffer_bytes=buffers * buffer_bytes)
    streamed = tasks.fit("llama", strategy, max_steps=4)
    _assert_same(streamed, host)
    report = strategy.memory_report()
    assert report["optimizer_step_modes"]["pipelined"] == 4
    assert report["peak_disk_pool_host_bytes"] <= buffers * buffer_bytes
    if buffers == 2:
        assert report["disk_fused_reads"] == 0
    elif not isinstance(strategy.link, EmulatedLink):  # no copy in flight holds the one buffer it may hand over
        assert report["disk_fused_reads"] > 0


@pytest.mark.usefixtures("emulated_link")
def test_a_pipelined_step_is_done_before_validation_a_checkpoint_or_a_callback_reads_the_weights(
    tmp_path: Path,
) -> None:
    """Validation every 3 steps, ``ModelCheckpoint`` every step, and a callback reading the weights (``state_dict``)
    after each step, while the steps are pipelined: each sees the weights of the step just taken (as the host tier's
    run gives them), and a resume from the last checkpoint continues with the uninterrupted run's losses."""
    seen: dict[str, list[torch.Tensor]] = {}

    class ReadsWeights(tasks.pl.Callback):
        def __init__(self, key: str) -> None:
            self.key = key

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            weight = module.state_dict()["model.model.layers.1.mlp.up_proj.weight"]
            seen.setdefault(self.key, []).append(weight.clone())

    options = dict(max_steps=-1, limit_train_batches=12, limit_val_batches=2, val_check_interval=6,
                   enable_checkpointing=True)
    kind = tasks.EXAMPLES["llama"][1]

    def fit(key: str, strategy: Any, epochs: int = 1, ckpt_path: Any = None) -> tasks.Task:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / key, save_last=True, every_n_train_steps=1)
        task = tasks.build_task("llama", seed=5 if ckpt_path else tasks.SEED)  # a resume takes every weight
        tasks.pl.seed_everything(tasks.SEED + 1, verbose=False)
        trainer = tasks.trainer(strategy, callbacks=[ReadsWeights(key), checkpoint], max_epochs=epochs, **options)
        trainer.fit(task, batches.data(kind), batches.data(kind), ckpt_path=ckpt_path)
        return task

    host = fit("host", "superpipe")
    streamed = fit("disk", _disk(tmp_path / "tier", overlap_optimizer="pipelined"))
    _assert_same(streamed, host)
    assert streamed.val_losses == host.val_losses and len(host.val_losses) == 4
    assert len(seen["disk"]) == len(seen["host"]) == 12
    assert all(torch.equal(a, b) for a, b in zip(seen["disk"], seen["host"]))
    assert streamed.trainer.strategy.memory_report()["optimizer_step_modes"]["pipelined"] == 6

    uninterrupted = fit("uninterrupted", "superpipe", epochs=2)
    resumed = fit("resumed", _disk(tmp_path / "resumed", overlap_optimizer="pipelined"), epochs=2,
                  ckpt_path=tmp_path / "disk" / "last.ckpt")
    assert resumed.losses == uninterrupted.losses[12:]
    assert tasks.max_relative_difference(resumed, uninterrupted) == 0.0


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_without_clipping_blocks_step_through_the_store_during_backward(tmp_path: Path, accumulate: int) -> None:
    """Where the overlapped step is exact each block steps as its gradients complete (the earlier micro-batch's
    gradients added on disk), and the step is committed after backward."""
    options = dict(gradient_clip_val=None, accumulate_grad_batches=accumulate)
    host = tasks.fit("llama", SuperpipeStrategy(overlap_optimizer=True), **options)
    streamed = tasks.fit("llama", _disk(tmp_path / "tier"), **options)
    _assert_same(streamed, host)
    assert streamed.trainer.strategy.memory_report()["overlapped_block_steps"] == 3 * 10  # 3 blocks, 10 steps


def test_bf16_mixed_casts_on_the_fly_and_equals_the_host_tier(tmp_path: Path) -> None:
    for options in (dict(), dict(gradient_clip_val=None)):
        host = tasks.fit("gpt2", "superpipe", precision="bf16-mixed", **options)
        streamed = tasks.fit("gpt2", _disk(tmp_path / "tier"), precision="bf16-mixed", **options)
        _assert_same(streamed, host)
        assert all(p.dtype == torch.float32 for p in streamed.parameters())  # fp32 masters, back in memory


@pytest.mark.parametrize("variant", ["sgd", "adamw-fused", "lora"])
def test_sgd_fused_adamw_and_lora_equal_the_host_tier(tmp_path: Path, variant: str) -> None:
    """SGD with momentum without accumulation or clipping, fused AdamW (it writes parameters without bumping their
    versions), and LoRA (frozen block weights: masters on disk, no state, no gradient)."""
    if variant != "lora":
        options: dict[str, Any] = dict(optimizer=variant, accumulate_grad_batches=1, gradient_clip_val=None)
        _assert_same(
            tasks.fit("llama", _disk(tmp_path / "tier"), **options), tasks.fit("llama", "superpipe", **options)
        )
        return
    peft = pytest.importorskip("peft")

    def run(strategy: Any) -> tasks.Task:
        task = tasks.build_task("llama")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        task.model = peft.get_peft_model(task.model, config)
        tasks.pl.seed_everything(8, verbose=False)
        tasks.trainer(strategy).fit(task, batches.data("lm"))
        return task

    host, streamed = run("superpipe"), run(_disk(tmp_path / "tier"))
    _assert_same(streamed, host)
    adapters = [p for n, p in streamed.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # B starts at zero: it trained


@pytest.mark.parametrize("name", [c.__name__ for c in PER_PARAMETER_OPTIMIZERS[3:]] + ["transformers-adafactor"])
def test_every_per_parameter_torch_optimizer_equals_the_host_tier_and_plain_lightning(
    tmp_path: Path, name: str
) -> None:
    """Each other optimizer of ``torch.optim`` that updates a parameter from its own gradient and state, with two
    groups and a warm-up (and ``transformers``' Adafactor with its defaults: relative step sizes): stepped from disk
    after backward (clipping, accumulation 2: spilled gradients) and through the store during backward (no clipping),
    bitwise as the host tier (and its overlapped step) and plain Lightning."""
    clipped = tasks.fit("llama", _disk(tmp_path / "tier"), optimizer=name)
    host = tasks.fit("llama", "superpipe", optimizer=name)
    _assert_same(clipped, host)
    assert tasks.max_relative_difference(host, tasks.fit("llama", "auto", optimizer=name)) == 0.0
    assert tasks.max_relative_difference(clipped, tasks.build_task("llama")) > 1e-3  # it trained
    options: dict[str, Any] = dict(optimizer=name, gradient_clip_val=None)
    during = tasks.fit("llama", _disk(tmp_path / "tier"), **options)
    _assert_same(during, tasks.fit("llama", SuperpipeStrategy(overlap_optimizer=True), **options))
    assert during.trainer.strategy.memory_report()["overlapped_block_steps"] == 3 * 10  # 3 blocks, 10 steps


def test_an_optimizer_registered_as_per_parameter_is_stepped_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lion as a third-party package writes it (``tasks.Lion``): refused by the disk tier, with the way out, and not
    overlapped by the host tier until registered; registered, stepped from disk after backward (clipping: spilled
    gradients) and during backward, bitwise plain Lightning."""
    from lightning_superpipe import register_per_parameter_optimizer
    from lightning_superpipe.stepping import optimizers

    monkeypatch.setattr(optimizers, "REGISTERED_PER_PARAMETER", [])
    during: dict[str, Any] = dict(optimizer="lion", gradient_clip_val=None)
    with pytest.raises(
        MisconfigurationException,
        match=r"Lion is not known .* lightning_superpipe\.register_per_parameter_optimizer\(Lion\)",
    ):
        tasks.fit("llama", _disk(tmp_path / "refused"), **during)
    unregistered = tasks.fit("llama", SuperpipeStrategy(overlap_optimizer=True), **during)
    assert unregistered.trainer.strategy.memory_report()["overlapped_block_steps"] == 0
    assert register_per_parameter_optimizer(tasks.Lion) is tasks.Lion
    for options in (dict(optimizer="lion"), during):
        plain = tasks.fit("llama", "auto", **options)
        assert tasks.max_relative_difference(plain, tasks.build_task("llama")) > 1e-3  # it trained
        for strategy in (_disk(tmp_path / str(len(options))), SuperpipeStrategy(overlap_optimizer=True)):
            streamed = tasks.fit("llama", strategy, **options)
            assert tasks.max_relative_difference(streamed, plain) == 0.0
            report = streamed.trainer.strategy.memory_report()
            if options is during:  # no clipping: every block of every step during backward
                assert report["overlapped_block_steps"] == 3 * 10
            elif isinstance(strategy.offload_device, str) and strategy.offload_device == "disk":
                # Clipping fires on every step: one speculative step redone, then pipelined from the spilled
                # gradients.
                assert report["optimizer_step_modes"]["speculative"] == report["speculative_steps_redone"] == 1
                assert report["optimizer_step_modes"]["pipelined"] == 9
            else:  # clipping on the host tier: speculative, then (it fires on every step) pipelined
                assert report["optimizer_step_modes"]["serial"] == 0
    with pytest.raises(TypeError, match=r"register_per_parameter_optimizer\('object'\): expected a subclass"):
        register_per_parameter_optimizer(object)  # type: ignore[arg-type]


class _DefaultsAdamW(torch.optim.AdamW):
    """A user's AdamW with defaults of its own: the update is AdamW's."""

    def __init__(self, params: Any, lr: float = 5e-3) -> None:
        super().__init__(params, lr=lr, betas=(0.8, 0.95), weight_decay=0.05)


class _DefaultsTask(tasks.Task):
    def configure_optimizers(self) -> Any:
        return _DefaultsAdamW(self.parameters())


def test_a_subclass_that_only_sets_defaults_trains_on_the_disk_tier_and_in_the_overlapped_step(tmp_path: Path) -> None:
    """A subclass of a per-parameter optimizer that overrides only ``__init__`` is stepped block by block (from
    disk, and during backward) exactly as plain Lightning steps it."""
    def fit(strategy: Any, **options: Any) -> tasks.Task:
        return tasks.fit_task(lambda: _DefaultsTask(tasks.llama, "lm"), strategy, batches.data("lm"), **options)

    _assert_same(fit(_disk(tmp_path / "tier")), fit("superpipe"))
    unclipped = dict(gradient_clip_val=None)
    plain = fit("auto", **unclipped)
    for strategy in (_disk(tmp_path / "tier"), SuperpipeStrategy(overlap_optimizer=True)):
        during = fit(strategy, **unclipped)
        assert during.trainer.strategy.memory_report()["overlapped_block_steps"] == 3 * 10  # 3 blocks, 10 steps
        assert during.losses == plain.losses and tasks.max_relative_difference(during, plain) == 0.0


@pytest.mark.usefixtures("emulated_link")
def test_memory_budgets_hold_and_train_as_the_host_tier(tmp_path: Path) -> None:
    """``memory_budget=`` with the disk tier: the profiled steps, then the plan, from the least budget to one with
    room for every block resident (their device copies then refresh from the files after each step); the device
    peak stays within each, losses and weights bitwise the host tier's, with clipping and accumulation (spilled
    gradients) and without (blocks stepped through the store during backward)."""
    unclipped = dict(accumulate_grad_batches=1, gradient_clip_val=None)
    profiling = SuperpipeStrategy(memory_budget="1GiB")
    tasks.fit("llama", profiling, max_steps=4, **unclipped)
    profile = profiling._planner.profile
    least = int(1.05 * minimum_plan(profile).predicted_peak_bytes)
    everything = int(1.2 * predict(profile, range(len(profile.blocks)), 1, ["keep"] * len(profile.blocks)).peak_bytes)
    for options in (dict(unclipped, max_steps=6), dict(max_steps=6)):  # 2 profiled steps, 4 planned
        host = tasks.fit("llama", "superpipe", **options)
        # The solver picks by measured times; resident_blocks, a constraint of the plan, makes the second resident.
        for budget, knobs in ((least, {}), (everything, dict(resident_blocks=len(profile.blocks)))):
            strategy = _disk(tmp_path / "tier", memory_budget=budget, **knobs)
            _assert_same(tasks.fit("llama", strategy, **options), host)
            assert strategy.memory_report()["peak_device_bytes"] <= budget
            assert len(strategy.plan.resident) == knobs.get("resident_blocks", len(strategy.plan.resident))


class _PoisonOneBlock(tasks.pl.Callback):
    """Before the scaler's check of step 3, an infinite gradient in block 1 only: in its spilled gradients under
    the disk tier, in ``.grad`` on the host tier."""

    def on_after_backward(self, trainer: tasks.pl.Trainer, module: Any) -> None:
        if trainer.global_step != 3 or trainer.fit_loop._should_accumulate():  # the last micro-batch of step 3
            return
        param = next(module.model.model.layers[1].parameters())
        tier = trainer.strategy.engine.home_kind
        if not isinstance(tier, DiskTier):
            param.grad.view(-1)[0] = float("inf")
            return
        poison = torch.zeros_like(param)
        poison.view(-1)[0] = float("inf")
        params = tier.store.params[1]
        tier.store.spill_grads(1, [poison if p is param else None for p in params], accumulate=True, norms=True)


@pytest.mark.usefixtures("emulated_link")
def test_16_mixed_with_a_gradient_scaler_skips_and_steps_as_the_host_tier(tmp_path: Path) -> None:
    """``16-mixed`` (a ``GradScaler``) whose scale grows until float16 overflows every other step, and an infinite
    gradient in one block only at step 3: the steps with non-finite gradients (spilled to disk) are skipped and the
    scale lowered, the others unscaled and clipped from disk, bitwise as the host tier; accumulation 2."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fit(strategy: Any) -> tuple[tasks.Task, list[float]]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        scales: list[float] = []

        class Scales(tasks.pl.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                scales.append(scaler.get_scale())

        task = tasks.fit("llama", strategy, plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
                          callbacks=[_PoisonOneBlock(), Scales()])  # clipping by norm: the step after backward
        return task, scales

    (host, host_scales), (streamed, scales) = fit("superpipe"), fit(_disk(tmp_path / "tier"))
    _assert_same(streamed, host)
    assert scales == host_scales
    pairs = list(zip(scales, scales[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # steps skipped (the scale fell), others not
    assert scales[7] == scales[6] / 2  # step 3 (micro-batch 7) was skipped for block 1's gradient alone
    assert tasks.max_relative_difference(streamed, tasks.build_task("llama")) > 1e-3  # and others stepped
    assert all(torch.isfinite(p).all() for p in streamed.parameters())


def test_resident_blocks_and_deeper_prefetch_equal_the_host_tier(tmp_path: Path) -> None:
    knobs = dict(resident_blocks=2, prefetch=2)
    host = tasks.fit("sequential", SuperpipeStrategy(**knobs))
    streamed = tasks.fit("sequential", _disk(tmp_path / "tier", **knobs))
    _assert_same(streamed, host)


def test_checkpoints_hold_the_manifest_and_resume_exactly_from_a_copy_elsewhere(tmp_path: Path) -> None:
    """``ModelCheckpoint`` saves the small state in the ``.ckpt`` and hard-links the tier's files beside it; the
    files of a removed checkpoint go with it; a resume from copies in another folder continues with the losses and
    weights of an uninterrupted run, whatever the model's initial weights."""
    options = dict(max_steps=-1, limit_train_batches=8)
    uninterrupted = tasks.build_task("llama")
    tasks.pl.seed_everything(8, verbose=False)
    tasks.trainer(_disk(tmp_path / "tier"), max_epochs=2, **options).fit(uninterrupted, batches.data("lm"))

    first = tasks.build_task("llama")
    tasks.pl.seed_everything(8, verbose=False)
    checkpoints = tmp_path / "checkpoints"
    callback = ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=2)
    tasks.trainer(_disk(tmp_path / "tier"), max_epochs=1, enable_checkpointing=True, callbacks=[callback],
                   **options).fit(first, batches.data("lm"))
    # save_top_k=1: the step-2 checkpoint and its folder were removed when step 4's was written.
    assert sorted(os.listdir(checkpoints)) == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.disk-tier", "last.ckpt",
                                               "last.ckpt.disk-tier"]
    saved = torch.load(checkpoints / "last.ckpt", weights_only=False)
    blocks = {name for block in saved[DISK_KEY]["names"] for name in block}
    assert blocks and not blocks & set(saved["state_dict"])  # no placeholder of a block parameter in the .ckpt
    states = saved["optimizer_states"][0]["state"]
    assert len(states) == len(saved["state_dict"])  # optimizer state of the trunk only: the blocks' is in files

    elsewhere = tmp_path / "copied"
    elsewhere.mkdir()
    shutil.copy(checkpoints / "last.ckpt", elsewhere / "last.ckpt")
    shutil.copytree(checkpoints / "last.ckpt.disk-tier", elsewhere / "last.ckpt.disk-tier")
    shutil.rmtree(checkpoints)
    resumed = tasks.build_task("llama", seed=123)  # other initial weights: everything must come from the copies
    tasks.trainer(_disk(tmp_path / "other-tier"), max_epochs=2, **options).fit(
        resumed, batches.data("lm"), ckpt_path=elsewhere / "last.ckpt"
    )
    assert first.losses == uninterrupted.losses[:8]
    assert resumed.losses == uninterrupted.losses[8:]
    assert tasks.max_relative_difference(resumed, uninterrupted) == 0.0

    shutil.rmtree(elsewhere / "last.ckpt.disk-tier")
    with pytest.raises(disk.DiskTierError, match=r"last\.ckpt\.disk-tier.*missing"):
        tasks.trainer(_disk(tmp_path / "tier"), max_epochs=2, **options).fit(
            tasks.build_task("llama"), batches.data("lm"), ckpt_path=elsewhere / "last.ckpt"
        )
    # A host-tier checkpoint holds the blocks' optimizer state, which the disk tier cannot take from a .ckpt yet.
    host_checkpoint = tmp_path / "host.ckpt"
    host_trainer = tasks.trainer("superpipe", max_steps=1)
    host_trainer.fit(tasks.build_task("llama"), batches.data("lm"))
    host_trainer.save_checkpoint(host_checkpoint)
    with pytest.raises(MisconfigurationException, match="written with offload_device='cpu'"):
        tasks.trainer(_disk(tmp_path / "tier"), max_steps=2).fit(
            tasks.build_task("llama"), batches.data("lm"), ckpt_path=host_checkpoint
        )
    with pytest.raises(MisconfigurationException, match="written by SuperpipeStrategy\\(offload_device='disk'\\)"):
        tasks.trainer("superpipe", max_epochs=2, **options).fit(
            tasks.build_task("llama"), batches.data("lm"), ckpt_path=elsewhere / "last.ckpt"
        )


def test_memory_report_counts_the_tier_and_the_pool_stays_bounded(tmp_path: Path) -> None:
    task = tasks.build_task("llama")
    trainer = tasks.trainer(_disk(tmp_path / "tier", host_buffer_bytes=1 << 20), max_steps=2)
    began = time.perf_counter()
    trainer.fit(task, batches.data("lm"))
    wall = time.perf_counter() - began
    report = trainer.strategy.memory_report()
    block_bytes = sum(p.numel() * 4 for layer in task.model.model.layers for p in layer.parameters() if p.ndim >= 1)
    assert report["disk_bytes"] >= 2 * 3 * block_bytes  # two slots of every block: masters and two moments
    assert 0 < report["peak_disk_pool_host_bytes"] <= 1 << 20
    # The embedding and the untied head train from the files too (the final norm, a vector, stays in memory).
    trunk = [task.model.model.embed_tokens.weight, task.model.lm_head.weight]
    assert report["disk_trunk_parameters"] == 2
    assert report["disk_trunk_bytes"] >= 3 * sum(p.numel() * 4 for p in trunk)
    # Each micro-batch reads every block's masters twice (forward, recomputation in backward); each step reads and
    # writes every record and the spilled gradients.
    assert report["disk_bytes_read"] > 2 * 4 * block_bytes
    assert report["disk_bytes_written"] > 2 * 3 * block_bytes
    # Where the time went: the disk was busy while a read or a write was in flight, never longer than both together
    # or than the run; the steps fsynced their records and did their arithmetic.
    seconds = report["disk_seconds"]
    assert set(seconds) == set(CLOCK_COUNTERS) and all(value >= 0 for value in seconds.values())
    assert max(seconds["read_busy"], seconds["write_busy"]) <= seconds["busy"] + 1e-6
    assert seconds["busy"] <= seconds["read_busy"] + seconds["write_busy"] + 1e-6
    assert 0 < seconds["busy"] < wall and 0 < seconds["fsync"] and 0 < seconds["step_compute"] < wall


def test_validation_and_predict_stream_from_the_tier(tmp_path: Path) -> None:
    options = dict(limit_val_batches=2, val_check_interval=4)
    strategies = {"host": SuperpipeStrategy(), "disk": _disk(tmp_path / "tier")}
    trained = {}
    build, kind = tasks.EXAMPLES["llama"]
    for name, strategy in strategies.items():
        trained[name] = tasks.fit_task(lambda: tasks.Task(build, kind), strategy, batches.data(kind),
                                       batches.data(kind, batches=2), **options)
    assert trained["disk"].val_losses == trained["host"].val_losses and len(trained["disk"].val_losses) > 0
    predictions = {}
    for name, task in trained.items():
        strategy = SuperpipeStrategy() if name == "host" else _disk(tmp_path / "tier")
        predictions[name] = tasks.trainer(strategy).predict(task, batches.data("lm", batches=2))
    assert all(torch.equal(a, b) for a, b in zip(predictions["disk"], predictions["host"]))


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(offload_device="nvme"), r"offload_device='nvme'.*must be 'cpu' .* or 'disk'"),
        (dict(offload_path="/tmp"), r"offload_device='cpu', offload_path='/tmp'.*used only by the disk tier"),
        (dict(offload_device="disk"), r"offload_path=None.*needs offload_path"),
        (dict(offload_device="disk", offload_path="/nonexistent/superpipe"), r"does not exist.*mkdir -p"),
        (
            dict(offload_device="disk", offload_path="/tmp", host_buffer_bytes=-1),
            r"host_buffer_bytes must be a positive",
        ),
    ],
)
def test_bad_knobs_are_refused_with_the_users_call_and_lose_nothing(knobs: dict[str, Any], message: str) -> None:
    task = tasks.build_task("llama")
    before = {name: p.detach().clone() for name, p in task.named_parameters()}
    with pytest.raises(MisconfigurationException, match=message):
        tasks.trainer(SuperpipeStrategy(**knobs)).fit(task, batches.data("lm"))
    assert all(torch.equal(p, before[name]) for name, p in task.named_parameters())


def test_a_disk_too_small_or_unwritable_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = tasks.build_task("llama")
    before = {name: p.detach().clone() for name, p in task.named_parameters()}
    monkeypatch.setattr(space, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(
        MisconfigurationException,
        match=r"offload_device='disk'.*The disk tier needs .* bytes: two slots.*only 1 MiB \(1048576 bytes\) are free",
    ):
        tasks.trainer(_disk(tmp_path / "tier")).fit(task, batches.data("lm"))
    monkeypatch.undo()
    assert not any((tmp_path / "tier").iterdir())  # nothing written
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(MisconfigurationException, match="is not writable"):
            tasks.trainer(SuperpipeStrategy(offload_device="disk", offload_path=locked)).fit(task, batches.data("lm"))
    assert all(torch.equal(p, before[name]) for name, p in task.named_parameters())


def test_a_file_deleted_mid_run_is_named_and_the_other_blocks_come_back(tmp_path: Path) -> None:
    tier = tmp_path / "tier"

    class Delete(tasks.pl.Callback):
        def on_train_batch_end(self, trainer: tasks.pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                for path in tier.glob("block00001.*.bin"):
                    path.unlink()

    task = tasks.build_task("llama")
    with pytest.raises(disk.DiskTierError, match=r"block00001\.\d\.bin' is missing"):
        tasks.trainer(_disk(tier), callbacks=[Delete()]).fit(task, batches.data("lm"))
    layers = task.model.model.layers
    for index in (0, 2):  # the committed step of the readable blocks is back in memory
        assert all(p.stride() == torch.empty(p.shape).stride() for p in layers[index].parameters())


def test_after_a_run_the_blocks_map_their_committed_files_and_no_later_run_writes_into_them(tmp_path: Path) -> None:
    """At the end of a run the block parameters are copy-on-write views of the committed files (no host memory until
    read): a second run in the same folder, an in-place edit and removing the folder all leave the values of the
    first run, held in a state dict, as they were."""
    tier = tmp_path / "tier"
    first = tasks.fit("llama", _disk(tier))
    host = tasks.fit("llama", "superpipe")
    _assert_same(first, host)
    layer = first.model.model.layers[1]
    held = {name: tensor for name, tensor in layer.state_dict().items()}  # references, not copies
    expected = {name: tensor.clone() for name, tensor in held.items()}
    maps = Path("/proc/self/maps").read_text()
    for index in range(3):  # every block's committed file is mapped, none of its bytes copied into the heap
        assert re.search(rf"{re.escape(str(tier))}/block0000{index}\.\d\.bin$", maps, re.M)
    weight = layer.mlp.down_proj.weight
    weight.data.add_(1.0)  # copy-on-write: the file keeps the committed value
    expected["mlp.down_proj.weight"] += 1.0
    tasks.fit("llama", _disk(tier), seed=8)  # another model trained in the same folder: new files
    assert all(torch.equal(held[name], expected[name]) for name in held)
    shutil.rmtree(tier)  # unlinked files live while mapped
    assert all(torch.equal(held[name], expected[name]) for name in held)
    assert torch.equal(weight, expected["mlp.down_proj.weight"])


def test_save_safetensors_exports_the_model_during_the_run_and_after_it(tmp_path: Path) -> None:
    """The way to a file for inference: during the run (a callback at step 2) the blocks hold placeholders and
    ``save_safetensors`` writes their committed values, mapped from the tier's files: bitwise plain Lightning's
    weights at that step; after ``fit`` the parameters are views of the files, written one at a time."""
    from safetensors.torch import load_file

    from lightning_superpipe import save_safetensors

    class SaveAtStep2(tasks.pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                save_safetensors(pl_module, tmp_path / "inside.safetensors")

    plain = _StateDictAtStep2()
    tasks.fit("llama", "auto", callbacks=[plain])
    task = tasks.fit("llama", _disk(tmp_path / "tier"), callbacks=[SaveAtStep2()])
    inside = load_file(tmp_path / "inside.safetensors")
    blocks = [key for key in inside if ".layers." in key]
    assert blocks and inside.keys() == plain.cloned.keys()
    assert all(torch.equal(inside[key], plain.cloned[key]) for key in plain.cloned)
    assert any(not torch.equal(inside[key], task.state_dict()[key]) for key in blocks)  # trained on after step 2
    save_safetensors(task.model, tmp_path / "model.safetensors")
    written, state = load_file(tmp_path / "model.safetensors"), task.model.state_dict()
    assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)
    _assert_same(task, tasks.fit("llama", "superpipe"))  # the weights trained are the host tier's


def test_a_read_buffer_released_before_its_copy_ran_shows_on_the_emulated_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seeded bug: a read's pool buffer goes back (and the next read refills it) while the copy to the device
    still reads it. The plain CPU link cannot see it; the emulated one must."""
    old, new = "self._in_flight.append((event, lease))", "lease.release()"
    source = inspect.getsource(DiskReads.copy_in)
    assert source.count(old) == 1, "the mutation no longer applies: update it"
    body = "\n".join(line[4:] for line in source.replace(old, new).splitlines())
    namespace: dict[str, Any] = {}
    exec(compile(body, "<mutated copy_in>", "exec"), vars(sys.modules[DiskReads.__module__]), namespace)
    monkeypatch.setattr(DiskReads, "copy_in", namespace["copy_in"])
    with pytest.raises(OrderingViolation, match="while it was in flight"):
        strategy = _disk(tmp_path / "tier", resident_blocks=0, link=EmulatedLink(mode="lazy", seed=1))
        tasks.fit("llama", strategy, max_steps=3)


@pytest.mark.usefixtures("emulated_link")
def test_clipping_by_value_equals_the_host_tier_bitwise(tmp_path: Path) -> None:
    """``gradient_clip_algorithm="value"`` with accumulation 2: the trunk's gradients are clamped in memory, each
    block's spilled (accumulated) gradients as the block is stepped from disk."""
    options = dict(gradient_clip_algorithm="value", gradient_clip_val=0.02)
    host = tasks.fit("llama", "superpipe", **options)
    unclipped = tasks.fit("llama", "superpipe", gradient_clip_val=None)
    assert tasks.max_relative_difference(host, unclipped) > 1e-4  # the clamp changed the steps
    for knob in (False, "auto"):  # after backward; speculative, each block clamped as it steps (always committed)
        streamed = tasks.fit("llama", _disk(tmp_path / f"tier-{knob}", overlap_optimizer=knob), **options)
        _assert_same(streamed, host)
        report = streamed.trainer.strategy.memory_report()
        assert report["overlapped_block_steps"] == (0 if knob is False else 3 * 10)
        assert report["speculative_steps_committed"] == (0 if knob is False else 10)


class _Manual(tasks.Task):
    """Manual optimization as users write it, one way per ``loop``:

    * ``"halves"``: two backwards a batch (half a batch each), ``self.clip_gradients`` by norm, the step, the LR
      schedule stepped by hand, ``zero_grad`` after the step;
    * ``"accumulate"``: a backward every batch and a step every second one, zeroed by ``self.zero_grad()`` (the
      module's), through ``step(closure=...)``;
    * ``"skip"``: on every third batch the gradients are zeroed instead of stepped (a loss spike skipped), and
      before each step one layer's MLP gradients are zeroed (part of a block: those parameters stay unstepped);
    * ``"no-zero-grad"``, ``"step-twice"``: what the disk tier refuses (no ``zero_grad`` after a step).
    """

    def __init__(self, *args: Any, loop: str = "halves", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.loop = loop

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.loop == "halves":
            tasks.two_backwards_and_a_step(self, batch)
        elif self.loop == "accumulate":

            def backward() -> None:
                loss = self(batch)
                self.losses.append(loss.item())
                self.manual_backward(loss / 2)

            if batch_idx % 2 == 0:
                backward()
                return
            optimizer.step(closure=backward)
            self.zero_grad()
        elif self.loop == "skip":
            loss = self(batch)
            self.losses.append(loss.item())
            self.manual_backward(loss)
            if batch_idx % 3 == 2:
                optimizer.zero_grad()
                return
            self.model.model.layers[1].mlp.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
        else:
            loss = self(batch)
            self.losses.append(loss.item())
            self.manual_backward(loss)
            optimizer.step()
            if self.loop == "step-twice":
                optimizer.step()


@pytest.mark.usefixtures("emulated_link")
def test_manual_optimization_equals_plain_lightning_bitwise(tmp_path: Path) -> None:
    """Two backwards a step, clipping by norm through ``self.clip_gradients``, an LR schedule stepped by hand: the
    losses and weights of plain Lightning (every block's gradients spilled, then stepped from disk)."""
    options = dict(max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None)
    build, kind = tasks.EXAMPLES["llama"]
    plain, streamed = (
        tasks.fit_task(lambda: _Manual(build, kind), strategy, batches.data(kind), **options)
        for strategy in ("auto", _disk(tmp_path / "tier"))
    )
    assert len(plain.losses) == 8
    _assert_same(streamed, plain)
    assert tasks.max_relative_difference(plain, tasks.build_task("llama")) > 1e-3  # they trained


def test_manual_optimization_under_a_gradient_scaler_equals_the_host_tier_bitwise(tmp_path: Path) -> None:
    """``16-mixed`` with a scale so large that the first steps overflow: the scaler skips them (the tier drops the
    blocks' spilled gradients, the user's ``zero_grad`` follows) and lowers the scale, as on the host tier."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(strategy: Any) -> tasks.Task:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        options = dict(max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None,
                       plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        build, kind = tasks.EXAMPLES["llama"]
        task = tasks.fit_task(lambda: _Manual(build, kind), strategy, batches.data(kind), **options)
        assert scaler.get_scale() < 2.0**24  # a step was skipped
        return task

    _assert_same(run(_disk(tmp_path / "tier")), run("superpipe"))


def test_base_finetuning_unfreezing_the_blocks_mid_run_equals_plain_lightning(tmp_path: Path) -> None:
    """The blocks frozen first, then unfrozen into a new param group of the optimizer at epoch 1: the tier steps
    them from then on, and sees the optimizer's zero_grad cover them."""
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=4, accumulate_grad_batches=1)
    plain, streamed = (
        tasks.fit_task(lambda: tasks.HeadFirstTask(tasks.llama, "lm"), strategy, batches.data("lm"),
                        callbacks=[tasks.UnfreezeLayersAtEpochOne()], **options)
        for strategy in ("auto", _disk(tmp_path / "tier"))
    )
    _assert_same(streamed, plain)
    tasks.pl.seed_everything(7, verbose=False)
    initial = tasks.HeadFirstTask(tasks.llama, "lm")
    assert tasks.max_relative_difference(streamed.model.model.layers, initial.model.model.layers) > 1e-3


class _StateDictAtStep2(tasks.pl.Callback):
    """Takes ``state_dict()`` after the second step (and a clone of it); with ``load``, then loads one whose
    embedding is zeroed."""

    def __init__(self, load: bool = False) -> None:
        self.load = load
        self.taken: dict[str, torch.Tensor] = {}
        self.cloned: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, pl_module: tasks.pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2 and not self.taken:
            self.taken = pl_module.state_dict()
            self.cloned = {key: value.clone() for key, value in self.taken.items()}
            if self.load:
                pl_module.load_state_dict({**self.cloned, "model.model.embed_tokens.weight": torch.zeros(96, 32)})


def test_state_dict_during_the_run_holds_the_weights_of_that_step(tmp_path: Path) -> None:
    """The block parameters hold placeholders during the run; ``state_dict()`` gives their committed values, mapped
    from the files, bitwise plain Lightning's at that step, and they stay those values as training goes on (the
    store writes those slots into new files)."""
    plain, streamed = _StateDictAtStep2(), _StateDictAtStep2()
    tasks.fit("llama", "auto", callbacks=[plain])
    tasks.fit("llama", _disk(tmp_path / "tier"), callbacks=[streamed])
    blocks = [key for key in plain.cloned if ".layers." in key]
    assert blocks and plain.cloned.keys() == streamed.cloned.keys()
    assert all(torch.equal(streamed.cloned[key], plain.cloned[key]) for key in plain.cloned)
    assert all(torch.equal(streamed.taken[key], streamed.cloned[key]) for key in blocks)  # not rewritten under it
    assert any(not torch.equal(plain.taken[key], plain.cloned[key]) for key in blocks)  # (plain's alias the params)


def test_a_block_parameter_read_directly_during_the_run_is_nan_not_plausible_zeros(tmp_path: Path) -> None:
    """A callback reading a block parameter's values itself gets the placeholder's NaN (its values are in the files;
    ``state_dict()`` gives them), as for the trunk's matrices in the files (the embedding); the trunk's vectors, in
    host memory, their values."""
    class ReadWeights(tasks.pl.Callback):
        block = trunk = embedding = torch.empty(0)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.block = pl_module.model.model.layers[0].mlp.down_proj.weight.detach().clone()
            self.trunk = pl_module.model.model.norm.weight.detach().clone()
            self.embedding = pl_module.model.model.embed_tokens.weight.detach().clone()

    read = ReadWeights()
    tasks.fit("llama", _disk(tmp_path / "tier"), callbacks=[read], max_steps=2)
    assert read.block.numel() and bool(read.block.isnan().all())
    assert bool(read.trunk.isfinite().all()) and bool(read.embedding.isnan().all())


def test_load_state_dict_during_the_run_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    callback = _StateDictAtStep2(load=True)
    build, kind = tasks.EXAMPLES["llama"]
    tasks.pl.seed_everything(7, verbose=False)
    task = tasks.Task(build, kind)
    message = (r"load_state_dict during the run would write 'model\.model\.[\w.]+', a parameter"
               r" whose values are in the tier's files .* Nothing was loaded\.$")
    with pytest.raises(RuntimeError, match=message):
        tasks.trainer(_disk(tmp_path / "tier"), callbacks=[callback]).fit(task, batches.data(kind))
    assert torch.equal(task.model.model.embed_tokens.weight, callback.cloned["model.model.embed_tokens.weight"])


@pytest.mark.parametrize(("precision", "optimizer"), [("bf16-true", "adamw"), ("16-true", "sgd")])
def test_true_half_precision_trains_as_plain_lightning_on_both_tiers(
    tmp_path: Path, precision: str, optimizer: str
) -> None:
    """``precision="bf16-true"``/``"16-true"``: the model, its masters on disk included, in half precision (clipping
    by norm, accumulation 2). SGD for fp16: AdamW's eps underflows there and plain Lightning's losses turn NaN."""
    options = dict(precision=precision, optimizer=optimizer)
    plain = tasks.fit("llama", "auto", **options)
    assert next(plain.parameters()).dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float16)
    assert all(np.isfinite(plain.losses))
    for strategy in ("superpipe", _disk(tmp_path / "tier")):
        _assert_same(tasks.fit("llama", strategy, **options), plain)


def test_an_accumulation_schedule_that_changes_between_epochs_equals_plain_lightning(tmp_path: Path) -> None:
    """``GradientAccumulationScheduler``: one micro-batch a step (each block stepped during backward), then two (the
    first spilled and added) from epoch 1."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    options = dict(accumulate_grad_batches=1, max_steps=-1, max_epochs=2, limit_train_batches=6,
                   gradient_clip_val=None)
    plain, streamed = (
        tasks.fit("llama", strategy, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})], **options)
        for strategy in ("auto", _disk(tmp_path / "tier"))
    )
    assert len(plain.losses) == 12
    _assert_same(streamed, plain)
    report = streamed.trainer.strategy.memory_report()
    assert report["overlapped_block_steps"] == 3 * (6 + 3)  # 3 blocks: 6 steps in epoch 0, 3 in epoch 1


@pytest.mark.parametrize("loop", ["accumulate", "skip"])
def test_manual_zero_grad_where_users_call_it_equals_plain_lightning_bitwise(tmp_path: Path, loop: str) -> None:
    """The tier learns of ``zero_grad`` from the optimizer, Lightning's wrapper of it and the modules: spilled
    gradients accumulate across batches until a step, and are dropped (whole blocks, or part of one) when zeroed."""
    options = dict(max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None)
    build, kind = tasks.EXAMPLES["llama"]
    plain, streamed = (
        tasks.fit_task(lambda: _Manual(build, kind, loop=loop), strategy, batches.data(kind), **options)
        for strategy in ("auto", _disk(tmp_path / "tier"))
    )
    _assert_same(streamed, plain)
    if loop == "skip":  # the MLP zeroed before each step never moved, the rest did
        mlp = {n for n, _ in plain.named_parameters() if ".layers.1.mlp." in n}
        initial = tasks.build_task("llama")
        before = dict(initial.named_parameters())
        after = dict(streamed.named_parameters())
        assert mlp and all(torch.equal(after[n], before[n]) for n in mlp)
        assert not torch.equal(after["model.model.layers.1.self_attn.q_proj.weight"],
                               before["model.model.layers.1.self_attn.q_proj.weight"])
    vars_left = [m for m in streamed.modules() if "zero_grad" in vars(m)]
    assert vars_left == [] and "zero_grad" not in vars(streamed.trainer.optimizers[0])  # the hooks are gone


@pytest.mark.parametrize(("loop", "message"), [
    ("no-zero-grad", r"backward added to its gradient, but no zero_grad came since the last optimizer step consumed"
                     r" the gradient of 'model\.model\.layers\.\d\.[\w.]+'.* Call optimizer\.zero_grad\(\) between"),
    ("step-twice", r"the optimizer is stepping it again, but no zero_grad came since the last optimizer step"),
])
def test_manual_steps_over_consumed_gradients_are_refused(tmp_path: Path, loop: str, message: str) -> None:
    """The host tier would add to (or step again with) gradients the tier no longer has: one clear error, and the
    files stay at the last committed step."""
    build, kind = tasks.EXAMPLES["llama"]
    tasks.pl.seed_everything(7, verbose=False)
    task = _Manual(build, kind, loop=loop)
    tier = tmp_path / "tier"
    with pytest.raises(RuntimeError, match=message):
        tasks.trainer(_disk(tier), max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None).fit(
            task, batches.data(kind))
    assert len(task.losses) == (2 if loop == "no-zero-grad" else 1)
    assert json.loads((tier / "manifest.json").read_text())["step"] == 1


class _OwnSGD(torch.optim.SGD):
    """A user's optimizer: its ``step`` may look at every parameter, so the tier cannot step it block by block."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


class _OwnOptimizer(tasks.Task):
    def configure_optimizers(self) -> Any:
        return _OwnSGD(self.parameters(), lr=0.1)


class _Fused(tasks.Task):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)


class _StepHook(tasks.Task):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1)
        optimizer.register_step_post_hook(lambda *args: None)
        return optimizer


def _refusal_cases() -> list[Any]:
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
    from lightning.pytorch.plugins.precision import MixedPrecision

    call = r"SuperpipeStrategy\(offload_device='disk', offload_path='[^']+', host_buffer_bytes=None\): "
    return [
        pytest.param(tasks.Task, dict(callbacks=[EMAWeightAveraging()]),
                     call + r"the callback EMAWeightAveraging is not supported: .* files .*"
                     r" with offload_device='cpu'\.$",
                     id="ema"),
        pytest.param(tasks.Task, dict(callbacks=[StochasticWeightAveraging(swa_lrs=1e-3)]),
                     call + r"the callback StochasticWeightAveraging is not supported", id="swa"),
        pytest.param(_OwnOptimizer, {}, call + r"_OwnSGD is not known to update each parameter on its own.*"
                     r"\(supported: SGD, Adam, AdamW, Adadelta, .*, Rprop, transformers\.optimization\.Adafactor,"
                     r" and subclasses of them that override only __init__; if it updates each parameter from that"
                     r" parameter's gradient and state alone, declare it with"
                     r" lightning_superpipe\.register_per_parameter_optimizer\(_OwnSGD\)\)", id="own-optimizer"),
        pytest.param(_StepHook, {}, call + "the optimizer has step hooks", id="step-hooks"),
        pytest.param(_Fused, dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]),
                     call + r"AdamW unscales the gradients inside its step under a gradient scaler",
                     id="16-mixed-fused"),
    ]


@pytest.mark.parametrize(("task_class", "options", "message"), _refusal_cases())
def test_what_the_tier_cannot_train_is_refused_with_the_users_call_before_training(
    tmp_path: Path, task_class: type, options: dict[str, Any], message: str
) -> None:
    """Each refusal is one MisconfigurationException quoting the strategy's call and saying what to do, raised
    before any file is written or any weight changes."""
    build, kind = tasks.EXAMPLES["llama"]
    tasks.pl.seed_everything(7, verbose=False)
    task = task_class(build, kind)
    before = {name: p.detach().clone() for name, p in task.named_parameters()}
    tier = tmp_path / "tier"
    with pytest.raises(MisconfigurationException, match=message):
        tasks.trainer(_disk(tier), **options).fit(task, batches.data(kind))
    assert task.losses == []  # not one training step
    assert not list(tier.iterdir())  # not one file
    assert all(torch.equal(p, before[name]) for name, p in task.named_parameters())


def test_a_step_hook_for_every_optimizer_is_refused_too(tmp_path: Path) -> None:
    """``register_optimizer_step_pre_hook`` (profilers use it) would run once per block as well."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        with pytest.raises(MisconfigurationException, match="the optimizer has step hooks, which would run once per"):
            tasks.fit("llama", _disk(tmp_path / "tier"), max_steps=1)
    finally:
        handle.remove()


def test_hooks_between_backward_and_the_step_are_told_block_gradients_are_not_there(tmp_path: Path) -> None:
    """An overridden ``on_before_optimizer_step`` (e.g. logging gradient norms) gets one warning naming it; it sees
    the trunk's vectors' gradients (the final norm's) and ``None`` for the blocks' and the trunk's matrices' (the
    head's, spilled to the files too), and the steps, pipelined, equal the host tier's. Without such a hook, no
    warning."""
    seen: list[tuple[int, int]] = []

    class Logging(tasks.Task):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            layers = list(self.model.model.layers.parameters())
            head, norm = self.model.lm_head.weight, self.model.model.norm.weight
            seen.append((sum(p.grad is not None for p in layers), int(head.grad is not None),
                         int(norm.grad is not None)))

    build, kind = tasks.EXAMPLES["llama"]
    strategy = _disk(tmp_path / "tier")
    with pytest.warns(UserWarning, match=r"offload_device='disk'.*Logging\.on_before_optimizer_step will see"):
        streamed = tasks.fit_task(lambda: Logging(build, kind), strategy, batches.data(kind), max_steps=2)
    assert seen == [(0, 0, 1), (0, 0, 1)]
    # The hook may rewrite gradients after backward: the steps are pipelined, from the spilled gradients.
    assert strategy.memory_report()["optimizer_step_modes"]["pipelined"] == 2
    _assert_same(streamed, tasks.fit_task(lambda: Logging(build, kind), "superpipe", batches.data(kind), max_steps=2))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*will see `p.grad is None`")
        tasks.trainer(_disk(tmp_path / "tier"), max_steps=1).fit(tasks.build_task("llama"), batches.data("lm"))


def test_init_module_empty_init_leaves_a_transformers_model_untouched_and_its_weights_tied() -> None:
    """``Trainer.init_module(empty_init=True)``, Lightning's way to build a model a checkpoint will fill (as a resume
    of the disk tier does, block by block from its files): nothing writes a ``transformers`` model's weights (so
    their pages are never touched), ``deterministic=True`` fills none with NaN, and ``post_init`` still ties them.
    Lightning's own mode lets transformers 5's init functions through."""
    from lightning.fabric.utilities.init import _EmptyInit
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)

    class Writes(TorchDispatchMode):
        """Bytes that in-place operators (``normal_``, ``uniform_``, ``fill_``, ...) write."""

        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            schema = func._schema
            if (
                schema.arguments
                and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write
            ):
                self.bytes += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    def written(context: Any) -> tuple[float, Any]:
        with Writes() as writes, context:
            model = LlamaForCausalLM(config)
        return writes.bytes / sum(p.numel() * p.element_size() for p in model.parameters()), model

    trainer = tasks.trainer(SuperpipeStrategy())  # deterministic=True
    assert torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    untouched, model = written(trainer.init_module(empty_init=True))
    assert untouched < 0.01
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.isnan(model.model.layers[0].mlp.up_proj.weight).all()  # not filled with NaN
    assert torch.utils.deterministic.fill_uninitialized_memory  # put back
    touched, model = written(_EmptyInit(enabled=True))
    assert touched > 0.9  # the count sees the init functions' writes
    assert torch.isnan(model.model.layers[0].mlp.up_proj.weight).sum() == 0  # normal_ wrote over the NaN fill

class _BuiltInConfigureModel(tasks.Task):
    """Builds its model in ``configure_model``, as Lightning advises for a model too large to build eagerly."""

    def __init__(self, family: str) -> None:
        build, kind = tasks.EXAMPLES[family]
        super().__init__(lambda: None, kind)
        self._build = build

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()


def _fit_configure_model(family: str, strategy: Any, **overrides: Any) -> _BuiltInConfigureModel:
    task = _BuiltInConfigureModel(family)
    tasks.pl.seed_everything(8, verbose=False)  # configure_model builds under the fit's seed
    tasks.trainer(strategy, **overrides).fit(task, batches.data(task.kind))
    return task


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_a_model_built_in_configure_model_reaches_the_files_block_by_block_with_eager_values(
    tmp_path: Path, family: str
) -> None:
    """Under the disk tier the init calls of ``configure_model`` are recorded and each block's run into fresh tensors
    as it is written (the parameters' own memory is never written): the run equals the host tier's, which builds
    the model eagerly, bitwise, and the random stream after the build (dropout) is the same."""
    with tasks.fresh_initial_values() as fresh:
        host = _fit_configure_model(family, "superpipe")
        assert not fresh  # the host tier builds eagerly
        streamed = _fit_configure_model(family, _disk(tmp_path / "tier"))
    _assert_same(streamed, host)
    manifest = json.loads((tmp_path / "tier" / disk.MANIFEST).read_text())
    # Every block parameter's values made apart from it (the trunk's matrices in the files follow, after the blocks).
    blocks = {name for block in manifest["names"] for name in block if re.search(r"\.(layers|h)\.\d", name)}
    assert blocks and {name: fresh.get(name) for name in blocks} == dict.fromkeys(blocks, True)
    assert tasks.max_relative_difference(streamed, _BuiltInConfigureModel(family)) > 1e-3  # it trained


def test_a_resume_into_a_model_built_in_configure_model_keeps_the_checkpoints_values(tmp_path: Path) -> None:
    """The checkpoint's trunk is loaded before the strategy's setup: those tensors must not be initialized after it,
    and the blocks come from the checkpoint's files."""
    options = dict(max_steps=-1, limit_train_batches=8)
    uninterrupted = _fit_configure_model("llama", _disk(tmp_path / "tier"), max_epochs=2, **options)
    checkpoints = tmp_path / "checkpoints"
    callback = ModelCheckpoint(dirpath=checkpoints, save_last=True)
    _fit_configure_model("llama", _disk(tmp_path / "tier"), max_epochs=1, enable_checkpointing=True,
                         callbacks=[callback], **options)
    resumed = _BuiltInConfigureModel("llama")
    tasks.pl.seed_everything(123, verbose=False)  # other initial weights: everything must come from the checkpoint
    tasks.trainer(_disk(tmp_path / "tier"), max_epochs=2, **options).fit(
        resumed, batches.data("lm"), ckpt_path=checkpoints / "last.ckpt"
    )
    assert resumed.losses == uninterrupted.losses[8:]
    assert tasks.max_relative_difference(resumed, uninterrupted) == 0.0


class _LoadedInConfigureModel(tasks.Task):
    """Builds a model from a saved folder's config in ``configure_model`` and gives it the folder's weights."""

    def __init__(self, folder: Path, through_from_pretrained: bool = False) -> None:
        super().__init__(lambda: None, "lm")
        self.folder = folder
        self.through_from_pretrained = through_from_pretrained

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_superpipe import load_safetensors

        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.folder))
            if self.through_from_pretrained:  # the reference: transformers' loading, the same draws before it
                self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(self.folder).state_dict())
            else:
                load_safetensors(self.model, self.folder)


def test_a_saved_model_loaded_in_configure_model_trains_as_from_pretrained(tmp_path: Path) -> None:
    """``load_safetensors`` in ``configure_model`` under the disk tier reads each block's tensors as the block is
    written: the run equals the host tier's with the same weights from ``from_pretrained``, bitwise."""
    tasks.pl.seed_everything(3, verbose=False)
    tasks.llama().save_pretrained(tmp_path / "saved")
    pretrained = _LoadedInConfigureModel(tmp_path / "saved", through_from_pretrained=True)
    tasks.pl.seed_everything(8, verbose=False)
    tasks.trainer("superpipe").fit(pretrained, batches.data("lm"))
    loaded = _LoadedInConfigureModel(tmp_path / "saved")
    tasks.pl.seed_everything(8, verbose=False)
    tasks.trainer(_disk(tmp_path / "tier")).fit(loaded, batches.data("lm"))
    _assert_same(loaded, pretrained)


def test_a_set_up_that_fails_leaves_a_model_built_in_configure_model_initialized(tmp_path: Path) -> None:
    """The tier refuses its buffer bound after the blocks' files are written: the model the user keeps must hold
    its eager values, not the untouched memory the deferred init left in its parameters."""
    failed = _BuiltInConfigureModel("llama")
    tasks.pl.seed_everything(8, verbose=False)
    with pytest.raises(MisconfigurationException, match="host_buffer_bytes=4096"):
        tasks.trainer(_disk(tmp_path / "tier", host_buffer_bytes=4096)).fit(failed, batches.data("lm"))
    eager = _BuiltInConfigureModel("llama")
    tasks.pl.seed_everything(8, verbose=False)
    eager.configure_model()
    assert [n for n, _ in failed.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(failed.parameters(), eager.parameters()))


def _wide_vocabulary_llama() -> torch.nn.Module:
    """tests.tasks' Llama with 2 layers and a vocabulary of 1024: the embedding's and the head's records (32k
    parameters each) outgrow a layer's (9k)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=batches.SEQ, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.mark.usefixtures("emulated_link")
def test_trunk_records_larger_than_a_block_go_in_pieces_of_the_default_pool(tmp_path: Path) -> None:
    """The default pool's buffers are sized by the largest block's record, not by a larger vocabulary's embedding
    and head (a Llama-3 vocabulary's would make every buffer 2.4x a layer's): those go in pieces, bitwise the host
    tier, clipped."""
    seen: dict[str, Any] = {}

    class Sizes(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            store = trainer.strategy._engine.home_kind.store
            seen["records"] = [(len(params), record.file_bytes) for params, record in zip(store.params, store.records)]
            seen["buffer"] = store.pool.buffer_bytes

    def fit(strategy: Any, callbacks: list[pl.Callback]) -> tasks.Task:
        return tasks.fit_task(lambda: tasks.Task(_wide_vocabulary_llama, "lm"), strategy, batches.data("lm"),
                              max_steps=4, gradient_clip_val=0.5, callbacks=callbacks)

    host = fit("superpipe", [])
    streamed = fit(_disk(tmp_path / "tier"), [Sizes()])
    _assert_same(streamed, host)
    blocks, trunk = seen["records"][:2], seen["records"][2:]
    assert [count for count, _ in trunk] == [1, 1]  # the embedding and the head, each a record in the files
    assert all(nbytes > seen["buffer"] for _, nbytes in trunk)
    assert all(nbytes <= seen["buffer"] for _, nbytes in blocks)
