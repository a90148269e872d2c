"""The clipped recipes of ``bench_streaming.py --recipes clipped``: what the host optimizer step leaves exposed when
clipping by norm decides after backward, for each way the step can run.

With knobs ``resident=1, prefetch=1, activations=recompute``, one run each of:

* no clipping, the step overlapped with backward: the reference for the step time;
* clipping by norm that never fires (``gradient_clip_val=1e9``) and that always fires (``1e-6``), each with the
  serial step (``overlap_optimizer=False``), the speculative step and the pipelined step.

Per measured step (after the warm-up, whose first steps allocate the optimizer state), the exposed optimizer time is
the time from the end of backward to the end of the step (as ``AfterBackwardTimer`` measures it), plus what the loop
then waits for that step's pending (pipelined) block steps until the next backward ends: the engine's own count of
those waits (``memory_report()["pipelined_wait_s"]``, taken per step), whether the next forward waits block by block
or a settle waits for all at once (reported apart as ``settle_wait_s``). Each run trains one trailing step, whose
forward waits for the last measured step.

Targets (on 2 CPU cores, ``--threads 1`` so that the host step has a core of its own): the speculative step's exposed
time at most 25% of the serial step's where clipping never fires; the pipelined step's at most 60% of the serial
step's, whether clipping fires or not; the step time with clipping that never fires (speculative) within 1.05x of
the step without clipping. Writes ``streaming_clipped_<device>.md`` and ``.json`` next to the knobs table.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.stepping.pipelined import WINDOW_HOOKS, weight_readers

#: (name, gradient_clip_val): no clipping, clipping by norm that never fires, that always fires.
CLIP_CASES = (("no clip", None), ("never fires", 1e9), ("always fires", 1e-6))

#: (name, overlap_optimizer) with clipping; without it the reference is the overlapped step.
MODES = (("serial", False), ("speculative", "speculative"), ("pipelined", "pipelined"))

#: Exposed time of the mode over the serial step's, at most (the clip cases it applies to).
EXPOSED_TARGETS = {"speculative": (0.25, ("never fires",)), "pipelined": (0.60, ("never fires", "always fires"))}

#: Step time with clipping that never fires (speculative) over the step without clipping, at most.
STEP_TIME_TARGET = 1.05


class ExposedTimer(pl.Callback):
    """Per step: the time from the end of backward to the end of the step, and what the loop waits afterwards for
    the step's pending block steps, until the next backward ends (by then the forward and ``zero_grad`` waited for
    every one). Backward ends where the engine's ``finish_backward`` starts, as for ``AfterBackwardTimer``."""

    # It reads clocks only: without this the strategy would wait for a pipelined step before its hooks.
    superpipe_reads_no_weights = True

    def __init__(self) -> None:
        self.times: list[float] = []  # end of backward -> end of step
        self.waits: list[float] = []  # the next forward's waits for this step's pending steps
        self.settle_waits: list[float] = []  # the part of those that a settle (all at once) waited
        self.weight_readers: dict[str, list[str]] = {}
        self._backward_end = 0.0
        self._settle_waited = 0.0
        self._mark: Optional[tuple[float, float]] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine
        pending = engine.pending
        finish_backward, settle = engine.finish_backward, pending.settle
        device = trainer.strategy.root_device

        def timed_finish_backward() -> None:
            _sync(device)
            self._backward_end = time.perf_counter()
            if self._mark is not None:  # the waits since the last step ended were for its pending steps
                waited, settled = self._mark
                self.waits.append(pending.waited_s - waited)
                self.settle_waits.append(self._settle_waited - settled)
                self._mark = None
            finish_backward()

        def timed_settle() -> None:
            before = pending.waited_s
            settle()
            self._settle_waited += pending.waited_s - before

        engine.finish_backward = timed_finish_backward
        pending.settle = timed_settle
        # Hooks the strategy waits for pending steps before (none expected: that would measure a serial step).
        self.weight_readers = {hook: weight_readers(trainer, hook) for hook in WINDOW_HOOKS}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        _sync(trainer.strategy.root_device)
        self.times.append(time.perf_counter() - self._backward_end)
        self._mark = (trainer.strategy.engine.pending.waited_s, self._settle_waited)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def run_recipe(
    args: argparse.Namespace, run_one: Callable[..., dict[str, Any]], clip: Optional[float], overlap: Any
) -> dict[str, Any]:
    """One run: ``run_one`` (bench_streaming's) with clipping ``clip`` and ``overlap_optimizer=overlap``."""
    strategy = SuperpipeStrategy(resident_blocks=1, prefetch=1, activations="recompute", overlap_optimizer=overlap)
    timer = ExposedTimer()
    run_args = argparse.Namespace(**{**vars(args), "clip": clip})
    result = run_one(run_args, strategy, args.token_sweep[0], after_backward=timer, trailing=1)
    measured = slice(args.warmup, args.warmup + args.steps)
    after, waits = timer.times[measured], timer.waits[measured]
    report = strategy.memory_report()
    result.update(
        exposed_s=_median([a + w for a, w in zip(after, waits)]),
        wait_s=_median(waits),
        settle_wait_s=_median(timer.settle_waits[measured]),
        exposed_per_step_s=[a + w for a, w in zip(after, waits)],
        modes=report["optimizer_step_modes"],
        committed=report["speculative_steps_committed"],
        redone=report["speculative_steps_redone"],
        discarded=report["speculative_steps_discarded"],
        pipelined_wait_s=report["pipelined_wait_s"],
        waiting_hooks={hook: names for hook, names in timer.weight_readers.items() if names},
    )
    return result


