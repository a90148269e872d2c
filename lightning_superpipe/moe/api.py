"""Plain-PyTorch entry point: ``page_experts(model, ...)`` and the handle it returns."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_superpipe.moe.damage import ActivationStats, DamageModel, RoutingStats
from lightning_superpipe.moe.experts import BINDING_ATTR, PAGED_EXPERTS_IMPLEMENTATION, ExpertsRuntime
from lightning_superpipe.moe.layouts import EXPERT_PROJECTIONS, MoELayer, find_moe_layers
from lightning_superpipe.moe.pages import TOP_LEVEL, PageKey, PageStore, SyncCopyEngine
from lightning_superpipe.moe.planner import BudgetPlanner, MoveCounts

__all__ = ["PagedExperts", "full_expert_bytes", "kv_cache_bytes", "page_experts"]

DEFAULT_LEVELS: tuple[int, ...] = (TOP_LEVEL, 8, 4, 3, 2)


def page_experts(
    model: nn.Module,
    *,
    budget_bytes: int | None = None,
    calibration: Iterable[Any] | None = None,
    group_size: int = 64,
    levels: Sequence[int] = DEFAULT_LEVELS,
    rows_per_page: int | None = None,
    device: torch.device | str | None = None,
    total_budget_bytes: int | None = None,
    hysteresis: float = 0.02,
    exchange_ratio: float = 2.0,
    rebalance_every: int | None = 64,
    routing_half_life_tokens: float | None = 8192.0,
    async_moves: bool = True,
) -> PagedExperts:
    """Page the routed experts' weights of ``model`` in place under a device byte budget.

    The experts' parameters are taken out of the model (their original values kept in host
    memory) and replaced by pages: group-wise 8-bit codes stored as bit planes whose lower planes
    (or original 16-bit weights) sit on the device only while the budget allows. The model keeps
    working as before through a registered ``transformers`` experts implementation; call
    :meth:`PagedExperts.restore` to put the original parameters back, bit for bit.

    The budget covers the stored pages (and uploads in flight). The experts being computed are
    rebuilt in the model's dtype, a chunk of up to 8 experts at a time; that working memory is
    transient, like activations, and not part of the budget. For evaluation and inference: the
    paged experts have no gradients.

    Args:
        model: A Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE model from ``transformers``.
        budget_bytes: Device bytes allowed for the experts (``None``: unlimited, every page at its
            original weights). Changeable later with :meth:`PagedExperts.set_budget`.
        calibration: Model inputs (dicts of keyword arguments, or ``input_ids`` tensors) used to
            measure expert inputs and routing before placing pages. ``None``: weight-only damage
            and uniform routing until routing is observed.
        group_size: Input columns per quantization group; must divide hidden and intermediate size.
        levels: Allowed levels: 16 (the original weights) and bit counts among 8..1; 8 is required.
        rows_per_page: Rows per page within an expert projection (``None``: one page per expert
            and projection, the fewest pages). Finer pages let the planner spend bytes more
            selectively but multiply the pages to plan, move and rebuild; on the benchmark's model
            32-row blocks (5x the pages) lowered the KL at equal bytes by 4-32%.
        device: Device computing the experts (default: where the routers are).
        total_budget_bytes: Pressure mode: a device budget for the experts *and* the KV cache; the
            expert budget shrinks as the cache grows during generation.
        hysteresis: Dead band of the planner, as a fraction of the budget.
        exchange_ratio: Damage ratio needed to move bits between pages when routing shifts.
        rebalance_every: Forward calls between planner runs that follow routing shifts (``None``:
            only when the budget changes).
        routing_half_life_tokens: Half-life of the running routing shares (``None``: cumulative).
        async_moves: On CUDA, upload on a side stream and keep computing at the old precision
            until a promotion lands.

    Returns:
        The handle controlling the paged experts.

    Raises:
        UnsupportedMoEModelError: The model is not of a supported family.
        ValueError: The budget is below the minimum (every page at the lowest level).
    """
    layers = find_moe_layers(model)
    if device is None:
        device = layers[0].router.weight.device
    device = torch.device(device)
    with _eager_autograd_mode():
        store = PageStore(
            layers,
            device=device,
            group_size=group_size,
            levels=levels,
            rows_per_page=rows_per_page,
            copy_engine=None if async_moves else SyncCopyEngine(device),
        )
        # Checked before the model is touched, so that a refused budget leaves it as it was.
        _check_budget(budget_bytes, int(store.bytes_table()[:, -1].sum()), store.min_level)
        handle = PagedExperts(
            model,
            layers,
            store,
            hysteresis=hysteresis,
            exchange_ratio=exchange_ratio,
            rebalance_every=rebalance_every,
            routing_half_life_tokens=routing_half_life_tokens,
        )
    try:
        if calibration is not None:
            handle.calibrate(calibration)
        handle._place(budget_bytes, total_budget_bytes)
    except BaseException:
        handle.restore()
        raise
    return handle


class PagedExperts:
    """Handle of a model whose experts are paged (returned by :func:`page_experts`).

    Args:
        model: The model, already found to be supported.
        layers: Its MoE layers.
        store: The page store built from their experts.
        hysteresis: See :func:`page_experts`.
        exchange_ratio: See :func:`page_experts`.
        rebalance_every: See :func:`page_experts`.
        routing_half_life_tokens: See :func:`page_experts`.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[MoELayer],
        store: PageStore,
        *,
        hysteresis: float,
        exchange_ratio: float,
        rebalance_every: int | None,
        routing_half_life_tokens: float | None,
    ) -> None:
        self.model = model
        self.layers = layers
        self.store = store
        self.planner = BudgetPlanner(
            store.levels, store.bytes_table(), hysteresis=hysteresis, exchange_ratio=exchange_ratio
        )
        self.routing = RoutingStats(layers, half_life_tokens=routing_half_life_tokens)
        _, two_inter, hidden = store.host_weight(layers[0].index, 0).shape
        self.activations = ActivationStats(layers, hidden, two_inter // 2)
        self.damage_model = DamageModel(store)
        self.runtime = ExpertsRuntime(store, self.activations)
        self.moves = MoveCounts()
        self.rebalance_every = rebalance_every
        self._budget: int | None = None
        self._total_budget: int | None = None
        self._levels_index = {level: i for i, level in enumerate(store.levels)}
        self._current: list[int] = []
        self._forwards = 0
        self._commits_seen = 0
        self._routing_seen = 0
        self._restored = False
        self._pretrained = _find_pretrained(model)
        self._previous_implementation = self._pretrained.get_experts_implementation()
        self._params: dict[tuple[int, int], nn.Parameter] = {}
        self._param_devices: dict[tuple[int, int], torch.device] = {}
        self._take_parameters()
        self._pretrained.set_experts_implementation(PAGED_EXPERTS_IMPLEMENTATION)
        for layer in layers:
            if layer.experts.config._experts_implementation != PAGED_EXPERTS_IMPLEMENTATION:
                raise RuntimeError(f"could not select the paged experts implementation for {layer.name}")
        self.routing.attach()
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    # ------------------------------------------------------------------ setup
    def _take_parameters(self) -> None:
        """Move the expert parameters out of the model; their data is the store's host copy."""
        for layer in self.layers:
            setattr(layer.experts, BINDING_ATTR, (self.runtime, layer.index))
            for proj, name in enumerate(EXPERT_PROJECTIONS):
                param = layer.experts._parameters.pop(name)
                self._params[(layer.index, proj)] = param
                self._param_devices[(layer.index, proj)] = param.device
                # Frees the device copy; the Parameter object itself survives for restore().
                param.data = self.store.host_weight(layer.index, proj)

    def _place(self, budget: int | None, total_budget: int | None) -> None:
        """First placement: every page at the lowest level, then promotions up to the budget."""
        self._check_budget(budget)
        self._budget = budget
        self._total_budget = total_budget
        self._refresh_damage()
        for page_id in range(len(self.store.pages)):
            self.store.set_level(page_id, self.store.min_level)
        self._current = [len(self.store.levels) - 1] * len(self.store.pages)
        self.moves += self.planner.rebalance(self.store, self._current, self._effective_budget(), force_fill=True)

    # ------------------------------------------------------------------ budget
    def min_bytes(self) -> int:
        """Device bytes with every page at the lowest level: the smallest feasible budget."""
        return self.planner.min_bytes

    def max_bytes(self) -> int:
        """Device bytes with every page at its original weights (in the model's dtype)."""
        return self.planner.max_bytes

    def full_bytes(self) -> int:
        """The experts' size at 16 bits per weight: the reference for budget fractions.

        Equal to :meth:`max_bytes` for bf16/fp16 models; an fp32 model's originals take twice this.
        """
        return 2 * sum(page.host_weight.numel() for page in self.store.pages)

    def device_bytes(self) -> int:
        """Expert bytes on the device now (pages, their metadata and uploads in flight)."""
        return self.store.device_bytes()

    @property
    def budget(self) -> int | None:
        """The expert budget set by :meth:`set_budget` (``None``: unlimited)."""
        return self._budget

    def set_budget(self, nbytes: int | None) -> MoveCounts:
        """Change the device budget of the experts and move pages accordingly.

        Args:
            nbytes: Bytes allowed (``None``: unlimited).

        Returns:
            The moves made.

        Raises:
            ValueError: ``nbytes`` is below :meth:`min_bytes`.
        """
        self._check_budget(nbytes)
        self._budget = nbytes
        return self._incremental(self._effective_budget())

    def set_total_budget(self, nbytes: int | None) -> None:
        """Pressure mode: device bytes for experts plus KV cache (``None``: off).

        Before every forward the expert budget becomes ``nbytes`` minus the KV cache's bytes after
        that forward (and at most the :meth:`set_budget` value).
        """
        self._total_budget = nbytes

    def _check_budget(self, nbytes: int | None) -> None:
        if self._restored:
            raise RuntimeError("the experts were restored; page the model again with page_experts()")
        _check_budget(nbytes, self.min_bytes(), self.store.min_level)

    def _effective_budget(self, kv_bytes: int = 0) -> int | None:
        if self._total_budget is None:
            return self._budget
        pressure = self._total_budget - kv_bytes
        return pressure if self._budget is None else min(self._budget, pressure)

    def rebalance(self) -> MoveCounts:
        """Re-plan from scratch for the current budget and damage, moving only the pages whose
        level changes (e.g. to hand control back to the planner after :meth:`apply_levels`).

        Returns:
            The moves made.
        """
        counts = self.planner.replan(self.store, self._current, self._effective_budget())
        self.moves += counts
        return counts

    def _incremental(self, budget: int | None, *, exchange: bool = False) -> MoveCounts:
        counts = self.planner.rebalance(self.store, self._current, budget, exchange=exchange)
        self.moves += counts
        return counts

    # ------------------------------------------------------------------ inspection
    def bits(self) -> dict[PageKey, int]:
        """Bits each page computes with now (16: original weights), keyed by page location."""
        return {page.key: page.level for page in self.store.pages}

    def level_counts(self) -> dict[int, int]:
        """Number of pages at each level now."""
        counts = Counter(page.level for page in self.store.pages)
        return {level: counts.get(level, 0) for level in self.store.levels}

    def damage(self) -> torch.Tensor:
        """Predicted damage ``[pages, levels]`` used by the planner (page order of :meth:`bits`)."""
        return torch.tensor(self.planner.damage, dtype=torch.float64)

    def apply_levels(self, levels: Sequence[int] | Mapping[PageKey, int]) -> None:
        """Put pages at explicit levels, bypassing the planner (e.g. for baselines).

        The planner works incrementally from these levels at the next budget change; call
        :meth:`rebalance` to have it re-plan from scratch.

        Args:
            levels: Bits per page, in the order of :meth:`bits` or keyed by page location.
        """
        if isinstance(levels, Mapping):
            levels = [levels[page.key] for page in self.store.pages]
        if len(levels) != len(self.store.pages):
            raise ValueError(f"expected {len(self.store.pages)} levels, got {len(levels)}")
        order = sorted(range(len(levels)), key=lambda i: levels[i] > self.store.pages[i].target_level)
        for page_id in order:  # demotions first, so that the device never holds both
            self.store.set_level(page_id, levels[page_id])
            self._current[page_id] = self._levels_index[levels[page_id]]

    def synchronize(self) -> None:
        """Wait for uploads in flight and commit them."""
        self.store.synchronize()

    # ------------------------------------------------------------------ statistics
    def calibrate(self, batches: Iterable[Any]) -> None:
        """Measure expert inputs and routing on ``batches`` (exact originals) and replan.

        Args:
            batches: Model inputs: dicts of keyword arguments, or ``input_ids`` tensors.
        """
        device = self.store.device
        self.activations.recording = True
        try:
            with self.reference(), torch.no_grad():
                for batch in batches:
                    _call(self.model, batch, device)
        finally:
            self.activations.recording = False
        self.damage_model.update_errors(self.activations)
        if self._current:  # already placed: the damage changed wholesale, plan again
            self._refresh_damage()
            self.rebalance()

    def _refresh_damage(self) -> None:
        shares = self.routing.shares() if self.routing.tokens_seen() > 0 else None
        self.planner.set_damage(self.damage_model.damage(shares))
        self._routing_seen = self.routing.updates

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Compute with the original expert weights inside this context.

        They are streamed from host memory one expert chunk at a time: exact full-precision outputs
        without raising the budget.
        """
        previous = self.runtime.reference
        self.runtime.reference = True
        try:
            yield
        finally:
            self.runtime.reference = previous

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.runtime.reference:
            return
        self._forwards += 1
        budget = self._effective_budget()
        moved = False
        if self._total_budget is not None:
            budget = self._pressure_budget(args, kwargs)
            self._incremental(budget)
            moved = True
        if self.store.commits != self._commits_seen:
            # Landed promotions to the original weights freed their bit planes: room to use.
            self._commits_seen = self.store.commits
            if not moved:
                self._incremental(budget)
        if (
            self.rebalance_every is not None
            and self._forwards % self.rebalance_every == 0
            and self.routing.updates != self._routing_seen
        ):
            self._refresh_damage()
            self._incremental(budget, exchange=True)

    def _pressure_budget(self, args: tuple, kwargs: dict) -> int:
        """Expert budget for the coming forward: the total minus the KV cache it will leave."""
        # transformers >= 5.2x calls it `cache`; earlier 5.x releases `past_key_values`.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kv_after = kv_cache_bytes(cache) + _new_kv_bytes(self.model, args, kwargs)
        budget = self._effective_budget(kv_after)
        if budget < self.min_bytes():
            raise RuntimeError(
                f"pressure mode: the KV cache needs {kv_after:,} of the {self._total_budget:,}-byte total budget, "
                f"leaving {budget:,} bytes for experts, below their minimum of {self.min_bytes():,}. Generate "
                "fewer tokens, use a smaller batch, or raise the total budget."
            )
        return budget

    # ------------------------------------------------------------------ restore
    def restore(self) -> None:
        """Undo :func:`page_experts`: the original parameters back, device pages freed.

        The same ``Parameter`` objects are put back with their original values, bit for bit, on
        their original device, and the previous experts implementation is selected again.
        Calling it twice is harmless.
        """
        if self._restored:
            return
        with _eager_autograd_mode():
            self._hook.remove()
            self.routing.detach()
            self.store.synchronize()
            self.store.release()
            for layer in self.layers:
                for proj, name in enumerate(EXPERT_PROJECTIONS):
                    param = self._params[(layer.index, proj)]
                    host = self.store.host_weight(layer.index, proj)
                    param.data = host.to(self._param_devices[(layer.index, proj)], copy=False)
                    layer.experts._parameters[name] = param
                delattr(layer.experts, BINDING_ATTR)
            self._pretrained.set_experts_implementation(self._previous_implementation)
        self._restored = True


def _check_budget(nbytes: int | None, minimum: int, min_level: int) -> None:
    if nbytes is not None and nbytes < minimum:
        raise ValueError(
            f"budget_bytes={nbytes:,} is below the minimum of {minimum:,} bytes (every page at {min_level} bits "
            "with its group metadata). Raise the budget to at least that, or lower the minimum: allow fewer "
            "bits (levels), or a larger group_size for less metadata."
        )


def full_expert_bytes(model: nn.Module) -> int:
    """Size of a supported model's routed experts at 16 bits per weight (before paging)."""
    layers = find_moe_layers(model)
    return 2 * sum(getattr(layer.experts, name).numel() for layer in layers for name in EXPERT_PROJECTIONS)


def kv_cache_bytes(cache: Any) -> int:
    """Bytes held by a ``transformers`` KV cache (``Cache`` object or legacy tuples); 0 for ``None``."""
    if cache is None:
        return 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    else:
        tensors = [t for layer in cache for t in layer]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def _new_kv_bytes(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """KV-cache bytes the coming forward adds (its new tokens, every layer, keys and values)."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None:
        return 0
    batch, new_tokens = inputs.shape[0], inputs.shape[1]
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element * batch * new_tokens


def _find_pretrained(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if hasattr(module, "set_experts_implementation") and hasattr(module, "get_experts_implementation"):
            return module
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel with experts implementations")


def _call(model: nn.Module, batch: Any, device: torch.device) -> Any:
    """Run ``model`` on one calibration item: a dict of keyword arguments or an ``input_ids`` tensor."""
    if isinstance(batch, Mapping):
        return model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch.to(device))
    raise TypeError(f"calibration items must be dicts of model inputs or input_ids tensors, got {type(batch).__name__}")


@contextlib.contextmanager
def _eager_autograd_mode() -> Iterator[None]:
    """Leave inference mode (Lightning evaluates under it): tensors created here must stay usable
    by autograd once training resumes."""
    with torch.inference_mode(False), torch.no_grad():
        yield
