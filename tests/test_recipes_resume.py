"""Periodic checkpoints, Ctrl-C and SIGTERM during ``superpipe fit``, and resuming exactly where a run stopped."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_superpipe.recipes import cli
from tests.test_recipes_cli import FULL, LORA, metric_rows, run_dir, superpipe_command, write_recipe

#: The class path of :class:`SignalAt`, for ``--trainer.callbacks+=``.
SIGNAL_AT = "tests.test_recipes_resume.SignalAt"
#: Training batches per epoch: an epoch ends every 5 steps, so most stopping points are in the middle of one.
EPOCH = 5
STEPS = 11


class SignalAt(Callback):
    """Sends ``signal_name`` to this process ``times`` times while step ``step`` (1-based) trains, or while the
    validation after it runs, as a user's Ctrl-C or a cluster's SIGTERM would arrive."""

    def __init__(self, step: int, signal_name: str = "SIGINT", during: str = "training", times: int = 1) -> None:
        self.step = step
        self.signal_name = signal_name
        self.during = during
        self.times = times

    def _send(self) -> None:
        for _ in range(self.times):
            signal.raise_signal(getattr(signal, self.signal_name))

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.during == "training" and trainer.global_step + 1 == self.step:
            self._send()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        validating = self.during == "validation" and not trainer.sanity_checking
        if validating and trainer.global_step == self.step and batch_idx == 0:
            self._send()


def tiny_recipe(folder: Path, recipe: str) -> str:
    """``recipe`` with a model and data small enough for a step in milliseconds, 5-step epochs, dropout on, a
    validation every 3 steps and a checkpoint every 4, each kept as its own file as well as last.ckpt."""

    def edit(settings: dict[str, Any]) -> None:
        settings["model"]["config"] = {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 64,
        }
        if settings["model"]["lora"] is not None:
            settings["model"]["lora"]["dropout"] = 0.1  # dropout draws random numbers: the resume must restore them
        settings["data"].update(seq_len=32, batch_size=4)
        settings["trainer"].update(
            max_steps=STEPS, limit_train_batches=EPOCH, val_check_interval=3, limit_val_batches=2,
            log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        )
        checkpoint = settings["trainer"]["callbacks"][-1]
        assert checkpoint["class_path"].endswith("ResumableCheckpoint")
        checkpoint["init_args"].update(every_n_train_steps=4, save_top_k=-1)

    return write_recipe(folder / f"tiny_{Path(recipe).name}", recipe, edit)


def fit(recipe: str, name: str, *arguments: str) -> tuple[int, str]:
    """Run ``superpipe fit`` in this process; its exit code and what it printed on standard error."""
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            cli.main(["fit", "--config", recipe, "--trainer.logger.init_args.name", name, *arguments])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, err.getvalue()


def losses(run: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Training loss and validation loss by logging step, as written to metrics.csv."""
    rows = metric_rows(run)
    train = {int(row["step"]): float(row["train/loss"]) for row in rows if row.get("train/loss")}
    val = {int(row["step"]): float(row["val/loss"]) for row in rows if row.get("val/loss")}
    return train, val


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.delenv(cli.TRACEBACK_ENV, raising=False)
        yield root


#: Lightning's own single-device strategy instead of the superpipe strategy.
PLAIN = ("--trainer.strategy", "auto")


@pytest.fixture(scope="module")
def uninterrupted(workdir: Path) -> dict[tuple[str, tuple[str, ...]], Path]:
    """Each recipe run for all its steps without a stop, to compare resumed runs with."""
    runs = {}
    for recipe, arguments in ((LORA, ()), (FULL, ()), (LORA, PLAIN)):
        name = f"whole_{Path(recipe).stem}_{len(arguments)}"
        code, err = fit(tiny_recipe(workdir, recipe), name, *arguments)
        assert code == 0, err
        runs[recipe, arguments] = run_dir(workdir, name)
    return runs


