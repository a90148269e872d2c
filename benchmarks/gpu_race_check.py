"""Race checks of the streaming engine on a CUDA GPU: delay injection, launch blocking, CUDA sanitizer, profiler.

Every check trains the same model with ``Trainer(strategy=SuperpipeStrategy(...), deterministic=True)``: a stack of
wide residual MLP blocks (fp32 by default), sized so that one block's compute takes longer than its copy, so the
GPU, not the link, is the bottleneck and copies really run behind compute.

Subcommands (each writes one JSON result to ``--json``; exit status 0 when its checks passed, 1 when one failed):

  race             Delay injection. Two undelayed runs must agree bit for bit (the control); then the same run with
                   ``torch.cuda._sleep`` injected on one side at a time must agree bit for bit with the first:
                   (a) on the compute stream before each wait for a copy (slow compute: a copy into a slot that
                   compute still reads would overwrite it), (b) on the host-to-device stream before each copy (slow
                   uploads: compute that does not wait would read stale or partial weights), (c) on the
                   device-to-host stream before each gradient copy (slow downloads: the host would add stale
                   staging), (d) ``time.sleep`` in the gradient worker before it waits (slow host adds: a staging
                   buffer reused too early, or ``.grad`` read before the adds are done); and (e) a positive control,
                   (b) with compute's waits removed, which must differ (else the delays have no teeth). The delays are
                   monkeypatched onto ``CudaCopier`` / ``GradientReturn`` here; the product code is untouched.
  launch-blocking  The same fit in a subprocess under ``CUDA_LAUNCH_BLOCKING=1``, bit for bit against this process.
  sanitizer        A 2-step fit in a subprocess under ``TORCH_CUDA_SANITIZER=1``: passed, or what CSAN reported.
  profile          A few streamed steps under ``torch.profiler``: every copy the engine issues is pinned and runs
                   on a side stream, how much copy time overlaps kernel time, and the copies' GB/s against a plain
                   pinned ``copy_(non_blocking=True)`` of the same size.
  run              One undelayed streamed fit, saved to ``--save`` (what launch-blocking and sanitizer run).

``--device cpu`` runs the same code paths on the CPU with a tiny model (delays become no-ops that only count their
calls, the profiler is skipped), to check the script itself on a machine without a GPU.

Usage:
    python benchmarks/gpu_race_check.py race --json race.json
    python benchmarks/gpu_race_check.py race --device cpu --json /tmp/race.json     # a smoke test of the script
"""

from __future__ import annotations

import os

# Deterministic cuBLAS needs this before the first cuBLAS call (Lightning sets it only when the Trainer is made,
# after the calibration here has already run GEMMs). 8 x 4 MiB is also sm90's default workspace size.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import copy
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.streaming import copier as copier_module
from lightning_superpipe.streaming.gradients import GradientReturn

OUT_FEATURES = 16

# Per subcommand and device: sizes chosen so that on an H200 a block's fp32 forward (~5 ms for 4096 x 2048 ->
# 8192 -> 2048) is longer than its pinned upload (~134 MB at ~50 GB/s, ~2.7 ms), and a run takes seconds.
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {
        "default": dict(width=2048, depth=8, tokens=4096, steps=3, accumulate=2),
        # CSAN runs every operator through Python with a stack trace: a smaller model, 2 optimizer steps.
        "sanitizer": dict(width=1024, depth=4, tokens=1024, steps=2, accumulate=1),
        "profile": dict(width=2048, depth=8, tokens=4096, steps=3, accumulate=1),
    },
    "cpu": {
        "default": dict(width=64, depth=4, tokens=32, steps=2, accumulate=2),
        "sanitizer": dict(width=64, depth=4, tokens=32, steps=2, accumulate=1),
        "profile": dict(width=64, depth=4, tokens=32, steps=3, accumulate=1),
    },
}
# Seconds a subcommand plans to finish within (the shell's `timeout` is the hard stop, a little later).
DEADLINES = {"race": 135.0, "launch-blocking": 52.0, "sanitizer": 52.0, "profile": 52.0, "run": 600.0}


@dataclass
class Config:
    """One streamed fit: the model, the data and the strategy's knobs."""

    device: str = "cuda"
    width: int = 2048
    depth: int = 8
    tokens: int = 4096  # rows per micro-batch (each row is one "token" of `width` features)
    steps: int = 3  # optimizer steps
    accumulate: int = 2  # micro-batches per optimizer step (covers `.grad +=` on the worker)
    resident: int = 1
    prefetch: int = 1
    precision: str = "32-true"
    lr: float = 1e-3
    seed: int = 0

    def argv(self) -> list[str]:
        """The command-line options that rebuild this config in a subprocess."""
        return [f"--{f.name}={getattr(self, f.name)}" for f in fields(self)]


