"""FlexGen's schedule in Lightning: trainer.predict with SuperpipeStrategy, and `superpipe predict` on its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.recipes import CausalLMModule, TextDataModule, cli
from lightning_superpipe.recipes.text_data import documentation_prompts

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "generate.yaml")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def predict(schedule: str, data: TextDataModule, strategy: object) -> tuple[list[dict[str, str]], CausalLMModule]:
    torch.manual_seed(0)
    module = CausalLMModule(model_type="llama", config=TINY, vocab_size=data.vocab_size,
                            generation=dict(schedule=schedule, max_new_tokens=6, micro_batch_size=3))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False)
    batches = trainer.predict(module, datamodule=data)
    return [record for batch in batches for record in batch], module


def test_trainer_predict_with_superpipe_strategy_matches_model_generate() -> None:
    data = TextDataModule(num_prompts=10, prompt_chars=40, predict_batch_size=8)
    plain, _ = predict("model", data, "auto")
    flexgen, module = predict("flexgen", data, SuperpipeStrategy(resident_blocks=0, prefetch=1))
    assert [r["prompt"] for r in flexgen] == documentation_prompts(10, 40)
    assert flexgen == plain
    stats = module.last_generation_stats  # the last batch: 2 prompts, one micro-batch
    assert stats["h2d_bytes"]["weights"] == 0  # the strategy streamed the weights ...
    assert stats["h2d_bytes"]["cache"] > 0 and stats["d2h_bytes"]["cache"] > 0  # ... generate moved the cache


def test_superpipe_predict_writes_completions_for_a_jsonl_of_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["The for statement is used to", "A class definition", "Exceptions are raised", "Lambda"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    monkeypatch.chdir(tmp_path)
    small = [f"--model.config.{key}={value}" for key, value in TINY.items()]
    cli.main(["predict", "--config", RECIPE, "--data.prompts_path", str(source), "--data.predict_batch_size", "4",
              "--model.generation.max_new_tokens", "5", "--model.generation.micro_batch_size", "2",
              "--trainer.enable_progress_bar", "false", *small])
    written = tmp_path / "superpipe_logs" / "generate" / "version_0" / "predictions.jsonl"
    records = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    assert all(isinstance(r["completion"], str) and len(r["completion"]) <= 5 for r in records)  # 5 byte tokens


def test_documentation_prompts_and_bad_prompt_settings() -> None:
    cut = documentation_prompts(5, 30)
    assert len(cut) == 5 and all(0 < len(p) <= 30 for p in cut) and len(set(cut)) == 5
    with pytest.raises(ValueError, match="data.predict_batch_size must be at least 1"):
        TextDataModule(predict_batch_size=0)
    with pytest.raises(ValueError, match="data.prompts_path 'missing.jsonl' does not exist"):
        TextDataModule(prompts_path="missing.jsonl")
