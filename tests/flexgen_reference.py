"""FlexGen's own linear program and policy search, reproduced to check the cost model of
:mod:`lightning_superpipe.generation.policy` against FlexGen's published predictions.

:func:`flexgen_lp` is ``flexgen/opt_config``'s ``solve_lp`` (same terms and constants) with placement fractions of
weights, cache and activations on GPU/CPU/disk, and :func:`flexgen_search` its search over GPU batch size and count.
They reproduce FlexGen's published predictions (OPT-30B on a T4: 48 x 3 at its published placement predicts 7.14
tokens/s; its search finds 32 x 5 at 7.09). Only the tests use them, so they live here rather than in the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

GB = 1 << 30  # FlexGen's GB
T = 1e12

@dataclass
class FlexGenConfig:
    """FlexGen's ``OptModelConfig``: the model, the run and T4 hardware constants fitted by FlexGen (defaults)."""

    s: int = 512  # prompt length
    n: int = 32  # new tokens
    l: int = 48  # layers  # noqa: E741 (FlexGen's names)
    h1: int = 7168  # hidden size
    h2: int = 28672  # MLP size
    nh: int = 56  # heads
    gmem: float = 16 * GB  # its command line's --gpu-mem 16 --cpu-mem 200 --nvme-mem 1500 for OPT-30B on a T4
    cmem: float = 200 * GB
    nmem: float = 1500 * GB
    alpha: float = 0.8  # FlexGen's relaxation of every memory bound (its examples use 1.2 for a fixed policy)
    ctog_bdw: float = 12.89 * GB
    gtoc_bdw_cache: float = 0.97 * GB
    gtoc_bdw_hidden: float = 4.82 * GB
    dtoc_bdw: float = 0.473 * GB
    ctod_bdw_cache_p: float = 0.746 * GB
    ctod_bdw_hidden_p: float = 2.015 * GB
    ctod_bdw_g: float = 2.015 * GB
    mm_flops_p: float = 21.24 * T
    mm_flops_g: float = 4.3 * T
    bmm_flops_p: float = 9.97 * T
    bmm_flops_g: float = 0.079 * T
    cpu_flops: float = 0.0123 * T
    c1: float = 0.0168
    c2: float = 0.0328
    c3: float = 0.0621


@dataclass
class FlexGenSolution:
    """One solved FlexGen LP: ``placement`` maps ``wg, wc, wn, cg, cc, cn, hg, hc, hn`` to fractions."""

    feasible: bool
    gpu_batch_size: int
    num_gpu_batches: int
    tokens_per_s: float = 0.0
    t_prefill: float = 0.0  # per layer
    t_decode: float = 0.0  # per layer
    placement: dict[str, float] = field(default_factory=dict)


_PLACEMENT = ("wg", "wc", "wn", "cg", "cc", "cn", "hg", "hc", "hn")


