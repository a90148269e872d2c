"""The disk tier's check of its folder tells a user what is wrong and what to do, without meaningless sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_superpipe.memory.disk import DiskTierError, preflight


def test_a_missing_folder_is_named_missing_without_a_size_of_zero(tmp_path: Path) -> None:
    missing = tmp_path / "tier"
    with pytest.raises(DiskTierError) as error:
        preflight(missing, 0)  # as the strategy checks the folder, before the tier's size is known
    message = str(error.value)
    assert f"{str(missing)!r} does not exist: the folder is missing" in message
    assert f"mkdir -p {missing}" in message and "or pass another offload_path" in message
    assert "0 B" not in message and "at least" not in message
    assert "room for two slots of every block's record" in message


def test_a_missing_folder_with_a_known_size_names_the_room_needed(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match=r"does not exist: the folder is missing.*at least 3 MiB free"):
        preflight(tmp_path / "tier", 3 << 20)


def test_a_file_in_place_of_the_folder_is_not_told_to_be_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="is not a folder") as error:
        preflight(tmp_path / "file", 0)
    assert "mkdir" not in str(error.value) and "0 B" not in str(error.value)
