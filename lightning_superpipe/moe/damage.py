"""Predicted damage of each page at each level, from routing and activation statistics.

The damage of a page of expert ``e`` at a level is the Hessian-diagonal weighted error of its
weights, weighted by how often ``e`` is used::

    damage = share_e * sum_ij r_i * E_e[w^2 x_j^2] * (W_ij - W^_ij)^2

``E_e[.]`` is the mean over the calibration tokens routed to ``e``, ``x`` the projection's input
(the ``gate_up_proj`` input, or the ``down_proj`` input ``act(gate) * up``), ``w`` the token's
routing weight for ``e`` (the expert's output is scaled by it), and ``share_e`` the running share of
tokens routed to ``e``, counted in the experts forward from the routed indices it receives. ``r_i``
puts both projections in the same units, the error of the MoE block's output: 1 for ``down_proj``
rows; for rows of the input projection, the mean square of ``d h / d z_i`` (``h`` the ``down_proj``
input; ``act'(gate_i) * up_i`` for a gate row and ``act(gate_i)`` for an up row with the default
gate) times the squared norm of the ``down_proj`` column that ``z_i`` feeds. The derivative is taken
by autograd through the family's own gating (``_apply_gate``: gpt-oss clamps and offsets, others
interleave gate and up rows, gate-less experts apply ``act_fn`` alone), so it is right for each.

With the full second moments kept (``ActivationStats(full=True)``, the default of ``page_experts``),
the column weights are the matrix ``C_e = E_e[w^2 x x^T]`` and the error of a row is ``e^T C_e e``:
the codes rounded with error feedback (:meth:`PageStore.requantize`, with the same ``C_e`` as
Hessian) make errors that cancel on correlated inputs, which the diagonal would not see.

A dense shared expert is one expert with routing weight 1 and share 1: every token uses it, so its
pages are the hottest. Without calibration data ``r = 1``, ``E[w^2 x^2] = 1`` and shares are
uniform until routing is observed: the damage is then the plain weight error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.moe.pages import TOP_LEVEL, PageStore

__all__ = ["ActivationStats", "DamageModel", "RoutingStats"]


class RoutingStats:
    """Running share of tokens routed to each expert, counted from the experts' routed indices.

    Counts decay with a half-life in tokens so that the shares follow the current workload. The
    paged experts forward reports each call's ``top_k_index`` (:meth:`observe`), so no hook on the
    router is needed and any router (returning indices, weights or logits) works.

    Args:
        layers: The model's paged units (shared experts have a fixed share of 1).
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
        self.top_k = [layer.top_k if layer.shared or layer.top_k_hint else None for layer in layers]
        self._pending: list[list[torch.Tensor]] = [[] for _ in layers]
        self._pending_elements = 0
        self.attached = False
        self.updates = 0

    def attach(self) -> None:
        """Start counting."""
        self.attached = True

    def detach(self) -> None:
        """Stop counting."""
        self.attached = False

    _MAX_PENDING = 256
    """Calls whose routing is kept before it is folded in (bounds memory when nobody reads)."""
    _MAX_PENDING_ELEMENTS = 1 << 20
    """Routed indices kept before they are folded in."""

    def observe(self, index: int, top_k_index: torch.Tensor) -> None:
        """Count one call's routing of unit ``index`` (``[tokens, top_k]`` expert indices)."""
        if not self.attached or self.layers[index].shared:
            return
        self.top_k[index] = int(top_k_index.shape[-1])
        # Only a reference is kept (no kernel, no host sync per forward: this runs per layer per
        # token step); the counting happens in one batched bincount when the shares are read.
        self._pending[index].append(top_k_index.reshape(-1))
        self._pending_elements += top_k_index.numel()
        self.updates += 1
        if len(self._pending[index]) >= self._MAX_PENDING or self._pending_elements >= self._MAX_PENDING_ELEMENTS:
            self._fold()

    def _fold(self) -> None:
        for i, pending in enumerate(self._pending):
            if not pending:
                continue
            num_experts, top_k = self.layers[i].num_experts, self.top_k[i]
            new_tokens = [p.numel() / top_k for p in pending]
            total = sum(new_tokens)
            if self.half_life_tokens is None:
                weights = [1.0] * len(pending)
                decay = 1.0
            else:
                # The decay of call j applies to everything before it: call i weighs prod_{j>i} d_j.
                after = 0.0
                weights = []
                for tokens in reversed(new_tokens):
                    weights.append(0.5 ** (after / self.half_life_tokens))
                    after += tokens
                weights.reverse()
                decay = 0.5 ** (total / self.half_life_tokens)
            indices = torch.cat(pending)
            per_index = torch.repeat_interleave(
                torch.tensor(weights, dtype=torch.float64, device=indices.device),
                torch.tensor([p.numel() for p in pending], device=indices.device),
            )
            # Indices past the last expert (expert-parallel sentinels) are not tokens of this rank.
            counts = torch.bincount(indices, weights=per_index, minlength=num_experts)[:num_experts]
            self.counts[i] = self.counts[i] * decay + counts.double().cpu()
            self.tokens[i] = self.tokens[i] * decay + sum(w * t for w, t in zip(weights, new_tokens))
            pending.clear()
        self._pending_elements = 0

    def shares(self) -> list[torch.Tensor]:
        """Per unit, ``float64 [E]``: share of tokens routed to each expert (sums to ``top_k``; 1 for
        a shared expert)."""
        self._fold()
        result = []
        for i, (layer, counts, tokens) in enumerate(zip(self.layers, self.counts, self.tokens)):
            if layer.shared:
                result.append(torch.ones(1, dtype=torch.float64))
                continue
            top_k = self.top_k[i] or 1
            prior = self.prior_tokens * top_k / layer.num_experts
            result.append((counts + prior) / (tokens + self.prior_tokens))
        return result

    def tokens_seen(self) -> float:
        """Tokens counted so far (after decay), averaged over routed units."""
        self._fold()
        routed = [t for layer, t in zip(self.layers, self.tokens) if not layer.shared]
        return sum(routed) / max(1, len(routed))


