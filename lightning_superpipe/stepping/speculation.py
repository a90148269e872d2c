"""A speculative optimizer step: stepped during backward, decided after it, bitwise the step after backward.

Clipping by the global norm and the ``16-mixed`` gradient scaler's check for infinities need every gradient before
any parameter may move, so the step after backward waits for both. A block is stepped during backward anyway, with
its gradients as they are then (unscaled by the scale the loss was scaled with; clamped, if clipping is by value,
which is elementwise), after its masters and optimizer state are kept (:class:`KeptState`). After backward what the
decision needs is known (:class:`PreStepWatch`):

* clipping by norm multiplies every gradient by ``min(max_norm / (norm + 1e-6), 1)``: where that is exactly 1 the
  multiplication changes no bit and the speculative step was the step (commit: the kept copies go);
* where it is below 1 the gradients changed: the kept state comes back and the block is stepped again (redo);
* where the scaler found an infinity it skips the step: the kept state comes back (discard).

Each outcome is what plain Lightning computes, bit for bit. The kept state costs a copy of the masters and of the
optimizer state of every parameter stepped (12 bytes a parameter with fp32 AdamW), held while steps are speculative.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from lightning_superpipe.stepping.param_groups import restricted


class KeptState:
    """The masters and optimizer state of the parameters stepped speculatively, as they were before the step.

    Its buffers are reused from one step to the next (a fresh allocation per step would fault every page in again
    on the optimizer thread, which then falls behind backward); :meth:`release` lets them go.

    Args:
        optimizer: The optimizer whose ``state`` is kept.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._kept: dict[nn.Parameter, tuple[Tensor, Optional[dict[str, Any]]]] = {}
        self._spare: dict[nn.Parameter, tuple[Tensor, dict[str, Any]]] = {}
        #: The most bytes held at once (kept and spare buffers), over the run.
        self.peak_bytes = 0

    def keep(self, params: list[nn.Parameter]) -> None:
        """Copies ``params``' masters and optimizer state (none yet before their first step) aside; those kept
        already this step (:meth:`keep` ahead of their step, during forward) are left as they are."""
        fresh = [param for param in params if param not in self._kept]
        for param in fresh:
            spare_master, spare_state = self._spare.pop(param, (None, {}))
            master = _copy_into(spare_master, param.detach())
            state = self.optimizer.state.get(param)
            kept = None
            if state:
                kept = {key: _copy_into(spare_state.get(key), value) if isinstance(value, Tensor)
                        else copy.deepcopy(value) for key, value in state.items()}
            self._kept[param] = (master, kept)
        if fresh:  # a block kept ahead comes back here at its step: nothing new to count
            self.peak_bytes = max(self.peak_bytes, self.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept and spare buffers."""
        held = [*self._kept.values(), *self._spare.values()]
        return sum(_nbytes(master) + sum(_nbytes(v) for v in (state or {}).values()) for master, state in held)

    def restore(self, stepped: set[nn.Parameter]) -> None:
        """Puts the kept masters and state of the ``stepped`` parameters back (a parameter with no state before its
        step gets none again); the others' copies become spares."""
        with torch.no_grad():
            for param, (master, state) in self._kept.items():
                if param not in stepped:
                    self._spare[param] = (master, state or {})
                    continue
                param.copy_(master)  # in place: the version counter moves, so the device copies are made again
                current = self.optimizer.state.pop(param, None) or {}
                if state is not None:
                    self.optimizer.state[param] = state  # the kept tensors go back; the stepped ones become spares
                self._spare[param] = (master, {k: v for k, v in current.items() if isinstance(v, Tensor)})
        self._kept.clear()

    def clear(self) -> None:
        """The step is committed: the kept copies become spare buffers for the next step."""
        for param, (master, state) in self._kept.items():
            self._spare[param] = (master, state or {})
        self._kept.clear()

    def release(self) -> None:
        """Lets every buffer go."""
        self._kept.clear()
        self._spare.clear()


def _copy_into(buffer: Optional[Tensor], value: Tensor) -> Tensor:
    """``value`` copied into ``buffer`` where it fits (same shape, dtype and device), else into a new tensor."""
    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype or buffer.device != value.device:
        return value.clone()
    return buffer.copy_(value)


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, Tensor) else 0


