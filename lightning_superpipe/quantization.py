"""The project's one group-wise quantizer: the MoE pages' 8-bit codes stored as bit planes, and the 4-bit packed form
of generation's compression (FlexGen's scheme: :func:`quantize_groupwise` with ``bits=4`` and :func:`pack_nibbles`).

A weight matrix ``[rows, cols]`` is cut into groups of ``group_size`` consecutive columns of one
row; each group gets its own ``scale`` and ``minimum`` so that
``w ~= minimum + scale * q`` with an 8-bit code ``q`` in ``[0, 255]``.

The codes are stored as eight *bit planes*: plane ``k`` holds bit ``7 - k`` (plane 0 is the most
significant bit) of every code, packed eight weights per byte. Keeping only the first ``b`` planes
keeps the top ``b`` bits of every code, i.e. which of ``2**b`` buckets of ``2**(8-b)`` codes the
weight falls in; :func:`dequantize` rebuilds such a weight at the middle of its bucket, which is
about as accurate as quantizing to ``b`` bits directly and much better than truncating. Putting
the lower planes back restores the 8-bit code exactly (``(hi << s) | lo``).

:func:`quantize_pageable` chooses the 8-bit codes *for* their truncations (nested codes in the
spirit of any-precision quantization): with a calibration Hessian, GPTQ's error feedback runs at
every width at once and each weight's 8-bit code is the one whose prefixes best fit all the
widths' error-compensated weights, so that every prefix is an error-compensated code of its own
width; and each width gets its own scale and minimum (the Hessian-weighted least-squares fit to
that width's codes, in place of the bucket middle). The rebuild is still :func:`dequantize`, with
the width's own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "CODE_BITS",
    "GroupCodes",
    "PageableCodes",
    "default_width_weights",
    "dequantize",
    "dequantize_nibbles",
    "pack_bit_planes",
    "pack_nibbles",
    "quantize_groupwise",
    "quantize_pageable",
    "unpack_codes",
    "unpack_nibbles",
]

CODE_BITS = 8
"""Bits of the full code; ``dequantize`` with all planes rebuilds exactly this precision."""

_FLOAT16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class GroupCodes:
    """Result of :func:`quantize_groupwise`.

    Args:
        codes: ``uint8`` codes, same shape as the weight.
        scale: Step between neighbouring codes, ``[*leading, rows, cols // group_size]``.
        minimum: Value of code 0, same shape as ``scale``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


def _check_group_size(cols: int, group_size: int) -> None:
    if group_size <= 0 or cols % group_size:
        raise ValueError(
            f"group_size={group_size} must be a positive divisor of the input dimension {cols}; "
            f"pick one that divides it (e.g. {_largest_divisor(cols, 128)})."
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def metadata_dtype(weight: torch.Tensor) -> torch.dtype:
    """Pick the dtype of the per-group scale and minimum for ``weight``.

    float16 halves the metadata bytes and keeps ~3 decimal digits, plenty next to 8-bit codes; it is
    only abandoned for weights outside its range.

    Args:
        weight: The weights that will be quantized.

    Returns:
        ``torch.float16`` or, if some weight is too large for it, ``torch.float32``.
    """
    low, high = torch.aminmax(weight.detach())  # a reduction: no weight-sized temporary
    return torch.float16 if max(-low.item(), high.item()) < _FLOAT16_MAX / 2 else torch.float32


def quantize_groupwise(
    weight: torch.Tensor, group_size: int, meta_dtype: torch.dtype = torch.float16, bits: int = CODE_BITS
) -> GroupCodes:
    """Quantize ``weight`` group-wise to asymmetric 8-bit codes.

    The codes are computed against the *stored* (rounded) scale and minimum so that dequantizing
    with the stored metadata is consistent.

    Args:
        weight: ``[..., cols]`` floating-point weights; groups run along the last dimension.
        group_size: Columns per group; must divide ``cols``.
        meta_dtype: dtype in which scale and minimum are stored.
        bits: Bits per code, 1 to 8 (8: the bit-plane codes; 4: FlexGen's scheme, see :func:`pack_nibbles`).

    Returns:
        The codes and per-group metadata.
    """
    if not 1 <= bits <= CODE_BITS:
        raise ValueError(f"quantize_groupwise(bits={bits}) must be 1 to {CODE_BITS}.")
    cols = weight.shape[-1]
    _check_group_size(cols, group_size)
    grouped = weight.detach().float().reshape(*weight.shape[:-1], cols // group_size, group_size)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scale = ((high - low) / (2**bits - 1)).to(meta_dtype)
    minimum = low.to(meta_dtype)
    # A constant group (or one whose range underflows the metadata dtype) gets scale 0 and codes 0:
    # every level then rebuilds it as its minimum, with no midpoint offset.
    step = scale.float().unsqueeze(-1)
    codes = torch.round((grouped - minimum.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0))
    codes = codes.clamp_(0, 2**bits - 1).to(torch.uint8).reshape(weight.shape)
    return GroupCodes(codes=codes, scale=scale, minimum=minimum)


@dataclass(frozen=True)
class PageableCodes:
    """Result of :func:`quantize_pageable`.

    Args:
        codes: ``uint8`` 8-bit codes, same shape as the weight; width ``b`` uses their top ``b`` bits.
        scale: Per width, ``[len(widths), *leading, rows, groups]``: the scale :func:`dequantize` takes
            with the top ``widths[i]`` planes (in 8-bit code units, as for the bucket middle).
        minimum: Same shape as ``scale``.
        widths: The code widths, ascending, ending at 8.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    widths: tuple[int, ...]


def quantize_pageable(
    weight: torch.Tensor,
    group_size: int,
    widths: tuple[int, ...] | list[int],
    meta_dtype: torch.dtype = torch.float16,
    hessian: torch.Tensor | None = None,
    *,
    damp: float = 0.01,
    width_weights: dict[int, float] | None = None,
    passes: int = 1,
) -> PageableCodes:
    """8-bit group-wise codes whose top-``b``-bit prefixes are good ``b``-bit codes, with metadata per width.

    The 8-bit grid is :func:`quantize_groupwise`'s (min-max). Without ``hessian`` the codes and the
    metadata of every width are exactly its own (rounding to the nearest 8-bit code also puts each
    weight in the nearest bucket of every width, rebuilt at the bucket middle). With it, GPTQ runs
    at every width at once: each width keeps its own copy of the weights into which its rounding
    errors are fed back (column by column, through the inverse Hessian's Cholesky factor), and each
    column's 8-bit code is the one whose prefixes are closest to all those copies (weighted by
    ``width_weights``); a prefix is a width's code, so the codes nest by construction. Then, for
    every width below 8, the scale and minimum of each group are refitted to that width's codes: the
    least-squares fit of ``minimum + scale * code`` to the weights, weighted by ``hessian`` (jointly
    over a row's groups), shrunk towards the bucket middle where the fit is undetermined. (Without a
    Hessian such a fit lowers the plain weight error but, pulling the outer buckets of peaked groups
    inwards, doubled the benchmark's KL: it is not done.)

    Args:
        weight: ``[*leading, rows, cols]`` weights; groups run along the last dimension.
        group_size: Columns per group; must divide ``cols``.
        widths: Code widths to optimise for (bit counts 1 to 8); 8 is always added.
        meta_dtype: dtype of the scales and minima.
        hessian: ``[*leading, cols, cols]`` second moments of the inputs (``X^T X``), or ``None``.
        damp: GPTQ's dampening, as a fraction of the mean Hessian diagonal.
        width_weights: Weight of each width's error in the choice of the codes (default:
            :func:`default_width_weights`).
        passes: Rounds of (codes, then refitted metadata) with a Hessian; from the second on the
            codes are chosen on the refitted grids (on the benchmark a second round did not help).

    Returns:
        The codes and the metadata of every width.
    """
    widths = tuple(sorted({*widths, CODE_BITS}))
    if widths[0] < 1:
        raise ValueError(f"quantize_pageable(widths={widths}) needs bit counts from 1 to {CODE_BITS}")
    base = quantize_groupwise(weight, group_size, meta_dtype)
    w = weight.detach().float()
    codes = base.codes
    # Per width, the stored scale and minimum, and the affine map of its codes they give (value =
    # low + step * code, the fold :func:`dequantize` makes); first the bucket middles.
    stored = [(base.scale, base.minimum) for _ in widths]
    grids = [_width_grid(*meta, CODE_BITS - width) for meta, width in zip(stored, widths)]
    h_inv = None if hessian is None else _inverse_cholesky(hessian.to(w.device), damp)
    weights = width_weights if width_weights is not None else default_width_weights(widths)
    weight_hessian = None if hessian is None else w @ hessian.to(w.device).float()
    refitted = [i for i, width in enumerate(widths) if width != CODE_BITS]  # the 8-bit grid stays min-max
    shifts = [CODE_BITS - widths[i] for i in refitted]
    for _ in range(passes if hessian is not None else 0):
        codes = _nested_gptq(w, h_inv, grids, widths, [float(weights.get(b, 0.0)) for b in widths], group_size)
        if not refitted:
            continue
        lows = torch.stack([grids[i][0] for i in refitted])
        steps = torch.stack([grids[i][1] for i in refitted])
        lows, steps = _refit(w, codes, shifts, lows, steps, group_size, hessian, weight_hessian=weight_hessian)
        for i, shift, low, step in zip(refitted, shifts, lows, steps):
            scale = (step / 2**shift).to(meta_dtype)
            minimum = (low - scale.float() * ((2**shift - 1) / 2)).to(meta_dtype)
            stored[i] = (scale, minimum)
            grids[i] = _width_grid(scale, minimum, shift)
    scales = [meta[0] for meta in stored]
    minima = [meta[1] for meta in stored]
    return PageableCodes(codes=codes, scale=torch.stack(scales), minimum=torch.stack(minima), widths=widths)


def default_width_weights(widths: tuple[int, ...] | list[int]) -> dict[int, float]:
    """Weight of each width's squared error when :func:`quantize_pageable` chooses the codes.

    ``4**b`` below 8 bits: every width counts alike relative to its own rounding error (which falls
    about 4x per bit). The 8-bit width counts as if it had 7 bits: weighing its own (tiny) rounding
    error fully would pin every coarser width to the bucket the weight itself falls in (no error
    feedback left), while ignoring it would let the 8-bit code drift far from the weight. On the
    benchmark's model (3 seeds, at 22% and 28% of the 16-bit bytes) ``4**7`` gave the lowest
    worst-seed ratio of the planner's KL to GPTQ's among ``4**8``, ``4**7``, 4000 and 1000.
    """
    return {b: 4.0 ** min(b, CODE_BITS - 1) for b in widths}


def _width_grid(scale: torch.Tensor, minimum: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, step)`` of a width with ``8 - shift`` bits: its code ``k`` rebuilds as ``low + step * k``."""
    step = scale.float()
    return minimum.float() + step * ((2**shift - 1) / 2), step * float(2**shift)


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the inverse of the dampened Hessian (GPTQ's), batched, float32.

    With ``J`` the reversal of the order of the columns, ``J H J = L L^T`` gives ``H^-1 = U^T U`` for
    ``U = J L^-1 J``, upper triangular with a positive diagonal: the factor. One factorisation and one triangular
    solve, where inverting ``H`` and factorising the inverse take three (and the batched inverse took seconds on
    two busy CPU cores).
    """
    h = hessian.float().clone()
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    dead = diagonal == 0
    diagonal.add_(dead.float())  # a column no input reaches: any rounding is as good (GPTQ sets 1)
    diagonal.add_(damp * diagonal.mean(dim=-1, keepdim=True))
    lower = torch.linalg.cholesky(h.flip(-2, -1))
    identity = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device).expand_as(h)
    return torch.linalg.solve_triangular(lower, identity, upper=False).flip(-2, -1)


GPTQ_BLOCK_COLUMNS = 32
"""Columns per block of :func:`quantize_pageable`'s error feedback (GPTQ's lazy batch): each column's error goes to
the rest of its block at once, and a block's errors to the later columns in one matrix product. On one CPU thread
16 to 32 columns were fastest (128, GPTQ's choice on GPUs, took 1.1 to 1.8x as long)."""


SEARCH_WINDOW_CODES = 16
"""How far, in 8-bit codes, from the 8-bit state's own code :class:`_NestedSearch` looks first. At the default
levels' weights a code 16 steps away costs as much in its 8-bit term alone as the largest 4-bit rounding error:
the window is almost never left."""

CODE_BITS_MAX = 2**CODE_BITS - 1


class _NestedSearch:
    """The exact search of :func:`_nested_gptq` for one column: the 8-bit code whose prefixes best fit every width.

    The cost of a code is the weighted sum over widths of its prefix's squared error against that width's state.
    The coarser widths' costs are summed over the buckets ("prefixes") of the finest of them, and within each prefix
    the best 8-bit child is found in closed form: the 8-bit cost is a quadratic in the code, least, over a range of
    codes, at the rounded minimiser clamped into the range. Each candidate is costed with the 256-code search's
    arithmetic; the choice is a reduction over the candidates, the outermost dimension.

    Only the prefixes within :data:`SEARCH_WINDOW_CODES` codes of the 8-bit state's own code are costed (3 of 16 for
    the default levels). Any other prefix costs at least its 8-bit term, which grows with its distance; where that
    bound of the nearest prefix outside the window does not exceed the best cost found for every weight of the
    column, the column is searched over every prefix instead. So the codes are the 256-code search's.
    """

    def __init__(self, widths: tuple[int, ...], weights: list[float], batch_dims: int, device: torch.device) -> None:
        self.coarse = len(widths) - 1
        prefix_bits = widths[-2] if self.coarse else 0
        self.prefixes = 2**prefix_bits
        self.children = 2 ** (CODE_BITS - prefix_bits)
        candidates = (-1, *(1,) * (batch_dims + 1))  # [prefixes, *leading, rows]
        every = torch.arange(self.prefixes, device=device).float().view(candidates)
        reach = -(-SEARCH_WINDOW_CODES // self.children)  # prefixes each side of the state's own
        windowed = weights[-1] > 0 and 2 * reach + 1 < self.prefixes
        self.offsets = torch.arange(-reach, reach + 1, device=device).float().view(candidates) if windowed else None
        self.outside = float(reach + 1)
        self.every_prefix = every
        if self.coarse:  # [*leading, coarse widths, rows] per candidate: a prefix's bucket at each coarse width
            self.coarse_shift = torch.tensor(
                [2.0 ** (width - prefix_bits) for width in widths[:-1]], device=device
            ).view(-1, 1)
            self.coarse_weights = torch.tensor(weights[:-1], device=device).view(-1, 1)
        self.finest_weight = weights[-1]
        # A code's bucket at each width: code / 2**(8 - width), rounded down (exact in float32).
        self.bucket_scale = torch.tensor([2.0 ** (width - CODE_BITS) for width in widths], device=device).view(-1, 1)

    def start_group(self, low: torch.Tensor, step: torch.Tensor) -> None:
        """Take the ``[*leading, widths, rows]`` grids of the next group of columns."""
        self.low, self.step = low, step
        if self.coarse:
            self.every_coarse_value = self._coarse_values(self.every_prefix)
        # A zero step (a constant group) or weight: every child costs alike, and a target of 0 takes the first.
        finest_step = step[..., -1, :] if self.finest_weight > 0 else torch.zeros_like(step[..., -1, :])
        self.divisor = torch.where(finest_step != 0, finest_step, float("inf"))

    def _coarse_values(self, prefixes: torch.Tensor) -> torch.Tensor:
        """Every coarse width's value of ``[candidates, *leading, rows]`` prefixes (float, whole numbers)."""
        buckets = (prefixes.unsqueeze(-2) * self.coarse_shift).floor_()  # [candidates, *leading, coarse, rows]
        return self.low[..., : self.coarse, :] + self.step[..., : self.coarse, :] * buckets

    def _children(self, prefixes: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The 8-bit code nearest ``target`` among each prefix's children."""
        first = prefixes * self.children
        return torch.clamp(target, min=first, max=first + (self.children - 1))

    def _finest_cost(self, child: torch.Tensor) -> torch.Tensor:
        finest, low, step = self.state[..., -1, :], self.low[..., -1, :], self.step[..., -1, :]
        return (finest - (low + step * child)).square_().mul_(self.finest_weight)

    def _least(self, prefixes: torch.Tensor, coarse_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The least-cost code of the candidate ``prefixes`` and its cost."""
        child = self._children(prefixes, self.target)  # [candidates, *leading, rows]
        cost = self._finest_cost(child)
        if coarse_values is not None:
            coarse = (self.state[..., : self.coarse, :] - coarse_values).square_().mul_(self.coarse_weights)
            total = coarse[..., 0, :]
            for finer in range(1, self.coarse):  # coarsest first: the order in which the 256-code search adds them
                total = coarse[..., finer, :] + total
            cost += total
        # The least-cost child, the first (smallest) of equal ones as argmin would take: faster than argmin on a CPU.
        least = cost.amin(dim=0)
        return torch.where(cost == least, child, float("inf")).amin(dim=0), least

    def codes(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best 8-bit codes (as floats) of ``[*leading, widths, rows]`` states, and every width's value of them."""
        self.state = state
        self.target = ((state[..., -1, :] - self.low[..., -1, :]) / self.divisor).round_()
        best = self._windowed() if self.offsets is not None else None
        if best is None:
            best, _ = self._least(self.every_prefix, self.every_coarse_value if self.coarse else None)
        return best, self.low + self.step * (best.unsqueeze(-2) * self.bucket_scale).floor_()

    def _windowed(self) -> torch.Tensor | None:
        """The best codes found among the prefixes near the 8-bit target's, or ``None`` where another might win."""
        own = torch.clamp(self.target, 0, CODE_BITS_MAX).div_(self.children).floor_()
        prefixes = (own + self.offsets).clamp_(0, self.prefixes - 1)
        best, least = self._least(prefixes, self._coarse_values(prefixes) if self.coarse else None)
        for side in (-self.outside, self.outside):
            beyond = own + side
            bound = self._finest_cost(self._children(beyond.clamp(0, self.prefixes - 1), self.target))
            unreachable = (beyond < 0) | (beyond >= self.prefixes)
            if not bool(((bound > least) | unreachable).all()):
                return None
        return best


def _nested_gptq(
    w: torch.Tensor,
    h_inv: torch.Tensor,
    grids: list[tuple[torch.Tensor, torch.Tensor]],
    widths: tuple[int, ...],
    weights: list[float],
    group_size: int,
    block_columns: int = GPTQ_BLOCK_COLUMNS,
) -> torch.Tensor:
    """Nested 8-bit codes by GPTQ run at every width at once.

    Each width keeps its own error-compensated copy of the weights. Column by column, the 8-bit code
    is the one minimising the weighted sum over widths of the squared error of its prefix against
    that width's copy (an exact search, :class:`_NestedSearch`); each width's rounding error is then
    spread over its copy's later columns through the inverse Hessian's Cholesky factor: over the
    column's block at once, and from a finished block to the later columns in one matrix product
    (GPTQ's lazy batch update, the same sums in another order). The widths and any leading (expert)
    dimensions are batched: one pass over the columns for all of them.
    """
    *leading, rows, cols = w.shape
    count = len(widths)
    # Columns first, then widths ([*leading, cols, widths, rows]): a column of every width is contiguous, and so is
    # a block of columns, which one matrix product updates for every width.
    states = w.mT.unsqueeze(-2).expand(*leading, cols, count, rows).contiguous()
    lows = torch.stack([low for low, _ in grids], dim=-3).movedim(-1, -3).contiguous()  # [*leading, groups, W, rows]
    steps = torch.stack([step for _, step in grids], dim=-3).movedim(-1, -3).contiguous()
    search = _NestedSearch(widths, weights, len(leading), w.device)
    codes = torch.empty(*leading, cols, rows, dtype=torch.uint8, device=w.device)
    # The same, as [matrices, cols, widths * rows] and [matrices, cols, cols], for the in-place block products.
    flat_states, flat_h_inv = states.view(-1, cols, count * rows), h_inv.reshape(-1, cols, cols)
    for start in range(0, cols, block_columns):
        end = min(start + block_columns, cols)
        errors = torch.empty(*leading, end - start, count, rows, device=w.device)
        for column in range(start, end):
            if column % group_size == 0:
                search.start_group(lows[..., column // group_size, :, :], steps[..., column // group_size, :, :])
            state = states[..., column, :, :]
            best, chosen = search.codes(state)
            codes[..., column, :] = best
            error = errors[..., column - start, :, :]
            torch.div(state - chosen, h_inv[..., column, column, None, None], out=error)
            if column + 1 < end:  # the rest of the block now; later blocks after it
                row = h_inv[..., column, column + 1 : end, None, None]
                states[..., column + 1 : end, :, :] -= row * error.unsqueeze(-3)  # as the per-column loop rounds
        if end < cols:
            errors = errors.view(-1, end - start, count * rows)
            flat_states[:, end:, :].baddbmm_(flat_h_inv[:, start:end, end:].mT, errors, alpha=-1)
    return codes.mT.contiguous()


def _refit(
    w: torch.Tensor,
    codes: torch.Tensor,
    shifts: list[int],
    low: torch.Tensor,
    step: torch.Tensor,
    group_size: int,
    hessian: torch.Tensor,
    ridge: float = 1e-4,
    chunk_elements: int = 1 << 20,
    weight_hessian: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per width and group ``(low, step)`` minimising ``e^T H e`` per row, ``e = w - low - step * top``, where
    ``top = codes >> shift`` are the width's codes.

    The groups of a row are fitted jointly (a ``2G x 2G`` system per row, ``G`` groups), since
    error-compensated codes make errors that cancel across groups; building the systems costs
    ``rows * cols**2`` per width (like one GPTQ pass), done in chunks of rows of ``chunk_elements`` products
    (8 MiB, which stay in cache). The fit is shrunk towards the given ``(low, step)``
    (``[widths, *leading, rows, G]``) by a small ridge, which decides it where it is undetermined (a group whose
    codes are all equal). The widths are fitted together, sharing ``w @ H`` (``weight_hessian``, if
    the caller has it); leading (expert) dimensions one matrix at a time, for the same reason as the chunks (on
    a CPU all experts at once took 2-3x as long).
    """
    if w.dim() > 2:
        fits = [
            _refit(
                w[i],
                codes[i],
                shifts,
                low[:, i],
                step[:, i],
                group_size,
                hessian[i],
                ridge,
                chunk_elements,
                None if weight_hessian is None else weight_hessian[i],
            )
            for i in range(w.shape[0])
        ]
        return torch.stack([fit[0] for fit in fits], dim=1), torch.stack([fit[1] for fit in fits], dim=1)
    rows, cols = w.shape
    groups = cols // group_size
    # The sums in float32 (codes are small integers, exact; the fit's metadata is stored in 16 bits), the systems
    # solved in float64.
    code = torch.stack([codes >> shift for shift in shifts]).float().unflatten(-1, (groups, group_size))
    low0, step0 = low.double(), step.double()  # [W, rows, G]; code: [W, rows, G, gs]
    h = hessian.float()
    ones = h.unflatten(-1, (groups, group_size)).sum(dim=-1).unflatten(-2, (groups, group_size))  # H 1_h, [G, gs, G]
    m11 = ones.sum(dim=-2).double()  # 1_g^T H 1_h, [G, G]
    w_h = (w.float() @ h if weight_hessian is None else weight_hessian).unflatten(-1, (groups, group_size))
    rhs_low = w_h.sum(dim=-1).double().expand_as(low0)  # 1_g^T H w, [W, rows, G]; w_h: w_r^T H, [rows, G, gs]
    rhs_steps = (w_h * code).sum(dim=-1).double()  # (k_r 1_g)^T H w_r, [W, rows, G]
    eye = torch.eye(2 * groups, dtype=torch.float64, device=w.device)
    solutions = []
    chunk = max(1, chunk_elements // (len(shifts) * cols * groups))
    by_row_group = h.unflatten(-2, (groups, group_size))  # [G, gs, cols]
    for start in range(0, rows, chunk):
        k = code[:, start : start + chunk]
        m21 = torch.einsum("wrgs,gsh->wrgh", k, ones).double()  # (k_r 1_g)^T H 1_h, [W, r, g, h]
        # P[g, r, c] = (H (k_r * 1_g))_c: H times the codes of group g of row r, one matrix product per group
        # (the rows * cols**2 part), laid out so that the sum below reads it in place.
        p = (k.movedim(-2, -3) @ by_row_group).unflatten(-1, (groups, group_size))  # [W, g, r, h, gs]
        m22 = (p * k.unsqueeze(-4)).sum(dim=-1).movedim(-3, -2).double()  # (k_r 1_g)^T H (k_r 1_h), [W, r, g, h]
        top_rows = torch.cat([m11.expand_as(m22), m21.mT], dim=-1)
        bottom_rows = torch.cat([m21, m22], dim=-1)
        normal = torch.cat([top_rows, bottom_rows], dim=-2)  # [W, r, 2G, 2G]
        prior = torch.cat([low0[:, start : start + chunk], step0[:, start : start + chunk]], dim=-1)
        rhs = torch.cat([rhs_low[:, start : start + chunk], rhs_steps[:, start : start + chunk]], dim=-1)
        shrink = normal.diagonal(dim1=-2, dim2=-1).mean(dim=-1, keepdim=True).clamp_min(1e-30) * ridge
        solutions.append(
            torch.linalg.solve(normal + shrink.unsqueeze(-1) * eye, (rhs + shrink * prior).unsqueeze(-1)).squeeze(-1)
        )
    solution = torch.cat(solutions, dim=-2)
    ok = torch.isfinite(solution).all(dim=-1, keepdim=True)
    fitted_low, fitted_step = solution[..., :groups], solution[..., groups:]
    return torch.where(ok, fitted_low, low0).float(), torch.where(ok, fitted_step, step0).float()


def pack_bit_planes(codes: torch.Tensor) -> torch.Tensor:
    """Split 8-bit codes into packed bit planes.

    Args:
        codes: ``uint8`` tensor ``[*leading, n]`` with ``n`` divisible by 8.

    Returns:
        ``uint8`` tensor ``[*leading, 8, n // 8]``; plane ``k`` holds bit ``7 - k`` of each code and
        byte ``t`` of a plane packs weights ``8t .. 8t+7`` (weight ``8t + m`` in bit ``m``).
    """
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"bit planes pack 8 weights per byte; got {n} weights, not a multiple of 8")
    device = codes.device
    plane_shift = torch.arange(CODE_BITS - 1, -1, -1, dtype=torch.uint8, device=device).view(-1, 1, 1)
    lane_shift = torch.arange(8, dtype=torch.uint8, device=device)
    octets = codes.reshape(*codes.shape[:-1], 1, n // 8, 8)
    bits = (octets >> plane_shift) & 1  # [*leading, 8 planes, n/8, 8 lanes]
    return (bits << lane_shift).sum(dim=-1, dtype=torch.uint8)


_SPREAD: dict[torch.device, torch.Tensor] = {}


def _spread_table(device: torch.device) -> torch.Tensor:
    """``int64 [256]``: byte ``v`` spread over the 8 bytes of a word, byte ``m`` holding bit ``m`` of ``v``."""
    table = _SPREAD.get(device)
    if table is None:
        lanes = torch.arange(8)
        bits = (torch.arange(256).view(-1, 1) >> lanes) & 1
        table = _SPREAD[device] = (bits << (8 * lanes)).sum(dim=-1).to(device)
    return table


def unpack_codes(planes: torch.Tensor) -> torch.Tensor:
    """Join the top ``b`` packed bit planes back into ``b``-bit codes.

    Args:
        planes: ``uint8`` tensor ``[*leading, b, n // 8]`` holding planes ``0 .. b-1``.

    Returns:
        ``uint8`` tensor ``[*leading, n]`` of codes in ``[0, 2**b - 1]`` (the top ``b`` bits of the
        8-bit codes).
    """
    # Each plane byte is looked up as one 64-bit word holding its 8 weights' bits, one per byte
    # (little-endian: byte m is weight 8t + m), and the planes are joined with word-wide shifts:
    # 8 weights per operation instead of one, and no code ever carries into its neighbour (< 256).
    if planes.shape[-2] == 0:
        raise ValueError("unpack_codes needs at least one bit plane")
    table = _spread_table(planes.device)
    code = table[planes.select(-2, 0).long()]
    for k in range(1, planes.shape[-2]):
        code = code.bitwise_left_shift_(1).bitwise_or_(table[planes.select(-2, k).long()])
    if code.dtype != torch.int64 or not code.is_contiguous():
        code = code.to(torch.int64).contiguous()
    # Reinterpreting the words as bytes needs a little-endian host (x86, ARM as configured by torch).
    return code.view(torch.uint8).view(*planes.shape[:-2], planes.shape[-1] * 8)


def dequantize(
    planes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rebuild weights from their top ``b`` bit planes (``b = planes.shape[-2]``).

    With fewer than 8 planes each weight is rebuilt at the middle of its bucket of
    ``2**(8-b)`` codes; with all 8 it is rebuilt exactly at its code. Works on any number of
    leading (batch) dimensions at once: the paged experts rebuild all the pages of one level of a
    layer in one call.

    Args:
        planes: ``uint8`` ``[*leading, b, n // 8]`` top bit planes.
        scale: ``[*leading, rows, groups]`` per-group step.
        minimum: ``[*leading, rows, groups]`` per-group minimum.
        shape: ``[*leading, rows, cols]`` shape of the weights (``rows * cols == n``).
        dtype: dtype of the result.

    Returns:
        The dequantized weights, ``shape``, ``dtype``, on the planes' device.
    """
    bits = planes.shape[-2]
    shift = CODE_BITS - bits
    code = unpack_codes(planes)
    step = scale.float()
    low = minimum.float()
    if shift:
        # Middle of the bucket [hi << s, (hi << s) + 2**s - 1], folded into the per-group affine map
        # (a per-group cost) so that the per-weight work is one multiply-add straight from uint8.
        low = low + step * ((2**shift - 1) / 2)
        step = step * float(2**shift)
    groups = scale.shape[-1]
    grouped = code.view(*scale.shape, shape[-1] // groups)
    weight = torch.addcmul(low.unsqueeze(-1), grouped, step.unsqueeze(-1))
    return weight.view(shape).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte (FlexGen's layout: the even element in the high nibble).

    Args:
        codes: ``uint8`` ``[..., n]`` codes in ``[0, 15]``, ``n`` even.

    Returns:
        ``uint8`` ``[..., n // 2]``.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles packs 2 codes per byte; got {codes.shape[-1]} codes, not an even number")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8`` ``[..., n // 2]`` -> ``uint8`` ``[..., n]``."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nibbles(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rebuild ``minimum + scale * q`` from packed 4-bit codes (groups along the last dimension).

    Args:
        packed: ``uint8`` ``[..., cols // 2]`` from :func:`pack_nibbles`.
        scale: ``[..., cols // group_size]`` per-group step.
        minimum: Same shape as ``scale``.
        dtype: dtype of the result.

    Returns:
        ``[..., cols]`` weights on ``packed``'s device.
    """
    code = unpack_nibbles(packed)
    grouped = code.view(*scale.shape, code.shape[-1] // scale.shape[-1])
    # In the metadata's precision: fp16 on a GPU keeps the rebuild one fused pass (FlexGen rebuilds in fp16).
    work = scale.dtype if scale.device.type == "cuda" else torch.float32
    rebuilt = torch.addcmul(minimum.to(work).unsqueeze(-1), grouped.to(work), scale.to(work).unsqueeze(-1))
    return rebuilt.view(code.shape).to(dtype)
