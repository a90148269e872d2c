"""What the planner knows about a run: the costs one profiled training step measured.

Everything here is measured, none of it is guessed from the model's config: a block's compute times and the bytes its
saved activations take come from running it, the link's speeds from copies on the real copy path (the copier's
streams, pinned buffers; on the CPU the emulated link), and the bytes outside blocks from the engine's ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from time import perf_counter  # bound at import: a test's patch of time.perf_counter times its own code
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_superpipe.planning.engine_view import PlannedEngine


@dataclass(frozen=True)
class BlockCosts:
    """One streamed block's costs, per micro-batch.

    Attributes:
        forward_s: Compute time of its forward.
        backward_s: Compute time of its backward, without recomputation.
        recompute_s: Time of recomputing its forward in backward (``"recompute"``).
        weight_bytes: Bytes of its weights on the device (what one copy of it moves, and what a resident copy or its
            share of a slot holds).
        gradient_bytes: Bytes of its weight gradients that leave the device after its backward.
        kept_bytes: Its saved activations under ``"keep"`` (each storage once).
        offloaded_bytes: What ``"offload"`` copies to the host in forward and back in backward.
        small_bytes: What ``"offload"`` leaves on the device (saved tensors below the offload threshold).
        input_bytes: What ``"recompute"`` holds until backward: its inputs, saved by the checkpoint.
        saved_input_bytes: Of ``kept_bytes``, its own inputs (a norm saves its input): under ``"recompute"`` the
            checkpoint holds them already, and the recomputation saves the same storage again.
        optimizer_s: The host optimizer step over its parameters.
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    weight_bytes: int
    gradient_bytes: int
    kept_bytes: int
    offloaded_bytes: int
    small_bytes: int
    input_bytes: int
    optimizer_s: float
    saved_input_bytes: int = 0


@dataclass(frozen=True)
class Profile:
    """The costs of a run, from one profiled step.

    Attributes:
        blocks: Each block's costs, in block order.
        trunk_s: Compute time outside the blocks (embeddings, head, loss) per micro-batch, forward and backward.
        head_s: Of ``trunk_s``, the compute between the blocks' forward and their backward (the final norm, the head,
            the loss and their backward): the activations' copies out still run during it.
        trunk_optimizer_s: The host optimizer step over the parameters outside blocks.
        h2d_bytes_per_s: Host-to-device speed of the copy path, as copies queued one after another get it (where
            copies run beside compute, the slope of the profiled copies' times over their bytes: each profiled copy
            ran alone and paid a latency that queued copies do not).
        d2h_bytes_per_s: Device-to-host speed of the copy path, the same way.
        asynchronous: Whether copies run beside compute (CUDA, an emulated link) or on the compute thread (a CPU
            device), where their time adds to it.
        overlap_optimizer: Whether the optimizer steps each block during backward
            (:mod:`lightning_superpipe.stepping.overlap`).
        micro_batches: Micro-batches per optimizer step (``accumulate_grad_batches``).
        trunk_bytes: Device bytes of the weights outside blocks (always resident).
        trunk_gradient_bytes: The most device bytes of their gradients at once.
        trunk_gradient_bytes_in_blocks: Of those, the gradients that can be on the device while blocks run backward:
            of the weights a forward uses after its first block (a final norm, a head, a tied embedding). The
            others' (an untied embedding's) arrive only after every block's backward. ``None``: all of them.
        block_gradient_bytes: The most device bytes of block gradients waiting to leave at once.
        margin_bytes: Device bytes the ledger does not count (the allocator's rounding and cache, what is not saved
            for backward) measured on CUDA during the profiled step; 0 on the CPU. :mod:`.check` raises it where
            an applied plan's peak exceeds its prediction.
        trunk_update_bytes: Bytes of the weights outside blocks that each optimizer step changes: copied to the device
            again at the start of each step, and their gradients off it at the end of each backward.
        offload_compute_s_per_byte: Compute time each offloaded byte costs a block, in its forward (the copy out)
            and again in its backward (the copy back): what offloading takes from compute beyond the link's time
            (issuing many copies, the copies' interference with compute). Measured in the profile where copies run
            beside compute, from each block's :class:`OffloadTiming` (0 on a synchronous link, where the copies'
            time is the link's); set from a measured step by :mod:`.check` when an applied plan that offloads runs
            slower than predicted.
        link_slowdown: How many times longer every copy takes in a running step than in the profiled one (where each
            copy ran alone): 1 in a profile; set from a measured step by :mod:`.check`.
        step_overhead_s: Seconds per step that no term of the model accounts for: 0 in a profile; set from a
            measured step by :mod:`.check` when no other term can explain it.
        outside_activation_bytes: The most device bytes a step saves for backward outside the blocks at once
            (embeddings, a final norm, the head's logits, the loss): held as forward ends and while the head's
            backward runs, beside every block's activations.
        outside_activation_bytes_in_blocks: Of those, the most still held while blocks run backward (the head's
            are freed by then).
        trunk_gradient_bytes_held_in_blocks: Where copies are synchronous (the CPU link), the most trunk gradients
            the profiled step held while blocks ran backward: each leaves as it is delivered, so that is what any
            placement holds then (a tied weight's, waiting for its last part). ``None`` where copies run beside
            compute and a gradient waits for its copy as long as the link makes it: the bound
            ``trunk_gradient_bytes_in_blocks`` then.
        copy_spread: How far a weights' copy's time strays from the median copy's (per byte), on average, as a
            fraction of it: what a prefetch of 1 exposes and a deeper one hides (:mod:`.cost`). Measured over the
            profiled copies; set from a measured step by :mod:`.check` when a plan at prefetch 1 runs slower than
            predicted.
    """

    blocks: list[BlockCosts]
    trunk_s: float
    trunk_optimizer_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    asynchronous: bool
    overlap_optimizer: bool
    micro_batches: int
    trunk_bytes: int
    trunk_gradient_bytes: int
    block_gradient_bytes: int
    margin_bytes: int = 0
    trunk_update_bytes: int = 0
    offload_compute_s_per_byte: float = 0.0
    link_slowdown: float = 1.0
    step_overhead_s: float = 0.0
    copy_spread: float = 0.0
    trunk_gradient_bytes_in_blocks: Optional[int] = None
    head_s: float = 0.0
    outside_activation_bytes: int = 0
    outside_activation_bytes_in_blocks: int = 0
    trunk_gradient_bytes_held_in_blocks: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class OffloadTiming:
    """One block call run through ``"offload"``'s copies on the side, for the cost of offloading on this machine's
    real copy path: the call's compute alone and with its copies, each way.

    Attributes:
        offloaded_bytes: What the call copied out and back.
        forward_s: The call's compute under the census's hooks, no copy.
        out_s: The same with each saved activation copied to the host as it is saved (``"offload"``'s forward).
        computed_s: The call's compute without gradients, no copy.
        back_s: The same, after issuing the copies of everything the call sent out back to the device (as
            ``"offload"``'s backward brings a block's activations back while the block after it computes).
    """

    offloaded_bytes: int
    forward_s: float
    out_s: float
    computed_s: float
    back_s: float


