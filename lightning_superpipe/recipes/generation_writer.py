"""Print and save what ``superpipe predict`` generates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

#: File written into the run's log folder, one JSON object a line.
PREDICTIONS_FILENAME = "predictions.jsonl"


class GenerationWriter(BasePredictionWriter):
    """Print each prompt with its completion and append both to ``predictions.jsonl`` in the log folder.

    Expects the predictions of :class:`~lightning_superpipe.recipes.causal_lm.CausalLMModule`: a list of
    ``{"prompt": ..., "completion": ...}`` per batch.

    Args:
        print_completions: Also print them to standard output as they are generated.
    """

    def __init__(self, print_completions: bool = True) -> None:
        super().__init__(write_interval="batch")
        self.print_completions = print_completions
        self.path: Path | None = None

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.path = Path(trainer.log_dir or trainer.default_root_dir) / PREDICTIONS_FILENAME
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not trainer.is_global_zero or self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as file:
            for record in prediction:
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
                if self.print_completions:
                    print(f"\n>>> {record['prompt']}\n{record['completion']}", flush=True)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and self.path is not None:
            print(f"\nPredictions written to {self.path}", flush=True)