class SpeculativeUnscale:
    """Unscales each block's gradients as ``GradScaler.unscale_`` would (the same operator and inverse scale, so the
    same bits), recording infinities; the scaler's own ``unscale_`` then leaves them out (:class:`PreStepWatch`).

    Args:
        scaler: The precision plugin's ``torch.amp.GradScaler``, whose scale the loss was multiplied by.
    """

    def __init__(self, scaler: Any) -> None:
        scale = scaler._scale
        self.inv_scale = scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        self.found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        self.unscaled: set[nn.Parameter] = set()

    def __call__(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.inv_scale)
        self.unscaled.update(params)


def gradient_preparation(
    unscale: Optional[SpeculativeUnscale], clip_value: Optional[float]
) -> Optional[Callable[[list[nn.Parameter]], None]]:
    """What a block's gradients go through before its step in backward: unscaling, then clamping by value (in that
    order, as Lightning unscales before it clips); ``None`` if neither."""
    if unscale is None and clip_value is None:
        return None

    def prepare(params: list[nn.Parameter]) -> None:
        if unscale is not None:
            unscale(params)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)

    return prepare


def tensor_norms(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's 2-norm, by the operator ``torch.nn.utils.get_total_norm`` uses for it (per device and dtype:
    ``torch._foreach_norm`` where supported, else ``torch.linalg.vector_norm``), in ``tensors``' order."""
    norms: list[Optional[Tensor]] = [None] * len(tensors)
    for (device, _), ([group], indices) in _group_tensors_by_device_and_dtype([tensors], with_indices=True).items():
        found = (torch._foreach_norm(group, 2.0) if _has_foreach_support(group, device)
                 else [torch.linalg.vector_norm(t, 2.0) for t in group])
        for index, norm in zip(indices, found):
            norms[index] = norm
    return norms  # type: ignore[return-value]


def total_norm(grads: list[Tensor], norms: list[Tensor]) -> Tensor:
    """The global 2-norm of ``grads`` from their norms, as ``torch.nn.utils.get_total_norm`` stacks them (grouped
    by device and dtype, in the order its grouping gives)."""
    groups = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    ordered = [norms[i] for _, (_, indices) in groups.items() for i in indices]
    first = grads[0].device
    return torch.linalg.vector_norm(torch.stack([norm.to(first) for norm in ordered]), 2.0)


def scale_gradients(params: list[nn.Parameter], factor: Tensor) -> None:
    """Multiplies ``params``' gradients by ``factor`` as ``torch.nn.utils.clip_grads_with_norm_`` does (per device
    and dtype, ``torch._foreach_mul_`` where supported): elementwise, so a block at a time is bitwise all at once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
        if _has_foreach_support(group, device):
            torch._foreach_mul_(group, factor.to(device))
        else:
            for grad in group:
                grad.mul_(factor.to(device))


class BackwardNorms:
    """The 2-norms of gradients taken during backward on the optimizer thread, as each block's are final (after
    unscaling), so that clipping by norm after backward only stacks them."""

    def __init__(self) -> None:
        self._norms: dict[nn.Parameter, tuple[Tensor, Tensor]] = {}  # param -> (the gradient it was, its norm)

    def take(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        present = [p for p in params if p.grad is not None]
        for param, grad, norm in zip(present, grads, tensor_norms(grads) if grads else []):
            self._norms[param] = (grad, norm)

    def norm_of(self, param: nn.Parameter) -> Optional[Tensor]:
        """``param``'s gradient norm, if taken of the gradient it holds now."""
        taken = self._norms.get(param)
        return taken[1] if taken is not None and taken[0] is param.grad else None

    def clear(self) -> None:
        self._norms.clear()


