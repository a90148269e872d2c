"""Quantized layers the strategy cannot stream, found before anything is allocated.

Streamed weights travel as full-precision tensors (float32, bfloat16 or float16), one flat buffer per block, and the
hooks bind plain device tensors into the modules. A quantized layer holds packed integers and a quantization state
(scales, zero points, codebooks) that its own kernels read from attributes of its own tensor classes: streamed as
tensors, it would fail deep inside the engine or its kernel. :func:`check_no_quantized_layers` names the first such
layer instead, with what to do.
"""

from __future__ import annotations

from itertools import chain
from typing import Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

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
        "To fine-tune a 4-bit (QLoRA) or 8-bit base, load it without `quantization_config` (e.g. in bfloat16) and"
        " train LoRA adapters on it: the strategy keeps the frozen base in host memory, so it need not fit on the"
        " device."
    ),
}
DEFAULT_ADVICE = (
    "Load the model without quantization (e.g. in bfloat16) and fine-tune it, or LoRA adapters on it: the strategy"
    " keeps it in host memory, so it need not fit on the device."
)


class QuantizedLayerError(ValueError, MisconfigurationException):
    """A model holds quantized layers the strategy cannot stream (the message names the first one). A
    ``ValueError``, and Lightning's ``MisconfigurationException`` as the strategy's other refusals of a run."""


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


def check_no_quantized_layers(model: nn.Module) -> None:
    """Raises if any module of ``model`` holds quantized weights (see the module's docstring).

    Raises:
        QuantizedLayerError: Naming the first such layer, its class, how many there are, and what to do.
    """
    found = [(name, module, kind) for name, module in model.named_modules()
             if (kind := _quantized_kind(module)) is not None]
    if not found:
        return
    name, module, (package, what) = found[0]
    label = QUANTIZATION_PACKAGES.get(package, "a quantized")
    cls = type(module)
    more = f" (and {len(found) - 1} more such layers)" if len(found) > 1 else ""
    raise QuantizedLayerError(
        f"SuperpipeStrategy cannot stream `{name or type(model).__name__}`, a {label} layer"
        f" ({cls.__module__}.{cls.__qualname__}: {what}){more}. Streamed weights travel as full-precision tensors"
        f" (float32, bfloat16 or float16); a quantized layer's packed weights and quantization state need its own"
        f" kernels' tensor classes. {ADVICE.get(package, DEFAULT_ADVICE)}"
    )
