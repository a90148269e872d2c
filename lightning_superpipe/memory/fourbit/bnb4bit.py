"""bitsandbytes' 4-bit weights as packed weights (:mod:`.packed`): QLoRA's frozen base streamed in its 4-bit form.

A ``bitsandbytes.nn.Linear4bit`` (made by ``transformers``' ``BitsAndBytesConfig(load_in_4bit=True)``, by peft around
it, or by Lightning's ``BitsandbytesPrecision``) holds its weight as a ``Params4bit``: ``uint8`` (or the
``quant_storage`` dtype) packing two 4-bit codes per byte, shape ``[n/2, 1]``, with a ``QuantState`` as a plain
attribute (neither parameter nor buffer): ``absmax`` (one scale per block of 64 weights), ``code`` (the NF4 or FP4
codebook), and with double quantization the scales themselves quantized: ``absmax`` in ``uint8``, an ``offset``, and a
nested state (``state2``) with its own ``absmax`` and ``code``. The layer's forward calls ``bnb.matmul_4bit(x,
self.weight, quant_state=self.weight.quant_state)``, which reads all of them.

Here such a weight is taken apart into the packed data and every tensor of its state (found by walking the state, so
that whatever a version of bitsandbytes keeps there travels), and rebuilt on the device as a ``Params4bit`` whose
``quant_state`` is a copy of the host's with its tensors pointed at the device views: the layer's own kernels then
compute exactly what they compute on the host. The copy is made at every binding, so what a kernel changes on it
(bitsandbytes repacks weights for CPU inference in place) never reaches the host's state.

Nothing here imports bitsandbytes: the classes are the parameter's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

#: A path of attribute names from a ``QuantState`` to one of its tensors (``("state2", "absmax")``).
StatePath = tuple[str, ...]


def is_params4bit(param: nn.Parameter) -> bool:
    """Whether ``param`` is a quantized bitsandbytes 4-bit weight (a ``Params4bit`` holding its ``quant_state``)."""
    cls = type(param)
    return (
        cls.__name__ == "Params4bit"
        and cls.__module__.startswith("bitsandbytes")
        and getattr(param, "quant_state", None) is not None
        and bool(getattr(param, "bnb_quantized", False))
    )


def state_paths(state: Any, prefix: StatePath = ()) -> list[StatePath]:
    """The paths to every tensor of ``state`` and of its nested states, in a fixed order (by attribute name)."""
    paths: list[StatePath] = []
    for name, value in sorted(vars(state).items()):
        if isinstance(value, Tensor):
            paths.append((*prefix, name))
        elif value is not None and type(value) is type(state):
            paths += state_paths(value, (*prefix, name))
    return paths


def get_path(state: Any, path: StatePath) -> Any:
    """The value at ``path`` in ``state`` (a tensor, or a nested state for a shorter path)."""
    for name in path:
        state = getattr(state, name)
    return state


def set_path(state: Any, path: StatePath, value: Tensor) -> None:
    """Puts ``value`` at ``path`` in ``state``."""
    setattr(get_path(state, path[:-1]), path[-1], value)


def copied_state(state: Any) -> Any:
    """A shallow copy of ``state`` and of its nested states (their tensors shared until replaced). Made without
    ``copy.copy``, which would consult ``QuantState.__getattr__``."""
    copy = object.__new__(type(state))
    copy.__dict__.update(vars(state))
    for name, value in vars(state).items():
        if value is not None and type(value) is type(state):
            setattr(copy, name, copied_state(value))
    return copy


class Bnb4bitFormat:
    """bitsandbytes' ``Params4bit`` as a :class:`~.packed.PackedFormat`."""

    name = "bitsandbytes 4-bit"

    def tensors(self, param: nn.Parameter) -> list[Tensor]:
        """The packed data, then the quantization state's tensors (absmax, code, and with double quantization the
        offset and the nested state's absmax and code)."""
        state = param.quant_state  # type: ignore[attr-defined]
        return [param.data, *(get_path(state, path) for path in state_paths(state))]

    def rebuild(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> Tensor:
        """A ``Params4bit`` on ``tensors`` with a copy of ``param``'s state pointed at them (``param`` unchanged)."""
        host_state = param.quant_state  # type: ignore[attr-defined]
        state = copied_state(host_state)
        for path, tensor in zip(state_paths(host_state), tensors[1:]):
            set_path(state, path, tensor)
        return type(param)(
            data=tensors[0],
            requires_grad=False,
            quant_state=state,
            blocksize=param.blocksize,  # type: ignore[attr-defined]
            compress_statistics=param.compress_statistics,  # type: ignore[attr-defined]
            quant_type=param.quant_type,  # type: ignore[attr-defined]
            quant_storage=param.quant_storage,  # type: ignore[attr-defined]
            module=None,  # only its quantization (done already) reads it
            bnb_quantized=True,
        )

    def rehome(self, param: nn.Parameter, tensors: Sequence[Tensor]) -> None:
        """Points ``param``'s data and its state's tensors (shared with its layer's ``quant_state``) at
        ``tensors``."""
        state = param.quant_state  # type: ignore[attr-defined]
        paths = state_paths(state)
        param.data = tensors[0]
        for path, tensor in zip(paths, tensors[1:]):
            set_path(state, path, tensor)

    def logical_numel(self, param: nn.Parameter) -> int:
        """The weights of the unpacked matrix (``quant_state.shape``)."""
        return math.prod(param.quant_state.shape)  # type: ignore[attr-defined]

    def materialized_bytes(self, param: nn.Parameter) -> int:
        """Nothing: the rebuilt ``Params4bit`` is views of the slot, and bitsandbytes' kernel reads them as they are."""
        return 0


#: The one instance: the format holds no state.
BNB_4BIT = Bnb4bitFormat()
