"""Plain-PyTorch entry point: ``page_experts(model, ...)`` and the handle it returns."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import nn

from lightning_superpipe.moe.damage import ActivationStats, DamageModel, RoutingStats
from lightning_superpipe.moe.experts import (
    BINDING_ATTR,
    PAGED_EXPERTS_IMPLEMENTATION,
    ExpertsRuntime,
    SharedExpertHooks,
)
from lightning_superpipe.moe.layouts import MoELayer, find_moe_layers
from lightning_superpipe.moe.options import PagingOptions, resolve_expert_budget
from lightning_superpipe.moe.pages import PageKey, PageStore, SyncCopyEngine
from lightning_superpipe.moe.planner import BudgetPlanner, MoveCounts
from lightning_superpipe.moe.progress import StepProgress
from lightning_superpipe.planning.budget import MemoryBudget

__all__ = ["PagedExperts", "expert_parameters", "full_expert_bytes", "kv_cache_bytes", "page_experts"]

CALIBRATION_BATCHES = "MoE calibration: batches through the original experts"
CALIBRATION_ROUNDING = "MoE calibration: rounding the experts with their Hessians (GPTQ)"


def page_experts(
    model: nn.Module,
    *,
    expert_budget: MemoryBudget | None = None,
    calibration: Iterable[Any] | None = None,
    device: torch.device | str | None = None,
    expert_and_kv_budget: MemoryBudget | None = None,
    shared_experts: bool = True,
    options: PagingOptions | None = None,
    progress: bool = True,
) -> PagedExperts:
    """Page the experts' weights of ``model`` (routed and dense shared) in place under a budget of expert bytes.

    The experts' parameters are taken out of the model (their original values kept in host
    memory) and replaced by pages: group-wise 8-bit codes stored as bit planes whose lower planes
    (or original 16-bit weights) sit on the device only while the budget allows. The model keeps
    working as before through a registered ``transformers`` experts implementation; call
    :meth:`PagedExperts.restore` to put the original parameters back, bit for bit.

    The budget covers the stored pages (and uploads in flight). Below a full budget the weights of
    a projection being computed are rebuilt in the model's dtype, one layer at a time; that working
    memory is transient, like activations, and not part of the budget. At a full budget nothing is
    rebuilt: the experts implementation that was active before paging runs on the original tensors.
    For evaluation and inference: the paged experts have no gradients.

    Args:
        model: A ``transformers`` model whose experts go through its experts interface (any
            fused-experts family: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss, ...).
        expert_budget: Device bytes for the experts only, not the device's whole budget (``memory_budget``):
            bytes (``6_000_000_000``, ``"6GiB"``) or a percentage of the experts' 16-bit size (``"30%"``);
            ``None``: unlimited, every page at its original weights. Changeable later with
            :meth:`PagedExperts.set_budget`.
        calibration: Model inputs (dicts of keyword arguments, or ``input_ids`` tensors) used to
            measure expert inputs and routing before placing pages. ``None``: weight-only damage
            and uniform routing until routing is observed.
        device: Device computing the experts (default: where the experts' parameters are).
        expert_and_kv_budget: Pressure mode: device bytes for the experts *and* the KV cache (bytes only); the
            expert budget shrinks as the cache grows during generation.
        shared_experts: Also page the blocks' dense shared experts (with their own damage: every
            token uses them, so the planner keeps them precise first).
        options: Codes, pages and planner (:class:`~lightning_superpipe.moe.PagingOptions`).
        progress: Show the calibration's progress (:meth:`PagedExperts.calibrate`); ``False`` shows nothing.

    Returns:
        The handle controlling the paged experts.

    Raises:
        UnsupportedMoEModelError: The model holds no fused experts of ``transformers``' experts interface
            (e.g. DBRX, Llama 4), or their weights are laid out in a way paging does not know.
        ValueError: The budget is below the minimum (every page at the lowest level), or not a budget.
    """
    options = options or PagingOptions()
    layers = find_moe_layers(model, shared_experts=shared_experts)
    device = torch.device(device if device is not None else layers[0].weight(0).device)
    call = f"page_experts(expert_and_kv_budget={expert_and_kv_budget!r})"
    pressure = resolve_expert_budget(expert_and_kv_budget, None, call)
    with _eager_autograd_mode():
        store = PageStore(
            layers,
            device=device,
            group_size=options.group_size,
            levels=options.levels,
            rows_per_page=options.rows_per_page,
            copy_engine=None if options.async_moves else SyncCopyEngine(device),
        )
        # Checked before the model is touched, so that a refused budget leaves it as it was.
        call = f"page_experts(expert_budget={expert_budget!r})"
        budget = resolve_expert_budget(expert_budget, _full_bytes(store), call)
        _check_budget(budget, int(store.bytes_table()[:, -1].sum()), store.min_level)
        handle = PagedExperts(model, layers, store, options)
    try:
        if calibration is not None:
            handle.calibrate(calibration, progress=progress)
        handle._place(budget, pressure)
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
        options: The planner's settings (see :class:`~lightning_superpipe.moe.PagingOptions`).
    """

    def __init__(self, model: nn.Module, layers: list[MoELayer], store: PageStore, options: PagingOptions) -> None:
        self.model = model
        self.layers = layers
        self.store = store
        self.planner = BudgetPlanner(
            store.levels, store.bytes_table(), hysteresis=options.hysteresis, exchange_ratio=options.exchange_ratio
        )
        self.routing = RoutingStats(layers, half_life_tokens=options.routing_half_life_tokens)
        self.activations = ActivationStats(layers, full=options.error_feedback)
        self.damage_model = DamageModel(store)
        previous = {layer.index: layer.experts.config._experts_implementation for layer in layers if not layer.shared}
        self.runtime = ExpertsRuntime(store, layers, self.activations, self.routing, previous)
        self.moves = MoveCounts()
        self.rebalance_every = options.rebalance_every
        self._budget: int | None = None
        self._expert_and_kv_budget: int | None = None
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
        self._shared_hooks: list[SharedExpertHooks] = []
        self._take_parameters()
        self._pretrained.set_experts_implementation(PAGED_EXPERTS_IMPLEMENTATION)
        for layer in layers:
            if not layer.shared and layer.experts.config._experts_implementation != PAGED_EXPERTS_IMPLEMENTATION:
                self.restore()
                raise RuntimeError(
                    f"could not select the paged experts implementation for {layer.name}: its config is not "
                    f"the one `{type(self._pretrained).__name__}.set_experts_implementation` sets"
                )
        self.routing.attach()
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    # ------------------------------------------------------------------ setup
    def _take_parameters(self) -> None:
        """Move the expert parameters out of the model; their data is the store's host copy."""
        for layer in self.layers:
            if layer.shared:
                self._shared_hooks.append(SharedExpertHooks(self.runtime, layer.index))
            else:
                setattr(layer.experts, BINDING_ATTR, (self.runtime, layer.index))
            for proj, (module, name) in enumerate(layer.slots):
                param = module._parameters.pop(name)
                self._params[(layer.index, proj)] = param
                self._param_devices[(layer.index, proj)] = param.device
                # Frees the device copy; the Parameter object itself survives for restore().
                param.data = self._host_param(layer, proj)

    def _host_param(self, layer: MoELayer, proj: int) -> torch.Tensor:
        host = self.store.host_weight(layer.index, proj)
        return host.squeeze(0) if layer.shared else host

    def _place(self, budget: int | None, expert_and_kv_budget: int | None) -> None:
        """First placement: every page at the lowest level, then promotions up to the budget."""
        self._check_budget(budget)
        self._budget = budget
        self._expert_and_kv_budget = expert_and_kv_budget
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
        """The experts' size at 16 bits per weight: what a percentage ``expert_budget`` is a share of.

        Equal to :meth:`max_bytes` for bf16/fp16 models; an fp32 model's originals take twice this.
        """
        return _full_bytes(self.store)

    def unit_bytes(self) -> dict[str, int]:
        """Device bytes now per paged unit, keyed by module name (routed experts and shared experts)."""
        totals = {layer.name: 0 for layer in self.layers}
        for page in self.store.pages:
            totals[self.layers[page.key.layer].name] += page.device_nbytes()
        return totals

    def device_bytes(self) -> int:
        """Expert bytes on the device now (pages, their metadata and uploads in flight)."""
        return self.store.device_bytes()

    @property
    def budget(self) -> int | None:
        """The expert budget in bytes, as set by :meth:`set_budget` (``None``: unlimited)."""
        return self._budget

    def set_budget(self, expert_budget: MemoryBudget | None) -> MoveCounts:
        """Change the device budget of the experts (``expert_budget`` of :func:`page_experts`) and move pages
        accordingly.

        Args:
            expert_budget: Bytes (an int or ``"6GiB"``) or a percentage of :meth:`full_bytes` (``"30%"``);
                ``None``: unlimited.

        Returns:
            The moves made.

        Raises:
            ValueError: The budget is below :meth:`min_bytes`, or not a budget.
        """
        nbytes = resolve_expert_budget(expert_budget, self.full_bytes(), f"set_budget({expert_budget!r})")
        self._check_budget(nbytes)
        self._budget = nbytes
        if self.routing.updates != self._routing_seen:  # routing seen since the last plan counts now
            self._refresh_damage()
        return self._incremental(self._effective_budget())

    def _everything_fits(self, budget: int | None) -> bool:
        return (budget is None or budget >= self.max_bytes()) and self.device_bytes() == self.max_bytes()

    def set_expert_and_kv_budget(self, expert_and_kv_budget: MemoryBudget | None) -> None:
        """Pressure mode: device bytes for experts plus KV cache (``None``: off; ``expert_and_kv_budget`` of
        :func:`page_experts`).

        Before every forward the expert budget becomes this budget minus the KV cache's bytes after
        that forward (and at most the :meth:`set_budget` value).
        """
        call = f"set_expert_and_kv_budget({expert_and_kv_budget!r})"
        self._expert_and_kv_budget = resolve_expert_budget(expert_and_kv_budget, None, call)

    def _check_budget(self, nbytes: int | None) -> None:
        if self._restored:
            raise RuntimeError("the experts were restored; page the model again with page_experts()")
        _check_budget(nbytes, self.min_bytes(), self.store.min_level)

    def _effective_budget(self, kv_bytes: int = 0) -> int | None:
        if self._expert_and_kv_budget is None:
            return self._budget
        pressure = self._expert_and_kv_budget - kv_bytes
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
    def calibrate(self, batches: Iterable[Any], *, progress: bool = True) -> None:
        """Measure expert inputs and routing on ``batches`` (exact originals) and replan.

        With ``PagingOptions.error_feedback`` (the default), every expert matrix is then rounded again with its
        Hessian, the longest part on a large model. Both steps show their progress: a bar on a terminal; elsewhere
        INFO lines of the ``lightning_superpipe.moe.progress`` logger when a step starts, about every 30 seconds
        and when it ends, with the time taken.

        Args:
            batches: Model inputs: dicts of keyword arguments, or ``input_ids`` tensors.
            progress: Show the progress; ``False`` shows nothing (as on a trainer's other ranks).
        """
        device = self.store.device
        count = len(batches) if isinstance(batches, Sized) else None
        self.activations.recording = True
        try:
            with (
                StepProgress(CALIBRATION_BATCHES, count, ("batch", "batches"), enabled=progress) as shown,
                self.reference(),
                torch.no_grad(),
            ):
                for batch in batches:
                    _call(self.model, batch, device)
                    shown.advance()
        finally:
            self.activations.recording = False
        if self.activations.full and self.activations.recorded:
            hessians = {}
            for layer in self.layers:
                for proj, hessian in enumerate(self.activations.hessians(layer.index)):
                    hessians[(layer.index, proj)] = hessian
            matrices = self.store.requantized_matrices(hessians)
            with (
                StepProgress(CALIBRATION_ROUNDING, matrices, ("expert matrix", "expert matrices"), enabled=progress)
                as shown,
                _eager_autograd_mode(),
            ):
                self.store.requantize(hessians, progress=shown.advance)
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
        if self._expert_and_kv_budget is not None:
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
            and not self._everything_fits(budget)  # at a full budget there is nothing to exchange
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
                f"pressure mode: the KV cache needs {kv_after:,} of the {self._expert_and_kv_budget:,}-byte "
                f"expert_and_kv_budget, leaving {budget:,} bytes for experts, below their minimum of "
                f"{self.min_bytes():,}. Generate fewer tokens, use a smaller batch, or raise the budget."
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
            if hasattr(self, "_hook"):
                self._hook.remove()
            self.routing.detach()
            for hooks in self._shared_hooks:
                hooks.remove()
            self.store.synchronize()
            self.store.release()
            for layer in self.layers:
                for proj, (module, name) in enumerate(layer.slots):
                    param = self._params.get((layer.index, proj))
                    if param is None:
                        continue
                    host = self._host_param(layer, proj)
                    param.data = host.to(self._param_devices[(layer.index, proj)], copy=False)
                    vars(module).pop(name, None)
                    module._parameters[name] = param
                if hasattr(layer.experts, BINDING_ATTR):
                    delattr(layer.experts, BINDING_ATTR)
            self._pretrained.set_experts_implementation(self._previous_implementation)
        self._restored = True


