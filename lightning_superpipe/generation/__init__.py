"""Throughput-oriented generation under a device budget (FlexGen's schedule, cost model and compression)."""

from lightning_superpipe.generation.api import GenerationError, GenerationOutput, generate

__all__ = ["GenerationError", "GenerationOutput", "generate"]
