"""The paged experts' calibration says what it is doing: a bar on a terminal, plain lines through logging elsewhere."""

import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from lightning_superpipe import PagedMoECallback
from lightning_superpipe.moe import page_experts
from lightning_superpipe.moe.progress import StepProgress
from lightning_superpipe.moe.testing import byte_corpus, tiny_moe

BATCHES = "MoE calibration: batches through the original experts"
ROUNDING = "MoE calibration: rounding the experts with their Hessians (GPTQ)"
MATRICES = 2 * 2 * 8  # tiny Mixtral: 2 layers x 2 projections x 8 experts


class Terminal(io.StringIO):
    """Standard output as a terminal."""

    def isatty(self) -> bool:
        return True


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[list[str]]:
    """The progress logger's lines (caught on the logger itself: the ``superpipe`` command stops their propagation)."""
    logger = logging.getLogger("lightning_superpipe.moe.progress")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return list(byte_corpus()[: 2 * 2 * 48].view(2, 2, 48))


def test_calibration_writes_plain_lines_when_output_is_not_a_terminal(batches, lines):
    page_experts(tiny_moe("mixtral"), expert_budget="50%", calibration=batches).restore()
    assert lines[0] == f"{BATCHES}: 2 batches"
    assert re.fullmatch(rf"{BATCHES}: 2 batches done in \d+\.\d s", lines[1])
    assert lines[2] == f"{ROUNDING}: {MATRICES} expert matrices"
    assert re.fullmatch(rf"{re.escape(ROUNDING)}: {MATRICES} expert matrices done in \d+\.\d s", lines[3])
    assert len(lines) == 4  # nothing in between: each step took less than 30 seconds


def test_lines_come_every_n_seconds_with_the_time_left(lines, monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 45.0, 62.0, 90.0, 95.0])  # the start, after each unit, the end
    monkeypatch.setattr("lightning_superpipe.moe.progress.perf_counter", lambda: next(clock))
    with StepProgress("rounding", 5, ("matrix", "matrices")) as progress:
        for _ in range(5):
            progress.advance()
    assert lines == [
        "rounding: 5 matrices",
        "rounding: 2/5 matrices (31.0 s elapsed, about 46.5 s left)",  # 30 s after the start
        "rounding: 4/5 matrices (0:01:02 elapsed, about 15.5 s left)",  # 30 s after the last line
        "rounding: 5 matrices done in 0:01:35",
    ]


def test_a_terminal_gets_a_bar_and_the_end_lines(batches, lines, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    page_experts(tiny_moe("mixtral"), expert_budget="50%", calibration=batches).restore()
    drawn = terminal.getvalue()  # tqdm redraws at most every 0.1 s, and clears the bars at the end
    assert f"{BATCHES}:   0%" in drawn and "0/2 " in drawn
    assert f"{ROUNDING}:   0%" in drawn and f"0/{MATRICES} " in drawn
    assert [re.sub(r" done in .*", "", line) for line in lines] == [
        f"{BATCHES}: 2 batches", f"{ROUNDING}: {MATRICES} expert matrices"
    ]


def test_nothing_is_shown_when_progress_is_off(batches, lines, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    page_experts(tiny_moe("mixtral"), expert_budget="50%", calibration=batches, progress=False).restore()
    assert terminal.getvalue() == "" and lines == []


class Evaluate(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_moe("mixtral")

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)


@pytest.mark.parametrize("progress_bar", [True, False])
def test_the_callback_shows_progress_when_the_trainer_shows_its_own(batches, lines, progress_bar):
    callback = PagedMoECallback(expert_budget="50%", calibration_batches=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=progress_bar, callbacks=[callback])
    trainer.validate(Evaluate(), DataLoader(torch.cat(batches), batch_size=2))
    assert "validate" in callback.reports
    assert len(lines) == (4 if progress_bar else 0)


def test_the_moe_recipe_writes_its_calibration_lines_to_a_log_file(tmp_path, monkeypatch, capsys):
    from lightning_superpipe.recipes import cli

    settings = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "eval_moe_paged.yaml").read_text())
    settings["model"]["config"].update(num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    settings["data"]["seq_len"] = 32
    settings["trainer"]["callbacks"][1]["init_args"]["measure_quality"] = False
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(settings))
    monkeypatch.chdir(tmp_path)
    cli.main(["validate", "--config", "recipe.yaml", "--trainer.limit_val_batches", "1"])  # output captured: a file
    written = capsys.readouterr().err
    assert f"{BATCHES}: 2 batches\n" in written and f"{ROUNDING}: 16 expert matrices\n" in written  # 1 x 2 x 8
    assert re.search(rf"{re.escape(ROUNDING)}: 16 expert matrices done in \d+\.\d s\n", written)
