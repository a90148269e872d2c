"""Show what a run costs in device memory: a progress-bar figure, a table at the end and a plot over the batches.

The table sets the peak device memory of the run against the plain strategy's peak for the same batch: every
weight, a gradient for every trainable weight, the optimizer's state and, in ``fit``, the activations the step saves
for backward, measured on the run's first batch before the strategy takes the module over
(:mod:`~lightning_superpipe.recipes.plain_activations`). Both sides count activations, so the ratio compares like with
like. With the superpipe strategy the run's figures come from its ``memory_report()``; with any other strategy the
plain figures are computed from the module and the optimizers, and the peak comes from CUDA when there is one. When a
:class:`~lightning_superpipe.moe.PagedMoECallback` pages the experts, its figures join the table.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from lightning_superpipe.recipes.plain_activations import ActivationCount, measure_plain_activations
from lightning_superpipe.units import format_bytes

log = logging.getLogger(__name__)

#: File names written into the run's log folder.
REPORT_FILENAME = "memory_report.json"
PLOT_FILENAME = "device_memory.png"


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizers: list[Optimizer], device: torch.device | None = None) -> int:
    """Bytes of the tensors the optimizers keep per parameter (AdamW: two moments and a step count).

    Args:
        optimizers: The trainer's optimizers.
        device: Count only tensors on this device; ``None`` counts all.
    """
    return sum(
        tensor_bytes(value)
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and (device is None or value.device == device)
    )


def strategy_memory_report(trainer: Trainer) -> dict[str, int] | None:
    """The strategy's own ``memory_report()`` (the superpipe strategy has one), or ``None``."""
    report = getattr(trainer.strategy, "memory_report", None)
    return dict(report()) if callable(report) else None


def paged_moe_callbacks(trainer: Trainer) -> list[Any]:
    """The trainer's :class:`~lightning_superpipe.moe.PagedMoECallback` instances."""
    from lightning_superpipe.moe import PagedMoECallback

    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    return [callback for callback in callbacks if isinstance(callback, PagedMoECallback)]


def active_paged_experts(trainer: Trainer) -> list[Any]:
    """Handles of the experts paged right now (between a paged stage's start and end)."""
    return [callback.handle for callback in paged_moe_callbacks(trainer) if callback.handle is not None]


def weight_bytes(trainer: Trainer, pl_module: LightningModule) -> tuple[int, int]:
    """``(all, trainable)`` parameter bytes of the module, counting paged experts at their original size.

    Paging takes the expert parameters out of the model; the plain strategy would hold them as they were.
    """
    parameters = list(pl_module.parameters())
    paged = sum(handle.max_bytes() for handle in active_paged_experts(trainer))
    return (
        sum(tensor_bytes(p) for p in parameters) + paged,
        sum(tensor_bytes(p) for p in parameters if p.requires_grad),
    )


@dataclass
class MemorySample:
    """Device memory after one batch.

    Args:
        batch: 1-based index of the batch within the stage.
        device_bytes: Bytes on the compute device: CUDA's allocated bytes; else what the superpipe strategy's ledger
            holds (block weights, the weights outside the blocks, gradients on their way to the host); else the
            module's weights, gradients and optimizer state on the device; plus, off CUDA, the pages of paged
            experts.
        peak_device_bytes: Highest device bytes so far, when the strategy or CUDA tracks it.
    """

    batch: int
    device_bytes: int
    peak_device_bytes: int | None


