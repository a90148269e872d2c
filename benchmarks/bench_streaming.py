"""Step time and device memory of the superpipe strategy against Lightning's plain strategy, in one run.

For a Llama-style causal LM built from a config (no download), it trains a few optimizer steps with each
strategy and knob setting and reports, as ratios against plain:

* step time (wall clock per optimizer step, after warm-up);
* peak device bytes: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU, where host and device are the
  same memory, what each strategy keeps as "device" state: plain keeps weights, gradients and optimizer state,
  superpipe its ledger (block slots and gradients in flight) plus the resident trunk;
* the host optimizer step for three CPU AdamW implementations (it is the usual bottleneck of offloading);
* on CUDA, the host-to-device bandwidth of one pinned block copy, and step time against tokens per micro-batch
  to find where copies hide behind compute.

``--recipes clipped`` (instead of, or with, the default ``knobs``) runs the clipped recipes of
:mod:`streaming_clipped`: the optimizer's exposed time (end of backward to the end of the step, plus what the next
forward waits for pending steps) with the serial, speculative and pipelined steps, clipping by norm that never
fires and that always fires, against the targets (speculative at most 25% of serial, pipelined at most 60%, the
step with clipping that never fires within 1.05x of the step without clipping).

Usage:
    python benchmarks/bench_streaming.py                      # CPU preset, a few minutes on 2 cores
    python benchmarks/bench_streaming.py --device cuda        # 24-block model, token sweep
    python benchmarks/bench_streaming.py --recipes clipped --threads 1 --steps 7   # clipped recipes, ~6 min
    python benchmarks/bench_streaming.py --recipes clipped --preset tiny --steps 2 --warmup 1 --threads 1  # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy

PRESETS: dict[str, dict[str, Any]] = {
    # ~260 MB of fp32 weights: a CPU step takes seconds on 2 cores.
    "cpu": dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=12, num_attention_heads=10, vocab_size=4096),
    # ~1.5 GB of fp32 weights in 24 blocks.
    "cuda": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16, vocab_size=32000
    ),
    # ~13 MB of fp32 weights in 4 blocks: a smoke test of the script, not a measurement.
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, vocab_size=1024),
}


class CausalLM(pl.LightningModule):
    def __init__(self, config: dict[str, Any], optimizer: str) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **config))
        self.optimizer = optimizer

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_adamw(self.parameters(), self.optimizer)


def make_adamw(params: Any, implementation: str) -> torch.optim.Optimizer:
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}[implementation]
    return torch.optim.AdamW(params, lr=1e-4, **flags)


class StepTimer(pl.Callback):
    """Wall time of each optimizer step, synchronised with the device."""

    # It reads clocks only: without this the strategy would wait for a pipelined step before its hooks.
    superpipe_reads_no_weights = True

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        _sync(trainer.strategy.root_device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        _sync(trainer.strategy.root_device)
        self.times.append(time.perf_counter() - self._start)


class AfterBackwardTimer(pl.Callback):
    """Wall time from the end of the last backward of a step to the end of the step: what the optimizer step (and
    the refresh of the device copies) leaves exposed. Backward ends where the engine's ``finish_backward`` starts,
    before it waits for the block steps still running on the host.

    A pipelined step ends the step before its block steps are done: what the next forward waits for them is not
    here (:class:`streaming_clipped.ExposedTimer` adds it)."""

    # It reads clocks only: without this the strategy would wait for a pipelined step before its hooks.
    superpipe_reads_no_weights = True

    def __init__(self) -> None:
        self.times: list[float] = []
        self._backward_end = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine
        finish_backward = engine.finish_backward

        def timed() -> None:
            _sync(trainer.strategy.root_device)
            self._backward_end = time.perf_counter()
            finish_backward()

        engine.finish_backward = timed

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        _sync(trainer.strategy.root_device)
        self.times.append(time.perf_counter() - self._backward_end)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(
    args: argparse.Namespace, strategy: Any, tokens: int, after_backward: Optional[AfterBackwardTimer] = None,
    trailing: int = 0,
) -> dict[str, Any]:
    """Trains ``args.warmup + args.steps + trailing`` steps and measures ``args.steps`` after the warm-up (the
    trailing steps' forwards wait for the last measured step's pipelined work). ``after_backward``: the timer from
    the end of backward (a plain :class:`AfterBackwardTimer` for superpipe if ``None``)."""
    pl.seed_everything(0, verbose=False)
    config = PRESETS[args.preset]
    module = CausalLM(config, args.optimizer)
    batch_size = max(1, tokens // args.seq)
    total = args.warmup + args.steps + trailing
    data = TensorDataset(torch.randint(0, config["vocab_size"], (total * batch_size, args.seq)))
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    if after_backward is None and isinstance(strategy, SuperpipeStrategy):
        after_backward = AfterBackwardTimer()
    if after_backward is not None:
        callbacks.append(after_backward)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, strategy=strategy, precision=args.precision,
        max_steps=total, gradient_clip_val=args.clip, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=batch_size))
    measured = slice(args.warmup, args.warmup + args.steps)
    result: dict[str, Any] = {"step_s": _median(timer.times[measured]), "tokens": batch_size * args.seq}
    if after_backward is not None:
        result["after_backward_s"] = _median(after_backward.times[measured])
    params = list(module.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer_bytes = sum(
        t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim()
    )
    if args.device == "cuda":
        result["device_bytes"] = torch.cuda.max_memory_allocated()
    elif isinstance(strategy, SuperpipeStrategy):
        report = strategy.memory_report()
        # The ledger counts the trunk and its gradients, and kept or brought-back activations (not recompute's saved
        # block inputs, nor plain's activations).
        result["device_bytes"] = report["peak_device_bytes"]
        result["activation_bytes"] = report["peak_activation_bytes"]
        result["host_activation_bytes"] = report["host_activation_bytes"]
    else:
        result["device_bytes"] = 2 * param_bytes + optimizer_bytes  # weights, gradients, optimizer state
    return result


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def host_optimizer_step_ms(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds per AdamW step over the model's parameters, for each CPU implementation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **PRESETS[args.preset]))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    timings = {}
    for implementation in ("foreach", "loop", "fused"):
        optimizer = make_adamw(model.parameters(), implementation)
        optimizer.step()  # allocate state
        start = time.perf_counter()
        for _ in range(3):
            optimizer.step()
        timings[implementation] = (time.perf_counter() - start) / 3 * 1e3
    return timings


def h2d_bandwidth_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 10 * nbytes / (time.perf_counter() - start) / 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model size (default: the device's)")
    parser.add_argument(
        "--recipes", nargs="+", choices=["knobs", "clipped"], default=["knobs"],
        help="knobs: the table against plain (default); clipped: the optimizer's exposed time with clipping",
    )
    parser.add_argument("--knobs", nargs="+", default=None, help="resident,prefetch pairs, e.g. 0,1 1,1 4,2")
    parser.add_argument("--tokens", nargs="+", type=int, default=None, help="tokens per micro-batch to sweep")
    parser.add_argument(
        "--activations", nargs="+", default=["recompute", "keep", "offload"], choices=["recompute", "keep", "offload"],
        help="where blocks' activations live (each with every knob setting)",
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on CUDA")
    parser.add_argument("--optimizer", choices=["fused", "foreach", "loop"], default="fused")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: torch's). With fewer than the cores, the host has a core for the overlapped step",
    )
    parser.add_argument(
        "--clip", type=float, default=None,
        help="clip gradients by norm in the knobs table (the clipped recipes set their own)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.preset = args.preset or args.device
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    args.token_sweep = args.tokens or ([512] if args.device == "cpu" else [2048, 8192, 16384, 32768])
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if "knobs" in args.recipes:
        knob_recipes(args)
    if "clipped" in args.recipes:
        sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its sibling module
        from streaming_clipped import clipped_recipes

        clipped_recipes(args, run_one)


def knob_recipes(args: argparse.Namespace) -> None:
    """The table against plain: each knob setting and activation placement, with and without the overlap."""
    default_knobs = ["1,1"] if args.device == "cpu" else ["0,1", "1,1", "2,2", "4,2"]
    knobs = [tuple(int(v) for v in k.split(",")) for k in (args.knobs or default_knobs)]
    rows: list[dict[str, Any]] = []
    for tokens in args.token_sweep:
        plain = run_one(args, "auto", tokens)
        rows.append({"strategy": "plain", "tokens": plain["tokens"], **plain, "time_ratio": 1.0, "memory_ratio": 1.0})
        for (resident, prefetch), activations, overlap in itertools.product(knobs, args.activations, (True, False)):
            strategy = SuperpipeStrategy(
                resident_blocks=resident, prefetch=prefetch, activations=activations, overlap_optimizer=overlap
            )
            result = run_one(args, strategy, tokens)
            result["overlapped_block_steps"] = strategy.memory_report()["overlapped_block_steps"]
            rows.append({
                "strategy": f"superpipe r={resident} p={prefetch} {activations}{'' if overlap else ' serial step'}",
                **result,
                "time_ratio": result["step_s"] / plain["step_s"],
                "memory_ratio": result["device_bytes"] / plain["device_bytes"],
            })
    extras: dict[str, Any] = {"host_adamw_step_ms": host_optimizer_step_ms(args)}
    if args.device == "cuda":
        from transformers import LlamaConfig, LlamaForCausalLM

        one_block = LlamaForCausalLM(LlamaConfig(**{**PRESETS[args.preset], "num_hidden_layers": 1})).model.layers[0]
        block_bytes = sum(p.numel() * 2 for p in one_block.parameters())
        extras["h2d_gbps_one_bf16_block"] = h2d_bandwidth_gbps(block_bytes)
        extras["device_name"] = torch.cuda.get_device_name()

    lines = [
        f"# superpipe vs plain ({args.device}, preset {args.preset}, {args.precision}, AdamW {args.optimizer},"
        f" {torch.get_num_threads()} torch threads)",
        "",
        "| strategy | tokens/micro-batch | step s | step time / plain | device MB | device memory / plain |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {row['tokens']} | {row['step_s']:.3f} | {row['time_ratio']:.2f}x |"
            f" {row['device_bytes'] / 2**20:.0f} | {row['memory_ratio']:.1%} |"
        )
    lines += ["", "Host AdamW step over all parameters (ms): "
              + ", ".join(f"{k} {v:.0f}" for k, v in extras["host_adamw_step_ms"].items())]
    # The optimizer's exposed time: from the end of backward to the end of the step, with the overlap against the
    # same run without it (the serial step, and the refresh of the device copies both have).
    by_name = {row["strategy"]: row for row in rows}
    for name, row in by_name.items():
        serial = by_name.get(name + " serial step")
        if serial is not None and row.get("overlapped_block_steps"):
            exposed, serial_s = row["after_backward_s"], serial["after_backward_s"]
            row["optimizer_exposed_ratio"] = exposed / serial_s
            lines.append(
                f"{name}: after backward {exposed * 1e3:.0f} ms with the overlap, {serial_s * 1e3:.0f} ms serial"
                f" ({exposed / serial_s:.0%} exposed); {row['overlapped_block_steps']} block steps during backward"
            )
    if "h2d_gbps_one_bf16_block" in extras:
        lines.append(
            f"Host-to-device, one pinned bf16 block: {extras['h2d_gbps_one_bf16_block']:.1f} GB/s"
            f" ({extras['device_name']})"
        )
    report = "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"streaming_{args.device}.md").write_text(report + "\n")
    (args.out / f"streaming_{args.device}.json").write_text(json.dumps({"rows": rows, **extras}, indent=2))


if __name__ == "__main__":
    main()