def flexgen_lp(
    config: FlexGenConfig,
    block_batch: int,
    gpu_batch: int,
    compress_weights: bool = False,
    placement: Optional[dict[str, float]] = None,
) -> FlexGenSolution:
    """FlexGen's linear program for ``block_batch = gpu_batch * count`` sequences (its ``solve_lp``).

    Args:
        config: Model, run and hardware constants.
        block_batch: The effective batch (``bls``).
        gpu_batch: The GPU batch (``gbs``); must divide ``block_batch``.
        compress_weights: FlexGen's ``compress_w`` (a quarter of the weight bytes, as its code counts them).
        placement: Fix some or all of the nine fractions (e.g. a published policy) instead of optimising them.

    Returns:
        The solution; ``feasible`` is ``False`` when no placement fits the memory of every tier.
    """
    if not (block_batch > 0 and gpu_batch > 0 and block_batch % gpu_batch == 0):
        raise ValueError(f"flexgen_lp(block_batch={block_batch}, gpu_batch={gpu_batch}): need gpu_batch | block_batch")
    wi = 8 * config.h1**2 + 4 * config.h1 * config.h2
    if compress_weights:
        wi = wi / 4
    lp = _Rows()
    lp.add(lp.row(wg=1, wc=1, wn=1), 1, 1)
    lp.add(lp.row(cg=1, cc=1, cn=1), 1, 1)
    lp.add(lp.row(hg=1, hc=1, hn=1), 1, 1)
    lp.add(lp.row(hn=1), 0, 0)  # FlexGen's runtime keeps no activations on disk
    _time_rows(lp, config, wi, block_batch, gpu_batch)
    _memory_rows(lp, config, wi, block_batch, gpu_batch)
    index, l, n, bls = lp.index, config.l, config.n, block_batch  # noqa: E741
    lo_bounds = np.zeros(len(_NAMES))
    hi_bounds = np.array([1.0] * len(_PLACEMENT) + [np.inf, np.inf])
    for name, value in (placement or {}).items():
        lo_bounds[index[name]] = hi_bounds[index[name]] = value
    objective = lp.row(Tpre=l / bls, Tgen=(n - 1) * l / bls)
    result = milp(objective, constraints=LinearConstraint(np.array(lp.rows), lp.lower, lp.upper),
                  bounds=Bounds(lo_bounds, hi_bounds))
    solution = FlexGenSolution(result.status == 0, gpu_batch, bls // gpu_batch)
    if result.status != 0:
        return solution
    x = result.x
    total = x[index["Tpre"]] * l + x[index["Tgen"]] * (n - 1) * l
    solution.tokens_per_s = float(bls * n / total)
    solution.t_prefill, solution.t_decode = float(x[index["Tpre"]]), float(x[index["Tgen"]])
    solution.placement = {name: float(x[index[name]]) for name in _PLACEMENT}
    return solution


_NAMES = list(_PLACEMENT) + ["Tpre", "Tgen"]


class _Rows:
    """The LP's constraint rows over the nine fractions and the two per-layer times."""

    def __init__(self) -> None:
        self.index = {name: i for i, name in enumerate(_NAMES)}
        self.rows: list[np.ndarray] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def row(self, **coefficients: float) -> np.ndarray:
        out = np.zeros(len(_NAMES))
        for name, value in coefficients.items():
            out[self.index[name]] += value
        return out

    def add(self, vector: np.ndarray, lo: float, hi: float) -> None:
        self.rows.append(vector)
        self.lower.append(lo)
        self.upper.append(hi)


def _time_rows(lp: _Rows, c: FlexGenConfig, wi: float, bls: int, gbs: int) -> None:
    """The per-layer prefill and decode times, linear in the placement."""
    s, n, h1, h2 = c.s, c.n, c.h1, c.h2
    row, add = lp.row, lp.add
    # Prefill per layer, linear in the placement: ctog, gtoc, dtoc, ctod, compute.
    hidden_p = 2 * s * h1 * bls
    ctogp = row(wc=wi / c.ctog_bdw, wn=wi / c.ctog_bdw, hc=hidden_p / c.ctog_bdw, hn=hidden_p / c.ctog_bdw)
    gtocp = row(cc=4 * (s + 1) * h1 * bls / c.gtoc_bdw_cache, cn=4 * (s + 1) * h1 * bls / c.gtoc_bdw_cache,
                hc=2 * s * h1 * bls / c.gtoc_bdw_hidden, hn=2 * s * h1 * bls / c.gtoc_bdw_hidden)
    dtocp = row(wn=wi / c.dtoc_bdw, hn=2 * s * h1 * bls / c.dtoc_bdw)
    ctodp = row(cn=4 * bls * (s + 1) * h1 / c.ctod_bdw_cache_p, hn=2 * s * h1 * bls / c.ctod_bdw_hidden_p)
    compp = bls * (8 * s * h1**2 + 4 * s * h1 * h2) / c.mm_flops_p + 4 * bls * s**2 * h1 / c.bmm_flops_p
    # T_prefill = max(in, out, compute) with in = ctog + dtoc and out = gtoc + ctod.
    add(row(Tpre=1) - ctogp - dtocp, 0, np.inf)
    add(row(Tpre=1) - gtocp - ctodp, 0, np.inf)
    add(row(Tpre=1), compp, np.inf)
    # Decode per layer: T_decode = ctog + max(gtoc, dtoc, ctod, compute).
    ctogg = row(wc=wi / c.ctog_bdw, wn=wi / c.ctog_bdw, hc=2 * h1 * bls / c.ctog_bdw, hn=2 * h1 * bls / c.ctog_bdw)
    gtocg = row(hc=2 * h1 * bls / c.gtoc_bdw_hidden, hn=2 * h1 * bls / c.gtoc_bdw_hidden)
    dtocg = row(cn=4 * bls * (s + n / 2) * h1 / c.dtoc_bdw, hn=2 * h1 * bls / c.dtoc_bdw, wn=wi / (c.dtoc_bdw * 0.95))
    ctodg = row(cn=4 * bls * h1 / c.ctod_bdw_g, hn=2 * h1 * bls / c.ctod_bdw_g)
    small_batch = max(0.0, math.log2(64 / gbs))
    small_hidden = max(0.0, math.log2(4096 / h1))
    cpu_flops = max(0.1, 1 + c.c1 * small_batch * small_hidden - c.c2 * small_batch - c.c3 * small_hidden) * c.cpu_flops
    attention = 4 * bls * (s + n / 2) * h1
    compg = row(cg=attention / c.bmm_flops_g, cc=attention / cpu_flops, cn=attention / cpu_flops)
    compg_const = bls * (8 * h1**2 + 4 * h1 * h2) / c.mm_flops_g
    for term, const in ((gtocg, 0.0), (dtocg, 0.0), (ctodg, 0.0), (compg, compg_const)):
        add(row(Tgen=1) - ctogg - term, const, np.inf)


def _memory_rows(lp: _Rows, c: FlexGenConfig, wi: float, bls: int, gbs: int) -> None:
    """GPU, CPU and disk memory (FlexGen's ``alpha`` relaxing every bound)."""
    s, n, l, h1, h2, nh = c.s, c.n, c.l, c.h1, c.h2, c.nh  # noqa: E741
    gmem, cmem, nmem = c.gmem * c.alpha, c.cmem * c.alpha, c.nmem * c.alpha
    row, add = lp.row, lp.add
    # GPU memory, prefill and decode (with FlexGen's double buffer for streamed weights).
    interp = (8 * gbs * s * h1 + gbs * (2 * s * h1 + 2 * nh * s**2) + gbs * 2 * s * h1 + 4 * gbs * s * h1
              + 2 * gbs * s * h2 + 2 * gbs * s * h1)
    gpu_p = row(wg=wi * l - 2 * wi, hg=2 * s * h1 * bls - 2 * s * h1 * gbs, cg=4 * (s + n) * h1 * bls * l)
    add(gpu_p, -np.inf, gmem - (2 * wi + 2 * s * h1 * gbs + interp))
    interg_const = 8 * gbs * h1 + 4 * gbs * h1 + 2 * gbs * h2 + 2 * gbs * h1
    interg_cg = gbs * (2 * h1 + 2 * (s + n) * h1 + 2 * nh * (s + n)) + gbs * (2 * (s + n) * h1 + 2 * h1)
    gpu_g = row(wg=wi * l - 2 * wi, hg=2 * h1 * bls - 2 * h1 * gbs,
                cg=4 * (s + n) * h1 * bls * l + 4 * gbs * (s + n) * h1 + interg_cg)
    add(gpu_g, -np.inf, gmem - (2 * wi + 2 * h1 * gbs + interg_const))
    # CPU memory, prefill and decode.
    cpu_p = row(wc=wi * l, hc=2 * s * h1 * bls, cc=4 * s * h1 * bls * l, wg=-wi, hg=-2 * s * h1 * gbs)
    add(cpu_p, -np.inf, cmem - (wi + 2 * s * h1 * gbs))
    cpu_g = row(wc=wi * l, hc=2 * h1 * bls, cc=4 * (s + n) * h1 * bls * l, wn=wi, hn=4 * h1 * gbs,
                cn=8 * (s + n) * h1 * gbs)
    add(cpu_g, -np.inf, cmem - (2 * nh * (s + n) * gbs + 2 * h1 * gbs))
    # Disk.
    add(row(wn=wi * l, hn=2 * s * h1 * bls, cn=4 * (s + n) * h1 * bls * l), -np.inf, nmem)


def flexgen_search(config: FlexGenConfig, compress_weights: bool = False) -> FlexGenSolution:
    """FlexGen's policy search (its ``solve``): GPU batch 1..4 then doubling; for each the largest feasible count by
    doubling and bisection; counts tried upwards until throughput drops; the best solution overall."""
    best = FlexGenSolution(False, 0, 0)
    gbs = 1
    while True:
        count = 1
        while flexgen_lp(config, gbs * count, gbs, compress_weights).feasible:
            count *= 2
        left, right = max(count // 2, 1), count
        while left < right:
            mid = (left + right) // 2
            if flexgen_lp(config, gbs * mid, gbs, compress_weights).feasible:
                left = mid + 1
            else:
                right = mid
        upper = left - 1
        if upper == 0:
            break
        previous = 0.0
        for count in range(1, upper + 1):
            found = flexgen_lp(config, gbs * count, gbs, compress_weights)
            if found.tokens_per_s < previous:
                break
            previous = found.tokens_per_s
            if found.tokens_per_s > best.tokens_per_s:
                best = found
        gbs = gbs + 1 if gbs < 4 else gbs * 2
    return best



__all__ = ["FlexGenConfig", "FlexGenSolution", "flexgen_lp", "flexgen_search"]