# --------------------------------------------------------------------------------------------------- the model


class Block(nn.Module):
    """A wide residual MLP block: two GEMMs of 8 x width^2 multiply-adds per row, 8 x width^2 parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.norm(self.down(F.gelu(self.up(x))))


class Stack(nn.Module):
    """Stem and head stay resident (the trunk, with its own gradient path); the blocks stream."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, OUT_FEATURES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class StackTask(pl.LightningModule):
    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[Tensor] = []

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        # MSE, not cross-entropy: its CUDA kernels are deterministic under `use_deterministic_algorithms`.
        loss = F.mse_loss(self.model(x), y)
        # Kept on the device: `.item()` would synchronize every step and hide races between steps.
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Fused CPU AdamW, as the README recommends; its normalisation also amplifies any stray difference.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


def make_template(cfg: Config) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return Stack(cfg.width, cfg.depth)


def make_data(cfg: Config) -> TensorDataset:
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    rows = cfg.steps * cfg.accumulate * cfg.tokens
    return TensorDataset(
        torch.randn(rows, cfg.width, generator=generator), torch.randn(rows, OUT_FEATURES, generator=generator)
    )


@dataclass
class RunResult:
    losses: Tensor
    state: dict[str, Tensor]
    wall_s: float
    report: dict[str, Any] = field(default_factory=dict)


def streamed_fit(
    cfg: Config, template: nn.Module, data: TensorDataset, callbacks: Sequence[pl.Callback] = ()
) -> RunResult:
    """One streamed fit from a copy of ``template`` (the strategy re-homes and re-classes the parameters it
    streams, so every run gets fresh ones)."""
    _free_memory()
    pl.seed_everything(cfg.seed, verbose=False)
    task = StackTask(copy.deepcopy(template), cfg.lr)
    strategy = SuperpipeStrategy(resident_blocks=cfg.resident, prefetch=cfg.prefetch, blocks={Block})
    trainer = pl.Trainer(
        accelerator="gpu" if cfg.device == "cuda" else "cpu", devices=1, strategy=strategy, precision=cfg.precision,
        max_steps=cfg.steps, accumulate_grad_batches=cfg.accumulate, deterministic=True, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=list(callbacks),
    )
    start = time.perf_counter()
    trainer.fit(task, DataLoader(data, batch_size=cfg.tokens, shuffle=False))
    _synchronize(cfg)
    wall = time.perf_counter() - start
    losses = torch.stack(task.losses).cpu()
    state = {name: tensor.detach().cpu().clone() for name, tensor in task.model.state_dict().items()}
    report = {k: v for k, v in strategy.memory_report().items() if isinstance(v, (int, float))}
    del trainer, task, strategy
    _free_memory()
    return RunResult(losses, state, wall, report)


