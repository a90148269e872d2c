"""``SuperpipeStrategy(offload_device="disk")`` with a pool smaller than one block's record: the strategy tests of
``tests/test_strategy_disk.py`` that hold the tier to the host tier bitwise (clipping, accumulation, the pipelined and
overlapped steps, ``bf16-mixed`` and ``16-mixed``, other optimizers, clipping by value, manual optimization,
checkpoints and their resume, the export) run again with ``host_buffer_bytes`` at the least the store takes, so that
every block is read, stepped, spilled and copied to the device in pieces (its parameters sliced on 1024 elements
here: the test models' parameters are smaller than the default slice)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.disk import DiskStore, pieces
from lightning_superpipe.memory.disk.tier import DiskTier
from tests import test_strategy_disk as whole

#: Two buffers of 48 KiB: below one block's record of the test models (212-312 KiB with AdamW and its gradients),
#: the least the store takes with slices of :data:`SLICE` elements.
POOL = 96 << 10
SLICE = 1024


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every disk tier the wrapped tests build gets :data:`POOL`; afterwards, blocks were stepped or spilled in
    pieces (a test whose scaler skips every step spills only) and every pool stayed within it."""
    monkeypatch.setattr(pieces, "SLICE_ELEMENTS", SLICE)
    stepped, peaks = [0], []

    def disk(path: Path, **knobs: Any) -> SuperpipeStrategy:
        knobs.setdefault("host_buffer_bytes", POOL)
        return real(path, **knobs)

    def counted(self: DiskStore, *args: Any, **kwargs: Any) -> Any:
        stepped[0] += 1
        return step_in_pieces(self, *args, **kwargs)

    def spilled(self: DiskStore, *args: Any, **kwargs: Any) -> Any:
        stepped[0] += 1
        return spill_in_pieces(self, *args, **kwargs)

    def closed(self: DiskTier) -> None:
        peaks.append(self.store.pool.peak_bytes)
        close(self)

    real, close = whole._disk, DiskTier.close
    step_in_pieces, spill_in_pieces = DiskStore._step_in_pieces, DiskStore._spill_in_pieces
    monkeypatch.setattr(whole, "_disk", disk)
    monkeypatch.setattr(DiskStore, "_step_in_pieces", counted)
    monkeypatch.setattr(DiskStore, "_spill_in_pieces", spilled)
    monkeypatch.setattr(DiskTier, "close", closed)
    yield stepped
    assert stepped[0] > 0, "no block was stepped or spilled in pieces"
    assert peaks and max(peaks) <= POOL


pytestmark = pytest.mark.usefixtures("small_pool")


@pytest.mark.usefixtures("emulated_link")
def test_clipping_accumulation_and_the_pipelined_step_in_pieces(tmp_path: Path) -> None:
    # gpt2 (Conv1D matrices, biases): the other tests here stream llama in pieces; the suite's time is bounded.
    whole.test_clipping_and_accumulation_spill_and_equal_the_host_tier_bitwise(tmp_path, "gpt2")


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_overlapped_step_in_pieces(tmp_path: Path, accumulate: int) -> None:
    whole.test_without_clipping_blocks_step_through_the_store_during_backward(tmp_path, accumulate)


def test_bf16_mixed_in_pieces(tmp_path: Path) -> None:
    whole.test_bf16_mixed_casts_on_the_fly_and_equals_the_host_tier(tmp_path)


@pytest.mark.parametrize("variant", ["sgd", "adamw-fused"])
def test_sgd_and_fused_adamw_in_pieces(tmp_path: Path, variant: str) -> None:
    whole.test_sgd_fused_adamw_and_lora_equal_the_host_tier(tmp_path, variant)


@pytest.mark.usefixtures("emulated_link")
def test_16_mixed_in_pieces(tmp_path: Path) -> None:
    whole.test_16_mixed_with_a_gradient_scaler_skips_and_steps_as_the_host_tier(tmp_path)


def test_checkpoints_and_resume_in_pieces(tmp_path: Path) -> None:
    whole.test_checkpoints_hold_the_manifest_and_resume_exactly_from_a_copy_elsewhere(tmp_path)


@pytest.mark.usefixtures("emulated_link")
def test_clipping_by_value_in_pieces(tmp_path: Path) -> None:
    whole.test_clipping_by_value_equals_the_host_tier_bitwise(tmp_path)


@pytest.mark.usefixtures("emulated_link")
def test_manual_optimization_in_pieces(tmp_path: Path) -> None:
    whole.test_manual_optimization_equals_plain_lightning_bitwise(tmp_path)


def test_the_export_in_pieces(tmp_path: Path) -> None:
    whole.test_save_safetensors_exports_the_model_during_the_run_and_after_it(tmp_path)
