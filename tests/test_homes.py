"""The engine knows the blocks' homes through one interface: a kind of home written outside the package trains exactly.

`RecordingHomes` is what a new kind of home looks like: each block's home an object of its own class that satisfies
the `Home` protocol (here it delegates to the host tier's `BlockHome`, and counts), and a `Homes` subclass that
overrides the hooks it needs. Nothing in the engine changes for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.home import DeviceLayout, Event, Home, Homes, Link, ParamSlice
from lightning_superpipe.memory.host import BlockHome, build_homes
from lightning_superpipe.streaming import setup as streaming_setup
from tests import tasks

pytestmark = pytest.mark.usefixtures("emulated_link")


class RecordingHome:
    """A block's home of another class than the host tier's: it keeps a `BlockHome` and counts its copies."""

    def __init__(self, inner: BlockHome, calls: Counter[str]) -> None:
        self.inner, self.calls = inner, calls
        self.slices: Sequence[ParamSlice] = inner.slices
        self.numel, self.master_numel = inner.numel, inner.master_numel
        self.master_dtype = inner.master_dtype

    @property
    def transfer_dtype(self) -> torch.dtype:
        return self.inner.transfer_dtype

    @property
    def transfer_bytes(self) -> int:
        return self.inner.transfer_bytes

    @property
    def trainable(self) -> list[ParamSlice]:
        return self.inner.trainable

    def mark_changed(self, param: nn.Parameter) -> None:
        self.inner.mark_changed(param)

    def changed(self) -> list[ParamSlice]:
        return self.inner.changed()

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        self.calls["sync"] += 1
        self.inner.sync(pieces)

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        self.calls["copy_in"] += 1
        return self.inner.copy_in(dst, link, after, what, layout)

    def release(self) -> None:
        self.calls["release"] += 1
        self.inner.release()


class RecordingHomes(Homes):
    """A kind of home that counts the engine's calls of each hook and otherwise keeps the defaults."""

    def __init__(self, homes: Sequence[Optional[Home]], calls: Counter[str]) -> None:
        super().__init__(homes)
        self.calls = calls

    def attach(self, link: Any, arena: Any, overlap: Any, slots: int) -> None:
        self.calls["attach"] += 1
        super().attach(link, arena, overlap, slots)

    def read_ahead(self, indices: Iterable[int]) -> None:
        self.calls["read_ahead"] += 1

    def block_done(self, index: int) -> None:
        self.calls[f"block_done {index}"] += 1
        super().block_done(index)

    def end_backward(self) -> None:
        self.calls["end_backward"] += 1

    def copies_done(self) -> None:
        self.calls["copies_done"] += 1

    def finish_step(self, optimizer: Any) -> list[int]:
        self.calls["finish_step"] += 1
        return []

    def close(self) -> None:
        self.calls["close"] += 1
        super().close()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The strategy builds its host homes as `RecordingHomes` of `RecordingHome`s; returns the calls counted."""
    calls: Counter[str] = Counter()

    def build(*args: Any, **kwargs: Any) -> RecordingHomes:
        host = build_homes(*args, **kwargs)
        return RecordingHomes([RecordingHome(h, calls) if h is not None else None for h in host.homes], calls)

    monkeypatch.setattr(streaming_setup, "build_homes", build)
    return calls


def test_a_kind_of_home_of_its_own_trains_exactly_as_plain_lightning(recorded: Counter[str]) -> None:
    steps = 3
    plain = tasks.fit_family("llama", "auto", steps=steps)
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    streamed = tasks.fit_family("llama", strategy, steps=steps)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) == 0.0
    assert tasks.max_relative_difference(streamed, plain) == 0.0
    blocks = strategy.memory_report()["num_blocks"]
    # Each step's new weights of every block came in through its home.
    assert recorded["copy_in"] >= blocks * steps
    assert recorded["attach"] == recorded["close"] == 1
    assert recorded["release"] == blocks  # each home given back once, by the kind's close
    assert recorded["end_backward"] == recorded["copies_done"] >= steps
    assert recorded["finish_step"] == steps
    assert all(recorded[f"block_done {i}"] >= steps for i in range(blocks))
    assert recorded["read_ahead"] > 0
    assert recorded["sync"] >= blocks * (steps - 1)  # the steps' new masters taken in by each home
