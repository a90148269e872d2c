"""``Trainer(strategy="superpipe", accelerator="cpu", devices=2)``: Lightning's DDP, gradients averaged per block.

Each fixture runs tests/ddp_script.py once (two gloo processes launched by Lightning's subprocess launcher, several
fits each, about ten seconds); the tests read what every rank saved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import models

SCRIPT = Path(__file__).with_name("ddp_script.py")


def _launch(mode: str, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(out)], capture_output=True, text=True, timeout=240,
        cwd=SCRIPT.parent.parent,
    )
    assert result.returncode == 0, f"{SCRIPT.name} {mode} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


def _load(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}_rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_exact")
    _launch("exact", out)
    return out


@pytest.fixture(scope="module")
def disagree_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_disagree")
    _launch("disagree", out)
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a)


def test_losses_and_weights_equal_plain_ddp_on_every_rank(exact_run: Path) -> None:
    # AdamW in two groups with a schedule, clipping by norm, accumulation 2, dropout; each rank on its own shard.
    for plain, streamed in zip(_load(exact_run, "ddp"), _load(exact_run, "superpipe")):
        assert streamed["sampler"] == plain["sampler"] == "DistributedSampler"
        assert streamed["steps"] == plain["steps"] == 6
        assert streamed["losses"] == plain["losses"]
        assert _max_difference(streamed["weights"], plain["weights"]) == 0.0
    for plain, emulated in zip(_load(exact_run, "ddp"), _load(exact_run, "emulated")):  # the CUDA code paths
        assert emulated["losses"] == plain["losses"]
        assert _max_difference(emulated["weights"], plain["weights"]) == 0.0
    zero, one = _load(exact_run, "superpipe")
    assert zero["losses"] != one["losses"]  # the ranks saw different data ...
    assert _max_difference(zero["weights"], one["weights"]) == 0.0  # ... and took the same averaged steps


def test_a_sharded_optimizer_equals_plain_ddp_with_each_rank_holding_its_share(exact_run: Path) -> None:
    replicated = _load(exact_run, "superpipe")[0]["report"]
    sharded = _load(exact_run, "sharded")
    for plain, rank in zip(_load(exact_run, "ddp"), sharded):  # clipping by the global norm of the shards
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
        assert 0 < rank["report"]["optimizer_state_bytes"] < replicated["optimizer_state_bytes"]
    # The ranks' shares add up to one whole optimizer state: one copy per node, not one per rank.
    assert sum(rank["report"]["optimizer_state_bytes"] for rank in sharded) == replicated["optimizer_state_bytes"]


def test_a_sharded_optimizer_checkpoints_all_of_its_state_in_one_file_and_resumes(exact_run: Path) -> None:
    whole = torch.load(exact_run / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    gathered = torch.load(exact_run / "sharded" / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert list(gathered) == list(whole)
    for index, state in whole.items():
        assert all(torch.equal(state[key], gathered[index][key]) for key in state)
    runs = ("uninterrupted", "sharded_first", "sharded_resumed")
    for uninterrupted, first, resumed in zip(*(_load(exact_run, name) for name in runs)):
        assert first["losses"] == uninterrupted["losses"][:8]
        assert resumed["losses"] == uninterrupted["losses"][8:]
        assert _max_difference(resumed["weights"], uninterrupted["weights"]) == 0.0


def test_the_overlapped_optimizer_step_stays_exact_with_averaged_gradients(exact_run: Path) -> None:
    for plain, overlapped in zip(_load(exact_run, "ddp_unclipped"), _load(exact_run, "overlapped")):
        # Every block of every step was stepped during backward, from its averaged gradients.
        assert overlapped["report"]["overlapped_block_steps"] == 4 * overlapped["report"]["num_blocks"]
        assert overlapped["losses"] == plain["losses"]
        assert _max_difference(overlapped["weights"], plain["weights"]) == 0.0


def test_gradients_are_reduced_once_per_step_at_the_boundary_within_the_ledgers_bounds(exact_run: Path) -> None:
    for rank in _load(exact_run, "superpipe"):
        blocks = rank["report"]["num_blocks"]
        # One all-reduce per block and per trunk parameter on the last micro-batch, none on the first.
        assert rank["reductions"] == rank["steps"] * (blocks + rank["trunk_params"])
        # The device still holds at most two blocks of gradients (one computed, one being reduced), plus flags,
        # and nothing (autograd included) keeps a view of a slot once the step is over.
        assert rank["report"]["peak_block_gradient_bytes"] <= 2 * rank["report"]["largest_block_bytes"] + 1024
        assert rank["slot_references"] and set(rank["slot_references"]) == {0}


def test_sync_dist_logging_averages_across_ranks(exact_run: Path) -> None:
    plain = _load(exact_run, "ddp")
    for rank, streamed in enumerate(_load(exact_run, "superpipe")):
        assert streamed["metrics"]["synced_rank"] == 0.5  # 0 on rank 0, 1 on rank 1: averaged
        assert streamed["metrics"]["synced_loss"] == plain[rank]["metrics"]["synced_loss"]
        assert streamed["metrics"]["synced_loss"] == pytest.approx(
            sum(sum(r["losses"]) / len(r["losses"]) for r in plain) / 2, rel=1e-6
        )


def test_resume_from_one_checkpoint_continues_like_an_uninterrupted_run(exact_run: Path) -> None:
    assert sorted(p.name for p in exact_run.glob("*.ckpt")) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # rank 0 wrote
    checkpoint = torch.load(exact_run / "last.ckpt", weights_only=False)
    assert len(checkpoint["superpipe_rng_states_per_rank"]) == 2
    for uninterrupted, first, resumed in zip(*(_load(exact_run, n) for n in ("uninterrupted", "first", "resumed"))):
        assert first["losses"] == uninterrupted["losses"][:8]
        assert resumed["losses"] == uninterrupted["losses"][8:]
        assert _max_difference(resumed["weights"], uninterrupted["weights"]) == 0.0


def test_host_bytes_per_node_are_one_copy_per_rank(exact_run: Path) -> None:
    """Each rank holds the whole host state: a node of two ranks holds twice one process's (the issue's target of
    1.25x needs a shared copy per node, not done yet). Measured here so that the figure is known."""
    single = models.build_task("llama")

    class Report(models.pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.report = trainer.strategy.memory_report()

    report = Report()
    models.pl.seed_everything(8, verbose=False)
    models.trainer(SuperpipeStrategy(), max_steps=6, callbacks=[report]).fit(single, models.data("lm"))
    ranks = _load(exact_run, "superpipe")
    node = sum(rank["report"]["host_bytes"] for rank in ranks)
    assert node == 2 * report.report["host_bytes"]
    assert all(rank["report"]["optimizer_state_bytes"] == report.report["optimizer_state_bytes"] for rank in ranks)


def test_ranks_with_different_knobs_fail_with_one_clear_error_on_every_rank(disagree_run: Path) -> None:
    for rank in (0, 1):
        message = (disagree_run / f"knobs_rank{rank}.txt").read_text()
        call = "`Trainer(strategy=SuperpipeStrategy(...), devices=2, num_nodes=1)`"
        assert message.startswith(f"RanksDisagreeError: {call} must be given the same knobs on every rank")
        assert "rank 1 has prefetch=2 where rank 0 has prefetch=1" in message


def test_a_failure_on_one_rank_is_an_error_on_every_rank(disagree_run: Path) -> None:
    assert (disagree_run / "host_rank1.txt").read_text().startswith("HostMemoryError: SuperpipeStrategy needs about")
    message = (disagree_run / "host_rank0.txt").read_text()
    assert message.startswith("RanksDisagreeError: SuperpipeStrategy could not start streaming on rank 1:")
    assert "HostMemoryError: SuperpipeStrategy needs about" in message


def test_what_several_devices_do_not_support_yet_is_refused_on_every_rank(disagree_run: Path) -> None:
    for rank in (0, 1):
        message = (disagree_run / f"disk_rank{rank}.txt").read_text()
        assert message.startswith("MisconfigurationException: SuperpipeStrategy(offload_device='disk'")
        assert "streams through one device for now: run it with `Trainer(devices=1)`" in message
        message = (disagree_run / f"batchnorm_rank{rank}.txt").read_text()
        assert "`Trainer(strategy='superpipe', sync_batchnorm=True)` is not supported yet" in message


def test_shard_optimizer_is_checked_and_changes_nothing_on_one_device() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"SuperpipeStrategy\(shard_optimizer='yes'\) must be True or"):
        models.trainer(SuperpipeStrategy(shard_optimizer="yes"), max_steps=1).fit(
            models.build_task("sequential"), models.data("vector")
        )
    plain = models.fit("sequential", SuperpipeStrategy(), max_steps=4)
    sharded = models.fit("sequential", SuperpipeStrategy(shard_optimizer=True), max_steps=4)
    assert sharded.losses == plain.losses
    assert models.max_relative_difference(sharded, plain) == 0.0
