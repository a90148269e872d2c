"""The host tier: where every streamed block's parameters live between uses.

Each block's parameters are re-homed into one flat host buffer (pinned when the compute device is CUDA, so
copies to the device are truly asynchronous) and the ``nn.Parameter`` objects become views of it. One flat
buffer per block turns a block's transfer into a single large copy instead of dozens of small ones. When the
device computes in a narrower dtype than the fp32 masters (``bf16-mixed``, ``16-mixed``), a second flat
buffer holds the weights in that dtype, so only half the bytes cross the link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class HostMemoryError(MemoryError):
    """Raised before pinning when the host lacks the memory a run needs, instead of an out-of-memory kill."""


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter sits inside its block's flat buffers."""

    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size

    def view_of(self, flat: Tensor) -> Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


class BlockHome:
    """The host home of one block's parameters.

    Args:
        params: The block's parameters, without duplicates. They must share one dtype.
        transfer_dtype: The dtype the weights travel and compute in on the device.
        pin: Whether to allocate page-locked memory (only with a CUDA compute device).
    """

    def __init__(self, params: Sequence[nn.Parameter], transfer_dtype: torch.dtype, pin: bool) -> None:
        dtypes = {param.dtype for param in params}
        if len(dtypes) != 1:
            raise TypeError(f"The parameters of one block must share a dtype to stream together, found {dtypes}.")
        self.master_dtype = dtypes.pop()
        self.slices: list[ParamSlice] = []
        offset = 0
        for param in params:
            self.slices.append(ParamSlice(param, offset, param.numel(), param.shape))
            offset += _aligned(param.numel())
        self.numel = offset
        self.master = _empty_host(self.numel, self.master_dtype, pin)
        self.master.zero_()  # the alignment gaps are copied too; keep them defined
        for piece in self.slices:
            piece.view_of(self.master).copy_(piece.param.detach())
            # The optimizer, checkpoints and the user keep using the same Parameter objects; only their storage
            # moves into the flat buffer.
            piece.param.data = piece.view_of(self.master)
        if transfer_dtype == self.master_dtype:
            self.transfer = self.master
        else:
            self.transfer = _empty_host(self.numel, transfer_dtype, pin)
            self.transfer.copy_(self.master)
        self.trainable = [piece for piece in self.slices if piece.param.requires_grad]

    @property
    def transfer_bytes(self) -> int:
        """Bytes that cross the link for one copy of this block."""
        return self.numel * self.transfer.element_size()

    @property
    def host_bytes(self) -> int:
        """Host bytes held by this home (masters plus the transfer copy when it is separate)."""
        extra = 0 if self.transfer is self.master else self.transfer_bytes
        return self.numel * self.master.element_size() + extra

    def refresh_transfer(self, everything: bool = False) -> None:
        """Brings the transfer copy up to date with the masters after they changed.

        Args:
            everything: Refresh frozen parameters too (after a checkpoint load); by default only trainable
                parameters change between steps, so only they are converted.
        """
        if self.transfer is self.master:
            return
        for piece in self.slices if everything else self.trainable:
            piece.view_of(self.transfer).copy_(piece.view_of(self.master))


#: Every parameter starts on a multiple of this many elements (256 bytes in fp32): kernels take the same aligned
#: code paths as for separately allocated tensors, so results match plain training bit for bit.
ALIGNMENT = 64


def _aligned(numel: int) -> int:
    return -(-numel // ALIGNMENT) * ALIGNMENT


def _empty_host(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, or ``None`` where the platform does not report it."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(needed_bytes: int, what: str) -> None:
    """Raises :class:`HostMemoryError` when the host cannot hold ``needed_bytes`` more.

    Args:
        needed_bytes: Bytes the run is about to allocate on the host.
        what: What the bytes are for, quoted in the message.
    """
    available = available_host_bytes()
    if available is None or needed_bytes <= available:
        return
    raise HostMemoryError(
        f"SuperpipeStrategy needs about {_gib(needed_bytes)} more host memory ({what}) but only {_gib(available)}"
        " is available. Free host memory, train fewer parameters (e.g. LoRA), use `precision='bf16-true'`, or use"
        " a machine with more RAM."
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**20 else f"{math.ceil(nbytes / 2**10)} KiB"
