"""The host optimizer step, block by block, while backward is still running.

Offloaded training usually leaves the device idle while the host steps the optimizer after backward. A block's
gradients are complete as soon as its backward has delivered them (the last block first), so its parameters can be
stepped then, on a host thread, while backward goes on with the blocks before it. :class:`OverlappedStep` does that
with the user's own optimizer, stepping it over one block's parameters at a time (its ``param_groups`` restricted
to them, so hyperparameters, state, schedules and checkpoints are those of the optimizer as configured), and
afterwards lets the optimizer's own step update only what is left (blocks not stepped, and the parameters outside
the blocks whose gradients complete only at the end, such as the input embedding). An untied head and the final
norm are complete as backward starts: they are stepped then, on the same thread. Each block's
transfer copy is brought up to date on the same thread right after its step, so that after backward only the copies
to the device remain.

It is exact only where nothing needs all gradients before any parameter moves, so :func:`overlap_refusal` says why
not for: manual optimization, clipping (the global norm), gradient scaling, hooks between backward and the step,
optimizer step hooks, and optimizers that are not known to update each parameter on its own (LBFGS re-evaluates
its closure). The step is armed only for the micro-batch whose backward runs inside ``optimizer.step(closure)``,
the last of an accumulation.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_superpipe.memory.param_groups import restrict, restricted, unrestrict

#: Optimizers whose update of a parameter depends on that parameter's gradient and state alone.
PER_PARAMETER_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adadelta", "Adafactor", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam",
                 "RMSprop", "Rprop")
    if hasattr(torch.optim, name)  # Adafactor came with torch 2.5
)


#: Where ``transformers`` keeps its optimizer that updates each parameter alone (``Adafactor``, which fine-tuning
#: recipes use for its factored second moments).
TRANSFORMERS_PER_PARAMETER = ("transformers.optimization", "Adafactor")


#: Optimizer classes the user declared per-parameter (:func:`register_per_parameter_optimizer`).
REGISTERED_PER_PARAMETER: list[type[Optimizer]] = []


def register_per_parameter_optimizer(optimizer_class: type[Optimizer]) -> type[Optimizer]:
    """Declares that ``optimizer_class`` updates each parameter from that parameter's gradient and state alone (as
    Lion, or an 8-bit Adam, do), so that the overlapped step and the disk tier may step it block by block, as they
    step the optimizers of :data:`PER_PARAMETER_OPTIMIZERS`; its subclasses that override only ``__init__`` too.
    The caller vouches for it: an optimizer whose update mixes parameters (a global norm, a shared trust ratio)
    would train differently. Returns the class, so that it also serves as a class decorator.

    Raises:
        TypeError: ``optimizer_class`` is not a subclass of ``torch.optim.Optimizer``, or it is ``LBFGS`` (its step
            re-evaluates the closure over every parameter).
    """
    call = f"register_per_parameter_optimizer({getattr(optimizer_class, '__name__', optimizer_class)!r})"
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(f"{call}: expected a subclass of torch.optim.Optimizer.")
    if issubclass(optimizer_class, torch.optim.LBFGS):
        raise TypeError(f"{call}: LBFGS re-evaluates its closure over every parameter in one step.")
    if optimizer_class not in REGISTERED_PER_PARAMETER:
        REGISTERED_PER_PARAMETER.append(optimizer_class)
    return optimizer_class


def per_parameter_optimizers() -> tuple[type[Optimizer], ...]:
    """:data:`PER_PARAMETER_OPTIMIZERS`, :data:`TRANSFORMERS_PER_PARAMETER` where its module is imported already (an
    optimizer of it in use imported it: a check never imports ``transformers``), and the classes registered with
    :func:`register_per_parameter_optimizer`."""
    module, name = TRANSFORMERS_PER_PARAMETER
    found = getattr(sys.modules.get(module), name, None)
    return PER_PARAMETER_OPTIMIZERS + ((found,) if isinstance(found, type) else ()) + tuple(REGISTERED_PER_PARAMETER)


def per_parameter_optimizer_names() -> str:
    """Those optimizers' names, as error messages list them."""
    torch_names = [cls.__name__ for cls in PER_PARAMETER_OPTIMIZERS]
    registered = [cls.__name__ for cls in REGISTERED_PER_PARAMETER]
    return ", ".join([*torch_names, ".".join(TRANSFORMERS_PER_PARAMETER), *registered])


