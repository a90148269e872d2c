"""Position-wise modules (a block's MLP) run over tiles of the sequence, each tile recomputed in backward.

A decoder block's MLP holds three ``tokens x intermediate`` tensors for its backward; over a long sequence they are
the block's largest. Run tile by tile under a non-reentrant checkpoint, the MLP keeps only each tile's input for
backward, and backward recomputes one tile's intermediates at a time. The output is the same tensor the whole
sequence gives, to fp32 rounding (the weight gradients are summed over tiles in another order).

The module's ``forward`` is replaced on the instance, so its parameters' names, its hooks and a checkpoint's keys
stay as they were; :func:`untile_position_wise` puts it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ORIGINAL_FORWARD = "_superpipe_untiled_forward"


def tile_position_wise(model: nn.Module, tile_tokens: int, names: Iterable[str] = ("mlp",)) -> int:
    """Run every submodule called one of ``names`` over tiles of ``tile_tokens`` positions.

    Args:
        model: The model (a ``transformers`` model, whose decoder layers call their MLP ``mlp``).
        tile_tokens: Positions per tile (along the second-last dimension of the module's input).
        names: Attribute names of the position-wise submodules.

    Returns:
        How many modules now run in tiles.

    Raises:
        ValueError: ``tile_tokens`` below 1.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_position_wise(tile_tokens={tile_tokens}) needs at least one position per tile")
    wanted = set(names)
    tiled = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in wanted:
            continue
        original = getattr(module, _ORIGINAL_FORWARD, None) or module.forward
        setattr(module, _ORIGINAL_FORWARD, original)
        module.forward = _tiled(original, tile_tokens)
        tiled += 1
    return tiled


def untile_position_wise(model: nn.Module) -> int:
    """Give every module :func:`tile_position_wise` changed its own ``forward`` back; how many it changed."""
    restored = 0
    for module in model.modules():
        if _ORIGINAL_FORWARD in module.__dict__:
            del module.__dict__["forward"]
            del module.__dict__[_ORIGINAL_FORWARD]
            restored += 1
    return restored


def _tiled(forward: Callable[..., Any], tile_tokens: int) -> Callable[..., torch.Tensor]:
    def tiled_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hidden_states.dim() < 2 or hidden_states.shape[-2] <= tile_tokens:
            return forward(hidden_states, *args, **kwargs)
        recompute = torch.is_grad_enabled()
        outputs = []
        for tile in hidden_states.split(tile_tokens, dim=-2):
            if recompute:
                output = checkpoint(forward, tile, *args, use_reentrant=False, **kwargs)
            else:
                output = forward(tile, *args, **kwargs)
            if not isinstance(output, torch.Tensor):
                raise ValueError(
                    f"tile_position_wise: {getattr(forward, '__qualname__', forward)} returned "
                    f"{type(output).__name__}; only modules that return one tensor per position can run in tiles"
                )
            outputs.append(output)
        return torch.cat(outputs, dim=-2)

    return tiled_forward
