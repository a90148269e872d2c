"""Step time and host memory of ``strategy="superpipe"`` on two devices against plain DDP, in the same run.

Lightning's subprocess launcher starts this script again for rank 1; both ranks then train a Llama-style causal LM
(built from a config, no download) with ``strategy="ddp"`` and with ``strategy="superpipe"``, a few optimizer steps
each, and rank 0 reports:

* the median step time of each after warm-up, and superpipe's as a ratio of DDP's;
* host memory per node, with the default (``superpipe``: ``shard_optimizer="auto"``, which is ``"node"`` here), the
  optimizer state replicated (``shard_optimizer=False``), sharded (``shard_optimizer=True``), sharded with one shared
  copy of the blocks per node (``shard_optimizer="node"``), and in files
  (``offload_device="disk"``: each rank its own copy under ``--disk-path``): the sum over both ranks of the
  training state (fp32 masters, the ``.grad`` each rank keeps, optimizer state, from the strategy's report), of the
  strategy's own count of host bytes (``host_bytes``: homes, transfer copies, staging), and of each process's
  resident set growth during the run, against the same figures of one process training the same model with
  ``devices=1`` (run first, in a subprocess of its own). What the ranks share (the ``/dev/shm`` region of
  ``"node"``: its ``shared_host_bytes``, the masters in it, the resident pages of it, ``RssShmem``) is counted once
  per node, not once per rank. Only the first variant's resident set growth is measured (``--first``): a later run
  reuses the memory an earlier one freed.

On the CPU both ranks share the machine's cores, so the ratio says what streaming and the per-block reduction cost
against DDP's bucketed one, not how either scales.

Usage:
    python benchmarks/bench_ddp.py                       # CPU, gloo: about a minute on 2 cores
    python benchmarks/bench_ddp.py --accelerator gpu     # two GPUs, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.host import rss_bytes, shared_rss_bytes

CONFIG = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, vocab_size=4096)
RESULTS = Path(__file__).with_name("results")


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=512, tie_word_embeddings=False, **CONFIG))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)


class StepTimes(Callback):
    """Wall-clock seconds of each optimizer step, and the superpipe strategy's report before teardown."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.report: dict[str, Any] = {}
        self._last = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._last:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, SuperpipeStrategy):
            report = trainer.strategy.memory_report()
            self.report = {k: v for k, v in report.items() if isinstance(v, (int, float))}
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.report["grad_bytes"] = sum(g.numel() * g.element_size() for g in grads)
            if report.get("offload_device") == "disk":
                # The block parameters hold placeholders (their masters are in files): count the bytes behind the
                # parameters, and the tier's pool of block buffers as host bytes of the strategy.
                storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                            for p in pl_module.parameters()}
                self.report["param_bytes"] = sum(storages.values())
                self.report["host_bytes"] += report["peak_disk_pool_host_bytes"]
            # The masters in the node's shared homes (shard_optimizer="node"): every rank's param_bytes counts them.
            shared = report["shared_host_bytes"] > 0
            homes = [home for home in trainer.strategy.engine.homes if home is not None] if shared else []
            self.report["shared_param_bytes"] = sum(p.param.numel() * p.param.element_size()
                                                    for home in homes for p in home.slices)


