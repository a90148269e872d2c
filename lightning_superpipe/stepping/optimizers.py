"""Which optimizers may be stepped a block at a time, and the ways to step one over some of its parameters.

Stepping block by block (during backward, or pipelined into the next forward) is exact only for an optimizer whose
update of a parameter depends on that parameter's gradient and state alone. :func:`updates_each_parameter_alone`
says so for torch's and ``transformers``' such optimizers and for classes the user declared with
:func:`register_per_parameter_optimizer`. :func:`shadow_of` makes a stand-in that steps some parameters with
hyperparameters frozen as they are now, sharing the optimizer's state, so a step can run on another thread while
the training loop goes on (a scheduler changing the learning rate meanwhile changes the next step's, not this one's).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

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


def has_step_hooks(optimizer: Optimizer) -> bool:
    """Whether a step of ``optimizer`` runs hooks: its own, or those of every optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and ``..._post_hook``). A step block by block would
    run them once per block."""
    from torch.optim import optimizer as optimizers

    every = (getattr(optimizers, f"_global_optimizer_{when}_hooks", None) for when in ("pre", "post"))
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or any(every))


def shadow_of(optimizer: Optimizer, params: Sequence[nn.Parameter]) -> Optimizer:
    """A stand-in for ``optimizer`` that steps ``params`` alone, with each group's hyperparameters as they are now.

    It shares the optimizer's ``state`` (the step updates the real moments) and nothing else that can change: its
    groups are copies (tensor hyperparameters cloned), so a scheduler stepping the real groups meanwhile does not
    reach a step already launched, and restricting its groups races with no one.
    """
    keep = set(params)
    shadow = object.__new__(type(optimizer))
    # Not an instance `step`: a scheduler's step counter wraps the real optimizer's, and would step that one.
    shadow.__dict__.update({key: value for key, value in optimizer.__dict__.items() if key != "step"})
    shadow.param_groups = [
        {**{key: value.clone() if isinstance(value, Tensor) else value for key, value in group.items()
            if key != "params"},
         "params": [p for p in group["params"] if p in keep]}
        for group in optimizer.param_groups
    ]
    return shadow


def put_state_in_group_order(optimizer: Optimizer) -> None:
    """Reorders ``optimizer.state`` in place into its groups' parameter order, the order a plain step creates it in.

    A step block by block creates (and a redo reinserts) the state in backward's order, and ``state_dict()`` lists the
    state in its dictionary's order: reordered, a checkpoint lists it as plain training's does.
    """
    state = optimizer.state
    keys = list(state)
    ordered = [p for group in optimizer.param_groups for p in group["params"] if p in state]
    seen = set(ordered)
    ordered += [key for key in keys if key not in seen]
    if any(a is not b for a, b in zip(ordered, keys)):  # by identity: == compares tensors elementwise
        items = [(key, state[key]) for key in ordered]
        state.clear()
        state.update(items)
