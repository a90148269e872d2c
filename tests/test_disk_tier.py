"""The disk tier (``lightning_superpipe.memory.disk``): exact block-by-block steps over files, crash safety under
kill -9, clear errors for a missing, unwritable, small or full disk and for deleted or truncated files, checkpoint
copies, and the safetensors export."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from lightning_superpipe.memory.disk import (
    DiskSpaceError,
    DiskStore,
    DiskTierError,
    buffers,
    checkpoint_folder,
    file_io,
    preflight,
    space,
    supports_direct_io,
)
from lightning_superpipe.memory.disk import folder as disk_folder
from lightning_superpipe.stepping.param_groups import restricted

SHM = Path("/dev/shm")
NUM_BLOCKS = 4


class Model(nn.Module):
    """Four streamed blocks of different shapes (a bias-free one too) and a trunk parameter that stays in memory."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            [nn.Linear(48, 40), nn.Sequential(nn.Linear(40, 40, bias=False), nn.LayerNorm(40)), nn.Linear(40, 24),
             nn.Linear(24, 56)]
        )
        self.head = nn.Linear(56, 8)

    def block_params(self) -> list[dict[str, nn.Parameter]]:
        return [dict(block.named_parameters(prefix=f"blocks.{i}")) for i, block in enumerate(self.blocks)]


class WideModel(Model):
    """Four streamed blocks whose records exceed a pool of :data:`SMALL_POOL` (weights of 19 200 and 40 000 elements:
    many slices) beside small ones, and a trunk parameter stepped in memory."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            [nn.Linear(96, 200), nn.Sequential(nn.Linear(200, 200, bias=False), nn.LayerNorm(200)),
             nn.Linear(200, 48), nn.Linear(48, 64)]
        )
        self.head = nn.Linear(64, 8)


#: Two buffers of 128 KiB: each of :class:`WideModel`'s first blocks' records (up to 640 KiB with Adam) goes in
#: pieces, the 200 x 200 weight in slices of 4096 elements.
SMALL_POOL = 256 << 10
#: A store's options that step :class:`WideModel` in pieces.
IN_PIECES = {"host_buffer_bytes": SMALL_POOL, "min_buffers": 2}


def make_optimizer(kind: str, model: Model) -> tuple[torch.optim.Optimizer, Optional[Any]]:
    """The optimizers of the exactness claim; ``groups`` splits weights and biases and adds an LR schedule."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), None
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, weight_decay=1e-3, nesterov=True), None
    assert kind == "groups"
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.05}, {"params": others, "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.8, 0.95),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def grads_for(model: Model, step: int, micro: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def reference_step(model: Model, optimizer: torch.optim.Optimizer, scheduler: Optional[Any], step: int,
                   micro_batches: int = 1) -> None:
    """Plain in-memory training: gradients accumulate in ``.grad`` as autograd would, then one step."""
    optimizer.zero_grad(set_to_none=True)
    for micro in range(micro_batches):
        for param, grad in zip(model.parameters(), grads_for(model, step, micro)):
            param.grad = grad.clone() if param.grad is None else param.grad + grad
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def disk_step(model: Model, store: DiskStore, optimizer: torch.optim.Optimizer, scheduler: Optional[Any], step: int,
              micro_batches: int = 1, spill: bool = False, per_block: bool = False) -> None:
    """The same step on the disk tier: block gradients in ``.grad`` or spilled to files, the trunk in memory; with
    ``per_block`` each block is stepped on its own, last first (as backward completes them), then committed."""
    optimizer.zero_grad(set_to_none=True)
    block_params = [list(block.values()) for block in model.block_params()]
    in_blocks = {p for block in block_params for p in block}
    for micro in range(micro_batches):
        grads = dict(zip(model.parameters(), grads_for(model, step, micro)))
        for param, grad in grads.items():
            if spill and param in in_blocks:
                continue
            param.grad = grad.clone() if param.grad is None else param.grad + grad
        if spill:
            for index, params in enumerate(block_params):  # in the background, as backward would
                store.spill_grads(index, [grads[p] for p in params], accumulate=micro > 0, wait=index % 2 == 0)
    if per_block:
        for index in reversed(range(len(block_params))):
            store.step(optimizer, grads="disk" if spill else "param", blocks=[index], commit=False)
        store.commit()
    else:
        store.step(optimizer, grads="disk" if spill else "param")
    with restricted(optimizer, {p for p in model.parameters() if p not in in_blocks}):
        optimizer.step()
    if scheduler is not None:
        scheduler.step()


def assert_store_equals(store: DiskStore, model: Model, optimizer: torch.optim.Optimizer) -> None:
    """Every block's masters and optimizer state in the store equal ``model``'s and ``optimizer``'s, bitwise."""
    for index, block in enumerate(model.block_params()):
        saved = store.read_block(index)
        assert set(saved.masters) == set(block)
        for name, param in block.items():
            assert torch.equal(saved.masters[name], param.detach()), f"master of {name}"
            expected = optimizer.state.get(param, {})
            assert set(saved.state.get(name, {})) == set(expected), name
            for key, value in expected.items():
                got = saved.state[name][key]
                if isinstance(value, Tensor):
                    assert got.dtype == value.dtype and torch.equal(got, value), f"{key} of {name}"
                else:
                    assert got == value, f"{key} of {name}"


def matches(store: DiskStore, model: Model, optimizer: torch.optim.Optimizer) -> bool:
    try:
        assert_store_equals(store, model, optimizer)
        return True
    except AssertionError:
        return False