@dataclass
class MemorySummary:
    """The figures of the memory table; see :class:`MemoryReport`."""

    stage: str
    strategy: str
    device: str
    param_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    plain_total_bytes: int
    superpipe_peak_device_bytes: int | None = None
    trunk_device_bytes: int | None = None
    cuda_max_allocated_bytes: int | None = None
    host_bytes: int | None = None
    strategy_report: dict[str, Any] | None = None
    paged_moe: dict[str, float] | None = None
    samples: list[MemorySample] = field(default_factory=list)
    #: The median wall time of the optimizer steps that ran in the plan (``memory_budget=``), for the plan's rows.
    planned_step_s: float | None = None
    #: Plain training's saved activations on the run's first batch (``fit`` only); ``None`` when not measured.
    plain_activation_bytes: int | None = None
    #: The part of them outside the streamed blocks (embeddings, head, loss), which the superpipe ledger leaves out.
    outside_blocks_activation_bytes: int | None = None
    #: Why the activations were not measured, when they were not.
    plain_activations_note: str = ""
    #: How plain training's activations were had: ``"measured"`` (a plain step on the first batch, before the run) or
    #: ``"counted in the profiled step"`` (where the weights are not built before the run, as under the disk tier:
    #: what the superpipe planner's profiled step saw each block and the rest of the step save for backward).
    plain_activations_source: str = "measured"
    #: Optimizer steps the run took (``fit``), for the figures per step.
    steps: int = 0
    #: The most host memory the process held at once (its peak resident set, everything: the libraries, the model as
    #: loaded, the data, the strategy's buffers), where the platform reports it.
    process_peak_host_bytes: int | None = None
    #: Whether the stage ended by an exception (a Ctrl-C, an error): the figures are those up to it.
    interrupted: bool = False

    @property
    def sampled_max_bytes(self) -> int | None:
        """The most device bytes seen after a batch."""
        return max((sample.device_bytes for sample in self.samples), default=None)

    @property
    def peak_bytes(self) -> int | None:
        """The run's measured device peak: CUDA's when available (it includes activations); else the superpipe
        strategy's ledger peak (every byte it put on the device: block weights, the weights outside the blocks and
        the gradients of both); else the most seen after a batch.
        """
        if self.cuda_max_allocated_bytes is not None:
            return self.cuda_max_allocated_bytes
        if self.superpipe_peak_device_bytes is not None:
            return self.superpipe_peak_device_bytes
        return self.sampled_max_bytes

    @property
    def plain_peak_bytes(self) -> int:
        """Plain training's peak on the device: weights, gradients, optimizer state and its measured activations."""
        return self.plain_total_bytes + (self.plain_activation_bytes or 0)

    @property
    def uncounted_activation_bytes(self) -> int:
        """Activations the run held that :attr:`peak_bytes` leaves out: all of them for samples taken after a batch;
        none for CUDA's peak, which counts every allocation, nor for the superpipe ledger, which counts what the step
        saves for backward in the blocks and outside them."""
        if self.plain_activation_bytes is None or self.cuda_max_allocated_bytes is not None:
            return 0
        if self.superpipe_peak_device_bytes is not None:
            return 0
        return self.plain_activation_bytes if self.samples else 0

    @property
    def compared_peak_bytes(self) -> int | None:
        """The run's device peak with its activations, what the ratio sets against :attr:`plain_peak_bytes`."""
        return None if self.peak_bytes is None else self.peak_bytes + self.uncounted_activation_bytes

    @property
    def peak_ratio(self) -> float | None:
        """:attr:`compared_peak_bytes` / :attr:`plain_peak_bytes`."""
        peak, plain = self.compared_peak_bytes, self.plain_peak_bytes
        return peak / plain if peak is not None and plain > 0 else None

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows of the table, in display order."""
        return [*self._run_rows(), *self._plain_rows(), *self._ratio_rows()]

    def _run_rows(self) -> list[tuple[str, str]]:
        """What the run held: the strategy's count, CUDA's or the samples', and the plan's prediction."""
        rows: list[tuple[str, str]] = []
        if self.superpipe_peak_device_bytes is not None:
            rows.append(("peak on device, strategy's count", format_bytes(self.superpipe_peak_device_bytes)))
        if self.trunk_device_bytes is not None:
            rows.append(("  of which weights outside the blocks", format_bytes(self.trunk_device_bytes)))
        report = self.strategy_report or {}
        if "peak_trunk_gradient_bytes" in report:
            rows.append(("  their gradients, most at once", format_bytes(report["peak_trunk_gradient_bytes"])))
        if "peak_block_gradient_bytes" in report:
            rows.append(("  block gradients, most at once", format_bytes(report["peak_block_gradient_bytes"])))
        if report.get("peak_activation_bytes"):
            rows.append(("  kept activations, most at once", format_bytes(report["peak_activation_bytes"])))
        if report.get("peak_outside_activation_bytes"):
            rows.append(("  activations outside the blocks, most at once",
                         format_bytes(report["peak_outside_activation_bytes"])))
        if self.cuda_max_allocated_bytes is not None:
            rows.append(("peak CUDA memory allocated", format_bytes(self.cuda_max_allocated_bytes)))
        if self.cuda_max_allocated_bytes is None and self.superpipe_peak_device_bytes is None and self.samples:
            rows.append(("most on device after a batch", format_bytes(self.sampled_max_bytes or 0)))
        if self.uncounted_activation_bytes:
            # Both sides of the ratio count the same activations: add those the samples above leave out.
            rows.append(("  activations of the step, freed by then", format_bytes(self.uncounted_activation_bytes)))
            rows.append(("device peak, activations included", format_bytes(self.compared_peak_bytes or 0)))
        if self.host_bytes is not None:
            rows.append(("host memory the strategy allocated (homes, copies, staging)", format_bytes(self.host_bytes)))
        if self.process_peak_host_bytes is not None:
            rows.append(("host memory of the whole process, most at once", format_bytes(self.process_peak_host_bytes)))
        rows += self._four_bit_rows(report)
        paged = self.paged_moe
        if paged:
            rows.append(("paged experts on device, most at once", format_bytes(paged["expert_bytes_device_max"])))
            rows.append(("  the same experts at 16 bits", format_bytes(paged["expert_bytes_16bit"])))
            if "ppl_paged" in paged:
                perplexities = f"{paged['ppl_paged']:.3f} / {paged['ppl_full']:.3f}"
                rows.append(("  perplexity paged / full experts", perplexities))
        plan = report.get("plan")
        if plan is not None:
            measured_peak = self.peak_bytes or 0
            rows.append((f"plan for a {format_bytes(plan['budget_bytes'])} budget: peak predicted / measured",
                         f"{format_bytes(plan['predicted_peak_bytes'])} / {format_bytes(measured_peak)}"))
            if self.planned_step_s is not None:
                rows.append(("  step time predicted / measured",
                             f"{plan['predicted_step_s'] * 1e3:.0f} / {self.planned_step_s * 1e3:.0f} ms"))
        return rows

    def _four_bit_rows(self, report: dict[str, Any]) -> list[tuple[str, str]]:
        """A 4-bit frozen base (QLoRA): its host bytes and the blocks' bytes streamed a step, each beside what the
        same weights would take at 16 bits."""
        packed = report.get("packed_weight_bytes")
        if not packed:
            return []
        sixteen = 2 * report["packed_weight_numel"]
        rows = [("frozen 4-bit base in host memory", format_bytes(packed)),
                ("  the same weights at 16 bits", format_bytes(sixteen))]
        if self.steps:
            streamed, streamed_packed = report["streamed_block_bytes"], report["streamed_packed_weight_bytes"]
            at_16_bits = streamed - streamed_packed + streamed_packed * sixteen / packed
            rows.append(("block weights streamed a step", format_bytes(int(streamed / self.steps))))
            rows.append(("  with the base at 16 bits", format_bytes(int(at_16_bits / self.steps))))
        return rows

    def _plain_rows(self) -> list[tuple[str, str]]:
        """What the plain strategy holds at its peak, part by part."""
        measured = self.plain_activation_bytes is not None
        if measured:
            title = "plain strategy's peak on device, same batch:"
        elif self.stage == "fit":
            title = f"plain strategy on device, activations not measured ({self.plain_activations_note or 'off'}):"
        else:
            title = "plain strategy on device (no activations are saved outside fit):"
        rows = [(title, ""), ("  weights", format_bytes(self.param_bytes))]
        if self.stage == "fit":
            rows.append(("  gradients", format_bytes(self.gradient_bytes)))
            rows.append(("  optimizer state", format_bytes(self.optimizer_state_bytes)))
        if measured:
            rows.append((f"  activations saved for backward ({self.plain_activations_source})",
                         format_bytes(self.plain_activation_bytes or 0)))
        rows.append(("  total", format_bytes(self.plain_peak_bytes)))
        return rows

    def headline(self) -> tuple[str, str] | None:
        """The ratio row, ``(label, value)``, its label saying what both sides count; ``None`` without a peak."""
        ratio = self.peak_ratio
        if ratio is None:
            return None
        if self.plain_activation_bytes is not None:
            label = "device peak / plain peak (activations included)"
        elif self.stage == "fit":
            label = "device peak / plain peak (plain's activations not measured)"
        else:
            label = "device peak / plain peak"
        return label, f"{100.0 * ratio:.1f} %"

    def _ratio_rows(self) -> list[tuple[str, str]]:
        """The headline ratio and the blocks a plan keeps activations of."""
        headline = self.headline()
        if headline is None:
            return []
        rows = [headline]
        plan = (self.strategy_report or {}).get("plan")
        kept = [index for index, mode in enumerate(plan["activations"]) if mode == "keep"] if plan else []
        if kept:
            # A budget with room makes the plan keep activations (no recomputation): faster, and it shows in the peak.
            rows.append((f"  the plan keeps the activations of {_block_ranges(kept)} on the device", ""))
        return rows

    def table(self) -> str:
        """The summary as an aligned plain-text table."""
        rows = self.rows()
        label_width = max(len(label) for label, _ in rows)
        value_width = max(len(value) for _, value in rows)
        title = [f"Device memory: {self.stage} with {self.strategy} on {self.device}"
                 + (" (interrupted: the figures up to then)" if self.interrupted else "")]
        title += [f"streaming {stack}" for stack in (self.strategy_report or {}).get("streamed_stacks", [])]
        rule = "-" * (label_width + value_width + 3)
        # Section titles have no value: no trailing blanks after them.
        body = [f"{label:<{label_width}}   {value:>{value_width}}".rstrip() for label, value in rows]
        lines = [*title, rule, *body, rule]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures, with the measured peak and the per-batch samples."""
        return {
            **asdict(self),
            "peak_bytes": self.peak_bytes,
            "sampled_max_bytes": self.sampled_max_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "compared_peak_bytes": self.compared_peak_bytes,
            "peak_ratio": self.peak_ratio,
        }


