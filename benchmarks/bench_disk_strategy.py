"""``Trainer.fit`` through ``SuperpipeStrategy(offload_device="disk")`` against the host tier and the raw disk, in one
run.

A Llama-style causal LM built from a ``transformers`` config (nothing downloaded: wide layers, a small vocabulary)
whose training state is at least 3 GB (fp32 masters, gradients and AdamW's two moments: 16 bytes per parameter) is
trained for a few steps with ``torch.optim.AdamW(fused=True)``, clipping by norm 1.0 (so the disk tier spills every
block's gradients and steps the blocks from disk after backward), three ways, each in a process of its own so that
each peak RSS is its own:

* ``host``: ``SuperpipeStrategy()`` (``offload_device="cpu"``: masters, gradients and moments in host memory);
* ``disk``: ``SuperpipeStrategy(offload_device="disk", offload_path=..., host_buffer_bytes=...)``, with a
  ``ModelCheckpoint`` at its last step;
* ``resumed``: that checkpoint resumed for two more steps by a model built the way Lightning builds one that a
  checkpoint will fill (``Trainer.init_module(empty_init=True)``: uninitialized memory, never touched, as the blocks
  come from the checkpoint's files), so that its peak RSS is the tier's, not the model's construction (4 bytes per
  parameter in the other two runs);
* ``configured``: a fresh disk-tier run whose model is built in ``configure_model``, where the strategy defers its
  init calls and runs each block's into fresh tensors as the block is written to its file (its losses must equal
  the ``disk`` run's, whose model is built eagerly under the same seed);
* ``loaded``: the same, then given the weights of a folder that ``save_pretrained`` wrote (the ``disk`` run's
  initial model) with ``load_safetensors``, each tensor read as its block is written (the same losses again);
* ``raw``: a sequential ``O_DIRECT`` write (``fsync``ed) and read of a file as large as a step's records, with one
  stream of 64 MiB requests and with four threads of 16 MiB requests, on the same disk (``bench_disk.run_raw``),
  and the read of one such file while another is written (two threads of 16 MiB requests each: the mix the tier's
  step makes), for what the disk gives reads and writes that share it; once before the training runs and once
  after, each figure the faster of the two (a shared virtual disk drifts within minutes).

After the ``disk`` run the trained model (its parameters mapped from the tier's files) is written for inference with
``lightning_superpipe.save_safetensors``: its peak RSS from then on (``VmHWM`` reset), against the host tier's
whole run, and its GB/s.

Reported: peak RSS (``VmHWM`` from ``/proc/self/status``) of each over the whole process, and over training alone
(``VmHWM`` reset through ``/proc/self/clear_refs`` when training starts: the model is built in host memory first,
4 bytes per parameter, in both runs), and their ratios, and the resumed run's whole-process peak against the host
tier's; step time of each (the steps after the first, which creates
the moments) and their ratio; the tier's read and write GB/s over the timed steps (bytes over the time a read, or a
write, was in flight) against the raw figures; the step's I/O against the raw disk (the time the raw disk would take
for the step's bytes, read and written one after the other, over the step's wall time); and, the fair measure of the
tier's I/O, its bytes over the time any of its I/O was in flight (the disk in use), against the raw disk moving the
same bytes (one kind after the other, and mixed). The per-kind figures undercount wherever reads and writes overlap:
both are in flight while they share one disk, so each gets part of it (here the raw disk read 1.2 GB/s and wrote
0.9 GB/s at once, against 2.0 and 2.3 GB/s alone). Also reported: where the tier's time went in a step
(``memory_report()["disk_seconds"]``: the disk busy, ``fsync``, waits for buffers, reads, and durable writes, the
step's arithmetic) and the time of its optimizer step after backward (``DiskTier.finish_step``, timed from outside).

Both training processes call :func:`~lightning_superpipe.memory.disk.limit_heap_retention` first, as the disk tier
does when it is built: without it glibc kept freed block-sized tensors in its heap and the host tier's steps took
12.4 s here instead of 4.7 s.

Usage:
    python benchmarks/bench_disk_strategy.py                                 # ~3.4 GB of state, files in /tmp
    python benchmarks/bench_disk_strategy.py --path /nvme/scratch --layers 48 --json results.json
    python benchmarks/bench_disk_strategy.py --fused-read --steps 6     # the step after backward vs pipelined
    python benchmarks/bench_disk_strategy.py --pieces --json pieces.json   # host_buffer_bytes 256 MiB, 1 GiB vs whole
    python benchmarks/bench_disk_strategy.py --trunk --vocab 32000 --layers 4 --hidden 512 --intermediate 1024
        # the trunk (embedding, untied head) in the tier's files vs in host memory
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_disk import GB, peak_rss_bytes, raw_rates, run_raw, step_io  # noqa: E402

#: Steps of the run resumed from the disk run's last checkpoint.
RESUMED_STEPS = 2

#: ``--overlap``: the strategy's ``overlap_optimizer`` for the disk runs.
OVERLAP_KNOBS: dict[str, Any] = {"auto": "auto", "serial": False, "pipelined": "pipelined"}


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq, tie_word_embeddings=False, attention_dropout=0.0,
    )


def count_params(args: argparse.Namespace) -> tuple[int, int]:
    """The model's parameters, and one decoder layer's (from the config on the meta device)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.layers[0].parameters())


