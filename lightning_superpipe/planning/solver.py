"""The fastest placement that fits a memory budget, as a mixed-integer linear program (HiGHS, ``scipy.optimize.milp``).

The program is :func:`.cost.predict`'s model in linear form: for each choice of its integer variables, the least
values its continuous variables can take are predict's step time and peak. Notation as in :mod:`.cost`, and:

* ``t^rho_i(pi, mu)``: block ``i``'s forward plus backward time, placed ``pi`` (resident or streamed) with mode
  ``mu``, by the rule ``rho``: overlapped (``max``) or serial (``sum``); ``b^rho_i(pi, mu)`` its backward alone. They
  are constants, :func:`.cost.block_times`' values.
* Classes ``K``: blocks that residency changes alike, i.e. with equal ``weight_bytes`` and equal changes
  ``t^rho_i(resident, mu) - t^rho_i(streamed, mu)`` (and of ``b``) for every ``rho`` and ``mu``; the last block is
  one of its own. ``D^rho_K(mu)`` and ``d^rho_K(mu)`` are those changes.
* ``P``: the prefetch depths allowed (``0..max_prefetch``, or the pinned one); ``S = min(max(P) + 1, N)``, the most
  slots; ``w_1 > ... > w_L`` the blocks' distinct ``weight_bytes``, ``w_{L+1} = 0``.

Variables:

* ``m_{i,mu}`` binary: block ``i``'s activations are ``mu``.
* ``R_{K,mu}`` integer in ``0..|K|``: resident blocks of class ``K`` with mode ``mu`` (which ones does not change
  the model: the plan takes them evenly spaced). Counting them, rather than a binary per block, leaves HiGHS no
  equal placements to tell apart by branching.
* ``n_r``, ``n_mu`` integer: the resident blocks and the blocks per mode in all, for HiGHS to branch on.
* ``q_p`` binary for ``p`` in ``P``: the prefetch depth is ``p``.
* ``v_j`` binary: a block of weight at least ``w_j`` streams; ``z_m`` binary for ``2 <= m <= S``: slot ``m`` is
  allocated; ``y_m >= 0``: its bytes.
* ``h_i >= 0``: what blocks ``0..i`` hold until their backward; ``a >= 0``: the activation peak.
* Where the rule is a choice (an asynchronous link and ``0`` in ``P``, among others): ``T_b``, the blocks' time, and
  ``H``, the backward time of blocks ``0..N-2``; ``e >= 0``: the exposed optimizer time (with ``overlap_optimizer``).

Constraints:

* ``sum_mu m_{i,mu} = 1``; ``sum_p q_p = 1``; ``R_{K,mu} <= sum_{i in K} m_{i,mu}``; ``n_r = sum R``, ``n_mu =
  sum_i m_{i,mu}``.
* Blocks' time under ``rho``: ``T^rho = sum_{i,mu} m_{i,mu} t^rho_i(streamed, mu) + sum_{K,mu} R_{K,mu}
  D^rho_K(mu)``, and ``H^rho`` alike with ``b``, over blocks ``0..N-2``. Copies overlap compute on an asynchronous
  link with ``p >= 1`` and are serial otherwise: where that is settled by the knobs, ``T_b = T^rho`` and ``H =
  H^rho``; else, with ``M`` and ``M'`` the most the serial figures can exceed the overlapped ones by, ``T_b >=
  T^overlap``, ``T_b >= T^serial - M (1 - q_0)`` (``T_b`` is minimised) and ``H <= H^serial``, ``H <= H^overlap +
  M' q_0`` (``H`` is maximised, as it lowers ``e``).
* With ``overlap_optimizer``: ``e >= trunk_optimizer_s + opt_0`` and ``e >= trunk_optimizer_s + sum_i opt_i - H``;
  without, ``e`` is that sum. (At least one micro-batch, so a larger ``H`` never pays for a larger ``T_b``.)
* Slots, ``min(p + 1, n_s) * max_{i streamed} weight_bytes_i`` exactly: ``v_j >= v_{j-1}`` and ``|K| v_j + sum_mu
  R_{K,mu} >= |K|`` for each class ``K`` of weight ``w_j``; slot 1 has ``W = sum_j (w_j - w_{j+1}) v_j`` bytes (a
  tighter relaxation than a max over blocks: ``v_L`` alone bounds it by the lightest weight). Slot ``m`` exists when
  ``p >= m - 1`` and ``n_s >= m``, which ``N z_m >= (N - n_r) - (m - 1) - N (1 - sum_{p >= m-1} q_p)`` forces, and
  ``y_m >= W - w_1 (1 - z_m)``.
* ``h_i = h_{i-1} + kept_i m_{i,keep} + small_i m_{i,offload} + input_i m_{i,recompute}`` (a variable per position
  keeps the matrix sparse) and ``a >= h_i + kept_i m_{i,recompute} + offloaded_i m_{i,offload} + offloaded_{i-1}
  m_{i-1,offload}``.
* ``peak = static + sum_{K,mu} R_{K,mu} weight_bytes_K + W + sum_m y_m + a <= budget``.
* Pinned knobs: ``n_r = resident_blocks``; ``P`` is the pinned prefetch; ``m`` fixed to the pinned modes.

Objective: the step time ``T = micro_batches (trunk_s + T_b) + e``. Among placements equally fast (within
``EQUAL``), the least memory: a second program minimises ``peak`` subject to ``T <= T*`` of the first. (A weighted
sum, time plus so many seconds per byte, would either trade real time for memory, 1e-12 s per byte being a
millisecond per GiB, or fall below HiGHS's tolerances.) :func:`minimum_plan` is the same two programs the other way
round: the least ``peak``, then the fastest at it.

Times and bytes are in units of 1e-3 of the most any placement could take (``_SCALE``). HiGHS holds a limit only to
a tolerance relative to its row's size (about 1e-9 of it), so each placement it picks is scored again by
:func:`.cost.predict`, whose figures the plan reports and which must agree with the program's. Where HiGHS takes a
placement a few bytes over the budget, :func:`solve` lowers the limit until the placement taken fits, and then makes
sure, by minimising the peak among faster placements (which HiGHS does exactly), that none of those it left out fits:
the plan fits the budget to the byte and is the fastest that does. HiGHS runs without presolve, which would fold the
count variables back into the binaries they sum; where it then finds no solution or one predict disagrees with, the
program is solved again with presolve (HiGHS 1.12 without it has been seen to cut off feasible solutions).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from lightning_superpipe.planning.cost import (
    MODES,
    PEAK_PARTS,
    Prediction,
    block_times,
    check_profile,
    held_bytes,
    in_use_bytes,
    overlapped,
    predict,
    slot_shape,
    static_bytes,
)
from lightning_superpipe.planning.plan import Plan
from lightning_superpipe.planning.profile import Profile
from lightning_superpipe.units import format_bytes

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
#: The objective is scaled further, so that HiGHS's absolute gap (1e-6) is 1e-12 of the largest value it can take.
_OBJECTIVE_SCALE = 1e3
#: The relative gap at which HiGHS stops: it proves its placement the best to about 1e-10.
_MIP_REL_GAP = 1e-10


class InfeasibleBudget(Exception):
    """No placement fits the memory budget.

    Attributes:
        budget_bytes: The budget.
        minimum_bytes: The least device memory any placement allowed by the pinned knobs needs.
        breakdown: That minimum's parts, as in :attr:`.cost.Prediction.breakdown`.
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, breakdown: dict[str, int]) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.breakdown = breakdown


