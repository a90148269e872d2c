"""The streaming engine: blocks, their device slots, copies and gradient return, and the knobs that shape them."""

from lightning_superpipe.streaming.blocks import BlockPolicy, NoBlocksFoundError, find_blocks
from lightning_superpipe.streaming.engine import StreamingEngine
from lightning_superpipe.streaming.options import SuperpipeOptions

__all__ = ["BlockPolicy", "NoBlocksFoundError", "StreamingEngine", "SuperpipeOptions", "find_blocks"]
