"""The peak's terms of the planner's program (:mod:`.program`): the slots' bytes and the activation peak, as the
program's docstring has them."""

from __future__ import annotations

import math
from typing import Optional

from lightning_superpipe.planning.cost import (
    MODES,
    gradient_bytes_at,
    head_extra_bytes,
    held_bytes,
    in_use_bytes,
    late_trunk_gradient_bytes,
    leaving_bytes,
)
from lightning_superpipe.planning.profile import BlockCosts, Profile
from lightning_superpipe.planning.terms import _Linear, _total


class _PeakTerms:
    """A mixin of :class:`.program._Program`: the rows and variables of the peak. It uses the program's variables
    (``modes``, ``classes``, ``resident``, ``depths``, ``depth``) and its ``_variable`` and ``_add``."""

    profile: Profile
    _blocks: list[BlockCosts]
    _nbytes: float
    modes: list[dict[str, _Linear]]
    classes: list[list[int]]
    resident: list[_Linear]
    depths: list[int]
    depth: dict[int, _Linear]
    _resident_count: _Linear

    def _variable(self, upper: float = math.inf, lower: float = 0.0) -> _Linear:
        raise NotImplementedError

    def _add(self, expression: _Linear, lower: float, upper: float) -> None:
        raise NotImplementedError

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