class _Linear:
    """``sum(coefficient * x[index] for index, coefficient in terms) + constant`` over the program's variables."""

    __slots__ = ("terms", "constant")

    def __init__(self, terms: Optional[dict[int, float]] = None, constant: float = 0.0) -> None:
        self.terms = terms or {}
        self.constant = constant

    def __add__(self, other: Union[_Linear, float]) -> _Linear:
        if not isinstance(other, _Linear):
            return _Linear(dict(self.terms), self.constant + other)
        terms = dict(self.terms)
        for index, coefficient in other.terms.items():
            terms[index] = terms.get(index, 0.0) + coefficient
        return _Linear(terms, self.constant + other.constant)

    __radd__ = __add__

    def __mul__(self, factor: float) -> _Linear:
        terms = {index: coefficient * factor for index, coefficient in self.terms.items()}
        return _Linear(terms, self.constant * factor)

    __rmul__ = __mul__

    def __neg__(self) -> _Linear:
        return self * -1.0

    def __sub__(self, other: Union[_Linear, float]) -> _Linear:
        return self + (-other)

    def __rsub__(self, other: float) -> _Linear:
        return -self + other

    def value(self, x: np.ndarray) -> float:
        return sum(coefficient * x[index] for index, coefficient in self.terms.items()) + self.constant


