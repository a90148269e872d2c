"""The reference cost model: a placement's predicted step time and device bytes, from a measured :class:`Profile`.

A placement is the set of resident blocks (the others are streamed), the prefetch depth ``p`` and each block's
activation mode. :func:`predict` is the model as written here, and :mod:`.solver`'s program is the same model in
linear form.

For block ``i`` (of ``N``), ``s_i`` is 1 if it is streamed and 0 if resident, ``r_i = 1 - s_i``, and ``k_i``, ``o_i``,
``c_i`` are 1 where its mode is ``"keep"``, ``"offload"``, ``"recompute"``. Its costs are those of
:class:`BlockCosts` (``F_i`` forward, ``B_i`` backward, ``R_i`` recompute, and its bytes); the link's speeds are
``h2d`` and ``d2h``:

* Copies: its weights in ``w_i = weight_bytes_i / h2d``; its offloaded activations out ``ao_i = offloaded_bytes_i /
  d2h`` and back in ``ai_i = offloaded_bytes_i / h2d``; its weight gradients out ``g_i = gradient_bytes_i / d2h``.
* Forward: compute ``F_i``, copies in ``s_i w_i``, copies out ``o_i ao_i``. Backward: compute ``B_i + c_i R_i``,
  copies in ``s_i w_i + o_i ai_i``, copies out ``g_i``.
* A direction's time (FlexGen's per-layer rule): ``max(compute, in, out)`` where copies run beside compute
  (``profile.asynchronous`` and ``p >= 1``), else ``compute + in + out``.
* Micro-batch: ``T_mb = trunk_s + sum_i (forward_i + backward_i)``.
* Exposed optimizer time: with ``overlap_optimizer``, ``E = trunk_optimizer_s + max(opt_0, sum_i opt_i -
  sum_{i <= N-2} backward_i)``: block ``i`` is stepped on a host thread once its backward is done, block 0 finishes
  last so its step is always exposed, and the others hide behind the rest of backward while the host keeps up.
  Without it ``E = trunk_optimizer_s + sum_i opt_i``.
* Step: ``T = micro_batches * T_mb + E``.

Device bytes at the worst moment, ``peak = static + weights + activations``:

* ``static = trunk_bytes + trunk_gradient_bytes + block_gradient_bytes + margin_bytes``.
* ``weights = sum_i r_i weight_bytes_i + slots``, ``slots = min(p + 1, n_s) * max_{i streamed} weight_bytes_i``
  with ``n_s`` the number of streamed blocks (0 when none is): ``p + 1`` slots, of which only as many are allocated
  as there are blocks to stream.
* ``activations = max_i A_i`` over backward positions ``i``, ``A_i = sum_{j <= i} (k_j kept_j + o_j small_j + c_j
  input_j) + c_i kept_i + o_i offloaded_i + o_{i-1} offloaded_{i-1}``: what blocks not yet through backward hold, plus
  block ``i``'s recomputed or returned activations, plus block ``i - 1``'s, brought back while ``i`` computes (that
  term is absent for ``i = 0``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Union

from lightning_superpipe.planning.profile import BlockCosts, Profile

#: The activation modes a block can have (``SuperpipeStrategy(activations=...)``).
MODES: tuple[str, ...] = ("recompute", "keep", "offload")

#: The parts of the peak, in the order :attr:`Prediction.breakdown` lists them.
PEAK_PARTS: tuple[str, ...] = (
    "trunk",
    "trunk_gradients",
    "block_gradients",
    "margin",
    "resident_weights",
    "slots",
    "activations",
)


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` expects of a placement.

    Attributes:
        step_s: Seconds per optimizer step.
        peak_bytes: Device bytes at the worst moment of the step.
        per_block: Per block, ``forward_s`` and ``backward_s`` (per micro-batch, copies and recomputation included, as
            the overlap rule gives) and ``device_bytes`` (its resident weights, plus the activations it holds at the
            peak).
        breakdown: The peak's parts (:data:`PEAK_PARTS`), summing to ``peak_bytes``.
    """

    step_s: float
    peak_bytes: int
    per_block: list[dict[str, Union[float, int]]]
    breakdown: dict[str, int]


def overlapped(profile: Profile, prefetch: int) -> bool:
    """Whether copies run beside compute: an asynchronous link, and a block fetched ahead of its use."""
    return profile.asynchronous and prefetch >= 1


def slot_shape(profile: Profile, resident: Collection[int], prefetch: int) -> tuple[int, int]:
    """``(number of slots, bytes of each)`` for streaming the blocks not in ``resident``; ``(0, 0)`` if none is."""
    streamed = [block.weight_bytes for index, block in enumerate(profile.blocks) if index not in resident]
    if not streamed:
        return 0, 0
    return min(prefetch + 1, len(streamed)), max(streamed)


