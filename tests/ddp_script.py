"""Runs on two CPU processes (gloo) for tests/test_strategy_ddp.py: ``python tests/ddp_script.py MODE OUT_DIR``
(``MODE`` may join modes with ``+``: they run one after the other in the same processes).

Lightning's subprocess launcher starts this script again for rank 1 at the first ``fit``; both processes then run
every fit below in the same process group. Each rank saves what it saw to ``OUT_DIR/<name>_rank<r>.pt``.

Modes:
    ``exact``: ``strategy="ddp"`` and ``"superpipe"`` on the same seed (AdamW in two groups with a schedule, clipping by
    norm, accumulation 2, dropout), with a ``sync_dist`` metric, also on the emulated asynchronous link; the
    overlapped optimizer step (no clipping) against DDP; then a run checkpointed after one epoch and resumed; then the
    same with ``shard_optimizer=True`` and with ``shard_optimizer="node"`` (the blocks' homes shared by both ranks),
    also under ``bf16-mixed`` against ``shard_optimizer=True``; the default (``shard_optimizer="auto"``, which is
    ``"node"`` here) against DDP. The runs of the replicated state name ``shard_optimizer=False``.
    ``node``: only the ``shard_optimizer="node"`` runs (with ``ddp`` to compare against).
    ``nodes``: two nodes of one device each (this script started once per node, with ``NODE_RANK``): ``"ddp"``,
    ``shard_optimizer="node"`` (each node's copy stepped by its own rank, from the gradients all-reduced across
    nodes) and the disk tier, each checkpointed at the end.
    ``disk``: the disk tier (see :func:`disk`).
    ``modes``: the optimizer step's modes with the replicated optimizer (see :func:`modes`).
    ``disagree``: rank 1 gets other knobs than rank 0 (both must fail with one clear error); rank 1's host memory is
    too small (its own error there, one naming rank 1 on rank 0), also with ``shard_optimizer="node"``, and rank 0's
    ``/dev/shm`` too small for the node's shared homes; rank 1's disk too small for the node's copies of the disk
    tier; rank 1's ``configure_model`` making other init calls than rank 0's under the disk tier; the disk tier with
    ``shard_optimizer=True`` and ``sync_batchnorm`` on two devices (refused on both); the default with a
    weight-averaging callback (``shard_optimizer=True`` then, said in an info line).

Each run also saves what the strategy said about ``shard_optimizer`` (``said``: rank 0's info lines).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint  # noqa: E402

import lightning_superpipe  # noqa: E402, F401
from lightning_superpipe import EmulatedLink, SuperpipeStrategy  # noqa: E402
from lightning_superpipe.memory.host import rss_bytes  # noqa: E402
from tests import batches, tasks  # noqa: E402

TIMEOUT = timedelta(seconds=60)  # a collective that waits longer fails instead of hanging the test


class SyncedTask(tasks.Task):
    """The tests' task on a tiny Llama with dropout, logging a rank-dependent value with ``sync_dist``."""

    def __init__(self) -> None:
        super().__init__(tasks.llama, "lm")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("synced_rank", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
        self.log("synced_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss


class ConfiguredTask(SyncedTask):
    """Builds its model in ``configure_model`` under a seed of each rank's own: the ranks start from rank 0's values
    only if the strategy gives them (DDP broadcasts them when it wraps the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(100 + self.global_rank)
            self.model = tasks.llama()


class DisagreeingTask(ConfiguredTask):
    """Rank 1 initializes one weight in another way: the same parameters, other init calls."""

    def configure_model(self) -> None:
        super().configure_model()
        if self.global_rank == 1:
            torch.nn.init.uniform_(self.model.model.layers[0].mlp.up_proj.weight)


class ManualTask(SyncedTask):
    """Manual optimization: two backwards a batch (each reduced across ranks, as under DDP), clipping by norm
    through ``self.clip_gradients``, the LR schedule stepped by hand, ``zero_grad`` after the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        tasks.two_backwards_and_a_step(self, batch)


class Record(Callback):
    """Keeps the strategy's memory report and its all-reduce count, read before teardown closes the engine."""

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}
        self.reductions = -1
        self.trunk_params = -1
        self.slot_references: list[int] = []
        self.shared_maps: list[tuple[str, int, int]] = []
        self.leftover_shm: list[str] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, SuperpipeStrategy):
            self.report = strategy.memory_report()
            self.report.update({f"steps_{m}": n for m, n in self.report.get("optimizer_step_modes", {}).items()})
            averager = strategy.engine.gradients.averager  # None on one device
            self.reductions = averager.reductions if averager is not None else 0
            self.trunk_params = len(strategy.engine.trunk_parameters())
            self.slot_references = tasks.extra_slot_references(strategy.engine)
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.report["grad_bytes"] = sum(g.numel() * g.element_size() for g in grads)
            self.shared_maps = shared_mappings()
            self.leftover_shm = sorted(name for name in os.listdir("/dev/shm") if name.startswith("superpipe-"))


