"""The disk tier's hooks on the user's objects during a run: ``zero_grad`` drops spilled gradients as it would drop
``.grad`` (:class:`ZeroGradHook`); ``state_dict()`` gives the committed values and ``load_state_dict()`` of block
parameters is refused (:class:`BlockValuesHook`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Callable, Protocol

from torch import Tensor, nn

from lightning_superpipe.wrappers import BeforeCalls


class TierView(Protocol):
    """What the hooks need of the tier (:class:`~lightning_superpipe.memory.disk.tier.DiskTier`)."""

    #: A checkpoint's state dict is being taken: the blocks' entries stay placeholders (the files go beside it).
    checkpointing: bool

    def holds(self, param: nn.Parameter) -> bool: ...

    def committed_master(self, param: nn.Parameter) -> Tensor: ...

    def zero_grad(self, params: Iterable[nn.Parameter]) -> None: ...


def _modules_holding(model: nn.Module, tier: TierView) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Each module of ``model`` that holds block parameters (its own or its submodules'), with them by name in it."""
    held = [(m, [(n, p) for n, p in m.named_parameters() if tier.holds(p)]) for m in model.modules()]
    return [(module, params) for module, params in held if params]


class ZeroGradHook(BeforeCalls):
    """Tells the tier when the user zeroes gradients, which it must know because a block's gradients are in its
    files, not in ``.grad``: before ``zero_grad`` of the optimizer, of Lightning's wrapper of it, and of every module
    holding block parameters (the LightningModule's ``self.zero_grad()``), :meth:`DiskTier.zero_grad
    <lightning_superpipe.memory.disk.tier.DiskTier.zero_grad>` hears which block parameters it zeroes.
    """

    def __init__(self, tier: TierView, model: nn.Module, optimizers: Sequence[Any]) -> None:
        # An optimizer's groups are read at each call: BaseFinetuning adds the blocks' group mid-run.
        targets: list[tuple[Any, str, Callable[[], None]]] = [
            (o, "zero_grad", lambda o=o: tier.zero_grad(p for group in o.param_groups for p in group["params"]))
            for o in optimizers
        ]
        for module, held in _modules_holding(model, tier):
            params = [p for _, p in held]
            targets.append((module, "zero_grad", lambda params=params: tier.zero_grad(params)))
        super().__init__(targets)


class BlockValuesHook:
    """``state_dict()`` and ``load_state_dict()`` during the run, where the block parameters hold placeholders: a
    state dict gets each block's committed masters, mapped copy-on-write from its file (no host memory until read;
    the store writes that slot into a new file from then on, so the values stay those of the step the state dict
    was taken at), and a load that would write block parameters is refused before anything is loaded (the tier's
    files are the weights; loading into placeholders would fail deep inside torch, or be lost).

    Hooks every module holding block parameters: the state-dict hook on their owners, the load pre-hook on every
    module above them too, so that a load is refused at the module it was called on.
    """

    def __init__(self, tier: TierView, model: nn.Module) -> None:
        self._tier = tier
        self._owners = [(m, [(n, p) for n, p in m._parameters.items() if p is not None and tier.holds(p)])
                        for m in model.modules()]
        self._owners = [(m, owned) for m, owned in self._owners if owned]
        self._holders = [(m, [n for n, _ in held]) for m, held in _modules_holding(model, tier)]
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        for module, owned in self._owners:
            self._handles.append(module.register_state_dict_post_hook(partial(self._committed, owned)))
        for module, names in self._holders:
            self._handles.append(module.register_load_state_dict_pre_hook(partial(self._refuse_load, names)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _committed(self, owned: list[tuple[str, nn.Parameter]], module: nn.Module, state_dict: dict[str, Any],
                   prefix: str, local_metadata: Any) -> None:
        if self._tier.checkpointing:
            return
        for name, param in owned:
            key = prefix + name
            if key in state_dict and state_dict[key] is not param:  # keep_vars=True asks for the parameter itself
                state_dict[key] = self._tier.committed_master(param)

    def _refuse_load(self, names: list[str], module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                     *args: Any) -> None:
        loaded = next((prefix + name for name in names if prefix + name in state_dict), None)
        if loaded is not None:
            raise RuntimeError(
                f"SuperpipeStrategy(offload_device='disk'): load_state_dict during the run would write {loaded!r}, a"
                " parameter whose values are in the tier's files (the parameter holds a placeholder). Load"
                " the weights before fit (or resume with trainer.fit(..., ckpt_path=...)), or after it, or use"
                " offload_device='cpu'. Nothing was loaded."
            )
