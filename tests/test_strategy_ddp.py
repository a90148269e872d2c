"""``Trainer(strategy="superpipe", accelerator="cpu", devices=2)``: Lightning's DDP, gradients averaged per block.

Each fixture runs tests/ddp_script.py once (two gloo processes launched by Lightning's subprocess launcher, several
fits each, ten to forty seconds), or once per "node" (two nodes of one process each, as torchrun would start them);
the tests read what every rank saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from tests import batches, tasks

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
    """The ``exact`` runs and, in the same two processes (one start-up fewer), the ``modes`` runs."""
    out = tmp_path_factory.mktemp("ddp_exact")
    _launch("exact+modes", out)
    return out


@pytest.fixture(scope="module")
def nodes_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two "nodes" of one CPU rank each on this machine: the script started once per node, as torchrun would."""
    import os
    import socket

    out = tmp_path_factory.mktemp("ddp_nodes")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "nodes", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=SCRIPT.parent.parent,
            env={**os.environ, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        )
        for node in (0, 1)
    ]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    for node, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"{SCRIPT.name} nodes failed on node {node}:\n{output[-8000:]}"
    return out


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_disk")
    _launch("disk", out)
    return out


@pytest.fixture(scope="module")
def modes_run(exact_run: Path) -> Path:
    return exact_run  # launched with the exact runs: their names do not overlap


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


