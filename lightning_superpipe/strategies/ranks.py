"""Lightning's DDP machinery for a strategy that does not wrap the model in ``DistributedDataParallel``.

:class:`RanksStrategy` is the base of :class:`~lightning_superpipe.SuperpipeStrategy`, as ``DDPStrategy`` is the base
of Lightning's DeepSpeed strategy: Lightning's launchers (its subprocess launcher for ``devices=N``, ``torchrun``,
SLURM through the cluster environments), ``DistributedSampler``, ``barrier``, ``broadcast``, ``reduce`` and
``sync_dist`` work unchanged, while the gradients are averaged by the streaming engine, block by block
(:mod:`lightning_superpipe.streaming.distributed`). With one device on one node nothing of that runs: no launcher,
no process group, no ``DistributedSampler``, as under a single-device strategy. With ``shard_optimizer="node"`` the
ranks of each node share one host copy of the blocks (:class:`~lightning_superpipe.streaming.distributed.NodeShare`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_superpipe.averaging import weight_averaging_callbacks
from lightning_superpipe.construction.deferred_init import DeferredInit
from lightning_superpipe.memory.pinned import shared_space
from lightning_superpipe.rng import rng_states, set_rng_states
from lightning_superpipe.run.options import SuperpipeOptions, default_sharding
from lightning_superpipe.run.setup import as_devices, join_ranks
from lightning_superpipe.streaming.distributed import (
    GradientAverager,
    NodeShare,
    every_ranks_rng_states,
    gather_optimizer_state,
    on_every_rank,
)

#: The precisions whose blocks travel and compute in a narrower dtype than their fp32 masters, and that dtype.
MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_RNG_KEY = "superpipe_rng_states"
_RANKS_RNG_KEY = "superpipe_rng_states_per_rank"


def let_lightning_ask_about_ranks() -> None:
    """Makes Lightning's ``is_distributed`` (``Trainer._accelerator_connector.is_distributed``) ask a
    :class:`RanksStrategy` whether its run has several ranks.

    Lightning answers ``True`` for every ``DDPStrategy`` subclass before it asks the strategy, and with that answer
    refuses the batch-size finder (``Tuner.scale_batch_size``, ``BatchSizeFinder``). A one-device run of this
    strategy is one process, as under ``SingleDeviceStrategy``. Other strategies get Lightning's own answer.
    Idempotent."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    lightnings = _AcceleratorConnector.__dict__["is_distributed"]
    if getattr(lightnings.fget, "asks_ranks_strategy", False):
        return

    def is_distributed(connector: _AcceleratorConnector) -> bool:
        strategy = connector.strategy
        return strategy.several_ranks if isinstance(strategy, RanksStrategy) else lightnings.fget(connector)

    is_distributed.asks_ranks_strategy = True  # type: ignore[attr-defined]
    _AcceleratorConnector.is_distributed = property(is_distributed)  # type: ignore[method-assign,assignment]


class _Rank:
    """A rank figure (``global_rank``, ``local_rank``, ``node_rank``, ``world_size``): on several ranks the cluster
    environment's, as under ``DDPStrategy``; on one, ``single`` without asking it (a SLURM or torchrun environment
    around a one-device run need not define the node's variables), as under ``SingleDeviceStrategy``. Assignable as
    that strategy's attributes are: a value set on the strategy is the one it answers from then on."""

    def __init__(self, single: int) -> None:
        self.single = single

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, strategy: Optional[RanksStrategy], owner: type) -> Any:
        if strategy is None:
            return self
        if self.name in strategy.__dict__:
            return strategy.__dict__[self.name]
        if strategy.several_ranks and strategy.cluster_environment is not None:
            return getattr(strategy.cluster_environment, self.name)()
        return self.single

    def __set__(self, strategy: RanksStrategy, value: int) -> None:
        strategy.__dict__[self.name] = value