def train(strategy: Any, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = CausalLM()
    data = torch.randint(0, CONFIG["vocab_size"], (args.batch * devices * (args.steps + args.warmup), args.seq))
    times = StepTimes()
    before, _ = rss_bytes()
    shared_before = shared_rss_bytes()
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=args.steps + args.warmup,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[times],
    )
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=args.batch))
    after, _ = rss_bytes()
    shared_after = shared_rss_bytes()
    report = times.report
    return {
        "step_s": statistics.median(times.times[args.warmup :]),
        "host_bytes": report.get("host_bytes", 0),
        "shared_host_bytes": report.get("shared_host_bytes", 0),
        "optimizer_state_bytes": report.get("optimizer_state_bytes", 0),
        "state_bytes": sum(report.get(key, 0) for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes")),
        "shared_state_bytes": report.get("shared_param_bytes", 0),
        "rss_growth_bytes": after - before,
        "shared_rss_growth_bytes": shared_after - shared_before,
    }


def per_node(ranks: list[dict[str, Any]], key: str) -> int:
    """The node's figure ``key`` from its ranks': each rank's own part, plus what they share once."""
    shared_key = {"host_bytes": "shared_host_bytes", "state_bytes": "shared_state_bytes",
                  "rss_growth_bytes": "shared_rss_growth_bytes"}.get(key)
    if shared_key is None:
        return sum(rank[key] for rank in ranks)
    return sum(rank[key] - rank[shared_key] for rank in ranks) + max(rank[shared_key] for rank in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--disk-path", type=Path, default=Path("/tmp/superpipe-bench-ddp-disk"),
                        help="offload_path of the disk-tier run (on a local disk)")
    parser.add_argument("--first", choices=("node", "sharded", "superpipe", "replicated", "disk"), default="node",
                        help="the superpipe variant run first: only its resident set growth is measured")
    parser.add_argument("--single", action="store_true", help="internal: the one-process baseline, printed as JSON")
    args = parser.parse_args()
    if args.single:
        print(json.dumps(train(SuperpipeStrategy(), 1, args)))
        return
    single = None
    if "LOCAL_RANK" not in os.environ:  # rank 0, before it launches rank 1: the one-process baseline
        out = subprocess.run([sys.executable, __file__, "--single", *sys.argv[1:]], capture_output=True, text=True)
        single = json.loads(out.stdout.strip().splitlines()[-1])
    variants = {
        "superpipe": lambda: SuperpipeStrategy(),  # the default
        "replicated": lambda: SuperpipeStrategy(shard_optimizer=False),
        "sharded": lambda: SuperpipeStrategy(shard_optimizer=True),
        "node": lambda: SuperpipeStrategy(shard_optimizer="node"),
        "disk": lambda: SuperpipeStrategy(offload_device="disk", offload_path=args.disk_path),
    }
    args.disk_path.mkdir(parents=True, exist_ok=True)  # the same offload_path on every rank
    order = [args.first] + [name for name in variants if name != args.first]
    runs = {name: train(variants[name](), 2, args) for name in order}
    runs["ddp"] = train("ddp", 2, args)
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, runs)
    if torch.distributed.get_rank() != 0:
        return
    assert single is not None
    result: dict[str, Any] = {
        "config": CONFIG, "accelerator": args.accelerator, "batch_per_rank": args.batch, "seq": args.seq,
        "single": single,
    }
    for name in runs:
        result[name] = {
            "step_s": max(rank[name]["step_s"] for rank in everyone),
            **{f"node_{key}": per_node([rank[name] for rank in everyone], key)
               for key in ("state_bytes", "host_bytes", "optimizer_state_bytes", "rss_growth_bytes")},
        }
    for name in variants:
        result[name]["step_ratio_vs_ddp"] = result[name]["step_s"] / result["ddp"]["step_s"]
        for key in ("state_bytes", "host_bytes", "rss_growth_bytes"):
            result[name][f"{key}_ratio_vs_single"] = result[name][f"node_{key}"] / max(1, single[key])
    for name in order[1:]:  # a later run in the same process reuses the memory the first one freed
        result[name]["node_rss_growth_bytes"] = result[name]["rss_growth_bytes_ratio_vs_single"] = None
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"ddp_{args.accelerator}_{args.first}_first.json").write_text(json.dumps(result, indent=2))
    mib = 2**20
    print(f"step time: ddp {result['ddp']['step_s']:.3f} s; superpipe devices=1 {single['step_s']:.3f} s")
    for name in order:
        run = result[name]
        rss = (
            f"resident set growth {run['node_rss_growth_bytes'] / mib:.1f} MiB"
            f" ({run['rss_growth_bytes_ratio_vs_single']:.2f}x)"
            if name == args.first
            else "resident set not measured"
        )
        print(
            f"{name}: step {run['step_s']:.3f} s ({run['step_ratio_vs_ddp']:.2f}x ddp); per node: training state"
            f" {run['node_state_bytes'] / mib:.1f} MiB ({run['state_bytes_ratio_vs_single']:.2f}x one process's"
            f" {single['state_bytes'] / mib:.1f}), strategy host bytes {run['node_host_bytes'] / mib:.1f} MiB"
            f" ({run['host_bytes_ratio_vs_single']:.2f}x), {rss}"
        )


if __name__ == "__main__":
    main()