@pytest.mark.parametrize("sharding", ["sharded", "node"])  # shard_optimizer=True, shard_optimizer="node"
def test_a_sharded_optimizer_checkpoints_all_of_its_state_in_one_file_and_resumes(
    exact_run: Path, sharding: str
) -> None:
    whole = torch.load(exact_run / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    gathered = torch.load(exact_run / sharding / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert list(gathered) == list(whole)
    for index, state in whole.items():
        assert all(torch.equal(state[key], gathered[index][key]) for key in state)
    runs = ("uninterrupted", f"{sharding}_first", f"{sharding}_resumed")
    for uninterrupted, first, resumed in zip(*(_load(exact_run, name) for name in runs)):
        assert first["losses"] == uninterrupted["losses"][:8]
        assert resumed["losses"] == uninterrupted["losses"][8:]
        assert _max_difference(resumed["weights"], uninterrupted["weights"]) == 0.0


def test_speculative_and_pipelined_steps_on_two_ranks_are_bitwise_the_step_after_backward(modes_run: Path) -> None:
    """Clipping by norm and accumulation 2, the replicated optimizer: each rank speculates on its averaged gradients
    and redoes every step (the clip fires on each), or pipelines it; the same losses and weights as the serial run
    of the same ranks."""
    serial = _load(modes_run, "serial")
    assert all(rank["report"]["steps_serial"] == 4 for rank in serial)
    for mode in ("speculative", "pipelined"):
        for after_backward, rank in zip(serial, _load(modes_run, mode)):
            assert rank["report"][f"steps_{mode}"] == 4
            assert rank["losses"] == after_backward["losses"]
            assert _max_difference(rank["weights"], after_backward["weights"]) == 0.0
            redone = rank["report"]["speculative_steps_redone"]
            assert redone == (4 if mode == "speculative" else 0)
    zero, one = _load(modes_run, "speculative")
    assert zero["losses"] != one["losses"] and _max_difference(zero["weights"], one["weights"]) == 0.0


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


def test_the_disk_tier_on_two_ranks_equals_plain_ddp_with_each_ranks_files_in_a_folder_of_its_own(
    disk_run: Path,
) -> None:
    # Clipping by norm and accumulation 2: the first micro-batch's gradients go to disk, and come back into the
    # reduction of the last one's, as DDP reduces the accumulated sum (without that the weights differ by ~0.08).
    for name in ("disk", "disk_emulated"):
        for plain, rank in zip(_load(disk_run, "ddp"), _load(disk_run, name)):
            assert rank["sampler"] == plain["sampler"] == "DistributedSampler"
            assert rank["losses"] == plain["losses"]
            assert _max_difference(rank["weights"], plain["weights"]) == 0.0
            assert rank["reductions"] == rank["steps"] * (rank["report"]["num_blocks"] + rank["trunk_params"])
            assert rank["report"]["disk_bytes_written"] > 0
    for plain, rank in zip(_load(disk_run, "ddp_unclipped"), _load(disk_run, "disk_overlapped")):
        assert rank["report"]["overlapped_block_steps"] == 4 * rank["report"]["num_blocks"]
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    # bf16-mixed (the masters cast on the fly as they stream) equals the host tier's; validation between the steps.
    runs = ("superpipe_bf16", "disk_bf16", "ddp")
    for host, rank, plain in zip(*(_load(disk_run, name) for name in runs)):
        assert rank["losses"] == host["losses"]
        assert _max_difference(rank["weights"], host["weights"]) == 0.0
        assert rank["losses"] != plain["losses"][:4]  # bf16 compute indeed
    for plain, rank in zip(_load(disk_run, "ddp_validated"), _load(disk_run, "disk_validated")):
        assert len(rank["val_losses"]) == 8 and rank["val_losses"] == plain["val_losses"]
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    for plain, rank in zip(_load(disk_run, "ddp_validate"), _load(disk_run, "disk_validate")):  # evaluation alone
        assert len(rank["val_losses"]) == 4 and rank["val_losses"] == plain["val_losses"]
    for host, rank in zip(_load(disk_run, "superpipe_16"), _load(disk_run, "disk_16")):  # a gradient scaler
        assert rank["losses"] == host["losses"]
        assert _max_difference(rank["weights"], host["weights"]) == 0.0
    for plain, rank in zip(_load(disk_run, "ddp_manual"), _load(disk_run, "disk_manual")):  # manual optimization
        assert len(rank["losses"]) == 8 and rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    # Built in configure_model under each rank's own seed: every rank starts from rank 0's values, its init calls
    # replayed with rank 0's draws block by block into fresh tensors (the parameters' own memory never written).
    for plain, rank in zip(_load(disk_run, "ddp_configured"), _load(disk_run, "disk_configured")):
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    blocks = {name for block in json.loads((disk_run / "tier" / "rank-0" / "manifest.json").read_text())["names"]
              for name in block}
    for rank in (0, 1):
        assert torch.load(disk_run / f"disk_configured_fresh_rank{rank}.pt") == dict.fromkeys(blocks, True)
    # Each rank's files in its own folder, stepped alike: the same committed bytes.
    folders = [disk_run / "tier" / f"rank-{rank}" for rank in (0, 1)]
    manifests = [json.loads((folder / "manifest.json").read_text()) for folder in folders]
    assert manifests[0] == manifests[1] and manifests[0]["step"] > 0
    for index, record in enumerate(manifests[0]["blocks"]):
        name = f"block{index:05d}.{record['slot']}.bin"
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes()


def test_the_disk_tier_on_two_ranks_checkpoints_rank_zeros_files_and_both_resume_from_them(disk_run: Path) -> None:
    checkpoints = disk_run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    for ckpt in ("epoch=0-step=4.ckpt", "last.ckpt"):  # one copy of the files per .ckpt, rank 0's
        assert len(list((checkpoints / f"{ckpt}.disk-tier").iterdir())) == 1
    runs = ("uninterrupted", "disk_first", "disk_resumed")
    for uninterrupted, first, resumed in zip(*(_load(disk_run, name) for name in runs)):
        assert first["losses"] == uninterrupted["losses"][:8]
        assert resumed["losses"] == uninterrupted["losses"][8:]
        assert _max_difference(resumed["weights"], uninterrupted["weights"]) == 0.0


def test_a_disk_tier_checkpoint_of_two_ranks_resumes_on_one_device(disk_run: Path, tmp_path: Path) -> None:
    """Rank 0's files beside the ``.ckpt`` are the whole training state: one device (in this process) resumes from
    them, with the weights the two ranks had, and trains on."""
    from tests import ddp_script

    first = _load(disk_run, "disk_first")[0]
    tier = tmp_path / "tier"
    tier.mkdir()
    options = dict(devices=1, max_steps=-1, limit_train_batches=8, ckpt_path=disk_run / "checkpoints" / "last.ckpt")
    ddp_script.fit("restored", tmp_path, SuperpipeStrategy(offload_device="disk", offload_path=tier), max_epochs=1,
                   **options)
    restored = torch.load(tmp_path / "restored_rank0.pt", weights_only=False)
    assert restored["losses"] == [] and _max_difference(restored["weights"], first["weights"]) == 0.0
    ddp_script.fit("continued", tmp_path, SuperpipeStrategy(offload_device="disk", offload_path=tier), max_epochs=2,
                   **options)
    continued = torch.load(tmp_path / "continued_rank0.pt", weights_only=False)
    assert len(continued["losses"]) == 8 and continued["steps"] == first["steps"] + 4
    assert _max_difference(continued["weights"], first["weights"]) > 0


def _node_bytes(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """A node's host bytes from its ranks' reports: each rank's own, plus the shared region once (all ranks map it)."""
    shared = {rank["report"]["shared_host_bytes"] for rank in ranks}
    assert len(shared) == 1
    private = sum(rank["report"]["host_bytes"] - rank["report"]["shared_host_bytes"] for rank in ranks)
    return {
        "host_bytes": private + shared.pop(),
        "optimizer_state_bytes": sum(rank["report"]["optimizer_state_bytes"] for rank in ranks),
        "grad_bytes": sum(rank["report"]["grad_bytes"] for rank in ranks),
    }


def test_host_bytes_per_node_one_copy_per_rank_replicated_one_per_node_with_shard_optimizer_node(
    exact_run: Path,
) -> None:
    """With ``shard_optimizer=False`` each rank holds the whole host state: a node of two ranks holds twice one
    process's. With
    ``shard_optimizer="node"`` the blocks' homes are one shared copy and gradients and optimizer state are split: the
    issue's target is a node of two ranks at most 1.25x one process."""
    single = tasks.build_task("llama")

    class Report(tasks.pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.report = trainer.strategy.memory_report()
            self.report["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in pl_module.parameters()
                                            if p.grad is not None)

    report = Report()
    tasks.pl.seed_everything(8, verbose=False)
    tasks.trainer(SuperpipeStrategy(), max_steps=6, callbacks=[report]).fit(single, batches.data("lm"))
    one = report.report
    assert one["shared_host_bytes"] == 0 and one["host_bytes"] > 0 and one["grad_bytes"] > 0
    replicated = _node_bytes(_load(exact_run, "superpipe"))
    assert replicated["host_bytes"] == 2 * one["host_bytes"]
    assert replicated["optimizer_state_bytes"] == 2 * one["optimizer_state_bytes"]
    node = _node_bytes(_load(exact_run, "node"))
    assert node["host_bytes"] == one["host_bytes"]  # the homes once per node (on the CPU there is no staging)
    assert node["optimizer_state_bytes"] == one["optimizer_state_bytes"]
    assert node["grad_bytes"] == one["grad_bytes"]
    total = lambda figures: sum(figures[k] for k in ("host_bytes", "optimizer_state_bytes", "grad_bytes"))  # noqa: E731
    assert total(node) <= 1.25 * total(one) < total(replicated)


def test_shard_optimizer_node_equals_plain_ddp_streaming_both_ranks_from_one_shared_copy(exact_run: Path) -> None:
    replicated = _load(exact_run, "superpipe")[0]["report"]
    ranks = _load(exact_run, "node")
    for plain, rank, emulated in zip(_load(exact_run, "ddp"), ranks, _load(exact_run, "node_emulated")):
        assert rank["losses"] == plain["losses"] and emulated["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
        assert _max_difference(emulated["weights"], plain["weights"]) == 0.0
        assert 0 < rank["report"]["optimizer_state_bytes"] < replicated["optimizer_state_bytes"]
        # Every block's home is in the one shared region: on the CPU, all the host bytes the engine holds.
        assert rank["report"]["shared_host_bytes"] == rank["report"]["host_bytes"] == replicated["host_bytes"]
        # The region is one file both ranks map, unlinked once both had it: nothing left in /dev/shm.
        ((path, inode, nbytes),) = rank["shared_maps"]
        assert path.startswith("/dev/shm/superpipe-") and path.endswith("(deleted)")
        assert nbytes == rank["report"]["shared_host_bytes"]
        assert rank["leftover_shm"] == []
    assert ranks[0]["shared_maps"] == ranks[1]["shared_maps"]  # the same file (path and inode) on both ranks
    assert sum(rank["report"]["optimizer_state_bytes"] for rank in ranks) == replicated["optimizer_state_bytes"]
    # Under bf16-mixed the homes' bf16 transfer copies are in the shared region too, written by each block's owner.
    for plain, sharded, shared in zip(_load(exact_run, "ddp"), _load(exact_run, "sharded_bf16"),
                                      _load(exact_run, "node_bf16")):
        assert shared["losses"] == sharded["losses"]
        assert _max_difference(shared["weights"], sharded["weights"]) == 0.0
        assert _max_difference(shared["weights"], plain["weights"]) > 0  # bf16 compute indeed
        assert shared["report"]["shared_host_bytes"] == sharded["report"]["host_bytes"] > replicated["host_bytes"]


def test_the_default_on_two_ranks_is_one_copy_per_node_and_equals_plain_ddp(exact_run: Path) -> None:
    """``SuperpipeStrategy()`` on two devices: ``shard_optimizer="auto"`` is ``"node"`` (nothing said), bit for bit
    plain DDP, with a node's host bytes those of ``shard_optimizer="node"``."""
    ranks = _load(exact_run, "default")
    for plain, rank in zip(_load(exact_run, "ddp"), ranks):
        assert rank["node"] and rank["said"] == []
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    assert _node_bytes(ranks) == _node_bytes(_load(exact_run, "node"))


def test_the_default_falls_back_where_one_copy_per_node_is_refused_and_says_why(
    disk_run: Path, disagree_run: Path
) -> None:
    """Where ``"node"`` is refused, ``"auto"`` takes the most sharing the run allows, in one info line on rank 0: per
    rank sharding with a weight-averaging callback, none with the disk tier (``16-mixed``, which Lightning makes
    ``bf16-mixed`` on the CPU, in tests/test_strategy_errors.py)."""
    said = "SuperpipeStrategy(shard_optimizer='auto') is {} here, not 'node': {}"
    cases = [
        (disagree_run, "ema_default", said.format(True, "the callback EMAWeightAveraging writes the averaged weights")),
        (disk_run, "disk", said.format(False, "the disk tier keeps each rank's copy of the training state")),
    ]
    for out, name, line in cases:
        zero, one = _load(out, name)
        assert len(zero["said"]) == 1 and zero["said"][0].startswith(line), (name, zero["said"])
        assert one["said"] == [] and not zero["node"] and not one["node"]  # rank 0 says it; neither shares the homes
    assert (disagree_run / "ema_default_rank0.txt").read_text() == "no error"
    shares = [rank["report"]["optimizer_state_bytes"] for rank in _load(disagree_run, "ema_default")]
    assert all(0 < share < sum(shares) for share in shares)  # shard_optimizer=True: each rank steps its share


def test_shard_optimizer_node_on_two_nodes_steps_each_nodes_copy_alike_and_equals_plain_ddp(nodes_run: Path) -> None:
    ranks = _load(nodes_run, "node")
    for plain, rank in zip(_load(nodes_run, "ddp"), ranks):
        assert rank["sampler"] == "DistributedSampler" and rank["steps"] == plain["steps"] == 6
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    # Each node its own shared copy (one rank per node here), stepped alike from the all-reduced gradients.
    assert all(len(rank["shared_maps"]) == 1 for rank in ranks)
    assert ranks[0]["shared_maps"][0][0] != ranks[1]["shared_maps"][0][0]
    # The node's one rank owns every block, and holds the whole optimizer state.
    assert ranks[0]["report"]["optimizer_state_bytes"] == ranks[1]["report"]["optimizer_state_bytes"]
    # The checkpoint holds the whole optimizer state, as plain DDP's does, bit for bit.
    plain, node = (torch.load(nodes_run / name / "last.ckpt", weights_only=False)["optimizer_states"][0]
                   for name in ("ddp", "node"))
    assert list(node["state"]) == list(plain["state"]) and node["param_groups"] == plain["param_groups"]
    for index, state in plain["state"].items():
        assert all(torch.equal(state[key], node["state"][index][key]) for key in state)
    # The disk tier on two nodes: each rank's files apart (here in one folder both nodes see), equal to DDP.
    for plain, rank in zip(_load(nodes_run, "ddp"), _load(nodes_run, "disk")):
        assert rank["losses"] == plain["losses"]
        assert _max_difference(rank["weights"], plain["weights"]) == 0.0
    assert sorted(p.name for p in (nodes_run / "tier").iterdir()) == ["rank-0", "rank-1"]
    assert len(list((nodes_run / "disk" / "last.ckpt.disk-tier").iterdir())) == 1


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


def test_with_shard_optimizer_node_a_failure_before_or_while_sharing_is_one_error_on_every_rank(
    disagree_run: Path,
) -> None:
    # Rank 1 fails before the homes; rank 0, already waiting to share them with it, hears of it and stops too.
    assert (disagree_run / "node_host_rank1.txt").read_text().startswith("HostMemoryError: SuperpipeStrategy needs")
    message = (disagree_run / "node_host_rank0.txt").read_text()
    assert message.startswith("RanksDisagreeError: SuperpipeStrategy could not start streaming on rank 1:")
    # Rank 0's /dev/shm cannot hold the node's copy: the bytes needed and free, on rank 0, and named on rank 1.
    mine = (disagree_run / "shm_rank0.txt").read_text()
    call = "`SuperpipeStrategy(shard_optimizer='node')` on devices=2, num_nodes=1"
    assert mine.startswith(f"HostMemoryError: {call} needs 120 KiB (122880 bytes) of /dev/shm for the node's shared")
    assert "but only 4 KiB (4096 bytes) is free" in mine
    theirs = (disagree_run / "shm_rank1.txt").read_text()
    assert theirs == f"RanksDisagreeError: SuperpipeStrategy could not share the blocks' host memory on rank 0: {mine}"


def test_a_disk_too_small_for_the_nodes_copies_of_the_disk_tier_is_one_error_on_every_rank(
    disagree_run: Path,
) -> None:
    # Rank 1's disk is checked for both ranks' copies before either writes; rank 0 waits there and hears of it.
    mine = (disagree_run / "disk_space_rank1.txt").read_text()
    assert mine.startswith("MisconfigurationException: SuperpipeStrategy(offload_device='disk'")
    assert "bytes: 2 ranks on this node, each with two slots of every block's record and its gradients)" in mine
    assert "but only 16 MiB (16781312 bytes) are free there" in mine and "/rank-1'" in mine
    theirs = (disagree_run / "disk_space_rank0.txt").read_text()
    assert theirs == f"RanksDisagreeError: SuperpipeStrategy could not check the disk tier's folders on rank 1: {mine}"


def test_init_calls_that_differ_between_ranks_under_the_disk_tier_are_one_error_on_every_rank(
    disagree_run: Path,
) -> None:
    # The ranks replay their deferred init calls with rank 0's draws: only if they made the same calls.
    mine = (disagree_run / "disk_init_rank1.txt").read_text()
    assert mine == (
        "RanksDisagreeError: configure_model made other init calls on rank 1 than on rank 0 (call 6: ('uniform_',"
        " (64, 32)) here, ('normal_', (64, 32)) there): every rank must build the same model in the same order."
    )
    theirs = (disagree_run / "disk_init_rank0.txt").read_text()
    assert theirs == ("RanksDisagreeError: SuperpipeStrategy could not initialize the model built in configure_model"
                      f" on rank 1: {mine}")


def test_what_several_devices_do_not_support_yet_is_refused_on_every_rank(disagree_run: Path) -> None:
    for rank in (0, 1):
        message = (disagree_run / f"disk_rank{rank}.txt").read_text()
        assert message.startswith("MisconfigurationException: SuperpipeStrategy(offload_device='disk'")
        assert "so shard_optimizer=True does not apply: leave it False, or use offload_device='cpu'" in message
        message = (disagree_run / f"batchnorm_rank{rank}.txt").read_text()
        assert "`Trainer(strategy='superpipe', sync_batchnorm=True)` is not supported yet" in message
        message = (disagree_run / f"ema_rank{rank}.txt").read_text()
        assert "shard_optimizer='node')` does not support the callback EMAWeightAveraging" in message


def test_shard_optimizer_is_checked_and_changes_nothing_on_one_device() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    message = r"SuperpipeStrategy\(shard_optimizer='yes'\) must be True, False or 'node'"
    with pytest.raises(MisconfigurationException, match=message):
        tasks.trainer(SuperpipeStrategy(shard_optimizer="yes"), max_steps=1).fit(
            tasks.build_task("sequential"), batches.data("vector")
        )
    plain = tasks.fit("sequential", SuperpipeStrategy(), max_steps=4)
    for value in (True, "node"):
        sharded = tasks.fit("sequential", SuperpipeStrategy(shard_optimizer=value), max_steps=4)
        assert sharded.losses == plain.losses
        assert tasks.max_relative_difference(sharded, plain) == 0.0


class _FakeNode:
    """A node's ranks for one process (:class:`~lightning_superpipe.memory.pinned.NodeRanks`): every agreement is
    this rank's alone; ``on_agree`` runs at each (the test plays the other rank there)."""

    call = "`SuperpipeStrategy(shard_optimizer='node')`"

    def __init__(self, local_rank: int, path: Any = None, on_agree: Any = None) -> None:
        self.local_rank, self.path, self.on_agree, self.agreements = local_rank, path, on_agree, 0

    def agree(self, error: Any, payload: Any = None) -> list[Any]:
        self.agreements += 1
        if self.on_agree is not None:
            self.on_agree(self.agreements, payload)
        if error is not None:
            raise error
        return [payload if self.local_rank == 0 else self.path]


def test_a_shared_arena_gives_both_ranks_one_copy_written_by_local_rank_zero_and_unlinks_its_file() -> None:
    import os
    from contextlib import ExitStack

    from lightning_superpipe.memory import host, pinned

    def block(seed: int) -> list[torch.nn.Parameter]:
        torch.manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(70))]

    written, other = block(0), block(1)  # the reader's own values differ: it must not write them
    reader_arena, writer_arena = pinned.HostArena(pin=False), pinned.HostArena(pin=False)
    nbytes = host.home_bytes(written, torch.float32)
    seen: dict[str, Any] = {}
    with ExitStack() as reader:
        def play_reader(step: int, payload: Any) -> None:
            if step == 1:  # the file exists now: the other rank maps it before local rank 0 unlinks it
                seen["path"] = payload
                reader.enter_context(reader_arena.shared(nbytes, _FakeNode(1, path=payload)))
                seen["existed"] = os.path.exists(payload)

        with writer_arena.shared(nbytes, _FakeNode(0, on_agree=play_reader)):
            assert not os.path.exists(seen["path"])  # unlinked once every rank mapped it
            assert writer_arena.writable and not reader_arena.writable  # only local rank 0 writes the region
            mine = host.BlockHome(written, torch.float32, writer_arena)
        theirs = host.BlockHome(other, torch.float32, reader_arena)
    assert seen["existed"]
    assert reader_arena.shared_bytes == writer_arena.shared_bytes == nbytes == writer_arena.allocated_bytes
    assert all(torch.equal(a, b) for a, b in zip(other, written))  # the reader's parameters show rank 0's values
    with torch.no_grad():
        written[1].add_(1.0)  # a step of the owner, seen by the other rank without a copy
    assert torch.equal(other[1], written[1]) and torch.equal(theirs.master, mine.master)
    assert writer_arena.writable and reader_arena.writable  # outside the region each process writes its own again
    with pytest.raises(host.HostMemoryError, match=r"needs 4 KiB \(4096 bytes\) of /dev/shm .* only 0 B \(0 bytes\)"):
        original = pinned.shared_space
        pinned.shared_space = lambda: 0
        try:
            with pinned.HostArena(pin=False).shared(10, _FakeNode(0)):
                pass
        finally:
            pinned.shared_space = original


def test_a_checkpoint_of_two_ranks_loads_on_one_device_as_plain_lightning_loads_it(
    exact_run: Path, tmp_path: Path
) -> None:
    """The one ``.ckpt`` rank 0 wrote for two ranks is a plain Lightning checkpoint: on one device (in this process)
    the strategy resumes from it exactly as plain single-device Lightning does, weights, optimizer state and RNG."""
    from lightning.pytorch import Callback

    from lightning_superpipe.rng import set_rng_states
    from tests import ddp_script

    class RestoreRng(Callback):  # what the strategy restores from the .ckpt, where it does; plain Lightning does not
        def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            set_rng_states(checkpoint["superpipe_rng_states"])

    checkpoint = torch.load(exact_run / "last.ckpt", weights_only=False)
    epochs = dict(devices=1, max_epochs=2, max_steps=-1, limit_train_batches=8, ckpt_path=exact_run / "last.ckpt")
    ddp_script.fit("plain", tmp_path, "auto", callbacks=(RestoreRng(),), **epochs)
    ddp_script.fit("streamed", tmp_path, SuperpipeStrategy(), **epochs)
    plain, streamed = (torch.load(tmp_path / f"{name}_rank0.pt", weights_only=False) for name in ("plain", "streamed"))
    assert streamed["steps"] == plain["steps"] == checkpoint["global_step"] + 4  # 8 micro-batches, accumulation 2
    assert len(streamed["losses"]) == 8 and streamed["losses"] == plain["losses"]
    assert _max_difference(streamed["weights"], plain["weights"]) == 0.0
