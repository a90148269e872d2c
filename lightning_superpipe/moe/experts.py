"""Experts implementation that computes with paged weights, registered in ``transformers``.

``transformers`` 5 dispatches every fused experts module's forward through its
``ExpertsInterface`` by ``config._experts_implementation``. Registering
:func:`paged_experts_forward` under :data:`PAGED_EXPERTS_IMPLEMENTATION` and selecting it with
``model.set_experts_implementation`` routes the experts through the page store: only the experts
that tokens were routed to are rebuilt from their pages, one at a time, at each page's current
precision. The op sequence is that of the ``eager`` implementation, so with every page at its
original weights the outputs are bit-identical to ``eager``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers.integrations.moe import ExpertsInterface

from lightning_superpipe.moe.damage import ActivationStats
from lightning_superpipe.moe.pages import PageStore

__all__ = ["PAGED_EXPERTS_IMPLEMENTATION", "ExpertsRuntime", "paged_experts_forward"]

PAGED_EXPERTS_IMPLEMENTATION = "superpipe_paged"
"""Name under which the paged implementation is registered in ``ExpertsInterface``."""

BINDING_ATTR = "_superpipe_paged"
"""Attribute of a paged experts module holding its ``(ExpertsRuntime, layer index)``."""


@dataclass
class ExpertsRuntime:
    """State shared by the paged experts modules of one model.

    Args:
        store: The page store.
        activations: Where expert inputs are recorded while ``activations.recording`` is set.
        reference: Compute with the original weights streamed from host memory instead of the
            pages (exact full-precision outputs within the device budget).
    """

    store: PageStore
    activations: ActivationStats
    reference: bool = False

    def weight(self, layer: int, proj: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Weights of one expert projection for computing now."""
        if self.reference:
            return self.store.reference_weight(layer, proj, expert, dtype)
        return self.store.weight(layer, proj, expert, dtype)


def paged_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Forward of a fused experts module whose weights live in a page store.

    Args:
        self: The experts module (its weights were taken over by ``page_experts``).
        hidden_states: ``[tokens, hidden]`` inputs.
        top_k_index: ``[tokens, top_k]`` routed experts.
        top_k_weights: ``[tokens, top_k]`` routing weights.

    Returns:
        ``[tokens, hidden]`` weighted sum of the routed experts' outputs.
    """
    binding = getattr(self, BINDING_ATTR, None)
    if binding is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the {PAGED_EXPERTS_IMPLEMENTATION!r} experts implementation but was "
            "not converted; use lightning_superpipe.moe.page_experts(model) instead of selecting it by hand."
        )
    runtime, layer = binding
    dtype = hidden_states.dtype
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in expert_hit.flatten().tolist():
        if expert == self.num_experts:  # expert-parallel sentinel
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        current_state = hidden_states[token_idx]
        gate_up = F.linear(current_state, runtime.weight(layer, 0, expert, dtype))
        current_hidden_states = self._apply_gate(gate_up)
        routing_weights = top_k_weights[token_idx, top_k_pos]
        runtime.activations.record(layer, expert, current_state, gate_up, self.act_fn, routing_weights)
        current_hidden_states = F.linear(current_hidden_states, runtime.weight(layer, 1, expert, dtype))
        current_hidden_states = current_hidden_states * routing_weights[:, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


ExpertsInterface.register(PAGED_EXPERTS_IMPLEMENTATION, paged_experts_forward)