def _synchronize(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _free_memory() -> None:
    gc.collect()  # Trainer and LightningModule reference each other: only the collector frees a finished run
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def save_run(result: RunResult, path: Path) -> None:
    torch.save({"losses": result.losses, "state": result.state, "wall_s": result.wall_s}, path)


def load_run(path: Path) -> RunResult:
    saved = torch.load(path, weights_only=True)
    return RunResult(saved["losses"], saved["state"], float(saved["wall_s"]))


# --------------------------------------------------------------------------------------------------- comparing


def _bits(tensor: Tensor) -> Tensor:
    """The raw bytes: bitwise equality (``torch.equal`` says NaN != NaN and -0.0 == 0.0)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _finite(tensor: Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _max_abs_difference(a: Tensor, b: Tensor) -> float:
    """NaN-aware: ``inf`` for different shapes, ``nan`` if either holds a NaN or an infinity."""
    if a.shape != b.shape:
        return math.inf
    if not (_finite(a) and _finite(b)):
        return math.nan
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def compare(reference: RunResult, other: RunResult) -> dict[str, Any]:
    """Bitwise comparison of losses and final weights; equal only if every value is finite too."""
    keys_equal = reference.state.keys() == other.state.keys()
    differing = [
        name for name, tensor in reference.state.items()
        if name not in other.state or not _bitwise_equal(tensor, other.state[name])
    ]
    finite = all(_finite(t) for run in (reference, other) for t in [run.losses, *run.state.values()])
    weight_differences = [
        _max_abs_difference(tensor, other.state[name])
        for name, tensor in reference.state.items()
        if name in other.state
    ]
    losses_equal = _bitwise_equal(reference.losses, other.losses)
    return {
        "equal": losses_equal and keys_equal and not differing and finite,
        "losses_equal": losses_equal,
        "weights_equal": keys_equal and not differing,
        "finite": finite,
        "num_losses": [int(reference.losses.numel()), int(other.losses.numel())],
        "max_abs_loss_difference": _max_abs_difference(reference.losses.double(), other.losses.double()),
        "max_abs_weight_difference": _nan_max(weight_differences) if keys_equal else math.inf,
        "num_differing_tensors": len(differing),
        "differing_tensors": differing[:8],
    }


def _nan_max(values: Sequence[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


# --------------------------------------------------------------------------------------------------- delays


@dataclass
class Delays:
    """What one delayed run injects, and how often it did (0 means the patch missed: the case is void)."""

    gpu_cycles: int
    host_seconds: float
    injected: int = 0


def _gpu_sleep(cycles: int, stream: Any) -> None:
    """Queues a spin of ``cycles`` GPU clock cycles on ``stream``; nothing on a CPU run or without a stream."""
    if cycles <= 0 or stream is None or not torch.cuda.is_available():
        return
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def _patch(stack: ExitStack, owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces ``owner.name`` by ``wrap(owner.name)`` until ``stack`` closes."""
    if not callable(getattr(owner, name, None)):
        raise AttributeError(f"{owner.__name__}.{name} does not exist any more: update the delay case in {__file__}")
    own = owner.__dict__.get(name)
    setattr(owner, name, wrap(getattr(owner, name)))
    stack.callback(lambda: setattr(owner, name, own) if own is not None else delattr(owner, name))


def _copier_class(cfg: Config) -> type:
    """The class whose methods the engine calls on this device (patched at class level: the engine makes its
    copier inside ``Trainer.fit``)."""
    return copier_module.CudaCopier if cfg.device == "cuda" else copier_module.Copier


def _compute_before_wait(stack: ExitStack, cfg: Config, delays: Delays) -> None:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_on_compute(self: Any, event: Any) -> None:
            delays.injected += 1
            # On the stream compute is issued on now (the autograd thread's in backward), before the wait.
            _gpu_sleep(delays.gpu_cycles, torch.cuda.current_stream(self.device) if cfg.device == "cuda" else None)
            original(self, event)

        return wait_on_compute

    _patch(stack, _copier_class(cfg), "wait_on_compute", wrap)


def _h2d_before_copy(stack: ExitStack, cfg: Config, delays: Delays) -> None:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def to_device(self: Any, *args: Any, **kwargs: Any) -> Any:
            delays.injected += 1
            # Queued ahead of the copy's own wait and copy: the upload starts late and ends late.
            _gpu_sleep(delays.gpu_cycles, getattr(self, "_h2d_stream", None))
            return original(self, *args, **kwargs)

        return to_device

    _patch(stack, _copier_class(cfg), "to_device", wrap)


def _d2h_before_copy(stack: ExitStack, cfg: Config, delays: Delays) -> None:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def to_host(self: Any, *args: Any, **kwargs: Any) -> Any:
            delays.injected += 1
            _gpu_sleep(delays.gpu_cycles, getattr(self, "_d2h_stream", None))
            return original(self, *args, **kwargs)

        return to_host

    _patch(stack, _copier_class(cfg), "to_host", wrap)


def _worker_before_wait(stack: ExitStack, cfg: Config, delays: Delays) -> None:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def _accumulate(self: Any, *args: Any, **kwargs: Any) -> Any:
            delays.injected += 1
            time.sleep(delays.host_seconds)  # on the worker thread, before it waits for the copy's event
            return original(self, *args, **kwargs)

        return _accumulate

    _patch(stack, GradientReturn, "_accumulate", wrap)


def _no_wait_and_h2d_slow(stack: ExitStack, cfg: Config, delays: Delays) -> None:
    """The positive control: (b)'s slow uploads with compute's waits removed must change the result, or the delays
    are too short to catch a missing wait."""
    _h2d_before_copy(stack, cfg, delays)

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_on_compute(self: Any, event: Any) -> None:
            pass  # sabotage: compute reads what the copies have written so far

        return wait_on_compute

    _patch(stack, _copier_class(cfg), "wait_on_compute", wrap)


#: name -> (what is injected, how, whether the run must stay bitwise equal to the undelayed one)
CASES: dict[str, tuple[str, Callable[[ExitStack, Config, Delays], None], bool]] = {
    "a_compute_slow_before_wait": (
        "torch.cuda._sleep on the compute stream in wait_on_compute, before the wait", _compute_before_wait, True
    ),
    "b_h2d_slow_before_copy": (
        "torch.cuda._sleep on the h2d stream before each copy in to_device", _h2d_before_copy, True
    ),
    "c_d2h_slow_before_copy": (
        "torch.cuda._sleep on the d2h stream before each gradient copy in to_host", _d2h_before_copy, True
    ),
    "d_worker_slow_before_wait": (
        "time.sleep in GradientReturn._accumulate (the worker) before it waits", _worker_before_wait, True
    ),
    "e_positive_control_no_wait": (
        "as (b), with wait_on_compute made a no-op: must DIFFER (else the delays are too short to catch a missing"
        " wait)",
        _no_wait_and_h2d_slow,
        False,
    ),
}


@contextmanager
def delayed(case: str, cfg: Config, delays: Delays) -> Iterator[None]:
    with ExitStack() as stack:
        CASES[case][1](stack, cfg, delays)
        yield


# --------------------------------------------------------------------------------------------------- calibration


def _time_ms(fn: Callable[[], Any], reps: int = 5, warmup: int = 2) -> float:
    """Mean milliseconds of ``fn``'s GPU work, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _transfer_itemsize(cfg: Config) -> int:
    return 2 if cfg.precision.startswith(("bf16", "16")) else 4


def _block_timings(cfg: Config, device: torch.device) -> tuple[float, float, float, int]:
    """One block's forward and forward+backward times, its upload time and its transfer bytes, in ms and bytes; the
    block and its buffers go with the call."""
    block = Block(cfg.width).to(device)
    x = torch.randn(cfg.tokens, cfg.width, device=device)
    low = torch.bfloat16 if cfg.precision.startswith("bf16") else torch.float16
    autocast = dict(device_type="cuda", dtype=low, enabled="mixed" in cfg.precision)

    def forward() -> None:
        with torch.no_grad(), torch.autocast(**autocast):
            block(x)

    def train() -> None:
        with torch.autocast(**autocast):
            out = block(x.requires_grad_())
        out.float().sum().backward()

    forward_ms = _time_ms(forward)
    train_ms = _time_ms(train)
    block_bytes = sum(p.numel() for p in block.parameters()) * _transfer_itemsize(cfg)
    src = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(block_bytes, dtype=torch.uint8, device=device)
    copy_ms = _time_ms(lambda: dst.copy_(src, non_blocking=True))
    return forward_ms, train_ms, copy_ms, block_bytes


def calibrate(cfg: Config) -> dict[str, Any]:
    """Times one block's forward, forward+backward and upload, and the GPU clock ``torch.cuda._sleep`` counts, and
    sizes the delays at twice a block's forward (long enough that a missing wait would be caught in the act)."""
    forward_ms, train_ms, copy_ms, block_bytes = _block_timings(cfg, torch.device("cuda"))
    _free_memory()
    probe = 20_000_000  # ~10 ms at the H200's ~2 GHz boost clock
    cycles_per_ms = probe / _time_ms(lambda: torch.cuda._sleep(probe), reps=3, warmup=1)
    # Twice a block's forward, kept between 1 and 40 ms so that a run stays seconds long whatever the sizes.
    sleep_ms = min(max(2.0 * forward_ms, 1.0), 40.0)
    return {
        "block_forward_ms": forward_ms,
        "block_forward_backward_ms": train_ms,
        "block_upload_ms": copy_ms,
        "block_transfer_bytes": block_bytes,
        "upload_gbps": block_bytes / copy_ms / 1e6,
        "gpu_bound": forward_ms > copy_ms,  # the premise: copies can hide behind compute
        "sleep_cycles_per_ms": cycles_per_ms,
        "sleep_ms": sleep_ms,
        "sleep_cycles": int(sleep_ms * cycles_per_ms),
        "host_sleep_s": sleep_ms / 1e3,
    }


# --------------------------------------------------------------------------------------------------- results


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats as strings, tensors as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Tensor):
        return _jsonable(value.tolist())
    return value


