"""The disk tier against holding the training state in memory, and against the raw disk, in one run.

A model of equal blocks whose training state in files (fp32 masters plus AdamW's two moments: 12 bytes per
parameter) is at least 3 GB is stepped with ``torch.optim.AdamW(fused=True)`` three ways, each in a process of its
own so that each peak RSS (``VmHWM`` from ``/proc/self/status``) is its own:

* ``memory``: every master, gradient and moment in host memory (what the host tier holds), one optimizer step;
* ``disk``: :class:`lightning_superpipe.memory.disk.DiskStore`, gradients spilled to files, the step block by block
  through a bounded pool of buffers (``host_buffer_bytes``), reads ahead and writes behind overlapping it;
* ``raw``: a sequential ``O_DIRECT`` write (``fsync``ed) and read of a file as large as a step's records, with one
  stream of 64 MiB requests and with four threads of 16 MiB requests (the tier's pattern), on the same disk, and the
  read of one such file while another is written (the mix of a step).

Reported: peak RSS of each and their ratio; step time of each (the steps after the first, which creates the
moments); the tier's read and write GB/s (bytes over the time a read, or a write, was in flight: they run at the
same time and share the disk); the step's I/O against the raw figures (the time the raw disk would take for the same
bytes, read and written one after the other, over the step's wall time, and over the time the step's I/O was in
flight: the fair measure while reads and writes share the disk); a forward-like pass that streams every
block's masters through the pool, against the raw read; and a write-only pass of every block's record through the
tier's writer (``fsync`` per file), against the raw write.

Usage:
    python benchmarks/bench_disk.py                                  # 3.2 GB of state in /tmp, about a minute
    python benchmarks/bench_disk.py --path /nvme/scratch --state-gb 8 --json results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

GB = 1e9
#: The width of every matrix: each block is one ``[rows, WIDTH]`` weight and one ``[WIDTH]`` bias.
WIDTH = 4096


def peak_rss_bytes() -> int:
    """The process's peak resident set (``VmHWM``)."""
    from lightning_superpipe.memory.host import rss_bytes

    peak = rss_bytes()[1]
    if not peak:
        raise RuntimeError("/proc/self/status has no VmHWM")
    return peak


def block_shapes(state_gb: float, blocks: int) -> dict[str, tuple[int, ...]]:
    """One block's parameter shapes such that ``blocks`` of them hold ``state_gb`` of masters and two moments."""
    params = state_gb * GB / 12 / blocks
    rows = math.ceil((params - WIDTH) / WIDTH)
    return {"weight": (rows, WIDTH), "bias": (WIDTH,)}