def _total(expressions: Sequence[_Linear]) -> _Linear:
    """The sum of many expressions, without copying the growing one for each."""
    terms: dict[int, float] = {}
    constant = 0.0
    for expression in expressions:
        for index, coefficient in expression.terms.items():
            terms[index] = terms.get(index, 0.0) + coefficient
        constant += expression.constant
    return _Linear(terms, constant)


@dataclass(frozen=True)
class _Knobs:
    """What the user pinned; ``None`` leaves it to the solver."""

    resident_blocks: Optional[int]
    prefetch: Optional[int]
    activations: Optional[list[str]]

    def pinned(self) -> list[str]:
        """The pinned knobs as the user wrote them, e.g. ``["prefetch=2"]``."""
        knobs = [] if self.resident_blocks is None else [f"resident_blocks={self.resident_blocks}"]
        knobs += [] if self.prefetch is None else [f"prefetch={self.prefetch}"]
        return knobs + ([] if self.activations is None else [_describe_modes(self.activations)])


@dataclass(frozen=True)
class _Placement:
    """A placement the program chose, with predict's figures for it."""

    resident: frozenset[int]
    prefetch: int
    modes: list[str]
    prediction: Prediction

    def figure(self, name: str) -> float:
        """Its predicted ``"time"`` (seconds per step) or ``"peak"`` (bytes)."""
        return self.prediction.step_s if name == "time" else self.prediction.peak_bytes


def _knobs(
    profile: Profile,
    resident_blocks: Optional[int],
    prefetch: Optional[int],
    activations: Union[str, Sequence[str], None],
    max_prefetch: int,
) -> _Knobs:
    """The pinned knobs, checked against the profile's blocks."""
    check_profile(profile)
    count = len(profile.blocks)
    if resident_blocks is not None and (
        not isinstance(resident_blocks, int) or isinstance(resident_blocks, bool) or not 0 <= resident_blocks <= count
    ):
        raise ValueError(
            f"SuperpipeStrategy(resident_blocks={resident_blocks!r}): the model has {count} blocks, so it is an int"
            f" from 0 to {count}, or None to let the planner choose."
        )
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
        raise ValueError(
            f"SuperpipeStrategy(prefetch={prefetch!r}): an int of at least 0, or None to let the planner choose."
        )
    if not isinstance(max_prefetch, int) or max_prefetch < 0:
        raise ValueError(f"solve(max_prefetch={max_prefetch!r}): an int of at least 0.")
    modes = None
    if activations is not None:
        modes = [activations] * count if isinstance(activations, str) else list(activations)
        if len(modes) != count or any(mode not in MODES for mode in modes):
            raise ValueError(
                f"SuperpipeStrategy(activations={activations!r}): one of {', '.join(map(repr, MODES))} for every"
                f" block, a list of them with one per block ({count} blocks), or None to let the planner choose."
            )
    return _Knobs(resident_blocks, prefetch, modes)


