"""The optimizer step's modes in training runs: the speculative step (during backward, then committed, redone or
discarded) and the pipelined one (launched after the pre-step work, finished while the next forward runs) give plain
Lightning's losses and weights bit for bit in fp32, whatever happens between backward and the step; the memory
report's counts show which mode ran and what the speculation decided.

Each test runs on the plain CPU link and on the emulated asynchronous links (the ``emulated_link`` fixture), whose
happens-before checker sees a block copied to the device before its pending step wrote it. The rules of the choice
itself, without training, are in tests/test_step_mode_choice.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.stepping.pipelined import PipelinedStep
from tests import batches, tasks

pytestmark = pytest.mark.usefixtures("emulated_link")

KNOBS = ("speculative", "pipelined")
MODES = ("overlapped", "speculative", "pipelined", "serial")
STEPS = 6

#: Clipping by norm on the quick Llama of :mod:`tests.tasks` over ``STEPS`` steps: its global norm (0.82 to 0.86) is
#: always above 1e-4 and never near 1e9; 0.84 is below it on the third and fourth steps only (found by running it).
CLIPS = {"every step": 1e-4, "no step": 1e9, "some steps": 0.84}

_plain_runs: dict[str, Any] = {}


def _plain(key: str, run: Callable[[], Any]) -> Any:
    """Plain Lightning's run, once per ``key`` for the whole module (it does not depend on the link)."""
    if key not in _plain_runs:
        _plain_runs[key] = run()
    return _plain_runs[key]


def _assert_same(streamed: tasks.Task, plain: tasks.Task) -> None:
    """Bitwise plain's: every loss, every weight and buffer."""
    assert len(streamed.losses) == len(plain.losses) > 0
    assert streamed.losses == plain.losses
    a, b = streamed.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _modes(strategy: SuperpipeStrategy) -> dict[str, int]:
    return strategy.memory_report()["optimizer_step_modes"]


def _only(mode: str, steps: int) -> dict[str, int]:
    return {m: steps if m == mode else 0 for m in MODES}


# ----------------------------------------------------------------------------------------------- clipping by norm


@pytest.mark.parametrize(
    ("fires", "knob"),
    [(fires, knob) for fires in CLIPS for knob in KNOBS] + [("no step", "auto"), ("some steps", "auto")],
)
def test_clipping_by_norm_on_every_step_on_none_or_on_some_is_plain_lightning_bitwise(fires: str, knob: str) -> None:
    """Accumulation over 2 micro-batches and the LR warm-up stepped every step (the defaults of
    :func:`tasks.trainer`), with two parameter groups. A speculative step is redone exactly where clipping
    multiplies the gradients by less than 1, and committed elsewhere; "auto" speculates until clipping fired on
    more than a quarter of the recent steps, then pipelines."""
    clip = dict(gradient_clip_val=CLIPS[fires], max_steps=STEPS)
    plain = _plain(f"llama clip {fires}", lambda: tasks.fit("llama", "auto", **clip))
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    streamed = tasks.fit("llama", strategy, **clip)
    _assert_same(streamed, plain)
    report = strategy.memory_report()
    modes, redone, committed = (
        report["optimizer_step_modes"], report["speculative_steps_redone"], report["speculative_steps_committed"]
    )
    assert report["speculative_steps_discarded"] == 0
    assert redone + committed == modes["speculative"]
    if knob == "pipelined":
        assert modes == _only("pipelined", STEPS)
        assert report["speculation_kept_peak_bytes"] == 0
    elif knob == "speculative":
        assert modes == _only("speculative", STEPS)
        assert report["speculation_kept_peak_bytes"] > 0
        expected = {"every step": redone == STEPS, "no step": redone == 0, "some steps": 0 < redone < STEPS}
        assert expected[fires], (fires, redone)
    elif fires == "no step":
        assert modes == _only("speculative", STEPS) and committed == STEPS
    else:  # two commits, a redo (a third of the recent steps changed), then pipelined
        assert committed >= 1 and redone >= 1 and modes["pipelined"] >= 1
        assert modes["speculative"] + modes["pipelined"] == STEPS