def reset_peak_rss() -> bool:
    """Resets ``VmHWM`` to the current RSS (Linux 4.0+); whether it applied."""
    try:
        with open("/proc/self/clear_refs", "w") as out:
            out.write("5")
        return True
    except OSError:
        return False


class Probe(pl.Callback):
    """Per step: its time and loss, the disk tier's I/O intervals and clocks, and the time of its optimizer step
    after backward; the peak RSS before and while training."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.io: list[list[tuple[str, float, float, int]]] = []
        self.clock: list[dict[str, float]] = []
        self.finish_step_s: list[float] = []
        self._clock_began: dict[str, float] = {}
        self.rss_before_training = 0
        self.rss_training = 0
        self.cleared = False
        self.direct_io: Any = None
        self._began = 0.0
        self.starts: list[tuple[float, int, int]] = []  # each batch's start: time, bytes read, bytes written

    # Reads nothing in its hooks: the pipelined step is not waited for at each batch's end on its account.
    superpipe_reads_no_weights = True

    @staticmethod
    def _tier(trainer: pl.Trainer) -> Any:
        """The run's disk tier, or ``None`` on the host tier."""
        from lightning_superpipe.memory.disk.tier import DiskTier

        homes = trainer.strategy._engine.home_kind
        return homes if isinstance(homes, DiskTier) else None

    def _files(self, trainer: pl.Trainer) -> Any:
        tier = self._tier(trainer)  # the disk tier's writer keeps (kind, start, end, bytes) per file
        return None if tier is None else tier.store.files

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.rss_before_training = peak_rss_bytes()  # the model built, the tier set up
        self.cleared = reset_peak_rss()
        files = self._files(trainer)
        self.direct_io = None if files is None else files.direct
        tier = self._tier(trainer)
        if tier is not None:  # time the optimizer step after backward (the blocks stepped from disk)
            finish_step = tier.finish_step

            def timed(*args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter()
                try:
                    return finish_step(*args, **kwargs)
                finally:
                    self.finish_step_s.append(time.perf_counter() - began)

            tier.finish_step = timed

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # Before teardown, where the disk tier reads the masters back into the parameters (4 B per parameter).
        self.rss_training = peak_rss_bytes() if self.cleared else 0

    def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
        files = self._files(trainer)
        if files is not None:
            files.intervals = []
            store = trainer.strategy._engine.home_kind.store
            self._clock_began = store.io_seconds()
            self.starts.append((time.perf_counter(), store.bytes_read, store.bytes_written))
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *rest: Any) -> None:
        self.step_s.append(time.perf_counter() - self._began)
        self.losses.append(float(outputs["loss"]))
        files = self._files(trainer)
        if files is not None:
            self.io.append(list(files.intervals))
            now = trainer.strategy._engine.home_kind.store.io_seconds()
            self.clock.append({k: now[k] - self._clock_began[k] for k in now})


