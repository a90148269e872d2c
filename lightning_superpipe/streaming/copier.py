"""Copies between host and compute device: ordered by events, asynchronous on CUDA, plain on the CPU.

Three copiers share one interface, so the engine above runs one code path:

* :class:`Copier`, for a CPU compute device: every copy is done when it returns and every event is ``None``.
* :class:`CudaCopier`: host-to-device copies run on their own stream and device-to-host copies on another, so both
  overlap with compute; events order them against the compute stream of the pass.
* ``EmulatedCopier`` (:mod:`.emulated`): the CUDA protocol emulated on the CPU, with deferred copies and a
  happens-before checker, so that ordering bugs show on machines without a GPU.

The protocol: a copy into a buffer is issued ``after`` an event that covers compute's last use of that buffer;
compute waits (:meth:`Copier.wait_on_compute`) for a copy's event before it reads what the copy wrote; host code
waits (:meth:`Copier.wait_on_host`) before it reads a device-to-host copy's destination; :meth:`Copier.synchronize`
before the host writes a buffer that a copy may still be reading.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor

#: An opaque marker of work issued so far on one stream (``None``: nothing to wait for).
Event = Optional[Any]


class Copier:
    """Synchronous copies for a CPU compute device.

    Args:
        device: The compute device.
    """

    #: Copies return before they are done, so what they read or write must wait for their events.
    asynchronous = False
    #: Host buffers that copies read or write are page-locked (needed for truly asynchronous copies).
    pin_memory = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_device(self, dst: Tensor, src: Tensor, after: Event = None, what: str = "") -> Event:
        """Copies host ``src`` into device ``dst`` once the compute work recorded in ``after`` is done.

        Args:
            dst: The device buffer.
            src: The host buffer; it must not be written until the copy is done.
            after: Compute's last use of ``dst`` (:meth:`mark_compute`); ``None`` only where compute never used it.
            what: What ``dst`` is, for error messages.

        Returns:
            An event the compute stream waits for before reading ``dst``.
        """
        dst.copy_(src)
        return None

    def to_host(self, dst: Tensor, src: Tensor, what: str = "") -> Event:
        """Copies device ``src`` (produced by the compute issued so far) into host ``dst``.

        Returns:
            An event to :meth:`wait_on_host` before reading ``dst`` on the host.
        """
        dst.copy_(src)
        return None

    def begin_pass(self) -> None:
        """Takes the stream current now as the compute stream of the pass that starts (CUDA)."""

    def mark_compute(self) -> Event:
        """Records the compute work issued so far (e.g. the last kernel reading a buffer about to be reused)."""
        return None

    def wait_on_compute(self, event: Event) -> None:
        """Makes later compute wait for ``event`` (e.g. a copy into a buffer it is about to read)."""

    def wait_on_host(self, event: Event) -> None:
        """Blocks the calling thread until ``event`` completed."""

    def synchronize(self) -> None:
        """Waits for every copy issued so far (before the host writes buffers a copy may still read)."""

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (streaming cannot be captured)."""
        return False

    def refuse_capture(self) -> None:
        """Raises where the current stream is capturing a CUDA graph: the weights of each block arrive by copies
        ordered at run time, which a captured graph would replay from stale buffers."""
        if self.capturing():
            raise RuntimeError(
                "SuperpipeStrategy cannot stream blocks inside CUDA graph capture: the weights of each block arrive by"
                " copies ordered at run time, which a captured graph would replay from stale buffers. Do not capture"
                " the model (`torch.cuda.graph`, `torch.compile(mode='reduce-overhead')`) while it streams."
            )

    def thread_initializer(self) -> Optional[Callable[[], None]]:
        """A function to run first in every thread the engine starts (the gradient worker), if any."""
        return None

    def close(self) -> None:
        """Waits for outstanding copies and releases what the copier holds."""
        self.synchronize()


class CudaCopier(Copier):
    """Asynchronous copies on two side streams of a CUDA device, ordered by CUDA events."""

    asynchronous = True
    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._h2d_stream = torch.cuda.Stream(device)
        self._d2h_stream = torch.cuda.Stream(device)
        self._compute_stream = torch.cuda.current_stream(device)

    def to_device(self, dst: Tensor, src: Tensor, after: Event = None, what: str = "") -> Event:
        with torch.cuda.stream(self._h2d_stream):
            if after is not None:
                self._h2d_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            return self._record(self._h2d_stream)

    def to_host(self, dst: Tensor, src: Tensor, what: str = "") -> Event:
        # ``src`` was produced on the stream the pass runs on: in backward, the autograd thread's current stream,
        # which is the stream of the forward op.
        self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            dst.copy_(src, non_blocking=True)
            # The caching allocator must not hand ``src``'s memory to another tensor before this copy ran.
            src.record_stream(self._d2h_stream)
            return self._record(self._d2h_stream)

    def begin_pass(self) -> None:
        # Forward and backward run on the stream current when the step starts (the user's, under
        # ``torch.cuda.stream(s)``); the engine's later events must be recorded on that one, not on whatever is
        # current when backward has returned.
        self._compute_stream = torch.cuda.current_stream(self.device)

    def mark_compute(self) -> Event:
        return self._record(self._compute_stream)

    def wait_on_compute(self, event: Event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_on_host(self, event: Event) -> None:
        if event is not None:
            event.synchronize()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        self._h2d_stream.synchronize()
        self._d2h_stream.synchronize()

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event


class OtherLink(Protocol):
    """A link other than the device's own (an :class:`~lightning_superpipe.EmulatedLink`): it makes the copier."""

    def copier(self, device: torch.device) -> Copier: ...


def make_copier(device: torch.device, link: Optional[OtherLink] = None) -> Copier:
    """The copier for ``device``: ``link``'s (an ``EmulatedLink``) when given, else CUDA's or the plain one."""
    if link is not None:
        return link.copier(device)
    return CudaCopier(device) if device.type == "cuda" else Copier(device)
