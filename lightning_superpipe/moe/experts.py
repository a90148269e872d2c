"""Experts implementation that computes with paged weights, registered in ``transformers``.

``transformers`` 5 dispatches every fused experts module's forward through its
``ExpertsInterface`` by ``config._experts_implementation``. Registering
:func:`paged_experts_forward` under :data:`PAGED_EXPERTS_IMPLEMENTATION` and selecting it with
``model.set_experts_implementation`` routes the experts through the page store.

The paged forward does not re-implement the experts: it puts the weights the pages provide (the
original tensors where every page of a projection is at its original weights, else a tensor
rebuilt from the pages) on the experts module and calls *the implementation that was active
before paging* (``grouped_mm``, ``batched_mm``, ``eager``, ...). At a full budget the outputs are
therefore those of the model as configured, bit for bit, at its speed; below it the family's own
layout, biases, gating and accumulation order are kept as they are.

Dense shared experts are paged the same way by hooks on their module: their ``nn.Linear`` weights
are set before their forward and removed after it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from lightning_superpipe.moe.damage import ActivationStats, RoutingStats
from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.moe.pages import PageStore

__all__ = ["PAGED_EXPERTS_IMPLEMENTATION", "ExpertsRuntime", "paged_experts_forward"]

PAGED_EXPERTS_IMPLEMENTATION = "superpipe_paged"
"""Name under which the paged implementation is registered in ``ExpertsInterface``."""

BINDING_ATTR = "_superpipe_paged"
"""Attribute of a paged experts module holding its ``(ExpertsRuntime, unit index)``."""

_INTERFACE = ExpertsInterface()


@dataclass
class ExpertsRuntime:
    """State shared by the paged units of one model.

    Args:
        store: The page store.
        layers: The paged units, by index.
        activations: Where expert inputs are recorded while ``activations.recording`` is set.
        routing: Counts routed tokens per expert.
        previous: Experts implementation active before paging, per unit (``"eager"``, ``"grouped_mm"``, ...).
        reference: Compute with the original weights streamed from host memory instead of the
            pages (exact full-precision outputs within the device budget).
    """

    store: PageStore
    layers: list[MoELayer]
    activations: ActivationStats
    routing: RoutingStats
    previous: dict[int, str] = field(default_factory=dict)
    reference: bool = False
    _implementations: dict[int, Callable[..., torch.Tensor]] = field(default_factory=dict, repr=False)

    def weights(self, layer: int, top_k_index: torch.Tensor | None) -> list[torch.Tensor]:
        """Weights of every projection of a unit for computing now, shaped like its parameters.

        Args:
            layer: Unit index.
            top_k_index: The call's routed experts (``None``: all experts are needed).
        """
        unit = self.layers[layer]
        count = len(unit.projections)
        if not self.reference:  # fast path first: every projection at its original weights
            full = [self.store.full_weight(layer, proj) for proj in range(count)]
            if all(w is not None for w in full):
                return full
        if self.reference:
            return [self.store.reference_weight(layer, proj) for proj in range(count)]
        weights: list[torch.Tensor] = []
        hit: list[int] | None | bool = False
        for proj in range(count):
            full = self.store.full_weight(layer, proj)
            if full is None:
                if hit is False:  # one host sync per call, and only below a full budget
                    hit = _hit_experts(top_k_index, unit.num_experts)
                full = self.store.projection_weight(layer, proj, hit)
            weights.append(full)
        return weights

    def implementation(self, experts: nn.Module, layer: int) -> Callable[..., torch.Tensor]:
        """The experts forward that was active before paging."""
        found = self._implementations.get(layer)
        if found is None:
            name = self.previous.get(layer, "eager")
            if name != "eager" and name in _INTERFACE:
                found = _INTERFACE[name]
            else:
                found = type(experts).forward.__wrapped__  # the class's own (eager) forward under the decorator
            self._implementations[layer] = found
        return found

    def record_routed(
        self,
        experts: nn.Module,
        layer: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        input_weight: torch.Tensor,
    ) -> None:
        """Record the calibration statistics of one call of a routed unit (one expert at a time)."""
        unit = self.layers[layer]
        canonical = unit.canonical(input_weight)
        bias = getattr(experts, f"{unit.projections[0]}_bias", None) if getattr(experts, "has_bias", False) else None
        gate_fn = unit.gate_fn()
        for expert in _hit_experts(top_k_index, unit.num_experts) or range(unit.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            if token_idx.numel() == 0:
                continue
            inputs = hidden_states[token_idx]
            pre = nn.functional.linear(inputs, canonical[expert], None if bias is None else bias[expert])
            self.activations.record(layer, expert, inputs, pre, gate_fn, top_k_weights[token_idx, top_k_pos])


def paged_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    """Forward of a fused experts module whose weights live in a page store.

    Args:
        self: The experts module (its weights were taken over by ``page_experts``).
        hidden_states: ``[tokens, hidden]`` inputs.
        *args: The routed experts ``[tokens, top_k]`` and their weights, as the family passes them.
        **kwargs: Same, by the family's own names (e.g. gpt-oss's ``router_indices``).

    Returns:
        What the implementation active before paging returns for the current weights.
    """
    binding = getattr(self, BINDING_ATTR, None)
    if binding is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the {PAGED_EXPERTS_IMPLEMENTATION!r} experts implementation but was "
            "not converted; use lightning_superpipe.moe.page_experts(model) instead of selecting it by hand."
        )
    runtime, layer = binding
    top_k_index, top_k_weights = _routing_arguments(self, hidden_states, args, kwargs)
    runtime.routing.observe(layer, top_k_index)
    weights = runtime.weights(layer, top_k_index)
    if runtime.activations.recording:
        runtime.record_routed(self, layer, hidden_states, top_k_index, top_k_weights, weights[0])
    implementation = runtime.implementation(self, layer)
    # The weights sit in the instance dict for the call only (a plain try/finally: this runs per layer
    # per token step, where a generator-based context manager's overhead shows at a full budget).
    names = runtime.layers[layer].projections
    attributes = vars(self)
    for name, weight in zip(names, weights):
        attributes[name] = weight
    try:
        return implementation(self, hidden_states, *args, **kwargs)
    finally:
        for name in names:
            attributes.pop(name, None)


@contextlib.contextmanager
def bound_weights(unit: MoELayer, weights: list[torch.Tensor]) -> Iterator[None]:
    """Put ``weights`` where the unit's modules read their parameters, for the duration of a call.

    The parameters themselves were taken out of the modules, so a plain attribute is found instead;
    it is removed afterwards so that nothing outlives the call (and restore finds the slot free).
    """
    for (module, attr), weight in zip(unit.slots, weights):
        object.__setattr__(module, attr, weight.squeeze(0) if unit.shared else weight)
    try:
        yield
    finally:
        for module, attr in unit.slots:
            vars(module).pop(attr, None)


class SharedExpertHooks:
    """Forward hooks paging a dense shared expert: weights set before its forward, removed after.

    Args:
        runtime: The model's paged state.
        layer: Index of the shared unit.
    """

    def __init__(self, runtime: ExpertsRuntime, layer: int) -> None:
        self.runtime = runtime
        self.layer = layer
        self._context: contextlib.AbstractContextManager[None] | None = None
        unit = runtime.layers[layer]
        self.handles = [
            unit.experts.register_forward_pre_hook(self._before),
            unit.experts.register_forward_hook(self._after, always_call=True),
        ]

    def _before(self, module: nn.Module, args: tuple) -> None:
        runtime, unit = self.runtime, self.runtime.layers[self.layer]
        weights = runtime.weights(self.layer, None)
        if runtime.activations.recording and args:
            inputs = args[0].reshape(-1, args[0].shape[-1])
            gate, up = (w.squeeze(0) for w in weights[:2])
            pre = torch.cat([nn.functional.linear(inputs, gate), nn.functional.linear(inputs, up)], dim=-1)
            ones = torch.ones(inputs.shape[0], device=inputs.device, dtype=torch.float32)
            runtime.activations.record(self.layer, 0, inputs, pre, unit.gate_fn(), ones)
        self._context = bound_weights(unit, weights)
        self._context.__enter__()

    def _after(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _hit_experts(top_k_index: torch.Tensor | None, num_experts: int) -> list[int] | None:
    """Experts that some token is routed to (``None``: all of them, or unknown)."""
    if top_k_index is None:
        return None
    hit = [e for e in torch.unique(top_k_index).tolist() if 0 <= e < num_experts]  # drops EP sentinels
    return None if len(hit) == num_experts else hit


_ROUTING_NAMES: dict[type, tuple[str, str]] = {}


def _routing_arguments(
    experts: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, top_k_weights)`` of a call, whatever the family names them."""
    if len(args) >= 2 and not kwargs:
        return args[0], args[1]
    cls = type(experts)
    names = _ROUTING_NAMES.get(cls)
    if names is None:
        parameters = list(inspect.signature(cls.forward.__wrapped__).parameters)
        names = _ROUTING_NAMES.setdefault(cls, (parameters[2], parameters[3]))
    bound = dict(zip(names, args)) | kwargs
    return bound[names[0]], bound[names[1]]


ExpertsInterface.register(PAGED_EXPERTS_IMPLEMENTATION, paged_experts_forward)