def clipped_recipes(args: argparse.Namespace, run_one: Callable[..., dict[str, Any]]) -> None:
    """Runs every clip case and mode, prints the table and the targets, writes them to ``args.out``."""
    rows: list[dict[str, Any]] = []
    for case, clip in CLIP_CASES:
        modes = (("overlapped", True),) if clip is None else MODES
        for mode, overlap in modes:
            result = run_recipe(args, run_one, clip, overlap)
            rows.append({"clip": case, "gradient_clip_val": clip, "mode": mode, **result})
    by_key = {(row["clip"], row["mode"]): row for row in rows}
    reference = by_key[("no clip", "overlapped")]
    for row in rows:
        serial = by_key.get((row["clip"], "serial"))
        row["exposed_ratio"] = row["exposed_s"] / serial["exposed_s"] if serial and serial["exposed_s"] else None
        row["step_ratio"] = row["step_s"] / reference["step_s"]
    checks = target_checks(by_key)
    report = "\n".join(_table(args, rows) + [""] + [check["line"] for check in checks])
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"streaming_clipped_{args.device}.md").write_text(report + "\n")
    (args.out / f"streaming_clipped_{args.device}.json").write_text(
        json.dumps({"settings": _settings(args), "rows": rows, "targets": checks}, indent=2)
    )


def target_checks(by_key: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """PASS or FAIL for each target, with its numbers."""
    checks = []
    for mode, (limit, cases) in EXPOSED_TARGETS.items():
        for case in cases:
            row, serial = by_key[(case, mode)], by_key[(case, "serial")]
            ratio = row["exposed_ratio"]
            passed = ratio is not None and ratio <= limit
            checks.append({
                "target": f"{mode} exposed / serial exposed, clipping {case}", "limit": limit, "value": ratio,
                "passed": passed,
                "line": f"{'PASS' if passed else 'FAIL'}: {mode} exposed / serial exposed, clipping {case}:"
                f" {_ratio(ratio)} (target <= {limit:.0%}; {row['exposed_s'] * 1e3:.1f} ms vs"
                f" {serial['exposed_s'] * 1e3:.1f} ms)",
            })
    clipped, reference = by_key[("never fires", "speculative")], by_key[("no clip", "overlapped")]
    ratio = clipped["step_ratio"]
    passed = ratio <= STEP_TIME_TARGET
    checks.append({
        "target": "step time, clipping never fires (speculative) / no clipping (overlapped)",
        "limit": STEP_TIME_TARGET, "value": ratio, "passed": passed,
        "line": f"{'PASS' if passed else 'FAIL'}: step time, clipping never fires (speculative) / no clipping"
        f" (overlapped): {ratio:.3f}x (target <= {STEP_TIME_TARGET:.2f}x; {clipped['step_s']:.3f} s vs"
        f" {reference['step_s']:.3f} s)",
    })
    return checks


def _table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"# superpipe optimizer step with clipping ({args.device}, preset {args.preset}, {args.precision},"
        f" AdamW {args.optimizer}, {torch.get_num_threads()} torch threads, r=1 p=1 recompute,"
        f" {rows[0]['tokens']} tokens/step, median of {args.steps} steps after {args.warmup} warm-up)",
        "",
        "| clipping | step mode | step s | step / no clip | after backward ms | next forward waits ms"
        " | exposed ms | exposed / serial | modes run | spec. committed/redone/discarded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        modes = ", ".join(f"{mode} {count}" for mode, count in row["modes"].items() if count)
        waits = f"{row['wait_s'] * 1e3:.1f}"
        if row["settle_wait_s"]:
            waits += f" (settle {row['settle_wait_s'] * 1e3:.1f})"
        lines.append(
            f"| {row['clip']} | {row['mode']} | {row['step_s']:.3f} | {row['step_ratio']:.3f}x"
            f" | {row['after_backward_s'] * 1e3:.1f} | {waits} | {row['exposed_s'] * 1e3:.1f}"
            f" | {_ratio(row['exposed_ratio'])} | {modes} | {row['committed']}/{row['redone']}/{row['discarded']} |"
        )
    lines += [
        "",
        "Exposed: end of backward to the end of the step, plus the loop's waits for that step's pending (pipelined)"
        " block steps until the next backward ends; '(settle x)': the part waited for all pending steps at once"
        " rather than block by block as the forward needs them.",
    ]
    for row in rows:
        if row["waiting_hooks"]:
            lines.append(f"Warning: {row['clip']}, {row['mode']}: the strategy waits before {row['waiting_hooks']}")
    return lines


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("device", "preset", "precision", "optimizer", "seq", "steps", "warmup", "token_sweep")
    return {**{key: getattr(args, key) for key in keys}, "threads": torch.get_num_threads()}
