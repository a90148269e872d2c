"""Host memory of a LoRA fine-tune on a 4-bit frozen base loaded block by block: the model built in
``configure_model`` from a saved folder (``load_safetensors``) under ``SuperpipeStrategy(quantize_frozen="nf4")``,
against the same model loaded whole first (``from_pretrained`` in the LightningModule's ``__init__``, then the same
strategy).

1. Saves a Llama-style causal LM with random weights (``--layers`` decoder layers of width ``--hidden``, in
   ``--dtype``) with ``save_pretrained`` to a temporary folder.
2. For each way of loading, in a fresh process: resets the peak resident set after the imports
   (``/proc/self/clear_refs``), fits ``--steps`` steps of LoRA (peft, rank 16, every linear layer of the blocks) on
   random tokens, and reads the peak resident set (``VmHWM``) once training starts (loading) and after the run
   (training), minus the resident set after the imports.
3. Reports each peak against the full-precision weights' bytes, and the peak minus the trunk's bytes (embedding, head
   and norms: they stay in their dtype) against them. Target for ``configure_model``: at most 0.35x plus the trunk.

``--ways`` picks the ways (default ``configure_model,from_pretrained``); a way with ``:disk``
(``configure_model:disk``) trains with ``offload_device="disk"`` in a temporary folder, where the 4-bit base lives in
the tier's read-only files: the report adds those files' bytes against the weights'.

Writes ``results.json`` and ``report.md`` to ``--out`` (default ``benchmarks/results/qlora_load/``) and prints the
report.

Usage::

    python benchmarks/bench_qlora_load.py                    # CPU, bf16 checkpoint of 0.45 GB, about 3 minutes
    python benchmarks/bench_qlora_load.py --layers 2 --hidden 512 --steps 1 --out /tmp/q   # smoke test
    python benchmarks/bench_qlora_load.py --ways configure_model,configure_model:disk   # the host vs the disk tier
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PRECISIONS = {"bf16": "bf16-true", "fp32": "32-true"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _status(key: str) -> int:
    with open("/proc/self/status") as fields:
        for line in fields:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def lora_module(loading: str, folder: Path, torch_dtype: Any) -> Any:
    """The LightningModule of a LoRA fine-tune of the model in ``folder``: loaded in ``__init__`` by
    ``from_pretrained``, or (``loading == "configure_model"``) built in ``configure_model`` and given its weights by
    ``load_safetensors``."""
    import lightning.pytorch as pl
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_superpipe import load_safetensors

    class LoRA(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            if loading == "from_pretrained":
                self.model = self._adapted(AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype))
            self.losses: list[float] = []

        @staticmethod
        def _adapted(model: Any) -> Any:
            # The adapters' initial values the same both ways: drawn in float32 (configure_model runs under the
            # precision's default dtype) from the same seed.
            torch.manual_seed(1)
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)).train()
            finally:
                torch.set_default_dtype(default)

        def configure_model(self) -> None:
            if self.model is None:
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch_dtype)
                load_safetensors(model, folder)
                self.model = self._adapted(model)

        def training_step(self, batch: Any, index: int) -> Any:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    return LoRA()


def child(way: str, folder: Path, dtype: str, steps: int, seq: int) -> dict[str, Any]:
    """One fit in this process; the figures as a dict."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoConfig

    from lightning_superpipe import SuperpipeStrategy

    torch_dtype = getattr(torch, DTYPES[dtype])
    loading, _, tier = way.partition(":")
    offload = tempfile.TemporaryDirectory(prefix="superpipe-qlora-tier-") if tier == "disk" else None
    with open("/proc/self/clear_refs", "w") as refs:  # the peak resident set starts again from here
        refs.write("5")
    base_rss = _status("VmRSS")

    class Peaks(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.loaded, self.settled = _status("VmHWM"), _status("VmRSS")
            self.device_at_start = trainer.strategy.memory_report()["device_bytes"]
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.times.append(time.perf_counter())

    torch.manual_seed(0)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    data = DataLoader(torch.randint(0, vocab, (steps, seq)), batch_size=1)
    peaks, module = Peaks(), lora_module(loading, folder, torch_dtype)
    disk = {} if offload is None else dict(offload_device="disk", offload_path=offload.name)
    strategy = SuperpipeStrategy(quantize_frozen="nf4", **disk)
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy, precision=PRECISIONS[dtype], max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[peaks])
    started = time.perf_counter()
    trainer.fit(module, data)
    ended = time.perf_counter()
    report = strategy.memory_report()
    return {
        "way": way,
        "peak_loading_bytes": peaks.loaded - base_rss,
        "peak_training_bytes": _status("VmHWM") - base_rss,
        "resident_at_start_bytes": peaks.settled - base_rss,
        "device_at_start_bytes": peaks.device_at_start,
        "packed_weight_bytes": report["packed_weight_bytes"],
        "peak_device_bytes": report["peak_device_bytes"],
        "report": {key: value for key, value in report.items() if isinstance(value, (int, float))},
        "losses": module.losses,
        "step_seconds": [b - a for a, b in zip(peaks.times, [*peaks.times[1:], ended])],
        "fit_seconds": ended - started,
        "frozen_disk_bytes": report.get("frozen_disk_bytes"),
    }


