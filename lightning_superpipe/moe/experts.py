"""Experts implementation that computes with paged weights, registered in ``transformers``.

``transformers`` 5 dispatches every fused experts module's forward through its
``ExpertsInterface`` by ``config._experts_implementation``. Registering
:func:`paged_experts_forward` under :data:`PAGED_EXPERTS_IMPLEMENTATION` and selecting it with
``model.set_experts_implementation`` routes the experts through the page store: only the experts
that tokens were routed to are rebuilt from their pages, at each page's current precision, a
chunk of experts at a time with pages of equal level rebuilt in one batch. The matmuls follow the
``eager`` implementation op for op, so with every page at its original weights the outputs are
bit-identical to ``eager``.
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

DEQUANT_CHUNK = 8
"""Experts rebuilt together: more means fewer kernels, but more transient dequantized weights."""

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

    def weights(self, layer: int, proj: int, experts: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """Weights of some experts' projection for computing now."""
        if self.reference:
            return self.store.reference_weights(layer, proj, experts, dtype)
        return self.store.weights(layer, proj, experts, dtype)


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
    hit = [expert for expert in expert_hit.flatten().tolist() if expert != self.num_experts]  # EP sentinel
    # Rebuild a chunk of experts at a time: batched dequantization, bounded working memory.
    for start in range(0, len(hit), DEQUANT_CHUNK):
        chunk = hit[start : start + DEQUANT_CHUNK]
        gate_up_weights = runtime.weights(layer, 0, chunk, dtype)
        down_weights = runtime.weights(layer, 1, chunk, dtype)
        for expert, gate_up_weight, down_weight in zip(chunk, gate_up_weights, down_weights):
            top_k_pos, token_idx = torch.where(expert_mask[expert])
            current_state = hidden_states[token_idx]
            gate_up = F.linear(current_state, gate_up_weight)
            current_hidden_states = self._apply_gate(gate_up)
            routing_weights = top_k_weights[token_idx, top_k_pos]
            runtime.activations.record(layer, expert, current_state, gate_up, self.act_fn, routing_weights)
            current_hidden_states = F.linear(current_hidden_states, down_weight)
            current_hidden_states = current_hidden_states * routing_weights[:, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


ExpertsInterface.register(PAGED_EXPERTS_IMPLEMENTATION, paged_experts_forward)
