"""Long sequences on a bounded device: the head and loss in chunks of tokens, position-wise modules in tiles.

Both trade a recomputation in backward for memory that does not grow with the whole sequence: the logits of one
chunk of tokens (never ``tokens x vocabulary``), the intermediates of one tile of a block's MLP.
"""

from lightning_superpipe.sequence.loss import (
    causal_lm_loss,
    chunk_causal_lm_loss,
    chunked_cross_entropy,
    unchunk_causal_lm_loss,
)
from lightning_superpipe.sequence.tiles import tile_position_wise, untile_position_wise

__all__ = [
    "causal_lm_loss",
    "chunk_causal_lm_loss",
    "chunked_cross_entropy",
    "tile_position_wise",
    "unchunk_causal_lm_loss",
    "untile_position_wise",
]
