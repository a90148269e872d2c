"""A run on one device is one process, as under Lightning's ``SingleDeviceStrategy``: the tuner works, the rank
figures need no cluster variables and can be set as that strategy's can, and every Lightning step style trains as
plain Lightning does. The strategy logs nothing the user did not log."""

from __future__ import annotations

import copy
import pickle
from typing import Any, Iterator

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.memory import is_oom_error
from torch import nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.planning.planner import BudgetExceededError
from tests import tasks

pytestmark = pytest.mark.usefixtures("emulated_link")


class _Stack(BoringModel):
    """Three equal layers and a head, with the attributes the tuner scales (``batch_size``, ``learning_rate``)."""

    def __init__(self, batch_size: int = 2, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.layer(x)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.randn(256, 32, generator=generator), batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


def _trainer(strategy: Any, **overrides: Any) -> tasks.pl.Trainer:
    options: dict[str, Any] = dict(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True)
    return tasks.trainer(strategy, **{**options, **overrides})


def _stack() -> _Stack:
    tasks.pl.seed_everything(3, verbose=False)
    return _Stack()


def test_the_batch_size_finder_runs_and_finds_what_it_finds_under_plain(tmp_path: Any) -> None:
    found = {}
    for name, strategy in (("plain", "auto"), ("superpipe", SuperpipeStrategy())):
        model = _stack()
        found[name] = Tuner(_trainer(strategy, default_root_dir=tmp_path)).scale_batch_size(
            model, mode="power", max_trials=4, steps_per_trial=2
        )
        assert model.batch_size == found[name]
    assert found["superpipe"] == found["plain"] == 16  # 2, 4, 8, 16: four trials, none out of memory


def test_the_batch_size_finder_finds_the_largest_batch_within_the_memory_budget(tmp_path: Any) -> None:
    # 29,000 bytes: the least placement of this model holds a batch of 32 rows (25 KB; 16 rows: 15 KB), not one of 64.
    budget = 29_000
    found = {}
    for name, strategy in (("unbounded", SuperpipeStrategy()), ("budget", SuperpipeStrategy(memory_budget=budget))):
        found[name] = Tuner(_trainer(strategy, default_root_dir=tmp_path)).scale_batch_size(
            _stack(), mode="power", max_trials=6, steps_per_trial=3
        )
        if name == "budget":
            # Each larger batch was planned again; 64 rows were refused before they ran, as an out-of-memory error.
            assert strategy._last_report is not None and strategy._last_report["peak_device_bytes"] <= budget
    assert (found["unbounded"], found["budget"]) == (64, 32)
    # A first batch too large for the budget fails once profiled, with the error the finder backs off from.
    model = _stack()
    model.batch_size = 64
    with pytest.raises(BudgetExceededError, match="memory_budget=29000.*out of memory") as raised:
        _trainer(SuperpipeStrategy(memory_budget=budget), max_steps=3).fit(model)
    assert is_oom_error(raised.value)


def test_the_learning_rate_finder_sees_the_losses_plain_sees(tmp_path: Any) -> None:
    curves = []
    for strategy in ("auto", SuperpipeStrategy()):
        finder = Tuner(_trainer(strategy, default_root_dir=tmp_path)).lr_find(_stack(), num_training=20,
                                                                          early_stop_threshold=None)
        assert finder is not None
        curves.append(finder.results)
    assert curves[0]["lr"] == curves[1]["lr"]
    torch.testing.assert_close(torch.tensor(curves[1]["loss"]), torch.tensor(curves[0]["loss"]), rtol=1e-5, atol=0)


def test_a_one_device_run_inside_a_slurm_job_needs_no_node_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # An interactive SLURM allocation: Lightning picks its SLURM environment, which reads SLURM_NODEID only when
    # asked for a node rank; a single-device strategy never asks.
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "job", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    strategy = SuperpipeStrategy()
    trainer = _trainer(strategy, max_steps=2)
    trainer.fit(_stack())
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (0, 0, 0, 1)
    assert not trainer._accelerator_connector.is_distributed


def test_rank_figures_can_be_set_as_on_a_single_device_strategy() -> None:
    strategy = SuperpipeStrategy()
    assert strategy.world_size == 1
    strategy.world_size = 2
    strategy.global_rank = 1
    assert (strategy.world_size, strategy.global_rank, strategy.is_global_zero) == (2, 1, False)


class _IteratorStep(_Stack):
    """Lightning's iterator-style step: the step draws its batches itself, two per step here."""

    def training_step(self, dataloader_iter: Iterator[Any]) -> Any:  # type: ignore[override]
        first, _, _ = next(dataloader_iter)
        second, _, _ = next(dataloader_iter)
        loss = self(torch.cat([first, second])).sum()
        self.log("loss", loss, batch_size=len(first))
        return loss


def test_an_iterator_style_training_step_trains_as_plain() -> None:
    weights = []
    for strategy in ("auto", SuperpipeStrategy()):
        tasks.pl.seed_everything(3, verbose=False)
        model = _IteratorStep()
        trainer = _trainer(strategy, max_steps=4)
        trainer.fit(model)
        assert set(trainer.callback_metrics) == {"loss"}  # nothing logged but what the step logged
        weights.append(model.state_dict())
    assert tasks.max_relative_difference(weights[0], weights[1]) < 1e-6


class _CopyMidRun(tasks.pl.Callback):
    """What EMA-style and test callbacks do mid-run: deep-copy the module (and, with it, callbacks that hold its
    bound ``log``) or pickle the Trainer, and compute with the copy."""

    def __init__(self) -> None:
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: tasks.pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step != 2 or self.outputs:
            return
        copied = copy.deepcopy(pl_module)
        copy.deepcopy(trainer.callbacks)
        # The Trainer too: a copy of the strategy has the knobs and no run (the engine stays with the original).
        unpickled = pickle.loads(pickle.dumps(trainer))
        if isinstance(trainer.strategy, SuperpipeStrategy):
            assert unpickled.strategy._streaming is None and trainer.strategy._streaming is not None
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            self.outputs.append((copied(x), pl_module(x)))


def test_a_module_deep_copied_mid_run_computes_as_the_original_and_the_run_goes_on() -> None:
    weights, outputs = [], []
    # Under torch's one thread (the suite's), the strategy's optimizer step is pipelined: it must be done, and the
    # resident copies made from it, before the callback calls the model.
    for strategy in ("auto", SuperpipeStrategy()):
        model, copier = _stack(), _CopyMidRun()
        _trainer(strategy, max_steps=4, callbacks=[copier]).fit(model)
        (copied, original), = copier.outputs
        outputs.append((copied, original))
        weights.append(model.state_dict())
    assert tasks.max_relative_difference(weights[0], weights[1]) == 0.0
    for plain, streamed in zip(*outputs):  # the copy and the original, each as under plain Lightning
        torch.testing.assert_close(streamed, plain, rtol=0, atol=0)


class _CheckpointKeys(tasks.pl.Callback):
    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []
        self.loaded: list[set[str]] = []

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saved.append(checkpoint)  # kept by reference, as Lightning's hook tests keep it

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.loaded.append(set(checkpoint))


def test_checkpoint_hooks_see_what_plain_lightning_gives_them(tmp_path: Any) -> None:
    keys = []
    for name, strategy in (("plain", "auto"), ("superpipe", SuperpipeStrategy())):
        path = tmp_path / f"{name}.ckpt"
        first = _CheckpointKeys()
        trainer = _trainer(strategy, max_steps=2, callbacks=[first])
        trainer.fit(_stack())
        trainer.save_checkpoint(path)
        resumed = _CheckpointKeys()
        _trainer(strategy if strategy == "auto" else SuperpipeStrategy(), max_steps=3, callbacks=[resumed]).fit(
            _stack(), ckpt_path=path)
        keys.append(([set(saved) for saved in first.saved], resumed.loaded))
    assert keys[1] == keys[0]
    # The strategy's own entry (the RNG states, for an exact resume) is in the file all the same.
    assert "superpipe_rng_states" in torch.load(tmp_path / "superpipe.ckpt", weights_only=False)
