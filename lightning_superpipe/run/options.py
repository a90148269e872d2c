"""The strategy's knobs, declared once: :class:`SuperpipeOptions`, checked when it is made.

``SuperpipeStrategy(...)`` builds one, so a bad value fails in the strategy's constructor with a message that quotes
the user's call. ``offload_device`` chooses the kind of home (:attr:`SuperpipeOptions.home_kind`, from the
registry of :mod:`lightning_superpipe.memory.home`), which checks its own knobs. What needs the model (one activation
mode per block), the trainer (what the kind of home cannot train; the number of ranks) or the machine (the kind's
folder) is checked when streaming starts (:func:`~lightning_superpipe.run.setup.start_streaming`). On several
ranks ``shard_optimizer="auto"`` is resolved there too (:func:`default_sharding`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_superpipe.emulation.link import EmulatedLink
from lightning_superpipe.memory.fourbit.frozen4bit import MODES as QUANTIZE_MODES
from lightning_superpipe.memory.fourbit.frozen4bit import bitsandbytes_installed
from lightning_superpipe.memory.home import HomeKind, home_kind, home_kinds
from lightning_superpipe.planning.budget import MemoryBudget, parse_budget, resolve_budget
from lightning_superpipe.streaming.activations import ActivationsPolicy, per_block_modes
from lightning_superpipe.streaming.blocks import BlockPolicy, _as_predicate
from lightning_superpipe.units import format_bytes

#: The kind of home the blocks live in unless ``offload_device`` says otherwise: host memory.
DEFAULT_OFFLOAD_DEVICE = "cpu"
#: ``shard_optimizer``'s values: ``"auto"`` is ``"node"`` on several ranks where that works (:func:`default_sharding`).
SHARD_MODES = (True, False, "node", "auto")


class KnobError(ValueError, MisconfigurationException):
    """A strategy knob the user gave is wrong. A ``ValueError``, and Lightning's ``MisconfigurationException``,
    which is what the strategy raised for a bad knob when it checked them only as streaming started."""


#: What ``overlap_optimizer`` accepts (:mod:`.step_modes` says what each does).
OVERLAP_MODES = ("auto", True, False, "speculative", "pipelined")


@dataclass(frozen=True)
class SuperpipeOptions:
    """Every knob of :class:`~lightning_superpipe.SuperpipeStrategy`, as the user wrote it (``None``: the default, or
    the plan's). The knob reference (``docs/reference/knobs.md``) says what each costs and buys.

    Attributes:
        memory_budget: Device bytes to plan for (an int, ``"12GiB"``, a share of free device memory such as ``"90%"``,
            ``"auto"``).
        resident_blocks: Blocks kept on the device for the whole run.
        prefetch: Blocks copied in ahead of the one computing.
        activations: ``"recompute"``, ``"keep"``, ``"offload"``, or one of them per block.
        overlap_optimizer: How the host optimizer step hides: ``"auto"`` (where it pays, the best exact mode),
            ``True`` (that, on a CPU compute device too), ``"speculative"``, ``"pipelined"`` or ``False`` (after
            backward). See :mod:`~lightning_superpipe.stepping.step_modes`.
        blocks: Which modules stream: module classes or a predicate; ``None``: every outermost stack.
        link: An :class:`~lightning_superpipe.EmulatedLink`, or ``None``.
        offload_device: The kind of home the blocks live in: ``"cpu"`` (host memory), ``"disk"`` (files under
            ``offload_path``), or another registered one (:func:`~lightning_superpipe.register_home_kind`).
        offload_path: The disk tier's folder.
        host_buffer_bytes: Bound on the disk tier's pool of host buffers; ``None``: a few of the largest block's.
            Below two whole blocks' buffers, blocks are stepped and read in pieces, whatever their size.
        shard_optimizer: On several ranks: ``False`` (every rank holds everything), ``True`` (gradients and optimizer
            state split across ranks), ``"node"`` (that, and one copy of the blocks per node) or ``"auto"``.
        quantize_frozen: ``"nf4"``, ``"nf4-dq"``, ``"fp4"`` or ``"fp4-dq"`` (Lightning's ``BitsandbytesPrecision``
            4-bit modes): the blocks' frozen matrices kept, streamed and computed with in 4 bits
            (:mod:`~lightning_superpipe.memory.fourbit.frozen4bit`); ``None``: as they are.

    Raises:
        KnobError: A value no model or run could accept (the message quotes the user's call).
    """

    memory_budget: Optional[MemoryBudget] = None
    resident_blocks: Optional[int] = None
    prefetch: Optional[int] = None
    activations: Optional[ActivationsPolicy] = None
    overlap_optimizer: Union[bool, str] = "auto"
    blocks: Optional[BlockPolicy] = None
    link: Optional[EmulatedLink] = None
    offload_device: str = DEFAULT_OFFLOAD_DEVICE
    offload_path: Optional[Union[str, os.PathLike[str]]] = None
    host_buffer_bytes: Optional[int] = None
    shard_optimizer: Union[bool, str] = "auto"
    quantize_frozen: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every knob on its own and the disk tier's together.

        Raises:
            KnobError: With the user's call and what would be accepted.
        """
        try:
            self._check_streaming()
            self._check_offload()
            self._check_quantize_frozen()
            if self.shard_optimizer not in SHARD_MODES:
                raise ValueError(
                    f"SuperpipeStrategy(shard_optimizer={self.shard_optimizer!r}) must be True, False or 'node' (or"
                    " 'auto', the default)."
                )
        except ValueError as error:
            raise KnobError(str(error)) from None

    def validate_for(self, device: torch.device) -> None:
        """Checks the knobs whose meaning depends on the compute device, once the Trainer has chosen it (before the
        model is built or data are read): a share of free device memory needs a CUDA device.

        Raises:
            KnobError: With the user's call and what would be accepted.
        """
        if self.memory_budget is None:
            return
        try:
            budget = parse_budget(self.memory_budget, f"SuperpipeStrategy(memory_budget={self.memory_budget!r})")
            if budget.nbytes is None and device.type != "cuda":
                resolve_budget(self.memory_budget, device)  # raises, saying what to give instead
        except ValueError as error:
            raise KnobError(str(error)) from None

    def _check_streaming(self) -> None:
        if self.memory_budget is not None:  # a share of free memory is read from the device when the run starts
            parse_budget(self.memory_budget, f"SuperpipeStrategy(memory_budget={self.memory_budget!r})")
        knob = self.overlap_optimizer
        if not (isinstance(knob, bool) or (isinstance(knob, str) and knob in OVERLAP_MODES)):
            raise ValueError(
                f"SuperpipeStrategy(overlap_optimizer={self.overlap_optimizer!r}) must be 'auto', True, False,"
                " 'speculative' or 'pipelined'."
            )
        for name in ("resident_blocks", "prefetch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"SuperpipeStrategy({name}={value!r}) must be a whole number, zero or more.")
        if self.activations is not None:  # each mode now; one per block once the blocks are known
            policy = self.activations
            per_block_modes(policy, len(policy) if isinstance(policy, Sequence) and not isinstance(policy, str) else 1)
        if self.blocks is not None:
            try:
                _as_predicate(self.blocks)
            except TypeError as error:
                raise ValueError(f"SuperpipeStrategy(blocks={self.blocks!r}): {error}") from None
        if self.link is not None and not isinstance(self.link, EmulatedLink):
            raise ValueError(f"SuperpipeStrategy(link={self.link!r}) must be an `EmulatedLink` or None.")

    def _check_offload(self) -> None:
        """``offload_device`` names a registered kind of home; the knobs only other kinds read are left out, and the
        kind checks its own."""
        call, kind = self.offload_call, self.home_kind
        if kind is None:
            choices = [f"{k.name!r} ({'the default: ' if k.name == DEFAULT_OFFLOAD_DEVICE else ''}{k.summary})"
                       for k in home_kinds()]
            listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]
            raise ValueError(f"{call}: offload_device must be {listed}.")
        for other in home_kinds():
            for name in other.own_knobs:
                if name not in kind.own_knobs and getattr(self, name) is not None:
                    raise ValueError(
                        f"{call}: {name} is used only by {other.title}. Pass offload_device={other.name!r} to"
                        f" {other.purpose}, or leave {name} out."
                    )
        kind.check_knobs(self)

    def _check_quantize_frozen(self) -> None:
        mode = self.quantize_frozen
        if mode is None:
            return
        call = f"SuperpipeStrategy(quantize_frozen={mode!r})"
        if not isinstance(mode, str) or mode not in QUANTIZE_MODES:
            raise ValueError(
                f"{call} must be 'nf4', 'nf4-dq', 'fp4' or 'fp4-dq' (the 4-bit modes of Lightning's"
                " `BitsandbytesPrecision`; '-dq' quantizes the scales too), or None (the default) to stream the frozen"
                " matrices as they are."
            )
        if not bitsandbytes_installed():
            raise ValueError(
                f"{call} quantizes the frozen matrices with bitsandbytes, which is not installed:"
                " `pip install bitsandbytes` (it runs on the CPU too)."
            )

    @property
    def home_kind(self) -> Optional[HomeKind]:
        """The kind of home ``offload_device`` chooses (``None``: none is registered by that name, which
        :meth:`validate` refuses). The one place that reads ``offload_device``."""
        return home_kind(self.offload_device)

    @property
    def offload_call(self) -> str:
        """The user's call of the disk tier's knobs, as quoted in error messages."""
        path = None if self.offload_path is None else os.fspath(self.offload_path)
        return (
            f"SuperpipeStrategy(offload_device={self.offload_device!r}, offload_path={path!r},"
            f" host_buffer_bytes={self.host_buffer_bytes!r})"
        )

    def knobs(self) -> dict[str, Any]:
        """Every knob by name (not copied, unlike ``dataclasses.asdict``: a link or a predicate stays itself)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def check_for_model(self, num_blocks: int) -> None:
        """What needs the model: at most ``num_blocks`` resident, one activation mode per block.

        Raises:
            ValueError: With the user's call.
        """
        if self.resident_blocks is not None and self.resident_blocks > num_blocks:
            raise ValueError(
                f"SuperpipeStrategy(resident_blocks={self.resident_blocks!r}): the model has {num_blocks} blocks, so it"
                f" is an int from 0 to {num_blocks}, or None to let the planner choose."
            )
        if self.activations is not None:
            per_block_modes(self.activations, num_blocks)

    def activation_modes(self, num_blocks: int) -> list[str]:
        """Each of ``num_blocks`` blocks' placement of its activations as given (``"recompute"`` where none is)."""
        return per_block_modes(self.activations or "recompute", num_blocks)


def default_sharding(
    options: SuperpipeOptions, *, precision: str, averaging: Sequence[Any], shared_free: Optional[int],
    shared_needed: int,
) -> tuple[Union[bool, str], Optional[str]]:
    """What ``shard_optimizer="auto"`` is on several ranks: ``"node"`` where it works, else the most sharing the run
    allows, with why.

    Args:
        options: The strategy's knobs.
        precision: The run's precision (``"16-mixed"``: no sharding).
        averaging: The weight-averaging callbacks of a ``fit`` (they swap weights into every rank's parameters).
        shared_free: Free bytes in ``/dev/shm`` (``None``: there is none).
        shared_needed: About the bytes the node's shared copy of the blocks takes there (an upper bound).

    Returns:
        The value, and ``None`` or the reason it is not ``"node"``.
    """
    refusal = options.home_kind.sharding_refusal if options.home_kind is not None else None
    if refusal is not None:
        return False, refusal
    if precision == "16-mixed":
        return False, "the gradient scaler of precision='16-mixed' checks every gradient, which a sharded rank lacks"
    if averaging:
        return True, (
            f"the callback {type(averaging[0]).__name__} writes the averaged weights into the parameters on every"
            " rank, which would share one copy of the blocks"
        )
    if shared_free is None:
        return True, "this machine has no /dev/shm for the node's shared copy of the blocks"
    if shared_needed > shared_free:
        return True, (
            f"/dev/shm has {format_bytes(shared_free)} free, less than the node's shared copy of the blocks may take"
            f" ({format_bytes(shared_needed)}); enlarge it for 'node'"
        )
    return "node", None
