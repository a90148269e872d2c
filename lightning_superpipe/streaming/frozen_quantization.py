"""``SuperpipeStrategy(quantize_frozen=...)`` for one run: the streamed blocks' frozen matrices quantized to 4 bits as
streaming starts (:mod:`lightning_superpipe.memory.frozen4bit`), after what they do not support is refused, and given
their values back as the run ends.

In between, each such parameter holds a placeholder and its values are 4-bit bytes in its block's home. So that
``state_dict()`` (a Lightning checkpoint, ``torch.save``, peft's adapter export) still holds the model's values, a
state-dict hook of each module owning one puts its dequantized values there, in the parameter's dtype: a checkpoint
holds what plain Lightning's holds of the same model with its frozen matrices rounded to 4 bits, and resuming from it
quantizes those values again. ``load_state_dict`` into one of them during the run is refused: the strategy streams the
4-bit values it quantized (load before ``fit``, as Lightning's resume does).

After the run every parameter holds its dequantized values again, in its own dtype, in memory of its own: the model
computes outside the strategy what it computed inside (``generate``, merging the adapters, saving it), and host memory
holds a full-precision base again, as before the run. A later run (``validate`` after ``fit``, a resumed ``fit``)
quantizes those values again, into the same values for ``"nf4"`` and ``"fp4"`` (measured: dequantized 4-bit values
quantize to themselves); with ``"-dq"`` the scales' own 8-bit rounding may move some by a step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_superpipe.memory.frozen4bit import quantize, quantized_format, restore
from lightning_superpipe.memory.packed import packed_format
from lightning_superpipe.streaming.activations import per_block_modes
from lightning_superpipe.streaming.options import SuperpipeOptions
from lightning_superpipe.streaming.quantized_layers import QuantizedLayerError


def frozen_matrices(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """What ``quantize_frozen`` quantizes of a block's ``params``: the frozen floating-point ones of two or more
    dimensions (biases, norms and anything trainable stay as they are)."""
    return [p for p in params
            if not p.requires_grad and p.is_floating_point() and p.dim() >= 2 and packed_format(p) is None]


def check_quantize_frozen(options: SuperpipeOptions, model: nn.Module, block_params: list[list[nn.Parameter]]) -> None:
    """Refuses, before anything is allocated, what ``quantize_frozen`` does not support: a model already in 4 bits,
    and activations other than recomputed for the blocks it quantizes (pinned when a budget is planned).

    Raises:
        QuantizedLayerError: With the user's call and what to do.
    """
    mode = options.quantize_frozen
    if mode is None:
        return
    call = f"SuperpipeStrategy(quantize_frozen={mode!r})"
    packed = next((name for name, param in model.named_parameters() if packed_format(param) is not None), None)
    if packed is not None:
        raise QuantizedLayerError(
            f"{call}: the model holds bitsandbytes 4-bit weights already (`{packed}`): its frozen base is 4-bit, and"
            " the strategy streams it in that form. quantize_frozen is for a model in full precision: leave it out."
        )
    why = ("a block computes with its frozen matrices dequantized into tensors of their own, which the strategy cannot"
           " fetch again in backward as it fetches the views of a block's streamed bytes: kept, they would stay on"
           " the device until backward")
    if options.activations is None and options.memory_budget is not None:
        raise QuantizedLayerError(
            f"SuperpipeStrategy(quantize_frozen={mode!r}, memory_budget={options.memory_budget!r}): {why}, so their"
            " blocks must recompute in backward, and the planner may choose to keep activations. Pin it:"
            " `activations='recompute'`."
        )
    modes = per_block_modes(options.activations or "recompute", len(block_params))
    kept = [i for i, params in enumerate(block_params) if modes[i] != "recompute" and frozen_matrices(params)]
    if kept:
        raise QuantizedLayerError(
            f"SuperpipeStrategy(quantize_frozen={mode!r}, activations={options.activations!r}): block {kept[0]} would"
            f" keep its activations ({modes[kept[0]]!r}), but {why}. Use activations='recompute' (the default) for"
            " the blocks with frozen matrices."
        )


class FrozenQuantization:
    """The frozen matrices of one run in 4 bits; a hook of the run whose :meth:`detach` gives them their values back.

    Args:
        model: The model (its modules get the state-dict hooks).
        block_params: The parameters that stream with each block: their frozen matrices are quantized.
        mode: ``quantize_frozen``'s value.
        transfer_dtype: The dtype the blocks' weights compute in on the device (``None``: each one's own).
    """

    def __init__(self, model: nn.Module, block_params: Sequence[Sequence[nn.Parameter]], mode: str,
                 transfer_dtype: Optional[torch.dtype]) -> None:
        self.params: list[nn.Parameter] = []
        self._handles: list[RemovableHandle] = []
        try:
            for params in block_params:
                for param in frozen_matrices(params):
                    quantize(param, mode, transfer_dtype or param.dtype)
                    self.params.append(param)
        except BaseException:
            self.detach()  # the model as it was
            raise
        quantized = set(self.params)
        for module in model.modules():
            names = [name for name, param in module._parameters.items() if param is not None and param in quantized]
            if names:
                self._handles += [
                    module.register_state_dict_post_hook(partial(_dequantized_entries, names)),
                    module.register_load_state_dict_pre_hook(partial(_refuse_loading, names)),
                ]

    def attach(self) -> None:
        """Nothing: the matrices were quantized when this was made."""

    def detach(self) -> None:
        """Writes the dequantized values back into the parameters (their own dtype) and removes the state-dict hooks;
        twice is harmless."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param in self.params:
            restore(param)


def quantize_frozen(model: nn.Module, block_params: Sequence[Sequence[nn.Parameter]], mode: Optional[str],
                    transfer_dtype: Optional[torch.dtype]) -> Optional[FrozenQuantization]:
    """The run's :class:`FrozenQuantization`, or ``None`` when ``mode`` (``quantize_frozen``) is ``None``."""
    return None if mode is None else FrozenQuantization(model, block_params, mode, transfer_dtype)


@contextmanager
def given_back_on_error(frozen: Optional[FrozenQuantization]) -> Iterator[None]:
    """Gives the quantized matrices their values back if what runs inside fails (the run does not start)."""
    try:
        yield
    except BaseException:
        if frozen is not None:
            frozen.detach()
        raise


def _dequantized_entries(names: list[str], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """Puts the dequantized values of ``module``'s quantized parameters ``names`` into ``state_dict`` in place of
    their placeholders (``state_dict(keep_vars=True)`` asks for the parameters themselves: they stay)."""
    for name in names:
        param, key = module._parameters.get(name), prefix + name
        format = quantized_format(param) if param is not None else None
        if format is not None and key in state_dict and not isinstance(state_dict[key], nn.Parameter):
            state_dict[key] = format.dequantized()


def _refuse_loading(names: list[str], module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Refuses to load values into a quantized parameter during the run (its 4-bit bytes stream, not its storage)."""
    for name in names:
        param = module._parameters.get(name)
        if prefix + name in state_dict and param is not None and quantized_format(param) is not None:
            raise RuntimeError(
                f"`load_state_dict` was given `{prefix + name}`, a frozen matrix SuperpipeStrategy(quantize_frozen=...)"
                " keeps in 4 bits for this run. Load the frozen weights before `Trainer.fit` (as Lightning's"
                " `ckpt_path` does), or leave their keys out (`strict=False`) to load the trainable ones."
            )
