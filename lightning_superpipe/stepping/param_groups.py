"""Restricting an optimizer's parameter groups to some of their parameters, so that its own ``step`` updates only
those (with their groups' hyperparameters, state and learning rate as configured).

Here, below both users, because the disk tier (:mod:`lightning_superpipe.memory.disk`) steps a block's parameters
this way, as the overlapped step (:mod:`lightning_superpipe.stepping.overlap`) does, and memory/ must not import
streaming/.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.optim import Optimizer


def restrict(optimizer: Optimizer, keep: set[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Leaves each of ``optimizer``'s parameter groups only its parameters in ``keep``; returns the groups' full
    parameter lists, for :func:`unrestrict`."""
    groups = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p in keep]
    return groups


def unrestrict(optimizer: Optimizer, groups: list[list[nn.Parameter]]) -> None:
    """Gives ``optimizer``'s parameter groups back the parameter lists :func:`restrict` returned."""
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params


@contextmanager
def restricted(optimizer: Optimizer, keep: set[nn.Parameter]) -> Iterator[None]:
    """``optimizer``'s parameter groups restricted to ``keep`` inside the ``with`` block (whole again after it, also
    after an error)."""
    groups = restrict(optimizer, keep)
    try:
        yield
    finally:
        unrestrict(optimizer, groups)