class StepProfiler:
    """Measures one training micro-batch of a streaming engine, for :class:`Profile`.

    The engine's hooks tell it what the compute thread is doing (:meth:`enter`: a block's forward or backward, or
    the trunk); every copy is timed on its own by making it synchronous (the device is synchronized before and after
    it), so compute phases never include copy time and the copies give the link's speed on the real copy path. The
    profiled micro-batch is slower than the others, and computes the same values.

    Args:
        engine: The engine to measure (a ``StreamingEngine``).
        num_blocks: The number of blocks.
    """

    def __init__(self, engine: PlannedEngine, num_blocks: int) -> None:
        self.engine = engine
        self.num_blocks = num_blocks
        self.forward_s = [0.0] * num_blocks
        self.backward_s = [0.0] * num_blocks
        self.trunk_s = 0.0
        #: Of ``trunk_s``, what ran after the first block's forward began and before backward reached a block.
        self.head_s = 0.0
        self.copy_s = {"h2d": 0.0, "d2h": 0.0}
        #: Each copy's ``(bytes, seconds)``, per direction.
        self.copies: dict[str, list[tuple[int, float]]] = {"h2d": [], "d2h": []}
        self.recompute_s = [0.0] * num_blocks
        self.input_bytes = [0] * num_blocks
        self.saved_input_bytes = [0] * num_blocks
        self.kept_bytes = [0] * num_blocks
        self.offloaded_bytes = [0] * num_blocks
        self.small_bytes = [0] * num_blocks
        self._inputs_seen: set[int] = set()
        self._saved_inputs: set[int] = set()
        self._block_input_addresses: set[int] = set()
        self._phase: tuple[str, int] = ("trunk", -1)
        self._since = 0.0
        self._copier = engine.copier
        self._cuda = engine.device.type == "cuda"
        self._lock = threading.RLock()
        self._copy_s_at_pause = 0.0
        self._blocks_started = False
        self._backward_started = False
        #: The trunk's parameters a forward used after its first block began: their gradients arrive before the
        #: blocks' backward has ended.
        self.used_after_blocks: dict[int, Tensor] = {}
        #: Per block that offloads anything, its :class:`OffloadTiming`.
        self.offload_trials: dict[int, OffloadTiming] = {}
        #: What the micro-batch saved outside the blocks: the most at once, and the most while blocks ran backward.
        self.outside_bytes = 0
        self.outside_bytes_in_blocks = 0
        self.trunk_gradient_bytes_in_blocks = 0

    def start(self) -> None:
        """Starts the clock in the trunk and makes the copier's copies timed and synchronous."""
        copier = self._copier
        self.engine.profiler = self
        self.engine.activations.start_outside_window()
        self._since = self._now()
        for name, direction in (("to_device", "h2d"), ("to_host", "d2h")):
            setattr(copier, name, self._timed(getattr(copier, name), direction))

    def pause(self) -> None:
        """Stops the clock at the end of backward; copies are still timed (see :meth:`stop`)."""
        self.enter("census")  # what follows is no part of the micro-batch
        self.engine.profiler = None
        self.outside_bytes = self.engine.activations.outside_peak_bytes
        self._copy_s_at_pause = sum(self.copy_s.values())

    def stop(self) -> float:
        """Gives the copier its own methods back; returns the seconds copies took since :meth:`pause` (the
        optimizer step's refresh of the device copies, which the cost model counts on its own)."""
        for name in ("to_device", "to_host"):
            vars(self._copier).pop(name, None)
        return sum(self.copy_s.values()) - self._copy_s_at_pause

    def enter(self, phase: str, index: int = -1) -> None:
        """The compute thread now works on ``phase``: ``"forward"``, ``"recompute"`` or ``"backward"`` of block
        ``index``, ``"trunk"`` (anything else in the step), or ``"census"`` (the profile's own work, not counted)."""
        with self._lock:
            now = self._now()
            self._add(self._phase, now - self._since)
            self._phase, self._since = (phase, index), now
            self._blocks_started = self._blocks_started or phase == "forward"
            if phase in ("backward", "recompute"):
                self._backward_started = True
                self.outside_bytes_in_blocks = max(self.outside_bytes_in_blocks, self.engine.activations.outside_bytes)
                held = self.engine.ledger.held["trunk_gradients"]
                self.trunk_gradient_bytes_in_blocks = max(self.trunk_gradient_bytes_in_blocks, held)

    def trunk_use(self, param: Tensor) -> None:
        """A forward uses the trunk's parameter ``param`` (one whose gradient it will deliver)."""
        if self._blocks_started:
            self.used_after_blocks[id(param)] = param

    @property
    def times_offload(self) -> bool:
        """Whether blocks' census calls are also run through ``"offload"``'s copies and timed: where copies run beside
        compute (on a synchronous link their time is the link's, which the model counts already)."""
        return bool(self._copier.asynchronous)

    @contextmanager
    def untimed_copies(self) -> Iterator[None]:
        """The copier's own, asynchronous copies for a while (the profiler makes each copy synchronous to time it)."""
        timed = {name: vars(self._copier).pop(name) for name in ("to_device", "to_host") if name in vars(self._copier)}
        try:
            yield
        finally:
            vars(self._copier).update(timed)

    def compute_seconds(self, run: Callable[[], Any]) -> float:
        """The seconds of compute that ``run`` issues, not waiting for the copies it leaves in flight."""
        if not self._cuda:
            start = perf_counter()
            run()
            return perf_counter() - start
        torch.cuda.synchronize(self.engine.device)
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        run()
        ended.record()
        ended.synchronize()
        return started.elapsed_time(ended) / 1e3

    def offload_tried(self, index: int, **timing: Any) -> None:
        """Takes block ``index``'s offload trial (the fields of :class:`OffloadTiming`)."""
        self.offload_trials[index] = OffloadTiming(**timing)

    def block_inputs(self, index: int, tensors: list[Any]) -> None:
        """Counts what a checkpoint of block ``index`` would hold: its tensor inputs, each storage once per pass."""
        self._block_input_addresses = {tensor.untyped_storage().data_ptr() for tensor in tensors}
        for tensor in tensors:
            address = tensor.untyped_storage().data_ptr()
            if address not in self._inputs_seen:
                self._inputs_seen.add(address)
                self.input_bytes[index] += tensor.untyped_storage().nbytes()

    def activations(self, index: int, census: Any) -> None:
        """Takes block ``index``'s :class:`~lightning_superpipe.streaming.activations.ActivationCensus`."""
        # A storage several blocks save (a mask, rotary tables: inputs of each) is held once, by the first block that
        # saved it. Only inputs can be shared: what the census computed was freed after it, and its addresses reused.
        for address, nbytes in census.kept.items():
            if address not in self._saved_inputs:
                if address in self._block_input_addresses:
                    self._saved_inputs.add(address)
                    self.saved_input_bytes[index] += nbytes
                self.kept_bytes[index] += nbytes
                self.small_bytes[index] += nbytes if address in census.small else 0
        self.offloaded_bytes[index] += census.offloaded_bytes

    def _add(self, phase: tuple[str, int], seconds: float) -> None:
        kind, index = phase
        if kind == "forward":
            self.forward_s[index] += seconds
        elif kind == "backward":
            self.backward_s[index] += seconds
        elif kind == "recompute":
            self.recompute_s[index] += seconds
        elif kind == "trunk":
            self.trunk_s += seconds
            if self._blocks_started and not self._backward_started:
                self.head_s += seconds
        # "census": the profile's own extra forward, no part of a step

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self.engine.device)
        return perf_counter()

    def _timed(self, copy: Callable[..., Any], direction: str) -> Callable[..., Any]:
        def timed(dst: Tensor, src: Tensor, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                now = self._now()
                self._add(self._phase, now - self._since)
                event = copy(dst, src, *args, **kwargs)
                self._copier.synchronize()
                self._since = self._now()
                nbytes = dst.numel() * dst.element_size()
                self.copy_s[direction] += self._since - now
                self.copies[direction].append((nbytes, self._since - now))
            return event

        return timed
