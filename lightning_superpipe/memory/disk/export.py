"""Plain safetensors files written one tensor at a time (for inference, from the tier's committed masters), and
the pages of file-mapped tensors given back once they are written."""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_superpipe.memory.disk.buffers import _byte_view
from lightning_superpipe.memory.disk.file_io import _io_error
from lightning_superpipe.memory.disk.space import PathLike
from lightning_superpipe.memory.pinned import PAGE

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL"}


def write_safetensors(
    path: PathLike,
    layout: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    tensors: Iterable[Tensor],
    dtype: Optional[torch.dtype] = None,
    metadata: Optional[Mapping[str, str]] = None,
    written: Optional[Callable[[Tensor], None]] = None,
) -> None:
    """Writes a safetensors file one tensor at a time (``safetensors``' own writer holds every tensor's bytes at
    once): the header from ``layout`` (name, dtype, shape of each), then each of ``tensors`` in that order, cast to
    ``dtype`` where it is floating-point, each handed to ``written`` once its bytes are out. The file appears whole or
    not at all (written beside, ``fsync``ed, renamed).

    Raises:
        DiskTierError: Naming the file, where writing it failed (a missing folder, a full disk).
    """

    def out_dtype(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, d, shape in layout:
        nbytes = math.prod(shape) * out_dtype(d).itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[out_dtype(d)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    iterator = iter(tensors)
    try:
        with open(temporary, "wb") as out:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for name, _, shape in layout:
                tensor = next(iterator, None)
                if tensor is None or tuple(tensor.shape) != tuple(shape):
                    found = "no tensor" if tensor is None else f"shape {tuple(tensor.shape)}"
                    raise ValueError(f"write_safetensors: {name} has {found}, not shape {tuple(shape)}.")
                _write_tensor(out, tensor.detach().to("cpu", out_dtype(tensor.dtype)))
                if written is not None:
                    written(tensor)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise _io_error("writing", target, error) from error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # a generator's clean-up (a lease it holds) runs now, also after a failure


#: ``madvise`` advice that reclaims pages now (Linux 5.4): clean file pages are dropped, to be read again if touched.
_MADV_PAGEOUT = 21


class MappedFiles:
    """This process's private file mappings (``/proc/self/maps``, read when built), so that a reader of tensors mapped
    from files (:meth:`DiskStore.map_masters`: the parameters after a disk-tier run) can give their pages back once
    read: mapped pages count in the resident set until reclaimed. Anonymous memory (a model in RAM) is never
    advised: reclaiming it would push it to swap."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    # Private file mappings only: a shared one (the node's homes in /dev/shm) may be another
                    # process's working memory.
                    private = len(fields) == 6 and fields[1].endswith("p")
                    if private and fields[5].startswith("/") and int(fields[4]) != 0:
                        start, end = (int(address, 16) for address in fields[0].split("-"))
                        self._ranges.append((start, end))
        except OSError:
            pass  # not Linux: nothing to give back
        self._ranges.sort()
        self._libc = ctypes.CDLL(None, use_errno=True) if self._ranges else None

    def maps(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s bytes (a contiguous tensor's) lie in a file mapping."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(low <= start and end <= high for low, high in self._ranges)

    def release(self, tensor: Tensor) -> None:
        """Reclaims the pages of a contiguous ``tensor`` if it is file-mapped (its values stay: they are read again
        from the file, or from swap for pages written since, when touched). Silently nothing on older kernels."""
        if self._libc is None or not tensor.is_contiguous() or not self.maps(tensor):
            return
        start = tensor.data_ptr()
        first = start - start % PAGE
        length = start + tensor.numel() * tensor.element_size() - first
        self._libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_PAGEOUT)


def _write_tensor(out: Any, tensor: Tensor) -> None:
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    if flat.numel():
        out.write(_byte_view(flat, flat.numel()))