def run_fit(args: argparse.Namespace) -> dict[str, Any]:
    """One ``Trainer.fit`` through the strategy, ``args.role`` being ``"host"`` or ``"disk"``."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaForCausalLM

    from lightning_superpipe import SuperpipeStrategy, load_safetensors
    from lightning_superpipe.memory.host import rss_bytes

    rss_after_imports = rss_bytes()[0]  # torch, Lightning, transformers: what any run holds before its model
    configured = args.role in ("configured", "loaded")

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None if configured else LlamaForCausalLM(llama_config(args))

        def configure_model(self) -> None:  # configured, loaded: built here, under the strategy's deferred init
            if self.model is None:
                self.model = LlamaForCausalLM(llama_config(args))
                if args.role == "loaded":  # the weights the save role wrote, read as each block is written
                    load_safetensors(self.model, args.folder / "saved")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.01, fused=True)

    callbacks: list[pl.Callback] = [probe := Probe()]
    if args.role == "host":
        strategy = SuperpipeStrategy()
    else:
        (args.folder / "tier").mkdir(exist_ok=True)
        strategy = SuperpipeStrategy(offload_device="disk", offload_path=args.folder / "tier",
                                     host_buffer_bytes=args.host_buffer_bytes,
                                     overlap_optimizer=OVERLAP_KNOBS[args.overlap])
    if args.role == "disk":  # the last step's checkpoint, for the resumed run (its files hard-linked beside it)
        callbacks.append(ModelCheckpoint(dirpath=args.folder, filename="last", every_n_train_steps=args.steps))
    resumed = args.role == "resumed"
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps + (RESUMED_STEPS if resumed else 0),
        gradient_clip_val=1.0, logger=False, enable_checkpointing=args.role == "disk", enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    began = time.perf_counter()
    pl.seed_everything(0, verbose=False)
    # Resumed: built as Lightning builds a model that a checkpoint will fill (uninitialized, untouched memory).
    with trainer.init_module(empty_init=True) if resumed else contextlib.nullcontext():
        task = Task()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (trainer.max_steps * args.batch, args.seq), generator=generator)
    trainer.fit(task, DataLoader(TensorDataset(tokens), batch_size=args.batch),
                ckpt_path=args.folder / "last.ckpt" if resumed else None)
    report = trainer.strategy.memory_report()
    peak_rss = peak_rss_bytes()  # since the reset (or the start, without one): training and the teardown after it
    export: dict[str, Any] = {}
    if args.role == "disk":  # the trained model, mapped from the tier's files, written for inference
        from lightning_superpipe import save_safetensors

        path = args.folder / "export.safetensors"
        exported = time.perf_counter()
        reset = reset_peak_rss()
        save_safetensors(task.model, path)
        export = {"export_s": time.perf_counter() - exported, "export_bytes": path.stat().st_size,
                  "peak_rss_export_bytes": peak_rss_bytes() if reset else None}
        path.unlink()
    return {
        "step_s": probe.step_s, "losses": probe.losses, "io_intervals": probe.io, "fit_s": time.perf_counter() - began,
        "disk_seconds": probe.clock, "finish_step_s": probe.finish_step_s,
        "peak_rss_before_training_bytes": probe.rss_before_training,
        "peak_rss_training_bytes": probe.rss_training or None,
        "peak_rss_bytes": peak_rss, **export, "rss_after_imports_bytes": rss_after_imports,
        "disk_bytes": report.get("disk_bytes"), "peak_disk_pool_host_bytes": report.get("peak_disk_pool_host_bytes"),
        "disk_bytes_read": report.get("disk_bytes_read"), "disk_bytes_written": report.get("disk_bytes_written"),
        "direct_io": probe.direct_io, "batch_starts": probe.starts, "disk_fused_reads": report.get("disk_fused_reads"),
        "optimizer_step_modes": report.get("optimizer_step_modes"),
    }


def fused_read(args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier stepping after backward (``overlap_optimizer=False``: each step reads every block's record and
    gradients, and the next forward reads every block's masters again) against its step pipelined into the next
    forward (``"pipelined"``: that forward copies each block from the buffer its step left it in). Per step (the
    steps after the first, from one batch's start to the next, so that a pipelined step's tail in the next batch
    counts): bytes read and written, and time; their ratios; whether the losses are equal."""
    runs = {}
    for overlap in ("serial", "pipelined"):
        args.overlap = overlap
        runs[overlap] = child("disk", args)
        shutil.rmtree(args.folder)
        args.folder.mkdir()
    figures: dict[str, Any] = {"params": count_params(args)[0], "layers": args.layers, "steps": args.steps,
                               "threads": args.threads, "host_buffer_bytes": args.host_buffer_bytes}
    for name, run in runs.items():
        starts = run["batch_starts"][1:]  # from the second batch's start: the first step creates the moments
        spans = list(zip(starts, starts[1:]))
        figures[f"step_s_{name}"] = [round(b[0] - a[0], 3) for a, b in spans]
        figures[f"step_read_bytes_{name}"] = sum(b[1] - a[1] for a, b in spans) / len(spans)
        figures[f"step_write_bytes_{name}"] = sum(b[2] - a[2] for a, b in spans) / len(spans)
        figures[f"optimizer_step_modes_{name}"] = run["optimizer_step_modes"]
        figures[f"disk_fused_reads_{name}"] = run["disk_fused_reads"]
    serial, pipelined = figures["step_s_serial"], figures["step_s_pipelined"]
    figures["step_time_ratio"] = (sum(pipelined) / len(pipelined)) / (sum(serial) / len(serial))
    figures["step_read_ratio"] = figures["step_read_bytes_pipelined"] / figures["step_read_bytes_serial"]
    figures["losses_equal"] = runs["serial"]["losses"] == runs["pipelined"]["losses"]
    return figures


