"""The Trainer's callbacks that keep an average of the weights and swap it into the parameters, which some ways of
keeping the blocks cannot follow (the disk tier's files, the node's one shared copy)."""

from __future__ import annotations

from typing import Any


def weight_averaging_callbacks(trainer: Any) -> list[Any]:
    """The trainer's callbacks that keep an average of the weights and swap it into the parameters
    (``EMAWeightAveraging``, any ``WeightAveraging``, ``StochasticWeightAveraging``)."""
    from lightning.pytorch import callbacks

    # WeightAveraging (and EMAWeightAveraging) came with Lightning 2.6.
    names = ("WeightAveraging", "StochasticWeightAveraging")
    kinds = tuple(getattr(callbacks, name) for name in names if hasattr(callbacks, name))
    return [c for c in trainer.callbacks if isinstance(c, kinds)]