class RanksStrategy(DDPStrategy):
    """One process per device (devices times nodes ranks), or this process alone for one device on one node.

    A subclass that averages the gradients itself (the streaming engine, block by block) gives this base its
    :attr:`averager` for the run, which :meth:`block_backward_sync` pauses and whose sharding
    :meth:`optimizer_state` follows.
    """

    #: What averages the gradients across ranks during the run (``None``: nothing, or one rank).
    averager: Optional[GradientAverager] = None
    #: The node's ranks, which share the blocks' host homes (``shard_optimizer="node"`` on several ranks).
    node: Optional[NodeShare] = None
    #: Why ``shard_optimizer="auto"`` was not ``"node"``, each said once.
    _sharding_said: frozenset[str] = frozenset()

    global_rank = _Rank(0)
    local_rank = _Rank(0)
    node_rank = _Rank(0)
    world_size = _Rank(1)

    def resolve_sharding(self, options: SuperpipeOptions, trainer: Trainer) -> SuperpipeOptions:
        """``options`` for the run: ``shard_optimizer="auto"`` is ``False`` on one rank (it does nothing there) and on
        several :func:`~lightning_superpipe.run.options.default_sharding`'s choice, the same on every rank (any
        rank's reason against ``"node"`` holds for all), said once per reason."""
        if options.shard_optimizer != "auto":
            return options
        if not self.several_ranks:
            return replace(options, shard_optimizer=False)
        assert self.model is not None
        precision = str(self.precision_plugin.precision)
        # The shared homes hold the blocks' masters and, under mixed precision, copies in the compute dtype: at most
        # this, which counts the trunk too.
        copy = MIXED_PRECISION_DTYPES[precision].itemsize if precision in MIXED_PRECISION_DTYPES else 0
        needed = sum(p.numel() * (p.element_size() + copy) for p in self.model.parameters())
        averaging = weight_averaging_callbacks(trainer) if trainer.state.fn == TrainerFn.FITTING else []
        choice = default_sharding(options, precision=precision, averaging=averaging, shared_free=shared_space(),
                                  shared_needed=needed)
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, choice)
        value, reason = next((theirs for theirs in everyone if theirs[1] is not None), choice)
        if reason is not None and reason not in self._sharding_said:
            self._sharding_said = self._sharding_said | {reason}
            rank_zero_info(f"SuperpipeStrategy(shard_optimizer='auto') is {value!r} here, not 'node': {reason}.")
        return replace(options, shard_optimizer=value)

    @property
    @override
    def parallel_devices(self) -> list[torch.device]:
        """The devices the Trainer resolved (empty until Lightning's connector sets them); each rank uses one."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[Union[int, str, torch.device]]]) -> None:
        self._parallel_devices = as_devices(devices or [])

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self._parallel_devices
        return devices[self.local_rank] if len(devices) > 1 else devices[0] if devices else torch.device("cpu")

    @property
    def several_ranks(self) -> bool:
        """Whether the run has more than one rank (devices per node times nodes)."""
        return self.num_nodes * max(1, len(self._parallel_devices)) > 1

    @override
    def _configure_launcher(self) -> None:
        if self.several_ranks:
            super()._configure_launcher()
        else:  # one device: this process, as under a single-device strategy
            self._launcher = None

    @override
    def setup_environment(self) -> None:
        if self.several_ranks:
            super().setup_environment()  # and the process group
        else:
            Strategy.setup_environment(self)

    def join_ranks(
        self, trainer: Trainer, options: SuperpipeOptions, deferred: Optional[DeferredInit] = None,
        by_default: bool = False,
    ) -> None:
        """Before streaming starts: on several ranks the same model and knobs everywhere and rank 0's weights given
        to all (:func:`~lightning_superpipe.run.setup.join_ranks`); on one, the data as a single-device strategy
        sees it. ``options`` has ``shard_optimizer`` resolved (``by_default``: from ``"auto"``, as messages say)."""
        assert self.model is not None
        self.node = None
        if self.several_ranks:
            join_ranks(self.model, self, trainer, options, deferred)
            if options.shard_optimizer == "node":  # every rank makes the node groups, in the same order
                written = "shard_optimizer='auto')` (here 'node')" if by_default else "shard_optimizer='node')`"
                devices = len(self.parallel_devices)
                call = f"`SuperpipeStrategy({written} on devices={devices}, num_nodes={self.num_nodes}"
                self.node = NodeShare(self.local_rank, devices, self.node_rank, self.num_nodes, call)
        else:  # Lightning would put a DistributedSampler of one replica (another data order) in every DataLoader
            trainer._accelerator_connector.use_distributed_sampler = False

    def on_every_rank(self, work: Callable[[], None], what: str) -> None:
        """Runs ``work``; on several ranks a failure on any is an error on every rank instead of a hang."""
        on_every_rank(work, what) if self.several_ranks else work()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Strategy's, looked up when called: DDP's adds advice about its wrapper's unused parameters, a wrapper this
        # strategy does not use.
        super(DDPStrategy, self).on_exception(exception)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model  # not wrapped in DistributedDataParallel: the engine averages the gradients

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches of an accumulation before the last: gradients accumulate locally, unreduced (DDP's
        ``no_sync``)."""
        averager = self.averager
        if averager is None:
            yield
            return
        averager.sync = False
        try:
            yield
        finally:
            averager.sync = True

    @property
    def sharded_optimizer(self) -> Optional[GradientAverager]:
        """The engine's averager where each rank keeps and steps only its share (``shard_optimizer``), else ``None``."""
        averager = self.averager
        return averager if averager is not None and averager.sharded else None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state dict; with ``shard_optimizer`` every rank's share, gathered on rank 0 (it writes)."""
        state = super().optimizer_state(optimizer)
        return gather_optimizer_state(state) if self.sharded_optimizer is not None else state

    def keep_own_optimizer_state(self, optimizer: Optimizer) -> None:
        """After loading a whole optimizer state with ``shard_optimizer``: only this rank's share stays."""
        averager = self.sharded_optimizer
        if averager is not None:
            for param in [p for p in optimizer.state if not averager.owns(p)]:
                del optimizer.state[param]

    def add_rng_states(self, checkpoint: dict[str, Any]) -> None:
        """Puts the RNG states into ``checkpoint`` (plain Lightning does not, so dropout after a resume would differ
        from an uninterrupted run); on several ranks every rank's, gathered (this runs on every rank, rank 0 writes)."""
        checkpoint[_RNG_KEY] = rng_states()
        if self.several_ranks:
            checkpoint[_RANKS_RNG_KEY] = every_ranks_rng_states(checkpoint[_RNG_KEY])

    def restore_rng_states(self, checkpoint: dict[str, Any]) -> None:
        """This rank's RNG states from ``checkpoint``: its own if it was saved by as many ranks, else rank 0's. The
        keys are taken out: the checkpoint the hooks see holds what plain Lightning's holds."""
        per_rank, states = checkpoint.pop(_RANKS_RNG_KEY, []), checkpoint.pop(_RNG_KEY, None)
        if self.several_ranks and len(per_rank) == self.world_size:
            set_rng_states(per_rank[self.global_rank])
        elif states is not None:
            set_rng_states(states)