#: What an error says to do about an optimizer it does not know.
REGISTER_HINT = (
    "if it updates each parameter from that parameter's gradient and state alone, declare it with"
    " lightning_superpipe.register_per_parameter_optimizer({name})"
)


#: What a subclass of a per-parameter optimizer may define and still update as its base does (its defaults).
_NEUTRAL_ATTRIBUTES = {"__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                       "__annotations__", "__firstlineno__", "__static_attributes__"}


def updates_each_parameter_alone(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s update of a parameter depends on that parameter's gradient and state alone: an
    instance of one of :func:`per_parameter_optimizers`, or of a subclass that overrides nothing of it but
    ``__init__`` (e.g. a user's class with other defaults). Stepping it block by block is then exact."""
    mro = type(optimizer).__mro__
    known_classes = per_parameter_optimizers()
    known = next((i for i, klass in enumerate(mro) if klass in known_classes), None)
    if known is None:
        return False
    base = mro[known]

    def overrides(name: str, value: Any) -> bool:
        # torch wraps an optimizer class's inherited ``step`` for its profiler on the first instance (the class
        # then holds a wrapper of the same function): not an override.
        return hasattr(base, name) and inspect.unwrap(value) is not inspect.unwrap(getattr(base, name))

    return not any(overrides(name, value) for klass in mro[:known] for name, value in vars(klass).items()
                   if name not in _NEUTRAL_ATTRIBUTES)


def overlap_refusal(trainer: Any, optimizer: Optimizer, only_where_it_pays: bool = True) -> Optional[str]:
    """Why stepping block by block during backward would not give the step after backward's result (or, with
    ``only_where_it_pays``, would only compete with compute), or ``None``."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = trainer.lightning_module
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if only_where_it_pays and trainer.strategy.root_device.type == "cpu" and torch.get_num_threads() >= cores:
        return (
            f"the compute device is the CPU and torch's {torch.get_num_threads()} threads use every core, so a host"
            " step during backward would compete with it (`overlap_optimizer=True` overlaps anyway)"
        )
    if not module.automatic_optimization:
        return "manual optimization steps after its backward"
    if not updates_each_parameter_alone(optimizer):
        name = type(optimizer).__name__
        return f"{name} is not known to update each parameter on its own ({REGISTER_HINT.format(name=name)})"
    if trainer.gradient_clip_val or is_overridden("configure_gradient_clipping", module, LightningModule):
        return "gradient clipping needs every gradient before any parameter moves"
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return "the gradient scaler checks every gradient for infinities before the step"
    for hook in ("on_after_backward", "on_before_optimizer_step"):
        users = [module] if is_overridden(hook, module, LightningModule) else []
        users += [c for c in trainer.callbacks if is_overridden(hook, c, Callback)]
        if users:
            return f"`{hook}` is overridden by {type(users[0]).__name__} and may read every gradient"
    if has_step_hooks(optimizer):
        return "the optimizer has step hooks, which would run once per block"
    return None


def has_step_hooks(optimizer: Optimizer) -> bool:
    """Whether a step of ``optimizer`` runs hooks: its own, or those of every optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and ``..._post_hook``). A step block by block would
    run them once per block."""
    from torch.optim import optimizer as optimizers

    every = (getattr(optimizers, f"_global_optimizer_{when}_hooks", None) for when in ("pre", "post"))
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or any(every))


class OverlappedStep:
    """Steps the armed optimizer over each block's parameters as soon as the block's gradients are complete.

    Args:
        block_params: Each block's streamed parameters.
    """

    def __init__(self, block_params: Sequence[Sequence[nn.Parameter]]) -> None:
        self.block_params = block_params
        self._optimizer: Optional[Optimizer] = None
        self._owned: set[nn.Parameter] = set()
        self._stepped: set[nn.Parameter] = set()
        self._futures: list[Future[None]] = []
        self._groups: Optional[list[list[nn.Parameter]]] = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="superpipe-optimizer")
        self._refusals_said: set[str] = set()
        #: Blocks stepped during backward, over the whole run.
        self.blocks_stepped = 0
        #: Parameters outside the blocks stepped during backward, over the whole run.
        self.trunk_params_stepped = 0
        #: Called on the optimizer thread with a block's index and parameters as soon as they are stepped.
        self.on_stepped: Optional[Callable[[int, list[nn.Parameter]], None]] = None
        #: Steps one block instead of the optimizer restricted to it (the disk tier steps through its store).
        self.step_block: Optional[Callable[[Optimizer, int, list[nn.Parameter]], None]] = None

    @property
    def armed(self) -> bool:
        """Whether blocks are stepped as their gradients complete (this micro-batch's backward)."""
        return self._optimizer is not None

    def arm_if_exact(self, trainer: Any, optimizer: Optimizer, only_where_it_pays: bool) -> None:
        """Arms the step for ``optimizer`` unless :func:`overlap_refusal` objects; says why once per reason."""
        refusal = overlap_refusal(trainer, optimizer, only_where_it_pays)
        if refusal is None:
            self.arm(optimizer)
        elif refusal not in self._refusals_said:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            self._refusals_said.add(refusal)
            rank_zero_info(f"SuperpipeStrategy steps the optimizer after backward, not during it: {refusal}.")

    def arm(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._owned = {p for group in optimizer.param_groups for p in group["params"]}
        self._stepped = set()

    def block_done(self, index: int) -> None:
        """Called once block ``index``'s gradients are all in ``.grad`` (on the thread that added them)."""
        if self._optimizer is None:
            return
        params = [p for p in self.block_params[index] if p in self._owned and p.grad is not None]
        if params:
            self._stepped.update(params)
            self._futures.append(self._executor.submit(self._step, index, params))

    def trunk_done(self, param: nn.Parameter) -> None:
        """Called once a parameter outside the blocks has its whole gradient in ``.grad`` (every use in forward
        delivered): an untied head and the final norm are complete as backward starts, so their step hides behind
        the blocks' backward instead of waiting for its end."""
        if self._optimizer is None or param not in self._owned or param.grad is None or param in self._stepped:
            return
        self._stepped.add(param)
        self._futures.append(self._executor.submit(self._step_trunk, param))

    def finish(self) -> None:
        """After backward: waits for the block steps, and leaves the optimizer's own step only what is left."""
        if self._optimizer is None:
            return
        for future in self._futures:
            future.result()
        self._futures.clear()
        remaining = [p for p in self._owned if p not in self._stepped]
        self._groups = restrict(self._optimizer, set(remaining))

    def disarm(self) -> None:
        """After the optimizer's step: its parameter groups are whole again."""
        for future in self._futures:  # a backward that raised may leave steps behind
            future.result()
        self._futures.clear()
        if self._optimizer is not None and self._groups is not None:
            unrestrict(self._optimizer, self._groups)
        self._optimizer, self._groups = None, None

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _step(self, index: int, params: list[nn.Parameter]) -> None:
        assert self._optimizer is not None
        if self.step_block is not None:
            self.step_block(self._optimizer, index, params)
        else:
            self._step_only(params)
        self.blocks_stepped += 1
        if self.on_stepped is not None:
            self.on_stepped(index, params)

    def _step_trunk(self, param: nn.Parameter) -> None:
        self._step_only([param])
        self.trunk_params_stepped += 1

    def _step_only(self, params: list[nn.Parameter]) -> None:
        """The user's optimizer, stepped over ``params`` alone."""
        assert self._optimizer is not None
        with restricted(self._optimizer, set(params)):
            self._optimizer.step()