def block_times(profile: Profile, block: BlockCosts, streamed: bool, mode: str, overlap: bool) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one block per micro-batch, by the overlap rule."""
    weights_in = block.weight_bytes / profile.h2d_bytes_per_s if streamed else 0.0
    offloaded = mode == "offload"
    forward = (block.forward_s, weights_in, block.offloaded_bytes / profile.d2h_bytes_per_s if offloaded else 0.0)
    backward = (
        block.backward_s + (block.recompute_s if mode == "recompute" else 0.0),
        weights_in + (block.offloaded_bytes / profile.h2d_bytes_per_s if offloaded else 0.0),
        block.gradient_bytes / profile.d2h_bytes_per_s,
    )
    combine = max if overlap else sum
    return combine(forward), combine(backward)


def held_bytes(block: BlockCosts, mode: str) -> int:
    """What a block's activations hold on the device from its forward until its backward."""
    return {"keep": block.kept_bytes, "offload": block.small_bytes, "recompute": block.input_bytes}[mode]


def in_use_bytes(block: BlockCosts, mode: str) -> int:
    """What its activations add while its own backward runs: recomputed, or brought back from the host."""
    return {"keep": 0, "offload": block.offloaded_bytes, "recompute": block.kept_bytes}[mode]


def static_bytes(profile: Profile) -> dict[str, int]:
    """The peak's parts that no placement changes."""
    return {
        "trunk": profile.trunk_bytes,
        "trunk_gradients": profile.trunk_gradient_bytes,
        "block_gradients": profile.block_gradient_bytes,
        "margin": profile.margin_bytes,
    }


def check_profile(profile: Profile) -> None:
    """Raises ``ValueError`` for a profile no profiled step could have produced, which the model cannot score."""
    if not profile.blocks:
        raise ValueError("Profile(blocks=[]): the profile has no blocks; there is nothing to place.")
    if profile.micro_batches < 1:
        raise ValueError(f"Profile(micro_batches={profile.micro_batches}): a step has at least one micro-batch.")
    if not (profile.h2d_bytes_per_s > 0 and profile.d2h_bytes_per_s > 0):
        raise ValueError(
            f"Profile(h2d_bytes_per_s={profile.h2d_bytes_per_s}, d2h_bytes_per_s={profile.d2h_bytes_per_s}): the"
            " link's speeds must be positive."
        )


def predict(profile: Profile, resident: Collection[int], prefetch: int, modes: Sequence[str]) -> Prediction:
    """Predicts a placement's step time and peak device bytes, by the model of this module's docstring.

    Args:
        profile: The measured costs.
        resident: Indices of the resident blocks; the others are streamed.
        prefetch: Blocks fetched ahead of the one in use (``prefetch + 1`` slots).
        modes: Each block's activation mode, one of :data:`MODES`.

    Raises:
        ValueError: For a mode, index or prefetch the engine does not have, or a profile it could not have measured.
    """
    check_profile(profile)
    blocks = profile.blocks
    count = len(blocks)
    if len(modes) != count:
        raise ValueError(f"predict(modes=...): {len(modes)} modes for {count} blocks; give one per block.")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f"predict(modes=...): unknown mode {unknown[0]!r}; expected one of {MODES}.")
    resident = frozenset(resident)
    outside = sorted(index for index in resident if not 0 <= index < count)
    if outside:
        raise ValueError(f"predict(resident=...): block {outside[0]} is out of range for {count} blocks.")
    if prefetch < 0:
        raise ValueError(f"predict(prefetch={prefetch}): prefetch must be at least 0.")

    overlap = overlapped(profile, prefetch)
    times = [block_times(profile, block, i not in resident, modes[i], overlap) for i, block in enumerate(blocks)]
    micro_batch_s = profile.trunk_s + sum(forward + backward for forward, backward in times)
    optimizer_s = [block.optimizer_s for block in blocks]
    if profile.overlap_optimizer:
        hidden_by = sum(backward for _, backward in times[: count - 1])
        exposed_s = profile.trunk_optimizer_s + max(optimizer_s[0], sum(optimizer_s) - hidden_by)
    else:
        exposed_s = profile.trunk_optimizer_s + sum(optimizer_s)

    held = [held_bytes(block, mode) for block, mode in zip(blocks, modes)]
    in_use = [in_use_bytes(block, mode) for block, mode in zip(blocks, modes)]
    returned = [block.offloaded_bytes if mode == "offload" else 0 for block, mode in zip(blocks, modes)]
    at_position = []
    prefix = 0
    for i in range(count):
        prefix += held[i]
        at_position.append(prefix + in_use[i] + (returned[i - 1] if i >= 1 else 0))
    # Backward runs from the last block, so among equal peaks the highest position is the first moment it is reached.
    peak_at = max(range(count - 1, -1, -1), key=at_position.__getitem__)

    slots, slot_bytes = slot_shape(profile, resident, prefetch)
    breakdown = static_bytes(profile)
    breakdown["resident_weights"] = sum(blocks[i].weight_bytes for i in resident)
    breakdown["slots"] = slots * slot_bytes
    breakdown["activations"] = at_position[peak_at]

    per_block: list[dict[str, Union[float, int]]] = []
    for i, (block, (forward, backward)) in enumerate(zip(blocks, times)):
        device = block.weight_bytes if i in resident else 0
        device += held[i] if i <= peak_at else 0
        device += in_use[i] if i == peak_at else 0
        device += returned[i] if i == peak_at - 1 else 0
        per_block.append({"forward_s": forward, "backward_s": backward, "device_bytes": device})
    return Prediction(
        step_s=profile.micro_batches * micro_batch_s + exposed_s,
        peak_bytes=sum(breakdown.values()),
        per_block=per_block,
        breakdown=breakdown,
    )
