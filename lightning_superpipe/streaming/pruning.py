"""Parameters pruned by ``torch.nn.utils.prune`` (and so by Lightning's ``ModelPruning``) while they stream.

Pruning a parameter ``weight`` keeps the same ``nn.Parameter`` under the name ``weight_orig``, adds a buffer
``weight_mask`` (made beside the parameter, in host memory) and a forward pre-hook that sets the plain attribute
``weight = weight_orig * weight_mask`` before each call. ``prune.remove`` undoes the names and writes the product into
the parameter's ``.data``, which the host homes copy back into their buffers like any ``p.data = x``.

The streaming hooks bind device copies to the parameters' names for the length of a call. For a pruned module this
means three things, which :class:`PrunedWeights` does:

* the names move: the hooks bind the same parameters again under their new names;
* the masks stay in host memory, beside the host parameters, where ``ModelPruning`` and ``prune.remove`` multiply
  them outside any call; a device copy of each (made once per mask) is bound in their place during a call;
* the pre-hook must compute the product from the device copies. A module's own pre-hooks run before the streaming
  hook binds it, so they run once more inside the binding. Afterwards no device product outlives the call: each
  product attribute is made again from the host parameter, as plain training leaves it (one multiplication in host
  memory per pruned parameter and call).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils import prune

# (the pruned module, its pre-hook's key, the pre-hook)
_Pruned = tuple[nn.Module, int, prune.BasePruningMethod]


class PrunedWeights:
    """The pruned parameters of ``module`` (and of the modules under it with ``recurse``), their masks copied to
    ``device``.

    Args:
        module: A streamed block, or a module that owns parameters outside the blocks.
        recurse: Include the modules under ``module``.
        device: The compute device.
    """

    def __init__(self, module: nn.Module, recurse: bool, device: torch.device) -> None:
        self.module = module
        self.recurse = recurse
        self.device = device
        self._pruned: list[_Pruned] = []
        self._masks: list[tuple[nn.Module, str, Tensor, Tensor]] = []  # (owner, name, host mask, device copy)
        self.refresh()

    def refresh(self) -> None:
        """Reads the pruning hooks again, and copies their masks to the device."""
        modules = list(self.module.modules()) if self.recurse else [self.module]
        self._pruned = [
            (owner, key, hook)
            for owner in modules
            for key, hook in owner._forward_pre_hooks.items()
            if isinstance(hook, prune.BasePruningMethod)
        ]
        self._masks = []
        for owner, _, hook in self._pruned:
            name = hook._tensor_name + "_mask"
            mask = owner._buffers[name]
            self._masks.append((owner, name, mask, mask.to(self.device)))

    def stale(self) -> bool:
        """Whether a pruning seen has changed: pruning a parameter again replaces its hook (by a container of both)
        and its mask, and ``prune.remove`` takes both away."""
        return any(owner._forward_pre_hooks.get(key) is not hook for owner, key, hook in self._pruned) or any(
            owner._buffers.get(name) is not mask for owner, name, mask, _ in self._masks
        )

    def apply(self, args: Any) -> list[tuple[nn.Module, str, Optional[Tensor]]]:
        """Just after the device copies of the parameters are bound: the masks' device copies bound too, and the
        module's own pruning hooks run again on them. Returns what to put back with :meth:`restore`."""
        if not self._pruned:
            return []
        saved = [(owner, hook._tensor_name, owner.__dict__.get(hook._tensor_name)) for owner, _, hook in self._pruned]
        for owner, name, _, on_device in self._masks:
            owner._buffers[name] = on_device
        for owner, _, hook in self._pruned:
            if owner is self.module:  # the hooks of modules under it run in its forward, inside the binding
                hook(owner, args)
        return saved

    def restore(self, saved: list[tuple[nn.Module, str, Optional[Tensor]]], current: bool) -> None:
        """After the call, once the host parameters are bound again: the host masks back, and each product attribute
        either made again from the host parameter (``current``: after a call's first run, so that it holds what a
        plain forward's pre-hook left, which pruning it again reads as its importance) or as it was before the call
        (after a recomputation, or the planner's census)."""
        for owner, name, mask, _ in self._masks:
            owner._buffers[name] = mask
        if current:
            with torch.no_grad():
                for owner, _, hook in self._pruned:
                    owner.__dict__[hook._tensor_name] = hook.apply_mask(owner)
            return
        for owner, name, value in saved:
            if value is None:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = value
