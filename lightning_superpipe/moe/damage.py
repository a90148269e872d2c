"""Predicted damage of each page at each level, from routing and activation statistics.

The damage of a page of expert ``e`` at a level is the Hessian-diagonal weighted error of its
weights, weighted by how often ``e`` is used::

    damage = share_e * sum_j E_e[x_j^2] * sum_i (W_ij - W^_ij)^2

where ``E_e[x_j^2]`` is the mean square of input feature ``j`` over the tokens routed to ``e``
(the ``gate_up_proj`` input, or the ``down_proj`` input ``act(gate) * up``), and ``share_e`` the
running share of tokens routed to ``e``, counted by hooks on the routers. Without calibration data
``E[x^2] = 1`` and shares are uniform: the damage is then the plain weight error.
"""

from __future__ import annotations

import torch

from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.moe.pages import TOP_LEVEL, PageStore

__all__ = ["ActivationStats", "RoutingStats", "page_damage"]


class RoutingStats:
    """Running share of tokens routed to each expert, counted by forward hooks on the routers.

    Counts decay with a half-life in tokens so that the shares follow the current workload.

    Args:
        layers: The model's MoE layers.
        half_life_tokens: Tokens after which old counts weigh half (``None``: never decay).
        prior_tokens: Pseudo-tokens spread evenly over the experts, so that an expert never seen
            yet still has a small share.
    """

    def __init__(self, layers: list[MoELayer], *, half_life_tokens: float | None = 8192.0, prior_tokens: float = 1.0) -> None:
        self.layers = layers
        self.half_life_tokens = half_life_tokens
        self.prior_tokens = prior_tokens
        self.counts = [torch.zeros(layer.num_experts, dtype=torch.float64) for layer in layers]
        self.tokens = [0.0 for _ in layers]
        self._pending: list[list[torch.Tensor]] = [[] for _ in layers]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.updates = 0

    def attach(self) -> None:
        """Start counting (hooks on every router)."""
        if not self._handles:
            self._handles = [
                layer.router.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)
            ]

    def detach(self) -> None:
        """Stop counting."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int):
        num_experts = self.layers[index].num_experts

        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            top_k_index = output[2]
            # Kept on the device and folded in lazily: no host sync per forward.
            self._pending[index].append(torch.bincount(top_k_index.reshape(-1), minlength=num_experts))
            self.updates += 1

        return hook

    def _fold(self) -> None:
        for i, pending in enumerate(self._pending):
            for counts in pending:
                counts = counts.double().cpu()
                new_tokens = counts.sum().item() / self.layers[i].top_k
                if self.half_life_tokens is not None:
                    decay = 0.5 ** (new_tokens / self.half_life_tokens)
                    self.counts[i] *= decay
                    self.tokens[i] *= decay
                self.counts[i] += counts
                self.tokens[i] += new_tokens
            pending.clear()

    def shares(self) -> list[torch.Tensor]:
        """Per layer, ``float64 [E]``: share of tokens routed to each expert (sums to ``top_k``)."""
        self._fold()
        result = []
        for layer, counts, tokens in zip(self.layers, self.counts, self.tokens):
            prior = self.prior_tokens * layer.top_k / layer.num_experts
            result.append((counts + prior) / (tokens + self.prior_tokens))
        return result

    def tokens_seen(self) -> float:
        """Tokens counted so far (after decay), averaged over layers."""
        self._fold()
        return sum(self.tokens) / max(1, len(self.tokens))


class ActivationStats:
    """Sum of squared expert inputs per expert and feature, recorded by the paged experts forward.

    Args:
        shapes: ``(layer, proj) -> (experts, cols)`` of every expert projection's input.
    """

    def __init__(self, shapes: dict[tuple[int, int], tuple[int, int]]) -> None:
        self.sum_sq = {key: torch.zeros(experts, cols, dtype=torch.float64) for key, (experts, cols) in shapes.items()}
        self.count = {key: torch.zeros(experts, dtype=torch.float64) for key, (experts, _) in shapes.items()}
        self.recording = False

    def record(self, layer: int, proj: int, expert: int, inputs: torch.Tensor) -> None:
        """Add the inputs ``[tokens, cols]`` that expert ``expert`` received."""
        if not self.recording:
            return
        self.sum_sq[(layer, proj)][expert] += inputs.detach().float().square().sum(dim=0).double().cpu()
        self.count[(layer, proj)][expert] += inputs.shape[0]

    def mean_sq(self, layer: int, proj: int, prior_tokens: float = 1.0) -> torch.Tensor:
        """``float64 [E, cols]``: ``E[x_j^2]`` per expert, shrunk towards the layer mean.

        An expert that received few tokens gets an estimate pulled towards the mean over all
        experts of the layer (``prior_tokens`` pseudo-tokens of it); with no data at all the
        result is 1 everywhere (weight-only error).
        """
        sum_sq, count = self.sum_sq[(layer, proj)], self.count[(layer, proj)]
        total = count.sum()
        if total == 0:
            return torch.ones_like(sum_sq)
        layer_mean = sum_sq.sum(dim=0) / total
        return (sum_sq + prior_tokens * layer_mean) / (count + prior_tokens).unsqueeze(-1)


def page_damage(
    store: PageStore, shares: list[torch.Tensor] | None, activations: ActivationStats | None
) -> torch.Tensor:
    """Predicted damage of every page at every level of the store.

    Args:
        store: The page store (its per-page column errors are precomputed).
        shares: Routing shares per layer (``None``: uniform).
        activations: Input statistics (``None``: weight-only error).

    Returns:
        ``float64 [pages, levels]`` in the order of ``store.pages`` and ``store.levels``; zero at
        ``TOP_LEVEL``.
    """
    quant_levels = [b for b in store.levels if b != TOP_LEVEL]
    per_projection: dict[tuple[int, int], torch.Tensor] = {}
    for (layer, proj), errors in store.column_errors.items():
        num_experts = errors.shape[0]
        mean_sq = (
            activations.mean_sq(layer, proj) if activations is not None else torch.ones(num_experts, errors.shape[-1], dtype=torch.float64)
        )
        share = shares[layer] if shares is not None else torch.ones(num_experts, dtype=torch.float64)
        # [E, blocks, levels]
        weighted = torch.einsum("ebkc,ec->ebk", errors.double(), mean_sq) * share.view(-1, 1, 1)
        per_projection[(layer, proj)] = weighted
    # Column k of the result comes from level quant_levels.index(level) of the per-projection table.
    columns = [quant_levels.index(level) if level != TOP_LEVEL else None for level in store.levels]
    damage = torch.zeros(len(store.pages), len(store.levels), dtype=torch.float64)
    for i, page in enumerate(store.pages):
        key = page.key
        row = per_projection[(key.layer, key.proj)][key.expert, key.block]
        for k, column in enumerate(columns):
            if column is not None:
                damage[i, k] = row[column]
    return damage