def test_the_recipes_keep_last_ckpt_current_every_n_steps_and_at_the_end(
    workdir: Path, uninterrupted: dict[tuple[str, tuple[str, ...]], Path]
) -> None:
    for recipe in (LORA, FULL):
        callback = yaml.safe_load(Path(recipe).read_text())["trainer"]["callbacks"][-1]
        assert callback["class_path"] == "lightning_superpipe.recipes.ResumableCheckpoint"
        assert callback["init_args"]["every_n_train_steps"] == 50 and callback["init_args"]["save_last"] is True
    folder = uninterrupted[LORA, ()] / "checkpoints"
    # Every 4 steps, and last.ckpt at the final step 11 (plain ModelCheckpoint leaves it at step 8, the last
    # multiple of every_n_train_steps).
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert torch.load(folder / "epoch=1-step=8.ckpt", weights_only=True)["global_step"] == 8
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == STEPS


STOPS = {
    # name: (recipe, signal, the step during which it arrives, training or the validation after that step, and
    # further arguments of both runs)
    "Ctrl-C in the middle of an epoch": (LORA, "SIGINT", 7, "training", ()),
    "Ctrl-C at the end of an epoch": (LORA, "SIGINT", 5, "training", ()),
    "Ctrl-C during a validation": (LORA, "SIGINT", 3, "validation", ()),
    "SIGTERM in the middle of an epoch": (LORA, "SIGTERM", 8, "training", ()),
    "SIGTERM at a validation step": (LORA, "SIGTERM", 3, "training", ()),
    "Ctrl-C in a full fine-tune": (FULL, "SIGINT", 7, "training", ()),
    "Ctrl-C with Lightning's own strategy": (LORA, "SIGINT", 7, "training", PLAIN),
}


@pytest.mark.parametrize("case", STOPS)
def test_a_stopped_run_saves_last_ckpt_and_resumes_with_the_uninterrupted_losses_and_weights(
    case: str, workdir: Path, uninterrupted: dict[tuple[str, tuple[str, ...]], Path]
) -> None:
    recipe, signal_name, step, during, arguments = STOPS[case]
    tiny = tiny_recipe(workdir, recipe)
    name = re.sub(r"\W+", "_", case)
    stop = [*arguments, f"--trainer.callbacks+={SIGNAL_AT}", f"--trainer.callbacks.step={step}",
            f"--trainer.callbacks.signal_name={signal_name}", f"--trainer.callbacks.during={during}"]
    code, err = fit(tiny, name, *stop)

    # One line says what happened and how to resume; no traceback; the shell's exit code for the signal.
    assert code == 128 + getattr(signal, signal_name), err
    checkpoint = run_dir(workdir, name) / "checkpoints" / "last.ckpt"
    lines = [line for line in err.splitlines() if line.startswith("superpipe: ")]
    relative = checkpoint.relative_to(workdir)
    resume = " ".join(["superpipe fit --config", tiny, "--trainer.logger.init_args.name", name, *stop])
    message = f"{signal_name} stopped training at step {step}; saved {relative}"
    assert lines == [f"superpipe: {message}; resume with: {resume} --ckpt_path {relative}"], err
    assert "Traceback" not in err
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["global_step"] == step
    # The shuffled training loader's place in its epoch: the batches of the epoch the stopped run trained on.
    loader_state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["shuffle"] is True and loader_state["batches_done"] == (step % EPOCH or EPOCH)

    code, err = fit(tiny, name, *arguments, "--ckpt_path", str(checkpoint))
    assert code == 0, err
    stopped, resumed = sorted(run_dir(workdir, name).parent.glob("version_*"))
    whole_train, whole_val = losses(uninterrupted[recipe, arguments])
    stopped_train, stopped_val = losses(stopped)
    resumed_train, resumed_val = losses(resumed)
    # The two runs together logged every step's loss once, each exactly as the uninterrupted run, and every
    # validation.
    assert sorted(stopped_train) == list(range(step)) and sorted(resumed_train) == list(range(step, STEPS))
    assert {**stopped_train, **resumed_train} == whole_train
    assert {**stopped_val, **resumed_val} == whole_val
    final = weights(resumed / "checkpoints" / "last.ckpt")
    whole = weights(uninterrupted[recipe, arguments] / "checkpoints" / "last.ckpt")
    assert final.keys() == whole.keys() and all(torch.equal(final[key], whole[key]) for key in whole)