def test_auto_moves_from_speculating_to_pipelining_when_clipping_keeps_firing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Clipping that fires on every step: "auto" speculates first, the redo makes it pipeline the rest, each said
    once with its reason; still plain's bits."""
    clip = dict(gradient_clip_val=CLIPS["every step"], max_steps=STEPS)
    plain = _plain("llama clip every step", lambda: tasks.fit("llama", "auto", **clip))
    strategy = SuperpipeStrategy()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        streamed = tasks.fit("llama", strategy, **clip)
    _assert_same(streamed, plain)
    report = strategy.memory_report()
    modes = report["optimizer_step_modes"]
    assert modes["speculative"] > 0 and modes["pipelined"] > 0 and modes["speculative"] + modes["pipelined"] == STEPS
    assert report["speculative_steps_redone"] == modes["speculative"]
    said = [r.getMessage() for r in caplog.records if "SuperpipeStrategy steps the optimizer" in r.getMessage()]
    assert said == [
        "SuperpipeStrategy steps the optimizer speculatively during backward: clipping by norm or the gradient scaler"
        " decide after backward.",
        "SuperpipeStrategy steps the optimizer pipelined into the next forward: clipping or the scaler changed the"
        " gradients of more than a quarter of the recent steps.",
    ]


# ---------------------------------------------------------------------------------------------- clipping by value


@pytest.mark.parametrize("knob", [*KNOBS, "auto"])
def test_clipping_by_value_clamps_each_block_in_backward_and_is_plain_lightning_bitwise(knob: str) -> None:
    """Clamping is elementwise: each block's gradients are clamped before its step during backward (the overlapped
    mode, also when the knob asks to speculate, which would decide nothing), and the step after backward has nothing
    left to clamp."""
    clip = dict(gradient_clip_val=1e-3, gradient_clip_algorithm="value", max_steps=4)
    plain = _plain("llama clip value", lambda: tasks.fit("llama", "auto", **clip))
    unclipped = _plain("llama no clipping", lambda: tasks.fit("llama", "auto", gradient_clip_val=None, max_steps=4))
    assert tasks.max_relative_difference(plain, unclipped) > 1e-3  # the clamp changes the run
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    streamed = tasks.fit("llama", strategy, **clip)
    _assert_same(streamed, plain)
    report = strategy.memory_report()
    if knob == "pipelined":
        assert report["optimizer_step_modes"] == _only("pipelined", 4)
    else:
        assert report["optimizer_step_modes"] == _only("overlapped", 4)
        assert report["overlapped_block_steps"] == 4 * report["num_blocks"]


class _HalvedNormClipping(Precision):
    """A precision plugin with its own clipping by norm: to half the norm asked for."""

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        super().clip_grad_by_norm(optimizer, clip_val / 2)


class _HalvedValueClipping(Precision):
    """A precision plugin with its own clipping by value: to half the value asked for."""

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        super().clip_grad_by_value(optimizer, clip_val / 2)


@pytest.mark.parametrize("knob", ["auto", False])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_precision_plugins_own_clipping_runs_and_pipelines_the_step(algorithm: str, knob: Any) -> None:
    """The plugin's clipping runs as it is (it was replaced by Lightning's, in every mode), after backward: "auto"
    pipelines the step, ``False`` steps after backward."""
    plugin = {"norm": _HalvedNormClipping, "value": _HalvedValueClipping}[algorithm]
    clip = dict(gradient_clip_val=1e-3 if algorithm == "value" else 0.5, gradient_clip_algorithm=algorithm,
                max_steps=4)
    plain = _plain(f"llama halved {algorithm}", lambda: tasks.fit("llama", "auto", plugins=[plugin()], **clip))
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    _assert_same(tasks.fit("llama", strategy, plugins=[plugin()], **clip), plain)
    assert _modes(strategy) == _only("pipelined" if knob == "auto" else "serial", 4)


# ------------------------------------------------------------------------------------------ the gradient scaler


