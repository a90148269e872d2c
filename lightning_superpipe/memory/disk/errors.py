"""The disk tier's errors: each names the file or folder at fault and what to do about it."""

from __future__ import annotations


class DiskTierError(RuntimeError):
    """A disk tier file is missing, truncated, unreadable or unwritable; the message names the file."""


class DiskSpaceError(DiskTierError):
    """``offload_path`` lacks the space the tier needs (before training or during a write)."""
