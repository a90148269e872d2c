"""How a page's data reaches the device: copy engines (synchronous, or on a CUDA side stream) and the device copy
of a page they fill."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CopyEngine", "CudaCopyEngine", "DeviceCopy", "SyncCopyEngine"]


class CopyEngine:
    """Moves host tensors to the device; subclasses decide whether the copy is asynchronous.

    Args:
        device: Target device.
    """

    asynchronous = False
    """Whether uploads land later than :meth:`upload` returns (then promotions stay pending)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Start copying ``host`` to the device and return the device tensor."""
        return host.to(self.device)

    def fence(self) -> object | None:
        """Return a marker completed once all uploads issued so far have landed (``None``: already)."""
        return None

    def is_done(self, fence: object | None) -> bool:
        """Whether the uploads before ``fence`` have landed."""
        return fence is None

    def wait(self, fence: object | None) -> None:
        """Make the compute stream wait for ``fence`` before it uses the uploaded data."""

    def hand_over(self, tensor: torch.Tensor) -> None:
        """Tell the allocator that ``tensor``, uploaded by this engine, is now used by compute."""


class SyncCopyEngine(CopyEngine):
    """Synchronous copies (CPU, or CUDA when asynchronous moves are not wanted)."""


class CudaCopyEngine(CopyEngine):
    """Asynchronous host-to-device copies on a dedicated CUDA stream, ordered by events.

    Args:
        device: A CUDA device.
    """

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def fence(self) -> object | None:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def is_done(self, fence: object | None) -> bool:
        return fence is None or fence.query()

    def wait(self, fence: object | None) -> None:
        if fence is not None:
            torch.cuda.current_stream(self.device).wait_event(fence)

    def hand_over(self, tensor: torch.Tensor) -> None:
        # The tensor was allocated on the copy stream; without this its memory could be reused by
        # a later upload while a compute kernel still reads it.
        tensor.record_stream(torch.cuda.current_stream(self.device))


@dataclass
class DeviceCopy:
    """What of a page is (or is being put) on the device.

    Args:
        level: Precision this data provides, ``TOP_LEVEL`` or a number of bit planes.
        weight: Original weights (``TOP_LEVEL`` only).
        segments: Bit plane segments, consecutive, starting at plane 0 (or, for a pending
            promotion, at the plane the page already has).
        scale: Group scales (bit-plane levels only).
        minimum: Group minima (bit-plane levels only).
        fence: Copy marker; the data may be read once it has completed.
    """

    level: int
    weight: torch.Tensor | None = None
    segments: list[torch.Tensor] = field(default_factory=list)
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    fence: object | None = None

    def tensors(self) -> list[torch.Tensor]:
        """All device tensors held."""
        held = [self.weight, self.scale, self.minimum, *self.segments]
        return [t for t in held if t is not None]

    def nbytes(self) -> int:
        """Device bytes held."""
        return sum(t.nbytes for t in self.tensors())

