"""Find the fused-experts MoE layers of any ``transformers`` model, structurally.

``transformers`` 5 routes the experts of its MoE families through one experts interface: a class
decorated with ``@use_experts_implementation`` keeps the weights of all experts of a layer in fused
3-D parameters and records its layout in attributes set by the decorator (``has_gate``,
``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_post_expert_norm``). A MoE layer is
therefore found as *a module whose ``experts`` child carries those attributes*, whatever the family
calls the module (``mlp``, ``block_sparse_moe``, ``feed_forward``, ``mixer`` or the decoder layer
itself, as in Gemma 4). The layouts handled:

* ``gate_up_proj [E, 2I, H]`` + ``down_proj [E, H, I]`` (the common case, gate half first, or
  gate/up interleaved when ``is_concatenated`` is false);
* transposed (``is_transposed``, e.g. gpt-oss): ``gate_up_proj [E, H, 2I]`` + ``down_proj [E, I, H]``;
* no gate (``has_gate`` false, e.g. Nemotron-H): ``up_proj [E, I, H]`` + ``down_proj [E, H, I]``;
* biases (``has_bias``): ``*_proj_bias`` stay unpaged parameters at full precision.

Each weight is described by its *canonical* ``[E, out, in]`` view (a transpose for transposed
layouts): quantization groups always run along the input dimension of that view.

A dense shared expert beside the routed ones (Qwen2-MoE's ``shared_expert``, DeepSeek's
``shared_experts``, ...), recognised as a child with bias-free ``gate_proj``/``up_proj``/``down_proj``
linears and an ``act_fn``, is described as a layer of one expert that every token uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "EXPERT_PROJECTIONS",
    "SHARED_EXPERT_NAMES",
    "SUPPORTED_MODEL_TYPES",
    "MoELayer",
    "UnsupportedMoEModelError",
    "find_moe_layers",
    "is_fused_experts",
]

EXPERT_PROJECTIONS: tuple[str, ...] = ("gate_up_proj", "down_proj")
"""Names of the fused expert weights of the common (gated) layout, in the order they apply."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""Families paging was first written for. Paging is no longer limited to them: any model whose experts
go through ``transformers``' experts interface is found structurally (see :func:`find_moe_layers`)."""

SHARED_EXPERT_NAMES: tuple[str, ...] = ("shared_expert", "shared_experts", "shared_mlp")
"""Child names under which families keep a dense expert that every token uses."""

_ROUTER_NAMES = ("gate", "router")
# Where families keep the experts per token, on the router, the block, the experts or the config.
_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token")
_INTERFACE_ATTRS = ("has_gate", "is_transposed", "is_concatenated", "has_bias")


class UnsupportedMoEModelError(ValueError):
    """The model has no expert layout that paging supports."""


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module of ``transformers``' experts interface."""
    return all(hasattr(module, attr) for attr in _INTERFACE_ATTRS) and hasattr(module, "config")


