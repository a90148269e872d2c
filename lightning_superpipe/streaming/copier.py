"""Copies between host and compute device, asynchronous on CUDA and plain on the CPU.

On CUDA, host-to-device copies run on their own stream and device-to-host copies on another, so both overlap
with compute on the current stream; events order them. On the CPU every copy is synchronous and every event is
``None``, so the engine above runs one code path for both.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

Event = Optional["torch.cuda.Event"]


class Copier:
    """Issues ordered copies for one compute device.

    Args:
        device: The compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        #: Copies return before they are done, so what they read or write must wait for their events.
        self.asynchronous = self.is_cuda
        #: Host buffers that copies read or write are page-locked (needed for truly asynchronous copies).
        self.pin_memory = self.is_cuda
        if self.is_cuda:
            self._h2d_stream = torch.cuda.Stream(device)
            self._d2h_stream = torch.cuda.Stream(device)

    def to_device(self, dst: Tensor, src: Tensor, after: Event = None) -> Event:
        """Copies host ``src`` into device ``dst`` once the compute work recorded in ``after`` is done.

        Returns:
            An event the compute stream waits for before reading ``dst``.
        """
        if not self.is_cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._h2d_stream):
            if after is not None:
                self._h2d_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            return self._record(self._h2d_stream)

    def to_host(self, dst: Tensor, src: Tensor) -> Event:
        """Copies device ``src`` (produced on the current stream) into host ``dst``.

        Returns:
            An event to :meth:`wait_on_host` before reading ``dst`` on the host.
        """
        if not self.is_cuda:
            dst.copy_(src)
            return None
        self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            dst.copy_(src, non_blocking=True)
            # The caching allocator must not hand ``src``'s memory to another tensor before this copy ran.
            src.record_stream(self._d2h_stream)
            return self._record(self._d2h_stream)

    def mark_compute(self) -> Event:
        """Records the compute work issued so far (e.g. the last kernel reading a buffer about to be reused)."""
        return self._record(torch.cuda.current_stream(self.device)) if self.is_cuda else None

    def wait_on_compute(self, event: Event) -> None:
        """Makes later compute wait for ``event`` (e.g. a copy into a buffer it is about to read)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def wait_on_host(event: Event) -> None:
        """Blocks the calling thread until ``event`` completed."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        """Waits for every copy issued so far (before the host writes buffers a copy may still read)."""
        if self.is_cuda:
            self._h2d_stream.synchronize()
            self._d2h_stream.synchronize()

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event
