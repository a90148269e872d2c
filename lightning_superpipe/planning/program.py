"""The mixed-integer linear program of :mod:`.solver` (HiGHS, ``scipy.optimize.milp``): its variables, rows and solve.

The program is :func:`.cost.predict`'s model in linear form: for each choice of its integer variables, the least
values its continuous variables can take are predict's step time and peak. Notation as in :mod:`.cost`, and:

* Classes ``K``: blocks that residency changes alike. It changes the model through ``s_i w_i``, ``r_i u_i w_i`` and
  the slots' bytes, and the time singles out blocks 0 and ``N-1``: blocks with equal ``weight_bytes`` and ``u_i``
  form a class, but for blocks 0 and ``N-1``, each a class of its own. (The mode's terms do not depend on
  residency, so the classes do not depend on any time: timing noise leaves them as they are.)
* ``P``: the prefetch depths allowed (``0..max_prefetch``, or the pinned one); ``S = min(max(P) + 1, N)``, the most
  slots; ``w_1 > ... > w_L`` the blocks' distinct ``weight_bytes``, ``w_{L+1} = 0``.

Variables:

* ``m_{i,mu}`` binary: block ``i``'s activations are ``mu``.
* ``R_K`` integer in ``0..|K|``: resident blocks of class ``K`` (which ones does not change the model: the plan takes
  them evenly spaced). Counting them, rather than a binary per block, leaves HiGHS no equal placements to tell apart
  by branching.
* ``n_r``, ``n_mu`` integer: the resident blocks and the blocks per mode in all, for HiGHS to branch on.
* ``q_p`` binary for ``p`` in ``P``: the prefetch depth is ``p``.
* ``v_j`` binary: a block of weight at least ``w_j`` streams; ``z_m`` binary for ``2 <= m <= S``: slot ``m`` is
  allocated; ``y_m >= 0``: its bytes.
* ``h_i >= 0``: what blocks ``0..i`` hold until their backward; ``a >= 0``: the activation peak.
* On an asynchronous link, continuous ``fwd1``, ``bwd`` and (with more than one micro-batch) ``fwd``, each at least
  each of its bounds; ``e >= 0``: the exposed optimizer time (with ``overlap_optimizer``).

Constraints:

* ``sum_mu m_{i,mu} = 1``; ``sum_p q_p = 1``; ``n_r = sum_K R_K``, ``n_mu = sum_i m_{i,mu}``.
* The model's terms are linear: ``sum_{i in K} s_i w_i = w_K (|K| - R_K)``, ``sum_{i in K} r_i u_i w_i = u_K w_K
  R_K``, ``o_i = m_{i,offload}``, ``Cb_i = B_i + R_i m_{i,recompute}``, and blocks 0 and ``N-1`` are their classes.
* Synchronous link: ``fwd``, ``bwd`` and ``fwd1`` are :mod:`.cost`'s sums, linear expressions.
* Asynchronous link: ``fwd`` at least each of its bounds, and ``fwd1`` at least each of ``fwd``'s and its own two
  (which makes ``fwd1 >= fwd``); ``bwd`` at least each of its bounds. The ``p >= 1`` bounds that a ``p = 0`` one
  dominates (``s_0 w_0 + sum_i F_i`` and ``sum_i s_i w_i + F_{N-1}`` are at most ``sum_i (F_i + s_i w_i)``;
  ``o_{N-1} ai_{N-1} + sum_i b_i + g_0 + t_tg`` at most the serial one below), with continuous ``b_i >= Cb_i`` and
  ``b_i >= o_{i-1} ai_{i-1}`` (``b_0 = Cb_0``; plain ``Cb_i`` where no block can offload), hold at any depth, and so
  does the ``p = 0`` one that a ``p >= 1`` one dominates (``sum_i o_i ai_i + Cb_0 + g_0 + t_tg``). Where ``P`` has
  both ``0`` and a depth of at least 1, the others are switched by ``q_0`` with big-M: ``fwd >= sum_i (F_i + s_i
  w_i) - M (1 - q_0)`` with ``M = min(sum_{i >= 1} w_i, sum_{i < N-1} F_i)``, the most it can exceed the first (the
  second) of those always-on bounds by; ``bwd >= o_{N-1} ai_{N-1} + sum_i (b_i + s_i w_i [i < N-1]) + g_0 + t_tg -
  M' (1 - q_0)``, and ``bwd >= sum_{i < N-1} s_i w_i + sum_i o_i ai_i + Cb_0 + g_0 + t_tg - M' q_0``,
  with ``M' = sum_{i < N-1} (w_i + ai_i)``.
  Where ``P`` settles it, only that depth's bounds are there. ``fwd``, ``fwd1`` and ``bwd`` are minimised (the step
  time rises with each), so each takes its largest bound.
* With ``overlap_optimizer``: ``e >= trunk_optimizer_s + opt_0`` and ``e >= trunk_optimizer_s + sum_i opt_i - (bwd -
  Cb_{N-1})``; without, ``e`` is that sum. (A larger ``bwd`` raises the step time by ``micro_batches`` times what it
  lowers ``e`` by at most, so it never pays to take ``bwd`` above its bounds.)
* Slots, ``min(p + 1, n_s) * max_{i streamed} weight_bytes_i`` exactly: ``v_j >= v_{j-1}`` and ``|K| v_j + R_K >=
  |K|`` for each class ``K`` of weight ``w_j``; slot 1 has ``W = sum_j (w_j - w_{j+1}) v_j`` bytes (a tighter
  relaxation than a max over blocks: ``v_L`` alone bounds it by the lightest weight). Slot ``m`` exists when ``p >=
  m - 1`` and ``n_s >= m``, which ``N z_m >= (N - n_r) - (m - 1) - N (1 - sum_{p >= m-1} q_p)`` forces, and ``y_m >=
  W - w_1 (1 - z_m)``.
* ``h_i = h_{i-1} + kept_i m_{i,keep} + small_i m_{i,offload} + input_i m_{i,recompute}`` (a variable per position
  keeps the matrix sparse), ``a >= h_i + (kept_i - saved_input_i) m_{i,recompute} + offloaded_i m_{i,offload} +
  offloaded_{i-1} m_{i-1,offload} + L_i`` (block ``i``'s backward starts) and ``a >= h_{i-1} + input_i m_{i,recompute} +
  offloaded_{i-1} m_{i-1,offload} + G_i`` (it delivers its gradients; for ``i = 0`` also ``+ T_late``), and ``a >=
  h_{N-1} + X_head - T_in`` (the head's moment), with :mod:`.cost`'s constants ``L_i``, ``G_i``, ``T_late``, ``X_head``.
* ``peak = static + sum_K R_K weight_bytes_K + W + sum_m y_m + a <= budget``.
* Pinned knobs: ``n_r = resident_blocks``; ``P`` is the pinned prefetch; ``m`` fixed to the pinned modes.

Objective: the step time ``T = fwd1 + (micro_batches - 1) fwd + micro_batches (trunk_s + bwd) + e``. Among
placements equally fast (within ``EQUAL``), the least memory: a second program minimises ``peak`` subject to ``T <=
T*`` of the first. (A weighted sum, time plus so many seconds per byte, would either trade real time for memory,
1e-12 s per byte being a millisecond per GiB, or fall below HiGHS's tolerances.) :func:`minimum_plan` is the same two
programs the other way round: the least ``peak``, then the fastest at it. From that placement, :func:`.solver.solve`
takes the one predicted as fast with the fewest copies the budget holds (``"keep"``, then resident blocks), then the
shallowest prefetch.

Times and bytes are in units of 1e-3 of the most any placement could take (``_SCALE``). HiGHS holds a limit only to
a tolerance relative to its row's size (about 1e-9 of it), so each placement it picks is scored again by
:func:`.cost.predict`, whose figures the plan reports and which must agree with the program's. Where HiGHS takes a
placement a few bytes over the budget, :func:`solve` lowers the limit until the placement taken fits, and then makes
sure, by minimising the peak among faster placements (which HiGHS does exactly), that none of those it left out fits:
the plan fits the budget to the byte and is the fastest that does. A time limit that the placement found misses by
less than HiGHS's tolerance on it (``_Program.time_band``) is no proof: there HiGHS has been seen to return a faster
placement that is not the least in peak, so that answer counts only from a limit past the band. HiGHS runs without
presolve, which would fold the count variables back into the binaries they sum; where it then finds no solution or
one predict disagrees with, the program is solved again with presolve (HiGHS 1.12 without it has been seen to cut
off feasible solutions).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from lightning_superpipe.planning.cost import (
    MODES,
    gradient_bytes_at,
    head_extra_bytes,
    held_bytes,
    in_use_bytes,
    late_trunk_gradient_bytes,
    leaving_bytes,
    link_times,
    predict,
    static_bytes,
    trunk_times,
)
from lightning_superpipe.planning.profile import Profile
from lightning_superpipe.planning.terms import (
    _every,
    _first,
    _Knobs,
    _Linear,
    _Placement,
    _residency_classes,
    _spread,
    _total,
)

#: Seconds HiGHS may take over one program.
TIME_LIMIT_S = 10.0
#: Placements whose predicted step times differ by less than this fraction count as equally fast.
EQUAL = 1e-9
#: How far the program's figures may be from predict's (relative) before it is a bug.
AGREEMENT = 1e-6
#: Times and bytes are in units of 1 / _SCALE of the largest step time and peak any placement can have: HiGHS's
#: absolute tolerance on rows (1e-6) is then 1e-9 of those, and its rows' values stay small enough for it to meet
#: that (at 1e4, its final check has been seen to fail by a hair).
_SCALE = 1e3
#: HiGHS's tolerance on rows and integrality in a mixed-integer program (its ``mip_feasibility_tolerance``).
_FEASIBILITY_TOLERANCE = 1e-6
#: The objective is scaled further, so that HiGHS's absolute gap (1e-6) is 1e-12 of the largest value it can take.
_OBJECTIVE_SCALE = 1e3
#: The relative gap at which HiGHS stops: it proves its placement the best to about 1e-10.
_MIP_REL_GAP = 1e-10
#: Predicted step times this close (relative) differ by float rounding only: the plan's last choices among equal
#: placements (more resident blocks, a shallower prefetch) take them as equal.
_ROUNDING = 1e-12


class _Program:
    """The program's variables and standing constraints for one profile and its pinned knobs, as the module's
    docstring has them.

    Times are in units of ``time_unit`` seconds and bytes of ``byte_unit`` bytes (see ``_SCALE``).
    """

    def __init__(self, profile: Profile, knobs: _Knobs, max_prefetch: int) -> None:
        self.profile = profile
        self._blocks = profile.blocks
        self._last = len(self._blocks) - 1
        self._lower: list[float] = []
        self._upper: list[float] = []
        self._integral: list[int] = []
        self._rows: list[tuple[_Linear, float, float]] = []
        self._links = [link_times(profile, block) for block in self._blocks]
        self._units()
        # Variables and rows in a fixed order (the order HiGHS sees them in, which can decide among equal plans).
        self._knob_variables(knobs, max_prefetch)
        self.time = self._step_time()
        # HiGHS holds a limit on the time to its tolerance on that row and on each row bounding a continuous variable
        # the time sums, each as many times as the time counts it: within this many seconds of the limit, a placement
        # is on its edge (twice that, for the integers' tolerance).
        counted = 1.0 + sum(abs(c) for index, c in self.time.terms.items() if not self._integral[index])
        self.time_band = 2 * _FEASIBILITY_TOLERANCE * counted * self.time_unit
        slots = self._slots()
        activations = self._activations()
        nbytes = self._nbytes
        resident_weights = _total(
            [
                resident * (self._blocks[members[0]].weight_bytes * nbytes)
                for members, resident in zip(self.classes, self.resident)
            ]
        )
        self.peak = _total([resident_weights, *slots, activations]) + self._static * nbytes

    def _units(self) -> None:
        """``time_unit`` and ``byte_unit``: the slowest step and the most bytes any placement could take, over
        ``_SCALE``, so that the program's coefficients are of one order."""
        profile, blocks, links = self.profile, self._blocks, self._links
        trunk_in, trunk_out = trunk_times(profile)
        self._optimizer_s = profile.trunk_optimizer_s + sum(block.optimizer_s for block in blocks)
        # More than any placement's step: every copy serial with every computation, every block refreshed.
        # (Each copy counted with its spread, which the prefetch-1 bounds can add.)
        late = 1.0 + profile.copy_spread
        forward_most = sum(
            b.forward_s + link.offload_compute + late * link.weights + link.offload_out
            for b, link in zip(blocks, links)
        )
        backward_most = trunk_out + sum(
            b.backward_s + b.recompute_s + link.offload_compute + late * link.weights + link.offload_in
            + link.gradients
            for b, link in zip(blocks, links)
        )
        slowest_s = (
            trunk_in
            + sum(link.weights for link in links)
            + profile.micro_batches * (forward_most + profile.trunk_s + backward_most)
            + self._optimizer_s
            + profile.step_overhead_s
        )
        self.time_unit = slowest_s / _SCALE or 1.0
        self._static = sum(static_bytes(profile).values())
        heaviest = max(block.weight_bytes for block in blocks)
        most_bytes = (
            self._static
            + sum(b.weight_bytes + b.kept_bytes + b.offloaded_bytes + b.small_bytes + b.input_bytes for b in blocks)
            + len(blocks) * heaviest
            + 2 * max(max(b.kept_bytes, b.offloaded_bytes) for b in blocks)
        )
        self.byte_unit = most_bytes / _SCALE or 1.0
        self._seconds, self._nbytes = 1.0 / self.time_unit, 1.0 / self.byte_unit
        self._trunk_in_s, self._trunk_out_s = trunk_in * self._seconds, trunk_out * self._seconds

    def _knob_variables(self, knobs: _Knobs, max_prefetch: int) -> None:
        """The modes ``m``, resident counts ``R_K`` and ``n_r``, and prefetch binaries ``q_p``, pinned where the
        user pinned them."""
        count = len(self._blocks)

        def mode_variable(i: int, mode: str) -> _Linear:
            if knobs.activations is None:
                return self._variable(1.0)
            pinned = float(knobs.activations[i] == mode)
            return self._variable(pinned, lower=pinned)

        self.modes = [{mode: mode_variable(i, mode) for mode in MODES} for i in range(count)]
        for modes in self.modes:
            self._add(_total(list(modes.values())), 1.0, 1.0)
        for mode in MODES:
            self._add(self._variable(count) - _total([modes[mode] for modes in self.modes]), 0.0, 0.0)

        self.classes = _residency_classes(self.profile)
        self.resident = [self._variable(len(members)) for members in self.classes]
        self._resident_count = self._variable(count)
        self._add(self._resident_count - _total(self.resident), 0.0, 0.0)
        if knobs.resident_blocks is not None:
            self._add(self._resident_count, knobs.resident_blocks, knobs.resident_blocks)
        self.depths = [knobs.prefetch] if knobs.prefetch is not None else list(range(max_prefetch + 1))
        self.depth = {p: self._variable(1.0) for p in self.depths}
        self._add(_total(list(self.depth.values())), 1.0, 1.0)

    # ------------------------------------------------------------------ the step time's terms
    def _crossing(self, include: Callable[[int], bool], changed_too: bool = False) -> _Linear:
        """``sum_i s_i w_i`` over the blocks ``include`` takes (whole classes: blocks 0 and N-1 are classes of
        their own), or with ``changed_too`` ``sum_i (s_i + r_i u_i) w_i``."""
        terms = []
        for members, resident in zip(self.classes, self.resident):
            if include(members[0]):
                weights_s = self._links[members[0]].weights * self._seconds
                if changed_too and self._links[members[0]].changes:
                    terms.append(_Linear(constant=len(members) * weights_s))
                else:
                    terms.append(_Linear(constant=len(members) * weights_s) - resident * weights_s)
        return _total(terms)

    def _per_mode(self, mode: str, value: Callable[[int], float], include: Callable[[int], bool] = _every) -> _Linear:
        """``sum_i mu_i value_i`` over the blocks ``include`` takes, in seconds."""
        return _total(
            [self.modes[i][mode] * (value(i) * self._seconds) for i in range(len(self._blocks)) if include(i)]
        )

    def _compute_backward(self, include: Callable[[int], bool]) -> _Linear:
        """``sum_i Cb_i`` over the blocks ``include`` takes."""
        blocks = self._blocks
        constant = sum(blocks[i].backward_s for i in range(len(blocks)) if include(i)) * self._seconds
        recomputed = self._per_mode("recompute", lambda i: blocks[i].recompute_s, include)
        return recomputed + self._offload_compute(include) + constant

    def _compute_forward(self, include: Callable[[int], bool]) -> _Linear:
        """``sum_i (F_i + o_i X_i)`` over the blocks ``include`` takes."""
        blocks = self._blocks
        constant = sum(blocks[i].forward_s for i in range(len(blocks)) if include(i)) * self._seconds
        return self._offload_compute(include) + constant

    def _offload_compute(self, include: Callable[[int], bool]) -> _Linear:
        """``sum_i o_i X_i`` over the blocks ``include`` takes (nothing where no correction set ``X``)."""
        if not self.profile.offload_compute_s_per_byte:
            return _Linear()
        return self._per_mode("offload", lambda i: self._links[i].offload_compute, include)

    def _step_time(self) -> _Linear:
        """``T``: the first micro-batch's forward, the others', every backward, the trunk and the exposed
        optimizer time."""
        profile, blocks, seconds = self.profile, self._blocks, self._seconds
        if not profile.asynchronous:
            first_forward_s, forward_s, backward_s = self._serial_passes()
        else:
            first_forward_s, forward_s, backward_s = self._overlapped_passes()
        if profile.overlap_optimizer:
            # E >= opt_0 + ..., E >= sum_i opt_i - (bwd - Cb_{N-1}) + ...: a larger bwd lowers E by at most as much
            # as it raises T (at least one micro-batch), so minimising T never takes bwd above its bounds.
            exposed = self._variable(lower=(profile.trunk_optimizer_s + blocks[0].optimizer_s) * seconds)
            last_backward = self._compute_backward(lambda i: i == self._last)
            self._add(exposed + backward_s - last_backward, self._optimizer_s * seconds, math.inf)
        else:
            exposed = _Linear(constant=self._optimizer_s * seconds)
        micro_batches = profile.micro_batches
        return (
            first_forward_s
            + (micro_batches - 1) * forward_s
            + micro_batches * (backward_s + profile.trunk_s * seconds)
            + exposed
            + profile.step_overhead_s * seconds
        )

    def _serial_passes(self) -> tuple[_Linear, _Linear, _Linear]:
        """``fwd1``, ``fwd`` and ``bwd`` on a synchronous link: :mod:`.cost`'s sums."""
        links, seconds = self._links, self._seconds
        forward_compute = self._compute_forward(_every)
        offload_out = self._per_mode("offload", lambda i: links[i].offload_out)
        offload_in = self._per_mode("offload", lambda i: links[i].offload_in)
        gradients = sum(link.gradients for link in links) * seconds
        forward_s: _Linear = forward_compute + self._crossing(_every) + offload_out
        backward_s: _Linear = (
            self._compute_backward(_every) + self._crossing(self._before_last) + offload_in + gradients
            + self._trunk_out_s
        )
        refreshed = _total(
            [
                resident * (links[members[0]].weights * seconds)
                for members, resident in zip(self.classes, self.resident)
                if links[members[0]].changes
            ]
        )
        return forward_s + self._trunk_in_s + refreshed, forward_s, backward_s

    def _before_last(self, i: int) -> bool:
        return i < self._last

    def _overlapped_passes(self) -> tuple[_Linear, _Linear, _Linear]:
        """``fwd1``, ``fwd`` and ``bwd`` on an asynchronous link: each at least each of its bounds."""
        blocks, links, seconds, last = self._blocks, self._links, self._seconds, self._last
        forward_compute = self._compute_forward(_every)
        first_forward, last_forward = self._compute_forward(_first), self._compute_forward(lambda i: i == last)
        offload_out = self._per_mode("offload", lambda i: links[i].offload_out)
        offload_in = self._per_mode("offload", lambda i: links[i].offload_in)
        gradients = sum(link.gradients for link in links) * seconds
        tail = links[0].gradients * seconds + self._trunk_out_s
        # The last block's activations come back before any backward compute can start.
        head = self.modes[last]["offload"] * (links[last].offload_in * seconds)
        # (bound, when, M): "always", or only at prefetch 0 ("p0") or at least 1 ("p1"), with M the most it can
        # exceed the pass's other bounds by elsewhere. The prefetch >= 1 bounds that the prefetch-0 ones
        # dominate hold at any prefetch, and so do the prefetch-0 ones that prefetch >= 1 ones dominate.
        not_first = sum(link.weights for link in links[1:]) * seconds
        not_last = sum(link.weights for link in links[:last]) * seconds
        computed_before_last = sum(
            block.forward_s + link.offload_compute for block, link in zip(blocks[:last], links[:last])
        ) * seconds
        behind_returns, returned_in = self._behind_returns()
        crossing, compute_backward, before_last = self._crossing, self._compute_backward, self._before_last
        forward_bounds = [
            (crossing(_first) + forward_compute, "always", 0.0),  # <= the serial one at prefetch 0
            (crossing(_every) + last_forward, "always", 0.0),  # likewise
            (offload_out + first_forward - self.profile.head_s * seconds, "always", 0.0),
            # Above the first of these by sum_{i >= 1} s_i w_i, above the second by sum_{i < N-1} F_i.
            (forward_compute + crossing(_every), "p0", min(not_first, computed_before_last)),
        ]
        backward_bounds = [
            (head + behind_returns + tail, "always", 0.0),  # <= the serial one at prefetch 0
            (offload_in + compute_backward(_first) + tail, "always", 0.0),  # <= the copies' one at prefetch >= 1
            (compute_backward(lambda i: i == last) + gradients + self._trunk_out_s, "always", 0.0),
            # Each above the first (the second) of these by sum_{i < N-1} s_i w_i.
            (head + behind_returns + crossing(before_last) + tail, "p0", not_last + returned_in),
            (crossing(before_last) + offload_in + compute_backward(_first) + tail, "p1", not_last),
        ]
        if 1 in self.depths and self.profile.copy_spread > 0:
            # At prefetch 1 the mean of the compute and copy bounds, each copy with its spread; above the always-on
            # compute bound by at most the copies with their spread.
            late = 1.0 + self.profile.copy_spread
            returned = self._per_mode("offload", lambda i: links[i].offload_in, self._before_last)
            forward_bounds.append((
                crossing(_first) + 0.5 * (forward_compute + last_forward + late * crossing(lambda i: i >= 1)),
                "d1", late * not_first,
            ))
            backward_bounds.append((
                head + 0.5 * (compute_backward(_every) + compute_backward(_first) + late * crossing(before_last)
                              + returned) + tail,
                "d1", late * not_last + sum(link.offload_in for link in links[:last]) * seconds,
            ))
        # fwd1 = max(fwd's bounds, the first micro-batch's own); with one micro-batch fwd itself is not needed.
        forward_s = self._at_least(forward_bounds) if self.profile.micro_batches > 1 else _Linear()
        backward_s = self._at_least(backward_bounds)
        first_forward_s = self._at_least(
            [
                *forward_bounds,
                (crossing(_first, changed_too=True) + self._trunk_in_s + forward_compute, "always", 0.0),
                (crossing(_every, changed_too=True) + self._trunk_in_s + last_forward, "always", 0.0),
            ]
        )
        return first_forward_s, forward_s, backward_s

    def _behind_returns(self) -> tuple[_Linear, float]:
        """The backward's compute, each block waiting for its activations, ``sum_i b_i``, and ``sum_{i < N-1} ai_i``
        (0 where nothing comes back).

        Block i - 1's activations are brought back as block i's backward starts, and block i - 1 starts once they
        are back: ``b_i >= Cb_i`` and ``b_i >= o_{i-1} ai_{i-1}`` (``b_i = Cb_i`` where nothing can be brought back).
        """
        links, seconds, last = self._links, self._seconds, self._last
        if not any(link.offload_in > 0 for link in links[:last]):
            return self._compute_backward(_every), 0.0
        behind = []
        for i in range(len(self._blocks)):
            own = self._compute_backward(lambda j, i=i: j == i)
            if i == 0:
                behind.append(own)
                continue
            slower = self._variable()
            self._add(slower - own, 0.0, math.inf)
            returned = self.modes[i - 1]["offload"] * (links[i - 1].offload_in * seconds)
            self._add(slower - returned, 0.0, math.inf)
            behind.append(slower)
        return _total(behind), sum(link.offload_in for link in links[:last]) * seconds

    def _at_least(self, bounds: Sequence[tuple[_Linear, str, float]]) -> _Linear:
        """The least value at least each of ``bounds``, ``(bound, when, M)``: ``when`` is ``"always"``, or ``"p0"``
        (``"p1"``, ``"d1"``) for a bound that holds only at prefetch 0 (at least 1, exactly 1), where it is relaxed by
        ``M`` (in the program's units, the most it can exceed the value by at the other depths) through the
        prefetch-0 (prefetch-1) binary.
        One bound that always holds is the value itself; else a continuous variable (the step time rises with it,
        so it takes the largest bound)."""
        shallow, deep = 0 in self.depths, any(p >= 1 for p in self.depths)

        def switched(when: str) -> str:
            if when == "d1":
                return "always" if self.depths == [1] else when
            return when if shallow and deep else "always"

        active = [
            (bound, switched(when), most)
            for bound, when, most in bounds
            if when == "always" or (when == "p0" and shallow) or (when == "p1" and deep)
            or (when == "d1" and 1 in self.depths)
        ]
        if len(active) == 1:
            return active[0][0]
        value = self._variable()
        for bound, when, most in active:
            if when == "always":
                self._add(value - bound, 0.0, math.inf)
            else:
                if when == "d1":
                    relaxation = (1.0 - self.depth[1]) * most
                else:
                    shallow_depth = self.depth[0]
                    relaxation = (1.0 - shallow_depth) * most if when == "p0" else shallow_depth * most
                self._add(value - bound + relaxation, 0.0, math.inf)
        return value

    # ------------------------------------------------------------------ the peak's terms
    def _slots(self) -> list[_Linear]:
        """The slots' bytes: slot 1 ``W`` from the ``v_j``, slot ``m`` ``y_m`` where ``z_m`` allocates it."""
        blocks, nbytes, count = self._blocks, self._nbytes, len(self._blocks)
        weights = sorted({block.weight_bytes for block in blocks}, reverse=True)
        size_terms = []
        streams: Optional[_Linear] = None
        for j, weight in enumerate(weights):
            heavier, streams = streams, self._variable(1.0)
            if heavier is not None:
                self._add(streams - heavier, 0.0, math.inf)
            for members, resident in zip(self.classes, self.resident):
                if blocks[members[0]].weight_bytes == weight:
                    self._add(len(members) * streams + resident, len(members), math.inf)
            lighter = weights[j + 1] if j + 1 < len(weights) else 0
            size_terms.append(streams * ((weight - lighter) * nbytes))
        size = _total(size_terms)
        slots = [size]
        for m in range(2, min(max(self.depths) + 1, count) + 1):
            allocated = self._variable(1.0)
            deep_enough = _total([self.depth[p] for p in self.depths if p >= m - 1])
            self._add(
                count * allocated + self._resident_count + count * (1.0 - deep_enough), count + 1.0 - m, math.inf
            )
            slot = self._variable()
            self._add(slot - size + (1.0 - allocated) * (weights[0] * nbytes), 0.0, math.inf)
            slots.append(slot)
        return slots

    def _activations(self) -> _Linear:
        """``a``: the activation peak, at least what is held when each block's backward starts and when it
        delivers its gradients."""
        profile, blocks, nbytes = self.profile, self._blocks, self._nbytes
        activations = self._variable()
        held = _Linear()
        leaving, delivered = leaving_bytes(profile), gradient_bytes_at(profile)
        for i, (block, modes) in enumerate(zip(blocks, self.modes)):
            before, held = held, self._variable()
            self._add(held - before - _total([modes[mu] * (held_bytes(block, mu) * nbytes) for mu in MODES]), 0.0, 0.0)
            in_use = _total([modes[mu] * (in_use_bytes(block, mu) * nbytes) for mu in MODES])
            returned = self.modes[i - 1]["offload"] * (blocks[i - 1].offloaded_bytes * nbytes) if i >= 1 else 0.0
            inputs = modes["recompute"] * (block.input_bytes * nbytes)
            self._add(activations - held - in_use - returned, leaving[i] * nbytes, math.inf)  # its backward starts
            # its gradients leave (after block 0's, the trunk's late gradients arrive)
            late = late_trunk_gradient_bytes(profile) if i == 0 else 0
            self._add(activations - before - inputs - returned, (delivered[i] + late) * nbytes, math.inf)
        # the head's moment: forward is done, every block holds its activations, the head its logits and loss
        self._add(activations - held, head_extra_bytes(profile) * nbytes, math.inf)
        return activations

    def _variable(self, upper: float = math.inf, lower: float = 0.0) -> _Linear:
        """A new variable from ``lower`` to ``upper``: an integer where ``upper`` is finite, else continuous."""
        self._lower.append(lower)
        self._upper.append(upper)
        self._integral.append(int(math.isfinite(upper)))
        return _Linear({len(self._lower) - 1: 1.0})

    def _add(self, expression: _Linear, lower: float, upper: float) -> None:
        self._rows.append((expression, lower, upper))

    def _figure(self, name: str) -> tuple[_Linear, float]:
        """The program's expression of the ``"time"`` or ``"peak"``, and its unit."""
        return (self.time, self.time_unit) if name == "time" else (self.peak, self.byte_unit)

    def _solve(self, objective: str, limits: Sequence[tuple[str, float]]) -> Optional[_Placement]:
        """The placement of HiGHS's solution minimising ``objective`` (``"time"`` or ``"peak"``) with each ``(figure,
        most)`` of ``limits`` (seconds or bytes) as a constraint; ``None`` if there is none.

        Without presolve, which would fold the count variables back into the binaries they sum and so lose the
        branching on them, HiGHS (1.12) has been seen to cut off feasible solutions: where it finds none, or one on
        which predict disagrees with the program, the program is solved again with presolve.
        """
        rows = list(self._rows)
        for name, most in limits:
            expression, unit = self._figure(name)
            rows.append((expression, -math.inf, most / unit))
        entries = [(r, index, value) for r, (e, _, _) in enumerate(rows) for index, value in e.terms.items()]
        row_index, column_index, data = zip(*entries)
        matrix = csr_array((data, (row_index, column_index)), shape=(len(rows), len(self._lower)))
        lower = np.array([low - e.constant for e, low, _ in rows])
        upper = np.array([high - e.constant for e, _, high in rows])
        cost = np.zeros(len(self._lower))
        for index, coefficient in self._figure(objective)[0].terms.items():
            cost[index] = coefficient * _OBJECTIVE_SCALE
        disagreement = None
        for presolve in (False, True):
            result = milp(
                cost,
                integrality=np.array(self._integral),
                bounds=Bounds(np.array(self._lower), np.array(self._upper)),
                constraints=LinearConstraint(matrix, lower, upper),
                options={"disp": False, "presolve": presolve, "time_limit": TIME_LIMIT_S, "mip_rel_gap": _MIP_REL_GAP},
            )
            if result.x is None:
                if not presolve:
                    continue
                if result.status == 2:
                    return None
                raise RuntimeError(f"The planner's program found no placement: HiGHS says {result.message!r}.")
            if result.status != 0:
                warnings.warn(
                    f"The planner's program stopped before proving its placement the best ({result.message}); using"
                    " the best it found.",
                    stacklevel=4,
                )
            placement, disagreement = self._placement(result.x, result.status == 0, objective)
            if disagreement is None:
                return placement
        raise RuntimeError(f"{disagreement}: a bug in the planner, whose program is the cost model's.")

    def _placement(self, x: np.ndarray, proven: bool, objective: str) -> tuple[_Placement, Optional[str]]:
        """The placement of solution ``x``, scored by :func:`.cost.predict`, and how predict disagrees with the
        program on ``objective`` (``None`` where it does not). The program's figure bounds predict's from above at any
        solution, and equals it at one proven the best whose integers are whole (one that takes an integer a hair off,
        within HiGHS's tolerance, to meet a limit exactly may leave other variables above their least, as the whole
        alternative was infeasible)."""

        def chosen(variable: _Linear) -> int:
            return int(np.round(variable.value(x)))

        depths = [p for p in self.depths if chosen(self.depth[p])]
        choices = [[mode for mode, variable in modes.items() if chosen(variable)] for modes in self.modes]
        if len(depths) != 1 or any(len(one) != 1 for one in choices):
            raise RuntimeError(
                f"The planner's program chose prefetch {depths} and modes {choices}, not one of each: a bug in the"
                " planner."
            )
        modes = [one[0] for one in choices]
        resident: set[int] = set()
        for members, variable in zip(self.classes, self.resident):
            resident |= _spread(members, chosen(variable))
        prediction = predict(self.profile, resident, depths[0], modes)
        placement = _Placement(frozenset(resident), depths[0], modes, prediction)
        expression, unit = self._figure(objective)
        program, predicted = expression.value(x) * unit, placement.figure(objective)
        tolerance = AGREEMENT * max(abs(predicted), unit)
        integral = np.array(self._integral, dtype=bool)
        whole = proven and float(np.max(np.abs(x[integral] - np.round(x[integral])))) <= 1e-9
        if program < predicted - tolerance or (whole and program > predicted + tolerance):
            return placement, (
                f"The planner's program puts the {objective} of resident={sorted(resident)}, prefetch={depths[0]},"
                f" activations={modes} at {program!r} and the cost model at {predicted!r}"
            )
        return placement, None

    def best(
        self, objective: str, limits: Sequence[tuple[str, float]], tie_break: bool = True
    ) -> Optional[_Placement]:
        """The placement least in ``objective`` (``"time"`` or ``"peak"``) within ``limits`` (``(figure, most)``
        pairs, in seconds or bytes) as HiGHS holds them, and with ``tie_break``, among those equal in it the least in
        the other; ``None`` if HiGHS finds none."""
        best = self._solve(objective, limits)
        if best is None or not tie_break:
            return best
        other = "peak" if objective == "time" else "time"
        # Equal peaks are the same bytes; equal times, within EQUAL.
        most = best.figure(objective) * (1 + EQUAL) if objective == "time" else best.figure(objective)
        tied_limits = [*limits, (objective, most)]
        tied = self._solve(other, tied_limits)
        # HiGHS may pass a placement a little past a limit: predict has the last word.
        if (
            tied is not None
            and all(tied.figure(name) <= limit for name, limit in tied_limits)
            and tied.figure(other) <= best.figure(other)
        ):
            return tied
        return best