def shared_mappings() -> list[tuple[str, int, int]]:
    """This process's mappings of the node's shared homes: (path as the kernel shows it, inode, bytes)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "/superpipe-" in fields[5]:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                found.append((fields[5].strip(), int(fields[4]), end - start))
    return found


class Said(logging.Handler):
    """Keeps what Lightning's loggers (rank_zero_info among them) said about ``shard_optimizer``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "shard_optimizer" in record.getMessage():
            self.lines.append(record.getMessage())


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def fit(
    name: str, out: Path, strategy: Any, ckpt_path: Any = None, callbacks: tuple[Callback, ...] = (),
    task_class: type[SyncedTask] = SyncedTask, validate: bool = False, **options: Any,
) -> None:
    pl.seed_everything(7, verbose=False)
    task = task_class()
    pl.seed_everything(8, verbose=False)
    record = Record()
    options.setdefault("devices", 2)
    trainer = tasks.trainer(strategy, callbacks=[record, *callbacks], **options)
    val = batches.data("lm", batches=4, seed=1) if validate else None
    said = Said()
    logging.getLogger("lightning.pytorch").addHandler(said)
    try:
        trainer.fit(task, batches.data("lm"), val, ckpt_path=ckpt_path)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(said)
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    rss, peak_rss = rss_bytes()
    torch.save(
        {
            "losses": task.losses,
            "val_losses": task.val_losses,
            "weights": {key: value.detach().clone() for key, value in task.state_dict().items()},
            "metrics": metrics,
            "report": {k: v for k, v in record.report.items() if isinstance(v, (int, float))},
            "reductions": record.reductions,
            "trunk_params": record.trunk_params,
            "slot_references": record.slot_references,
            "shared_maps": record.shared_maps,
            "leftover_shm": record.leftover_shm,
            "steps": trainer.global_step,
            "rss": rss,
            "peak_rss": peak_rss,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
            "said": said.lines,
            "node": isinstance(strategy, SuperpipeStrategy) and strategy.node is not None,
        },
        out / f"{name}_rank{trainer.global_rank}.pt",
    )


def exact(out: Path) -> None:
    fit("ddp", out, "ddp", max_steps=6)
    fit("superpipe", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_steps=6)
    fit("sharded", out, SuperpipeStrategy(shard_optimizer=True, timeout=TIMEOUT), max_steps=6)
    # The CUDA code paths (staging, the gradient worker, events) on deferred copies, with the ordering checker.
    fit("emulated", out, SuperpipeStrategy(link=EmulatedLink(mode="thread", seed=1), shard_optimizer=False,
                                           timeout=TIMEOUT), max_steps=6)
    # The overlapped optimizer step (blocks stepped during backward, as soon as their averaged gradients are in).
    fit("ddp_unclipped", out, "ddp", max_steps=4, gradient_clip_val=None)
    fit("overlapped", out, SuperpipeStrategy(overlap_optimizer=True, shard_optimizer=False, timeout=TIMEOUT),
        max_steps=4, gradient_clip_val=None)
    epochs = dict(max_steps=-1, limit_train_batches=8)
    fit("uninterrupted", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_epochs=2, **epochs)
    checkpoint = ModelCheckpoint(dirpath=out, save_last=True)
    fit("first", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_epochs=1,
        enable_checkpointing=True, callbacks=(checkpoint,), **epochs)
    fit("resumed", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_epochs=2,
        ckpt_path=out / "last.ckpt", **epochs)
    # The same with each rank keeping its share of the optimizer state: one .ckpt with all of it, resumed.
    sharded = out / "sharded"
    checkpoint = ModelCheckpoint(dirpath=sharded, save_last=True)
    fit("sharded_first", out, SuperpipeStrategy(shard_optimizer=True, timeout=TIMEOUT), max_epochs=1,
        enable_checkpointing=True, callbacks=(checkpoint,), **epochs)
    fit("sharded_resumed", out, SuperpipeStrategy(shard_optimizer=True, timeout=TIMEOUT), max_epochs=2,
        ckpt_path=sharded / "last.ckpt", **epochs)
    node(out, ddp=False)
    # The default: shard_optimizer="auto", one copy of the blocks per node here. Last: a finished run's model keeps
    # its parameters in its mapping of the shared homes until it is collected, and the "node" run counts mappings.
    fit("default", out, SuperpipeStrategy(timeout=TIMEOUT), max_steps=6)


