"""The reference cost model: a placement's predicted step time and device bytes, from a measured :class:`Profile`.

A placement is the set of resident blocks (the others are streamed), the prefetch depth ``p`` and each block's
activation mode. :func:`predict` is the model as written here, and :mod:`.solver`'s program is the same model in
linear form.

For block ``i`` (of ``N``), ``s_i`` is 1 if it is streamed and 0 if resident, ``r_i = 1 - s_i``, and ``k_i``, ``o_i``,
``c_i`` are 1 where its mode is ``"keep"``, ``"offload"``, ``"recompute"``. Its costs are those of
:class:`BlockCosts`: ``F_i`` forward, ``B_i`` backward, ``R_i`` recompute, ``opt_i`` its host optimizer step, and its
bytes; ``u_i`` is 1 if ``gradient_bytes_i > 0`` (the block changes at every optimizer step), else 0. The link's
speeds are ``h2d`` and ``d2h``; ``a`` is ``profile.asynchronous``, ``m`` is ``profile.micro_batches``.

* Copies: its weights in ``w_i = weight_bytes_i / h2d``; its offloaded activations out ``ao_i = offloaded_bytes_i /
  d2h`` and back in ``ai_i = offloaded_bytes_i / h2d``; its weight gradients out ``g_i = gradient_bytes_i / d2h``.
  The weights outside blocks that a step changes: to the device again after each optimizer step in ``t_tr =
  trunk_update_bytes / h2d``, their gradients off it at the end of each backward in ``t_tg = trunk_update_bytes /
  d2h``.
* An offloaded block costs compute ``X_i = offloaded_bytes_i * offload_compute_s_per_byte`` in its forward and again
  in its backward (measured by the profile's offload trials, or corrected by :mod:`.check`). Below, ``F_i`` stands
  for ``F_i + o_i X_i``.
* Corrections from a measured step (:mod:`.check`; none in a profile): every copy time above is multiplied by
  ``profile.link_slowdown``; the step takes ``profile.step_overhead_s`` more.
* A block's backward computes ``Cb_i = B_i + c_i R_i + o_i X_i``.

The engine runs copies on their own streams, in the order they are issued. In forward, block ``i + 1``'s weights are
copied while block ``i`` computes (``p >= 1``); block 0's copy hides behind nothing. Offloaded activations leave
during their block's forward and come back one block ahead in backward, whatever ``p``. In backward the last block is
still in its slot from forward: its weights are not copied again. A block's gradients leave after its backward, while
the next block's backward runs; the last ones (block 0's, and the trunk's) after backward has ended. After each
optimizer step every block that changed (``u_i = 1``) is copied again in the next forward: a resident one as a
refresh, a streamed one as its usual copy; the trunk's changed weights first, as the embedding needs them first.

Per micro-batch, the forward takes ``fwd`` and the backward ``bwd``; the first forward of a step ``fwd1``:

* Synchronous link (``a`` false): everything is serial.

  - ``fwd = sum_i (F_i + s_i w_i + o_i ao_i)``
  - ``bwd = sum_i (Cb_i + s_i w_i [i < N-1] + o_i ai_i + g_i) + t_tg``
  - ``fwd1 = fwd + t_tr + sum_i r_i u_i w_i``

* Asynchronous link: each pass takes the longest of its streams' work, each with what cannot overlap it (a flow-shop
  bound: exact for uniform blocks, and it credits streamed blocks whose copies hide behind resident neighbours'
  compute). ``fwd`` is the largest of

  - ``p >= 1``: ``s_0 w_0 + sum_i F_i`` (compute, after the first block's copy), ``sum_i s_i w_i + F_{N-1}`` (the
    host-to-device stream, then the last block's compute), ``F_0 + sum_i o_i ao_i - H`` (the device-to-host stream,
    from the first block on; its last copies run on while the head computes, ``H = head_s``, and must be done
    before the last block's activations come back);
  - ``p = 0`` (a block's weights are copied only when it is needed, serial with compute; activations' copies still
    overlap): ``sum_i (F_i + s_i w_i)``, ``F_0 + sum_i o_i ao_i - H``.

  ``bwd`` is the largest of

  - ``p >= 1``: ``o_{N-1} ai_{N-1} + sum_i max(Cb_i, o_{i-1} ai_{i-1}) + g_0 + t_tg`` (compute, after the last
    block's activations came back, then the last gradients leave; block ``i - 1``'s activations are brought back as
    block ``i``'s backward starts, and block ``i - 1`` cannot start before they are back), ``sum_{i < N-1} s_i w_i +
    sum_i o_i ai_i + Cb_0 + g_0 + t_tg`` (the host-to-device stream: the weights again but the last block's, every
    offloaded block's activations back; then block 0's compute and gradients);
  - ``p = 0``: ``o_{N-1} ai_{N-1} + sum_i (max(Cb_i, o_{i-1} ai_{i-1}) + s_i w_i [i < N-1]) + g_0 + t_tg``
    (block ``i - 1``'s weights are copied when it starts, behind its activations brought back while block ``i``
    computed), ``sum_i o_i ai_i + Cb_0 + g_0 + t_tg``;
  - any ``p``: ``Cb_{N-1} + sum_i g_i + t_tg`` (the device-to-host stream: every block's gradients, after the last
    block's backward, the first to run).

  At ``p = 1`` a block's copy can run only beside the compute before it (one slot is free): a copy that runs late
  stalls compute, where a deeper prefetch would have started it earlier. With ``v = profile.copy_spread`` (how far a
  copy's time strays from its median, as a fraction: measured over the profiled copies, or set by :mod:`.check`), the
  pass at ``p = 1`` takes on average at least the mean of its compute and copy bounds plus half each copy's spread
  (``E max(a, b) >= (a + b + E|a - b|) / 2`` per block):
  ``fwd >= s_0 w_0 + (sum_i F_i + F_{N-1} + (1 + v) sum_{i >= 1} s_i w_i) / 2`` and ``bwd >= o_{N-1} ai_{N-1} +
  (sum_i Cb_i + Cb_0 + (1 + v) sum_{i < N-1} s_i w_i + sum_{i < N-1} o_i ai_i) / 2 + g_0 + t_tg``. At ``v = 0``
  the mean of two bounds is below their max: the term only counts with a spread (and is left out at ``v = 0``).

  ``fwd1 = max(fwd, t_tr + (s_0 + r_0 u_0) w_0 + sum_i F_i, t_tr + sum_i (s_i + r_i u_i) w_i + F_{N-1})``: the
  trunk's refresh is exposed (the embedding needs it first), and every block changed or streamed crosses the link in
  this forward.

* Exposed optimizer time: without ``overlap_optimizer``, ``E = trunk_optimizer_s + sum_i opt_i``. With it, ``E =
  trunk_optimizer_s + max(opt_0, sum_i opt_i - (bwd - Cb_{N-1}))``: a block is stepped on a host thread once its
  gradients are home, block 0's step is always exposed, and the others hide behind backward after its first block.
* Step: ``T = fwd1 + (m - 1) fwd + m (trunk_s + bwd) + E + step_overhead_s``.

Per block, :attr:`Prediction.per_block` (and the plan's table) show a time by the per-layer rule, for display only:
its own compute and its own copies (forward: ``F_i``, ``s_i w_i``, ``o_i ao_i``; backward: ``Cb_i``, ``s_i w_i [i <
N-1] + o_i ai_i``, ``g_i``) combined by ``max`` where they overlap and summed where they are serial (on an
asynchronous link with ``p = 0`` the weights' copy adds to compute, and the result overlaps the other copies);
refreshes and the trunk's copies are in no block's figure. The step time comes from the stream bounds above, not
from summing these.

Device bytes at the worst moment, ``peak = static + weights + activations``:

* ``static = trunk_bytes + T_in + margin_bytes + X_in``, with ``T_in`` the trunk's gradients that can be on the
  device during the blocks' backward (``trunk_gradient_bytes_in_blocks``: of the weights used after the first
  block; on a synchronous link, what the profiled step held then, ``trunk_gradient_bytes_held_in_blocks``); the
  others, ``T_late = trunk_gradient_bytes - T_in`` (an untied embedding's), arrive after block 0's backward and
  count at the moment ``(0, False)`` only. ``X_in`` (``outside_activation_bytes_in_blocks``) is what
  the step saved outside the blocks and still holds during their backward (the embeddings'); the rest of what it
  saves there, ``X_head = outside_activation_bytes - X_in`` (the head's logits, the loss), counts at the head's
  moment only.
* ``weights = sum_i r_i weight_bytes_i + slots``, ``slots = min(p + 1, n_s) * max_{i streamed} weight_bytes_i``
  with ``n_s`` the number of streamed blocks (0 when none is): ``p + 1`` slots, of which only as many are allocated
  as there are blocks to stream.
* ``activations`` (block gradients included) is the most over two moments of each backward position ``i``:

  - as block ``i``'s backward starts, ``A_i + L_i``: ``A_i = sum_{j <= i} (k_j kept_j + o_j small_j + c_j input_j) +
    c_i (kept_i - saved_input_i) + o_i offloaded_i + o_{i-1} offloaded_{i-1}``, what blocks not yet through
    backward hold, plus block ``i``'s recomputed (less its inputs, which the checkpoint holds already) or returned
    activations, plus block ``i - 1``'s, brought back while ``i`` computes (absent for ``i = 0``); ``L_i =
    min(block_gradient_bytes, a gradient_bytes_{i+1})``, block ``i + 1``'s gradients still on their way out (none
    for the last block, whose backward runs first);
  - as it delivers its gradients, ``D_i + G_i``: ``D_i = sum_{j < i} (...) + c_i input_i + o_{i-1}
    offloaded_{i-1}`` (block ``i``'s own activations were freed by its backward; a checkpoint's inputs go with the
    checkpoint, after it), ``G_i = min(block_gradient_bytes, gradient_bytes_i + L_i)``.

  So the moment all activations are held meets the gradients of one block at most, and the moment two blocks of
  gradients are on the device meets one block fewer of activations.
* The head's moment (forward done; reached before any block's backward): ``sum_j (k_j kept_j + o_j small_j + c_j
  input_j) + X_head - T_in``, every block's held activations beside all the step saved outside them, and no
  trunk gradient yet (the head's backward frees what it saved before its weights' gradients are delivered).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
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
    "outside_activations",
)


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` expects of a placement.

    Attributes:
        step_s: Seconds per optimizer step.
        peak_bytes: Device bytes at the worst moment of the step.
        per_block: Per block, ``forward_s`` and ``backward_s`` (per micro-batch, its own copies and recomputation
            included, by the per-layer rule: for display, the step time does not sum them) and ``device_bytes`` (its
            resident weights, plus the activations it holds at the peak).
        breakdown: The peak's parts (:data:`PEAK_PARTS`), summing to ``peak_bytes``.
        passes: The step's parts in seconds: ``first_forward_s`` (``fwd1``), ``forward_s`` (``fwd``, each later
            micro-batch's), ``backward_s`` (``bwd``) and ``optimizer_s`` (``E``, the exposed optimizer time).
    """

    step_s: float
    peak_bytes: int
    per_block: list[dict[str, Union[float, int]]]
    breakdown: dict[str, int]
    passes: dict[str, float] = field(default_factory=dict)