class Result:
    """A subcommand's JSON result, rewritten after every stage so that a timeout still leaves what was done."""

    def __init__(self, path: Optional[Path], mode: str, cfg: Config) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"mode": mode, "config": asdict(cfg), "complete": False, "passed": None}
        self.write()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 2)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_jsonable(self.data), indent=2))
            tmp.replace(self.path)

    def finish(self, passed: Optional[bool]) -> int:
        self.data["passed"] = passed
        self.data["complete"] = True
        self.write()
        print(json.dumps(_jsonable(self.data), indent=2))
        return 0 if passed is not False else 1


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _run_summary(run: RunResult) -> dict[str, Any]:
    return {
        "wall_s": round(run.wall_s, 3),
        "losses": [float(v) for v in run.losses.double()],
        "finite": _finite(run.losses) and all(_finite(t) for t in run.state.values()),
        "peak_device_bytes": run.report.get("peak_device_bytes"),
        "cuda_max_allocated_bytes": run.report.get("cuda_max_allocated_bytes"),
    }


# --------------------------------------------------------------------------------------------------- subcommands


def cmd_race(cfg: Config, args: argparse.Namespace) -> int:
    result = Result(args.json, "race", cfg)
    if cfg.device == "cuda":
        try:
            calibration = calibrate(cfg)
        except Exception as error:  # the delays still run, with a fixed ~10 ms at a ~2 GHz clock
            calibration = {"error": f"{type(error).__name__}: {error}", "gpu_bound": None, "sleep_ms": 10.0,
                           "sleep_cycles": 20_000_000, "host_sleep_s": 0.01}
        result.data["calibration"] = calibration
        delays = (calibration["sleep_cycles"], calibration["host_sleep_s"])
        _log(f"calibration: {calibration}")
        if calibration["gpu_bound"] is False:
            result.data["note"] = "a block's forward is shorter than its upload: copies cannot all hide behind compute"
    else:
        delays = (0, 0.001)  # CPU: the patches only count their calls, plus a real sleep on the (inline) adds
        result.data["note"] = "cpu smoke run: no GPU delays, copies are synchronous; this checks the script only"
    template, data = make_template(cfg), make_data(cfg)

    reference = streamed_fit(cfg, template, data)
    result.data["reference"] = _run_summary(reference)
    _log(f"reference: {reference.wall_s:.2f} s, losses {reference.losses.tolist()}")
    control = streamed_fit(cfg, template, data)
    result.data["control"] = {**compare(reference, control), "wall_s": round(control.wall_s, 3)}
    _log(f"control: equal={result.data['control']['equal']}")
    result.write()

    cases: dict[str, dict[str, Any]] = {}
    result.data["cases"] = cases
    longest = max(reference.wall_s, control.wall_s)
    for name, (description, _, must_be_equal) in CASES.items():
        if not must_be_equal and cfg.device != "cuda":
            cases[name] = {"as_expected": True, "not_applicable": "CPU copies are synchronous: nothing to race"}
            continue
        if result.elapsed() + 3 * longest > args.deadline_s:  # a delayed run takes up to ~3 undelayed ones
            cases[name] = {"as_expected": False, "skipped": f"no time left before the {args.deadline_s:.0f} s deadline"}
            result.write()
            continue
        injected = Delays(*delays)
        try:
            with delayed(name, cfg, injected):
                run = streamed_fit(cfg, template, data)
            outcome = compare(reference, run)
            # Against the control: the reference run also pays the process's warm-up (cuBLAS, pinned pools).
            outcome.update(wall_s=round(run.wall_s, 3), slowdown_s=round(run.wall_s - control.wall_s, 3))
            longest = max(longest, run.wall_s)
        except Exception as error:  # one case failing must not hide the others
            outcome = {"equal": None, "error": f"{type(error).__name__}: {error}"}
        outcome.update(description=description, injected=injected.injected, expected_equal=must_be_equal)
        outcome["as_expected"] = outcome["equal"] is must_be_equal
        if injected.injected == 0 and cfg.device == "cpu" and name == "c_d2h_slow_before_copy":
            outcome["not_applicable"] = "on a CPU device gradients are added from where they are: no to_host"
        elif injected.injected == 0:
            outcome["as_expected"] = False
            outcome["error"] = "no delay was injected: the patched method is no longer called"
        cases[name] = outcome
        _log(f"{name}: equal={outcome['equal']} (expected {must_be_equal}) injected={injected.injected}"
             f" max|dw|={outcome.get('max_abs_weight_difference')}")
        result.write()
    passed = bool(result.data["control"]["equal"]) and all(case["as_expected"] for case in cases.values())
    if not result.data["control"]["equal"]:
        result.data["note"] = "the control failed: undelayed runs differ, so the delayed comparisons prove nothing"
    return result.finish(passed)