class _OverflowsOnSomeBatches(tasks.Task):
    """Its loss is multiplied by infinity on the micro-batches :attr:`OVERFLOW` names (the last of the third step,
    whose backward is the speculative one; the first of the fifth): the gradient scaler finds infinities and skips
    those steps. The losses recorded are the finite ones."""

    OVERFLOW = (5, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.losses.append(loss.item())
        return loss * float("inf") if batch_idx in self.OVERFLOW else loss


@pytest.mark.parametrize(
    ("knob", "optimizer", "clip"),
    [
        ("speculative", "adamw", 0.5), ("pipelined", "adamw", 0.5), ("auto", "adamw", None),
        ("auto", "adamw-fused", None),
    ],
)
def test_a_step_the_gradient_scaler_skips_is_discarded_and_plain_lightning_bitwise(
    knob: str, optimizer: str, clip: Any
) -> None:
    """``16-mixed`` with its ``GradScaler`` (set up by hand: Lightning turns ``precision="16-mixed"`` on the CPU into
    ``bf16-mixed``): the blocks are unscaled and stepped speculatively during backward, and the steps whose gradients
    hold infinities are discarded (the kept masters and state come back). With fused AdamW, which unscales inside
    its step, "auto" pipelines, passing the scaler's ``grad_scale`` and ``found_inf``."""
    build, kind = tasks.EXAMPLES["llama"]

    def run(strategy: Any) -> tuple[tasks.Task, torch.amp.GradScaler]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        make = lambda: _OverflowsOnSomeBatches(build, kind, optimizer=optimizer)  # noqa: E731
        task = tasks.fit_task(make, strategy, batches.data(kind), gradient_clip_val=clip, max_steps=STEPS,
                              plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        return task, scaler

    plain, plain_scaler = _plain(f"llama 16-mixed {optimizer} {clip}", lambda: run("auto"))
    assert plain_scaler.get_scale() == 2.0**10 / 4  # Lightning skipped both steps (and no other)
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    streamed, scaler = run(strategy)
    _assert_same(streamed, plain)
    assert scaler.get_scale() == plain_scaler.get_scale()
    report = strategy.memory_report()
    if knob == "pipelined" or optimizer == "adamw-fused":
        assert report["optimizer_step_modes"] == _only("pipelined", STEPS)
        assert report["speculative_steps_discarded"] == 0
        return
    discarded, modes = report["speculative_steps_discarded"], report["optimizer_step_modes"]
    decided = report["speculative_steps_committed"] + report["speculative_steps_redone"]
    assert decided + discarded == modes["speculative"]
    if knob == "speculative":
        assert modes == _only("speculative", STEPS) and discarded == 2
    else:  # auto: the first skip is speculative (nothing changed before it); it makes the next step pipelined
        assert discarded >= 1 and modes["pipelined"] >= 1 and modes["speculative"] + modes["pipelined"] == STEPS


# ------------------------------------------------------------------------------------ accumulation and schedules


class _DecayingTask(tasks.Task):
    """AdamW whose learning rate changes on every step of the run (``lr / (1 + step)``), stepped by Lightning."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize(("accumulate", "steps", "clip"), [(1, 6, 1.2), (3, 4, 0.75)])
def test_accumulation_and_a_schedule_stepped_every_step_are_plain_lightning_bitwise(
    accumulate: int, steps: int, clip: float, knob: str
) -> None:
    """Only the last micro-batch's backward of each step speculates; a pipelined step runs with the learning rate of
    its launch, though the scheduler steps before it is done. The clip values fire on some steps only (one of four
    with 3 micro-batches, three of six with 1; found by running them)."""
    build, kind = tasks.EXAMPLES["llama"]
    options = dict(accumulate_grad_batches=accumulate, max_steps=steps, gradient_clip_val=clip)
    make = lambda: _DecayingTask(build, kind)  # noqa: E731
    plain = _plain(f"decaying {accumulate}", lambda: tasks.fit_task(make, "auto", batches.data(kind), **options))
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    _assert_same(tasks.fit_task(make, strategy, batches.data(kind), **options), plain)
    report = strategy.memory_report()
    assert report["optimizer_step_modes"] == _only(knob, steps)
    if knob == "speculative":
        assert 0 < report["speculative_steps_redone"] < steps


# ------------------------------------------------------------------------------------------------------ callbacks


@pytest.mark.parametrize("knob", KNOBS)
def test_ema_weight_averaging_averages_the_weights_each_step_produced(knob: str) -> None:
    """``EMAWeightAveraging`` reads the weights after each step (``on_train_batch_end``): a pipelined step is
    waited for first; at the end the model holds the average, plain's bit for bit."""

    def run(strategy: Any) -> tasks.Task:
        return tasks.fit("llama", strategy, callbacks=[EMAWeightAveraging(decay=0.5)], max_steps=4)

    plain = _plain("llama ema", lambda: run("auto"))
    last = _plain("llama clip 0.5", lambda: tasks.fit("llama", "auto", max_steps=4))
    assert tasks.max_relative_difference(plain, last) > 1e-3  # the model ends with the average, not the last step
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    _assert_same(run(strategy), plain)
    assert _modes(strategy) == _only(knob, 4)


class _ReadsWeights(tasks.pl.Callback):
    """Sums every parameter where a callback may read weights outside the training step: after each step, at the
    epoch's end, before each validation, at the end of training."""

    def __init__(self) -> None:
        self.readings: list[tuple[str, int, float]] = []

    def _read(self, hook: str, trainer: tasks.pl.Trainer, module: tasks.pl.LightningModule) -> None:
        with torch.no_grad():
            total = sum(p.double().sum() for p in module.parameters())
        self.readings.append((hook, trainer.global_step, float(total)))

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, module: tasks.pl.LightningModule, *args: Any) -> None:
        self._read("on_train_batch_end", trainer, module)

    def on_train_epoch_end(self, trainer: tasks.pl.Trainer, module: tasks.pl.LightningModule) -> None:
        self._read("on_train_epoch_end", trainer, module)

    def on_validation_epoch_start(self, trainer: tasks.pl.Trainer, module: tasks.pl.LightningModule) -> None:
        self._read("on_validation_epoch_start", trainer, module)

    def on_train_end(self, trainer: tasks.pl.Trainer, module: tasks.pl.LightningModule) -> None:
        self._read("on_train_end", trainer, module)


class _ReadsElsewhere(_ReadsWeights):
    """Reads weights only where no hook of its own in the training loop makes the steps wait: before a validation
    and at the end of training."""

    on_train_batch_end = tasks.pl.Callback.on_train_batch_end  # type: ignore[assignment]
    on_train_epoch_end = tasks.pl.Callback.on_train_epoch_end  # type: ignore[assignment]


@pytest.mark.parametrize("reader", [_ReadsWeights, _ReadsElsewhere])
def test_a_callback_reading_weights_between_a_pipelined_step_and_the_next_forward_reads_the_stepped_weights(
    reader: type[_ReadsWeights], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block's pipelined step is slowed by 20 ms on the optimizer thread, so that a hook that did not wait for
    it would read the weights before it: the readings are plain Lightning's, bit for bit (one validation after the
    second step, none after the last, so that the end of training follows a step directly)."""
    build, kind = tasks.EXAMPLES["llama"]
    val = batches.data(kind, batches=2, seed=1)
    options = dict(max_steps=4, val_check_interval=4, limit_val_batches=1, limit_train_batches=6)

    def run(strategy: Any) -> tuple[tasks.Task, _ReadsWeights]:
        callback = reader()
        task = tasks.fit_task(lambda: tasks.Task(build, kind), strategy, batches.data(kind), val,
                              callbacks=[callback], max_epochs=2, **options)
        return task, callback

    plain, plain_reader = _plain(f"reads {reader.__name__}", lambda: run("auto"))
    hooks = [hook for hook, _, _ in plain_reader.readings]
    assert hooks[-1] == "on_train_end" and "on_validation_epoch_start" in hooks
    assert reader is _ReadsElsewhere or {"on_train_batch_end", "on_train_epoch_end"} <= set(hooks)
    step = PipelinedStep._step

    def slow_step(self: PipelinedStep, *args: Any) -> None:
        time.sleep(0.02)
        step(self, *args)

    monkeypatch.setattr(PipelinedStep, "_step", slow_step)
    strategy = SuperpipeStrategy(overlap_optimizer="pipelined")
    streamed, streamed_reader = run(strategy)
    _assert_same(streamed, plain)
    assert streamed_reader.readings == plain_reader.readings
    assert _modes(strategy) == _only("pipelined", 4)


class _SeesPending(tasks.pl.Callback):
    """Records after each step whether pipelined steps are still pending (launched, not waited for)."""

    def __init__(self) -> None:
        self.pending: list[bool] = []

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, *args: Any) -> None:
        self.pending.append(bool(trainer.strategy.streaming.engine.pending.pending_blocks))


class _DeclaresItReadsNoWeights(_SeesPending):
    superpipe_reads_no_weights = True


def test_a_callback_declaring_it_reads_no_weights_keeps_the_step_pipelined_past_its_hook() -> None:
    """After each step, a callback that may read weights finds every pipelined step done (the barrier waited);
    one that declares it reads none finds them pending: it did not make the loop wait."""
    reads, declares = _SeesPending(), _DeclaresItReadsNoWeights()
    strategy = SuperpipeStrategy(overlap_optimizer="pipelined")
    tasks.fit("llama", strategy, callbacks=[reads], max_steps=3, accumulate_grad_batches=1)
    alone = SuperpipeStrategy(overlap_optimizer="pipelined")
    tasks.fit("llama", alone, callbacks=[declares], max_steps=3, accumulate_grad_batches=1)
    assert reads.pending == [False] * 3
    assert declares.pending == [True] * 3


@pytest.mark.parametrize("knob", KNOBS)
def test_base_finetuning_unfreezing_the_layers_mid_run_is_plain_lightning_bitwise(knob: str) -> None:
    """The decoder layers frozen for the first epoch, then added to SGD's parameter groups (``on_train_epoch_start``,
    after the first epoch's last step was launched): they train from then on, as in plain Lightning."""
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=3, accumulate_grad_batches=1)
    make = lambda: tasks.HeadFirstTask(tasks.llama, "lm")  # noqa: E731

    def run(strategy: Any) -> tasks.Task:
        return tasks.fit_task(make, strategy, batches.data("lm"), callbacks=[tasks.UnfreezeLayersAtEpochOne()],
                              **options)

    plain = _plain("finetuning", lambda: run("auto"))
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    streamed = run(strategy)
    _assert_same(streamed, plain)
    tasks.pl.seed_everything(tasks.SEED, verbose=False)
    initial = make()
    assert tasks.max_relative_difference(streamed.model.model.layers, initial.model.model.layers) > 1e-3
    assert _modes(strategy) == _only(knob, 6)