def overlapped(profile: Profile, prefetch: int) -> bool:
    """Whether weights' copies run beside compute: an asynchronous link, and a block fetched ahead of its use. The
    model depends on the prefetch depth only through this and the number of slots."""
    return profile.asynchronous and prefetch >= 1


def slot_shape(profile: Profile, resident: Collection[int], prefetch: int) -> tuple[int, int]:
    """``(number of slots, bytes of each)`` for streaming the blocks not in ``resident``; ``(0, 0)`` if none is."""
    streamed = [block.weight_bytes for index, block in enumerate(profile.blocks) if index not in resident]
    if not streamed:
        return 0, 0
    return min(prefetch + 1, len(streamed)), max(streamed)


@dataclass(frozen=True)
class LinkTimes:
    """One block's copy times in seconds (``w_i``, ``ao_i``, ``ai_i``, ``g_i`` of the module's docstring), the
    compute time its offloaded activations cost in each pass (``X_i``), and whether it changes at every optimizer step
    (``u_i``)."""

    weights: float
    offload_out: float
    offload_in: float
    gradients: float
    changes: bool
    offload_compute: float = 0.0


def link_times(profile: Profile, block: BlockCosts) -> LinkTimes:
    """What each of ``block``'s copies takes on ``profile``'s link (its speeds, slowed by ``link_slowdown``)."""
    h2d, d2h = profile.h2d_bytes_per_s / profile.link_slowdown, profile.d2h_bytes_per_s / profile.link_slowdown
    return LinkTimes(
        weights=block.weight_bytes / h2d,
        offload_out=block.offloaded_bytes / d2h,
        offload_in=block.offloaded_bytes / h2d,
        gradients=block.gradient_bytes / d2h,
        changes=block.gradient_bytes > 0,
        offload_compute=block.offloaded_bytes * profile.offload_compute_s_per_byte,
    )