def _child(cfg: Config, env: dict[str, str], save: Path, log: Path, json_path: Path, timeout: float) -> int:
    """Runs ``run`` in a subprocess with ``env`` added; its output goes to ``log``. Returns its exit status."""
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, "run", *cfg.argv(), f"--save={save}", f"--json={json_path}"]
    with log.open("w") as output:
        try:
            return subprocess.run(
                command, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=output, stderr=subprocess.STDOUT,
                timeout=max(5.0, timeout),
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def _tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return [line[:300] for line in path.read_text(errors="replace").splitlines()[-lines:]]
    except OSError:
        return []


def cmd_launch_blocking(cfg: Config, args: argparse.Namespace) -> int:
    result = Result(args.json, "launch-blocking", cfg)
    reference = streamed_fit(cfg, make_template(cfg), make_data(cfg))
    result.data["reference"] = _run_summary(reference)
    result.write()
    with tempfile.TemporaryDirectory() as scratch:
        save, log = Path(scratch) / "blocking.pt", args.log_dir / "launch_blocking_child.log"
        rc = _child(cfg, {"CUDA_LAUNCH_BLOCKING": "1"}, save, log, Path(scratch) / "child.json",
                    args.deadline_s - result.elapsed())
        result.data["child_rc"] = rc
        if rc != 0:
            result.data["child_log_tail"] = _tail(log)
            return result.finish(False)
        blocking = load_run(save)
    result.data["blocking"] = {"wall_s": round(blocking.wall_s, 3)}
    result.data["comparison"] = compare(reference, blocking)
    return result.finish(bool(result.data["comparison"]["equal"]))


_CSAN_MARK = "CSAN detected a possible data race"


def cmd_sanitizer(cfg: Config, args: argparse.Namespace) -> int:
    result = Result(args.json, "sanitizer", cfg)
    # CSAN asks for the current CUDA stream at every operator: on a CPU-only torch the child runs without it,
    # which checks this script's plumbing only.
    env = {"TORCH_CUDA_SANITIZER": "1"} if cfg.device == "cuda" else {}
    with tempfile.TemporaryDirectory() as scratch:
        log, child_json = args.log_dir / "sanitizer_child.log", Path(scratch) / "child.json"
        rc = _child(cfg, env, Path(scratch) / "run.pt", log, child_json, args.deadline_s - result.elapsed())
        child = json.loads(child_json.read_text()) if child_json.exists() else {}
    text = log.read_text(errors="replace") if log.exists() else ""
    races = text.count(_CSAN_MARK)
    first = text.find(_CSAN_MARK)
    result.data.update(
        child_rc=rc,
        sanitizer_enabled=child.get("sanitizer_enabled"),
        races_reported=races,
        # The first report names both accesses and their stacks; the rest is in the child's log.
        first_report=text[first : first + 6000].splitlines()[:80] if first >= 0 else [],
        note="CSAN tracks tensors by their first address: reads of a slot through views at an offset are invisible"
        " to it, which is why the delay injection checks the same ordering by its effects.",
    )
    if rc != 0 and not races:
        result.data["child_log_tail"] = _tail(log)
    if cfg.device != "cuda":
        result.data["skipped"] = "CSAN needs CUDA: the child ran without it (a check of the script only)"
        return result.finish(None if rc == 0 else False)
    # A pass only counts if CSAN really watched the run.
    return result.finish(rc == 0 and races == 0 and bool(child.get("sanitizer_enabled")))


def cmd_run(cfg: Config, args: argparse.Namespace) -> int:
    """One undelayed streamed fit, saved for the parent process to compare."""
    enabled = False
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        import torch.cuda._sanitizer as csan

        enabled = bool(csan.cuda_sanitizer.enabled)
    result = Result(args.json, "run", cfg)
    result.data.update(sanitizer_enabled=enabled, launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING"))
    result.write()
    run = streamed_fit(cfg, make_template(cfg), make_data(cfg))
    if args.save is not None:
        save_run(run, args.save)
    result.data["run"] = _run_summary(run)
    return result.finish(True)


# --------------------------------------------------------------------------------------------------- profiler


class ProfileWindow(pl.Callback):
    """Profiles CUDA activity from micro-batch ``first`` to the end of the fit's last micro-batch."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.profiler: Optional[torch.profiler.profile] = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.first:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.last and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)


def _trace_events(profiler: torch.profiler.profile) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _stream(event: dict[str, Any]) -> Any:
    return event.get("args", {}).get("stream", event.get("tid"))


def _direction(name: str) -> str:
    return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "other"


def _bytes(event: dict[str, Any]) -> int:
    args = event.get("args", {})
    if "bytes" in args:
        return int(args["bytes"])
    return int(float(args.get("memory bandwidth (GB/s)", 0.0)) * float(event.get("dur", 0.0)) * 1e3)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged if a < end and b > start)


def _gbps(copies: list[dict[str, Any]]) -> Optional[float]:
    duration = sum(float(c["dur"]) for c in copies)
    return sum(_bytes(c) for c in copies) / duration / 1e3 if duration > 0 else None  # bytes/us -> GB/s


def analyze_trace(events: list[dict[str, Any]], other_bytes_allowed: int, big: int = 1 << 20) -> dict[str, Any]:
    """Copies and kernels of a chrome trace: which streams copies ran on, whether pinned, their overlap with
    kernels on the compute stream (the stream with the most kernel time) and their bandwidth.

    Args:
        other_bytes_allowed: Host<->device bytes that may go on the compute stream without being the engine's
            (Lightning's batch transfers, logged scalars).
        big: Copies at least this large count for the bandwidth (small ones are latency-bound).
    """
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"]
    kernel_us: dict[Any, float] = defaultdict(float)
    for kernel in kernels:
        kernel_us[_stream(kernel)] += float(kernel["dur"])
    compute = max(kernel_us, key=kernel_us.__getitem__) if kernel_us else None
    busy = _merged([(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels if _stream(k) == compute])
    host_copies = [c for c in copies if _direction(c["name"]) != "other"]
    side = [c for c in host_copies if _stream(c) != compute]
    on_compute = [c for c in host_copies if _stream(c) == compute]

    def by_name(group: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        for c in group:
            table[c["name"]]["count"] += 1
            table[c["name"]]["bytes"] += _bytes(c)
        return dict(table)

    directions: dict[str, dict[str, Any]] = {}
    for direction in ("h2d", "d2h"):
        group = [c for c in side if _direction(c["name"]) == direction]
        copy_us = sum(float(c["dur"]) for c in group)
        overlapped = sum(_overlap(float(c["ts"]), float(c["ts"]) + float(c["dur"]), busy) for c in group)
        large = [c for c in group if _bytes(c) >= big]
        directions[direction] = {
            "count": len(group),
            "bytes": sum(_bytes(c) for c in group),
            "streams": sorted({str(_stream(c)) for c in group}),
            "copy_ms": copy_us / 1e3,
            "overlap_fraction": overlapped / copy_us if copy_us else None,
            "gbps_all": _gbps(group),
            "gbps_large": _gbps(large),
            "largest_bytes": max((_bytes(c) for c in group), default=0),
        }
    unpinned = [c["name"] for c in side if "Pinned" not in c["name"] or "Pageable" in c["name"]]
    compute_bytes = sum(_bytes(c) for c in on_compute)
    total_copy_us = sum(float(c["dur"]) for c in side)
    overlapped_all = sum(_overlap(float(c["ts"]), float(c["ts"]) + float(c["dur"]), busy) for c in side)
    checks = {
        "engine_copies_seen": directions["h2d"]["count"] > 0 and directions["d2h"]["count"] > 0,
        "all_side_stream_copies_pinned": not unpinned,
        # The engine's copies are block- and gradient-sized; what the compute stream carries must be no more than
        # the batches and scalars.
        "compute_stream_copies_within_batches": compute_bytes <= other_bytes_allowed,
    }
    return {
        "checks": checks,
        "passed": all(checks.values()),
        "compute_stream": str(compute),
        "kernel_ms_by_stream": {str(k): v / 1e3 for k, v in kernel_us.items()},
        "side_streams": directions,
        "overlap_fraction": overlapped_all / total_copy_us if total_copy_us else None,
        "unpinned_side_copies": unpinned[:10],
        "side_copies_by_name": by_name(side),
        "compute_stream_copies_by_name": by_name(on_compute),
        "compute_stream_copy_bytes": compute_bytes,
        "other_bytes_allowed": other_bytes_allowed,
    }


def reference_copies(h2d_bytes: int, d2h_bytes: int, reps: int = 5) -> dict[str, Any]:
    """Plain pinned ``copy_(non_blocking=True)`` of the streamed copies' sizes, alone on the GPU, timed from a
    trace (as the streamed ones) and by CUDA events."""
    device = torch.device("cuda")
    measured: dict[str, Any] = {}
    for direction, nbytes in (("h2d", h2d_bytes), ("d2h", d2h_bytes)):
        if nbytes <= 0:
            continue
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        destination, source = (dev, host) if direction == "h2d" else (host, dev)
        copy_once = partial(destination.copy_, source, non_blocking=True)
        event_ms = _time_ms(copy_once, reps=reps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(reps):
                copy_once()
            torch.cuda.synchronize()
        traced = [e for e in _trace_events(profiler) if e.get("cat") == "gpu_memcpy"]
        measured[direction] = {
            "bytes": nbytes, "names": sorted({e["name"] for e in traced}),
            "gbps_trace": _gbps(traced), "gbps_events": nbytes / event_ms / 1e6,
        }
        del host, dev
    return measured


def cmd_profile(cfg: Config, args: argparse.Namespace) -> int:
    result = Result(args.json, "profile", cfg)
    if cfg.device != "cuda":
        result.data["skipped"] = "the profiler check needs CUDA"
        return result.finish(None)
    micro_batches = cfg.steps * cfg.accumulate
    window = ProfileWindow(first=min(1, micro_batches - 1), last=micro_batches - 1)  # after one warm-up step
    run = streamed_fit(cfg, make_template(cfg), make_data(cfg), callbacks=[window])
    result.data["run"] = _run_summary(run)
    assert window.profiler is not None, "the profiled window never started"
    profiled = micro_batches - window.first
    # x and y of each profiled micro-batch, plus the scalars Lightning and the strategy log (a few KiB).
    batch_bytes = cfg.tokens * (cfg.width + OUT_FEATURES) * 4
    allowed = (profiled + 1) * batch_bytes + (1 << 20)
    analysis = analyze_trace(_trace_events(window.profiler), other_bytes_allowed=allowed)
    result.data["trace"] = analysis
    result.write()
    side = analysis["side_streams"]
    reference = reference_copies(side["h2d"]["largest_bytes"], side["d2h"]["largest_bytes"])
    result.data["reference_copies"] = reference
    for direction in ("h2d", "d2h"):
        streamed, plain = side[direction]["gbps_large"], reference.get(direction, {}).get("gbps_trace")
        side[direction]["gbps_vs_plain_copy"] = streamed / plain if streamed and plain else None
    return result.finish(bool(analysis["passed"]))


# --------------------------------------------------------------------------------------------------- main


COMMANDS: dict[str, Callable[[Config, argparse.Namespace], int]] = {
    "race": cmd_race, "launch-blocking": cmd_launch_blocking, "sanitizer": cmd_sanitizer, "profile": cmd_profile,
    "run": cmd_run,
}


HELP = {
    "race": "delay injection: bitwise equal with delays on the compute, h2d, d2h and worker sides",
    "launch-blocking": "the same fit under CUDA_LAUNCH_BLOCKING=1 (a subprocess), bitwise equal",
    "sanitizer": "a 2-step fit under TORCH_CUDA_SANITIZER=1 (a subprocess)",
    "profile": "torch.profiler: engine copies pinned, on side streams, overlap with kernels, GB/s",
    "run": "one undelayed streamed fit saved to --save (used by launch-blocking and sanitizer)",
}


def parse(argv: Optional[Sequence[str]] = None) -> tuple[Config, argparse.Namespace]:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    for name in ("width", "depth", "tokens", "steps", "accumulate"):
        common.add_argument(f"--{name}", type=int, default=None, help="default: per subcommand and device")
    common.add_argument("--resident", type=int, default=1, help="SuperpipeStrategy(resident_blocks=)")
    common.add_argument("--prefetch", type=int, default=1, help="SuperpipeStrategy(prefetch=)")
    common.add_argument("--precision", default="32-true", help="Trainer(precision=), e.g. bf16-mixed")
    common.add_argument("--lr", type=float, default=1e-3)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--json", type=Path, default=None, help="where to write the result")
    common.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()), help="subprocess logs")
    common.add_argument("--deadline-s", type=float, default=None, help="seconds to plan within (default per command)")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        sub = commands.add_parser(name, parents=[common], help=HELP[name])
        if name == "run":
            sub.add_argument("--save", type=Path, default=None, help="torch.save losses and final weights here")
    args = parser.parse_args(argv)
    sizes = DEFAULTS[args.device].get(args.command, DEFAULTS[args.device]["default"])
    cfg = Config(
        device=args.device, resident=args.resident, prefetch=args.prefetch, precision=args.precision, lr=args.lr,
        seed=args.seed, **{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()},
    )
    if args.deadline_s is None:
        args.deadline_s = DEADLINES[args.command]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu for a smoke run)")
    return cfg, args


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg, args = parse(argv)
    return COMMANDS[args.command](cfg, args)


if __name__ == "__main__":
    sys.exit(main())
