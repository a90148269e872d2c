"""What planning sees of the streaming engine: the parts a profiled step measures and a plan re-places, typed, so
that planning needs nothing of :mod:`lightning_superpipe.streaming` (which imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch
from torch import nn

from lightning_superpipe.memory.home import Home


class LinkView(Protocol):
    """The engine's copier: whether copies return before they are done (CUDA, the emulated link)."""

    @property
    def asynchronous(self) -> bool: ...


class LedgerView(Protocol):
    """The engine's count of its device bytes (:class:`~lightning_superpipe.streaming.ledger.DeviceLedger`)."""

    @property
    def peak_bytes(self) -> int: ...

    @property
    def window_peak_bytes(self) -> int: ...

    @property
    def held(self) -> dict[str, int]: ...

    def start_window(self) -> None: ...


class ActivationsView(Protocol):
    """What the engine's activations count outside the blocks
    (:class:`~lightning_superpipe.streaming.activations.ActivationPlacement`)."""

    @property
    def outside_bytes(self) -> int: ...

    @property
    def outside_peak_bytes(self) -> int: ...

    def start_outside_window(self) -> None: ...


class PendingSteps(Protocol):
    """The optimizer steps launched and not yet waited for (:class:`~lightning_superpipe.stepping.pipelined.
    PipelinedStep`)."""

    def settle(self) -> None: ...


class PlannedEngine(Protocol):
    """The streaming engine (:class:`~lightning_superpipe.streaming.engine.StreamingEngine`) as the planner sees it:
    its device, copier, ledger, activations and homes to measure, the steps to wait for, and :meth:`replan`.

    Attributes:
        profiler: The planner's ``StepProfiler`` while it measures a step, which the engine's hooks report to.
    """

    device: torch.device
    copier: LinkView
    ledger: LedgerView
    activations: ActivationsView
    pending: PendingSteps
    profiler: Any

    @property
    def homes(self) -> Sequence[Optional[Home]]: ...

    def replan(self, resident: Sequence[int], prefetch: int, activations: Any) -> None: ...

    def trunk_parameters(self) -> list[nn.Parameter]: ...

    def trunk_device_bytes(self) -> int: ...