@pytest.fixture
def shm() -> Iterator[Path]:
    """A scratch folder on tmpfs (another file system than the tests' temporary folders), removed afterwards."""
    folder = SHM / f"superpipe-test-{os.getpid()}-{time.monotonic_ns()}"
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def trained() -> Callable[[str, int], tuple[Model, torch.optim.Optimizer, Optional[Any]]]:
    """The in-memory reference after ``steps`` steps."""

    def run(kind: str, steps: int, micro_batches: int = 1,
            model_class: type[Model] = Model) -> tuple[Model, torch.optim.Optimizer, Optional[Any]]:
        model = model_class()
        optimizer, scheduler = make_optimizer(kind, model)
        for step in range(steps):
            reference_step(model, optimizer, scheduler, step, micro_batches)
        return model, optimizer, scheduler

    return run


# ---------------------------------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize(
    "kind, spill, micro_batches, options",
    [
        pytest.param("adamw", False, 1, {}, id="adamw"),
        pytest.param("sgd", False, 1, {}, id="sgd-momentum"),
        pytest.param("groups", False, 1, {}, id="two-groups-lr-schedule"),
        # Spilled gradients accumulated over two micro-batches; one buffer only (no overlap), many small chunks.
        pytest.param("groups", True, 2, {"host_buffer_bytes": 72 << 10, "chunk_bytes": 4096, "io_workers": 3},
                     id="groups-spilled-accumulated-one-buffer"),
        pytest.param("adamw", True, 1, {"read_ahead": 3}, id="adamw-spilled-read-ahead-3"),
        pytest.param("groups", False, 1, {"per_block": True}, id="groups-per-block-then-commit"),
        pytest.param("sgd", True, 2, {"per_block": True}, id="sgd-spilled-accumulated-per-block"),
    ],
)
def test_steps_over_files_equal_stepping_in_memory(tmp_path: Path, trained: Any, kind: str, spill: bool,
                                                  micro_batches: int, options: dict[str, Any]) -> None:
    steps = 4
    reference, ref_optimizer, ref_scheduler = trained(kind, steps, micro_batches)
    model = Model()
    optimizer, scheduler = make_optimizer(kind, model)
    per_block = options.pop("per_block", False)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, spill_grads=spill, **options)
    try:
        for step in range(steps):
            disk_step(model, store, optimizer, scheduler, step, micro_batches, spill, per_block)
        assert store.step_count == steps
        assert_store_equals(store, reference, ref_optimizer)
        assert torch.equal(model.head.weight, reference.head.weight)  # the trunk, stepped in memory
        assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in ref_optimizer.param_groups]
        if "host_buffer_bytes" in options:
            assert store.pool.peak_bytes <= options["host_buffer_bytes"]
    finally:
        store.close()


@pytest.mark.parametrize("model_class, options", [pytest.param(Model, {}, id="whole-blocks"),
                                                   pytest.param(WideModel, IN_PIECES, id="in-pieces")])
def test_clipping_by_global_norm_over_spilled_gradients(tmp_path: Path, model_class: type[Model],
                                                        options: dict[str, Any]) -> None:
    """Gradient accumulation over two micro-batches and clipping by global norm, the gradients spilled: the norms
    kept at the last spill and the trunk's give ``clip_grad_norm_``'s total, its coefficient scales the step, and
    weights and state equal Lightning's in-memory way bitwise."""
    max_norm, steps = 0.5, 3
    reference = model_class()
    ref_optimizer, ref_scheduler = make_optimizer("groups", reference)
    model = model_class()
    optimizer, scheduler = make_optimizer("groups", model)
    block_params = [list(block.values()) for block in model.block_params()]
    in_blocks = {p for block in block_params for p in block}
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, spill_grads=True, **options)
    try:
        for step in range(steps):
            ref_optimizer.zero_grad(set_to_none=True)
            for micro in range(2):
                for param, grad in zip(reference.parameters(), grads_for(reference, step, micro)):
                    param.grad = grad.clone() if param.grad is None else param.grad + grad
            total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            ref_optimizer.step()
            ref_scheduler.step()

            optimizer.zero_grad(set_to_none=True)
            for micro in range(2):
                grads = dict(zip(model.parameters(), grads_for(model, step, micro)))
                for param in model.parameters():
                    if param not in in_blocks:
                        param.grad = grads[param].clone() if param.grad is None else param.grad + grads[param]
                for index, params in enumerate(block_params):
                    store.spill_grads(index, [grads[p] for p in params], accumulate=micro > 0, norms=micro == 1)
            norms_by_param = {p: n for i, ps in enumerate(block_params) for p, n in zip(ps, store.grad_norms(i))}
            norms = [norms_by_param[p] if p in in_blocks else torch.linalg.vector_norm(p.grad, 2.0)
                     for p in model.parameters()]
            global_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            assert torch.equal(global_norm, total)
            scale = torch.clamp(max_norm / (global_norm + 1e-6), max=1.0)
            assert scale.item() < 1.0, "the clipping must bite for the test to mean anything"
            trunk = [p for p in model.parameters() if p not in in_blocks]
            for param in trunk:
                param.grad.mul_(scale)
            store.step(optimizer, grads="disk", grad_scale=scale)
            with restricted(optimizer, set(trunk)):
                optimizer.step()
            scheduler.step()
        assert_store_equals(store, reference, ref_optimizer)
        assert torch.equal(model.head.weight, reference.head.weight)
    finally:
        store.close()
    with pytest.raises(DiskTierError, match="did not keep norms; pass norms=True"):
        reopened = DiskStore.open(tmp_path, model_class().block_params(), spill_grads=True, **options)
        try:
            reopened.grad_norms(0)
        finally:
            reopened.close()


