"""Fine-tune and evaluate models larger than accelerator memory with PyTorch Lightning.

Importing the package registers ``Trainer(strategy="superpipe")``: Lightning only registers its own strategies,
and has no entry point for third-party ones. It also lets Lightning ask the strategy whether a run has several ranks
(:func:`~lightning_superpipe.strategies.ranks.let_lightning_ask_about_ranks`): on one device it has one.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_superpipe.construction.deferred_init import load_safetensors, save_safetensors
from lightning_superpipe.emulation.link import EmulatedLink, OrderingViolation
from lightning_superpipe.memory.home import register_home_kind
from lightning_superpipe.planning import Plan
from lightning_superpipe.run.options import SuperpipeOptions
from lightning_superpipe.stepping.optimizers import register_per_parameter_optimizer
from lightning_superpipe.strategies.memory_logger import DeviceMemoryLogger
from lightning_superpipe.strategies.ranks import let_lightning_ask_about_ranks
from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

if TYPE_CHECKING:
    from lightning_superpipe.generation import GenerationPolicy, generate
    from lightning_superpipe.moe import PagedMoECallback, PagingOptions

SuperpipeStrategy.register_strategies(StrategyRegistry)
let_lightning_ask_about_ranks()

#: Names imported from their room on first use: generation and MoE paging (which loads transformers' MoE
#: integration) are not needed to register the strategy, nor by ``superpipe --help``.
_LAZY_NAMES = {
    "GenerationPolicy": "lightning_superpipe.generation",
    "generate": "lightning_superpipe.generation",
    "PagedMoECallback": "lightning_superpipe.moe",
    "PagingOptions": "lightning_superpipe.moe",
}


def __getattr__(name: str) -> Any:
    room = _LAZY_NAMES.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(room), name)
    globals()[name] = value  # once imported, a plain attribute
    return value

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
    "register_home_kind",
    "register_per_parameter_optimizer",
    "save_safetensors",
]