class _Program:
    """The program's variables and standing constraints for one profile and its pinned knobs, as the module's
    docstring has them.

    Times are in units of ``time_unit`` seconds and bytes of ``byte_unit`` bytes (see ``_SCALE``).
    """

    def __init__(self, profile: Profile, knobs: _Knobs, max_prefetch: int) -> None:
        self.profile = profile
        blocks = profile.blocks
        count = len(blocks)
        self._lower: list[float] = []
        self._upper: list[float] = []
        self._integral: list[int] = []
        self._rows: list[tuple[_Linear, float, float]] = []
        # times[overlapped][i][(streamed, mode)]: block i's (forward_s, backward_s).
        times = {
            rule: [
                {(s, mode): block_times(profile, block, s, mode, rule) for s in (False, True) for mode in MODES}
                for block in blocks
            ]
            for rule in (True, False)
        }
        optimizer_s = profile.trunk_optimizer_s + sum(block.optimizer_s for block in blocks)
        slowest_s = profile.trunk_s + sum(max(map(sum, block.values())) for block in times[False])
        self.time_unit = (profile.micro_batches * slowest_s + optimizer_s) / _SCALE or 1.0
        static = sum(static_bytes(profile).values())
        heaviest = max(block.weight_bytes for block in blocks)
        most_bytes = (
            static
            + sum(b.weight_bytes + b.kept_bytes + b.offloaded_bytes + b.small_bytes + b.input_bytes for b in blocks)
            + count * heaviest
            + 2 * max(max(b.kept_bytes, b.offloaded_bytes) for b in blocks)
        )
        self.byte_unit = most_bytes / _SCALE or 1.0
        seconds, nbytes = 1.0 / self.time_unit, 1.0 / self.byte_unit

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

        def residency_key(i: int) -> tuple:
            changes = (
                # Rounded so that float noise in equal changes does not split a class.
                round((times[rule][i][(False, mode)][d] - times[rule][i][(True, mode)][d]) * seconds, 9)
                for rule in (True, False)
                for mode in MODES
                for d in (0, 1)
            )
            return (i == count - 1, blocks[i].weight_bytes, *changes)

        classes: dict[tuple, list[int]] = {}
        for i in range(count):
            classes.setdefault(residency_key(i), []).append(i)
        self.classes = list(classes.values())
        self.resident = [{mode: self._variable(len(members)) for mode in MODES} for members in self.classes]
        for members, resident in zip(self.classes, self.resident):
            for mode, variable in resident.items():
                self._add(variable - _total([self.modes[i][mode] for i in members]), -math.inf, 0.0)
        resident_count = self._variable(count)
        self._add(resident_count - _total([v for resident in self.resident for v in resident.values()]), 0.0, 0.0)
        if knobs.resident_blocks is not None:
            self._add(resident_count, knobs.resident_blocks, knobs.resident_blocks)
        self.depths = [knobs.prefetch] if knobs.prefetch is not None else list(range(max_prefetch + 1))
        self.depth = {p: self._variable(1.0) for p in self.depths}
        self._add(_total(list(self.depth.values())), 1.0, 1.0)

        def blocks_time(rule: bool, hidden: bool) -> _Linear:
            """``T^rule``, or with ``hidden`` ``H^rule``: the backward time of the blocks before the last."""
            direction = (lambda f, b: b) if hidden else (lambda f, b: f + b)
            terms = []
            for members, resident in zip(self.classes, self.resident):
                if hidden and count - 1 in members:
                    continue
                for mode in MODES:
                    streamed = [direction(*times[rule][i][(True, mode)]) for i in members]
                    terms += [self.modes[i][mode] * (t * seconds) for i, t in zip(members, streamed)]
                    change = direction(*times[rule][members[0]][(False, mode)]) - streamed[0]
                    terms.append(resident[mode] * (change * seconds))
            return _total(terms)

        def serial_excess(hidden: bool) -> float:
            """The most ``T^serial`` (``H^serial``) exceeds ``T^overlap`` (``H^overlap``) by."""
            direction = (lambda f, b: b) if hidden else (lambda f, b: f + b)
            return seconds * sum(
                max(direction(*serial[key]) - direction(*overlap[key]) for key in serial)
                for i, (serial, overlap) in enumerate(zip(times[False], times[True]))
                if not (hidden and i == count - 1)
            )

        rules = {profile.asynchronous and p >= 1 for p in self.depths}
        hides = profile.overlap_optimizer
        if len(rules) == 1:
            (rule,) = rules
            blocks_s = blocks_time(rule, False)
            hidden_s = blocks_time(rule, True) if hides else None
        else:
            serial = self.depth[0]
            blocks_s = self._variable()
            self._add(blocks_s - blocks_time(True, False), 0.0, math.inf)
            self._add(blocks_s - blocks_time(False, False) + serial_excess(False) * (1.0 - serial), 0.0, math.inf)
            hidden_s = self._variable() if hides else None
            if hidden_s is not None:
                self._add(hidden_s - blocks_time(False, True), -math.inf, 0.0)
                self._add(hidden_s - blocks_time(True, True) - serial_excess(True) * serial, -math.inf, 0.0)
        if hidden_s is not None:
            exposed = self._variable(lower=(profile.trunk_optimizer_s + blocks[0].optimizer_s) * seconds)
            self._add(exposed + hidden_s, optimizer_s * seconds, math.inf)
        else:
            exposed = _Linear(constant=optimizer_s * seconds)
        self.time = profile.micro_batches * (blocks_s + profile.trunk_s * seconds) + exposed

        weights = sorted({block.weight_bytes for block in blocks}, reverse=True)
        size_terms = []
        streams: Optional[_Linear] = None
        for j, weight in enumerate(weights):
            heavier, streams = streams, self._variable(1.0)
            if heavier is not None:
                self._add(streams - heavier, 0.0, math.inf)
            for members, resident in zip(self.classes, self.resident):
                if blocks[members[0]].weight_bytes == weight:
                    self._add(len(members) * streams + _total(list(resident.values())), len(members), math.inf)
            lighter = weights[j + 1] if j + 1 < len(weights) else 0
            size_terms.append(streams * ((weight - lighter) * nbytes))
        size = _total(size_terms)
        slots = [size]
        for m in range(2, min(max(self.depths) + 1, count) + 1):
            allocated = self._variable(1.0)
            deep_enough = _total([self.depth[p] for p in self.depths if p >= m - 1])
            self._add(count * allocated + resident_count + count * (1.0 - deep_enough), count + 1.0 - m, math.inf)
            slot = self._variable()
            self._add(slot - size + (1.0 - allocated) * (weights[0] * nbytes), 0.0, math.inf)
            slots.append(slot)

        activations = self._variable()
        held = _Linear()
        for i, (block, modes) in enumerate(zip(blocks, self.modes)):
            before, held = held, self._variable()
            self._add(held - before - _total([modes[mu] * (held_bytes(block, mu) * nbytes) for mu in MODES]), 0.0, 0.0)
            in_use = _total([modes[mu] * (in_use_bytes(block, mu) * nbytes) for mu in MODES])
            returned = self.modes[i - 1]["offload"] * (blocks[i - 1].offloaded_bytes * nbytes) if i >= 1 else 0.0
            self._add(activations - held - in_use - returned, 0.0, math.inf)
        resident_weights = _total(
            [
                variable * (blocks[members[0]].weight_bytes * nbytes)
                for members, resident in zip(self.classes, self.resident)
                for variable in resident.values()
            ]
        )
        self.peak = _total([resident_weights, *slots, activations]) + static * nbytes

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
        for members, counts in zip(self.classes, self.resident):
            for mode, variable in counts.items():
                candidates = [i for i in members if modes[i] == mode]
                # Any of them give the same prediction; evenly spaced ones leave streamed blocks between them.
                many = min(chosen(variable), len(candidates))
                resident.update(candidates[(2 * j + 1) * len(candidates) // (2 * many)] for j in range(many))
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


def _describe_modes(modes: Sequence[str]) -> str:
    """``activations='recompute' on every block``, or ``activations 'keep' on blocks 0-2, 'recompute' on block 3``."""
    if len(set(modes)) == 1:
        return f"activations={modes[0]!r} on every block"
    runs: list[tuple[str, int, int]] = []
    for index, mode in enumerate(modes):
        if runs and runs[-1][0] == mode:
            runs[-1] = (mode, runs[-1][1], index)
        else:
            runs.append((mode, index, index))
    return "activations " + ", ".join(
        f"{mode!r} on block {first}" if first == last else f"{mode!r} on blocks {first}-{last}"
        for mode, first, last in runs
    )


def _plan(profile: Profile, placement: _Placement, budget_bytes: int, knobs: _Knobs) -> Plan:
    """The plan of ``placement``, at the shallowest prefetch that predicts the same where prefetch is not pinned:
    predict depends on it only through whether copies overlap and how many slots there are, and the engine refuses
    (warning) a prefetch deeper than the streamed blocks."""
    prefetch = placement.prefetch
    if knobs.prefetch is None:
        prefetch = min(
            p
            for p in range(prefetch + 1)
            if overlapped(profile, p) == overlapped(profile, prefetch)
            and slot_shape(profile, placement.resident, p) == slot_shape(profile, placement.resident, prefetch)
        )
    prediction = predict(profile, placement.resident, prefetch, placement.modes)
    return Plan.from_prediction(placement.resident, prefetch, placement.modes, budget_bytes, prediction)


def _infeasible(profile: Profile, budget_bytes: int, smallest: Plan, knobs: _Knobs) -> InfeasibleBudget:
    """The error for a budget below the ``smallest`` plan's peak, with that peak's parts and what would get under
    it."""
    minimum = smallest.predicted_peak_bytes
    parts = []
    for name in PEAK_PARTS:
        nbytes = smallest.breakdown[name]
        if name == "slots" and nbytes:
            slots, size = slot_shape(profile, smallest.resident, smallest.prefetch)
            parts.append(f"slots {slots} x {format_bytes(size)}")
        elif nbytes:
            parts.append(f"{name.replace('_', ' ')} {format_bytes(nbytes)}")
    budget_text, minimum_text = format_bytes(budget_bytes), format_bytes(minimum)
    if budget_text == minimum_text:
        budget_text, minimum_text = f"{budget_text} ({budget_bytes} bytes)", f"{minimum_text} ({minimum} bytes)"
    pinned = knobs.pinned()
    message = (
        f"memory_budget={budget_text} cannot hold the model: the least it can run in is {minimum_text}"
        f" ({', '.join(parts) or 'nothing'}) with resident_blocks={len(smallest.resident)},"
        f" prefetch={smallest.prefetch}, {_describe_modes(smallest.activations)}"
        + (f", as pinned by {', '.join(pinned)}" if pinned else "")
        + ". Raise the budget"
        + (", unpin those knobs" if pinned else "")
        + ", or lower the tokens per micro-batch."
    )
    return InfeasibleBudget(message, budget_bytes, minimum, dict(smallest.breakdown))


def solve(
    profile: Profile,
    budget_bytes: int,
    *,
    resident_blocks: Optional[int] = None,
    prefetch: Optional[int] = None,
    activations: Union[str, Sequence[str], None] = None,
    max_prefetch: int = 2,
) -> Plan:
    """The placement with the least predicted step time that fits ``budget_bytes``, and among those the least
    memory.

    Args:
        profile: The measured costs.
        budget_bytes: The device memory the plan may use.
        resident_blocks: If given, exactly this many blocks are resident (the solver picks which).
        prefetch: If given, the prefetch depth; more than there are streamed blocks is allowed (the engine allocates
            a slot per streamed block at most).
        activations: If given, one mode for every block, or one per block.
        max_prefetch: The deepest prefetch the solver considers when ``prefetch`` is not pinned.

    Raises:
        InfeasibleBudget: If no placement the pinned knobs allow fits, with the least one that would.
        ValueError: For knobs the model does not have.
    """
    knobs = _knobs(profile, resident_blocks, prefetch, activations, max_prefetch)
    program = _Program(profile, knobs, max_prefetch)
    found = program.best("time", [("peak", budget_bytes)])
    if found is not None and found.prediction.peak_bytes <= budget_bytes:
        # Every placement that fits is feasible to HiGHS too, so none that fits is faster.
        return _plan(profile, found, budget_bytes, knobs)
    smallest = program.best("peak", [])
    assert smallest is not None, "without a budget some placement always exists"
    if smallest.prediction.peak_bytes > budget_bytes:
        raise _infeasible(profile, budget_bytes, _plan(profile, smallest, smallest.prediction.peak_bytes, knobs), knobs)
    # HiGHS holds a limit to a tolerance relative to its row's size, and took a placement a few bytes over the
    # budget, so none that fits is faster. The fastest that fits is found in two walks:
    # - the peak limit goes below the budget by twice as much as the placement taken went over, until one fits;
    # - that left out any placement with a peak between the limit and the budget, so the least peak among the
    #   placements faster than the one found (HiGHS minimises exactly where it limits loosely) says whether one of
    #   them fits; while one does, it is the one found. Where HiGHS lets in one no faster, the time limit goes below
    #   in the same way.
    bound = budget_bytes
    while found is not None and found.prediction.peak_bytes > budget_bytes:
        bound -= 2 * (found.prediction.peak_bytes - bound)
        found = program.best("time", [("peak", bound)], tie_break=False)
    found = found or smallest
    cap = found.prediction.step_s * (1 - EQUAL)
    while True:
        faster = program.best("peak", [("time", cap)], tie_break=False)
        if faster is None or faster.prediction.peak_bytes > budget_bytes:
            break
        if faster.prediction.step_s < found.prediction.step_s:
            found = faster
            cap = found.prediction.step_s * (1 - EQUAL)
        else:
            cap -= 2 * (faster.prediction.step_s - cap)
    # The tie-break, as in `_Program.best`.
    limits = [("peak", float(budget_bytes)), ("time", found.prediction.step_s * (1 + EQUAL))]
    tied = program.best("peak", limits, tie_break=False)
    if tied is not None and all(tied.figure(name) <= most for name, most in limits):
        found = min(found, tied, key=lambda placement: placement.prediction.peak_bytes)
    return _plan(profile, found, budget_bytes, knobs)


def minimum_plan(
    profile: Profile,
    *,
    resident_blocks: Optional[int] = None,
    prefetch: Optional[int] = None,
    activations: Union[str, Sequence[str], None] = None,
    max_prefetch: int = 2,
) -> Plan:
    """The placement with the least predicted peak under the pinned knobs (as in :func:`solve`), and among those the
    fastest: what :func:`solve` gives at that peak, which is its ``budget_bytes``.

    Raises:
        ValueError: For knobs the model does not have.
    """
    knobs = _knobs(profile, resident_blocks, prefetch, activations, max_prefetch)
    smallest = _Program(profile, knobs, max_prefetch).best("peak", [])
    assert smallest is not None, "without a budget some placement always exists"
    return _plan(profile, smallest, smallest.prediction.peak_bytes, knobs)