def node(out: Path, ddp: bool = True) -> None:
    """``shard_optimizer="node"``: against DDP (the ``exact`` mode ran that already), then checkpointed and resumed
    against the uninterrupted run of ``exact`` (or of its own here)."""
    if ddp:
        fit("ddp", out, "ddp", max_steps=6)
    fit("node", out, SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT), max_steps=6)
    # The CUDA code paths (staging, the gradient worker) reading the shared homes.
    fit("node_emulated", out, SuperpipeStrategy(shard_optimizer="node", link=EmulatedLink(mode="thread", seed=1),
                                                timeout=TIMEOUT), max_steps=6)
    # Mixed precision: the homes' bf16 transfer copies are shared too (written by each block's owner after its step).
    for name, value in (("sharded_bf16", True), ("node_bf16", "node")):
        fit(name, out, SuperpipeStrategy(shard_optimizer=value, timeout=TIMEOUT), max_steps=6, precision="bf16-mixed")
    epochs = dict(max_steps=-1, limit_train_batches=8)
    if ddp:
        fit("uninterrupted", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_epochs=2, **epochs)
    folder = out / "node"
    checkpoint = ModelCheckpoint(dirpath=folder, save_last=True)
    fit("node_first", out, SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT), max_epochs=1,
        enable_checkpointing=True, callbacks=(checkpoint,), **epochs)
    fit("node_resumed", out, SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT), max_epochs=2,
        ckpt_path=folder / "last.ckpt", **epochs)


def nodes(out: Path) -> None:
    """Two nodes of one rank each: ``strategy="ddp"`` and ``shard_optimizer="node"``, each checkpointed at the end."""
    two = dict(devices=1, num_nodes=2, enable_checkpointing=True)
    (out / "tier").mkdir(exist_ok=True)  # both "nodes" see one folder here: the ranks' files apart by global rank
    for name, strategy in (
        ("ddp", "ddp"), ("node", SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT)),
        ("disk", SuperpipeStrategy(offload_device="disk", offload_path=out / "tier", timeout=TIMEOUT)),
    ):
        fit(name, out, strategy, max_steps=6, callbacks=(ModelCheckpoint(dirpath=out / name, save_last=True),), **two)


def disk(out: Path) -> None:
    """The disk tier on two ranks (each rank's files in a folder of its own under ``offload_path``) against DDP: with
    clipping by norm and accumulation 2 (the earlier micro-batch's gradients spilled, read back into the last one's
    reduction), also on the emulated link; the overlapped step; ``bf16-mixed`` and ``16-mixed``; validation between
    steps, and alone; manual optimization; a model built in ``configure_model``; checkpointed (rank 0's files beside
    the ``.ckpt``) and resumed by both ranks."""
    tier = out / "tier"
    tier.mkdir(exist_ok=True)

    def on_disk(**knobs: Any) -> SuperpipeStrategy:
        return SuperpipeStrategy(offload_device="disk", offload_path=tier, timeout=TIMEOUT, **knobs)

    fit("ddp", out, "ddp", max_steps=6)
    fit("disk", out, on_disk(), max_steps=6)
    fit("disk_emulated", out, on_disk(link=EmulatedLink(mode="thread", seed=1)), max_steps=6)
    fit("ddp_unclipped", out, "ddp", max_steps=4, gradient_clip_val=None)
    fit("disk_overlapped", out, on_disk(overlap_optimizer=True), max_steps=4, gradient_clip_val=None)
    # Mixed precision (the masters cast on the fly) against the host tier, and validation between the steps.
    fit("superpipe_bf16", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_steps=4,
        precision="bf16-mixed")
    fit("disk_bf16", out, on_disk(), max_steps=4, precision="bf16-mixed")
    validating = dict(max_steps=4, limit_val_batches=2, val_check_interval=2, validate=True)
    fit("ddp_validated", out, "ddp", **validating)
    fit("disk_validated", out, on_disk(), **validating)
    # 16-mixed: the gradient scaler's checks cover the spilled blocks on every rank alike.
    fit("superpipe_16", out, SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT), max_steps=4,
        precision="16-mixed")
    fit("disk_16", out, on_disk(), max_steps=4, precision="16-mixed")
    # Evaluation alone (no optimizer: the tier's records hold masters only).
    for name, strategy in (("ddp_validate", "ddp"), ("disk_validate", on_disk())):
        pl.seed_everything(7, verbose=False)
        task = SyncedTask()
        trainer = tasks.trainer(strategy, devices=2, limit_val_batches=4)
        trainer.validate(task, batches.data("lm", batches=8, seed=1), verbose=False)
        torch.save({"val_losses": task.val_losses}, out / f"{name}_rank{trainer.global_rank}.pt")
    manual = dict(max_steps=4, accumulate_grad_batches=1, gradient_clip_val=None, task_class=ManualTask)
    fit("ddp_manual", out, "ddp", **manual)
    fit("disk_manual", out, on_disk(), **manual)
    fit("ddp_configured", out, "ddp", max_steps=4, task_class=ConfiguredTask)
    with tasks.fresh_initial_values() as fresh:
        fit("disk_configured", out, on_disk(), max_steps=4, task_class=ConfiguredTask)
    torch.save(fresh, out / f"disk_configured_fresh_rank{rank()}.pt")
    epochs = dict(max_steps=-1, limit_train_batches=8)
    fit("uninterrupted", out, on_disk(), max_epochs=2, **epochs)
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)
    fit("disk_first", out, on_disk(), max_epochs=1, enable_checkpointing=True, callbacks=(checkpoint,), **epochs)
    fit("disk_resumed", out, on_disk(), max_epochs=2, ckpt_path=out / "checkpoints" / "last.ckpt", **epochs)


