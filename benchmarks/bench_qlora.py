"""Quality of LoRA on a 4-bit frozen base, streamed: bitsandbytes NF4 (QLoRA as scripts build it) against the
strategy's own ``quantize_frozen="nf4-dq"``, both against a 16-bit base.

1. Pretrains a small Llama-style causal LM (byte tokens, every matrix dimension a multiple of 64) on Python's
   documentation (``pydoc_data.topics``) in fp32, plain PyTorch, until its held-out loss is well below the text's
   unigram entropy (reported), so that the 4-bit rounding of its weights matters.
2. LoRA-fine-tunes it (peft, on the seven linear layers of every block) on another text, the source of some standard
   library modules (``inspect.getsource``), each time through ``Trainer(strategy=SuperpipeStrategy(...))`` on the
   CPU under ``bf16-mixed``, for the same steps, seed, data order and LoRA initialisation, three ways:

   * ``bf16``: the base rounded to bfloat16 (``model.to(torch.bfloat16)``), held in fp32, with fp32 adapters: a
     block mixing bf16 and fp32 parameters is refused by the strategy (``TypeError: The parameters of one block must
     share a dtype``), and under ``bf16-mixed`` it streams these blocks in bf16 and every matmul computes with the
     same bf16 values as a bf16 base would;
   * ``bnb-nf4``: issue 27's item 1, the base reloaded with ``from_pretrained(..., quantization_config=
     BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
     bnb_4bit_compute_dtype=torch.bfloat16), device_map="cpu")``;
   * ``superpipe-nf4``: item 2, the fp32 base with ``SuperpipeStrategy(quantize_frozen="nf4-dq")``.

3. Reports the held-out loss (a split of the second text, token mean) of each before fine-tuning (the sanity check,
   where LoRA's B is zero) and after it, for ``--seeds`` (default 3), each seed, the mean and the spread; item 2's
   relative difference from item 1 (target: within 0.5%, checked on the means and on each seed) and both against the
   16-bit base; the packed 4-bit bytes of the frozen base in the strategy's homes (``memory_report()``'s
   ``packed_weight_bytes``) against their 16-bit bytes (2 x ``packed_weight_numel``); and each fine-tune's wall time.

The base is pretrained once (seed 0); the seeds vary the fine-tunes (LoRA initialisation, dropout, data order).
Writes ``report.md`` and ``results.json`` to ``--out`` (default ``benchmarks/results/qlora/``) and prints the report.

Usage::

    python benchmarks/bench_qlora.py                                   # CPU, about 13 minutes (1 thread)
    python benchmarks/bench_qlora.py --seeds 0 --pretrain-steps 100 --finetune-steps 10 --out /tmp/q  # smoke test
    python benchmarks/bench_qlora.py --hidden 512 --layers 8 --pretrain-steps 2000 --finetune-steps 300  # bigger
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import inspect
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.recipes.text_data import embedded_documents, pack_documents, split_rows
from lightning_superpipe.recipes.tokenization import ByteTokenizer

#: Item 2's held-out loss within this share of item 1's.
TARGET = 0.005
VARIANTS = ("bf16", "bnb-nf4", "superpipe-nf4")
LABELS = {"bf16": "16-bit base (bf16)", "bnb-nf4": "item 1: bitsandbytes NF4-dq",
          "superpipe-nf4": "item 2: quantize_frozen='nf4-dq'"}
#: Every linear layer of a Llama block: LoRA on all of them, as QLoRA does.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: The fine-tuning text: standard library source, unlike the documentation the base learnt.
FINETUNE_MODULES = ("argparse", "difflib", "dataclasses", "functools", "statistics", "configparser", "email.message",
                    "fractions", "calendar", "textwrap", "heapq", "csv", "json.decoder", "json.encoder")
VOCAB = 320  # the byte tokenizer's 259 ids, rounded up to a multiple of 64
COMPUTE = torch.bfloat16


def token_rows(documents: Sequence[str], seq_len: int, val_fraction: float) -> tuple[Tensor, Tensor]:
    """Byte tokens of ``documents`` packed into rows of ``seq_len``, split into training and held-out rows."""
    tokenizer = ByteTokenizer()
    rows = pack_documents([tokenizer.encode(text) for text in documents], seq_len, tokenizer.eos_token_id)
    return split_rows(rows.long(), val_fraction, seed=0)


def unigram_entropy(rows: Tensor) -> float:
    """Entropy (nats per token) of the tokens' frequencies in ``rows``: what a model of no context reaches."""
    counts = torch.bincount(rows.reshape(-1), minlength=VOCAB).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def make_base(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = args.hidden // 64
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=64, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
                         pad_token_id=256, bos_token_id=257, eos_token_id=258)
    return LlamaForCausalLM(config)


