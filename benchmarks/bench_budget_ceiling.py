"""The memory budget as a ceiling, on the fine-tuning recipes as shipped (their embedded models).

For each recipe, one run with a budget too large to constrain anything gives the profile; from it, the least
placement's predicted peak and the all-resident one's. Then a sweep of budgets between the two: each run profiles
itself, applies its plan, and reports the plan's predicted peak and the peak measured once it was applied (the
strategy's ledger: weights, gradients, the activations saved in the blocks and outside them), and the run's own
peak (profiled steps included). On the CPU link and on the emulated asynchronous link.

    python benchmarks/bench_budget_ceiling.py [--recipes finetune_full finetune_lora finetune_qlora] [--budgets 5]

Prints a markdown table, and writes it with the raw figures to benchmarks/results/budget_ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_superpipe.planning.cost import predict
from lightning_superpipe.planning.solver import minimum_plan
from lightning_superpipe.recipes import CausalLMModule, TextDataModule
from lightning_superpipe.recipes.cli import SuperpipeCLI
from lightning_superpipe.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
LINKS = {"cpu": None, "emulated": {"class_path": "lightning_superpipe.EmulatedLink", "init_args": {"mode": "thread"}}}


def run(recipe: str, budget: int, link: str, steps: int, root: str) -> Any:
    """One short fit of ``recipe`` under ``budget`` bytes; the strategy after it."""
    args = [
        "--config", str(ROOT / "recipes" / f"{recipe}.yaml"),
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", root,
        "--trainer.strategy.init_args.memory_budget", str(budget),
    ]
    if LINKS[link] is not None:
        args += ["--trainer.strategy.init_args.link", json.dumps(LINKS[link])]
    cli = SuperpipeCLI(CausalLMModule, TextDataModule, args=args, run=False, auto_configure_optimizers=False,
                       save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.trainer.strategy


def sweep(recipe: str, link: str, budgets: int, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        profile = run(recipe, 2**40, link, 3, root)._planner.profile
        count = len(profile.blocks)
        least = minimum_plan(profile).predicted_peak_bytes
        everything = predict(profile, range(count), 1, ["keep"] * count).peak_bytes
        rows = []
        # A little room over the least: each run profiles itself, and its figures move by a few bytes.
        for budget in np.linspace(1.03 * least, 1.1 * everything, budgets).astype(int).tolist():
            start = time.perf_counter()
            strategy = run(recipe, budget, link, steps, root)
            plan, report = strategy.plan, strategy.memory_report()
            rows.append({
                "recipe": recipe, "link": link, "budget_bytes": budget,
                "plan": f"{len(plan.resident)} / {plan.prefetch} / {_modes(plan.activations)}",
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": plan.measured_peak_bytes,
                "run_peak_bytes": report["peak_device_bytes"],
                "peak_corrections": strategy._planner.peak_corrections,
                "seconds": time.perf_counter() - start,
            })
            print(_row(rows[-1]), flush=True)
        return rows


def _modes(modes: list[str]) -> str:
    counts = {mode: modes.count(mode) for mode in dict.fromkeys(modes)}
    return ", ".join(f"{n} {mode}" for mode, n in counts.items())


def _row(row: dict[str, Any]) -> str:
    measured, predicted = row["measured_peak_bytes"], row["predicted_peak_bytes"]
    return (
        f"| {row['recipe']} | {row['link']} | {format_bytes(row['budget_bytes'])} | {row['plan']} |"
        f" {format_bytes(predicted)} | {format_bytes(measured)} | {predicted / measured:.3f} |"
        f" {format_bytes(row['run_peak_bytes'])} | {row['peak_corrections']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["finetune_full", "finetune_lora", "finetune_qlora"])
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run: 2 profiled, then the plan's")
    options = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.WARNING)
    print("| recipe | link | budget | plan (resident / prefetch / activations) | predicted peak | measured peak |"
          " predicted / measured | run's peak | corrections |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [row for recipe in options.recipes for link in options.links
            for row in sweep(recipe, link, options.budgets, options.steps)]
    over = [row for row in rows if row["run_peak_bytes"] > row["budget_bytes"]]
    worst = max(abs(row["predicted_peak_bytes"] / row["measured_peak_bytes"] - 1) for row in rows)
    print(f"\n{len(rows)} runs; over the budget: {len(over)}; prediction off by at most {worst:.1%}.")
    out = ROOT / "benchmarks" / "results" / "budget_ceiling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