def pieces(args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier with a model built in ``configure_model`` (so that the peak is the tier's, not the model's
    construction), with whole-block buffers (``--buffers`` of them: today's records) and with each bound of
    ``--bounds`` (blocks larger than a buffer stepped in pieces), in alternating rounds (a shared machine drifts).
    Per run: the peak RSS while training (``VmHWM`` reset when training starts) and over the whole process, each
    minus the RSS after the imports, the pool's peak, and the mean step time (the steps after the first). Also:
    what the report names beside the pool (two layers' gradients arriving, the trunk's masters, gradients and
    moments), and whether every run's losses are equal."""
    params, layer = count_params(args)
    whole = args.host_buffer_bytes
    bounds = {"whole": whole, **{f"bound_{b}": int(b) for b in args.bounds.split(",")}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in bounds}
    for _ in range(args.rounds):
        for name, bound in bounds.items():
            args.host_buffer_bytes = bound
            runs[name].append(child("configured", args))
            shutil.rmtree(args.folder)
            args.folder.mkdir()
    trunk = params - args.layers * layer
    figures: dict[str, Any] = {
        "params": params, "layer_params": layer, "layers": args.layers, "hidden": args.hidden,
        "intermediate": args.intermediate, "training_state_bytes": 16 * params, "layer_record_bytes": 16 * layer,
        "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        # Beside the pool: two layers' fp32 gradients arriving from the device, the trunk's masters, gradients and
        # AdamW moments (16 B a parameter; its masters are the model's), no staging (fp32: no cast).
        "named_besides_pool_bytes": 2 * 4 * layer + 16 * trunk,
        "losses_equal": len({json.dumps(r["losses"]) for rs in runs.values() for r in rs}) == 1,
    }
    for name, rs in runs.items():
        imports = [r["rss_after_imports_bytes"] for r in rs]
        figures[name] = {
            "host_buffer_bytes": bounds[name],
            "peak_disk_pool_host_bytes": [r["peak_disk_pool_host_bytes"] for r in rs],
            "rss_after_imports_bytes": imports,
            "peak_rss_training_bytes": [r["peak_rss_training_bytes"] for r in rs],
            "peak_rss_training_minus_imports_bytes": [r["peak_rss_training_bytes"] - i for r, i in zip(rs, imports)],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in rs],
            "peak_rss_before_training_minus_imports_bytes": [
                r["peak_rss_before_training_bytes"] - i for r, i in zip(rs, imports)],
            "step_s": [sum(r["step_s"][1:]) / max(len(r["step_s"]) - 1, 1) for r in rs],
            "disk_seconds_per_step": [
                {k: round(sum(c[k] for c in r["disk_seconds"][1:]) / max(len(r["disk_seconds"]) - 1, 1), 3)
                 for k in r["disk_seconds"][0]} for r in rs],
        }
    base = sum(figures["whole"]["step_s"]) / args.rounds
    for name in bounds:
        figures[name]["step_time_vs_whole"] = sum(figures[name]["step_s"]) / args.rounds / base
    return figures


def trunk(args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier with the trunk's matrices (the embedding and the untied head) in its files, as it trains them,
    against the same run with them in host memory (``--trunk-in-memory``: the rule of
    :mod:`lightning_superpipe.memory.disk.trunk` switched off in that process), a model built in
    ``configure_model`` (so that the peak is the tier's), in alternating rounds. Per run: the peak RSS while
    training and over the whole process, each minus the RSS after the imports, the pool's peak, the mean step time
    (the steps after the first) and the tier's files; and whether the losses are equal."""
    params, layer = count_params(args)
    runs: dict[str, list[dict[str, Any]]] = {"trunk_on_disk": [], "trunk_in_memory": []}
    for _ in range(args.rounds):
        for name in runs:
            args.trunk_in_memory = name == "trunk_in_memory"
            runs[name].append(child("configured", args))
            shutil.rmtree(args.folder)
            args.folder.mkdir()
    figures: dict[str, Any] = {
        "params": params, "layer_params": layer, "trunk_params": params - args.layers * layer - args.hidden,
        "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "steps": args.steps,
        "rounds": args.rounds, "threads": args.threads, "host_buffer_bytes": args.host_buffer_bytes,
        "losses_equal": len({json.dumps(r["losses"]) for rs in runs.values() for r in rs}) == 1,
    }
    for name, rs in runs.items():
        imports = [r["rss_after_imports_bytes"] for r in rs]
        figures[name] = {
            "peak_disk_pool_host_bytes": [r["peak_disk_pool_host_bytes"] for r in rs],
            "peak_rss_training_minus_imports_bytes": [r["peak_rss_training_bytes"] - i for r, i in zip(rs, imports)],
            "peak_rss_minus_imports_bytes": [r["peak_rss_bytes"] - i for r, i in zip(rs, imports)],
            "step_s": [sum(r["step_s"][1:]) / max(len(r["step_s"]) - 1, 1) for r in rs],
            "disk_bytes": [r["disk_bytes"] for r in rs],
        }
    return figures


def save_model(args: argparse.Namespace) -> dict[str, Any]:
    """The model the ``disk`` run trains (same seed), saved with ``save_pretrained`` for the ``loaded`` run."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(args)).save_pretrained(args.folder / "saved")
    return {}


def child(role: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--role", role, "--folder", str(args.folder)]
    for name in ("layers", "hidden", "intermediate", "vocab", "seq", "batch", "steps", "threads", "overlap"):
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--raw-bytes", str(args.raw_bytes)]
    if getattr(args, "trunk_in_memory", False):
        command.append("--trunk-in-memory")
    if args.host_buffer_bytes is not None:
        command += ["--host-buffer-bytes", str(args.host_buffer_bytes)]
    print(f"[{role}] ...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {role} run failed:\n{done.stderr[-4000:]}")
    print(f"[{role}] {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=Path(tempfile.gettempdir()),
                        help="a folder on the disk to measure (a scratch folder is made in it and removed)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--buffers", type=int, default=3,
                        help="host_buffer_bytes as this many buffers of one layer's record and gradients")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--fused-read", action="store_true",
                        help="only the disk tier, its step after backward against its step pipelined into the next"
                             " forward (which copies each block from the buffer the step left it in)")
    parser.add_argument("--pieces", action="store_true",
                        help="only the disk tier (model built in configure_model): whole-block buffers (--buffers)"
                             " against each host_buffer_bytes of --bounds, in --rounds alternating rounds")
    parser.add_argument("--bounds", default=f"{256 << 20},{1 << 30}", help="--pieces: host_buffer_bytes values")
    parser.add_argument("--rounds", type=int, default=2, help="--pieces, --trunk: rounds of the runs")
    parser.add_argument("--trunk", action="store_true",
                        help="the trunk's matrices in the tier's files vs in host memory (use a large --vocab)")
    parser.add_argument("--trunk-in-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", choices=list(OVERLAP_KNOBS), default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["host", "disk", "resumed", "configured", "loaded", "save", "raw"],
                        default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--raw-bytes", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host-buffer-bytes", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_role(args: argparse.Namespace) -> None:
    """A child process: one role's run, its figures printed as one line of JSON."""
    from lightning_superpipe.memory.disk import limit_heap_retention
    from lightning_superpipe.memory.disk import trunk as disk_trunk

    if args.trunk_in_memory:  # no trunk parameter has this many dimensions: all stay in host memory
        disk_trunk.TRUNK_ON_DISK_MIN_DIMS = 1 << 30

    limit_heap_retention()  # what the strategy does for a disk tier; in both runs alike (see bench_disk.py)
    runner = {"raw": run_raw, "save": save_model}.get(args.role, run_fit)
    print(json.dumps(runner(args)))


def write(figures: dict[str, Any], args: argparse.Namespace) -> None:
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    if args.role is not None:
        run_role(args)
        return
    params, layer = count_params(args)
    # fp32 master + two moments (12 B) and the spilled gradient (4 B) of one layer, page-rounded, per buffer.
    args.host_buffer_bytes = args.buffers * (-(-16 * layer // 4096) * 4096 + 4096)
    args.raw_bytes = max(12 * (params - 2 * args.vocab * args.hidden), 1 << 30)  # one step's records, >= 1 GiB
    # Two slots of 12 B and 4 B of gradients per parameter, a third slot for the resumed run (the checkpoint keeps
    # the committed one), then (the tier's files removed) the two raw files.
    needed = max(40 * params, 2 * args.raw_bytes)
    free = shutil.disk_usage(args.path).free
    if needed * 1.1 > free:
        raise SystemExit(f"{args.path} has {free / GB:.1f} GB free; this run needs about {needed * 1.1 / GB:.1f} GB.")
    args.folder = Path(tempfile.mkdtemp(prefix="superpipe-bench-disk-strategy-", dir=args.path))
    if args.fused_read or args.pieces or args.trunk:
        try:
            figures = (pieces if args.pieces else trunk if args.trunk else fused_read)(args)
        finally:
            shutil.rmtree(args.folder, ignore_errors=True)
        write(figures, args)
        return
    write(compare(args, params, *all_runs(args)), args)


def all_runs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The raw disk (before and after), and the host, disk, resumed, configured and loaded runs."""
    try:
        # The raw disk before and after the training runs: a shared virtual disk's throughput drifts within minutes.
        raws = [child("raw", args)]
        host = child("host", args)
        disk = child("disk", args)
        resumed = child("resumed", args)
        shutil.rmtree(args.folder)
        args.folder.mkdir()
        configured = child("configured", args)
        shutil.rmtree(args.folder)
        args.folder.mkdir()
        child("save", args)
        loaded = child("loaded", args)
        shutil.rmtree(args.folder)
        args.folder.mkdir()
        raws.append(child("raw", args))
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    return raws, {"host": host, "disk": disk, "resumed": resumed, "configured": configured, "loaded": loaded}


def compare(
    args: argparse.Namespace, params: int, raws: list[dict[str, Any]], runs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The disk tier's figures against the host tier's and the raw disk's."""
    host, disk = runs["host"], runs["disk"]
    later, steps_counted, read_bytes, write_bytes, read_busy, write_busy, busy = step_io(disk, args.steps)
    disk_step = sum(disk["step_s"][later]) / steps_counted
    host_step = sum(host["step_s"][later]) / len(host["step_s"][later])
    # Each figure the faster of the two raw runs: the tier is compared with the best the disk did.
    raw = {"bytes": raws[0]["bytes"], **{k: min(r[k] for r in raws) for k in raws[0] if k.endswith("_s")}}
    raw_read, raw_write, raw_mixed = raw_rates(raw)
    raw_time = (read_bytes / raw_read + write_bytes / raw_write) / steps_counted
    clock = {k: sum(step[k] for step in disk["disk_seconds"][later]) / steps_counted for k in disk["disk_seconds"][0]}
    finish = disk["finish_step_s"][later] or disk["finish_step_s"]
    figures: dict[str, Any] = {
        "params": params, "training_state_bytes": 16 * params, "layers": args.layers,
        "tokens_per_step": args.batch * args.seq, "threads": args.threads,
        "host_buffer_bytes": args.host_buffer_bytes, "peak_disk_pool_host_bytes": disk["peak_disk_pool_host_bytes"],
        "disk_file_bytes": disk["disk_bytes"], "direct_io": disk["direct_io"],
        "peak_rss_before_training_host_bytes": host["peak_rss_before_training_bytes"],
        "peak_rss_before_training_disk_bytes": disk["peak_rss_before_training_bytes"],
        "peak_rss_training_host_bytes": host["peak_rss_training_bytes"],
        "peak_rss_training_disk_bytes": disk["peak_rss_training_bytes"],
        "step_s_host": host_step, "step_s_disk": disk_step, "step_time_ratio": disk_step / host_step,
        "first_step_s_host": host["step_s"][0], "first_step_s_disk": disk["step_s"][0],
        "fit_s_host": host["fit_s"], "fit_s_disk": disk["fit_s"],
        "losses_host": host["losses"], "losses_disk": disk["losses"],
        "step_read_bytes": read_bytes / steps_counted, "step_write_bytes": write_bytes / steps_counted,
        "step_read_gbps": read_bytes / read_busy / GB, "step_write_gbps": write_bytes / write_busy / GB,
        "raw_read_gbps": {"1x64MiB": raw["bytes"] / raw["read_1_s"] / GB,
                          "4x16MiB": raw["bytes"] / raw["read_4_s"] / GB},
        "raw_write_fsync_gbps": {"1x64MiB": raw["bytes"] / raw["write_1_s"] / GB,
                                 "4x16MiB": raw["bytes"] / raw["write_4_s"] / GB},
        "step_read_vs_raw": read_bytes / read_busy / raw_read,
        "step_write_vs_raw": write_bytes / write_busy / raw_write,
        "step_io_vs_raw": raw_time / disk_step,
        "step_disk_busy_s": busy / steps_counted,
        "step_io_gbps_while_busy": (read_bytes + write_bytes) / busy / GB,
        "raw_runs_read_write_mixed_gbps": [
            [round(max(r["bytes"] / r["read_1_s"], r["bytes"] / r["read_4_s"]) / GB, 3),
             round(max(r["bytes"] / r["write_1_s"], r["bytes"] / r["write_4_s"]) / GB, 3),
             round(2 * r["bytes"] / r["mixed_s"] / GB, 3)] for r in raws],
        "raw_mixed_gbps": {"read": raw["bytes"] / raw["mixed_read_s"] / GB,
                           "write_fsync": raw["bytes"] / raw["mixed_write_s"] / GB, "together": raw_mixed / GB},
        # 1.0: the tier moved its bytes, while its I/O was in flight, as fast as the raw disk moves them one kind
        # after the other (first) or mixed (second).
        "step_io_vs_raw_while_busy": raw_time * steps_counted / busy,
        "step_io_vs_raw_mixed_while_busy": (read_bytes + write_bytes) / busy / raw_mixed,
        "step_disk_seconds": clock,
        "optimizer_step_after_backward_s_disk": sum(finish) / max(len(finish), 1),
    }
    add_rss_figures(figures, runs)
    return figures


def add_rss_figures(figures: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """Adds each run's peak RSS against the host tier's whole run, and the export's after the disk run."""
    names = ("host", "disk", "resumed", "configured", "loaded")
    host, disk, resumed, configured, loaded = (runs[name] for name in names)
    for phase in ("before_training", "training"):
        host_bytes, disk_bytes = figures[f"peak_rss_{phase}_host_bytes"], figures[f"peak_rss_{phase}_disk_bytes"]
        if host_bytes and disk_bytes:
            figures[f"peak_rss_{phase}_ratio"] = disk_bytes / host_bytes
    whole = [max(filter(None, (r["peak_rss_before_training_bytes"], r["peak_rss_training_bytes"],
                               r["peak_rss_bytes"]))) for r in (host, disk, resumed, configured, loaded)]
    figures.update(peak_rss_host_bytes=whole[0], peak_rss_disk_bytes=whole[1], peak_rss_ratio=whole[1] / whole[0],
                   peak_rss_resumed_disk_bytes=whole[2], peak_rss_resumed_ratio=whole[2] / whole[0],
                   peak_rss_before_training_resumed_disk_bytes=resumed["peak_rss_before_training_bytes"],
                   losses_resumed_disk=resumed["losses"], step_s_resumed_disk=resumed["step_s"],
                   peak_rss_configured_disk_bytes=whole[3], peak_rss_configured_ratio=whole[3] / whole[0],
                   peak_rss_before_training_configured_disk_bytes=configured["peak_rss_before_training_bytes"],
                   losses_configured_equal_disk=configured["losses"] == disk["losses"],
                   peak_rss_loaded_disk_bytes=whole[4], peak_rss_loaded_ratio=whole[4] / whole[0],
                   peak_rss_before_training_loaded_disk_bytes=loaded["peak_rss_before_training_bytes"],
                   losses_loaded_equal_disk=loaded["losses"] == disk["losses"])
    # save_safetensors after the disk run: its peak against the host tier's whole run, its bytes per second.
    if disk.get("peak_rss_export_bytes"):
        figures.update(export_s=disk["export_s"], export_gbps=disk["export_bytes"] / disk["export_s"] / GB,
                       peak_rss_export_bytes=disk["peak_rss_export_bytes"],
                       peak_rss_export_ratio=disk["peak_rss_export_bytes"] / whole[0])


if __name__ == "__main__":
    main()
