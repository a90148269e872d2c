"""The building blocks of the planner's program (:mod:`.program`): linear expressions over its variables, the
knobs the user pinned, the placement it chose, and the classes of blocks that residency changes alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from lightning_superpipe.planning.cost import Prediction
from lightning_superpipe.planning.profile import Profile


class _Linear:
    """``sum(coefficient * x[index] for index, coefficient in terms) + constant`` over the program's variables."""

    __slots__ = ("terms", "constant")

    def __init__(self, terms: Optional[dict[int, float]] = None, constant: float = 0.0) -> None:
        self.terms = terms or {}
        self.constant = constant

    def __add__(self, other: Union[_Linear, float]) -> _Linear:
        if not isinstance(other, _Linear):
            return _Linear(dict(self.terms), self.constant + other)
        terms = dict(self.terms)
        for index, coefficient in other.terms.items():
            terms[index] = terms.get(index, 0.0) + coefficient
        return _Linear(terms, self.constant + other.constant)

    __radd__ = __add__

    def __mul__(self, factor: float) -> _Linear:
        terms = {index: coefficient * factor for index, coefficient in self.terms.items()}
        return _Linear(terms, self.constant * factor)

    __rmul__ = __mul__

    def __neg__(self) -> _Linear:
        return self * -1.0

    def __sub__(self, other: Union[_Linear, float]) -> _Linear:
        return self + (-other)

    def __rsub__(self, other: float) -> _Linear:
        return -self + other

    def value(self, x: np.ndarray) -> float:
        return sum(coefficient * x[index] for index, coefficient in self.terms.items()) + self.constant


def _total(expressions: Sequence[_Linear]) -> _Linear:
    """The sum of many expressions, without copying the growing one for each."""
    terms: dict[int, float] = {}
    constant = 0.0
    for expression in expressions:
        for index, coefficient in expression.terms.items():
            terms[index] = terms.get(index, 0.0) + coefficient
        constant += expression.constant
    return _Linear(terms, constant)


@dataclass(frozen=True)
class _Knobs:
    """What the user pinned; ``None`` leaves it to the solver."""

    resident_blocks: Optional[int]
    prefetch: Optional[int]
    activations: Optional[list[str]]

    def pinned(self) -> list[str]:
        """The pinned knobs as the user wrote them, e.g. ``["prefetch=2"]``."""
        knobs = [] if self.resident_blocks is None else [f"resident_blocks={self.resident_blocks}"]
        knobs += [] if self.prefetch is None else [f"prefetch={self.prefetch}"]
        return knobs + ([] if self.activations is None else [_describe_modes(self.activations)])


@dataclass(frozen=True)
class _Placement:
    """A placement the program chose, with predict's figures for it."""

    resident: frozenset[int]
    prefetch: int
    modes: list[str]
    prediction: Prediction

    def figure(self, name: str) -> float:
        """Its predicted ``"time"`` (seconds per step) or ``"peak"`` (bytes)."""
        return self.prediction.step_s if name == "time" else self.prediction.peak_bytes


def _residency_classes(profile: Profile) -> list[list[int]]:
    """The blocks that residency changes alike, in classes: it changes the model through ``s_i w_i`` (weights),
    ``r_i u_i w_i`` (refreshes) and the slots' bytes, with blocks 0 and N-1 singled out, so blocks alike in
    ``weight_bytes`` and ``u_i`` are interchangeable but for those two, each a class of its own."""
    count = len(profile.blocks)
    classes: dict[tuple, list[int]] = {}
    for i, block in enumerate(profile.blocks):
        classes.setdefault((i == 0, i == count - 1, block.weight_bytes, block.gradient_bytes > 0), []).append(i)
    return list(classes.values())


def _spread(members: Sequence[int], many: int) -> set[int]:
    """``many`` of a class's ``members``, evenly spaced: any of them give the same prediction, and these leave
    streamed blocks between them."""
    many = min(many, len(members))
    return {members[(2 * j + 1) * len(members) // (2 * many)] for j in range(many)}


def _every(i: int) -> bool:
    return True


def _first(i: int) -> bool:
    return i == 0


def _describe_modes(modes: Sequence[str]) -> str:
    """``activations='recompute' on every block``, or ``activations 'keep' on blocks 0-2, 'recompute' on block 3``."""
    if len(set(modes)) == 1:
        return f"activations={modes[0]!r} on every block"
    runs: list[tuple[str, int, int]] = []
    for index, mode in enumerate(modes):
        if runs and runs[-1][0] == mode:
            runs[-1] = (mode, runs[-1][1], index)
        else:
            runs.append((mode, index, index))
    return "activations " + ", ".join(
        f"{mode!r} on block {first}" if first == last else f"{mode!r} on blocks {first}-{last}"
        for mode, first, last in runs
    )
