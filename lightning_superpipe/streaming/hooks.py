"""Hooks that make a host-resident model compute with device weights.

Each hook has one job, and attaching or detaching it twice is harmless:

* :class:`BlockStreamingHook` wraps a block's ``forward``: it borrows the block's weights from the engine for
  the call and, when gradients are on, checkpoints the call so that backward recomputes it with the weights
  fetched again. Autograd therefore never keeps a reference to a block's device weights after the block is
  done, and the engine can reuse its slot.
* :class:`TrunkHook` does the same for one module outside the blocks, with resident device copies and no
  checkpointing.

The parameters themselves never change device: during a call, the module's parameter entries point at device
tensors (the technique ``torch.func.functional_call`` uses) and are put back afterwards, even on error. The
device tensors come out of :class:`_ToDevice`, an identity in forward whose backward hands the gradients to the
engine instead of to autograd's accumulation, so that they reach the host parameters' ``.grad`` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from lightning_superpipe.streaming.engine import StreamingEngine

# (module that owns the parameter, attribute name, the host parameter)
_Binding = tuple[nn.Module, str, nn.Parameter]


class _ToDevice(torch.autograd.Function):
    """Identity from host parameters to their device copies; backward delivers the gradients to the engine."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, deliver: Callable[[Sequence[Optional[Tensor]]], None], device_tensors: tuple[Tensor, ...], *host_params: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.deliver = deliver
        # Fresh aliases: autograd attaches this node to them, not to the engine's buffers.
        return tuple(tensor.detach() for tensor in device_tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[None, ...]:
        ctx.deliver(grads)
        # The host parameters get their gradients from the engine, already accumulated in fp32.
        return (None, None) + (None,) * len(grads)


def _bindings(module: nn.Module, recurse: bool) -> list[_Binding]:
    """Every (owner, name, parameter) under ``module``, tied parameters once per owner."""
    modules = module.modules() if recurse else [module]
    return [
        (owner, name, param)
        for owner in modules
        for name, param in owner._parameters.items()
        if param is not None
    ]


@contextmanager
def _bound(bindings: Sequence[_Binding], tensors: dict[nn.Parameter, Tensor]) -> Iterator[None]:
    for owner, name, param in bindings:
        owner._parameters[name] = tensors[param]  # type: ignore[assignment]
    try:
        yield
    finally:
        for owner, name, param in bindings:
            owner._parameters[name] = param


class BlockStreamingHook:
    """Streams block ``index`` through the device around each call of its ``forward``.

    Args:
        engine: The engine that owns the block's weights.
        index: The block's position in execution order.
        block: The block module.
    """

    def __init__(self, engine: StreamingEngine, index: int, block: nn.Module) -> None:
        self.engine = engine
        self.index = index
        self.block = block
        self._bindings = _bindings(block, recurse=True)
        home = engine.homes[index]
        self._streamed = [piece.param for piece in home.slices] if home is not None else []
        self._trainable = [piece.param for piece in home.trainable] if home is not None else []
        self._deliver = partial(engine.gradients.send_block, index)
        # Parameters the block uses but does not stream (tied to the trunk or to another block): resident.
        streamed = set(self._streamed)
        self._resident = list({param: None for _, _, param in self._bindings if param not in streamed})
        self._original_forward: Optional[Callable[..., Any]] = None
        self._previous_instance_forward: Optional[Callable[..., Any]] = None

    def attach(self) -> None:
        if self._original_forward is not None:
            return
        # Someone else's instance-level wrapper, if any, to put back on detach.
        self._previous_instance_forward = self.block.__dict__.get("forward")
        self._original_forward = self.block.forward
        self.block.forward = self._forward  # type: ignore[method-assign]

    def detach(self) -> None:
        if self._original_forward is None:
            return
        if self._previous_instance_forward is None:
            del self.block.forward
        else:
            self.block.forward = self._previous_instance_forward  # type: ignore[method-assign]
        self._original_forward = None

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            # Nothing computed inside is saved for backward; backward re-runs ``_compute``, fetching the weights
            # again, with the RNG state of the first run (dropout matches).
            return checkpoint(self._compute, *args, use_reentrant=False, **kwargs)
        return self._compute(*args, **kwargs)

    def _compute(self, *args: Any, **kwargs: Any) -> Any:
        assert self._original_forward is not None
        # A block whose parameters are all shared with others has nothing to stream: all of it is resident.
        tensors = dict(zip(self._streamed, self.engine.acquire(self.index))) if self._streamed else {}
        if torch.is_grad_enabled() and self._trainable:
            on_device = _ToDevice.apply(self._deliver, tuple(tensors[p] for p in self._trainable), *self._trainable)
            tensors.update(zip(self._trainable, on_device))
        for param in self._resident:
            tensors[param] = _resident_tensor(self.engine, param)
        with _bound(self._bindings, tensors):
            return self._original_forward(*args, **kwargs)


class TrunkHook:
    """Gives one module outside the blocks the resident device copies of its own parameters during its calls.

    Args:
        engine: The engine that holds the device copies.
        module: A module that directly owns trunk parameters.
    """

    def __init__(self, engine: StreamingEngine, module: nn.Module) -> None:
        self.engine = engine
        self.module = module
        self._bindings = [b for b in _bindings(module, recurse=False) if engine.is_trunk(b[2])]
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        if self._handles:
            return
        self._handles = [
            self.module.register_forward_pre_hook(self._bind),
            self.module.register_forward_hook(self._unbind, always_call=True),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _bind(self, module: nn.Module, args: Any) -> None:
        for owner, name, param in self._bindings:
            owner._parameters[name] = _resident_tensor(self.engine, param)  # type: ignore[assignment]

    def _unbind(self, module: nn.Module, args: Any, output: Any) -> None:
        for owner, name, param in self._bindings:
            owner._parameters[name] = param


class CallerDeviceHook:
    """Runs a model on the compute device for callers that hand it host tensors, and hands results back there.

    ``transformers`` puts generation inputs on ``model.device``, the device of the first parameter, which for a
    streamed model is the host. This hook moves the tensors a call receives to the compute device and the
    tensors it returns back to where the inputs were, as Accelerate's ``io_same_device`` does, so
    ``generate()`` works while the computation happens on the device. Calls whose inputs are already on the
    device (every Lightning step) are untouched.

    Args:
        module: The model that callers call (the outermost ``transformers`` model).
        device: The compute device.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self._caller_devices: list[Optional[torch.device]] = []
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        if self._handles:
            return
        self._handles = [
            self.module.register_forward_pre_hook(self._to_device, with_kwargs=True),
            self.module.register_forward_hook(self._to_caller, always_call=True),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _to_device(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        caller = next((t.device for t in leaves if t.device != self.device), None)
        self._caller_devices.append(caller)
        if caller is None:
            return args, kwargs
        return tree_map(self._move_to(self.device), (args, kwargs))

    def _to_caller(self, module: nn.Module, args: Any, output: Any) -> Any:
        caller = self._caller_devices.pop() if self._caller_devices else None
        return output if caller is None else tree_map(self._move_to(caller), output)

    @staticmethod
    def _move_to(device: torch.device) -> Callable[[Any], Any]:
        return lambda value: value.to(device) if isinstance(value, Tensor) else value


def _resident_tensor(engine: StreamingEngine, param: nn.Parameter) -> Tensor:
    tensor = engine.trunk_tensor(param)
    if torch.is_grad_enabled() and param.requires_grad:
        deliver = lambda grads: engine.gradients.send_trunk(param, grads[0])  # noqa: E731
        (tensor,) = _ToDevice.apply(deliver, (tensor,), param)
    return tensor


def outermost_pretrained_models(model: nn.Module) -> list[nn.Module]:
    """The outermost ``transformers`` models inside ``model`` (the ones users and ``generate()`` call)."""
    from transformers import PreTrainedModel

    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def trunk_modules(model: nn.Module, blocks: Sequence[nn.Module]) -> Iterator[nn.Module]:
    """Modules outside the blocks that directly own parameters."""
    inside = {id(block) for block in blocks}

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        if id(module) in inside:
            return
        if any(param is not None for param in module._parameters.values()):
            yield module
        for child in module.children():
            yield from visit(child)

    yield from visit(model)
