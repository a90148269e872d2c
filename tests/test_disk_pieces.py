"""The disk tier's records in pieces: a pool smaller than one block's record (``host_buffer_bytes``) reads, steps and
writes each block a parameter, or a slice of one, at a time, bitwise what stepping in memory gives, with the pool's
host bytes within the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_superpipe.memory.disk import DiskStore, DiskTierError
from lightning_superpipe.memory.disk.pieces import SLICE_ELEMENTS, ParamCost, Part, plan_pieces, sliceable
from tests.test_disk_tier import (
    IN_PIECES,
    SMALL_POOL,
    WideModel,
    assert_store_equals,
    disk_step,
    make_optimizer,
    reference_step,
)


def _optimizer(kind: str, model: WideModel) -> tuple[torch.optim.Optimizer, Optional[Any]]:
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True), None
    if kind == "adam-amsgrad":
        return torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True, foreach=True), None
    return make_optimizer(kind, model)


def _reference(kind: str, steps: int, micro_batches: int) -> tuple[WideModel, torch.optim.Optimizer]:
    model = WideModel()
    optimizer, scheduler = _optimizer(kind, model)
    for step in range(steps):
        reference_step(model, optimizer, scheduler, step, micro_batches)
    return model, optimizer


@pytest.mark.parametrize(
    "kind, spill, micro_batches, per_block",
    [
        pytest.param("adamw", False, 1, False, id="adamw"),
        pytest.param("adamw-fused", True, 1, False, id="adamw-fused-spilled"),
        pytest.param("sgd", False, 1, True, id="sgd-momentum-per-block"),
        pytest.param("groups", True, 2, False, id="groups-spilled-accumulated"),
        pytest.param("adam-amsgrad", True, 2, True, id="amsgrad-spilled-accumulated-per-block"),
    ],
)
def test_a_pool_smaller_than_a_record_steps_in_pieces_bitwise(
    tmp_path: Path, kind: str, spill: bool, micro_batches: int, per_block: bool
) -> None:
    steps = 3
    reference, ref_optimizer = _reference(kind, steps, micro_batches)
    model = WideModel()
    optimizer, scheduler = _optimizer(kind, model)
    store = DiskStore.create(
        tmp_path, model.block_params(), optimizer, spill_grads=spill, host_buffer_bytes=SMALL_POOL, min_buffers=2
    )
    try:
        assert all(store._in_pieces(i) for i in (0, 1))
        assert any(part.numel < 40000 for piece in store._plan(1) for part in piece if part.param == 0)  # sliced
        for step in range(steps):
            disk_step(model, store, optimizer, scheduler, step, micro_batches, spill, per_block)
        assert store.step_count == steps
        assert_store_equals(store, reference, ref_optimizer)
        assert torch.equal(model.head.weight, reference.head.weight)
        assert store.pool.peak_bytes <= SMALL_POOL
    finally:
        store.close()


def test_pieces_survive_a_reopen_a_snapshot_and_the_export(tmp_path: Path) -> None:
    """Stepped in pieces, closed, reopened with whole-block buffers (and the other way): the records read the same;
    the masters read for the device in chunks and exported a tensor at a time equal the model's."""
    reference, ref_optimizer = _reference("adamw", 2, 1)
    model = WideModel()
    optimizer, _ = _optimizer("adamw", model)
    store = DiskStore.create(tmp_path, model.block_params(), optimizer, **IN_PIECES)
    try:
        disk_step(model, store, optimizer, None, 0)
    finally:
        store.close()
    store = DiskStore.open(tmp_path, model.block_params(), optimizer)  # whole blocks
    try:
        disk_step(model, store, optimizer, None, 1)
    finally:
        store.close()
    store = DiskStore.open(
        tmp_path, model.block_params(), optimizer, spill_grads=True, host_buffer_bytes=SMALL_POOL, min_buffers=2
    )
    try:
        assert_store_equals(store, reference, ref_optimizer)
        for index, block in enumerate(reference.block_params()):
            chunks = store.master_chunks(index)
            flat = torch.empty(chunks[-1][1] // 4)
            for number, (start, end) in enumerate(chunks):
                lease = store.prefetch_masters(index, number)
                flat[start // 4 : end // 4].copy_(lease.flat((end - start) // 4, torch.float32))
                lease.release()
            for entry, param in zip(store.master_entries(index), block.values()):
                assert torch.equal(entry.view_of(flat.view(torch.uint8)), param.detach())
        blocks = [list(b.values()) for b in model.block_params()]
        store.spill_grads(1, [torch.ones_like(p) for p in blocks[1]])  # in pieces, and taken back whole
        assert all(torch.equal(g, torch.ones_like(p)) for g, p in zip(store.take_grads(1), blocks[1]))
        store.export_safetensors(tmp_path / "model.safetensors")
        saved = load_file(str(tmp_path / "model.safetensors"))
        for block in reference.block_params():
            for name, param in block.items():
                assert torch.equal(saved[name], param.detach())
        assert store.pool.peak_bytes <= SMALL_POOL
    finally:
        store.close()


def test_the_plan_slices_only_what_a_buffer_cannot_hold_and_names_the_least_bound() -> None:
    costs = [ParamCost(100, 16.0, 4), ParamCost(50_000, 16.0, 4), ParamCost(10, 16.0, 4)]
    pieces = plan_pieces(costs, 128 << 10, True, "Block 0")
    assert pieces[0] == [Part(0, 0, 100)] and pieces[-1] == [Part(2, 0, 10)]
    slices = [piece[0] for piece in pieces[1:-1]]
    assert all(len(piece) == 1 for piece in pieces[1:-1])
    assert [s.start for s in slices] == list(range(0, 50_000, slices[0].numel))
    assert slices[0].numel % SLICE_ELEMENTS == 0 and slices[-1].stop == 50_000
    with pytest.raises(DiskTierError, match="needs buffers of at least .* stepped whole"):
        plan_pieces(costs, 128 << 10, False, "Block 0")
    assert sliceable(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]))

    class Custom(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    assert not sliceable(Custom([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_a_bound_below_two_pieces_is_one_error_naming_the_least(tmp_path: Path) -> None:
    model = WideModel()
    optimizer, _ = _optimizer("adamw", model)
    with pytest.raises(DiskTierError, match=r"host_buffer_bytes=65536 .* cannot hold 2 buffers") as error:
        DiskStore.create(tmp_path, model.block_params(), optimizer, host_buffer_bytes=64 << 10, min_buffers=2)
    assert not any(tmp_path.iterdir()), "refused before anything is written"
    least = int(str(error.value).split("Give at least ")[1].split(" ")[0])
    store = DiskStore.create(
        tmp_path, model.block_params(), optimizer, host_buffer_bytes=least, min_buffers=2, overwrite=True
    )
    try:
        disk_step(model, store, optimizer, None, 0)
        assert store.pool.peak_bytes <= least
    finally:
        store.close()
    with pytest.raises(DiskTierError, match="cannot hold 2 buffers"):
        DiskStore.open(tmp_path, model.block_params(), optimizer, host_buffer_bytes=least - 4096, min_buffers=2)


def test_the_host_memory_check_counts_every_part_and_names_the_bound_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything is allocated: the pool (within host_buffer_bytes), two blocks' gradients arriving, the cast's
    staging and the trunk's gradients and moments are counted; a run that does not fit is refused with the
    host_buffer_bytes that would fit, or, where even the least pool does not, says so; a bound below the least pool
    names the least."""
    from lightning_superpipe.host_memory import HostMemoryError
    from lightning_superpipe.memory.disk import budget as disk_budget

    model = WideModel()
    optimizer, _ = _optimizer("adamw", model)
    blocks = [list(b.values()) for b in model.block_params()]
    trunk = list(model.head.parameters())
    largest = max(sum(p.numel() for p in block) for block in blocks)

    def parts(bound: Optional[int]) -> disk_budget.DiskHostBytes:
        return disk_budget.disk_host_bytes(blocks, trunk, optimizer, torch.bfloat16, 2, bound)

    small = parts(SMALL_POOL)
    assert small.least_pool <= small.pool <= SMALL_POOL
    assert small.gradients == 2 * 4 * largest and small.staging == 3 * 2 * largest
    # AdamW: the head's bias (a vector, in host memory) a gradient and two moments; its weight (a matrix, in the
    # files: a record of its own in the pool's pieces) only the gradient arriving before its spill.
    vectors, matrices = [p for p in trunk if p.dim() == 1], [p for p in trunk if p.dim() >= 2]
    assert vectors and matrices
    assert small.trunk == 12 * sum(p.numel() for p in vectors) + 4 * sum(p.numel() for p in matrices)
    # On a CUDA device every trunk gradient also crosses a page-locked staging buffer of its size.
    pinned = disk_budget.disk_host_bytes(blocks, trunk, optimizer, torch.bfloat16, 2, SMALL_POOL, pinned=True)
    assert pinned.trunk == small.trunk + 4 * sum(p.numel() for p in trunk)
    assert parts(None).pool > SMALL_POOL  # the default: whole blocks' buffers
    monkeypatch.setattr(disk_budget, "available_host_bytes", lambda: small.total)
    disk_budget.check_disk_host_room(small, SMALL_POOL)
    room = small.others + small.least_pool + 3 * 4096
    monkeypatch.setattr(disk_budget, "available_host_bytes", lambda: room)
    refused = r"host_buffer_bytes=262144\) needs about .* Give host_buffer_bytes="
    with pytest.raises(HostMemoryError, match=refused) as e:
        disk_budget.check_disk_host_room(small, SMALL_POOL)
    named = int(str(e.value).split("Give host_buffer_bytes=")[1].split(" ")[0])
    assert small.least_pool <= named <= room - small.others
    disk_budget.check_disk_host_room(parts(named), named)  # the bound it names fits
    monkeypatch.setattr(disk_budget, "available_host_bytes", lambda: small.others)
    with pytest.raises(HostMemoryError, match="Even the least pool that works"):
        disk_budget.check_disk_host_room(small, SMALL_POOL)
    with pytest.raises(DiskTierError, match=f"Give at least {small.least_pool} "):
        parts(small.least_pool - 4096)


def test_the_trunk_goes_to_the_files_by_a_rule_matrices_that_train_vectors_and_frozen_ones_stay() -> None:
    """The disk tier's trunk rule: floating matrices (or more) that train go to the files, once each (a tied
    embedding and head are one parameter); vectors, frozen and integer parameters stay in host memory."""
    from torch import nn

    from lightning_superpipe.memory.disk.trunk import trunk_on_disk, trunk_records

    embedding, norm = nn.Parameter(torch.zeros(96, 32)), nn.Parameter(torch.ones(32))
    frozen, cls_token = nn.Parameter(torch.zeros(4, 32), requires_grad=False), nn.Parameter(torch.zeros(1, 1, 32))
    counts = nn.Parameter(torch.zeros(4, 4, dtype=torch.int64), requires_grad=False)
    chosen = trunk_on_disk([embedding, norm, frozen, cls_token, counts, embedding])
    assert [id(p) for p in chosen] == [id(embedding), id(cls_token)]
    assert list(trunk_records(3, chosen).values()) == [3, 4]  # after the three blocks' records