def trunk_times(profile: Profile) -> tuple[float, float]:
    """``(t_tr, t_tg)``: the trunk's changed weights to the device after a step, their gradients off it in
    backward."""
    slowdown = profile.link_slowdown
    return (
        profile.trunk_update_bytes * slowdown / profile.h2d_bytes_per_s,
        profile.trunk_update_bytes * slowdown / profile.d2h_bytes_per_s,
    )


def block_times(
    profile: Profile, block: BlockCosts, streamed: bool, mode: str, prefetch: int, last: bool = False
) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one block per micro-batch by the per-layer rule, for display: its own compute
    and copies, the longest of them where they overlap, their sum where serial. ``last``: the last block, whose
    weights are not copied again in backward."""
    link = link_times(profile, block)
    weights = link.weights if streamed else 0.0
    offloaded = mode == "offload"

    def rule(compute: float, weights: float, copies_in: float, copies_out: float) -> float:
        if not profile.asynchronous:
            return compute + weights + copies_in + copies_out
        if overlapped(profile, prefetch):
            return max(compute, weights + copies_in, copies_out)
        # Prefetch 0: the weights' copy is serial with compute; the activations' and gradients' copies overlap.
        return max(compute + weights, copies_in, copies_out)

    extra = link.offload_compute if offloaded else 0.0
    forward = rule(block.forward_s + extra, weights, 0.0, link.offload_out if offloaded else 0.0)
    backward = rule(
        block.backward_s + (block.recompute_s if mode == "recompute" else 0.0) + extra,
        0.0 if last else weights,
        link.offload_in if offloaded else 0.0,
        link.gradients,
    )
    return forward, backward


def held_bytes(block: BlockCosts, mode: str) -> int:
    """What a block's activations hold on the device from its forward until its backward."""
    return {"keep": block.kept_bytes, "offload": block.small_bytes, "recompute": block.input_bytes}[mode]


