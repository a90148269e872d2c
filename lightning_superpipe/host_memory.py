"""How much host memory there is, and the one error a run raises before it would run out of it."""

from __future__ import annotations

from lightning_superpipe.units import format_bytes


class HostMemoryError(MemoryError):
    """Raised before pinning when the host lacks the memory a run needs, instead of an out-of-memory kill."""


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``kB`` field of a ``/proc`` file (``MemAvailable`` of ``/proc/meminfo``, ``VmRSS`` of ``/proc/self/status``)
    in bytes, or ``None`` where the platform does not report it."""
    try:
        with open(path) as fields:
            for line in fields:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, or ``None`` where the platform does not report it."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def rss_bytes() -> tuple[int, int]:
    """This process's resident set size now and at its peak, in bytes (Linux; zeros elsewhere)."""
    return _proc_bytes("/proc/self/status", "VmRSS") or 0, _proc_bytes("/proc/self/status", "VmHWM") or 0


def shared_rss_bytes() -> int:
    """Bytes of this process's resident set in shared memory (``RssShmem``: e.g. a node's shared homes, which every
    rank of the node maps and a sum of the ranks' resident sets counts once per rank), 0 where not reported."""
    return _proc_bytes("/proc/self/status", "RssShmem") or 0


def check_host_memory(needed_bytes: int, what: str) -> None:
    """Raises :class:`HostMemoryError` when the host cannot hold ``needed_bytes`` more.

    Args:
        needed_bytes: Bytes the run is about to allocate on the host.
        what: What the bytes are for, quoted in the message.
    """
    available = available_host_bytes()
    if available is None or needed_bytes <= available:
        return
    raise HostMemoryError(
        f"SuperpipeStrategy needs about {format_bytes(needed_bytes)} more host memory ({what}) but only"
        f" {format_bytes(available)}"
        " is available. Free host memory, train fewer parameters (e.g. LoRA), use `precision='bf16-true'`, or use"
        " a machine with more RAM."
    )
