"""The memory table's plain-strategy figure counts plain training's activations, measured without disturbing the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.recipes import MemoryReport
from lightning_superpipe.recipes.memory_report import MemorySummary
from lightning_superpipe.recipes.plain_activations import count_saved_activations
from tests import tasks

BATCH, WIDTH, FLOAT = 5, 8, 4


def stack() -> nn.Module:
    """An input layer, two blocks (``Linear`` + ``ReLU``) in a stack the strategy streams, a head."""
    return nn.Sequential(
        nn.Linear(4, WIDTH), nn.ReLU(),
        nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(2)]),
        nn.Linear(WIDTH, 2),
    )


class Squares(pl.LightningModule):
    """The mean square of the stack's output, a loss whose saved tensors are known; logs like recipes do."""

    def __init__(self) -> None:
        super().__init__()
        self.model = stack()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = (self.model(batch[0]) ** 2).mean()
        self.log("train/loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(4 * BATCH, 4, generator=generator)), batch_size=BATCH, shuffle=True)


# Autograd saves, for a batch of BATCH rows (weights aside, each storage once): the input x (the first Linear's
# weight gradient needs it), the output of each ReLU (its own backward, and the next Linear's input: one storage) and
# the head's output (the square's backward).
HAND_COUNTED_OUTSIDE = BATCH * 4 * FLOAT + BATCH * 2 * FLOAT  # x, the head's output
HAND_COUNTED_BLOCKS = 3 * BATCH * WIDTH * FLOAT  # the input layer's ReLU output (the first block's input), 2 ReLUs


def test_the_count_of_saved_activations_is_the_hand_count_and_changes_nothing() -> None:
    torch.manual_seed(0)
    module = Squares()
    weights = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    module.eval()
    batch = (torch.randn(BATCH, 4),)
    rng = torch.get_rng_state()
    count = count_saved_activations(module, batch, blocks=list(module.model[2]))
    assert count.total_bytes == HAND_COUNTED_OUTSIDE + HAND_COUNTED_BLOCKS
    assert count.block_bytes == HAND_COUNTED_BLOCKS and count.outside_blocks_bytes == HAND_COUNTED_OUTSIDE
    # No gradient made, weights and RNG as they were, eval mode put back, nothing logged.
    assert all(param.grad is None for param in module.parameters())
    assert all(torch.equal(weights[name], tensor) for name, tensor in module.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng) and not module.training and "log" not in vars(module)


def fit_squares(root: Path, callbacks: list[Any], strategy: Any = "auto") -> tuple[Squares, pl.Trainer]:
    pl.seed_everything(3, verbose=False)
    module = Squares()
    trainer = tasks.trainer(strategy, max_steps=4, accumulate_grad_batches=1, callbacks=callbacks,
                            default_root_dir=root)
    trainer.fit(module, loader())
    return module, trainer


def test_the_table_sets_the_peak_against_plain_training_with_its_activations(tmp_path: Path) -> None:
    report = MemoryReport(plot=False, progress_bar=False)
    fit_squares(tmp_path, [report])
    summary = report.summary
    assert summary is not None
    assert summary.plain_activation_bytes == HAND_COUNTED_OUTSIDE + HAND_COUNTED_BLOCKS
    assert summary.plain_peak_bytes == summary.plain_total_bytes + summary.plain_activation_bytes
    rows = dict(summary.rows())
    assert rows["  activations saved for backward (measured)"] == f"{summary.plain_activation_bytes} B"
    # The plain strategy is what it is compared with: after a batch it holds all but the activations, freed by then.
    assert summary.peak_bytes == summary.plain_total_bytes
    assert rows["device peak / plain peak (activations included)"] == "100.0 %"
    assert "device peak / plain total" not in rows


def test_the_superpipe_peak_is_compared_with_plain_training_with_its_activations(tmp_path: Path) -> None:
    report = MemoryReport(plot=False, progress_bar=False)
    fit_squares(tmp_path, [report], SuperpipeStrategy(resident_blocks=0, prefetch=0, activations="keep"))
    summary = report.summary
    assert summary is not None and summary.superpipe_peak_device_bytes is not None
    assert summary.plain_activation_bytes == HAND_COUNTED_OUTSIDE + HAND_COUNTED_BLOCKS
    # The ledger counts the blocks' activations and the ones outside them: all kept, as many as plain training
    # saves (the first block's input, a ReLU's output saved outside the blocks too, counts once, as outside).
    assert summary.outside_blocks_activation_bytes == HAND_COUNTED_OUTSIDE
    report = summary.strategy_report
    assert report is not None
    assert report["peak_outside_activation_bytes"] == HAND_COUNTED_OUTSIDE + BATCH * WIDTH * FLOAT
    assert report["peak_activation_bytes"] + report["peak_outside_activation_bytes"] == summary.plain_activation_bytes
    assert summary.compared_peak_bytes == summary.superpipe_peak_device_bytes
    ratio = summary.compared_peak_bytes / summary.plain_peak_bytes
    assert dict(summary.rows())["device peak / plain peak (activations included)"] == f"{100 * ratio:.1f} %"


class EndState(pl.Callback):
    """The optimizer's state tensors and the parameters' gradients as training ends."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.optimizers[0].state_dict()["state"]
        self.tensors = [value for entry in state.values() for value in entry.values() if isinstance(value, Tensor)]
        self.tensors += [param.grad for param in pl_module.parameters() if param.grad is not None]


@pytest.mark.parametrize("strategy", ["auto", "superpipe"])
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_measuring_leaves_the_run_as_it_would_have_been(strategy: str, dropout: float, tmp_path: Path) -> None:
    def run(callbacks: list[Any]) -> tuple[tasks.Task, list[Tensor]]:
        chosen = "auto" if strategy == "auto" else SuperpipeStrategy(resident_blocks=0, prefetch=0)
        build = lambda: tasks.Task(lambda: tasks.sequential(dropout), "vector")  # noqa: E731
        end = EndState()
        task = tasks.fit_task(build, chosen, tasks.data("vector"), callbacks=[*callbacks, end], max_steps=4,
                              default_root_dir=tmp_path)
        return task, end.tensors

    # Dropout draws from the RNG in every step: a measurement that moved the RNG would change every loss after it.
    (with_report, with_state), (without, state) = run([MemoryReport(plot=False)]), run([])
    # The measurement ran ``training_step`` once more, before the run: the task recorded its loss first.
    assert with_report.losses[1:] == without.losses
    if dropout == 0.0:  # on the run's first batch (with dropout, other masks: the run's RNG is put back after it)
        assert with_report.losses[0] == without.losses[0]
    assert all(torch.equal(a, b) for a, b in zip(with_report.state_dict().values(), without.state_dict().values()))
    # The optimizer's moments and step counts, and the gradients left, are those of the run without the report.
    assert len(with_state) == len(state) > 0 and all(torch.equal(a, b) for a, b in zip(with_state, state))


def test_unmeasured_activations_are_said_to_be_unmeasured() -> None:
    summary = MemorySummary(stage="fit", strategy="X", device="cpu", param_bytes=10, gradient_bytes=10,
                            optimizer_state_bytes=20, plain_total_bytes=40, superpipe_peak_device_bytes=20,
                            plain_activations_note="off")
    rows = dict(summary.rows())
    assert "plain strategy on device, activations not measured (off):" in rows
    assert rows["device peak / plain peak (plain's activations not measured)"] == "50.0 %"


def test_a_plan_that_keeps_activations_says_so_next_to_the_ratio() -> None:
    plan = {"activations": ["offload", "keep", "recompute", "recompute", "keep", "keep"], "budget_bytes": 100,
            "predicted_peak_bytes": 50, "predicted_step_s": 0.1}
    summary = MemorySummary(stage="fit", strategy="X", device="cpu", param_bytes=10, gradient_bytes=10,
                            optimizer_state_bytes=20, plain_total_bytes=40, superpipe_peak_device_bytes=60,
                            strategy_report={"plan": plan}, plain_activation_bytes=80,
                            outside_blocks_activation_bytes=0)
    labels = [label for label, _ in summary.rows()]
    ratio = labels.index("device peak / plain peak (activations included)")
    assert labels[ratio + 1] == "  the plan keeps the activations of blocks 1, 4-5 on the device"


class RemembersItsLoader(pl.LightningDataModule):
    """Like the recipes' data module: the loader it made last is where a checkpoint's position is loaded into."""

    def __init__(self) -> None:
        super().__init__()
        self.last_loader: DataLoader | None = None

    def train_dataloader(self) -> DataLoader:
        self.last_loader = loader()
        return self.last_loader


def test_taking_the_first_batch_leaves_the_data_module_as_it_was(tmp_path: Path) -> None:
    data = RemembersItsLoader()
    report = MemoryReport(plot=False, progress_bar=False)
    seen: list[Any] = []

    class Watch(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            seen.append(data.last_loader)  # after the report's setup, which asked for a loader

    pl.seed_everything(3, verbose=False)
    tasks.trainer("auto", max_steps=1, accumulate_grad_batches=1, callbacks=[report, Watch()],
                  default_root_dir=tmp_path).fit(Squares(), datamodule=data)
    assert seen == [None] and report.summary is not None and report.summary.plain_activation_bytes


class LateSquares(Squares):
    """Squares whose stack is built in ``configure_model``: under the disk tier its weights are never whole in memory,
    so plain training's activations cannot be measured before the run."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.losses = []

    def configure_model(self) -> None:
        # Blocks that save their input, not their output (as a transformer's): ReLU's output is what it and the
        # Linear after it save. Plain training saves x, each block's ReLU output, the last ReLU's and the head's output:
        # the hand count of `stack()` again.
        if not hasattr(self, "model"):
            self.model = nn.Sequential(
                nn.Linear(4, WIDTH),
                nn.Sequential(*[nn.Sequential(nn.ReLU(), nn.Linear(WIDTH, WIDTH)) for _ in range(2)]),
                nn.ReLU(), nn.Linear(WIDTH, 2),
            )


def test_under_the_disk_tier_the_plain_side_counts_the_optimizer_state_in_files_and_the_run_s_activations(
    tmp_path: Path,
) -> None:
    report = MemoryReport(plot=False, progress_bar=False)
    pl.seed_everything(3, verbose=False)
    module = LateSquares()
    (tmp_path / "tier").mkdir()
    strategy = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path / "tier", memory_budget="1GiB")
    trainer = tasks.trainer(strategy, max_steps=4, accumulate_grad_batches=1, callbacks=[report],
                            default_root_dir=tmp_path)
    trainer.fit(module, loader())
    summary = report.summary
    assert summary is not None
    # AdamW's two moments per trainable weight, most of them in the tier's files, and a step count per tensor.
    trainable = sum(p.numel() * p.element_size() for p in module.parameters())
    assert 2 * trainable <= summary.optimizer_state_bytes <= 2 * trainable + 4 * 64
    # Plain training's activations: as many as a plain step saves, counted by the planner's profiled step.
    assert summary.plain_activations_source == "counted in the profiled step"
    assert summary.plain_activation_bytes == HAND_COUNTED_OUTSIDE + HAND_COUNTED_BLOCKS
    rows = dict(summary.rows())
    counted = rows["  activations saved for backward (counted in the profiled step)"]
    assert counted == f"{summary.plain_activation_bytes} B"
    assert "device peak / plain peak (activations included)" in rows


def test_a_run_stopped_by_an_exception_still_writes_its_report(tmp_path: Path) -> None:
    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("stopped by hand")

    report = MemoryReport(plot=False, progress_bar=False)
    with pytest.raises(RuntimeError, match="stopped by hand"):
        fit_squares(tmp_path, [report, Stop()], SuperpipeStrategy(resident_blocks=0))
    written = json.loads(next(tmp_path.rglob("memory_report.json")).read_text())
    assert written["interrupted"] is True and written["stage"] == "fit" and written["steps"] == 2
    assert written["superpipe_peak_device_bytes"] > 0
    # The whole process's host memory beside what the strategy allocated: the process holds far more.
    assert written["process_peak_host_bytes"] > 10 * written["host_bytes"] > 0
    assert "interrupted" in report.summary.table().splitlines()[0]