def in_use_bytes(block: BlockCosts, mode: str) -> int:
    """What its activations add while its own backward runs: recomputed, or brought back from the host."""
    recomputed = block.kept_bytes - block.saved_input_bytes  # its inputs are the checkpoint's, held already
    return {"keep": 0, "offload": block.offloaded_bytes, "recompute": recomputed}[mode]


def leaving_bytes(profile: Profile) -> list[int]:
    """``L_i`` for each backward position: block ``i + 1``'s gradients, still on their way out as block ``i``'s
    backward starts on an asynchronous link (0 on a synchronous one, and for the last block)."""
    blocks = profile.blocks
    return [
        min(profile.block_gradient_bytes, blocks[i + 1].gradient_bytes)
        if profile.asynchronous and i + 1 < len(blocks) else 0
        for i in range(len(blocks))
    ]


def gradient_bytes_at(profile: Profile) -> list[int]:
    """``G_i`` for each backward position: the block gradients on the device as block ``i``'s backward delivers its
    own (``L_i`` with them)."""
    leaving = leaving_bytes(profile)
    return [
        min(profile.block_gradient_bytes, block.gradient_bytes + leaving[i]) for i, block in enumerate(profile.blocks)
    ]


def memory_moments(profile: Profile, modes: Sequence[str]) -> dict[tuple[int, bool], tuple[int, int]]:
    """The activation and block-gradient bytes at the two moments of each backward position ``i``: ``(i, True)``
    as block ``i``'s backward starts (``A_i``, ``L_i``) and ``(i, False)`` as it delivers its gradients (``D_i``,
    ``G_i``), by the module's docstring."""
    held, in_use, returned = block_memory(profile, modes)
    leaving, delivered = leaving_bytes(profile), gradient_bytes_at(profile)
    moments: dict[tuple[int, bool], tuple[int, int]] = {}
    before = 0  # what blocks 0..i-1 hold until their backward
    for i, (block, mode) in enumerate(zip(profile.blocks, modes)):
        back = returned[i - 1] if i >= 1 else 0  # block i - 1's, brought back while block i computes
        moments[(i, True)] = (before + held[i] + in_use[i] + back, leaving[i])
        inputs = block.input_bytes if mode == "recompute" else 0  # freed with the checkpoint, after the block
        moments[(i, False)] = (before + inputs + back, delivered[i])
        before += held[i]
    return moments


