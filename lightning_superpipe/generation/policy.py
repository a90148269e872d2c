"""The policy of :func:`~lightning_superpipe.generate`: micro-batch size and count, the cache's device fraction and
compression, from FlexGen's cost model solved exactly with ``scipy.optimize.milp``.

Two models live here:

* :func:`flexgen_lp`, FlexGen's own linear program (``flexgen/opt_config``'s ``solve_lp``, same terms and constants)
  with placement fractions of weights, cache and activations on GPU/CPU/disk, and its search over GPU batch size
  and count (:func:`flexgen_search`). It reproduces FlexGen's published predictions (OPT-30B on a T4: 48 x 3 at
  its published placement predicts 7.14 tokens/s; its search finds 32 x 5 at 7.09), which checks the cost model.
* :func:`choose_policy`, the same overlap rule for this package's engine, with FlexGen's placements by whole layers:
  the weights of the first ``w`` blocks resident on the device (the rest streamed every token), the cache of the
  first ``k`` layers resident, and the hidden states on the device or (``h = 1``) in host memory between blocks:
  per layer ``T_prefill = max(in, out, compute)`` and ``T_decode = in + max(out, compute)`` (FlexGen's rule as
  coded) with the streamed shares ``1 - w / L`` and ``1 - k / L``, ``T = L * T_prefill + L * (n - 1) * T_decode``;
  for each micro-batch size and compression choice the integers ``k``, ``w``, the binary ``h`` and the times are
  one small MILP under the device-memory constraint, and the best tokens/s wins. ``h`` is binary as in FlexGen's
  runtime, which keeps all activations on one device (its LP's fractions ``hg, hc`` are relaxed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import nn

from lightning_superpipe.generation.compression import BYTES_PER_ELEMENT
from lightning_superpipe.units import format_bytes

GB = 1 << 30  # FlexGen's GB
T = 1e12


# ================================================================================================ FlexGen's own model


@dataclass
class FlexGenConfig:
    """FlexGen's ``OptModelConfig``: the model, the run and T4 hardware constants fitted by FlexGen (defaults)."""

    s: int = 512  # prompt length
    n: int = 32  # new tokens
    l: int = 48  # layers
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
    c = config
    s, n, l, h1, h2, nh, bls, gbs = c.s, c.n, c.l, c.h1, c.h2, c.nh, block_batch, gpu_batch
    gmem, cmem, nmem = c.gmem * c.alpha, c.cmem * c.alpha, c.nmem * c.alpha
    wi = 8 * h1**2 + 4 * h1 * h2
    if compress_weights:
        wi = wi / 4
    names = list(_PLACEMENT) + ["Tpre", "Tgen"]
    index = {name: i for i, name in enumerate(names)}

    def row(**coefficients: float) -> np.ndarray:
        out = np.zeros(len(names))
        for name, value in coefficients.items():
            out[index[name]] += value
        return out

    rows: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(vector: np.ndarray, lo: float, hi: float) -> None:
        rows.append(vector)
        lower.append(lo)
        upper.append(hi)

    add(row(wg=1, wc=1, wn=1), 1, 1)
    add(row(cg=1, cc=1, cn=1), 1, 1)
    add(row(hg=1, hc=1, hn=1), 1, 1)
    add(row(hn=1), 0, 0)  # FlexGen's runtime keeps no activations on disk
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

    lo_bounds = np.zeros(len(names))
    hi_bounds = np.array([1.0] * len(_PLACEMENT) + [np.inf, np.inf])
    for name, value in (placement or {}).items():
        lo_bounds[index[name]] = hi_bounds[index[name]] = value
    objective = row(Tpre=l / bls, Tgen=(n - 1) * l / bls)
    result = milp(objective, constraints=LinearConstraint(np.array(rows), lower, upper),
                  bounds=Bounds(lo_bounds, hi_bounds))
    solution = FlexGenSolution(result.status == 0, gbs, bls // gbs)
    if result.status != 0:
        return solution
    x = result.x
    total = x[index["Tpre"]] * l + x[index["Tgen"]] * (n - 1) * l
    solution.tokens_per_s = float(bls * n / total)
    solution.t_prefill, solution.t_decode = float(x[index["Tpre"]]), float(x[index["Tgen"]])
    solution.placement = {name: float(x[index[name]]) for name in _PLACEMENT}
    return solution


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


# ================================================================================================ this engine's model


@dataclass
class Hardware:
    """Link and compute constants of the cost model (defaults: FlexGen's fitted T4 figures).

    Attributes:
        h2d_bytes_per_s: Host-to-device bandwidth.
        d2h_bytes_per_s: Device-to-host bandwidth (FlexGen's fitted T4 figure for the cache).
        d2h_hidden_bytes_per_s: Device-to-host bandwidth for hidden states (FlexGen's ``gtoc_bdw_hidden``).
        prefill_flops: Matmul FLOP/s at prefill.
        decode_flops: Matmul FLOP/s at decode.
        attention_prefill_flops: Batched-matmul FLOP/s (attention) at prefill.
        attention_decode_flops: Batched-matmul FLOP/s (attention) at decode.
    """

    h2d_bytes_per_s: float = 12.89 * GB
    d2h_bytes_per_s: float = 0.97 * GB
    d2h_hidden_bytes_per_s: float = 4.82 * GB
    prefill_flops: float = 21.24 * T
    decode_flops: float = 4.3 * T
    attention_prefill_flops: float = 9.97 * T
    attention_decode_flops: float = 0.079 * T


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know of a model (bytes are as stored: the parameters' dtype)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    block_bytes: int  # one block's parameters
    block_params: int
    compressible_fraction: float  # of a block's parameters: the weight matrices 4-bit compression applies to
    trunk_bytes: int  # everything outside the blocks (embeddings, head, norms, buffers)
    mlp: int

    @staticmethod
    def of(model: nn.Module, blocks: list[nn.Module]) -> "ModelShape":
        """Reads the shape of a ``transformers`` causal LM whose decoder layers are ``blocks``."""
        config = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        params = list(blocks[0].parameters())
        block_params = sum(p.numel() for p in params)
        matrices = sum(p.numel() for p in params if p.ndim == 2)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        trunk = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
        trunk += sum(b.numel() * b.element_size() for b in model.buffers())
        return ModelShape(
            layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            vocab=getattr(config, "vocab_size", 0), dtype_bytes=params[0].element_size(),
            block_bytes=sum(p.numel() * p.element_size() for p in params), block_params=block_params,
            compressible_fraction=matrices / max(block_params, 1), trunk_bytes=trunk, mlp=mlp,
        )


@dataclass
class Policy:
    """A chosen policy and what the cost model predicts for it."""

    micro_batch_size: int
    num_micro_batches: int
    cache_device_fraction: float
    compress_weights: bool
    compress_kv: bool
    tokens_per_s: float
    t_prefill: float  # per layer, seconds
    t_decode: float  # per layer, seconds
    device_bytes: float  # the model's estimate of the device peak
    weights_device_fraction: float = 0.0  # resident blocks / layers
    activations_on_host: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_bytes(
    shape: ModelShape, micro_batch: int, batch: int, prompt: int, new_tokens: int, resident_layers: float,
    compress_weights: bool, compress_kv: bool, resident_blocks: float = 0, activations_on_host: bool = False,
) -> float:
    """The engine's device peak as the cost model counts it (prefill/decode maximum).

    Terms: the trunk; the resident blocks' weights (packed when compressed), and two streamed blocks in flight
    unless every block is resident (plus one rebuilt dense block when compressed); the hidden states: on the device
    those of every micro-batch (each thread keeps its own), in host memory those of the running micro-batch (its
    input and output) and the prefetched next one, plus every waiting micro-batch's one-token embedding at decode;
    the resident layers' cache; two micro-batches' streamed cache for one layer (the one in use and the one
    prefetched) plus the layer's output of the one in use; and one micro-batch's working set inside a block
    (attention scores, MLP) with fp32 logits.

    Args:
        shape: The model.
        micro_batch: Rows per micro-batch.
        batch: The effective batch.
        prompt: Prompt length.
        new_tokens: Tokens generated.
        resident_layers: Layers whose cache stays on the device.
        compress_weights: 4-bit weights.
        compress_kv: 4-bit cache.
        resident_blocks: Blocks whose weights stay on the device.
        activations_on_host: Hidden states in host memory between blocks.
    """
    b = shape.dtype_bytes
    length = prompt + new_tokens
    weights = resident_blocks * _block_bytes_moved(shape, compress_weights)
    if resident_blocks < shape.layers:
        weights += 2 * _block_bytes_moved(shape, compress_weights)
    if compress_weights:
        weights += shape.block_bytes
    hidden = _hidden_bytes(shape, micro_batch, batch, prompt, activations_on_host)
    kv_token = 2 * shape.kv_heads * shape.head_dim  # elements per token per layer
    resident = resident_layers * batch * length * kv_token * b
    moved = BYTES_PER_ELEMENT if compress_kv else b
    # Packed in flight, plus (compressed) the rebuilt dense copy, for two micro-batches; and the layer's output.
    streamed = 2 * micro_batch * length * kv_token * (moved + (b if compress_kv else 0))
    streamed += micro_batch * length * kv_token * b
    working = micro_batch * prompt * (4 * shape.hidden + 2 * shape.mlp + 2 * shape.heads * prompt) * b
    working = max(working, micro_batch * shape.vocab * 4 * 2)
    return shape.trunk_bytes + weights + hidden + resident + streamed + working


def _hidden_bytes(shape: ModelShape, micro_batch: int, batch: int, prompt: int, on_host: bool) -> float:
    row = prompt * shape.hidden * shape.dtype_bytes  # one row's hidden states at prefill
    if not on_host:
        return 2 * batch * row
    return 3 * micro_batch * row + batch * shape.hidden * shape.dtype_bytes


def _block_bytes_moved(shape: ModelShape, compress_weights: bool) -> float:
    if not compress_weights:
        return shape.block_bytes
    matrices = shape.block_params * shape.compressible_fraction
    return matrices * BYTES_PER_ELEMENT + (shape.block_params - matrices) * shape.dtype_bytes


def _solve(
    shape: ModelShape, hardware: Hardware, batch: int, micro_batch: int, prompt: int, new_tokens: int,
    budget: float, compress_weights: bool, compress_kv: bool, resident: Optional[int],
    resident_blocks: Optional[int] = None, activations_on_host: Optional[bool] = None,
) -> Optional[Policy]:
    """The MILP for one micro-batch size and compression choice.

    Variables ``x = [k, w, h, z, Tpre, Tgen]``: ``k`` layers' cache and ``w`` blocks' weights resident (integers),
    ``h`` hidden states in host memory (binary), ``z`` every block resident (binary, ``w >= L * z``: no streamed
    block in flight then), and the per-layer times. ``None`` for a fixed choice lets the solver pick it.
    """
    L, n, s = shape.layers, new_tokens, prompt
    b = shape.dtype_bytes
    kv_token = 2 * shape.kv_heads * shape.head_dim
    moved = BYTES_PER_ELEMENT if compress_kv else b
    block_moved = _block_bytes_moved(shape, compress_weights)
    weights_in = block_moved / hardware.h2d_bytes_per_s
    # Per layer, for the streamed fraction (1 - k / L) of the layers.
    cache_out_p = batch * s * kv_token * moved / hardware.d2h_bytes_per_s
    cache_in_g = batch * (s + n / 2) * kv_token * moved / hardware.h2d_bytes_per_s
    cache_out_g = batch * kv_token * moved / hardware.d2h_bytes_per_s
    # Hidden states in host memory: every micro-batch's copied out after a block and back before the next one.
    hidden_p, hidden_g = batch * s * shape.hidden * b, batch * shape.hidden * b
    act_in_p, act_out_p = hidden_p / hardware.h2d_bytes_per_s, hidden_p / hardware.d2h_hidden_bytes_per_s
    act_in_g, act_out_g = hidden_g / hardware.h2d_bytes_per_s, hidden_g / hardware.d2h_hidden_bytes_per_s
    flops_p = 2 * batch * s * shape.block_params
    attention_p = 4 * batch * s * s * shape.heads * shape.head_dim
    compute_p = flops_p / hardware.prefill_flops + attention_p / hardware.attention_prefill_flops
    compute_g = (2 * batch * shape.block_params / hardware.decode_flops
                 + 4 * batch * (s + n / 2) * shape.heads * shape.head_dim / hardware.attention_decode_flops)
    w_in = weights_in / L  # time saved per resident block, per layer-step
    rows = [  # x = [k, w, h, z, Tpre, Tgen]
        [0, w_in, -act_in_p, 0, 1, 0],  # Tpre >= in = weights (1 - w/L) + h * hidden in
        [cache_out_p / L, 0, -act_out_p, 0, 1, 0],  # Tpre >= out = cache out (1 - k/L) + h * hidden out
        [0, 0, 0, 0, 1, 0],  # Tpre >= compute_p
        # Tgen >= in + out, in = weights (1 - w/L) + cache in (1 - k/L) + h * hidden in
        [(cache_in_g + cache_out_g) / L, w_in, -(act_in_g + act_out_g), 0, 0, 1],
        [cache_in_g / L, w_in, -act_in_g, 0, 0, 1],  # Tgen >= in + compute
        [0, 1, 0, -L, 0, 0],  # z = 1 only when every block is resident
    ]
    lower = [
        weights_in, cache_out_p, compute_p, weights_in + cache_in_g + cache_out_g,
        weights_in + cache_in_g + compute_g, 0,
    ]
    upper = [np.inf] * 6
    # Device memory, linear in (k, w, h, z) around the all-streamed, hidden-on-device base.
    base = device_bytes(shape, micro_batch, batch, prompt, new_tokens, 0, compress_weights, compress_kv)
    per_layer = batch * (prompt + new_tokens) * kv_token * b
    hidden_saved = (_hidden_bytes(shape, micro_batch, batch, prompt, False)
                    - _hidden_bytes(shape, micro_batch, batch, prompt, True))
    rows.append([per_layer, block_moved, -hidden_saved, -2 * block_moved, 0, 0])
    lower.append(-np.inf)
    upper.append(budget - base)
    k_bounds = (resident, resident) if resident is not None else (0, L)
    w_bounds = (resident_blocks, resident_blocks) if resident_blocks is not None else (0, L)
    h_bounds = (int(activations_on_host),) * 2 if activations_on_host is not None else (0, 1)
    # Ties (transfers hidden behind compute) go to hidden states on the device and to more resident blocks.
    tie = 1e-9 * (L * compute_p + L * (n - 1) * compute_g)
    result = milp(
        np.array([0.0, -tie, tie, 0.0, L, L * (n - 1)]),
        constraints=LinearConstraint(np.array(rows, dtype=float), lower, upper),
        integrality=np.array([1, 1, 1, 1, 0, 0]),
        bounds=Bounds([k_bounds[0], w_bounds[0], h_bounds[0], 0, 0, 0],
                      [k_bounds[1], w_bounds[1], h_bounds[1], 1, np.inf, np.inf]),
    )
    if result.status != 0:
        return None
    k, w, h, _, t_pre, t_gen = result.x
    k, w, h = int(round(k)), int(round(w)), bool(round(h))
    total = L * t_pre + L * (n - 1) * t_gen
    return Policy(
        micro_batch_size=micro_batch, num_micro_batches=-(-batch // micro_batch), cache_device_fraction=k / L,
        compress_weights=compress_weights, compress_kv=compress_kv, tokens_per_s=float(batch * n / total),
        t_prefill=float(t_pre), t_decode=float(t_gen),
        device_bytes=float(device_bytes(shape, micro_batch, batch, prompt, new_tokens, k, compress_weights,
                                        compress_kv, w, h)),
        weights_device_fraction=w / L, activations_on_host=h,
    )


def choose_policy(
    shape: ModelShape, batch: int, prompt: int, new_tokens: int, budget: float, hardware: Optional[Hardware] = None,
    micro_batch_size: Optional[int] = None, compress_weights: Optional[bool] = None,
    compress_kv: Optional[bool] = None, cache_device_fraction: Optional[float] = None,
    weights_device_fraction: Optional[float] = None, activations_on_host: Optional[bool] = None,
    weights_streamed_elsewhere: bool = False, call: str = "generate(...)",
) -> Policy:
    """The policy with the most predicted tokens/s whose device peak fits ``budget``.

    Args:
        shape: The model (:meth:`ModelShape.of`).
        batch: The effective batch (rows of ``input_ids``).
        prompt: Prompt length.
        new_tokens: Tokens generated.
        budget: Device bytes.
        hardware: Cost-model constants (default: FlexGen's T4).
        micro_batch_size, compress_weights, compress_kv, cache_device_fraction, weights_device_fraction,
            activations_on_host: Fix that choice (``None``: the solver picks; compression is then chosen only where it
            wins tokens/s or is needed to fit).
        weights_streamed_elsewhere: Something else streams the weights (``SuperpipeStrategy``): no resident blocks.
        call: The user's call, quoted in errors.

    Raises:
        ValueError: (``GenerationError``) if nothing fits, with the smallest budget that would.
    """
    from lightning_superpipe.generation.api import GenerationError

    hardware = hardware or Hardware()
    # Largest first: sizes the cost model ties on are won by fewer, larger micro-batches (less per-turn overhead).
    sizes = [micro_batch_size] if micro_batch_size else list(range(batch, 0, -1))
    weight_options = [compress_weights] if compress_weights is not None else [False, True]
    kv_options = [compress_kv] if compress_kv is not None else [False, True]
    resident = None if cache_device_fraction is None else int(round(cache_device_fraction * shape.layers))
    if weights_streamed_elsewhere:
        weights_device_fraction = 0.0
    blocks = None if weights_device_fraction is None else int(round(weights_device_fraction * shape.layers))
    best: Optional[Policy] = None
    for size in sizes:
        for cw in weight_options:
            for ckv in kv_options:
                found = _solve(shape, hardware, batch, size, prompt, new_tokens, budget, cw, ckv, resident, blocks,
                               activations_on_host)
                # Prefer no compression unless it is worth more than 5% (compression changes the outputs).
                penalty = 1.0 - 0.05 * (cw + ckv)
                if found is not None and (best is None or found.tokens_per_s * penalty > best.tokens_per_s * (
                        1.0 - 0.05 * (best.compress_weights + best.compress_kv))):
                    best = found
    if best is None:
        smallest = min(
            device_bytes(shape, size, batch, prompt, new_tokens, resident or 0, cw, ckv, blocks or 0,
                         activations_on_host is not False)
            for size in sizes for cw in weight_options for ckv in kv_options
        )
        raise GenerationError(
            f"{call}: memory_budget={format_bytes(budget)} cannot hold even one block's working set: the smallest"
            f" policy needs {format_bytes(smallest)} on the device (one block is {format_bytes(shape.block_bytes)},"
            f" the layers outside the blocks {format_bytes(shape.trunk_bytes)}). Raise `memory_budget` to at least"
            f" that, or allow compression, smaller micro-batches and hidden states in host memory"
            f" (`compress_weights=None`, `micro_batch_size=None`, `activations_on_host=None`)."
        )
    return best


__all__ = ["FlexGenConfig", "FlexGenSolution", "Hardware", "ModelShape", "Policy", "choose_policy", "device_bytes",
           "flexgen_lp", "flexgen_search"]