class PreStepWatch:
    """Watches the work Lightning does between backward and the step, for the decisions it feeds.

    * Clipping by norm (the precision plugin's ``clip_grad_by_norm``): the global norm and the coefficient as
      ``torch.nn.utils.clip_grad_norm_`` computes them; where the coefficient is exactly 1 the multiplication, which
      would change no bit, is skipped and :attr:`changed_gradients` stays ``False``.
    * Clipping by value (``clip_grad_by_value``) of what is left when every block was clamped in backward.
    * The scaler's ``unscale_``: gradients that a speculative step unscaled already are left out, and the
      infinities found in them are added to the scaler's.

    Args:
        plugin: The run's precision plugin.
    """

    #: How many recent steps :attr:`changed_rate` looks at.
    HISTORY = 8

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.scaler = getattr(plugin, "scaler", None)
        self.changed_gradients = False
        #: Gradient norms taken during backward (:class:`BackwardNorms`).
        self.norms = BackwardNorms()
        self.defer_scaling = False
        #: Clipping's factor, where this step leaves the multiplication to the blocks' steps (``None``: done, or 1).
        self.deferred_scale: Optional[Tensor] = None
        #: Set by the speculative step for this backward, read by the scaler's ``unscale_``.
        self.unscale: Optional[SpeculativeUnscale] = None
        self._history: deque[bool] = deque(maxlen=self.HISTORY)
        self._installed: list[tuple[Any, str]] = []

    @property
    def changed_rate(self) -> float:
        """The share of the recent steps whose gradients changed after backward (clipped) or that were skipped."""
        return sum(self._history) / len(self._history) if self._history else 0.0

    def record(self, changed: bool) -> None:
        """Records one step's outcome: its gradients changed after backward, or the scaler skipped it."""
        self._history.append(changed)

    def start_step(self, defer_scaling: bool = False) -> None:
        """A step starts; with ``defer_scaling`` (a pipelined step) clipping's multiplication is left to each block's
        step (:attr:`deferred_scale`)."""
        self.changed_gradients = False
        self.norms.clear()
        self.defer_scaling, self.deferred_scale = defer_scaling, None

    def install(self) -> None:
        """Takes the plugin's ``clip_grad_by_norm`` and ``clip_grad_by_value`` (where they are Lightning's: a plugin's
        own clipping runs as it is, and makes the step pipelined, :mod:`.step_modes`) and the scaler's ``unscale_``
        (instance attributes)."""
        from lightning.pytorch.plugins.precision import Precision

        if self._installed:
            return
        for name, own in (("clip_grad_by_norm", self._clip_grad_by_norm),
                          ("clip_grad_by_value", self._clip_grad_by_value)):
            if getattr(type(self.plugin), name, None) is getattr(Precision, name):
                vars(self.plugin)[name] = own
                self._installed.append((self.plugin, name))
        if self.scaler is not None:
            self._unscale = self.scaler.unscale_
            vars(self.scaler)["unscale_"] = self._unscale_
            self._installed.append((self.scaler, "unscale_"))

    @property
    def installed(self) -> bool:
        """Whether the plugin's clipping runs through the watch (not where the homes or sharding clip)."""
        return any(name == "clip_grad_by_norm" for _, name in self._installed)

    def uninstall(self) -> None:
        for owner, name in self._installed:
            vars(owner).pop(name, None)
        self._installed = []

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = list(self.plugin.main_params(optimizer))
        present = [p for p in params if p.grad is not None]
        if not present:
            return
        grads = [p.grad for p in present]
        norms = [self.norms.norm_of(p) for p in present]  # those taken in backward; the rest now
        missing = [i for i, norm in enumerate(norms) if norm is None]
        for i, norm in zip(missing, tensor_norms([grads[i] for i in missing]) if missing else []):
            norms[i] = norm
        total = total_norm(grads, norms)  # type: ignore[arg-type]
        coefficient = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        if bool(coefficient == 1.0):
            return  # multiplying by exactly 1 changes no bit
        self.changed_gradients = True
        if self.defer_scaling:  # a pipelined step multiplies each block's gradients on its thread, before its step
            self.deferred_scale = coefficient
            return
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)

    def _clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clamp, of what the step after backward has left: nothing where every parameter was stepped
        (and clamped) during backward, and torch's ``clip_grad_value_`` refuses an empty list."""
        params = [p for p in self.plugin.main_params(optimizer) if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)

    def _unscale_(self, optimizer: Optimizer) -> None:
        unscale = self.unscale
        if unscale is None:
            self._unscale(optimizer)
            return
        rest = {p for group in optimizer.param_groups for p in group["params"] if p not in unscale.unscaled}
        with restricted(optimizer, rest):
            self._unscale(optimizer)
        per_device = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        device = unscale.found_inf.device
        per_device[device] = per_device[device] + unscale.found_inf if device in per_device else unscale.found_inf
        if bool(unscale.found_inf):
            self.changed_gradients = True
