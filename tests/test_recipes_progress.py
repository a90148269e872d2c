"""Plain progress lines (``LoggingProgressBar``) and throughput figures (``ThroughputLogger``) in a Lightning run."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_superpipe.recipes import CausalLMModule, LoggingProgressBar, ThroughputLogger
from lightning_superpipe.recipes.progress import batch_tokens, format_figure

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
SEQ_LEN, BATCH_SIZE = 16, 2


def token_batches(rows: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 256, (SEQ_LEN,), generator=generator)} for _ in range(rows)]
    return DataLoader(samples, batch_size=BATCH_SIZE)  # type: ignore[arg-type]


@pytest.fixture
def progress_lines() -> Iterator[list[str]]:
    """What the progress logger writes, whatever handlers ``superpipe`` set up on its parent in this process."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("lightning_superpipe.recipes.progress")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_lines_come_after_the_first_step_every_n_steps_and_when_each_stage_ends(progress_lines: list[str]) -> None:
    module = CausalLMModule(model_type="llama", config=dict(SIZES), vocab_size=259)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, val_check_interval=5, limit_val_batches=2, accumulate_grad_batches=2,
        callbacks=[LoggingProgressBar(every_n_seconds=None, every_n_steps=2), ThroughputLogger(window=2)],
    )
    trainer.fit(module, token_batches(20), token_batches(4))
    text = "\n".join(progress_lines)
    assert [int(step) for step in re.findall(r"^train step (\d+)/5, epoch 0 ", text, re.MULTILINE)] == [1, 3, 5], text
    assert progress_lines[-2].startswith("validation done (") and "val/loss=" in progress_lines[-2]
    assert re.fullmatch(r"training done: step 5 \(\d+:\d\d:\d\d elapsed\): train/loss=[\d.]+, "
                        r"train/step_time_s=[\d.]+, train/tokens_per_s=[\d.,]+, val/loss=.*", progress_lines[-1])
    assert "device peak" not in text  # the plain strategy on the CPU has no count of its device's bytes
    # Both figures cover the same two optimizer steps of two micro-batches each.
    metrics = trainer.callback_metrics
    tokens_per_step = 2 * BATCH_SIZE * SEQ_LEN
    assert float(metrics["train/tokens_per_s"] * metrics["train/step_time_s"]) == pytest.approx(tokens_per_step)


def test_a_disabled_bar_writes_nothing(progress_lines: list[str]) -> None:
    bar = LoggingProgressBar(every_n_steps=1)
    bar.disable()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, callbacks=[bar])
    trainer.fit(CausalLMModule(model_type="llama", config=dict(SIZES), vocab_size=259), token_batches(4))
    assert not bar.is_enabled and progress_lines == []


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ThroughputLogger(window=0), r"ThroughputLogger\(window=0\) must be a whole number of steps"),
        (lambda: ThroughputLogger(window=2.5), r"ThroughputLogger\(window=2.5\) must be a whole number of steps"),
        (lambda: LoggingProgressBar(every_n_seconds=None), "LoggingProgressBar needs every_n_seconds or every_n_steps"),
        (lambda: LoggingProgressBar(every_n_seconds=0), r"LoggingProgressBar\(every_n_seconds=0\) must be a positive"),
        (lambda: LoggingProgressBar(every_n_seconds="30"), r"LoggingProgressBar\(every_n_seconds='30'\) must be a "),
        (lambda: LoggingProgressBar(every_n_steps=0), r"LoggingProgressBar\(every_n_steps=0\) must be a whole number"),
    ],
)
def test_bad_intervals_are_refused_at_construction(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_tokens_are_counted_from_the_mask_else_the_ids() -> None:
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    assert batch_tokens({"input_ids": ids}) == 16 == batch_tokens(ids)
    assert batch_tokens({"input_ids": ids, "attention_mask": mask}) == 14  # left padding is not trained on
    assert batch_tokens({"prompts": ["a"]}) is None and batch_tokens(["a"]) is None
    assert [format_figure(value) for value in (3.41234, 0.000812, 12345.6, 7, torch.tensor(2.5))] == [
        "3.412", "0.000812", "12,346", "7", "2.5"
    ]