# --------------------------------------------------------------------------------- checkpoints and validation


def _checkpoint_states(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """A checkpoint's weights, optimizer state (by parameter index: the order a step fills it in differs), and
    parameter groups and schedule."""
    saved = torch.load(path, weights_only=False)
    optimizer = saved["optimizer_states"][0]
    moments = {f"{index}.{key}": value for index, state in optimizer["state"].items() for key, value in state.items()}
    return saved["state_dict"], moments, (optimizer["param_groups"], saved["lr_schedulers"])


@pytest.mark.parametrize("knob", KNOBS)
def test_a_checkpoint_every_step_holds_plain_lightnings_state_and_resuming_mid_run_is_exact(
    knob: str, tmp_path: Path
) -> None:
    """``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``: each checkpoint holds the weights, the optimizer
    state and the schedule of its step, plain Lightning's bit for bit (a pipelined step is done before it is
    written). A run resumed from the fourth of six steps (the end of the second epoch: a checkpoint inside an epoch
    would replay the epoch's batches from its start, in plain Lightning too) ends with the uninterrupted run's
    weights."""
    epochs = dict(max_steps=-1, max_epochs=3, limit_train_batches=4)  # two steps an epoch

    def run(strategy: Any, folder: Path) -> tasks.Task:
        callback = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        return tasks.fit("llama", strategy, callbacks=[callback], enable_checkpointing=True, **epochs)

    plain = run("auto", tmp_path / "plain")
    streamed = run(SuperpipeStrategy(overlap_optimizer=knob), tmp_path / "streamed")
    _assert_same(streamed, plain)
    names = [f"step={step}.ckpt" for step in range(1, 7)]
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == names
    for name in names:
        (weights, moments, groups), (plain_weights, plain_moments, plain_groups) = (
            _checkpoint_states(tmp_path / run_name / name) for run_name in ("streamed", "plain")
        )
        assert weights.keys() == plain_weights.keys() and moments.keys() == plain_moments.keys() and moments
        assert all(torch.equal(weights[key], plain_weights[key]) for key in weights), name
        assert all(torch.equal(moments[key], plain_moments[key]) for key in moments), name
        assert groups == plain_groups, name
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    resumed = tasks.build_task("llama", seed=123)  # other initial weights: everything comes from the checkpoint
    tasks.trainer(strategy, **epochs).fit(resumed, batches.data("lm"), ckpt_path=tmp_path / "streamed" / names[3])
    assert resumed.losses == streamed.losses[8:]
    assert tasks.max_relative_difference(resumed, streamed) == 0.0
    assert _modes(strategy) == _only(knob, 2)


@pytest.mark.parametrize("knob", KNOBS)
def test_validation_every_two_steps_sees_the_weights_of_its_step(knob: str) -> None:
    """``val_check_interval=4`` micro-batches with 2 validation batches, between pipelined steps too."""
    build, kind = tasks.EXAMPLES["llama"]
    options = dict(max_steps=STEPS, val_check_interval=4, limit_val_batches=2)

    def run(strategy: Any) -> tasks.Task:
        val = batches.data(kind, batches=4, seed=1)
        return tasks.fit_task(lambda: tasks.Task(build, kind), strategy, batches.data(kind), val, **options)

    plain = _plain("validated", lambda: run("auto"))
    assert len(plain.val_losses) == 2 * STEPS // 2
    assert len(set(plain.val_losses[::2])) == STEPS // 2  # the first validation batch's loss changed as it trained
    strategy = SuperpipeStrategy(overlap_optimizer=knob)
    streamed = run(strategy)
    _assert_same(streamed, plain)
    assert streamed.val_losses == plain.val_losses
    assert _modes(strategy) == _only(knob, STEPS)


# ------------------------------------------------------------------------------------------------- the disk tier


@pytest.mark.parametrize("knob", ["auto", *KNOBS])
@pytest.mark.parametrize("fires", ["no step", "every step"])
def test_the_disk_tier_speculates_in_its_files_where_clipping_decides(
    knob: str, fires: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk tier steps each block through its store during backward, into the block's other slot: committed
    where clipping by norm does not fire, else undone and stepped again from the spilled gradients. Where clipping
    keeps firing, "auto" pipelines the step into the next forward (from the spilled gradients); "pipelined" always
    does. Plain Lightning's bits throughout, and no host memory kept."""
    options = dict(max_steps=4, gradient_clip_val=CLIPS[fires])
    plain = _plain(f"llama 4 steps clip {fires}", lambda: tasks.fit("llama", "auto", **options))
    strategy = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path, overlap_optimizer=knob)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        streamed = tasks.fit("llama", strategy, **options)
    _assert_same(streamed, plain)
    report = strategy.memory_report()
    modes = _modes(strategy)
    assert report["speculation_kept_peak_bytes"] == 0
    said = [r.getMessage() for r in caplog.records if "SuperpipeStrategy steps the optimizer" in r.getMessage()]
    if knob == "pipelined":
        assert modes == _only("pipelined", 4) and report["disk_fused_reads"] > 0
        assert said[0] == "SuperpipeStrategy steps the optimizer pipelined into the next forward: overlap_optimizer=" \
            "'pipelined'."
        return
    if fires == "no step":
        assert modes == _only("speculative", 4) and report["speculative_steps_committed"] == 4
    elif knob == "speculative":
        assert modes == _only("speculative", 4) and report["speculative_steps_redone"] == 4
    else:  # one redo, then pipelined
        assert modes == {**_only("speculative", 1), "pipelined": 3} and report["speculative_steps_redone"] == 1
        assert said[1].startswith("SuperpipeStrategy steps the optimizer pipelined into the next forward: clipping")
    assert said[0] == (
        "SuperpipeStrategy steps the optimizer speculatively during backward: clipping or the gradient scaler decide"
        " after backward (the disk tier's other slot keeps the previous step)."
    )
    assert len(said) == len(set(said))
