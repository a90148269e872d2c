"""Quantized layers: which the strategy streams, and one clear error for the others, before anything is allocated.

Streamed weights travel as full-precision tensors (float32, bfloat16 or float16), one flat buffer per block, and the
hooks bind device tensors into the modules. bitsandbytes' 4-bit layers (``Linear4bit``: NF4 or FP4, with or without
double quantization; QLoRA's frozen base) are the exception: their packed weights and quantization state travel as the
bytes they are and are rebuilt on the device for bitsandbytes' own kernels
(:mod:`lightning_superpipe.memory.fourbit.packed`), when they stream with a block. Any other quantized layer
(bitsandbytes 8-bit, GPTQ, AWQ, HQQ, quanto, torchao) holds packed integers and a state its own kernels read from
attributes of its own tensor classes: streamed as tensors, it would fail deep inside the engine or its kernel.
:func:`check_quantized_layers` names the first such layer instead, with what to do, and refuses what the 4-bit layers do
not support yet (activations kept or offloaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any, Optional, Protocol

from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_superpipe.memory.fourbit.packed import packed_format


class ActivationKnobs(Protocol):
    """The knobs that say where the blocks' activations live (:class:`~lightning_superpipe.run.options.
    SuperpipeOptions`)."""

    @property
    def activations(self) -> Any: ...

    @property
    def memory_budget(self) -> Any: ...

    def activation_modes(self, num_blocks: int) -> Sequence[str]:
        """Each block's placement of its activations, ``"recompute"`` where none is given."""
        ...

#: Packages whose layers and tensor classes hold quantized weights, and what users call them.
QUANTIZATION_PACKAGES = {
    "bitsandbytes": "bitsandbytes",
    "auto_gptq": "GPTQ (auto-gptq)",
    "gptqmodel": "GPTQ (GPTQModel)",
    "awq": "AWQ (AutoAWQ)",
    "hqq": "HQQ",
    "optimum.quanto": "quanto",
    "torchao": "torchao",
    "compressed_tensors": "compressed-tensors",
    "eetq": "EETQ",
}

#: What to do instead, by package.
ADVICE = {
    "bitsandbytes": (
        "Of bitsandbytes' layers the strategy streams the 4-bit ones (`Linear4bit`, NF4 or FP4: load the base with"
        " `BitsAndBytesConfig(load_in_4bit=True)` for QLoRA), not 8-bit ones; or load the model without"
        " `quantization_config` (e.g. in bfloat16) and train LoRA adapters on it: the strategy keeps the frozen base"
        " in host memory, so it need not fit on the device."
    ),
}
#: What to do with a quantized bitsandbytes 4-bit weight that does not stream with a block.
OUTSIDE_BLOCKS_ADVICE = (
    "bitsandbytes 4-bit weights stream with their blocks only, and this one is outside the streamed blocks (or shared"
    " with the rest of the model). Keep it in full precision (e.g. `BitsAndBytesConfig(llm_int8_skip_modules=[...])`"
    " naming it), or make its module part of a block (`SuperpipeStrategy(blocks=...)`)."
)
#: What to do with a bitsandbytes 4-bit weight not quantized yet (no quantization state).
UNQUANTIZED_ADVICE = (
    "Its 4-bit weight is not quantized yet (bitsandbytes quantizes it when the layer is moved to a device, or when"
    " `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))` loads it): quantize the model"
    " before `Trainer.fit` (e.g. `model.to('cpu')` on the host)."
)
DEFAULT_ADVICE = (
    "Load the model without quantization (e.g. in bfloat16) and fine-tune it, or LoRA adapters on it: the strategy"
    " keeps it in host memory, so it need not fit on the device."
)


class QuantizedLayerError(ValueError, MisconfigurationException):
    """A model holds quantized layers the strategy cannot stream, or streams them in a way they do not support yet
    (the message names the first one). A ``ValueError``, and Lightning's ``MisconfigurationException`` as the
    strategy's other refusals of a run."""


def quantization_package(obj: object) -> Optional[str]:
    """The quantization package that defines ``obj``'s class (a key of :data:`QUANTIZATION_PACKAGES`), or ``None``."""
    module = type(obj).__module__
    return next((p for p in QUANTIZATION_PACKAGES if module == p or module.startswith(p + ".")), None)


def _quantized_kind(module: nn.Module) -> Optional[tuple[str, str]]:
    """(package, what) if ``module`` holds quantized weights itself: a parameter or buffer of a quantization
    package's tensor class, a module of such a package holding integer tensors, or an integer parameter."""
    tensors: list[tuple[str, Tensor]] = list(chain(module.named_parameters(recurse=False),
                                                  module.named_buffers(recurse=False)))
    for name, tensor in tensors:
        package = quantization_package(tensor)
        if package is not None:
            return package, f"its `{name}` is a {type(tensor).__name__}"
    package = quantization_package(module)
    integers = [(name, t) for name, t in tensors if not (t.is_floating_point() or t.is_complex())]
    if package is not None and integers:
        name, tensor = integers[0]
        return package, f"its `{name}` holds {tensor.dtype} values"
    for name, param in module.named_parameters(recurse=False):
        if not (param.is_floating_point() or param.is_complex()):
            return "", f"its parameter `{name}` holds {param.dtype} values"
    return None


def _streams_packed(module: nn.Module, streamed: set[nn.Parameter]) -> bool:
    """Whether every quantized tensor ``module`` holds itself is a packed weight (:mod:`~lightning_superpipe.memory.
    packed`) that streams with a block: its quantized layer streams as it is."""
    tensors = list(chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)))
    quantized = [t for _, t in tensors
                 if quantization_package(t) is not None or not (t.is_floating_point() or t.is_complex())]
    return bool(quantized) and all(isinstance(t, nn.Parameter) and t in streamed and packed_format(t) is not None
                                   for t in quantized)


def _advice(module: nn.Module, package: str) -> str:
    """What to do with a refused quantized layer: for a bitsandbytes 4-bit one, what it lacks."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.Parameter) and type(weight).__name__ == "Params4bit":
        return OUTSIDE_BLOCKS_ADVICE if packed_format(weight) is not None else UNQUANTIZED_ADVICE
    return ADVICE.get(package, DEFAULT_ADVICE)


def check_quantized_layers(
    model: nn.Module, block_params: list[list[nn.Parameter]], options: Optional[ActivationKnobs] = None
) -> None:
    """Raises if a module of ``model`` holds quantized weights the strategy cannot stream (see the module's
    docstring), or if bitsandbytes 4-bit weights stream (with ``block_params``) under knobs (``options``) they do not
    support yet.

    Raises:
        QuantizedLayerError: Naming the first such layer, its class, how many there are, and what to do.
    """
    streamed = {param for params in block_params for param in params}
    found = [(name, module, kind) for name, module in model.named_modules()
             if (kind := _quantized_kind(module)) is not None and not _streams_packed(module, streamed)]
    if found:
        name, module, (package, what) = found[0]
        label = QUANTIZATION_PACKAGES.get(package, "a quantized")
        cls = type(module)
        more = f" (and {len(found) - 1} more such layers)" if len(found) > 1 else ""
        raise QuantizedLayerError(
            f"SuperpipeStrategy cannot stream `{name or type(model).__name__}`, a {label} layer"
            f" ({cls.__module__}.{cls.__qualname__}: {what}){more}. Streamed weights travel as full-precision tensors"
            f" (float32, bfloat16 or float16), and quantized ones only as bitsandbytes 4-bit weights inside the"
            f" streamed blocks; other packed weights and quantization states need their own kernels' tensor classes."
            f" {_advice(module, package)}"
        )
    packed_blocks = [i for i, params in enumerate(block_params) if any(packed_format(p) is not None for p in params)]
    if packed_blocks and options is not None:
        _check_knobs(options, packed_blocks, len(block_params))


def _check_knobs(options: ActivationKnobs, packed_blocks: list[int], num_blocks: int) -> None:
    """Refuses the knobs 4-bit blocks do not support yet (``packed_blocks``: the blocks holding such weights)."""
    what = f"bitsandbytes 4-bit weights stream in {len(packed_blocks)} of the {num_blocks} blocks"
    if options.activations is None and options.memory_budget is not None:
        raise QuantizedLayerError(
            f"SuperpipeStrategy(memory_budget={options.memory_budget!r}): {what}, whose kernels keep their weights for"
            " backward outside autograd's saved tensors, so their blocks must recompute in backward, and the planner"
            " may choose to keep activations. Pin it: `SuperpipeStrategy(memory_budget=..., activations='recompute')`."
        )
    modes = options.activation_modes(num_blocks)
    kept = [i for i in packed_blocks if modes[i] != "recompute"]
    if kept:
        raise QuantizedLayerError(
            f"SuperpipeStrategy(activations={options.activations!r}): {what}, and block {kept[0]} would keep its"
            f" activations ({modes[kept[0]]!r}), but bitsandbytes' 4-bit kernels keep their weights for backward"
            " outside autograd's saved tensors, where the strategy cannot fetch them again. Use"
            " activations='recompute' (the default) for the blocks that hold 4-bit weights."
        )
