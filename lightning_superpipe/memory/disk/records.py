"""A block's record: its fp32 masters and optimizer state laid out in one file, and how the state is sized, encoded
and read back.

A record holds the block's masters first (in the block's parameter order, each on :data:`ENTRY_ALIGNMENT` bytes)
and then its state tensors; non-tensor state values go to the manifest (as JSON, or pickled)."""

from __future__ import annotations

import base64
import inspect
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_superpipe.memory.pinned import PAGE, page_rounded

#: Every master of a record starts on this many bytes (64 fp32 elements, the host tier's alignment), so kernels take
#: the same vectorized paths as for separately allocated tensors and the masters' region is the host tier's flat
#: layout of the block.
ENTRY_ALIGNMENT = 256
#: Every state tensor starts on a page (and the state after the masters' region on the next page), so that a piece of
#: a record (a parameter, or a slice of one on :data:`~.pieces.SLICE_ELEMENTS` elements) reads and writes its state
#: with ``O_DIRECT`` on pages of its own. Records written before used 256 bytes; their entries' offsets are in the
#: manifest and are read as they are.
STATE_ALIGNMENT = PAGE


@dataclass(frozen=True)
class StateSize:
    """The optimizer state one parameter takes: ``per_element`` bytes per element of the parameter in
    ``element_tensors`` tensors, plus ``fixed_tensors`` small tensors (e.g. Adam's ``step``), each on its own
    :data:`STATE_ALIGNMENT` in a record."""

    per_element: float
    fixed_tensors: int
    element_tensors: int = 0

    def record_bytes(self, numel: int) -> int:
        tensors = max(self.element_tensors, 1)
        return (tensors * page_rounded(int(self.per_element * numel / tensors))
                + self.fixed_tensors * STATE_ALIGNMENT)


def probe_state_size(optimizer: Optional[Optimizer]) -> StateSize:
    """How much state ``optimizer`` keeps per parameter, measured by stepping a fresh optimizer of the same class and
    defaults over a small probe parameter (state is created lazily, so the real one has none before its first step).
    Falls back to Adam's size (two fp32 moments and a step) for an optimizer that cannot be probed so."""
    if optimizer is None:
        return StateSize(0.0, 0)
    numel = 4096
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        probe = nn.Parameter(torch.zeros(numel))
        probe.grad = torch.full((numel,), 1e-3)
        fresh = type(optimizer)([probe], **defaults)
        fresh.step()
        per_element, fixed, tensors = 0.0, 0, 0
        for value in fresh.state[probe].values():
            if isinstance(value, Tensor):
                if value.numel() == numel:
                    per_element += value.element_size()
                    tensors += 1
                else:
                    fixed += 1
        return StateSize(per_element, fixed, tensors)
    except Exception:  # an optimizer that needs a closure or other constructor arguments: assume Adam-like
        return StateSize(8.0, 1, 2)


@dataclass
class Entry:
    """One tensor of a block's record: a master (``key`` is ``None``) or a state tensor of parameter ``param``."""

    param: int
    key: Optional[str]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def view_of(self, buffer: Tensor) -> Tensor:
        """This entry's tensor inside a record held in the uint8 ``buffer``."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"param": self.param, "key": self.key, "dtype": _dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        return cls(int(data["param"]), data["key"], _DTYPES[data["dtype"]], tuple(data["shape"]), int(data["offset"]))


@dataclass
class Record:
    """Where a block's committed record lives (its slot) and how it is laid out."""

    slot: int
    entries: list[Entry]
    #: Non-tensor state per parameter index, encoded for JSON (see :func:`_encode_value`).
    values: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def file_bytes(self) -> int:
        return page_rounded(max(self.nbytes, 1))

    def masters(self) -> list[Entry]:
        return [e for e in self.entries if e.key is None]

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "file_bytes": self.file_bytes, "entries": [e.to_json() for e in self.entries],
                "values": {str(k): v for k, v in self.values.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        return cls(int(data["slot"]), [Entry.from_json(e) for e in data["entries"]],
                   {int(k): dict(v) for k, v in data["values"].items()})


def _layout(params: Sequence[Tensor], states: Sequence[Mapping[str, Any]]) -> tuple[list[Entry], dict[int, dict]]:
    """The record of a block: masters first (so a forward reads a prefix), then each parameter's state tensors, from
    the page after the masters, each on a page."""
    entries: list[Entry] = []
    offset = 0
    for index, param in enumerate(params):
        entries.append(Entry(index, None, param.dtype, tuple(param.shape), offset))
        offset += _aligned(entries[-1].nbytes)
    offset = page_rounded(offset)
    values: dict[int, dict[str, Any]] = {}
    for index, state in enumerate(states):
        for key, value in state.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"The disk tier stores optimizer state under string keys; this optimizer uses the key {key!r}"
                    f" ({type(key).__name__}). Use offload_device='cpu' with this optimizer."
                )
            if isinstance(value, Tensor):
                if value.device.type != "cpu":
                    raise TypeError(
                        f"Optimizer state {key!r} is on {value.device}; the disk tier keeps host optimizer state only."
                    )
                entries.append(Entry(index, key, value.dtype, tuple(value.shape), offset))
                offset += page_rounded(entries[-1].nbytes)
            else:
                values.setdefault(index, {})[key] = _encode_value(value)
    return entries, values


def _master_bytes(params: Sequence[Tensor]) -> int:
    return sum(_aligned(p.numel() * p.element_size()) for p in params)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ENTRY_ALIGNMENT) * ENTRY_ALIGNMENT


def _encode_value(value: Any) -> dict[str, Any]:
    """A non-tensor state value for the manifest: as JSON when it survives the round trip, else pickled."""
    try:
        decoded = json.loads(json.dumps(value))
        if decoded == value and type(decoded) is type(value):  # a tuple would come back as a list
            return {"json": value}
    except (TypeError, ValueError):
        pass
    return {"pickle": base64.b64encode(pickle.dumps(value)).decode("ascii")}


def _decode_value(data: Mapping[str, Any]) -> Any:
    if "json" in data:
        return data["json"]
    return pickle.loads(base64.b64decode(data["pickle"]))


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64)
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"The disk tier cannot store tensors of dtype {dtype}.")
    return name


def _own_state(optimizer: Optional[Optimizer], param: nn.Parameter) -> dict[str, Any]:
    if optimizer is None or param not in optimizer.state:
        return {}
    return dict(optimizer.state[param])


def _tensor_of(entry: Entry, params: Sequence[Tensor], states: Sequence[Mapping[str, Any]]) -> Tensor:
    return params[entry.param].detach() if entry.key is None else states[entry.param][entry.key]


def _signature(entry: Entry) -> tuple[Any, ...]:
    return entry.param, entry.key, entry.dtype, entry.shape, entry.offset
