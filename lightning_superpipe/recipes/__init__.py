"""Recipes: fine-tune and evaluate ``transformers`` models from a YAML file with the ``superpipe`` command."""

from lightning_superpipe.recipes.causal_lm import CausalLMModule
from lightning_superpipe.recipes.checkpointing import ResumableCheckpoint, TrainingInterrupted
from lightning_superpipe.recipes.errors import RecipeError, TokenizerError
from lightning_superpipe.recipes.export import ExportCheckpoints, export_pretrained
from lightning_superpipe.recipes.generation_writer import GenerationWriter
from lightning_superpipe.recipes.memory_report import MemoryReport
from lightning_superpipe.recipes.progress import LoggingProgressBar, ThroughputLogger
from lightning_superpipe.recipes.resumable_loading import ResumableDataLoader, ResumableSampler
from lightning_superpipe.recipes.settings import (
    GenerationSettings,
    LoRASettings,
    OptimizerSettings,
    QuantizationSettings,
)
from lightning_superpipe.recipes.text_data import TextDataModule
from lightning_superpipe.recipes.tokenization import ByteTokenizer, TextTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "CausalLMModule",
    "ExportCheckpoints",
    "GenerationSettings",
    "GenerationWriter",
    "LoggingProgressBar",
    "LoRASettings",
    "QuantizationSettings",
    "MemoryReport",
    "OptimizerSettings",
    "RecipeError",
    "ResumableCheckpoint",
    "ResumableDataLoader",
    "ResumableSampler",
    "TextDataModule",
    "TextTokenizer",
    "ThroughputLogger",
    "TokenizerError",
    "TrainingInterrupted",
    "export_pretrained",
    "load_tokenizer",
]