def initial_block(index: int, shapes: dict[str, tuple[int, ...]], prefix: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    return {f"{prefix}.{name}": torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}


def gradient_block(index: int, step: int, shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + index)
    return [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes.values()]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Everything in host memory: masters, gradients, moments; one fused step over all of it."""
    shapes = block_shapes(args.state_gb, args.blocks)
    params: list[nn.Parameter] = []
    for index in range(args.blocks):
        params += [nn.Parameter(t) for t in initial_block(index, shapes, f"blocks.{index}").values()]
    optimizer = make_optimizer(params)
    times = []
    for step in range(args.steps):
        for index in range(args.blocks):
            for param, grad in zip(params[2 * index : 2 * index + 2], gradient_block(index, step, shapes)):
                param.grad = grad
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return {"step_s": times, "peak_rss_bytes": peak_rss_bytes(),
            "params": sum(p.numel() for p in params)}


def run_disk(args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier: placeholders in memory, values written block by block, gradients spilled, stepped block by
    block through the bounded pool."""
    from lightning_superpipe.memory.disk import DiskStore

    shapes = block_shapes(args.state_gb, args.blocks)
    blocks = [
        {f"blocks.{i}.{name}": nn.Parameter(torch.zeros(()).expand(shape)) for name, shape in shapes.items()}
        for i in range(args.blocks)
    ]
    optimizer = make_optimizer([p for block in blocks for p in block.values()])
    folder = Path(args.folder)
    began = time.perf_counter()
    store = DiskStore.create(folder, blocks, optimizer, spill_grads=True, read_ahead=args.read_ahead,
                             host_buffer_bytes=args.host_buffer_bytes, io_workers=args.io_workers,
                             initial=lambda i: initial_block(i, shapes, f"blocks.{i}"))
    create_s = time.perf_counter() - began
    times, reads, writes, io = [], [], [], []
    try:
        for step in range(args.steps):
            for index in range(args.blocks):
                store.spill_grads(index, gradient_block(index, step, shapes))
            store.files.intervals = []
            read_before, written_before = store.bytes_read, store.bytes_written
            began = time.perf_counter()
            store.step(optimizer, grads="disk")
            times.append(time.perf_counter() - began)
            reads.append(store.bytes_read - read_before)
            writes.append(store.bytes_written - written_before)
            io.append(list(store.files.intervals))
        # A forward-like pass: every block's masters streamed through the pool with read-ahead.
        store.files.intervals = []
        began = time.perf_counter()
        leases = deque(store.prefetch_masters(i) for i in range(min(args.read_ahead + 1, args.blocks)))
        following, touched = len(leases), 0.0
        for _ in range(args.blocks):
            lease = leases.popleft()
            touched += float(lease.wait()[0][0, 0])  # where the engine would copy the block to the device
            lease.release()
            if following < args.blocks:
                leases.append(store.prefetch_masters(following))
                following += 1
        forward_s = time.perf_counter() - began
        forward_bytes = sum(n for kind, _, _, n in store.files.intervals if kind == "read")
        # A write-only pass through the tier's writer (fsync per file, as a step's), into scratch files, with as
        # many writes in flight as the pool has buffers.
        buffers = [store.pool.acquire(store.pool.buffer_bytes) for _ in range(store.pool.count)]
        record_bytes = store.records[0].file_bytes
        began = time.perf_counter()
        in_flight: deque[Any] = deque()
        for index in range(args.blocks):
            if len(in_flight) == len(buffers):
                in_flight.popleft().result()
            in_flight.append(store.files.write(folder / f"scratch{index}.bin", buffers[index % len(buffers)],
                                               record_bytes, durable=True))
        for future in in_flight:
            future.result()
        write_pass_s = time.perf_counter() - began
        for buffer in buffers:
            store.pool.release(buffer)
        result = {
            "step_s": times, "bytes_read": reads, "bytes_written": writes, "create_s": create_s,
            "forward_s": forward_s, "forward_bytes": forward_bytes, "direct_io": store.direct_io,
            "write_pass_s": write_pass_s, "write_pass_bytes": record_bytes * args.blocks,
            "pool_buffers": store.pool.count, "pool_buffer_bytes": store.pool.buffer_bytes,
            "pool_peak_bytes": store.pool.peak_bytes, "io_intervals": io,
            "file_bytes": sum(f.stat().st_size for f in folder.iterdir() if not f.name.startswith("scratch")),
        }
    finally:
        store.close()
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    """Sequential O_DIRECT write (then fsync) and read of one file, one stream and four; then the read of one file
    while another is written (two streams each), which is how the tier's step uses the disk."""
    from lightning_superpipe.memory.disk.buffers import _aligned_buffer, _byte_view

    size = int(args.raw_bytes) // (64 << 20) * (64 << 20)
    path = Path(args.folder) / "raw.bin"
    results: dict[str, Any] = {"bytes": size}

    def transfer(target: Path, write: bool, streams: int, request: int) -> float:
        buffers = [_aligned_buffer(request) for _ in range(streams)]
        for buffer in buffers:
            buffer.random_(0, 255)
        offsets = list(range(0, size, request))
        flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT
        fd = os.open(target, flags, 0o600)
        try:
            if write:
                os.ftruncate(fd, size)
            began = time.perf_counter()

            def worker(stream: int) -> None:
                view = _byte_view(buffers[stream], request)
                for offset in offsets[stream::streams]:
                    done = 0
                    while done < request:
                        call = os.pwritev if write else os.preadv
                        done += call(fd, [view[done:]], offset + done)

            with ThreadPoolExecutor(streams) as pool:
                list(pool.map(worker, range(streams)))
            if write:
                os.fsync(fd)
            return time.perf_counter() - began
        finally:
            os.close(fd)

    for streams, request in ((1, 64 << 20), (4, 16 << 20)):
        results[f"write_{streams}_s"] = transfer(path, True, streams, request)
        results[f"read_{streams}_s"] = transfer(path, False, streams, request)
    # Reads and writes at once: each gets part of the disk.
    other = path.with_name("raw-other.bin")
    transfer(path, True, 4, 16 << 20)
    with ThreadPoolExecutor(2) as both:
        began = time.perf_counter()
        read = both.submit(transfer, path, False, 2, 16 << 20)
        written = both.submit(transfer, other, True, 2, 16 << 20)
        results["mixed_read_s"], results["mixed_write_s"] = read.result(), written.result()
        results["mixed_s"] = time.perf_counter() - began
    path.unlink()
    other.unlink()
    return results


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The time at least one of ``intervals`` was open."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


class StepIO(NamedTuple):
    """The disk tier's I/O over the steps that count (all but the first, which creates the optimizer state)."""

    later: slice  # the steps that count, as an index into per-step lists
    steps: int
    read_bytes: int
    write_bytes: int
    read_busy_s: float  # time at least one read was in flight
    write_busy_s: float
    busy_s: float  # time any I/O was in flight, step by step (the gaps between steps do not count)


def step_io(disk: dict[str, Any], steps: int) -> StepIO:
    """:class:`StepIO` of a disk run's ``io_intervals`` (``(kind, start, stop, bytes)`` per request, per step)."""
    later = slice(1, None) if steps > 1 else slice(None)
    intervals = [i for step in disk["io_intervals"][later] for i in step]
    return StepIO(
        later=later,
        steps=len(disk["step_s"][later]),
        read_bytes=sum(n for kind, _, _, n in intervals if kind == "read"),
        write_bytes=sum(n for kind, _, _, n in intervals if kind == "write"),
        read_busy_s=union_seconds([(a, b) for kind, a, b, _ in intervals if kind == "read"]),
        write_busy_s=union_seconds([(a, b) for kind, a, b, _ in intervals if kind == "write"]),
        busy_s=sum(union_seconds([(a, b) for _, a, b, _ in step]) for step in disk["io_intervals"][later]),
    )


def raw_rates(raw: dict[str, Any]) -> tuple[float, float, float]:
    """The raw disk's bytes per second: reading, writing with fsync (each the faster of 1 x 64 MiB and 4 x 16 MiB
    requests), and a read and a write at once."""
    read = max(raw["bytes"] / raw["read_1_s"], raw["bytes"] / raw["read_4_s"])
    write = max(raw["bytes"] / raw["write_1_s"], raw["bytes"] / raw["write_4_s"])
    return read, write, 2 * raw["bytes"] / raw["mixed_s"]


def child(role: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--role", role, "--folder", str(args.folder), "--state-gb", str(args.state_gb),
               "--blocks", str(args.blocks), "--steps", str(args.steps), "--read-ahead", str(args.read_ahead),
               "--io-workers", str(args.io_workers), "--raw-bytes", str(args.raw_bytes)]
    command += ["--keep-heap"] if args.keep_heap else []
    if args.host_buffer_bytes is not None:
        command += ["--host-buffer-bytes", str(args.host_buffer_bytes)]
    print(f"[{role}] ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {role} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=Path(tempfile.gettempdir()),
                        help="a folder on the disk to measure (a scratch folder is made in it and removed)")
    parser.add_argument("--state-gb", type=float, default=3.2, help="masters + AdamW moments in files, GB")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--read-ahead", type=int, default=2)
    parser.add_argument("--io-workers", type=int, default=4)
    parser.add_argument("--host-buffer-bytes", type=int, default=None)
    parser.add_argument("--keep-heap", action="store_true",
                        help="leave glibc's dynamic mmap threshold alone (no limit_heap_retention())")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--role", choices=["memory", "disk", "raw"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--raw-bytes", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_role(args: argparse.Namespace) -> None:
    """A child process: one role's run, its figures printed as one line of JSON."""
    # The same imports in every process, for equal baselines.
    from lightning_superpipe.memory.disk import limit_heap_retention

    if not args.keep_heap:
        limit_heap_retention()  # what the strategy does for a disk tier; in both runs alike

    baseline = peak_rss_bytes()
    runner = {"memory": run_memory, "disk": run_disk, "raw": run_raw}[args.role]
    print(json.dumps({**runner(args), "import_rss_bytes": baseline}))


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    if args.role is not None:
        run_role(args)
        return

    shapes = block_shapes(args.state_gb, args.blocks)
    params = args.blocks * sum(math.prod(s) for s in shapes.values())
    state = 12 * params
    args.raw_bytes = state
    # Two slots of every record, the gradients, and the raw file (made after the tier is removed).
    needed = 3 * state + 4 * params  # two slots, the gradients, the write pass's scratch files
    free = shutil.disk_usage(args.path).free
    if needed * 1.1 > free:
        raise SystemExit(f"{args.path} has {free / GB:.1f} GB free; this run needs about {needed * 1.1 / GB:.1f} GB.")
    args.folder = Path(tempfile.mkdtemp(prefix="superpipe-bench-disk-", dir=args.path))
    try:
        memory = child("memory", args)
        disk = child("disk", args)
        shutil.rmtree(args.folder)
        args.folder.mkdir()
        raw = child("raw", args)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    figures = compare(args, params, state, memory, disk, raw)
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


def compare(
    args: argparse.Namespace, params: int, state: int, memory: dict[str, Any], disk: dict[str, Any],
    raw: dict[str, Any],
) -> dict[str, Any]:
    """The disk tier's figures against the same training in memory and against the raw disk."""
    later, steps_counted, read_bytes, write_bytes, read_busy, write_busy, busy = step_io(disk, args.steps)
    disk_step = sum(disk["step_s"][later]) / steps_counted
    memory_step = sum(memory["step_s"][later]) / len(memory["step_s"][later])
    raw_read, raw_write, raw_mixed = raw_rates(raw)
    raw_time = (read_bytes / raw_read + write_bytes / raw_write) / steps_counted
    figures = {
        "params": params, "state_bytes_in_files": state, "file_bytes": disk["file_bytes"], "blocks": args.blocks,
        "direct_io": disk["direct_io"], "heap_retention_limited": not args.keep_heap,
        "pool": f"{disk['pool_buffers']} x {disk['pool_buffer_bytes']} bytes",
        "pool_peak_bytes": disk["pool_peak_bytes"],
        "peak_rss_memory_bytes": memory["peak_rss_bytes"], "peak_rss_disk_bytes": disk["peak_rss_bytes"],
        "peak_rss_ratio": disk["peak_rss_bytes"] / memory["peak_rss_bytes"],
        "rss_after_imports_bytes": disk["import_rss_bytes"],
        "peak_rss_ratio_above_imports": (disk["peak_rss_bytes"] - disk["import_rss_bytes"])
        / (memory["peak_rss_bytes"] - memory["import_rss_bytes"]),
        "step_s_memory": memory_step, "step_s_disk": disk_step, "step_time_ratio": disk_step / memory_step,
        "first_step_s_disk": disk["step_s"][0], "create_s": disk["create_s"],
        "step_read_gbps": read_bytes / read_busy / GB, "step_write_gbps": write_bytes / write_busy / GB,
        "step_io_gbps": (read_bytes + write_bytes) / steps_counted / disk_step / GB,
        "step_io_vs_raw": raw_time / disk_step,
        # The fair measure while reads and writes share the disk: the step's bytes over the time any of its I/O was
        # in flight, against the raw disk moving them one kind after the other, and mixed.
        "step_io_gbps_while_busy": (read_bytes + write_bytes) / busy / GB,
        "step_io_vs_raw_while_busy": raw_time * steps_counted / busy,
        "raw_mixed_gbps": raw_mixed / GB,
        "step_io_vs_raw_mixed_while_busy": (read_bytes + write_bytes) / busy / raw_mixed,
        "forward_read_gbps": disk["forward_bytes"] / disk["forward_s"] / GB,
        "raw_read_gbps": {"1x64MiB": raw["bytes"] / raw["read_1_s"] / GB,
                          "4x16MiB": raw["bytes"] / raw["read_4_s"] / GB},
        "raw_write_fsync_gbps": {"1x64MiB": raw["bytes"] / raw["write_1_s"] / GB,
                                 "4x16MiB": raw["bytes"] / raw["write_4_s"] / GB},
        "forward_read_vs_raw": disk["forward_bytes"] / disk["forward_s"] / raw_read,
        "write_pass_gbps": disk["write_pass_bytes"] / disk["write_pass_s"] / GB,
        "write_pass_vs_raw": disk["write_pass_bytes"] / disk["write_pass_s"] / raw_write,
        "step_read_vs_raw": read_bytes / read_busy / raw_read,
        "step_write_vs_raw": write_bytes / write_busy / raw_write,
    }
    return figures


if __name__ == "__main__":
    main()
