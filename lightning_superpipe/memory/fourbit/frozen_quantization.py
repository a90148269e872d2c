"""``SuperpipeStrategy(quantize_frozen=...)`` for one run: the streamed blocks' frozen matrices quantized to 4 bits as
streaming starts (:mod:`lightning_superpipe.memory.fourbit.frozen4bit`), after what they do not support is refused,
and given their values back as the run ends.

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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_superpipe.memory.fourbit.frozen4bit import frozen_matrices, quantize, quantized_format, restore
from lightning_superpipe.memory.fourbit.packed import PACKED_ATTR, packed_entries_are_left_out, packed_format
from lightning_superpipe.memory.fourbit.quantized_layers import QuantizedLayerError


class FrozenKnobs(Protocol):
    """The knobs ``quantize_frozen`` is checked against (:class:`~lightning_superpipe.run.options.
    SuperpipeOptions`)."""

    @property
    def quantize_frozen(self) -> Optional[str]: ...

    @property
    def activations(self) -> Any: ...

    @property
    def memory_budget(self) -> Any: ...


class DeferredValues(Protocol):
    """The init calls ``configure_model`` recorded (a :class:`~lightning_superpipe.construction.deferred_init.
    DeferredInit`), as quantizing a matrix from values made apart from it needs them."""

    def determines(self, tensor: Tensor) -> bool: ...

    def initial_values(self, block: Mapping[str, Tensor]) -> dict[str, Tensor]: ...

    def materialize(self, tensors: Iterable[Tensor]) -> None: ...


def check_quantize_frozen(options: FrozenKnobs, model: nn.Module, block_params: list[list[nn.Parameter]]) -> None:
    """Refuses, before anything is allocated, what ``quantize_frozen`` does not support: a model already in 4 bits,
    and a budget planned without pinning the activations. (Blocks that keep or offload their activations save their
    dense dequantized matrices as handles, dequantized again in backward: :mod:`.activations`.)

    Raises:
        QuantizedLayerError: With the user's call and what to do.
    """
    mode = options.quantize_frozen
    if mode is None:
        return
    call = f"SuperpipeStrategy(quantize_frozen={mode!r})"
    packed = next((name for name, param in model.named_parameters()
                   if packed_format(param) is not None and quantized_format(param) is None), None)
    if packed is not None:
        raise QuantizedLayerError(
            f"{call}: the model holds bitsandbytes 4-bit weights already (`{packed}`): its frozen base is 4-bit, and"
            " the strategy streams it in that form. quantize_frozen is for a model in full precision: leave it out."
        )
    if options.activations is None and options.memory_budget is not None:
        raise QuantizedLayerError(
            f"SuperpipeStrategy(quantize_frozen={mode!r}, memory_budget={options.memory_budget!r}): the planner does"
            " not count yet the frozen matrices a block that keeps its activations dequantizes again in backward."
            " Pin the activations: `activations='recompute'` (or 'keep', 'offload')."
        )


class FrozenQuantization:
    """The frozen matrices of one run in 4 bits; a hook of the run whose :meth:`detach` gives them their values back.

    With a ``deferred`` init (a model built in ``configure_model``, its weights read by
    :func:`~lightning_superpipe.load_safetensors`), each matrix is quantized from values made apart from it, one at a
    time (:meth:`.DeferredInit.initial_values`), so host memory never holds the full-precision base; such a matrix
    stays in 4 bits when the run ends (:attr:`.Frozen4bit.kept`), and a later run streams it as it is.

    Args:
        model: The model (its modules get the state-dict hooks).
        block_params: The parameters that stream with each block: their frozen matrices are quantized.
        mode: ``quantize_frozen``'s value.
        transfer_dtype: The dtype the blocks' weights compute in on the device (``None``: each one's own).
        deferred: The init calls ``configure_model`` recorded, if any.
        written: Called with each block's index and parameters once its matrices are quantized (the disk tier writes
            them to its files then, so that host memory holds one block's 4-bit matrices at a time).
    """

    def __init__(self, model: nn.Module, block_params: Sequence[Sequence[nn.Parameter]], mode: str,
                 transfer_dtype: Optional[torch.dtype], deferred: Optional[DeferredValues] = None,
                 written: Optional[Callable[[int, Sequence[nn.Parameter]], None]] = None) -> None:
        self.params: list[nn.Parameter] = []
        self._handles: list[RemovableHandle] = []
        self._kept_before: set[nn.Parameter] = set()  # kept in 4 bits by an earlier run, which hooked them
        #: What the matrices quantized from a deferred init held before: given back if the run does not start, for
        #: the init calls (still pending) to fill, as they would have without the strategy.
        self._originals: dict[nn.Parameter, Tensor] = {}
        names = {param: name for name, param in model.named_parameters()}
        try:
            for index, params in enumerate(block_params):
                for param in frozen_matrices(params):
                    self._quantize(names.get(param, ""), param, mode, transfer_dtype or param.dtype, deferred)
                if written is not None:
                    written(index, params)
        except BaseException:
            self.detach()  # the model as it was
            raise
        quantized = {param for param in self.params if param not in self._kept_before}
        for module in model.modules():
            names = [name for name, param in module._parameters.items() if param is not None and param in quantized]
            if names:
                self._handles += [
                    module.register_state_dict_post_hook(partial(_dequantized_entries, names)),
                    module.register_load_state_dict_pre_hook(partial(_refuse_loading, names)),
                ]

    def _quantize(self, name: str, param: nn.Parameter, mode: str, compute_dtype: torch.dtype,
                  deferred: Optional[DeferredValues]) -> None:
        kept = quantized_format(param)
        if kept is not None:  # kept in 4 bits by an earlier run (and hooked by it)
            if kept.mode != mode:
                raise QuantizedLayerError(
                    f"SuperpipeStrategy(quantize_frozen={mode!r}): the model's frozen matrices stayed in 4 bits"
                    f" ({kept.mode!r}) after an earlier run, which built them from a deferred init: use"
                    f" quantize_frozen={kept.mode!r}, or build the model again."
                )
            self._kept_before.add(param)
            self.params.append(param)
            return
        values = None
        if deferred is not None and deferred.determines(param):
            original = param.data
            values = deferred.initial_values({name: param})[name]
        elif deferred is not None:  # pending calls that write part of it, or a tensor shared: they run in place
            deferred.materialize([param])
        format = quantize(param, mode, compute_dtype, values)
        self.params.append(param)
        if values is not None:
            format.kept = True
            self._originals[param] = original

    def attach(self) -> None:
        """Nothing: the matrices were quantized when this was made."""

    def started(self) -> None:
        """The run started: what the matrices held before is not needed any more."""
        self._originals.clear()

    def detach(self) -> None:
        """Writes the dequantized values back into the parameters (their own dtype; those :attr:`.Frozen4bit.kept`
        stay in 4 bits, with their state-dict hooks) and removes the state-dict hooks; twice is harmless. Before the
        run started, matrices quantized from a deferred init get their own storage back instead, uninitialized, for
        the init calls to fill."""
        for param, original in self._originals.items():
            delattr(param, PACKED_ATTR)
            param.data = original
        self.params = [param for param in self.params if param not in self._originals]
        self._originals.clear()
        kept = {param for param in self.params if (format := quantized_format(param)) is not None and format.kept}
        if not kept:  # (a hook of a matrix given back does nothing: those of a module with a kept one may stay)
            for handle in self._handles:
                handle.remove()
        self._handles = []
        for param in self.params:
            if param not in kept:
                restore(param)


def quantize_frozen(model: nn.Module, block_params: Sequence[Sequence[nn.Parameter]], mode: Optional[str],
                    transfer_dtype: Optional[torch.dtype], deferred: Optional[DeferredValues] = None,
                    written: Optional[Callable[[int, Sequence[nn.Parameter]], None]] = None,
                    ) -> Optional[FrozenQuantization]:
    """The run's :class:`FrozenQuantization`, or ``None`` when ``mode`` (``quantize_frozen``) is ``None``."""
    return None if mode is None else FrozenQuantization(model, block_params, mode, transfer_dtype, deferred, written)


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
    their placeholders (``state_dict(keep_vars=True)`` asks for the parameters themselves: they stay; so do all of
    them where the caller leaves them out,
    :func:`~lightning_superpipe.memory.fourbit.packed.packed_entries_left_out`)."""
    if packed_entries_are_left_out():
        return
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
