"""The disk tier training a model whose training state is larger than the machine's memory.

A Llama-style causal LM built from a ``transformers`` config (nothing downloaded) is sized so that its training
state (fp32 masters, gradients and AdamW's two moments: 16 bytes per parameter) is ``--times`` the machine's memory
(``MemTotal``). It is built in ``configure_model`` (the strategy defers the init calls and writes each block's values
to its file as the block is built) and trained for ``--steps`` clipped steps through
``SuperpipeStrategy(offload_device="disk", host_buffer_bytes=--host-buffer-bytes)``, in a process of its own
(``bench_disk_strategy.py``'s ``configured`` run).

Reported: the model's size and its state against the machine's memory; the process's peak RSS (``VmHWM``) over the
whole run and over training alone, against the state; the step time (the steps after the first, which creates the
moments); and the disk's share of a step (the wall time with tier I/O in flight, and the time the step waited for
it: reads, durable writes and free buffers), from the tier's own clock.

Usage:
    python benchmarks/bench_disk_beyond_memory.py --path /nvme/scratch --json beyond.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_disk import GB  # noqa: E402
from bench_disk_strategy import child, count_params  # noqa: E402


def machine_memory_bytes() -> int:
    """``MemTotal`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def layers_for(args: argparse.Namespace, state_bytes: float) -> int:
    """The fewest decoder layers whose model holds at least ``state_bytes`` of training state."""
    args.layers = 1
    params, layer = count_params(args)
    trunk = params - layer
    return max(1, -(-int(state_bytes / 16 - trunk) // layer))


def summarize(run: dict[str, Any], args: argparse.Namespace, memory: int) -> dict[str, Any]:
    params, layer = count_params(args)
    state = 16 * params
    later = slice(1, None)  # the first step creates the moments
    steps = run["step_s"][later]
    clocks = run["disk_seconds"][later]
    step_s = sum(steps) / len(steps)

    def per_step(key: str) -> float:
        return sum(clock[key] for clock in clocks) / len(clocks)

    waited = per_step("read_wait") + per_step("write_wait") + per_step("pool_wait")
    return {
        "params": params, "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
        "vocab": args.vocab, "tokens_per_step": args.batch * args.seq, "threads": args.threads,
        "overlap_optimizer": args.overlap, "optimizer_step_modes": run["optimizer_step_modes"],
        "machine_memory_bytes": memory, "training_state_bytes": state, "state_vs_memory": state / memory,
        "layer_record_bytes": 16 * layer, "host_buffer_bytes": args.host_buffer_bytes,
        "disk_file_bytes": run["disk_bytes"], "peak_disk_pool_host_bytes": run["peak_disk_pool_host_bytes"],
        "rss_after_imports_bytes": run["rss_after_imports_bytes"],
        "peak_rss_bytes": run["peak_rss_bytes"], "peak_rss_vs_state": run["peak_rss_bytes"] / state,
        "peak_rss_training_bytes": run["peak_rss_training_bytes"],
        "peak_rss_before_training_bytes": run["peak_rss_before_training_bytes"],
        "step_s": [round(s, 2) for s in run["step_s"]], "mean_step_s": step_s, "fit_s": run["fit_s"],
        "disk_busy_share_of_step": per_step("busy") / step_s, "disk_wait_share_of_step": waited / step_s,
        "disk_seconds_per_step": {key: round(per_step(key), 2) for key in clocks[0]},
        "losses": run["losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=Path(tempfile.gettempdir()), help="a folder on the disk to test")
    parser.add_argument("--times", type=float, default=1.5, help="the training state over the machine's memory")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: sized by --times)")
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--intermediate", type=int, default=6912)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--host-buffer-bytes", type=int, default=256 << 20)
    parser.add_argument("--overlap", choices=["auto", "serial", "pipelined"], default="auto",
                        help="the strategy's overlap_optimizer ('serial': False)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    memory = machine_memory_bytes()
    args.layers = args.layers or layers_for(args, args.times * memory)
    params, layer = count_params(args)
    # Two slots of each block's record (12 B a parameter) and its spilled gradients (4 B), as the tier's check asks.
    needed = 28 * args.layers * layer
    free = shutil.disk_usage(args.path).free
    if needed * 1.05 > free:
        raise SystemExit(f"{args.path} has {free / GB:.1f} GB free; this run needs about {needed * 1.05 / GB:.1f} GB.")
    args.raw_bytes, args.role = 0, None
    args.folder = Path(tempfile.mkdtemp(prefix="superpipe-beyond-memory-", dir=args.path))
    try:
        run = child("configured", args)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    figures = summarize(run, args, memory)
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
