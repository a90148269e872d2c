"""Lightning strategies."""

from lightning_superpipe.strategies.superpipe import SuperpipeStrategy

__all__ = ["SuperpipeStrategy"]
