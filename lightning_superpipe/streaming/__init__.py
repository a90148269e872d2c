"""The streaming engine: blocks, their device slots, copies and gradient return."""

from lightning_superpipe.streaming.blocks import BlockPolicy, NoBlocksFoundError, find_blocks
from lightning_superpipe.streaming.engine import StreamingEngine

__all__ = ["BlockPolicy", "NoBlocksFoundError", "StreamingEngine", "find_blocks"]