@dataclass(frozen=True)
class MoELayer:
    """One unit of paged weights: the routed experts of a MoE layer, or its dense shared expert.

    Args:
        index: Position among the model's paged units (0-based).
        name: Qualified name of the module holding the weights, e.g. ``"model.layers.3.mlp.experts"``.
        block: The module owning the experts (the MoE block, or the decoder layer in Gemma 4).
        router: The block's router (``None`` for a shared expert or where none is found).
        experts: The fused experts module, or the shared expert module.
        projections: Names of the paged weights, in the order they apply (input side first).
        slots: ``(module, attribute)`` holding each paged weight as a parameter.
        transposed: Whether the weights are stored ``[E, in, out]`` (canonical view: a transpose).
        concatenated: Gate half then up half (``True``) or interleaved gate/up rows (``False``).
        has_gate: Whether the input projection holds gate and up rows (else only up rows).
        shared: A dense shared expert (every token uses it, routing weight 1).
        top_k_hint: Experts per token from the router or the config (``None``: unknown until routed).
        hidden_size: Model width (input features of the first projection).
        intermediate_size: Width of one expert (input features of ``down_proj``).
    """

    index: int
    name: str
    block: nn.Module
    router: nn.Module | None
    experts: nn.Module
    projections: tuple[str, ...]
    slots: tuple[tuple[nn.Module, str], ...]
    transposed: bool = False
    concatenated: bool = True
    has_gate: bool = True
    shared: bool = False
    top_k_hint: int | None = None
    hidden_size: int = 0
    intermediate_size: int = 0

    def weight(self, proj: int) -> torch.Tensor:
        """The paged weight ``proj`` as stored in the model (``[E, ...]``)."""
        module, attr = self.slots[proj]
        weight = getattr(module, attr)
        return weight.unsqueeze(0) if self.shared else weight

    def canonical(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``[E, out, in]`` view of a weight of this layer stored in its own layout."""
        return tensor.mT if self.transposed else tensor

    @property
    def num_experts(self) -> int:
        """Experts in this unit (1 for a shared expert)."""
        return 1 if self.shared else int(self.experts.num_experts)

    @property
    def top_k(self) -> int:
        """Experts each token is routed to (1 for a shared expert)."""
        if self.shared:
            return 1
        if self.top_k_hint is None:
            raise RuntimeError(f"the experts per token of {self.name} are unknown until tokens are routed")
        return self.top_k_hint

    def gate_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Map from the input projection's output to ``down_proj``'s input (the family's own gating)."""
        if self.shared:
            act = self.experts.act_fn
            return lambda z: act(z[..., : z.shape[-1] // 2]) * z[..., z.shape[-1] // 2 :]
        if self.has_gate:
            return self.experts._apply_gate
        return self.experts.act_fn

    def row_to_hidden(self) -> torch.Tensor:
        """For each output row of the input projection, the ``down_proj`` input it feeds."""
        inter = self.intermediate_size
        if not self.has_gate:
            return torch.arange(inter)
        if self.concatenated:
            return torch.arange(2 * inter) % inter
        return torch.arange(2 * inter) // 2


def _unsupported(reason: str) -> UnsupportedMoEModelError:
    return UnsupportedMoEModelError(
        f"{reason}. Paged MoE precision pages experts that go through transformers' experts interface "
        "(classes decorated with `@use_experts_implementation`, with fused 3-D `gate_up_proj`/`up_proj` and "
        "`down_proj` parameters): Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, gpt-oss, GraniteMoE, "
        "PhiMoE, MiniMax, ... Families whose experts are separate modules or custom kernels (e.g. DBRX, "
        "Llama 4) cannot be paged; use one of the fused-experts families."
    )


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _top_k(*holders: object) -> int | None:
    for holder in holders:
        if holder is None:
            continue
        for name in _TOP_K_NAMES:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _router(block: nn.Module) -> nn.Module | None:
    for name in _ROUTER_NAMES:
        router = getattr(block, name, None)
        if isinstance(router, nn.Module):
            return router
    return None


def _experts_layer(index: int, name: str, block: nn.Module, experts: nn.Module, caller: str) -> MoELayer:
    projections = ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")
    for proj in projections:
        if not isinstance(experts._parameters.get(proj), nn.Parameter):
            raise _unsupported(
                f"{caller}() refused: experts module {name!r} does not hold `{proj}` as a parameter (already "
                "paged, quantized, or wrapped by an adapter)"
            )
    router = _router(block)
    config = experts.config
    text_config = getattr(config, "text_config", None)
    layer = MoELayer(
        index=index,
        name=name,
        block=block,
        router=router,
        experts=experts,
        projections=projections,
        slots=tuple((experts, proj) for proj in projections),
        transposed=bool(experts.is_transposed),
        concatenated=bool(experts.is_concatenated),
        has_gate=bool(experts.has_gate),
        top_k_hint=_top_k(router, block, experts, config, text_config),
    )
    first, down = (layer.canonical(layer.weight(p)) for p in (0, 1))
    rows = 2 * down.shape[-1] if layer.has_gate else down.shape[-1]
    chained = first.dim() == down.dim() == 3 and first.shape[:2] == (down.shape[0], rows)
    if not chained or down.shape[1] != first.shape[2]:
        raise _unsupported(
            f"{caller}() refused: experts module {name!r} has {projections[0]} {tuple(first.shape)} and down_proj "
            f"{tuple(down.shape)} (canonical [E, out, in] views), which do not chain as "
            f"[E, {'2I' if layer.has_gate else 'I'}, H] and [E, H, I]"
        )
    return dataclasses.replace(layer, hidden_size=int(first.shape[-1]), intermediate_size=int(down.shape[-1]))


def _shared_layer(index: int, name: str, block: nn.Module, shared: nn.Module) -> MoELayer | None:
    """A dense gated MLP every token uses, or ``None`` when ``shared`` is not one we can page."""
    linears = [getattr(shared, proj, None) for proj in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(linear, nn.Linear) and linear.bias is None for linear in linears):
        return None
    if not callable(getattr(shared, "act_fn", None)):
        return None
    gate, up, down = (linear.weight for linear in linears)
    if gate.shape != up.shape or down.shape != (gate.shape[1], gate.shape[0]):
        return None
    return MoELayer(
        index=index,
        name=name,
        block=block,
        router=None,
        experts=shared,
        projections=("gate_proj", "up_proj", "down_proj"),
        slots=tuple((linear, "weight") for linear in linears),
        shared=True,
        hidden_size=int(gate.shape[1]),
        intermediate_size=int(gate.shape[0]),
    )


def find_moe_layers(model: nn.Module, *, shared_experts: bool = True, caller: str = "page_experts") -> list[MoELayer]:
    """Return the paged units of a model: routed experts (and dense shared experts), in module order.

    Args:
        model: A ``transformers`` model (or any module containing one, e.g. a PEFT wrapper).
        shared_experts: Also return the blocks' dense shared experts (as one-expert units).
        caller: The public function being called, quoted in errors.

    Returns:
        One :class:`MoELayer` per fused experts module, each followed by its block's shared expert
        when there is one (dense layers are skipped).

    Raises:
        UnsupportedMoEModelError: If the model holds no fused experts module of the experts
            interface, or one whose weights are laid out in a way paging does not know.
    """
    layers: list[MoELayer] = []
    other_experts: list[str] = []
    for name, module in model.named_modules():
        experts = module._modules.get("experts")
        if experts is None:
            continue
        prefix = f"{name}." if name else ""
        if not is_fused_experts(experts):
            other_experts.append(f"{prefix}experts ({type(experts).__name__})")
            continue
        layers.append(_experts_layer(len(layers), f"{prefix}experts", module, experts, caller))
        if not shared_experts:
            continue
        for shared_name in SHARED_EXPERT_NAMES:
            shared = module._modules.get(shared_name)
            if shared is not None:
                unit = _shared_layer(len(layers), f"{prefix}{shared_name}", module, shared)
                if unit is not None:
                    layers.append(unit)
    if not layers:
        found = f"; its experts modules {', '.join(other_experts[:2])} do not use it" if other_experts else ""
        raise _unsupported(
            f"{caller}({type(model).__name__}) refused: {type(model).__name__} (model type "
            f"{_model_type(model)!r}) has no fused experts module of the transformers experts interface{found}"
        )
    return layers
