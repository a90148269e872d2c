"""A placement chosen for a memory budget, with what :mod:`.cost` predicts of it, as a table and as data."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_superpipe.units import format_bytes

#: The placements a block's activations may have between its forward and its backward.
MODES = ("recompute", "keep", "offload")
#: One placement for every block, or one per block.
ActivationsPolicy = Union[str, Sequence[str]]

if TYPE_CHECKING:
    from lightning_superpipe.planning.cost import Prediction


@dataclass(frozen=True)
class Plan:
    """Where each block's weights and activations live, and the step time and peak that placement predicts.

    Attributes:
        resident: Indices of the blocks whose weights stay on the device; the others are streamed.
        prefetch: Blocks fetched ahead of the one in use.
        activations: Each block's activation mode (``"keep"``, ``"offload"``, ``"recompute"``).
        budget_bytes: The device memory budget the plan was made for.
        predicted_step_s: Predicted seconds per optimizer step.
        predicted_peak_bytes: Predicted device bytes at the step's worst moment.
        breakdown: The peak's parts (``trunk``, ``trunk_gradients``, ``block_gradients``, ``margin``,
            ``resident_weights``, ``slots``, ``activations``, ``outside_activations``).
        blocks: Per block: ``index``, ``placement`` (``"resident"`` or ``"streamed"``), ``activations``,
            ``predicted_ms`` (its forward and backward per micro-batch, its own copies included, by the per-layer
            rule of :mod:`.cost`: for display, the step time is not their sum) and ``device_bytes`` (its resident
            weights and the activations it holds at the peak).
        predicted_passes: The predicted step's parts in seconds (:attr:`.cost.Prediction.passes`):
            ``first_forward_s``, ``forward_s`` (each later micro-batch's), ``backward_s`` and ``optimizer_s`` (the
            exposed optimizer time).
        measured_step_s: The step time measured once the plan was applied (the fastest of the steps timed,
            :mod:`.check`), or ``None`` before the check has timed it.
        corrections: Each correction of the cost model the check made, in words (what it measured against what was
            predicted, and the term it set), in order.
        checks: Each placement the check applied and timed: ``resident``, ``prefetch``, ``activations``,
            ``predicted_step_s`` and ``predicted_peak_bytes`` (when applied) and ``measured_step_s``.
        measured_peak_bytes: The most device bytes held at once over the steps run in this placement (the
            strategy's ledger: weights, gradients, activations in and outside the blocks; on CUDA, at least what the
            allocator measured), or ``None`` before a step ran in it.
    """

    resident: frozenset[int]
    prefetch: int
    activations: list[str]
    budget_bytes: int
    predicted_step_s: float
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    blocks: list[dict[str, Any]]
    predicted_passes: dict[str, float] = field(default_factory=dict)
    measured_step_s: Optional[float] = None
    corrections: tuple[str, ...] = ()
    checks: tuple[dict[str, Any], ...] = ()
    measured_peak_bytes: Optional[int] = None

    @classmethod
    def from_prediction(
        cls,
        resident: Collection[int],
        prefetch: int,
        activations: Sequence[str],
        budget_bytes: int,
        prediction: Prediction,
    ) -> Plan:
        """The plan of a placement, with ``prediction`` (from :func:`~.cost.predict` of that placement)."""
        blocks = [
            {
                "index": index,
                "placement": "resident" if index in resident else "streamed",
                "activations": mode,
                "predicted_ms": (costs["forward_s"] + costs["backward_s"]) * 1e3,
                "device_bytes": costs["device_bytes"],
            }
            for index, (mode, costs) in enumerate(zip(activations, prediction.per_block))
        ]
        return cls(
            resident=frozenset(resident),
            prefetch=prefetch,
            activations=list(activations),
            budget_bytes=budget_bytes,
            predicted_step_s=prediction.step_s,
            predicted_peak_bytes=prediction.peak_bytes,
            breakdown=dict(prediction.breakdown),
            blocks=blocks,
            predicted_passes=dict(prediction.passes),
        )

    def table(self) -> str:
        """One row per block (consecutive blocks that read the same share one, e.g. ``3-10``), then the totals."""
        header = ("blocks", "placement", "activations", "ms/micro-batch", "device")
        runs: list[tuple[int, int, tuple[str, ...]]] = []
        for block in self.blocks:
            cells = (
                block["placement"],
                block["activations"],
                f"{block['predicted_ms']:.2f}",
                format_bytes(block["device_bytes"]),
            )
            if runs and runs[-1][2] == cells:
                runs[-1] = (runs[-1][0], block["index"], cells)
            else:
                runs.append((block["index"], block["index"], cells))
        rows = [(str(first) if first == last else f"{first}-{last}", *cells) for first, last, cells in runs]
        widths = [max(len(row[column]) for row in (header, *rows)) for column in range(len(header))]
        # Names read left-aligned, numbers right-aligned.
        lines = [
            "  ".join(
                cell.ljust(width) if column < 3 else cell.rjust(width)
                for column, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in (header, *rows)
        ]
        parts = ", ".join(
            f"{name.replace('_', ' ')} {format_bytes(nbytes)}" for name, nbytes in self.breakdown.items() if nbytes
        )
        passes = self.predicted_passes
        if passes:
            parts_ms = (
                f" (forward {passes['forward_s'] * 1e3:.2f} ms, the first {passes['first_forward_s'] * 1e3:.2f} ms;"
                f" backward {passes['backward_s'] * 1e3:.2f} ms; optimizer {passes['optimizer_s'] * 1e3:.2f} ms"
                " exposed)"
            )
        else:
            parts_ms = ""
        lines += [
            f"predicted step  {self.predicted_step_s * 1e3:.2f} ms{parts_ms}",
            f"predicted peak  {format_bytes(self.predicted_peak_bytes)} of a {format_bytes(self.budget_bytes)} budget"
            f" ({parts or 'nothing'})",
            f"prefetch        {self.prefetch}",
        ]
        if self.measured_step_s is not None:
            measured = self.measured_step_s * 1e3
            lines.append(f"measured step   {measured:.2f} ms (the fastest of the steps timed once applied)")
        if self.measured_peak_bytes is not None:
            lines.append(f"measured peak   {format_bytes(self.measured_peak_bytes)} (the most at once, once applied)")
        lines += [f"correction {n}    {text}" for n, text in enumerate(self.corrections, 1)]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the resident set as a sorted list)."""
        return {
            "resident": sorted(self.resident),
            "prefetch": self.prefetch,
            "activations": list(self.activations),
            "budget_bytes": self.budget_bytes,
            "predicted_step_s": self.predicted_step_s,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "breakdown": dict(self.breakdown),
            "blocks": [dict(block) for block in self.blocks],
            "predicted_passes": dict(self.predicted_passes),
            "measured_step_s": self.measured_step_s,
            "corrections": list(self.corrections),
            "checks": [dict(check) for check in self.checks],
            "measured_peak_bytes": self.measured_peak_bytes,
        }
