"""What a long step of the paged experts shows while it runs: a progress bar on a terminal, plain lines elsewhere.

:meth:`~lightning_superpipe.moe.PagedExperts.calibrate` rounds every expert matrix again with its Hessian, which on a
large model takes minutes. On a terminal it draws Lightning's tqdm bar; written to a file or a pipe (under ``nohup``,
SLURM or a CI job), where a bar is carriage returns, it writes plain lines through :mod:`logging` instead: when the
step starts, about every half minute, and when it ends, with the time taken.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from time import perf_counter
from types import TracebackType

from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

log = logging.getLogger(__name__)

__all__ = ["StepProgress", "output_is_terminal"]


def output_is_terminal() -> bool:
    """Whether standard output, where Lightning's tqdm bars draw, is a terminal."""
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


def _duration(seconds: float) -> str:
    """``0:01:05`` for 65 seconds; ``4.2 s`` under a minute."""
    return f"{seconds:.1f} s" if seconds < 60 else str(timedelta(seconds=round(seconds)))


class StepProgress:
    """Progress of one long step, counted in units of work, as a context manager.

    On a terminal (:func:`output_is_terminal`) it is a tqdm bar that disappears when the step ends; elsewhere an
    INFO line on this module's logger when the step starts and about every ``every_n_seconds`` after. Either way an
    INFO line says when the step ends and how long it took. The lines show where :mod:`logging` is configured to
    show them: the ``superpipe`` command shows them on standard error; a script shows them after, for example,
    ``logging.basicConfig(level=logging.INFO)``.

    Args:
        what: The step, for the bar and the lines ("MoE calibration: rounding the experts with their Hessians").
        total: Units of work in the step (``None``: not known beforehand).
        units: The units' name, singular and plural (``("expert matrix", "expert matrices")``).
        enabled: ``False`` shows nothing (another rank, or a trainer whose progress bar is off).
        every_n_seconds: Seconds between the lines written in place of the bar.
    """

    def __init__(
        self,
        what: str,
        total: int | None,
        units: tuple[str, str],
        *,
        enabled: bool = True,
        every_n_seconds: float = 30.0,
    ) -> None:
        self.what = what
        self.total = total
        self.units = units
        self.enabled = enabled
        self.every_n_seconds = every_n_seconds
        self.done = 0
        self._bar: Tqdm | None = None
        self._started = self._last_line = 0.0

    def __enter__(self) -> StepProgress:
        self._started = self._last_line = perf_counter()
        if not self.enabled:
            return self
        if output_is_terminal():
            self._bar = Tqdm(
                desc=self.what, total=self.total, unit=f" {self.units[1]}", leave=False, dynamic_ncols=True,
                file=sys.stdout,
            )
        else:
            log.info("%s: %s", self.what, self._units(self.total) if self.total is not None else "started")
        return self

    def advance(self, units: int = 1) -> None:
        """Count ``units`` more units of work done."""
        self.done += units
        if self._bar is not None:
            self._bar.update(units)
            return
        now = perf_counter()
        if not self.enabled or now - self._last_line < self.every_n_seconds:
            return
        elapsed = now - self._started
        if self.total is None:
            log.info("%s: %s (%s elapsed)", self.what, self._units(self.done), _duration(elapsed))
        elif self.done < self.total:
            left = elapsed / self.done * (self.total - self.done)
            log.info("%s: %d/%s (%s elapsed, about %s left)", self.what, self.done, self._units(self.total),
                     _duration(elapsed), _duration(left))
        self._last_line = now

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.enabled and kind is None:
            log.info("%s: %s done in %s", self.what, self._units(self.done), _duration(self.seconds))

    @property
    def seconds(self) -> float:
        """Seconds since the step started."""
        return perf_counter() - self._started

    def _units(self, count: int) -> str:
        return f"{count} {self.units[0] if count == 1 else self.units[1]}"
