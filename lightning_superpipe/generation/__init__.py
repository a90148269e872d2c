"""Throughput-oriented generation under a device budget (FlexGen's schedule, cost model and compression).

``generate(model, input_ids, policy=GenerationPolicy(...), max_new_tokens=...)``: the policy says where weights, KV
cache and hidden states live, or gives a ``memory_budget`` for the cost model to choose.
"""

from lightning_superpipe.generation.api import GenerationOutput, generate
from lightning_superpipe.generation.errors import GenerationError
from lightning_superpipe.generation.policy import GenerationPolicy, Hardware, SolvedPolicy

__all__ = ["GenerationError", "GenerationOutput", "GenerationPolicy", "Hardware", "SolvedPolicy", "generate"]