def save_model(folder: Path, args: argparse.Namespace) -> dict[str, int]:
    """Saves the model; its bytes: all weights, the frozen matrices of the blocks, the trunk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=max(1, args.hidden // 512), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, DTYPES[args.dtype]))
    model.save_pretrained(folder)
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return {
        "weight_bytes": sum(sizes.values()),
        "block_matrix_bytes": sum(n for name, n in sizes.items() if ".layers." in name and "norm" not in name),
        "trunk_bytes": sum(n for name, n in sizes.items() if ".layers." not in name or "norm" in name),
    }


def report(results: dict[str, Any]) -> str:
    sizes, runs = results["model"], results["runs"]
    gib = lambda n: f"{n / 2**30:.3f} GiB"  # noqa: E731
    lines = [
        f"# Host memory of a 4-bit frozen base loaded block by block ({results['date']})",
        "",
        f"Machine: {results['machine']}. Command: `{results['command']}`.",
        "",
        f"Model: {results['args']['layers']} Llama layers of width {results['args']['hidden']}"
        f" ({results['args']['dtype']}): weights {gib(sizes['weight_bytes'])}, of which the blocks' matrices"
        f" {gib(sizes['block_matrix_bytes'])} and the trunk {gib(sizes['trunk_bytes'])}.",
        "",
        "The compute device is the CPU, so what the strategy puts on the device is inside the resident set too."
        " Loading: the peak while loading minus the device bytes when training starts (the ledger's: the trunk's"
        " copy, the resident and prefetched blocks) and the trunk's host bytes, against the weights' bytes: the host"
        " memory the 4-bit base costs. Training: the peak minus the ledger's device peak and the trunk; it also holds"
        " the CPU's compute temporaries (matmul workspaces, autograd's), which a GPU holds on the device and the"
        " ledger does not count.",
        "",
        "| loading | peak RSS, loading | peak RSS, training | device at start / peak (ledger) | host homes (ledger)"
        " | loading: host / weights | training: host / weights | s / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        trunk, weights = sizes["trunk_bytes"], sizes["weight_bytes"]
        loading = (run["peak_loading_bytes"] - run["device_at_start_bytes"] - trunk) / weights
        training = (run["peak_training_bytes"] - run["peak_device_bytes"] - trunk) / weights
        steps = run["step_seconds"][1:] or run["step_seconds"]
        lines.append(
            f"| {run['way']} | {gib(run['peak_loading_bytes'])} | {gib(run['peak_training_bytes'])}"
            f" | {gib(run['device_at_start_bytes'])} / {gib(run['peak_device_bytes'])}"
            f" | {gib(run['report']['host_bytes'])} | {loading:.3f} | {training:.3f} | {sum(steps) / len(steps):.2f} |"
        )
    same = all(run["losses"] == runs[0]["losses"] for run in runs)
    lines += ["", f"Losses of the {len(runs)} ways bitwise equal: {same}."]
    for run in runs:
        if run.get("frozen_disk_bytes") is not None:
            lines.append(f"{run['way']}: the 4-bit base's files {gib(run['frozen_disk_bytes'])},"
                         f" {run['frozen_disk_bytes'] / sizes['block_matrix_bytes']:.3f}x of the blocks' matrices"
                         f" ({results['args']['dtype']}).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "qlora_load")
    parser.add_argument("--ways", default="configure_model,from_pretrained")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.dtype, args.steps, args.seq)))
        return
    with tempfile.TemporaryDirectory(prefix="superpipe-qlora-load-") as folder:
        sizes = save_model(Path(folder), args)
        runs = []
        for way in args.ways.split(","):
            command = [sys.executable, __file__, "--child", way, "--folder", folder, "--dtype", args.dtype,
                       "--steps", str(args.steps), "--seq", str(args.seq)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{way} failed:\n{done.stderr[-4000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "command": shlex.join(["python", "benchmarks/bench_qlora_load.py", *sys.argv[1:]]),
        "args": {key: value for key, value in vars(args).items() if key not in ("out", "child", "folder")},
        "model": sizes,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (args.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
