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

Recomputing a block in backward must compute what its first run computed and change nothing the first run
already changed. So a checkpointed call drops an empty key-value cache it was handed (a cache would receive the
block's keys and values twice, and keep every layer's alive through the step: ``transformers``'
``GradientCheckpointingLayer`` does the same), and the recomputation runs on copies of the buffers the block
mutates in forward (BatchNorm's running statistics), taken before the first run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from lightning_superpipe.memory.home import Hook
from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.streaming.activations import (
    ActivationCensus,
    BlockActivations,
    OffloadTrial,
    RecomputedActivations,
    tensors_in,
)
from lightning_superpipe.streaming.blocks import outermost
from lightning_superpipe.streaming.engine import StreamingEngine
from lightning_superpipe.streaming.pruning import PrunedWeights

# (module that owns the parameter, attribute name, the host parameter)
_Binding = tuple[nn.Module, str, nn.Parameter]
# (module that owns the buffer, attribute name) -> the buffer
_Buffers = dict[tuple[nn.Module, str], Tensor]


class _ToDevice(torch.autograd.Function):
    """Identity from host parameters to their device copies; backward delivers the gradients to the engine."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        deliver: Callable[[Sequence[Optional[Tensor]]], None],
        device_tensors: tuple[Tensor, ...],
        *host_params: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.deliver = deliver
        # A parameter that took no part in the loss must get no gradient, not a zero one (AdamW would move it).
        ctx.set_materialize_grads(False)
        # Fresh aliases: autograd attaches this node to them, not to the engine's buffers.
        return tuple(tensor.detach() for tensor in device_tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[None, ...]:
        ctx.deliver(grads)
        # The host parameters get their gradients from the engine, already accumulated in fp32.
        return (None, None) + (None,) * len(grads)


def _turn_off_own_checkpointing(block: nn.Module) -> list[nn.Module]:
    """Turns off the checkpointing of ``transformers`` layers inside ``block`` (``gradient_checkpointing_enable()``,
    or peft's ``prepare_model_for_kbit_training``, turn it on) and returns them, to turn it on again on detach.

    Such a layer checkpoints its class's own ``forward`` (transformers 5 wraps it at the class), so its backward
    recomputes the layer outside this hook's bindings: with the host parameters, never fetched to the device, their
    gradients never returned through the engine. The hook checkpoints the block itself, RNG and buffers included, so
    the layer's own checkpointing adds nothing but a third run of it."""
    turned_off = [module for module in block.modules() if getattr(module, "gradient_checkpointing", None) is True]
    for module in turned_off:
        module.gradient_checkpointing = False
    return turned_off


def _bindings(module: nn.Module, recurse: bool) -> list[_Binding]:
    """Every (owner, name, parameter) under ``module``, tied parameters once per owner."""
    modules = module.modules() if recurse else [module]
    return [
        (owner, name, param)
        for owner in modules
        for name, param in owner._parameters.items()
        if param is not None
    ]


def _buffer_bindings(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (owner, name) of a buffer under ``block``."""
    return [(owner, name) for owner in block.modules() for name, buffer in owner._buffers.items() if buffer is not None]


def _renamed(bindings: Sequence[_Binding]) -> Optional[_Binding]:
    """The first binding whose name no longer holds its parameter (checked at every call: stops at the first)."""
    return next((binding for binding in bindings if binding[0]._parameters.get(binding[1]) is not binding[2]), None)


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
        self.engine: Optional[StreamingEngine] = engine
        self.index = index
        self.block = block
        self._bindings = _bindings(block, recurse=True)
        self._home = engine.homes[index]
        # Parameters the block uses but does not stream (tied to the trunk or to another block): resident.
        streamed = {piece.param for piece in self._home.slices} if self._home is not None else set()
        self._resident = list({param: None for _, _, param in self._bindings if param not in streamed})
        self._buffer_bindings = _buffer_bindings(block)
        # The buffers seen to change in a forward (None until the first checkpointed call has shown which).
        self._mutated_buffers: Optional[set[tuple[nn.Module, str]]] = None
        self._pruning = PrunedWeights(block, recurse=True, device=engine.device)
        self._keeps_cache = bool(getattr(block, "_can_checkpoint_with_cache", False))
        self._census_running = False  # the census computes with the weights the call just used
        self._original_forward: Optional[Callable[..., Any]] = None
        self._previous_instance_forward: Optional[Callable[..., Any]] = None
        self._checkpointing_turned_off: list[nn.Module] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return _inert_copy, (type(self), self.block)

    def attach(self) -> None:
        if self._original_forward is not None:
            return
        # Someone else's instance-level wrapper, if any, to put back on detach.
        self._previous_instance_forward = self.block.__dict__.get("forward")
        self._original_forward = self.block.forward
        self.block.forward = self._forward  # type: ignore[method-assign]
        self._checkpointing_turned_off = _turn_off_own_checkpointing(self.block)

    def detach(self) -> None:
        if self._original_forward is None:
            return
        for module in self._checkpointing_turned_off:
            module.gradient_checkpointing = True
        self._checkpointing_turned_off = []
        if self._previous_instance_forward is None:
            del self.block.forward
        else:
            self.block.forward = self._previous_instance_forward  # type: ignore[method-assign]
        self._original_forward = None

    # Dynamo must not trace the engine (slots, events, version checks): a compiled model breaks its graph here and
    # compiles what runs between blocks.
    @torch.compiler.disable
    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:  # a copy's (:func:`_inert_copy`)
            return type(self.block).forward(self.block, *args, **kwargs)
        self._check_bindings()  # once per call: a recomputation runs with the bindings its first run checked
        if torch.is_grad_enabled():
            if not self._keeps_cache:
                args, kwargs = _without_cache(self.block, args, kwargs)
            mode = self.engine.activation_modes[self.index]
            if mode != "recompute":
                # Saved weights become handles fetched again in backward; activations stay or go to the host.
                with BlockActivations(self.engine.activations, self.index, offload=mode == "offload"):
                    output = self._compute(True, *args, **kwargs)
                self.engine.activations.bring_back_ahead(self.index, output)
                return output
            # Nothing computed inside is saved for backward; backward re-runs ``_compute``, fetching the weights
            # again, with the RNG state of the first run (dropout matches) and the buffers as they were before it.
            live = {(owner, name): owner._buffers[name] for owner, name in self._buffer_bindings}
            versions = {key: buffer._version for key, buffer in live.items()}
            watched = live.keys() if self._mutated_buffers is None else self._mutated_buffers
            before = {key: live[key].clone() for key in watched}
            runs = [0]
            self.engine.activations.hold_inputs(self.index, tensors_in((args, kwargs)))
            output = checkpoint(self._checkpointed, runs, live, before, *args, use_reentrant=False, **kwargs)
            # The first checkpointed call shows which buffers the forward mutates; later calls copy only those.
            # Values are compared too: kernels such as batch norm's update running statistics in place without
            # bumping the version counter.
            known = self._mutated_buffers or set()
            mutated = {
                key
                for key, buffer in live.items()
                if key not in known
                and (buffer._version != versions[key] or (key in before and not torch.equal(buffer, before[key])))
            }
            self._mutated_buffers = known | mutated
            if self.engine.profiler is not None:
                self._census(live, before, args, kwargs)
            self.engine.activations.bring_back_ahead(self.index, output)
            return output
        return self._compute(True, *args, **kwargs)

    def _checkpointed(self, runs: list[int], live: _Buffers, before: _Buffers, *args: Any, **kwargs: Any) -> Any:
        first = runs[0] == 0
        runs[0] += 1
        if first:
            return self._compute(True, *args, **kwargs)
        # The recomputation updates copies of the mutated buffers, which are then dropped: the first run's update
        # is the step's one update, as in plain training.
        profiler = self.engine.profiler
        if profiler is not None:
            profiler.enter("recompute", self.index)
        try:
            with RecomputedActivations(self.engine.activations, self.index):
                return self._on_buffer_copies(live, before, *args, **kwargs)
        finally:
            if profiler is not None:
                profiler.enter("backward", self.index)

    def _on_buffer_copies(self, live: _Buffers, before: _Buffers, *args: Any, **kwargs: Any) -> Any:
        """Computes the block again with copies of its mutated buffers as they were before its first run."""
        for (owner, name), tensor in before.items():
            owner._buffers[name] = tensor.clone()
        try:
            return self._compute(False, *args, **kwargs)
        finally:
            for owner, name in before:
                owner._buffers[name] = live[(owner, name)]

    def _census(self, live: _Buffers, before: _Buffers, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """For a planner's profile: what the call would keep for backward without recomputation, and what a
        checkpoint of it holds (its inputs). The call runs once more, right after the first, on the weights still
        held, under an :class:`ActivationCensus`, with the buffers as they were before the first run and the RNG put
        back afterwards; its result is dropped. Where offloading would copy anything, :meth:`_offload_trial` times
        it."""
        profiler = self.engine.profiler
        profiler.block_inputs(self.index, tensors_in((args, kwargs)))
        # Cut from the real graph, but needing gradients where the inputs do: autograd then saves the same tensors.
        detach = partial(
            tree_map,
            lambda value: value.detach().requires_grad_(value.requires_grad) if isinstance(value, Tensor) else value,
        )
        states = rng_states()

        def run(hooks: Any) -> Callable[[], None]:
            def call() -> None:
                try:
                    with hooks:
                        self._on_buffer_copies(live, before, *detach(args), **detach(kwargs))
                finally:
                    set_rng_states(states)

            return call

        profiler.enter("census")
        self._census_running = True
        census = ActivationCensus(self.engine.activations, self.index)
        try:
            forward_s = profiler.compute_seconds(run(census))
            if census.offloaded_bytes and profiler.times_offload:
                self._offload_trial(run, census.offloaded_bytes, forward_s)
        finally:
            self._census_running = False
            profiler.enter("trunk")
        profiler.activations(self.index, census)

    def _offload_trial(self, run: Callable[[Any], Callable[[], None]], offloaded_bytes: int, forward_s: float) -> None:
        """Times the census's call again with its saved activations copied out on the real copy path, and once more
        without gradients, alone and while they are copied back: what offloading costs compute each way."""
        profiler = self.engine.profiler
        trial = OffloadTrial(self.engine.activations, self.index)
        with profiler.untimed_copies():
            try:
                out_s = profiler.compute_seconds(run(trial))
                trial.copies_out_done()
                computed_s = profiler.compute_seconds(run(torch.no_grad()))
                back_s = profiler.compute_seconds(partial(self._while_brought_back, trial, run(torch.no_grad())))
            finally:
                trial.finish()
        profiler.offload_tried(
            self.index, offloaded_bytes=offloaded_bytes, forward_s=forward_s, out_s=out_s, computed_s=computed_s,
            back_s=back_s,
        )

    @staticmethod
    def _while_brought_back(trial: OffloadTrial, call: Callable[[], None]) -> None:
        trial.bring_back()
        call()

    def _compute(self, first_run: bool, *args: Any, **kwargs: Any) -> Any:
        assert self._original_forward is not None
        # A block whose parameters are all shared with others has nothing to stream: all of it is resident.
        tensors: dict[nn.Parameter, Tensor] = {}
        if self._home is not None:
            fetch = self.engine.held if self._census_running else self.engine.acquire
            # Read at every call, as what streams may change between passes (withheld parameters).
            pieces = self.engine.streamed_slices(self.index)
            tensors = {piece.param: tensor for piece, tensor in zip(pieces, fetch(self.index))}
        if torch.is_grad_enabled() and self._home is not None:
            # Read at every call: which parameters train may change between steps (e.g. ``BaseFinetuning``).
            trainable = self._home.trainable
            if self.engine.withheld:
                trainable = [piece for piece in trainable if piece.param not in self.engine.withheld]
            if trainable:
                if first_run:
                    self.engine.gradients.expect_block(self.index)
                params = [piece.param for piece in trainable]
                deliver = partial(self._deliver, trainable)
                on_device = _ToDevice.apply(deliver, tuple(tensors[p] for p in params), *params)
                tensors.update(zip(params, on_device))
        for param in self._resident:
            tensors[param] = _resident_tensor(self.engine, param, count_use=first_run)
        profiler = self.engine.profiler
        if profiler is not None and first_run:
            profiler.enter("forward", self.index)
        pruned: list[Any] = []
        try:
            with _bound(self._live_bindings(), tensors):
                pruned = self._pruning.apply(args)
                return self._original_forward(*args, **kwargs)
        finally:
            self._pruning.restore(pruned, current=first_run and not self._census_running)
            if profiler is not None and first_run:
                profiler.enter("trunk")

    def _deliver(self, pieces: Sequence[Any], grads: Sequence[Optional[Tensor]]) -> None:
        self.engine.gradients.send_block(self.index, pieces, grads)
        if self.engine.profiler is not None:
            self.engine.profiler.enter("trunk")  # the block's backward ends with its weights' gradients

    def _live_bindings(self) -> list[_Binding]:
        """The bindings of the parameters the block computes with now: not those the engine withholds (their
        owners compute with them some other way, e.g. paged experts, and no longer list them)."""
        withheld = self.engine.withheld
        return [binding for binding in self._bindings if binding[2] not in withheld] if withheld else self._bindings

    def _check_bindings(self) -> None:
        if _renamed(self._live_bindings()) is not None or self._pruning.stale():
            self._bind_again()

    def _bind_again(self) -> None:
        """The block's parameters moved to other names (``torch.nn.utils.prune`` keeps ``weight`` as
        ``weight_orig``, beside a new ``weight_mask`` buffer, and ``prune.remove`` puts it back): the same objects
        are bound under their new names (:mod:`.pruning`). Any other change of the block's parameters is refused."""
        bindings = _bindings(self.block, recurse=True)
        if {id(param) for _, _, param in bindings} != {id(param) for _, _, param in self._bindings}:
            owner, name, _ = _renamed(self._live_bindings()) or next(iter(self._live_bindings()))
            raise RuntimeError(
                f"The parameter {type(owner).__name__}.{name} of streamed block {self.index} was replaced by"
                " another object during the run (e.g. `load_state_dict(assign=True)`, or a module attribute set"
                " to a new `nn.Parameter`). SuperpipeStrategy streams the parameters it set up with: change values"
                " in place (`load_state_dict(...)`, `param.copy_(...)` under `torch.no_grad()`) instead."
            )
        self._bindings = bindings
        self._buffer_bindings = _buffer_bindings(self.block)
        self._mutated_buffers = None  # which buffers a forward changes is learnt again
        self._pruning.refresh()


class TrunkHook:
    """Gives one module outside the blocks the resident device copies of its own parameters during its calls.

    Args:
        engine: The engine that holds the device copies.
        module: A module that directly owns trunk parameters.
    """

    def __init__(self, engine: StreamingEngine, module: nn.Module) -> None:
        self.engine = engine
        self.module = module
        self._bindings = self._trunk_bindings()
        self._pruning = PrunedWeights(module, recurse=False, device=engine.device)
        self._pruned: list[Any] = []  # the product attributes a call's pruning hooks replaced, to put back
        self._handles: list[RemovableHandle] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return _inert_copy, (type(self), self.module)

    def _trunk_bindings(self) -> list[_Binding]:
        return [b for b in _bindings(self.module, recurse=False) if self.engine.is_trunk(b[2])]

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

    @torch.compiler.disable
    def _bind(self, module: nn.Module, args: Any) -> None:
        if self.engine is None:  # a copy's (:func:`_inert_copy`)
            return
        if _renamed(self._bindings) is not None or self._pruning.stale():  # pruned (:mod:`.pruning`)
            self._bindings = self._trunk_bindings()
            self._pruning.refresh()
        for owner, name, param in self._bindings:
            owner._parameters[name] = _resident_tensor(self.engine, param)  # type: ignore[assignment]
        self._pruned = self._pruning.apply(args)

    @torch.compiler.disable
    def _unbind(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.engine is None:
            return
        for owner, name, param in self._bindings:
            owner._parameters[name] = param
        self._pruning.restore(self._pruned, current=True)
        self._pruned = []


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
        caller = next((t.device for t in tensors_in((args, kwargs)) if t.device != self.device), None)
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


def _inert_copy(cls: type[Any], module: nn.Module) -> Any:
    """What a deep copy or a pickle of a module makes of a streaming hook attached to it (``copy.deepcopy(model)``
    mid-run; Lightning gives every callback the LightningModule's bound ``log``, so copying a callback copies the
    module): a hook of the same class with no engine, which does nothing. The copy computes as a plain module, with
    its own copied host parameters; the run's engine is neither copied nor shared."""
    hook = cls.__new__(cls)
    hook.engine = None
    hook.block = hook.module = module
    return hook


def _resident_tensor(engine: StreamingEngine, param: nn.Parameter, count_use: bool = True) -> Tensor:
    """The device copy of a resident parameter, connected to the gradient return when it trains; else a fresh
    alias of it, so that a module that sets ``.data`` on what it is handed (bitsandbytes' 4-bit layers cast their
    bias to their compute dtype so) changes the alias for that call, not the copy the engine keeps and refreshes.

    Args:
        count_use: Whether this use will deliver a gradient (not inside a recomputation, whose graph autograd
            never runs backward through).
    """
    tensor = engine.trunk_tensor(param)
    if torch.is_grad_enabled() and param.requires_grad:
        if count_use:
            engine.gradients.expect_trunk(param)
            if engine.profiler is not None:
                engine.profiler.trunk_use(param)
        deliver = lambda grads: engine.gradients.send_trunk(param, grads[0])  # noqa: E731
        (tensor,) = _ToDevice.apply(deliver, (tensor,), param)
        return tensor
    return tensor.detach()


def _without_cache(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with an empty key-value cache replaced by ``None`` and ``use_cache`` off.

    Raises:
        ValueError: If the cache holds keys and values already (a cached prefix, prefix tuning): recomputing the
            block would append to it a second time, and without it the block would compute something else.
    """
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # no transformers, no transformers caches
        return args, kwargs

    def dropped(value: Any) -> Any:
        if not isinstance(value, Cache):
            return value
        if _cache_length(value) > 0:
            raise ValueError(
                f"A streamed block ({type(block).__name__}) was called in training with a key-value cache that already"
                " holds keys and values (a cached prefix, or peft prefix tuning). SuperpipeStrategy recomputes each"
                " block in backward, which would append to that cache twice. Train without a filled cache (e.g. LoRA"
                " instead of prefix tuning), or evaluate under `torch.no_grad()`."
            )
        return None

    args = tuple(dropped(value) for value in args)
    kwargs = {name: dropped(value) for name, value in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _cache_length(cache: Any) -> int:
    try:
        return int(cache.get_seq_length())
    except (AttributeError, IndexError, TypeError, NotImplementedError):  # layers not created yet: nothing held
        return 0


def outermost_pretrained_models(model: nn.Module) -> list[nn.Module]:
    """The outermost ``transformers`` models inside ``model`` (the ones users and ``generate()`` call)."""
    from transformers import PreTrainedModel

    return outermost(model, lambda module: isinstance(module, PreTrainedModel), include_model=True)


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


def attach_hooks(engine: StreamingEngine, model: nn.Module, blocks: Sequence[nn.Module]) -> list[Hook]:
    """Attaches every hook the strategy needs: one per block, one per trunk module, and on an accelerator one per
    outermost ``transformers`` model (inputs to the device)."""
    hooks: list[Hook] = [BlockStreamingHook(engine, i, block) for i, block in enumerate(blocks)]
    hooks += [TrunkHook(engine, module) for module in trunk_modules(model, blocks)]
    if engine.device.type != "cpu":
        hooks += [CallerDeviceHook(module, engine.device) for module in outermost_pretrained_models(model)]
    for hook in hooks:
        hook.attach()
    return hooks
