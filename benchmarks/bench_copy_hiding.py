"""How much copy time the prefetch schedule hides behind compute, measured on the emulated link.

The CPU has no link to hide copies on, so the benchmark gives the emulated asynchronous device a bandwidth
(``EmulatedLink(bandwidth=...)``): each copy then takes ``bytes / bandwidth`` seconds of modelled link time, one
at a time per stream (host-to-device, device-to-host), and waiting for a copy blocks until it is done. The
bandwidth is set so that one block's copy takes ``ratio`` times one block's forward compute (measured first).

On 2 cores the copy bookkeeping competes with compute, so absolute step times mean little; what is reported is
the *exposed* copy time, ``step time with the cap - step time without it`` (same link, same schedule), against the
modelled copy time of the step, and the hidden fraction ``1 - exposed / copy time``.

Usage:
    python benchmarks/bench_copy_hiding.py                     # ~2 minutes on 2 cores
    python benchmarks/bench_copy_hiding.py --ratios 0.5 1 1.5 --prefetch 0 1 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_superpipe  # noqa: F401
from lightning_superpipe import EmulatedLink, SuperpipeStrategy


def build(width: int, depth: int) -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    return nn.Sequential(*[block() for _ in range(depth)])


class Regression(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.model = build(width, depth)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.model(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # A cheap host step: the benchmark is about the blocks' copies, not the optimizer.
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    def __init__(self, link: EmulatedLink) -> None:
        self.link = link
        self.times: list[float] = []
        self.copy_bytes: list[int] = []
        self._start = 0.0
        self._bytes = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()
        self._bytes = self.link.stats.bytes

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.copy_bytes.append(self.link.stats.bytes - self._bytes)


def block_forward_seconds(width: int, tokens: int) -> float:
    block = build(width, 1)
    x = torch.randn(tokens, width)
    with torch.no_grad():
        for _ in range(3):
            block(x)
        runs = []
        for _ in range(10):
            start = time.perf_counter()
            block(x)
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def measure(args: argparse.Namespace, prefetch: int, bandwidth: float | None) -> tuple[float, float]:
    """Median step time and modelled copy time per step (seconds) for one setting."""
    pl.seed_everything(0, verbose=False)
    module = Regression(args.width, args.depth)
    data = DataLoader(TensorDataset(torch.randn(args.steps + 2, args.tokens, args.width),
                                    torch.randn(args.steps + 2, args.tokens, args.width)), batch_size=None)
    link = EmulatedLink(mode="lazy", bandwidth=bandwidth, check=False)
    timer = StepTimer(link)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps + 2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        strategy=SuperpipeStrategy(resident_blocks=0, prefetch=prefetch, link=link),
    )
    trainer.fit(module, data)
    steps = slice(2, None)  # after warm-up
    copy_seconds = statistics.median(timer.copy_bytes[steps]) / bandwidth if bandwidth else 0.0
    return statistics.median(timer.times[steps]), copy_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0], help="block copy time / block forward")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    forward = block_forward_seconds(args.width, args.tokens)
    block_bytes = sum(p.numel() * 4 for p in build(args.width, 1).parameters())
    print(f"block: {block_bytes / 2**20:.1f} MiB, forward {forward * 1e3:.1f} ms on {args.tokens} tokens")
    rows = []
    for prefetch in args.prefetch:
        uncapped, _ = measure(args, prefetch, None)
        for ratio in args.ratios:
            bandwidth = block_bytes / (ratio * forward)
            capped, copy_seconds = measure(args, prefetch, bandwidth)
            exposed = max(0.0, capped - uncapped)
            row = dict(
                prefetch=prefetch, ratio=ratio, bandwidth_MBps=bandwidth / 1e6, step_uncapped_s=uncapped,
                step_capped_s=capped, copy_s=copy_seconds, exposed_s=exposed,
                hidden_fraction=1.0 - exposed / copy_seconds if copy_seconds else 1.0,
            )
            rows.append(row)
            print(
                f"prefetch={prefetch} copy/compute={ratio:.2f}: copy {copy_seconds * 1e3:.0f} ms/step, exposed"
                f" {exposed * 1e3:.0f} ms -> {100 * row['hidden_fraction']:.0f}% hidden"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    table = [
        "| prefetch | block copy / block forward | copy time per step | exposed | hidden |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {r['prefetch']} | {r['ratio']:.2f} | {r['copy_s'] * 1e3:.0f} ms | {r['exposed_s'] * 1e3:.0f} ms |"
        f" {100 * r['hidden_fraction']:.0f}% |"
        for r in rows
    ]
    header = (
        f"Emulated link, {args.depth} blocks of {block_bytes / 2**20:.1f} MiB, block forward {forward * 1e3:.1f} ms,"
        f" {args.tokens} tokens, resident_blocks=0, {args.threads} torch thread(s).\n\n"
    )
    (args.out / "copy_hiding.md").write_text(header + "\n".join(table) + "\n")
    (args.out / "copy_hiding.json").write_text(
        json.dumps(dict(block_forward_s=forward, block_bytes=block_bytes, rows=rows), indent=1)
    )
    print(header + "\n".join(table))


if __name__ == "__main__":
    main()