def block_memory(profile: Profile, modes: Sequence[str]) -> tuple[list[int], list[int], list[int]]:
    """Per block: what its activations hold until its backward, what they add during it, and what ``"offload"``
    brings back for it."""
    blocks = profile.blocks
    held = [held_bytes(block, mode) for block, mode in zip(blocks, modes)]
    in_use = [in_use_bytes(block, mode) for block, mode in zip(blocks, modes)]
    returned = [block.offloaded_bytes if mode == "offload" else 0 for block, mode in zip(blocks, modes)]
    return held, in_use, returned


def static_bytes(profile: Profile) -> dict[str, int]:
    """The peak's parts that no placement changes (the trunk's gradients that blocks' backward can meet)."""
    held = profile.trunk_gradient_bytes_held_in_blocks
    return {
        "trunk": profile.trunk_bytes,
        "trunk_gradients": profile.trunk_gradient_bytes - late_trunk_gradient_bytes(profile) if held is None else held,
        "margin": profile.margin_bytes,
        "outside_activations": profile.outside_activation_bytes_in_blocks,
    }


def head_extra_bytes(profile: Profile) -> int:
    """What the head's moment holds beyond :func:`static_bytes` (may be negative): as forward ends, everything the
    step saved outside the blocks (the head's logits and loss with the embeddings'), and no trunk gradient yet. (The
    head's backward frees what it saved before its weights' gradients are delivered, and those meet the blocks'
    backward, counted there.)"""
    static = static_bytes(profile)
    return profile.outside_activation_bytes - static["outside_activations"] - static["trunk_gradients"]


def late_trunk_gradient_bytes(profile: Profile) -> int:
    """``T_late``: the trunk's gradients that arrive after every block's backward (an untied embedding's), at the
    moment ``(0, False)`` only (none where ``trunk_gradient_bytes_in_blocks`` is not known)."""
    in_blocks = profile.trunk_gradient_bytes_in_blocks
    return 0 if in_blocks is None else max(0, profile.trunk_gradient_bytes - in_blocks)


