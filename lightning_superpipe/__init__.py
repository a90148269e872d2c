"""Fine-tune and evaluate models larger than accelerator memory with PyTorch Lightning.

Importing the package registers ``Trainer(strategy="superpipe")``: Lightning only registers its own strategies,
and has no entry point for third-party ones. It also lets Lightning ask the strategy whether a run has several ranks
(:func:`~lightning_superpipe.strategies.ranks.let_lightning_ask_about_ranks`): on one device it has one.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_superpipe.generation import GenerationPolicy, generate
from lightning_superpipe.moe import PagedMoECallback, PagingOptions
from lightning_superpipe.planning import Plan
from lightning_superpipe.strategies.memory_logger import DeviceMemoryLogger
from lightning_superpipe.strategies.ranks import let_lightning_ask_about_ranks
from lightning_superpipe.strategies.superpipe import SuperpipeStrategy
from lightning_superpipe.streaming.deferred_init import load_safetensors, save_safetensors
from lightning_superpipe.streaming.emulated import EmulatedLink, OrderingViolation
from lightning_superpipe.streaming.optimizers import register_per_parameter_optimizer
from lightning_superpipe.streaming.options import SuperpipeOptions

SuperpipeStrategy.register_strategies(StrategyRegistry)
let_lightning_ask_about_ranks()

__all__ = [
    "DeviceMemoryLogger",
    "EmulatedLink",
    "GenerationPolicy",
    "OrderingViolation",
    "PagedMoECallback",
    "PagingOptions",
    "Plan",
    "SuperpipeOptions",
    "SuperpipeStrategy",
    "generate",
    "load_safetensors",
    "register_per_parameter_optimizer",
    "save_safetensors",
]
