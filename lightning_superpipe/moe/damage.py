"""Predicted damage of each page at each level, from routing and activation statistics.

The damage of a page of expert ``e`` at a level is the Hessian-diagonal weighted error of its
weights, weighted by how often ``e`` is used::

    damage = share_e * sum_ij r_i * E_e[w^2 x_j^2] * (W_ij - W^_ij)^2

``E_e[.]`` is the mean over the calibration tokens routed to ``e``, ``x`` the projection's input
(the ``gate_up_proj`` input, or the ``down_proj`` input ``act(gate) * up``), ``w`` the token's
routing weight for ``e`` (the expert's output is scaled by it), and ``share_e`` the running share of
tokens routed to ``e``, counted by hooks on the routers. ``r_i`` puts both projections in the same
units, the error of the MoE block's output: 1 for ``down_proj`` rows; for ``gate_up_proj`` rows, the
mean square of ``d h_i / d z_i`` (``act'(gate_i) * up_i`` for a gate row, ``act(gate_i)`` for an up
row) times the squared norm of ``down_proj``'s column ``i``. Without calibration data ``r = 1``,
``E[w^2 x^2] = 1`` and shares are uniform until routing is observed: the damage is then the plain
weight error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.moe.pages import TOP_LEVEL, PageStore

__all__ = ["ActivationStats", "DamageModel", "RoutingStats"]


class RoutingStats:
    """Running share of tokens routed to each expert, counted by forward hooks on the routers.

    Counts decay with a half-life in tokens so that the shares follow the current workload.

    Args:
        layers: The model's MoE layers.
        half_life_tokens: Tokens after which old counts weigh half (``None``: never decay).
        prior_tokens: Pseudo-tokens spread evenly over the experts, so that an expert never seen
            yet still has a small share.
    """

    def __init__(
        self, layers: list[MoELayer], *, half_life_tokens: float | None = 8192.0, prior_tokens: float = 1.0
    ) -> None:
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

    _MAX_PENDING = 256
    """Counts kept on the device before they are folded in (bounds memory when nobody reads)."""

    def _hook(self, index: int) -> Callable[[torch.nn.Module, tuple, tuple], None]:
        num_experts = self.layers[index].num_experts

        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            top_k_index = output[2]
            # Kept on the device and folded in lazily: no host sync per forward. Indices past the
            # last expert (expert-parallel sentinels) are not tokens of this rank's experts.
            counts = torch.bincount(top_k_index.reshape(-1), minlength=num_experts)[:num_experts]
            self._pending[index].append(counts)
            self.updates += 1
            if len(self._pending[index]) >= self._MAX_PENDING:
                self._fold()

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
    """Routing-weighted second moments of expert inputs, recorded by the paged experts forward.

    Per layer and expert: ``sum w^2 x_j^2`` of the ``gate_up_proj`` input, ``sum w^2 h_j^2`` of the
    ``down_proj`` input, ``sum w^2 (dh_i/dz_i)^2`` of the ``gate_up_proj`` outputs, ``sum w^2`` and
    the number of tokens.

    Args:
        layers: The model's MoE layers.
        hidden_size: Model width.
        intermediate_size: Width of one expert.
    """

    def __init__(self, layers: list[MoELayer], hidden_size: int, intermediate_size: int) -> None:
        def zeros(*shape: int) -> list[torch.Tensor]:
            return [torch.zeros(layer.num_experts, *shape, dtype=torch.float64) for layer in layers]

        self.input_sq = zeros(hidden_size)
        self.hidden_sq = zeros(intermediate_size)
        self.slope_sq = zeros(2 * intermediate_size)
        self.weight_sq = zeros()
        self.tokens = zeros()
        self.recording = False

    def record(
        self,
        layer: int,
        expert: int,
        inputs: torch.Tensor,
        gate_up: torch.Tensor,
        act_fn: torch.nn.Module,
        routing_weights: torch.Tensor,
    ) -> None:
        """Add one expert's tokens.

        Args:
            layer: MoE layer index.
            expert: Expert index.
            inputs: ``[tokens, hidden]`` inputs of the expert.
            gate_up: ``[tokens, 2 * intermediate]`` output of its ``gate_up_proj``.
            act_fn: The experts' activation.
            routing_weights: ``[tokens]`` routing weights of the expert for those tokens.
        """
        if not self.recording:
            return
        w_sq = routing_weights.detach().float().square().unsqueeze(-1)
        gate, up = gate_up.detach().float().chunk(2, dim=-1)
        # Central difference: works for any elementwise activation, also under inference mode.
        step = 1e-3
        slope = (act_fn(gate + step) - act_fn(gate - step)) / (2 * step)
        activated = act_fn(gate)
        sensitivity = torch.cat([slope * up, activated], dim=-1)
        hidden = activated * up
        for stat, values in (
            (self.input_sq, inputs.detach().float()),
            (self.hidden_sq, hidden),
            (self.slope_sq, sensitivity),
        ):
            stat[layer][expert] += (w_sq * values.square()).sum(dim=0).double().cpu()
        self.weight_sq[layer][expert] += w_sq.sum().double().cpu()
        self.tokens[layer][expert] += inputs.shape[0]

    @property
    def recorded(self) -> bool:
        """Whether any token was recorded."""
        return any(tokens.sum() > 0 for tokens in self.tokens)

    def _per_token(self, stat: torch.Tensor, tokens: torch.Tensor, prior_tokens: float) -> torch.Tensor:
        """Mean per routed token, shrunk towards the layer mean for experts with few tokens."""
        layer_mean = stat.sum(dim=0) / tokens.sum().clamp_min(1.0)
        extra = (1,) * (stat.dim() - 1)
        return (stat + prior_tokens * layer_mean) / (tokens + prior_tokens).view(-1, *extra)

    def projection_weights(
        self, layer: int, down_proj: torch.Tensor, prior_tokens: float = 1.0
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[None, torch.Tensor]]:
        """Row and column weights of both projections of a layer, per routed token.

        Args:
            layer: MoE layer index.
            down_proj: ``[E, hidden, intermediate]`` original ``down_proj`` weights of the layer.
            prior_tokens: Pseudo-tokens of the layer mean added to every expert.

        Returns:
            ``((rows, cols) of gate_up_proj, (None, cols) of down_proj)``.
        """
        tokens = self.tokens[layer]
        weight_sq = self._per_token(self.weight_sq[layer], tokens, prior_tokens)
        slope_sq = self._per_token(self.slope_sq[layer], tokens, prior_tokens)
        # E[w^2 s^2] / E[w^2]: the routing weight is counted once, in the column weights.
        slope_sq = slope_sq / weight_sq.clamp_min(1e-30).unsqueeze(-1)
        column_norm_sq = down_proj.double().square().sum(dim=1).repeat(1, 2)  # [E, 2I]
        gate_up_rows = slope_sq * column_norm_sq
        gate_up_cols = self._per_token(self.input_sq[layer], tokens, prior_tokens)
        down_cols = self._per_token(self.hidden_sq[layer], tokens, prior_tokens)
        return (gate_up_rows, gate_up_cols), (None, down_cols)


class DamageModel:
    """Predicted damage of every page at every level of a store.

    The routing-independent part (error weighted by activation statistics, per routed token) is
    computed once per calibration; routing shares multiply it whenever they are refreshed.

    Args:
        store: The page store.
    """

    def __init__(self, store: PageStore) -> None:
        self.store = store
        self._bit_columns = [
            i for i, level in enumerate(store.levels) if level != TOP_LEVEL
        ]
        self.base = torch.zeros(len(store.pages), len(store.levels), dtype=torch.float64)
        self.update_errors(None)

    def update_errors(self, activations: ActivationStats | None) -> None:
        """Recompute the per-token weighted errors (``None`` or no data: weight-only errors)."""
        per_projection: dict[tuple[int, int], torch.Tensor] = {}
        calibrated = activations is not None and activations.recorded
        for layer, proj in self.store.projections():
            if calibrated:
                down_proj = self.store.host_weight(layer, 1)
                rows, cols = activations.projection_weights(layer, down_proj)[proj]
            else:
                rows, cols = None, None
            per_projection[(layer, proj)] = self.store.weighted_errors(layer, proj, rows, cols)
        for i, page in enumerate(self.store.pages):
            key = page.key
            self.base[i, self._bit_columns] = per_projection[(key.layer, key.proj)][key.expert, key.block]

    def damage(self, shares: list[torch.Tensor] | None) -> torch.Tensor:
        """``float64 [pages, levels]``: damage per page and level (zero at ``TOP_LEVEL``).

        Args:
            shares: Routing share of every expert per layer (``None``: uniform).
        """
        if shares is None:
            return self.base.clone()
        page_share = torch.tensor(
            [float(shares[page.key.layer][page.key.expert]) for page in self.store.pages], dtype=torch.float64
        )
        return self.base * page_share.unsqueeze(-1)