def test_the_comparison_has_teeth(tmp_path: Path, trained: Any) -> None:
    """A store stepped with another learning rate, or one step short, does not pass the comparison."""
    reference, ref_optimizer, _ = trained("adamw", 2)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0001e-2, weight_decay=0.1)
    (tmp_path / "a").mkdir()
    store = DiskStore.create(tmp_path / "a", model.block_params(), optimizer)
    try:
        for step in range(2):
            disk_step(model, store, optimizer, None, step)
        assert not matches(store, reference, ref_optimizer)
    finally:
        store.close()
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    (tmp_path / "b").mkdir()
    store = DiskStore.create(tmp_path / "b", model.block_params(), optimizer)
    try:
        disk_step(model, store, optimizer, None, 0)
        assert not matches(store, reference, ref_optimizer)
        disk_step(model, store, optimizer, None, 1)
        assert matches(store, reference, ref_optimizer)
    finally:
        store.close()


def test_parameters_hold_no_memory_and_masters_stream(tmp_path: Path) -> None:
    """After create the block parameters are memory-free placeholders of their shape; the masters come back from
    files through the pool, and non-tensor optimizer state survives the manifest."""
    model, original = Model(), Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    try:
        for (name, param), (_, before) in zip(model.blocks.named_parameters(), original.blocks.named_parameters()):
            assert param.shape == before.shape and param.dtype == before.dtype
            assert all(stride == 0 for stride in param.stride()), name
        for index, block in enumerate(original.block_params()):
            lease = store.prefetch_masters(index)
            try:
                for view, param in zip(lease.wait(), block.values()):
                    assert torch.equal(view, param.detach())
            finally:
                lease.release()
        model.blocks[0].weight.grad = torch.ones_like(original.blocks[0].weight)
        store.step(optimizer)
        assert store.step_count == 1 and optimizer.state.get(model.blocks[0].weight) is None
        assert torch.equal(store.read_block(0).masters["blocks.0.weight"], original.blocks[0].weight - 0.1)
        # Only block 0 had a gradient: the others kept their slot and were neither read nor written again.
        assert [r.slot for r in store.records] == [0, 1, 1, 1]
    finally:
        store.close()


def _slowed(original: Any, seconds: float) -> Any:
    """``original``, taking ``seconds`` longer."""

    def slowed(*args: Any) -> None:
        time.sleep(seconds)
        original(*args)

    return slowed