@torch.no_grad()
def held_out_loss(model: nn.Module, rows: Tensor, batch_size: int) -> float:
    """Token-mean loss of ``model`` (plain PyTorch, its own dtype) on ``rows``."""
    model.eval()
    losses = [model(input_ids=batch, labels=batch).loss.item() * len(batch) for batch in rows.split(batch_size)]
    return sum(losses) / len(rows)


@torch.no_grad()
def nf4_round_trip(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose block matrices hold bitsandbytes' NF4-dq round trip (the values items 1 and 2
    compute with), in fp32."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    rounded = copy.deepcopy(model)
    for param in rounded.model.layers.parameters():
        if param.dim() == 2:
            packed, state = quantize_4bit(param.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4")
            param.copy_(dequantize_4bit(packed, state))
    return rounded


def pretrain(args: argparse.Namespace, train: Tensor, held_out: Tensor) -> tuple[nn.Module, dict[str, Any]]:
    """The base: ``args.pretrain_steps`` fp32 AdamW steps (warm-up, cosine decay) on ``train``, seed 0."""
    torch.manual_seed(0)
    model = make_base(args).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.pretrain_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, s / args.pretrain_steps)))))
    order, generator, start, losses = torch.empty(0, dtype=torch.long), torch.Generator().manual_seed(0), 0, []
    began = time.perf_counter()
    for step in range(args.pretrain_steps):
        if start + args.batch_size > len(order):
            order, start = torch.randperm(len(train), generator=generator), 0
        batch = train[order[start:start + args.batch_size]]
        start += args.batch_size
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0 or step == args.pretrain_steps - 1:
            print(f"pretrain step {step}: loss {loss.item():.3f}", flush=True)
    figures = {"seconds": time.perf_counter() - began, "first_train_loss": losses[0],
               "last_train_loss": statistics.fmean(losses[-20:]), "unigram_entropy": unigram_entropy(train),
               "held_out_loss": held_out_loss(model, held_out, args.batch_size),
               "held_out_loss_nf4": held_out_loss(nf4_round_trip(model), held_out, args.batch_size),
               "params": sum(p.numel() for p in model.parameters()), "train_tokens": train.numel()}
    return model, figures


class LoraLM(pl.LightningModule):
    """A peft model trained on token rows; records the held-out loss of the sanity check (before training: LoRA's B
    is zero) and of the validation after the last step."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr
        self.sums: dict[str, list[float]] = {"before": [0.0, 0.0], "after": [0.0, 0.0]}

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        sums = self.sums["before" if self.trainer.sanity_checking else "after"]
        sums[0] += loss.item() * len(batch[0])
        sums[1] += len(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.0)

    def loss(self, when: str) -> float:
        total, rows = self.sums[when]
        if not rows:
            raise RuntimeError(f"no held-out loss {when} fine-tuning was recorded")
        return total / rows


class TrainClock(pl.Callback):
    """Seconds from the start of training to the validation after the last step."""

    superpipe_reads_no_weights = True  # clocks only

    def __init__(self) -> None:
        self.start = self.seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seconds = time.perf_counter() - self.start


def load_variant(variant: str, folder: Path) -> nn.Module:
    """The pretrained base in ``folder`` as ``variant`` fine-tunes it (before LoRA)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if variant == "bf16":  # bf16 values held in fp32: the strategy streams a block of one dtype (see the docstring)
        return AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).to(torch.float32)
    if variant == "bnb-nf4":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=COMPUTE)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")
    return AutoModelForCausalLM.from_pretrained(folder)