class ActivationStats:
    """Routing-weighted second moments of expert inputs, recorded while calibrating.

    Per unit and expert: ``sum w^2 x_j^2`` of the input projection's input, ``sum w^2 h_j^2`` of the
    ``down_proj`` input, ``sum w^2 (dh/dz_i)^2`` of the input projection's outputs, ``sum w^2`` and
    the number of tokens.

    With ``full`` (and while the matrices fit in ``max_full_bytes``) it also keeps the full
    routing-weighted second-moment matrices ``sum w^2 x x^T`` and ``sum w^2 h h^T`` per expert: the
    Hessians with which :meth:`PageStore.requantize` rounds each expert matrix with error feedback
    and with which the damage counts the errors' correlations (``e^T H e`` rather than its diagonal).

    Args:
        layers: The model's paged units.
        full: Keep the full second-moment matrices.
        max_full_bytes: Their float64 size above which only the diagonals are kept.
    """

    def __init__(self, layers: list[MoELayer], *, full: bool = True, max_full_bytes: int = 2 << 30) -> None:
        self.layers = layers
        full_bytes = 8 * sum(
            layer.num_experts * (layer.hidden_size**2 + layer.intermediate_size**2) for layer in layers
        )
        self.full = full and full_bytes <= max_full_bytes
        self.input_gram: list[torch.Tensor | None] = [None] * len(layers)
        self.hidden_gram: list[torch.Tensor | None] = [None] * len(layers)

        def zeros(size: Callable[[MoELayer], tuple[int, ...]]) -> list[torch.Tensor]:
            return [torch.zeros(layer.num_experts, *size(layer), dtype=torch.float64) for layer in layers]

        self.input_sq = zeros(lambda layer: (layer.hidden_size,))
        self.hidden_sq = zeros(lambda layer: (layer.intermediate_size,))
        self.slope_sq = zeros(lambda layer: (len(layer.row_to_hidden()),))
        self.weight_sq = zeros(lambda layer: ())
        self.tokens = zeros(lambda layer: ())
        self.recording = False

    def record(
        self,
        layer: int,
        expert: int,
        inputs: torch.Tensor,
        pre_activation: torch.Tensor,
        gate_fn: Callable[[torch.Tensor], torch.Tensor],
        routing_weights: torch.Tensor,
    ) -> None:
        """Add one expert's tokens.

        Args:
            layer: Unit index.
            expert: Expert index.
            inputs: ``[tokens, hidden]`` inputs of the expert.
            pre_activation: ``[tokens, rows]`` output of its input projection (bias included).
            gate_fn: The family's map from that output to the ``down_proj`` input.
            routing_weights: ``[tokens]`` routing weights of the expert for those tokens.
        """
        if not self.recording:
            return
        w_sq = routing_weights.detach().float().square().unsqueeze(-1)
        # Each z_i feeds one h_j, so d(sum h)/dz_i is dh_j/dz_i: exact for any elementwise gating.
        with torch.inference_mode(False), torch.enable_grad():
            z = pre_activation.detach().float().clone().requires_grad_(True)
            hidden = gate_fn(z)
            (sensitivity,) = torch.autograd.grad(hidden.sum(), z)
        hidden = hidden.detach()
        if self.full:
            for grams, values, size in (
                (self.input_gram, inputs.detach().float(), self.layers[layer].hidden_size),
                (self.hidden_gram, hidden, self.layers[layer].intermediate_size),
            ):
                if grams[layer] is None:
                    grams[layer] = torch.zeros(self.layers[layer].num_experts, size, size, dtype=torch.float64)
                weighted = values * w_sq
                grams[layer][expert] += (weighted.T @ values).double().cpu()
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

    def hessians(self, layer: int, prior_tokens: float = 1.0) -> list[torch.Tensor | None]:
        """Full input second moments ``E_e[w^2 x x^T]`` per routed token of every projection of a unit.

        Args:
            layer: Unit index.
            prior_tokens: Pseudo-tokens of the layer mean added to every expert (an expert that no
                calibration token reached gets the layer's mean).

        Returns:
            ``float64 [E, cols, cols]`` per projection, in the unit's projection order (``None``
            where the full matrices are not kept).
        """
        grams = self.input_gram[layer], self.hidden_gram[layer]
        if grams[0] is None or grams[1] is None:
            return [None] * len(self.layers[layer].projections)
        tokens = self.tokens[layer]
        inputs, hidden = (self._per_token(g, tokens, prior_tokens) for g in grams)
        if len(self.layers[layer].projections) == 3:
            return [inputs, inputs, hidden]
        return [inputs, hidden]

    def projection_weights(
        self, layer: int, down_proj: torch.Tensor, prior_tokens: float = 1.0
    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """Row and column weights of every projection of a unit, per routed token.

        Args:
            layer: Unit index.
            down_proj: ``[E, hidden, intermediate]`` original ``down_proj`` weights (canonical view).
            prior_tokens: Pseudo-tokens of the layer mean added to every expert.

        Returns:
            ``(rows, cols)`` per projection, in the unit's projection order (``rows`` ``None``: 1).
        """
        unit = self.layers[layer]
        tokens = self.tokens[layer]
        weight_sq = self._per_token(self.weight_sq[layer], tokens, prior_tokens)
        slope_sq = self._per_token(self.slope_sq[layer], tokens, prior_tokens)
        # E[w^2 s^2] / E[w^2]: the routing weight is counted once, in the column weights.
        slope_sq = slope_sq / weight_sq.clamp_min(1e-30).unsqueeze(-1)
        column_norm_sq = down_proj.double().square().sum(dim=1)  # [E, I]
        rows = slope_sq * column_norm_sq[:, unit.row_to_hidden()]
        input_cols = self._per_token(self.input_sq[layer], tokens, prior_tokens)
        down_cols = self._per_token(self.hidden_sq[layer], tokens, prior_tokens)
        if len(unit.projections) == 3:  # a dense expert: separate gate and up linears
            inter = unit.intermediate_size
            return [(rows[:, :inter], input_cols), (rows[:, inter:], input_cols), (None, down_cols)]
        return [(rows, input_cols), (None, down_cols)]


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
                last = len(activations.layers[layer].projections) - 1
                down_proj = self.store.canonical_host_weight(layer, last)
                rows, cols = activations.projection_weights(layer, down_proj)[proj]
                full = activations.hessians(layer)[proj]
                if full is not None:
                    cols = full
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