def check_profile(profile: Profile) -> None:
    """Raises ``ValueError`` for a profile no profiled step could have produced, which the model cannot score."""
    if not profile.blocks:
        raise ValueError("Profile(blocks=[]): the profile has no blocks; there is nothing to place.")
    if profile.micro_batches < 1:
        raise ValueError(f"Profile(micro_batches={profile.micro_batches}): a step has at least one micro-batch.")
    if not (profile.link_slowdown > 0 and profile.offload_compute_s_per_byte >= 0 and profile.copy_spread >= 0):
        raise ValueError(
            f"Profile(link_slowdown={profile.link_slowdown}, offload_compute_s_per_byte="
            f"{profile.offload_compute_s_per_byte}, copy_spread={profile.copy_spread}): a slowdown is positive, a"
            " compute cost and a spread not negative."
        )
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

    passes = pass_times(profile, resident, prefetch, modes)
    times = [
        block_times(profile, block, i not in resident, modes[i], prefetch, last=i == count - 1)
        for i, block in enumerate(blocks)
    ]

    held, in_use, returned = block_memory(profile, modes)
    moments = memory_moments(profile, modes)
    # The head's moment, as forward ends: every block's activations beside the head's (no block gradient yet). It
    # stands for position N with the blocks' moments: backward reaches it first.
    moments[(count, True)] = (sum(held), 0)
    extra = {(count, True): head_extra_bytes(profile), (0, False): late_trunk_gradient_bytes(profile)}
    # Backward runs from the last block, so among equal peaks the highest position is the first moment it is reached.
    positions = [(count, True)] + [(i, starting) for i in range(count - 1, -1, -1) for starting in (True, False)]
    peak_at, starting = max(positions, key=lambda moment: sum(moments[moment]) + extra.get(moment, 0))
    activation_bytes, gradient_bytes = moments[(peak_at, starting)]

    slots, slot_bytes = slot_shape(profile, resident, prefetch)
    breakdown = static_bytes(profile)
    breakdown["trunk_gradients"] += extra[(0, False)] if (peak_at, starting) == (0, False) else 0
    if peak_at == count:
        breakdown["trunk_gradients"], breakdown["outside_activations"] = 0, profile.outside_activation_bytes
    breakdown["resident_weights"] = sum(blocks[i].weight_bytes for i in resident)
    breakdown["slots"] = slots * slot_bytes
    breakdown["block_gradients"] = gradient_bytes
    breakdown["activations"] = activation_bytes

    per_block: list[dict[str, Union[float, int]]] = []
    for i, (block, (forward, backward)) in enumerate(zip(blocks, times)):
        device = block.weight_bytes if i in resident else 0
        device += held[i] if i < peak_at or (i == peak_at and starting) else 0  # all of them at the head's moment
        device += in_use[i] if i == peak_at and starting else 0
        device += block.input_bytes if i == peak_at and not starting and modes[i] == "recompute" else 0
        device += returned[i] if i == peak_at - 1 else 0
        per_block.append({"forward_s": forward, "backward_s": backward, "device_bytes": device})
    step_s = (
        passes["first_forward_s"]
        + (profile.micro_batches - 1) * passes["forward_s"]
        + profile.micro_batches * (profile.trunk_s + passes["backward_s"])
        + passes["optimizer_s"]
        + profile.step_overhead_s
    )
    return Prediction(
        step_s=step_s,
        peak_bytes=sum(breakdown.values()),
        per_block=per_block,
        breakdown=breakdown,
        passes=passes,
    )