def _slowed_io(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every read and write request of the tier takes ``seconds`` longer (a slow disk)."""
    for chunk in ("_read_chunk", "_write_chunk"):
        monkeypatch.setattr(file_io, chunk, _slowed(getattr(file_io, chunk), seconds))


def _timed_step(store: DiskStore, model: Model, optimizer: torch.optim.Optimizer) -> float:
    """One step of every block with unit gradients, its I/O intervals kept; returns its wall time."""
    for param in model.parameters():
        param.grad = torch.ones(param.shape)
    store.files.intervals = []
    began = time.perf_counter()
    store.step(optimizer)
    return time.perf_counter() - began


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("buffers", [1, 3])
def test_reads_ahead_and_writes_behind_overlap_the_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         buffers: int, separate: bool) -> None:
    """With each I/O request and each block's arithmetic slowed to 50 ms, a step over three buffers takes well under
    the sum of its reads, writes and arithmetic (the next blocks' reads and the previous block's write run while a
    block steps, the reads waiting for their buffers on the reader thread, not on the thread stepping); with one
    buffer there is nothing to overlap, and it takes their sum. Reads and writes taking turns on the disk or not."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = DiskStore.create(tmp_path, model.block_params(), optimizer)
    buffer_bytes = probe.pool.buffer_bytes
    probe.close()
    store = DiskStore.open(tmp_path, model.block_params(), optimizer, host_buffer_bytes=buffers * buffer_bytes,
                           read_ahead=2, separate_io_kinds=separate)
    _slowed_io(monkeypatch, 0.05)
    arithmetic = 0.05
    step_block = DiskStore._step_block

    def slow_step_block(self: DiskStore, *args: Any, **kwargs: Any) -> Any:
        time.sleep(arithmetic)
        return step_block(self, *args, **kwargs)

    monkeypatch.setattr(DiskStore, "_step_block", slow_step_block)
    try:
        wall = _timed_step(store, model, optimizer)
        serial = sum(end - start for _, start, end, _ in store.files.intervals) + NUM_BLOCKS * arithmetic
        assert len(store.files.intervals) == 2 * NUM_BLOCKS
        if buffers == 1:
            assert wall >= 0.9 * serial, (wall, serial)
        else:
            assert wall < 0.8 * serial, (wall, serial)
        seconds = store.io_seconds()
        assert seconds["step_compute"] >= NUM_BLOCKS * arithmetic
        if buffers == 1:  # every read but the first waited for the buffer the write before it held
            assert seconds["pool_wait"] >= (NUM_BLOCKS - 1) * 0.05 * 0.8
    finally:
        store.close()


@pytest.mark.parametrize("separate", [True, False])
def test_reads_and_writes_take_turns_on_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 separate: bool) -> None:
    """With ``separate_io_kinds`` (opt-in) no read of a file is in flight beside a write of one, reads beside
    reads still; without it they overlap (the step reads the next blocks while it writes the previous ones)."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = DiskStore.create(tmp_path, model.block_params(), optimizer)
    buffer_bytes = probe.pool.buffer_bytes
    probe.close()
    store = DiskStore.open(tmp_path, model.block_params(), optimizer, host_buffer_bytes=3 * buffer_bytes,
                           read_ahead=2, separate_io_kinds=separate)
    _slowed_io(monkeypatch, 0.03)
    step_block = DiskStore._step_block

    def slow_step_block(self: DiskStore, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.03)  # so that the fourth block's read comes while the second block's write is in flight
        return step_block(self, *args, **kwargs)

    monkeypatch.setattr(DiskStore, "_step_block", slow_step_block)
    try:
        _timed_step(store, model, optimizer)
        _timed_step(store, model, optimizer)  # the second: records with state, reads and writes of equal size
        intervals = store.files.intervals
        reads = [(a, b) for kind, a, b, _ in intervals if kind == "read"]
        # A write's interval ends with its fsync, which runs outside its turn: its bytes went in the 30 ms before.
        writes = [(a, b) for kind, a, b, _ in intervals if kind == "write"]

        def overlap(x: tuple[float, float], y: tuple[float, float]) -> float:
            return max(0.0, min(x[1], y[1]) - max(x[0], y[0]))

        mixed = max(overlap(r, w) for r in reads for w in writes)
        together = max(overlap(r, q) for r in reads for q in reads if r is not q)
        if separate:
            assert mixed < 0.01, mixed  # the fsyncs of these small files take well under 10 ms
        else:
            assert mixed > 0.02, mixed
        assert together > 0.02, together  # reads ahead go together either way
    finally:
        store.close()


def test_a_buffer_takes_the_next_read_while_its_write_is_made_durable(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With one buffer and a slow ``fdatasync``, the next block's read starts before the write before it is durable: the
    buffer goes back once the record's bytes have left it. The commit still waits for every ``fsync``."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = DiskStore.create(tmp_path, model.block_params(), optimizer)
    buffer_bytes = probe.pool.buffer_bytes
    probe.close()
    store = DiskStore.open(tmp_path, model.block_params(), optimizer, host_buffer_bytes=buffer_bytes)
    real_fdatasync = os.fdatasync
    synced: list[float] = []

    def slow_fdatasync(fd: int) -> None:  # what a record's write is made durable with
        time.sleep(0.1)
        real_fdatasync(fd)
        synced.append(time.perf_counter())

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    commits: list[float] = []
    real_replace = disk_folder._replace

    def replace(source: Path, target: Path) -> None:
        commits.append(time.perf_counter())
        real_replace(source, target)

    monkeypatch.setattr(disk_folder, "_replace", replace)
    try:
        _timed_step(store, model, optimizer)
        ordered = sorted(store.files.intervals, key=lambda interval: interval[1])
        assert [kind for kind, *_ in ordered] == ["read", "write"] * NUM_BLOCKS
        early = [ordered[i + 1][1] < ordered[i][2] for i in range(1, len(ordered) - 1, 2)]
        assert all(early), early  # every next read began before the write before it was durable
        assert store.io_seconds()["fsync"] >= NUM_BLOCKS * 0.1
        # The block files' fdatasyncs all came before the rename that commits the step.
        assert len(commits) == 1 and sum(t < commits[0] for t in synced) == NUM_BLOCKS
        assert store.step_count == 1
    finally:
        store.close()


@pytest.mark.parametrize("model_class, failing_file, nth", [
    pytest.param(Model, "block00002", 1, id="whole-blocks"),
    # Half-way through block 1's pieces: the next piece's read and the pieces' writes in flight.
    pytest.param(WideModel, "block00001", 6, id="in-pieces"),
])
def test_a_read_failing_mid_step_gives_every_buffer_back_and_the_step_repeats(
    tmp_path: Path, trained: Any, monkeypatch: pytest.MonkeyPatch, model_class: type[Model], failing_file: str,
    nth: int,
) -> None:
    """A step over spilled gradients whose third block (in pieces: a piece of the second) cannot be read, with two
    buffers (the reads behind it queued for them on the reader thread): the error names the file, every buffer comes
    back and the spilled gradients' writes are still waited for, so the step repeated afterwards equals training
    that never failed."""
    reference, ref_optimizer, _ = trained("adamw", 1, model_class=model_class)
    model = model_class()
    optimizer, _ = make_optimizer("adamw", model)
    probe = DiskStore.create(tmp_path, model.block_params(), optimizer, spill_grads=True)
    buffer_bytes = probe.pool.buffer_bytes
    probe.close()
    options = IN_PIECES if model_class is WideModel else {"host_buffer_bytes": 2 * buffer_bytes, "read_ahead": 3}
    store = DiskStore.open(tmp_path, model.block_params(), optimizer, spill_grads=True, **options)
    monkeypatch.setattr(buffers, "ACQUIRE_TIMEOUT_S", 10.0)  # a buffer never given back fails the repeat, not hangs
    real_preadv = os.preadv
    reads, failures = [0], [0]

    def failing(fd: int, buffers: Any, offset: int) -> int:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(failing_file):
            reads[0] += 1
            if reads[0] == nth:
                failures[0] += 1
                time.sleep(0.05)  # the reads behind it are queued by now
                raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "preadv", failing)
            with pytest.raises(DiskTierError, match=failing_file):
                disk_step(model, store, optimizer, None, 0, spill=True)
        assert failures[0] == 1 and store.step_count == 0 and store.pending == []
        with store.pool._cond:
            assert len(store.pool._free) == store.pool._allocated  # every buffer is back
        disk_step(model, store, optimizer, None, 0, spill=True)
        assert store.step_count == 1
        assert_store_equals(store, reference, ref_optimizer)
    finally:
        store.close()


def test_initial_values_stream_in_block_by_block(tmp_path: Path) -> None:
    """A model too large for host memory: placeholders for parameters, each block's values loaded when written."""
    source = Model()
    model = Model()
    for param in model.blocks.parameters():
        param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
    calls: list[int] = []

    def load(index: int) -> dict[str, Tensor]:
        calls.append(index)
        return {name: param.detach().clone() for name, param in source.block_params()[index].items()}

    store = DiskStore.create(tmp_path, model.block_params(), initial=load)
    try:
        assert calls == list(range(NUM_BLOCKS))
        for index, block in enumerate(source.block_params()):
            saved = store.read_block(index)
            assert all(torch.equal(saved.masters[n], p.detach()) for n, p in block.items())
    finally:
        store.close()
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"initial\(0\) gave the tensors"):
        DiskStore.create(tmp_path / "other", Model().block_params(), initial=lambda index: {})


