"""Time of the paged experts' calibration on the ``eval_moe_paged`` recipe's model: what ``PagedMoECallback`` does
before the first validation batch.

Builds the recipe's model and data as ``superpipe validate --config recipes/eval_moe_paged.yaml`` does (random
weights, Python's documentation), takes the first ``calibration_batches`` validation batches, and times
``page_experts(model, expert_budget=..., calibration=batches)`` and, within it, ``PagedExperts.calibrate``: the
batches through the original experts, then every expert matrix rounded again with its Hessian (GPTQ). Each round
builds the model again, so every round times the same work.

Usage::

    python benchmarks/bench_moe_calibration.py                  # torch's default threads, 3 rounds
    python benchmarks/bench_moe_calibration.py --threads 1 --rounds 5
    # an earlier commit's package, for comparison
    git archive COMMIT lightning_superpipe | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python benchmarks/bench_moe_calibration.py

The CPU should be otherwise idle: with other work on the cores, every operation of the column loop may wait for a
thread that is not running, and the times grow several-fold.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from itertools import islice
from pathlib import Path

import torch
import yaml
from lightning.pytorch import seed_everything

from lightning_superpipe.moe import page_experts
from lightning_superpipe.moe.api import PagedExperts
from lightning_superpipe.recipes import CausalLMModule, TextDataModule
from lightning_superpipe.recipes.cli import SuperpipeCLI

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "eval_moe_paged.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=RECIPE, help="the recipe whose model and data are used")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def one_round(config: Path) -> tuple[float, float, float]:
    """Seconds of ``page_experts`` and of the calibration within it, on a freshly built model, and the calibration's
    process CPU seconds (with one thread, the figure that other work on the machine changes least)."""
    paging = yaml.safe_load(config.read_text())["trainer"]["callbacks"][1]["init_args"]
    seed_everything(42, verbose=False)
    cli = SuperpipeCLI(CausalLMModule, TextDataModule, args=["--config", str(config)], run=False,
                       save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)
    cli.datamodule.setup("validate")
    batches = [dict(batch) for batch in islice(cli.datamodule.val_dataloader(), paging["calibration_batches"])]
    model = cli.model.model.eval()
    calibrate, spent = PagedExperts.calibrate, []
    # No progress lines during the timing (a package from before progress has none to turn off).
    quiet = {"progress": False} if "progress" in inspect.signature(page_experts).parameters else {}

    def timed(handle: PagedExperts, *args: object, **kwargs: object) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        calibrate(handle, *args, **kwargs)
        spent.append((time.perf_counter() - started, time.process_time() - cpu))

    PagedExperts.calibrate = timed  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        handle = page_experts(model, expert_budget=paging["expert_budget"], calibration=batches, **quiet)
        total = time.perf_counter() - started
    finally:
        PagedExperts.calibrate = calibrate  # type: ignore[method-assign]
    handle.restore()
    return total, *spent[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rounds = [one_round(args.config) for _ in range(args.rounds)]
    for i, (total, calibration, cpu) in enumerate(rounds, 1):
        print(f"round {i}: page_experts {total:.1f} s, of which calibration {calibration:.1f} s ({cpu:.1f} CPU s)")
    for name, index in (("wall", 1), ("process CPU", 2)):
        figures = [figure[index] for figure in rounds]
        print(f"calibration on {torch.get_num_threads()} threads, {name} time: median "
              f"{statistics.median(figures):.2f} s, {min(figures):.2f} to {max(figures):.2f} s")


if __name__ == "__main__":
    main()
