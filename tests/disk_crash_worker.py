"""A ``Trainer.fit`` under ``SuperpipeStrategy(offload_device="disk")`` that kills itself with ``SIGKILL`` at a chosen
point, run in a subprocess by ``tests/test_disk_crash.py`` (not a test module: pytest does not collect it).

Usage: ``python -m tests.disk_crash_worker CONFIG_JSON``, where the config holds:

* ``tier``, ``checkpoints``: the offload_path and the ``ModelCheckpoint`` folder (every 2 steps, ``save_last``);
  clipping by norm is on, so every block's gradients are spilled to disk and the blocks stepped from there;
* ``losses``: a file each micro-batch's loss is appended to as ``global_step batch_idx repr(loss)``, written
  unbuffered, so that what a killed run logged is on disk;
* ``kill``: ``None`` (run to the end) or ``[point, step]``, one of the points below, reached at that step;
* ``resume``: a ``.ckpt`` to ``fit(ckpt_path=...)`` from, or ``None``;
* ``weights``: where to ``torch.save`` the model's state dict after an uninterrupted fit (``None``: not saved);
* ``mutate``: ``"shared-inode"`` disables the store's unlinking of a hard-linked file before it is rewritten
  (the seeded bug: later steps then write into a checkpoint's copy), else ``None``;
* ``host_buffer_bytes``, ``slice_elements``: a pool bound (``None``: the default) and the slice of a parameter a
  piece holds (``None``: the default), for a tier that steps its blocks in pieces.

Kill points (the hook wraps the store's module-level file functions, in this process only; the package has no
test-only code path):

* ``"step-write"``: half-way through writing the second block record of optimizer step ``step``;
* ``"after-commit"``: right after the live manifest of step ``step`` is committed, before any checkpoint of it;
* ``"mid-snapshot"``: between the first and the second hard link of ``last.ckpt``'s copy of step ``step``;
* ``"before-ckpt"``: after ``last.ckpt``'s copy of step ``step`` is committed, before the ``.ckpt`` is written;
* ``"mid-prune"``: after ``last.ckpt`` of step ``step`` is written, half-way through removing its older copy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

KILL_POINTS = ("step-write", "after-commit", "mid-snapshot", "before-ckpt", "mid-prune")
#: Each epoch ends on a checkpoint step: Lightning resumes a plain DataLoader exactly only from an epoch's last batch.
MICRO_BATCHES_PER_EPOCH = 2
#: No accumulation: a resumed run's ModelCheckpoint would save again after the first micro-batch (it does not restore
#: the step it last saved at), a checkpoint half-way through an accumulation, which Lightning cannot resume exactly.
ACCUMULATE = 1
MAX_STEPS = 8


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str, step: int, tier: Path, mutate: str | None) -> None:
    """Wraps the disk tier's file functions (:mod:`lightning_superpipe.memory.disk.folder`, ``.file_io``) so that
    the process kills itself at ``point`` of step ``step``; with ``mutate="shared-inode"``, also seeds the
    shared-inode bug."""
    from lightning_superpipe.memory.disk import file_io
    from lightning_superpipe.memory.disk import folder as disk_folder

    live = tier.resolve()
    committed = {"step": -1}  # the live folder's last committed step
    links = {"count": 0}
    real_commit, real_write_chunk, real_link = disk_folder._commit, file_io._write_chunk, disk_folder._link_or_copy
    real_rmtree = shutil.rmtree

    def in_last(path: Path) -> bool:
        return any(part == "last.ckpt.disk-tier" for part in Path(path).parts)

    def commit(folder: Path, manifest: Any) -> None:
        real_commit(folder, manifest)
        if Path(folder).resolve() == live:
            committed["step"] = int(manifest["step"])
            if point == "after-commit" and committed["step"] == step:
                _die()
        elif point == "before-ckpt" and in_last(folder) and int(manifest["step"]) == step:
            _die()

    def write_chunk(fd: int, view: memoryview, offset: int, path: Path) -> None:
        if (point == "step-write" and Path(path).name.startswith("block00001") and Path(path).parent.resolve() == live
                and committed["step"] == step - 1):
            real_write_chunk(fd, view[: len(view) // 2], offset, path)
            _die()
        real_write_chunk(fd, view, offset, path)

    def link_or_copy(source: Path, target: Path) -> None:
        real_link(source, target)
        if point == "mid-snapshot" and in_last(target) and committed["step"] == step:
            links["count"] += 1
            if links["count"] == 1:
                _die()

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if point == "mid-prune" and in_last(Path(path)) and committed["step"] == step:
            (Path(path) / "manifest.json").unlink(missing_ok=True)
            _die()
        real_rmtree(path, *args, **kwargs)

    disk_folder._commit, file_io._write_chunk, disk_folder._link_or_copy = commit, write_chunk, link_or_copy
    shutil.rmtree = rmtree
    if mutate == "shared-inode":
        real_stat = os.stat

        class _OneLink:
            st_nlink = 1

        def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_name
            return _OneLink() if caller == "_unlink_unless_ours" else real_stat(path, *args, **kwargs)

        os.stat = stat  # type: ignore[assignment]  # only the check before a file is rewritten sees one link


def main(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_superpipe import SuperpipeStrategy
    from tests import batches, tasks

    if config.get("slice_elements"):
        from lightning_superpipe.memory.disk import pieces

        pieces.SLICE_ELEMENTS = int(config["slice_elements"])
    tier, checkpoints = Path(config["tier"]), Path(config["checkpoints"])
    tier.mkdir(parents=True, exist_ok=True)
    if config.get("kill") or config.get("mutate"):
        point, step = config.get("kill") or ("none", -1)
        install_kill(point, int(step), tier, config.get("mutate"))
    log = os.open(config["losses"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    class Logged(tasks.Task):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            os.write(log, f"{self.trainer.global_step} {batch_idx} {loss.item()!r}\n".encode())
            return loss

    build, kind = tasks.EXAMPLES["llama"]
    # Other initial weights when resuming: everything must come from the checkpoint and its copy of the tier.
    tasks.pl.seed_everything(7 if config.get("resume") is None else 123, verbose=False)
    task = Logged(build, kind)
    tasks.pl.seed_everything(8, verbose=False)
    callback = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_last=True)
    trainer = tasks.trainer(
        SuperpipeStrategy(offload_device="disk", offload_path=tier, host_buffer_bytes=config.get("host_buffer_bytes")),
        max_steps=MAX_STEPS, max_epochs=-1,
        limit_train_batches=MICRO_BATCHES_PER_EPOCH, accumulate_grad_batches=ACCUMULATE, enable_checkpointing=True,
        callbacks=[callback],
    )
    trainer.fit(task, batches.data(kind), ckpt_path=config.get("resume"))
    if config.get("weights"):
        torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, config["weights"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