def pass_times(profile: Profile, resident: Collection[int], prefetch: int, modes: Sequence[str]) -> dict[str, float]:
    """The step's parts by the module's docstring: ``first_forward_s`` (``fwd1``), ``forward_s`` (``fwd``),
    ``backward_s`` (``bwd``) and ``optimizer_s`` (``E``), in seconds. The arguments are :func:`predict`'s, checked."""
    blocks = profile.blocks
    last = len(blocks) - 1
    links = [link_times(profile, block) for block in blocks]
    streamed = [i not in resident for i in range(len(blocks))]
    # X_i: what an offloaded block's activations cost compute, in its forward and in its backward.
    extra = [link.offload_compute if mode == "offload" else 0.0 for link, mode in zip(links, modes)]
    forward = [block.forward_s + x for block, x in zip(blocks, extra)]
    backward = [
        block.backward_s + (block.recompute_s if mode == "recompute" else 0.0) + x
        for block, mode, x in zip(blocks, modes, extra)
    ]
    weights = [link.weights if s else 0.0 for link, s in zip(links, streamed)]  # s_i w_i
    # Crossing the link in a step's first forward: streamed, or resident and changed (s_i + r_i u_i) w_i.
    first_weights = [link.weights if s or link.changes else 0.0 for link, s in zip(links, streamed)]
    offload_out = [link.offload_out if mode == "offload" else 0.0 for link, mode in zip(links, modes)]
    offload_in = [link.offload_in if mode == "offload" else 0.0 for link, mode in zip(links, modes)]
    gradients = [link.gradients for link in links]
    trunk_in, trunk_out = trunk_times(profile)
    if not profile.asynchronous:
        forward_s = sum(forward) + sum(weights) + sum(offload_out)
        backward_s = sum(backward) + sum(weights[:last]) + sum(offload_in) + sum(gradients) + trunk_out
        refreshed = sum(link.weights for link, s in zip(links, streamed) if link.changes and not s)
        first_forward_s = forward_s + trunk_in + refreshed
    else:
        tail = gradients[0] + trunk_out  # block 0's gradients and the trunk's leave after backward has ended
        head = offload_in[last]  # the last block's activations come back before any backward compute can start
        # Block i - 1's activations come back while block i computes, and not before it starts: per block the
        # longer of the two.
        behind = [max(backward[i], offload_in[i - 1] if i >= 1 else 0.0) for i in range(len(blocks))]
        if prefetch >= 1:
            forward_bounds = [weights[0] + sum(forward), sum(weights) + forward[last]]
            backward_bounds = [
                head + sum(behind) + tail,
                sum(weights[:last]) + sum(offload_in) + backward[0] + tail,
            ]
            if prefetch == 1 and profile.copy_spread > 0:
                late = 1 + profile.copy_spread  # a copy's time with its spread: what a late one exposes
                forward_bounds.append(weights[0] + (sum(forward) + forward[last] + late * sum(weights[1:])) / 2)
                backward_bounds.append(
                    head + (sum(backward) + backward[0] + late * sum(weights[:last]) + sum(offload_in[:last])) / 2
                    + tail
                )
        else:
            forward_bounds = [sum(forward) + sum(weights)]
            # Block i - 1's weights are asked for when it starts, after its activations came back: then the copy.
            backward_bounds = [head + sum(behind) + sum(weights[:last]) + tail, sum(offload_in) + backward[0] + tail]
        # The last activations leave while the head computes; they must be out before they can come back.
        forward_bounds.append(forward[0] + sum(offload_out) - profile.head_s)
        backward_bounds.append(backward[last] + sum(gradients) + trunk_out)
        forward_s = max(forward_bounds)
        backward_s = max(backward_bounds)
        first_forward_s = max(
            forward_s,
            trunk_in + first_weights[0] + sum(forward),
            trunk_in + sum(first_weights) + forward[last],
        )
    optimizer_s = [block.optimizer_s for block in blocks]
    if profile.overlap_optimizer:
        exposed_s = profile.trunk_optimizer_s + max(optimizer_s[0], sum(optimizer_s) - (backward_s - backward[last]))
    else:
        exposed_s = profile.trunk_optimizer_s + sum(optimizer_s)
    return {
        "first_forward_s": first_forward_s,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "optimizer_s": exposed_s,
    }