def test_a_run_resumed_from_a_periodic_checkpoint_continues_exactly(
    workdir: Path, uninterrupted: dict[tuple[str, tuple[str, ...]], Path]
) -> None:
    # As after a crash or a SIGKILL: the newest checkpoint is the one saved every N steps, in the middle of epoch 0.
    periodic = uninterrupted[LORA, ()] / "checkpoints" / "epoch=0-step=4.ckpt"
    code, err = fit(tiny_recipe(workdir, LORA), "from_periodic", "--ckpt_path", str(periodic))
    assert code == 0, err
    whole_train, whole_val = losses(uninterrupted[LORA, ()])
    resumed_train, resumed_val = losses(run_dir(workdir, "from_periodic"))
    assert resumed_train == {step: loss for step, loss in whole_train.items() if step >= 4}
    assert resumed_val == {step: loss for step, loss in whole_val.items() if step >= 4}


def test_a_second_ctrl_c_stops_at_once_and_names_the_newest_checkpoint(workdir: Path) -> None:
    # Two Ctrl-C in step 6: the first asks for a stop after the step, the second cuts the step short.
    code, err = fit(tiny_recipe(workdir, LORA), "twice", f"--trainer.callbacks+={SIGNAL_AT}",
                    "--trainer.callbacks.step=6", "--trainer.callbacks.times=2")
    assert code == 130
    folder = run_dir(workdir, "twice") / "checkpoints"
    # Nothing was saved on stopping; last.ckpt is the periodic one of step 4.
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 4
    lines = [line for line in err.splitlines() if line.startswith("superpipe: ")]
    newest = (folder / "last.ckpt").relative_to(workdir)
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"superpipe: SIGINT stopped training at step 5 without saving; the newest checkpoint is {newest}; "
        "resume with: superpipe fit "
    )
    assert "Traceback" not in err


def test_ctrl_c_before_the_first_step_is_done_stops_at_once(workdir: Path) -> None:
    code, err = fit(tiny_recipe(workdir, LORA), "first_step", f"--trainer.callbacks+={SIGNAL_AT}",
                    "--trainer.callbacks.step=1")
    assert code == 130
    assert not (run_dir(workdir, "first_step") / "checkpoints").exists()
    lines = [line for line in err.splitlines() if line.startswith("superpipe: ")]
    assert lines == [
        "superpipe: SIGINT stopped training at step 0, before any checkpoint was saved; nothing to resume from"
    ]
    assert "Traceback" not in err


def test_ctrl_c_sent_to_the_superpipe_command_leaves_a_checkpoint_to_resume_from(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(cli.TRACEBACK_ENV, None)
    recipe = tiny_recipe(tmp_path, LORA)
    # Long enough not to end by itself; a checkpoint every 2 steps shows when training is under way.
    command = [superpipe_command(), "fit", "--config", recipe, "--trainer.max_steps", "100000",
               "--trainer.limit_train_batches", "1.0", "--trainer.val_check_interval", "1000",
               "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "0"]
    checkpoint = tmp_path / "superpipe_logs" / "finetune_lora" / "version_0" / "checkpoints" / "last.ckpt"
    with (tmp_path / "stderr.txt").open("w+") as stderr:
        # Output to a file, not a pipe nobody reads while the test waits, which could fill up and stall the run.
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 60
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        stderr.seek(0)
        err = stderr.read()
    assert process.returncode == 130, err[-3000:]
    step = torch.load(checkpoint, weights_only=True)["global_step"]
    relative = checkpoint.relative_to(tmp_path)
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith(f"superpipe: SIGINT stopped training at step {step}; saved {relative}; resume with: ")
    assert last_line.endswith(f"--trainer.callbacks.save_top_k 0 --ckpt_path {relative}")
    assert step >= 2 and "Traceback" not in err