def _block_ranges(indices: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``blocks 1-3, 5``; one index as ``block 1``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    text = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
    return f"block {text}" if len(indices) == 1 else f"blocks {text}"


class MemoryReport(Callback):
    """Device memory on the progress bar, a table at the end of each stage, and a plot in the log folder.

    During ``fit`` the progress bar shows ``dev_mem_MiB`` (``dev_mem_GiB`` for models of a GiB or more). When a
    stage ends, the callback prints the table, writes its figures and the per-batch samples to
    ``memory_report.json`` and, if matplotlib is installed (``pip install lightning-superpipe[plot]``), plots device
    memory over the batches into ``device_memory.png``, both in the trainer's log folder.

    In ``fit`` the plain strategy's figure includes its activations: in ``setup``, before the strategy takes the module
    over, one ``training_step`` of the module runs on the run's first batch (on the host copy when the module is
    there) to count what it saves for backward, without a backward; the run's RNG, weights, buffers and logged
    metrics are left as they were (:mod:`~lightning_superpipe.recipes.plain_activations`). It costs one forward.

    Args:
        plot: Write ``device_memory.png``.
        progress_bar: Show device memory on the progress bar during ``fit``.
        plain_activations: Measure plain training's activations with one forward on the host before the run:
            ``None`` (default) where the run computes on the CPU, where that forward costs what one step does;
            ``True`` also for a GPU run (a large model's forward on the host can take minutes); ``False`` never (the
            table then says they were not measured).
    """

    def __init__(self, plot: bool = True, progress_bar: bool = True, plain_activations: bool | None = None) -> None:
        self.plot = plot
        self.progress_bar = progress_bar
        self.plain_activations = plain_activations
        self.activations: ActivationCount | None = None
        self._activations_note = "off"
        self.samples: list[MemorySample] = []
        self.summary: MemorySummary | None = None
        self._unit_name = "MiB"
        self._unit_bytes = 2**20
        self._step_times: dict[int, float] = {}  # optimizer step -> the wall time of its micro-batches
        self._batch_start = (0, 0.0)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.samples = []
        self.summary = None
        self._step_times = {}
        if weight_bytes(trainer, pl_module)[0] >= 2**30:
            self._unit_name, self._unit_bytes = "GiB", 2**30
        on_cpu = trainer.strategy.root_device.type == "cpu"
        if stage == "fit" and (self.plain_activations or (self.plain_activations is None and on_cpu)):
            self.activations, self._activations_note = measure_plain_activations(
                trainer, pl_module, getattr(trainer.strategy, "block_policy", None)
            )
        elif stage == "fit" and self.plain_activations is None:
            self._activations_note = "a forward on the host would be slow here; MemoryReport(plain_activations=True)"
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def _sample(self, trainer: Trainer, pl_module: LightningModule) -> MemorySample:
        device = trainer.strategy.root_device
        report = strategy_memory_report(trainer)
        peak: int | None = None
        if device.type == "cuda":
            device_bytes = torch.cuda.memory_allocated(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            if report is not None and "device_bytes" in report:
                # The strategy's ledger counts every byte it put on the device.
                device_bytes = report["device_bytes"]
                peak = report.get("peak_device_bytes")
            else:
                device_bytes = sum(
                    tensor_bytes(p) + (tensor_bytes(p.grad) if p.grad is not None else 0)
                    for p in pl_module.parameters()
                    if p.device == device
                ) + optimizer_state_bytes(trainer.optimizers, device)
            device_bytes += sum(handle.device_bytes() for handle in active_paged_experts(trainer))
        sample = MemorySample(batch=len(self.samples) + 1, device_bytes=int(device_bytes), peak_device_bytes=peak)
        self.samples.append(sample)
        return sample

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Micro-batches are grouped by the optimizer step they belong to: the counter as each one starts.
        self._batch_start = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step, start = self._batch_start
        self._step_times[step] = self._step_times.get(step, 0.0) + time.perf_counter() - start
        sample = self._sample(trainer, pl_module)
        if self.progress_bar:
            pl_module.log(
                f"dev_mem_{self._unit_name}", sample.device_bytes / self._unit_bytes, prog_bar=True, logger=False
            )

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.state.fn == "validate":  # during fit only the training batches are plotted
            self._sample(trainer, pl_module)

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._sample(trainer, pl_module)

    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._sample(trainer, pl_module)

    # The figures are taken when a stage ends, while the strategy still holds the model (``on_fit_end`` comes
    # after the strategy's teardown, so fit uses ``on_train_end``); they are shown in ``teardown``, once every
    # callback, the paged-MoE one included, has finished the stage.

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = self.summarize(trainer, pl_module, "fit")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.summary = self.summarize(trainer, pl_module, "validate")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = self.summarize(trainer, pl_module, "test")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = self.summarize(trainer, pl_module, "predict")

    def summarize(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> MemorySummary:
        """The table's figures for the stage that just ended.

        Args:
            trainer: The trainer that ran the stage.
            pl_module: The module it ran.
            stage: ``fit``, ``validate``, ``test`` or ``predict``.
        """
        report = strategy_memory_report(trainer) or {}
        param_bytes, trainable_bytes = weight_bytes(trainer, pl_module)
        training = stage == "fit"
        # Outside ``fit`` the plain strategy keeps only the weights: no gradients, no optimizer.
        gradient_bytes = trainable_bytes if training else 0
        optimizer_bytes = (
            report.get("optimizer_state_bytes", optimizer_state_bytes(trainer.optimizers)) if training else 0
        )
        device = trainer.strategy.root_device
        activations = self.activations if training else None
        plain_activations = activations.total_bytes if activations is not None else None
        source = "measured"
        if training and plain_activations is None:
            plain_activations = activations_counted_in_run(report)
            source = "counted in the profiled step"
        return MemorySummary(
            stage=stage,
            strategy=describe_strategy(trainer, report),
            device=str(device),
            param_bytes=param_bytes,
            gradient_bytes=gradient_bytes,
            optimizer_state_bytes=int(optimizer_bytes),
            plain_total_bytes=int(param_bytes + gradient_bytes + optimizer_bytes),
            superpipe_peak_device_bytes=report.get("peak_device_bytes"),
            trunk_device_bytes=report.get("trunk_device_bytes"),
            cuda_max_allocated_bytes=(
                report.get("cuda_max_allocated_bytes", torch.cuda.max_memory_allocated(device))
                if device.type == "cuda"
                else None
            ),
            host_bytes=report.get("host_bytes"),
            strategy_report=report or None,
            samples=list(self.samples),
            planned_step_s=self._planned_step_s(trainer),
            plain_activation_bytes=plain_activations,
            plain_activations_source=source,
            outside_blocks_activation_bytes=activations.outside_blocks_bytes if activations is not None else None,
            plain_activations_note=self._activations_note if training else "",
            steps=trainer.global_step if training else 0,
            process_peak_host_bytes=process_peak_host_bytes(),
        )

    def _planned_step_s(self, trainer: Trainer) -> float | None:
        """The median time of the steps after the plan was applied, and after the first of them (a warm-up)."""
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None:
            return None
        from lightning_superpipe.planning.planner import BudgetPlanner

        times = [seconds for step, seconds in self._step_times.items() if step > BudgetPlanner.PROFILED_STEPS]
        return statistics.median(times) if times else None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A stage stopped by an exception (Ctrl-C, an error) still gets its table and files, with the figures up to
        then: Lightning calls no ``teardown`` of callbacks after one."""
        stage = trainer.state.stage
        if self.summary is not None or stage is None:
            return
        name = {"train": "fit", "sanity_check": "fit"}.get(stage.value, stage.value)
        try:
            self.summary = self.summarize(trainer, pl_module, name)
            self.summary.interrupted = True
            self.teardown(trainer, pl_module, name)
        except Exception as error:  # the report must not hide the exception that stopped the run
            log.warning("MemoryReport could not write the interrupted run's report: %r", error)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # On several ranks `log_dir` is a broadcast from rank 0: every rank asks, or rank 0 waits for ever.
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        summary = self.summary
        if summary is None or not trainer.is_global_zero:
            return
        # The paged-MoE callback files its figures for the stage when the stage ends, maybe after this callback.
        summary_stage = summary.stage if summary.stage != "fit" else "validate"
        for callback in paged_moe_callbacks(trainer):
            summary.paged_moe = callback.reports.get(summary_stage) or summary.paged_moe
        print(f"\n{summary.table()}\n", flush=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        written = [log_dir / REPORT_FILENAME]
        written[0].write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
        if self.plot and summary.samples:
            plot_path = plot_device_memory(summary, log_dir / PLOT_FILENAME)
            if plot_path is not None:
                written.append(plot_path)
        print("Memory report written to " + ", ".join(str(path) for path in written), flush=True)


def activations_counted_in_run(report: dict[str, Any]) -> int | None:
    """Plain training's activations from what the superpipe strategy's planner counted in its profiled step (every
    block's saved tensors as plain training holds them, each storage once, and those saved outside the blocks), or
    ``None`` without a plan (``memory_budget``)."""
    return report.get("profiled_activation_bytes")


def process_peak_host_bytes() -> int | None:
    """The process's peak resident set in bytes (``getrusage``: kilobytes on Linux, bytes on macOS), or ``None``
    where there is no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def describe_strategy(trainer: Trainer, report: dict[str, Any]) -> str:
    """Strategy class name, with the superpipe settings when its report has them."""
    name = type(trainer.strategy).__name__
    settings = [f"{key}={report[key]}" for key in ("num_blocks", "resident_blocks", "prefetch") if key in report]
    return f"{name} ({', '.join(settings)})" if settings else name


def plot_device_memory(summary: MemorySummary, path: Path) -> Path | None:
    """Plot device memory over the batches, with the plain strategy's requirement for comparison.

    Args:
        summary: The stage's figures and samples.
        path: The PNG file to write.

    Returns:
        ``path``, or ``None`` when matplotlib is not installed.
    """
    try:
        # The object-oriented API, not pyplot: no global figure state, no GUI backend, safe inside any program.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        log.warning("matplotlib is not installed, so no %s: `pip install lightning-superpipe[plot]`.", path.name)
        return None
    extra = summary.uncounted_activation_bytes
    peaks = [sample.peak_device_bytes for sample in summary.samples]
    largest = max([summary.plain_peak_bytes, *(s.device_bytes for s in summary.samples),
                   *(peak + extra for peak in peaks if peak is not None)])
    unit_name, unit_bytes = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    batches = [sample.batch for sample in summary.samples]
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    device_bytes = [sample.device_bytes / unit_bytes for sample in summary.samples]
    axes.plot(batches, device_bytes, marker=".", label="on device after each batch (its activations freed)")
    if all(peak is not None for peak in peaks):
        values = [(peak + extra) / unit_bytes for peak in peaks if peak is not None]
        axes.step(batches, values, where="post", label=_peak_label(summary))
    axes.axhline(summary.plain_peak_bytes / unit_bytes, color="tab:red", linestyle="--", label=_plain_label(summary))
    axes.set_xlabel(f"{'training' if summary.stage == 'fit' else summary.stage} batch")
    axes.set_ylabel(f"device memory ({unit_name})")
    axes.set_ylim(bottom=0)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    title = f"Device memory: {summary.stage} with {summary.strategy} on {summary.device}"
    headline = summary.headline()
    if headline is not None:  # as the table words it
        title += "\n" + ": ".join(headline)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    figure.savefig(path, dpi=120)
    return path


def _peak_label(summary: MemorySummary) -> str:
    """What the plot's peak line counts."""
    if summary.cuda_max_allocated_bytes is not None:
        return "peak so far: all CUDA allocations (activations included)"
    if summary.superpipe_peak_device_bytes is None:
        return "peak so far"
    return "peak so far: the strategy's weights, gradients and activations"


def _plain_label(summary: MemorySummary) -> str:
    """What the plot's plain-strategy line counts."""
    if summary.stage != "fit":
        return "plain strategy: weights"
    parts = "weights + gradients + optimizer state"
    if summary.plain_activation_bytes is None:
        return f"plain strategy: {parts} (activations not measured)"
    return f"plain strategy's peak: {parts} + activations (same batch)"