def test_blocks_stepped_before_the_commit(tmp_path: Path, trained: Any) -> None:
    """Between ``step(commit=False)`` and ``commit()`` a stepped block reads back its new values, cannot be stepped
    again, and is discarded (the folder stays at the committed step) by ``abort()`` or a reopen."""
    after_one = trained("sgd", 1)[0]
    model = Model()
    optimizer, _ = make_optimizer("sgd", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    try:
        for param, grad in zip(model.parameters(), grads_for(model, 0)):
            param.grad = grad
        store.step(optimizer, blocks=[3], commit=False)
        lease = store.prefetch_masters(3)
        try:
            assert torch.equal(lease.wait()[0], after_one.blocks[3].weight)
        finally:
            lease.release()
        with pytest.raises(DiskTierError, match="Block 3 was already stepped in this optimizer step; commit"):
            store.step(optimizer, blocks=[3], commit=False)
        with pytest.raises(DiskTierError, match="commit the step first"):
            store.snapshot(tmp_path / "copy")
        assert store.step_count == 0
        store.abort()
        assert torch.equal(store.read_block(3).masters["blocks.3.weight"], Model().blocks[3].weight)
        store.step(optimizer, blocks=[2, 3])
        assert store.step_count == 1
        assert torch.equal(store.read_block(3).masters["blocks.3.weight"], after_one.blocks[3].weight)
        assert torch.equal(store.read_block(0).masters["blocks.0.weight"], Model().blocks[0].weight)
    finally:
        store.close()


class ThreeMoments(torch.optim.Optimizer):
    """An optimizer the size probe cannot build (``decay`` has no default), with more state than Adam's."""

    def __init__(self, params: Any, decay: float, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "decay_": decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(m1=torch.zeros_like(p), m2=torch.zeros_like(p), m3=torch.zeros_like(p))
                state["m1"].mul_(group["decay_"]).add_(p.grad)
                state["m2"].mul_(group["decay_"]).add_(state["m1"])
                state["m3"].mul_(group["decay_"]).add_(state["m2"])
                p.sub_(group["lr"] * state["m3"])


def test_state_larger_than_foreseen_grows_the_buffers_or_names_the_bound(tmp_path: Path) -> None:
    reference = Model()
    ref_optimizer = ThreeMoments(reference.parameters(), decay=0.5)
    model = Model()
    optimizer = ThreeMoments(model.parameters(), decay=0.5)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    foreseen = store.pool.buffer_bytes
    try:
        for step in range(3):
            reference_step(reference, ref_optimizer, None, step)
            disk_step(model, store, optimizer, None, step)
        assert store.pool.buffer_bytes > foreseen
        assert_store_equals(store, reference, ref_optimizer)
    finally:
        store.close()
    (tmp_path / "bounded").mkdir()
    model = Model()
    optimizer = ThreeMoments(model.parameters(), decay=0.5)
    store = DiskStore.create(tmp_path / "bounded", model.block_params(), optimizer, host_buffer_bytes=2 * foreseen)
    try:
        with pytest.raises(DiskTierError, match="record grew to .* Raise host_buffer_bytes to at least"):
            disk_step(model, store, optimizer, None, 0)
        assert store.step_count == 0
    finally:
        store.close()


def test_non_tensor_state_round_trips(tmp_path: Path) -> None:
    """Whatever ``optimizer.state[p]`` holds is kept: tensors in the record, other values (a float, a tuple) in the
    manifest, across a reopen."""

    class Tagged(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            result = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        state = self.state[p]
                        state["count"] = state.get("count", 0) + 1
                        state["shape"] = tuple(p.shape)
                        state["scale"] = torch.tensor(0.5, dtype=torch.float64) * state["count"]
            return result

    model = Model()
    optimizer = Tagged(model.parameters(), lr=0.1, momentum=0.5)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    for step in range(2):
        disk_step(model, store, optimizer, None, step)
    store.close()
    store = DiskStore.open(tmp_path, Model().block_params(), optimizer)
    try:
        state = store.read_block(2).state["blocks.2.weight"]
        assert state["count"] == 2 and state["shape"] == (24, 40)
        assert state["scale"].dtype == torch.float64 and state["scale"].item() == 1.0
        assert state["momentum_buffer"].shape == (24, 40)
    finally:
        store.close()


def test_direct_io_where_accepted_buffered_where_refused(tmp_path: Path, trained: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """ext4 takes O_DIRECT (so does tmpfs since Linux 6.6; older kernels refuse it at open with EINVAL). Where it is
    refused the store falls back to buffered I/O, drops what it read or wrote from the page cache, and gets the
    same results."""
    if file_system(tmp_path) in ("ext4", "xfs"):
        assert supports_direct_io(tmp_path)
    real_open = os.open

    def refuse_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    dropped: list[int] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        dropped.append(advice)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", refuse_direct)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    assert not supports_direct_io(tmp_path)
    reference, ref_optimizer, _ = trained("adamw", 2)
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, spill_grads=True)
    try:
        assert not store.direct_io
        for step in range(2):
            disk_step(model, store, optimizer, None, step, spill=True)
        assert_store_equals(store, reference, ref_optimizer)
        assert dropped and set(dropped) == {os.POSIX_FADV_DONTNEED}
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------------------------------
# Crash safety


def file_system(path: Path) -> str:
    """The type of the file system holding ``path``, from ``/proc/mounts`` (the longest mount point above it)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fs_type, *_ = line.split()
            if (resolved == point or resolved.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fs_type
    return kind


def _die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_hooks(point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arms a kill -9 of this process at ``point`` (``chunk:N``: after N chunk writes, the file half written;
    ``file:N``: after N block files are durable, written whole or in ranges and finished; ``replace:before`` /
    ``replace:after``: around the manifest's rename, with block writes slowed down)."""
    what, _, when = point.partition(":")
    count = [0]
    if what == "chunk":
        original_chunk = file_io._write_chunk

        def chunk(*args: Any) -> None:
            original_chunk(*args)
            count[0] += 1
            if count[0] == int(when):
                _die()

        monkeypatch.setattr(file_io, "_write_chunk", chunk)
    elif what == "file":  # a file written whole, or in ranges and then finished
        for method in ("_write", "_finish"):
            original = getattr(file_io._Files, method)

            def durable(self: Any, *args: Any, original: Any = original) -> None:
                original(self, *args)
                count[0] += 1
                if count[0] == int(when):
                    _die()

            monkeypatch.setattr(file_io._Files, method, durable)
    else:
        original_replace, original_chunk = disk_folder._replace, file_io._write_chunk

        def slow_chunk(*args: Any) -> None:  # so that a manifest renamed before the blocks are durable shows
            time.sleep(0.02)
            original_chunk(*args)

        monkeypatch.setattr(file_io, "_write_chunk", slow_chunk)

        def replace(source: Path, target: Path) -> None:
            if when == "before":
                _die()
            original_replace(source, target)
            _die()

        monkeypatch.setattr(disk_folder, "_replace", replace)


def _in_child(work: Callable[[], None]) -> int:
    """Runs ``work`` in a forked child and returns the signal that ended it (0 for a clean exit)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            work()
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child neither died at its kill point nor finished")
        time.sleep(0.01)


@pytest.mark.parametrize(
    "point, survives",
    [
        ("chunk:3", "previous"),  # block 0's new slot half written
        ("file:1", "previous"),  # block 0 durable in its new slot, the others not yet
        ("chunk:late", "previous"),  # the third block mid-file, earlier ones durable
        (f"file:{NUM_BLOCKS}", "previous"),  # every block durable, the manifest not yet written
        ("replace:before", "previous"),  # the new manifest durable under its temporary name
        ("replace:after", "new"),  # renamed: the new step is committed
    ],
)
def test_kill_at_any_moment_leaves_the_previous_or_the_new_step(tmp_path: Path, trained: Any, point: str,
                                                                 survives: str) -> None:
    previous, previous_optimizer, _ = trained("adamw", 2)
    new, new_optimizer, _ = trained("adamw", 3)
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, chunk_bytes=4096)
    for step in range(2):
        disk_step(model, store, optimizer, None, step)
    if point == "chunk:late":  # two pages into the third block's record (4 KiB chunks)
        point = f"chunk:{sum(r.file_bytes // 4096 for r in store.records[:2]) + 2}"
    store.close()

    def third_step() -> None:
        monkeypatch = pytest.MonkeyPatch()
        _kill_hooks(point, monkeypatch)
        child_store = DiskStore.open(tmp_path, model.block_params(), optimizer, chunk_bytes=4096)
        disk_step(model, child_store, optimizer, None, 2)

    assert _in_child(third_step) == signal.SIGKILL, "the kill point was never reached"
    reopened = Model()
    reopened_optimizer, _ = make_optimizer("adamw", reopened)
    store = DiskStore.open(tmp_path, reopened.block_params(), reopened_optimizer)
    try:
        assert store.step_count == (2 if survives == "previous" else 3)
        assert matches(store, previous, previous_optimizer) == (survives == "previous")
        assert matches(store, new, new_optimizer) == (survives == "new")
        if survives == "previous":  # and training resumes from it exactly
            disk_step(reopened, store, reopened_optimizer, None, 2)
            assert_store_equals(store, new, new_optimizer)
    finally:
        store.close()


def test_a_kill_before_the_first_commit_leaves_nothing_to_open(tmp_path: Path) -> None:
    model = Model()

    def create() -> None:
        monkeypatch = pytest.MonkeyPatch()
        _kill_hooks("file:2", monkeypatch)
        DiskStore.create(tmp_path, model.block_params())

    assert _in_child(create) == signal.SIGKILL
    with pytest.raises(DiskTierError, match="holds no committed disk tier"):
        DiskStore.open(tmp_path, Model().block_params())


# ---------------------------------------------------------------------------------------------------------------------
# Errors


def test_preflight_names_the_folder_and_the_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model()
    with pytest.raises(DiskTierError, match=r"offload_path '.*missing' does not exist.*mkdir -p"):
        DiskStore.create(tmp_path / "missing", model.block_params())
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="is not a folder"):
        preflight(tmp_path / "file", 1)

    real_open = os.open

    def refuse(path: Any, *args: Any, **kwargs: Any) -> int:
        if ".superpipe-write-probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", refuse)
        with pytest.raises(DiskTierError, match="is not writable \\(Permission denied\\)"):
            DiskStore.create(tmp_path, model.block_params())

    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    with pytest.raises(DiskSpaceError) as error:
        DiskStore.create(tmp_path, model.block_params(), optimizer, spill_grads=True)
    # Two slots of (masters + two moments + step) per block, plus a gradient file: from the model's own sizes. The
    # masters are on 256 bytes, each state tensor on a page of its own after them.
    needed = 0
    for block in model.block_params():
        masters = sum(-(-p.numel() * 4 // 256) * 256 for p in block.values())
        state = sum(2 * -(-p.numel() * 4 // 4096) * 4096 + 4096 for p in block.values())
        record = -(-masters // 4096) * 4096 + state
        needed += 2 * record + -(-masters // 4096) * 4096
    assert f"({needed} bytes: two slots" in str(error.value) and "only 1000 B (1000 bytes) are free" in str(error.value)
    assert not any(tmp_path.glob("block*")), "nothing is written before the check passes"
    monkeypatch.undo()
    DiskStore.create(tmp_path, model.block_params(), optimizer).close()  # writes one slot of each block
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    with pytest.raises(DiskSpaceError, match="bytes: the slots the next step writes"):
        DiskStore.open(tmp_path, Model().block_params(), torch.optim.AdamW(Model().parameters()))


def test_a_full_disk_mid_step_names_the_file_and_loses_nothing(tmp_path: Path, trained: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reference, ref_optimizer, _ = trained("adamw", 2)
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, chunk_bytes=4096)
    try:
        disk_step(model, store, optimizer, None, 0)
        calls = [0]
        real_pwritev = os.pwritev

        def fill_up(fd: int, buffers: Any, offset: int) -> int:
            calls[0] += 1
            if calls[0] >= 5:  # a few chunks of the step's first write land, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwritev(fd, buffers, offset)

        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", fill_up)
            with pytest.raises(DiskSpaceError) as error:
                disk_step(model, store, optimizer, None, 1)
        assert "The disk is full while writing the disk tier's file" in str(error.value)
        # Step 0 wrote slot 0 of every block (create wrote slot 1), so step 1 writes slot 1 of the first block.
        assert "block00000.1.bin'" in str(error.value) and "The last committed step in" in str(error.value)
        assert store.step_count == 1 and not optimizer.state.get(model.blocks[0].weight)
        # The step is repeated once space is back, and equals training that never failed.
        disk_step(model, store, optimizer, None, 1)
        assert_store_equals(store, reference, ref_optimizer)
    finally:
        store.close()


def test_a_full_disk_at_allocation_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    try:
        model.blocks[3].weight.grad = torch.ones(56, 24)

        def full(*args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(DiskSpaceError, match="block00003.0.bin"):
            store.step(optimizer)
        monkeypatch.undo()
        store.step(optimizer)
        assert store.step_count == 1
    finally:
        store.close()


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_deleted_or_truncated_file_is_named_in_use_and_on_reopen(tmp_path: Path, damage: str) -> None:
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer)
    try:
        disk_step(model, store, optimizer, None, 0)
        victim = tmp_path / f"block00002.{store.records[2].slot}.bin"
        if damage == "delete":
            victim.unlink()
            message = "is missing"
        else:
            os.truncate(victim, 4096)
            message = "truncated"
        with pytest.raises(DiskTierError, match=f"{victim.name}.*{message}"):
            disk_step(model, store, optimizer, None, 1)
        assert store.step_count == 1
    finally:
        store.close()
    with pytest.raises(DiskTierError, match=f"{victim.name}.*{message}"):
        DiskStore.open(tmp_path, Model().block_params())


def test_opening_refuses_other_blocks_an_existing_tier_and_a_tiny_bound(tmp_path: Path) -> None:
    model = Model()
    DiskStore.create(tmp_path, model.block_params()).close()
    with pytest.raises(DiskTierError, match="already holds a disk tier .*DiskStore.open, or pass overwrite=True"):
        DiskStore.create(tmp_path, Model().block_params())
    other = Model()
    with pytest.raises(DiskTierError, match="was written for other blocks"):
        DiskStore.open(tmp_path, other.block_params()[:3])
    other.blocks[0] = nn.Linear(48, 41)
    with pytest.raises(DiskTierError, match=r"blocks.0.weight is \(41, 48\) torch.float32 in the model"):
        DiskStore.open(tmp_path, other.block_params())
    with pytest.raises(DiskTierError, match="host_buffer_bytes=4096 .* cannot hold 2 buffers of the smallest piece"):
        DiskStore.open(tmp_path, Model().block_params(), host_buffer_bytes=4096)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and export


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_snapshot_survives_later_steps_and_resumes_exactly(tmp_path: Path, shm: Path, trained: Any,
                                                             elsewhere: bool) -> None:
    """A snapshot (hard links beside the .ckpt) stays at its step while training goes on writing both slots, and a
    restore from it, also into another folder or from another file system (tmpfs: copies and buffered I/O),
    continues with the same results as training that never stopped."""
    at_two, at_two_optimizer, _ = trained("groups", 2)
    at_four, at_four_optimizer, _ = trained("groups", 4)
    if elsewhere and file_system(SHM) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm to copy a checkpoint onto")
    model = Model()
    optimizer, scheduler = make_optimizer("groups", model)
    (tmp_path / "tier").mkdir()
    store = DiskStore.create(tmp_path / "tier", model.block_params(), optimizer)
    try:
        for step in range(2):
            disk_step(model, store, optimizer, scheduler, step)
        ckpt = (shm if elsewhere else tmp_path) / "epoch=0.ckpt"
        ckpt.parent.mkdir(exist_ok=True)
        folder = checkpoint_folder(ckpt)
        manifest = store.snapshot(folder)
        scheduler_state, groups_state = scheduler.state_dict(), optimizer.state_dict()["param_groups"]
        assert manifest["step"] == 2
        linked = [(folder / f"block{i:05d}.{r.slot}.bin").stat().st_nlink for i, r in enumerate(store.records)]
        assert linked == ([1] * NUM_BLOCKS if elsewhere else [2] * NUM_BLOCKS)
        for step in range(2, 4):  # both slots of every block get written again
            disk_step(model, store, optimizer, scheduler, step)
        assert_store_equals(store, at_four, at_four_optimizer)
    finally:
        store.close()

    snapshot_model = Model()
    snapshot = DiskStore.open(folder, snapshot_model.block_params())
    try:
        assert_store_equals(snapshot, at_two, at_two_optimizer)
    finally:
        snapshot.close()

    resumed = Model()
    resumed_optimizer, resumed_scheduler = make_optimizer("groups", resumed)
    resumed_optimizer.load_state_dict({"state": {}, "param_groups": groups_state})
    resumed_scheduler.load_state_dict(scheduler_state)
    resumed.head.load_state_dict(at_two.head.state_dict())
    # The trunk's optimizer state, as the .ckpt would hold it.
    for mine, theirs in zip(resumed.head.parameters(), at_two.head.parameters()):
        resumed_optimizer.state[mine] = {key: value.clone() for key, value in at_two_optimizer.state[theirs].items()}
    (tmp_path / "resumed").mkdir()
    store = DiskStore.restore(folder, tmp_path / "resumed", resumed.block_params(), resumed_optimizer)
    try:
        assert store.step_count == 2 and store.direct_io == supports_direct_io(tmp_path)
        for step in range(2, 4):
            disk_step(resumed, store, resumed_optimizer, resumed_scheduler, step)
        assert_store_equals(store, at_four, at_four_optimizer)
        assert torch.equal(resumed.head.weight, at_four.head.weight)
        store.close()
        # The snapshot is still at step 2 after the resumed run wrote its own files.
        snapshot = DiskStore.open(folder, Model().block_params())
        assert_store_equals(snapshot, at_two, at_two_optimizer)
        snapshot.close()
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_is_a_plain_safetensors_state_dict(tmp_path: Path, trained: Any, dtype: Optional[torch.dtype]) -> None:
    reference, _, _ = trained("adamw", 2)
    model = Model()
    optimizer, _ = make_optimizer("adamw", model)
    (tmp_path / "tier").mkdir()
    store = DiskStore.create(tmp_path / "tier", model.block_params(), optimizer)
    try:
        for step in range(2):
            disk_step(model, store, optimizer, None, step)
        store.export_safetensors(tmp_path / "model.safetensors", extra=dict(model.head.named_parameters("head")),
                                 dtype=dtype)
    finally:
        store.close()
    exported = load_file(tmp_path / "model.safetensors")
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    assert list(exported) == list(expected)  # the model's own order: blocks, then the extra (trunk) tensors
    for name, tensor in expected.items():
        wanted = tensor if dtype is None else tensor.to(dtype)
        assert exported[name].dtype == wanted.dtype and torch.equal(exported[name], wanted), name
    fresh = Model()
    fresh.load_state_dict({k: v.float() for k, v in exported.items()})
    assert torch.equal(fresh.blocks[1][0].weight, reference.blocks[1][0].weight.to(dtype or torch.float32).float())


def test_a_lease_gives_a_blocks_masters_in_the_host_tiers_flat_layout(tmp_path: Path) -> None:
    """What the engine streams from: the masters' region of a record, one flat fp32 tensor, each parameter where
    the host tier's ``BlockHome`` puts it (every 64 elements), so device slots are laid out as on the host tier."""
    from lightning_superpipe.memory.host import ALIGNMENT

    model = Model()
    expected = [[p.detach().clone() for p in block.values()] for block in model.block_params()]
    store = DiskStore.create(tmp_path, model.block_params(), spill_grads=True)
    try:
        assert store.pending == [] and not store.spilled(0) and not store.has_norms(0)
        for index, params in enumerate(store.params):
            numel = sum(-(-p.numel() // ALIGNMENT) * ALIGNMENT for p in params)
            lease = store.prefetch_masters(index)
            flat = lease.flat(numel, torch.float32)
            offset = 0
            for param, entry, value in zip(params, store.master_entries(index), expected[index]):
                assert entry.offset == 4 * offset
                assert torch.equal(flat[offset : offset + param.numel()].view(param.shape), value)
                offset += -(-param.numel() // ALIGNMENT) * ALIGNMENT
            lease.release()
        store.spill_grads(1, [torch.ones_like(v) for v in expected[1]], norms=True)
        assert store.spilled(1) and store.has_norms(1) and not store.spilled(0)
    finally:
        store.close()


def test_mapped_files_give_back_only_file_pages_and_keep_every_value(tmp_path: Path) -> None:
    """What ``save_safetensors`` calls after each tensor: pages of a file mapping are reclaimed (read again from the
    file when touched), a page written since keeps its new value, and memory that is not a file's is never advised."""
    from lightning_superpipe.memory.disk import MappedFiles

    values = torch.arange(3 * 4096, dtype=torch.float32)
    (tmp_path / "weights.bin").write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(tmp_path / "weights.bin"), shared=False, size=values.numel(), dtype=torch.float32)
    mapped[5] = -1.0  # copy-on-write: this page is the process's own now, not the file's
    expected = values.clone()
    expected[5] = -1.0
    heap = values.clone()
    shared = torch.from_file(str(tmp_path / "weights.bin"), shared=True, size=values.numel(), dtype=torch.float32)
    files = MappedFiles()
    assert files.maps(mapped) and files.maps(mapped[4096:]) and not files.maps(heap)
    assert not files.maps(shared)  # a shared mapping may be another process's working memory: never advised
    advised: list[tuple[int, int]] = []
    madvise = files._libc.madvise

    def spy(address: Any, length: Any, advice: int) -> int:
        advised.append((address.value, length.value))
        return madvise(address, length, advice)

    files._libc.madvise = spy
    files.release(heap)
    assert advised == []
    files.release(mapped)
    assert advised == [(mapped.data_ptr(), mapped.numel() * 4)]
    assert torch.equal(mapped, expected)  # reclaimed pages come back from the file; the written one kept its value
    assert torch.equal(torch.from_file(str(tmp_path / "weights.bin"), size=values.numel(), dtype=torch.float32), values)
