"""``state_dict()`` of layers whose packed weights stream (bitsandbytes' 4-bit ones): their entries on their own.

A block's home holds its floating parameters and its packed weights' tensors (bitsandbytes' 4-bit codes, absmax,
codebooks) in one flat buffer, each viewed there with its own dtype (:mod:`lightning_superpipe.memory.fourbit.packed`).
``torch.save`` refuses views of one storage with different dtypes ("Cannot save multiple tensors or storages that
view the same data as different types"), so a Lightning checkpoint of such a model would fail.
:func:`clone_packed_entries` clones the entries the layers holding packed weights put in a state dict: a transient
host copy of the 4-bit base while a checkpoint is written. Their floating neighbours stay views of the home, all of
one dtype, as in any block.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_superpipe.memory.fourbit.packed import packed_entries_are_left_out

#: The attribute that marks a module whose state-dict entries are cloned already (a second run hooks it no more).
MARK = "_superpipe_packed_state_dict_hook"


def clone_packed_entries(model: nn.Module, packed: set[nn.Parameter]) -> None:
    """Makes every state dict hold copies of the entries of the modules of ``model`` that own weights in ``packed``.

    The hooks stay after the run: the packed tensors stay views of their homes (as the floating parameters do), so
    a state dict taken then (``trainer.save_checkpoint`` after ``fit``, ``torch.save(model.state_dict())``) needs
    them as much.
    """
    for module in model.modules():
        if not hasattr(module, MARK) and any(p in packed for p in module._parameters.values() if p is not None):
            setattr(module, MARK, module.register_state_dict_post_hook(_own_entries_cloned))


def _own_entries_cloned(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Replaces the tensors ``module`` (and anything below it) put in ``state_dict`` with copies of their own. The
    parameters ``state_dict(keep_vars=True)`` asks for stay themselves; so do all of them where the caller leaves
    them out (:func:`~lightning_superpipe.memory.fourbit.packed.packed_entries_left_out`)."""
    if packed_entries_are_left_out():
        return
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
            state_dict[key] = value.clone()