def modes(out: Path) -> None:
    """Clipping by norm (which fires on every step here) and accumulation 2 with the replicated optimizer: the step
    after backward, speculative during it (each rank redoes every step from the same averaged gradients), and
    pipelined into the next forward."""
    for name, knob in (("serial", False), ("speculative", "speculative"), ("pipelined", "pipelined")):
        fit(name, out, SuperpipeStrategy(overlap_optimizer=knob, shard_optimizer=False, timeout=TIMEOUT), max_steps=4)


def disagree(out: Path) -> None:
    from lightning_superpipe import host_memory
    from lightning_superpipe.memory import pinned
    from lightning_superpipe.memory.disk import space

    (out / "tier").mkdir(exist_ok=True)
    attempts = {
        "knobs": SuperpipeStrategy(prefetch=1 + rank(), timeout=TIMEOUT),
        "host": SuperpipeStrategy(shard_optimizer=False, timeout=TIMEOUT),  # rank 1's host is too small
        "node_host": SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT),  # the same, rank 0 goes on to share
        "shm": SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT),  # rank 0's /dev/shm is too small
        "disk": SuperpipeStrategy(offload_device="disk", offload_path=out / "tier", shard_optimizer=True,
                                  timeout=TIMEOUT),
        "disk_space": SuperpipeStrategy(offload_device="disk", offload_path=out / "tier", timeout=TIMEOUT),
        "disk_init": SuperpipeStrategy(offload_device="disk", offload_path=out / "tier", timeout=TIMEOUT),
        "batchnorm": SuperpipeStrategy(timeout=TIMEOUT),
        "ema": SuperpipeStrategy(shard_optimizer="node", timeout=TIMEOUT),
        "ema_default": SuperpipeStrategy(timeout=TIMEOUT),  # True instead of "node", and an info line says why
    }
    available, shared_space, free_bytes = host_memory.available_host_bytes, pinned.shared_space, space.free_bytes
    for name, strategy in attempts.items():
        host_memory.available_host_bytes = (
            (lambda: 1024) if name in ("host", "node_host") and rank() == 1 else available
        )
        pinned.shared_space = (lambda: 4096) if name == "shm" and rank() == 0 else shared_space
        # Rank 1's disk has the margin the tier keeps free and one page: not the node's two copies of the tier.
        space.free_bytes = (lambda path: (16 << 20) + 4096) if name == "disk_space" and rank() == 1 else free_bytes
        try:
            callbacks = (EMAWeightAveraging(),) if name in ("ema", "ema_default") else ()
            task_class = DisagreeingTask if name == "disk_init" else SyncedTask
            fit(name, out, strategy, max_steps=2, sync_batchnorm=name == "batchnorm", callbacks=callbacks,
                task_class=task_class)
        except Exception as error:  # noqa: BLE001 - what each rank saw is the test's evidence
            (out / f"{name}_rank{rank()}.txt").write_text(f"{type(error).__name__}: {error}")
        else:
            (out / f"{name}_rank{rank()}.txt").write_text("no error")


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    try:
        for part in mode.split("+"):  # "exact+modes": one mode after the other, in the same processes
            {"exact": exact, "disagree": disagree, "node": node, "nodes": nodes, "disk": disk, "modes": modes}[part](
                folder
            )
    except BaseException:
        traceback.print_exc()
        raise
    # Both ranks leave the process group together, not each in its own exit handler while the other still talks.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
