"""A kind of home is added by registering it: the engine, the run and the strategy change nothing for it.

`DictKind` is what a new kind of home looks like from outside the package: each block's home keeps its masters in a
plain dict of tensors (the parameters themselves, by name) and copies them into the device buffer one by one; its kind
builds them, and `lightning_superpipe.register_home_kind` makes it `SuperpipeStrategy(offload_device="dict")`. It
trains bitwise as plain Lightning. `RecordingKind` counts the engine's calls of each hook of its homes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import lightning_superpipe
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory import HomeKind, Homes, HomesBuilder, HomesRun, unregister_home_kind
from lightning_superpipe.memory.home import DeviceLayout, Event, Home, Link, ParamSlice, aligned
from lightning_superpipe.memory.host import BlockHome, build_homes
from lightning_superpipe.memory.pinned import HostArena
from lightning_superpipe.run.options import KnobError
from tests import tasks

pytestmark = pytest.mark.usefixtures("emulated_link")


class DictHome:
    """A block's home that keeps its masters in a plain dict of tensors, the parameters by name, as they are (the
    optimizer steps them in place); a copy to the device copies each into its place in the block's buffer.

    With ``notices_steps=False`` it copies the values each parameter had when the run started: the device never sees
    a step (a broken home).
    """

    def __init__(self, params: Sequence[nn.Parameter], notices_steps: bool = True) -> None:
        self.masters: dict[str, nn.Parameter] = {f"p{i}": param for i, param in enumerate(params)}
        self.slices: list[ParamSlice] = []
        offset = 0
        for param in self.masters.values():  # each on an aligned offset, as the host tier lays them out
            self.slices.append(ParamSlice(param, offset, param.numel(), param.shape))
            offset += aligned(param.numel())
        self.numel = self.master_numel = offset
        self.master_dtype = params[0].dtype
        self._sources = {p: p.detach() if notices_steps else p.detach().clone() for p in self.masters.values()}
        self._seen = {piece.param: self._state(piece.param) for piece in self.slices}
        self._forced: set[nn.Parameter] = set()

    @staticmethod
    def _state(param: nn.Parameter) -> tuple[int, int]:
        return param._version, param.data_ptr()

    @property
    def transfer_dtype(self) -> torch.dtype:
        return self.master_dtype

    @property
    def transfer_bytes(self) -> int:
        return self.numel * self.master_dtype.itemsize

    @property
    def trainable(self) -> list[ParamSlice]:
        return [piece for piece in self.slices if piece.param.requires_grad]

    def mark_changed(self, param: nn.Parameter) -> None:
        self._forced.add(param)

    def changed(self) -> list[ParamSlice]:
        return [piece for piece in self.slices
                if piece.param in self._forced or self._state(piece.param) != self._seen[piece.param]]

    def sync(self, pieces: Sequence[ParamSlice]) -> None:
        for piece in pieces:
            self._seen[piece.param] = self._state(piece.param)
            self._forced.discard(piece.param)

    def copy_in(self, dst: Tensor, link: Link, after: Event, what: str, layout: Optional[DeviceLayout] = None) -> Event:
        done: Event = None
        for piece in layout.slices if layout is not None else self.slices:  # one stream: the last event covers all
            done = link.to_device(piece.view_of(dst), self._sources[piece.param], after, what)
        return done

    def release(self) -> None:
        """Nothing to give back: the parameters were never moved."""


class DictKind(HomeKind):
    """``offload_device="dict"``: every block's masters in a dict of its own; gradients in ``.grad`` (the default
    hooks of :class:`Homes`)."""

    name = "dict"
    summary = "each block's masters in a plain dict of tensors"
    title = "the dict homes"
    purpose = "keep each block in a dict"

    def __init__(self, notices_steps: bool = True) -> None:
        self.notices_steps = notices_steps

    def prepare(self, run: HomesRun) -> HomesBuilder:
        return _DictBuilder(run.block_params, self.notices_steps)


class _DictBuilder(HomesBuilder):
    def __init__(self, block_params: list[list[nn.Parameter]], notices_steps: bool) -> None:
        self.block_params, self.notices_steps = block_params, notices_steps

    def homes(self, arena: HostArena) -> Homes:
        return Homes([DictHome(params, self.notices_steps) if params else None for params in self.block_params])


@pytest.fixture
def registered() -> Iterator[list[HomeKind]]:
    """Registers the kinds a test appends (through the public call) and takes them out again after it."""
    kinds: list[HomeKind] = []
    yield kinds
    for kind in kinds:
        unregister_home_kind(kind.name)


def test_a_kind_of_home_registered_from_outside_trains_exactly_as_plain_lightning(registered: list[HomeKind]) -> None:
    registered.append(lightning_superpipe.register_home_kind(DictKind()))
    steps = 3
    plain = tasks.fit_family("llama", "auto", steps=steps)
    strategy = SuperpipeStrategy(offload_device="dict", resident_blocks=1, prefetch=1)
    streamed = tasks.fit_family("llama", strategy, steps=steps)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) == 0.0
    assert tasks.max_relative_difference(streamed, plain) == 0.0
    assert strategy.memory_report()["num_blocks"] > 1


def test_a_kind_of_home_that_misses_the_steps_is_seen_to_train_differently(registered: list[HomeKind]) -> None:
    """The comparison above fails for a broken home: the device keeps the first weights of the streamed blocks."""
    registered.append(lightning_superpipe.register_home_kind(DictKind(notices_steps=False)))
    plain = tasks.fit_family("llama", "auto", steps=3)
    streamed = tasks.fit_family("llama", SuperpipeStrategy(offload_device="dict", resident_blocks=0), steps=3)
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) > 0.0


def test_an_unregistered_kind_is_refused_in_the_constructor_naming_the_registered_ones(
    registered: list[HomeKind],
) -> None:
    with pytest.raises(KnobError, match=r"offload_device must be 'cpu' \(the default: .*\) or 'disk' \("):
        SuperpipeStrategy(offload_device="dict")
    registered.append(lightning_superpipe.register_home_kind(DictKind()))
    SuperpipeStrategy(offload_device="dict")
    with pytest.raises(KnobError, match="offload_path is used only by the disk tier"):
        SuperpipeStrategy(offload_device="dict", offload_path="somewhere")
    unregister_home_kind("dict")
    with pytest.raises(KnobError, match=r"'disk' \(.*\)\.$"):
        SuperpipeStrategy(offload_device="dict")


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
    """Homes that count the engine's calls of each hook and otherwise keep the defaults."""

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


class RecordingKind(HomeKind):
    """``offload_device="recording"``: the host tier's homes, wrapped so that every call is counted."""

    name = "recording"
    summary = "the host tier's homes, each call counted"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def prepare(self, run: HomesRun) -> HomesBuilder:
        kind = self

        class Builder(HomesBuilder):
            def homes(self, arena: HostArena) -> Homes:
                host = build_homes(run.block_params, run.transfer_dtype, arena)
                wrapped = [RecordingHome(h, kind.calls) if isinstance(h, BlockHome) else None for h in host.homes]
                return RecordingHomes(wrapped, kind.calls)

        return Builder()


def test_the_engine_calls_each_hook_of_a_registered_kind_where_it_should(registered: list[HomeKind]) -> None:
    kind = RecordingKind()
    registered.append(lightning_superpipe.register_home_kind(kind))
    recorded, steps = kind.calls, 3
    plain = tasks.fit_family("llama", "auto", steps=steps)
    strategy = SuperpipeStrategy(offload_device="recording", resident_blocks=0, prefetch=1)
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