def finetune(args: argparse.Namespace, variant: str, folder: Path, seed: int, train: Tensor,
             held_out: Tensor) -> dict[str, Any]:
    """One fine-tune of ``variant`` with ``seed``: held-out losses before and after, wall time, the strategy's
    memory figures."""
    from peft import LoraConfig, get_peft_model

    base = load_variant(variant, folder)
    pl.seed_everything(seed, verbose=False)
    adapters = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05, target_modules=LORA_TARGETS)
    module = LoraLM(get_peft_model(base, adapters).train(), args.lr)
    quantize = "nf4-dq" if variant == "superpipe-nf4" else None
    strategy = SuperpipeStrategy(activations="recompute", quantize_frozen=quantize)
    clock = TrainClock()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                         max_steps=args.finetune_steps, val_check_interval=args.finetune_steps,
                         check_val_every_n_epoch=None, num_sanity_val_steps=-1, callbacks=[clock], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(TensorDataset(train), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    began = time.perf_counter()
    trainer.fit(module, loader, DataLoader(TensorDataset(held_out), batch_size=args.batch_size))
    fit_seconds = time.perf_counter() - began
    report = strategy.memory_report()
    memory = {key: report[key] for key in ("packed_weight_bytes", "packed_weight_numel", "streamed_block_bytes")
              if key in report}
    result = {"variant": variant, "seed": seed, "before": module.loss("before"), "after": module.loss("after"),
              "train_seconds": clock.seconds, "fit_seconds": fit_seconds, **memory}
    print(f"{variant} seed {seed}: held-out {result['before']:.4f} -> {result['after']:.4f},"
          f" {clock.seconds:.0f} s", flush=True)
    return result


def relative(a: float, b: float) -> float:
    """``a``'s relative difference from ``b``."""
    return (a - b) / b


def summarize(runs: list[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Per variant: losses per seed, mean, sample standard deviation, spread; the relative differences; bytes."""
    by = {v: {r["seed"]: r for r in runs if r["variant"] == v} for v in VARIANTS}
    summary: dict[str, Any] = {"variants": {}}
    for variant, seen in by.items():
        after = [seen[s]["after"] for s in seeds]
        entry: dict[str, Any] = {
            "after": after, "before": [seen[s]["before"] for s in seeds], "mean": statistics.fmean(after),
            "std": statistics.stdev(after) if len(after) > 1 else 0.0, "spread": max(after) - min(after),
            "train_seconds": [seen[s]["train_seconds"] for s in seeds],
        }
        first = seen[seeds[0]]
        if "packed_weight_bytes" in first:
            entry["packed_weight_bytes"], entry["packed_weight_numel"] = (first["packed_weight_bytes"],
                                                                         first["packed_weight_numel"])
            entry["bytes_vs_16bit"] = first["packed_weight_bytes"] / (2 * first["packed_weight_numel"])
        entry["streamed_block_bytes"] = first.get("streamed_block_bytes")
        summary["variants"][variant] = entry
    means = {v: summary["variants"][v]["mean"] for v in VARIANTS}
    per_seed = [relative(by["superpipe-nf4"][s]["after"], by["bnb-nf4"][s]["after"]) for s in seeds]
    summary["item2_vs_item1"] = {"of_means": relative(means["superpipe-nf4"], means["bnb-nf4"]), "per_seed": per_seed}
    summary["item1_vs_16bit"] = relative(means["bnb-nf4"], means["bf16"])
    summary["item2_vs_16bit"] = relative(means["superpipe-nf4"], means["bf16"])
    summary["target_met_on_means"] = abs(summary["item2_vs_item1"]["of_means"]) <= TARGET
    summary["target_met_every_seed"] = all(abs(x) <= TARGET for x in per_seed)
    return summary


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
             if line.startswith("model name")]
    cpu = names[0] if names else "unknown"
    versions = {name: importlib.import_module(name).__version__
                for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning")}
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "versions": versions}


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def render(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    """The markdown report of ``figures`` (what :func:`main` writes to ``results.json``)."""
    base, s, seeds, host = figures["pretrain"], figures["summary"], figures["seeds"], figures["machine"]
    v = s["variants"]
    lines = [
        "# QLoRA quality: LoRA on a 4-bit frozen base, streamed (issue 27, 'Quality')", "",
        f"- Date: {figures['date']}",
        f"- Machine: {host['cpu']}, {host['cores']} cores, {host['threads']} torch threads; "
        + ", ".join(f"{k} {x}" for k, x in host["versions"].items()),
        f"- Command: `{figures['command']}`", "",
        "## Setup", "",
        f"- Base: Llama-style, hidden {args.hidden}, {args.layers} blocks, intermediate {3 * args.hidden}, head_dim 64,"
        f" vocab {VOCAB} (byte tokens), {base['params']:,} parameters; sequences of {args.seq_len}, batches of"
        f" {args.batch_size}.",
        f"- Pretrained in fp32 on `pydoc_data.topics` ({base['train_tokens']:,} training tokens),"
        f" {args.pretrain_steps} steps in {base['seconds']:.0f} s: training loss {base['first_train_loss']:.3f} ->"
        f" {base['last_train_loss']:.3f}, held-out {base['held_out_loss']:.3f} nats/token against the text's unigram"
        f" entropy {base['unigram_entropy']:.3f} ({base['held_out_loss'] / base['unigram_entropy']:.2f}x); with its"
        f" block matrices rounded to NF4-dq (fp32 compute) {base['held_out_loss_nf4']:.3f}"
        f" ({pct(relative(base['held_out_loss_nf4'], base['held_out_loss']))}).",
        f"- Fine-tuned on the source of {', '.join(FINETUNE_MODULES)} ({figures['finetune_train_tokens']:,} training,"
        f" {figures['finetune_held_out_tokens']:,} held-out tokens): LoRA r={args.rank}, alpha={2 * args.rank},"
        f" dropout 0.05 on {', '.join(LORA_TARGETS)}; AdamW lr {args.lr}, {args.finetune_steps} steps;"
        " `Trainer(strategy=SuperpipeStrategy(activations='recompute', ...), precision='bf16-mixed')` on the CPU"
        " for all three; seeds vary LoRA's initialisation, dropout and data order.",
        f"- The fp32 base before fine-tuning: held-out loss {figures['base_fp32_held_out']:.4f} on the fine-tuning"
        " text (plain PyTorch, fp32).", "",
        "## Held-out loss after fine-tuning (nats/token)", "",
        "| variant | before | " + " | ".join(f"seed {x}" for x in seeds) + " | mean | std | spread | vs 16-bit |",
        "|---|---|" + "---|" * len(seeds) + "---|---|---|---|",
    ]
    for name in VARIANTS:
        e = v[name]
        versus = "" if name == "bf16" else pct(relative(e["mean"], v["bf16"]["mean"]))
        lines.append(f"| {LABELS[name]} | {statistics.fmean(e['before']):.4f} | "
                     + " | ".join(f"{x:.4f}" for x in e["after"])
                     + f" | {e['mean']:.4f} | {e['std']:.4f} | {e['spread']:.4f} | {versus} |")
    rel = s["item2_vs_item1"]
    met = "met" if s["target_met_on_means"] else "NOT met"
    lines += [
        "", "'before' is the held-out loss of the sanity check (LoRA's B is zero: the base as each variant computes"
        " it), averaged over the seeds.", "",
        f"**Item 2 against item 1: {pct(rel['of_means'])} on the means** (per seed: "
        + ", ".join(pct(x) for x in rel["per_seed"]) + f"). Target within {100 * TARGET:.1f}%: **{met}** on the"
        f" means; {'within' if s['target_met_every_seed'] else 'not within'} it on every seed.",
        f"Against the 16-bit base: item 1 {pct(s['item1_vs_16bit'])}, item 2 {pct(s['item2_vs_16bit'])}; for scale,"
        f" the 16-bit base's standard deviation across seeds is {100 * v['bf16']['std'] / v['bf16']['mean']:.2f}% of"
        " its mean.", "",
        "## Frozen base bytes (strategy's `memory_report()`)", "",
        "| variant | packed_weight_numel | packed_weight_bytes | 16-bit bytes (2 x numel) | ratio |"
        " streamed_block_bytes (run) |", "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        e = v[name]
        if "packed_weight_bytes" in e:
            lines.append(f"| {LABELS[name]} | {e['packed_weight_numel']:,} | {e['packed_weight_bytes']:,} |"
                         f" {2 * e['packed_weight_numel']:,} | {e['bytes_vs_16bit']:.3f} |"
                         f" {e['streamed_block_bytes']:,} |")
        else:
            lines.append(f"| {LABELS[name]} | - | - | - | - | {e['streamed_block_bytes']:,} |")
    lines += ["", "## Fine-tune wall time (s, training steps; shared CPU, indicative only)", "",
              "| variant | " + " | ".join(f"seed {x}" for x in seeds) + " | mean | s/step |",
              "|---|" + "---|" * len(seeds) + "---|---|"]
    for name in VARIANTS:
        times = v[name]["train_seconds"]
        mean = statistics.fmean(times)
        lines.append(f"| {LABELS[name]} | " + " | ".join(f"{x:.1f}" for x in times)
                     + f" | {mean:.1f} | {mean / args.finetune_steps:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--hidden", type=int, default=192, help="hidden size, a multiple of 64")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=2e-3, help="the fine-tunes' learning rate")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a shared 2-core machine one thread"
                        " measured 4-20x faster than two)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/qlora"))
    args = parser.parse_args()
    if args.hidden % 64:
        parser.error("--hidden must be a multiple of 64 (bitsandbytes' CPU dequantize needs it)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    pre_train, pre_held_out = token_rows(embedded_documents(), args.seq_len, args.val_fraction)
    sources = [inspect.getsource(importlib.import_module(name)) for name in FINETUNE_MODULES]
    tune_train, tune_held_out = token_rows(sources, args.seq_len, args.val_fraction)
    base, pretrain_figures = pretrain(args, pre_train, pre_held_out)
    base_fp32 = held_out_loss(base, tune_held_out, args.batch_size)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        del base
        for seed in args.seeds:
            for variant in VARIANTS:
                runs.append(finetune(args, variant, Path(folder), seed, tune_train, tune_held_out))
    figures = {"date": date, "command": command, "machine": machine(), "args": {k: str(x) for k, x in
               vars(args).items()}, "seeds": args.seeds, "pretrain": pretrain_figures,
               "finetune_train_tokens": tune_train.numel(), "finetune_held_out_tokens": tune_held_out.numel(),
               "base_fp32_held_out": base_fp32, "runs": runs, "summary": summarize(runs, args.seeds)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(figures, indent=2) + "\n")
    report = render(args, figures)
    (args.out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
