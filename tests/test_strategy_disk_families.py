"""The class, not the example, on the disk tier: every model family ``tests/families.py`` builds, with its default
config, trains with ``offload_device="disk"`` exactly as plain Lightning trains it in fp32. On the CPU link only:
``tests/test_strategy_disk.py`` runs the tier's paths on the emulated asynchronous links."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_superpipe import SuperpipeStrategy
from tests import families, tasks


@pytest.mark.parametrize("clip", [None, 1.0], ids=["stepped-during-backward", "clipped-spilled"])
@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_every_family_trains_on_the_disk_tier_exactly_as_plain_lightning(
    name: str, clip: float | None, tmp_path: Any
) -> None:
    """The blocks' masters and AdamW's state in files: without clipping each block is stepped through the store as
    its gradients complete (the first micro-batch's spilled and added); clipping by norm spills every block's and
    steps them from disk after backward. Experts no token reached (MoE), two stacks (T5, BART), BatchNorm's
    statistics (ResNet), a vision tower (LLaVA) included."""
    plain = tasks.fit_family(name, "auto", gradient_clip_val=clip)
    disk = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path, resident_blocks=1, prefetch=1)
    streamed = tasks.fit_family(name, disk, gradient_clip_val=clip)
    assert len(streamed.losses) == len(plain.losses) == 8
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    assert disk.memory_report()["disk_bytes_written"] > 0
    assert tasks.max_relative_difference(streamed, tasks.build_family_task(name), integers=False) > 1e-4