def _check_budget(nbytes: int | None, minimum: int, min_level: int) -> None:
    if nbytes is not None and nbytes < minimum:
        raise ValueError(
            f"expert_budget={nbytes:,} bytes is below the minimum of {minimum:,} bytes (every page at {min_level} bits "
            "with its group metadata). Raise the budget to at least that, or lower the minimum: allow fewer "
            "bits (levels), or a larger group_size for less metadata."
        )


def _full_bytes(store: PageStore) -> int:
    """The paged experts' size at 16 bits per weight."""
    return 2 * sum(page.host_weight.numel() for page in store.pages)


def full_expert_bytes(model: nn.Module, *, shared_experts: bool = True) -> int:
    """Size of a model's pageable expert weights at 16 bits per weight (before paging).

    Args:
        model: A model :func:`page_experts` accepts.
        shared_experts: Count the dense shared experts too (as :func:`page_experts` pages them).
    """
    layers = find_moe_layers(model, shared_experts=shared_experts, caller="full_expert_bytes")
    return 2 * sum(layer.weight(proj).numel() for layer in layers for proj in range(len(layer.projections)))


def expert_parameters(model: nn.Module, *, shared_experts: bool = True) -> list[nn.Parameter]:
    """The parameters :func:`page_experts` takes out of ``model`` (to be given back by :meth:`PagedExperts.restore`).

    Args:
        model: A model :func:`page_experts` accepts.
        shared_experts: Include the dense shared experts (as :func:`page_experts` pages them).
    """
    layers = find_moe_layers(model, shared_experts=shared_experts, caller="expert_parameters")
    return [module._parameters[name] for layer in layers for module, name in layer.slots]


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
