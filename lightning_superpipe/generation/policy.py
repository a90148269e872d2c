"""The policy of :func:`~lightning_superpipe.generate`: what the user fixes (:class:`GenerationPolicy`, FlexGen's
``Policy``) and what FlexGen's cost model, solved exactly with ``scipy.optimize.milp``, chooses for the rest
(:func:`choose_policy`).

The cost model is FlexGen's overlap rule for this package's engine, with FlexGen's placements by whole layers: the
weights of the first ``w`` blocks resident on the device (the rest streamed every token), the cache of the first
``k`` layers resident, and the hidden states on the device or (``h = 1``) in host memory between blocks: per layer
``T_prefill = max(in, out, compute)`` and ``T_decode = in + max(out, compute)`` (FlexGen's rule as coded) with the
streamed shares ``1 - w / L`` and ``1 - k / L``, ``T = L * T_prefill + L * (n - 1) * T_decode``; for each micro-batch
size and compression choice the integers ``k``, ``w``, the binary ``h`` and the times are one small MILP under the
device-memory constraint, and the best tokens/s wins. ``h`` is binary as in FlexGen's runtime, which keeps all
activations on one device (its LP's fractions ``hg, hc`` are relaxed). FlexGen's own LP, which checks these terms
against its published predictions, is reproduced in the tests (``tests/flexgen_reference.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import nn

from lightning_superpipe.generation.compression import BYTES_PER_ELEMENT
from lightning_superpipe.generation.errors import GenerationError
from lightning_superpipe.planning.budget import MemoryBudget
from lightning_superpipe.units import format_bytes

GB = 1 << 30  # FlexGen's GB
T = 1e12


# ================================================================================================ the user's policy


@dataclass(frozen=True)
class GenerationPolicy:
    """How :func:`~lightning_superpipe.generate` places weights, cache and hidden states (FlexGen's ``Policy``).

    With ``memory_budget`` every choice left ``None`` is made by the cost model (:func:`choose_policy`); a value you
    set is a constraint. Without it, ``None`` means the default in brackets.

    Attributes:
        memory_budget: Device bytes: an int, ``"8GiB"``, ``"90%"`` of free device memory (CUDA) or ``"auto"``
            (:func:`~lightning_superpipe.planning.parse_budget`). ``None``: no cost model.
        micro_batch_size: Rows per micro-batch (the whole batch).
        resident_blocks: Decoder blocks whose weights stay on the device for the whole generation, the first ones:
            copied once instead of once per token (0). ``SuperpipeStrategy(resident_blocks=...)`` is the same count.
        cache_device_fraction: Fraction of the layers whose KV cache stays on the device, rounded to whole layers
            (FlexGen's ``cache_gpu_percent``; 0).
        activations_on_host: Keep each micro-batch's hidden states in host memory between blocks, so that the
            device holds one micro-batch's instead of every micro-batch's (``False``).
        compress_weights: Block weight matrices in FlexGen's 4-bit form in host memory and over the link
            (``None`` with ``memory_budget``: the cost model decides).
        compress_kv: The KV cache in FlexGen's 4-bit form in host memory and over the link (likewise).
        overlap: Prefetch while computing (``False``: load each thing when needed and wait, for comparison).
        stream_weights: ``False`` when something else streams the weights (``SuperpipeStrategy`` in
            ``trainer.predict``): only the schedule and the KV cache are :func:`generate`'s then.
        hardware: :class:`Hardware` constants of the cost model (FlexGen's T4 figures).
    """

    memory_budget: Optional[MemoryBudget] = None
    micro_batch_size: Optional[int] = None
    resident_blocks: Optional[int] = None
    cache_device_fraction: Optional[float] = None
    activations_on_host: Optional[bool] = None
    compress_weights: Optional[bool] = False
    compress_kv: Optional[bool] = False
    overlap: bool = True
    stream_weights: bool = True
    hardware: Optional[Hardware] = None

    def __repr__(self) -> str:
        # Only what differs from the defaults: errors quote the policy inside the user's call.
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) != f.default]
        return f"GenerationPolicy({', '.join(changed)})"

    def check(self, layers: int, call: str) -> None:
        """Refuses values no model could serve, and combinations that contradict each other.

        Args:
            layers: The model's decoder blocks.
            call: The user's call, quoted in errors.

        Raises:
            GenerationError: Saying which field to change.
        """
        size = self.micro_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise GenerationError(f"{call}: `micro_batch_size` must be a positive integer or None.")
        blocks = self.resident_blocks
        if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool)
                                   or not 0 <= blocks <= layers):
            raise GenerationError(f"{call}: `resident_blocks` must be a count of blocks between 0 and the model's"
                                  f" {layers}, got {blocks!r}.")
        fraction = self.cache_device_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0.0 <= fraction <= 1.0):
            raise GenerationError(f"{call}: `cache_device_fraction` must be a number between 0 and 1, got"
                                  f" {fraction!r}.")
        if not self.stream_weights and self.compress_weights:
            raise GenerationError(f"{call}: `compress_weights=True` needs `stream_weights=True`: whatever streams the"
                                  " weights instead (SuperpipeStrategy) moves them uncompressed.")
        if not self.stream_weights and blocks:
            raise GenerationError(f"{call}: `resident_blocks={blocks!r}` needs `stream_weights=True`: whatever streams"
                                  " the weights instead (SuperpipeStrategy) keeps its own resident blocks (its"
                                  " `resident_blocks`).")



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
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        heads = getattr(config, "num_attention_heads", None) or config.n_head
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
class SolvedPolicy:
    """The policy :func:`choose_policy` chose, and what the cost model predicts for it."""

    micro_batch_size: int
    num_micro_batches: int
    cache_device_fraction: float
    compress_weights: bool
    compress_kv: bool
    tokens_per_s: float
    t_prefill: float  # per layer, seconds
    t_decode: float  # per layer, seconds
    device_bytes: float  # the model's estimate of the device peak
    resident_blocks: int = 0  # the first blocks, whose weights stay on the device
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
) -> Optional[SolvedPolicy]:
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
    return SolvedPolicy(
        micro_batch_size=micro_batch, num_micro_batches=-(-batch // micro_batch), cache_device_fraction=k / L,
        compress_weights=compress_weights, compress_kv=compress_kv, tokens_per_s=float(batch * n / total),
        t_prefill=float(t_pre), t_decode=float(t_gen),
        device_bytes=float(device_bytes(shape, micro_batch, batch, prompt, new_tokens, k, compress_weights,
                                        compress_kv, w, h)),
        resident_blocks=w, activations_on_host=h,
    )


def choose_policy(
    shape: ModelShape, batch: int, prompt: int, new_tokens: int, budget: float, hardware: Optional[Hardware] = None,
    micro_batch_size: Optional[int] = None, compress_weights: Optional[bool] = None,
    compress_kv: Optional[bool] = None, cache_device_fraction: Optional[float] = None,
    resident_blocks: Optional[int] = None, activations_on_host: Optional[bool] = None,
    weights_streamed_elsewhere: bool = False, call: str = "generate(...)",
) -> SolvedPolicy:
    """The policy with the most predicted tokens/s whose device peak fits ``budget``.

    Args:
        shape: The model (:meth:`ModelShape.of`).
        batch: The effective batch (rows of ``input_ids``).
        prompt: Prompt length.
        new_tokens: Tokens generated.
        budget: Device bytes (resolved: :func:`~lightning_superpipe.planning.resolve_budget`).
        hardware: Cost-model constants (default: FlexGen's T4).
        micro_batch_size, compress_weights, compress_kv, cache_device_fraction, resident_blocks,
            activations_on_host: Fix that choice (``None``: the solver picks; compression is then chosen only where it
            wins tokens/s or is needed to fit).
        weights_streamed_elsewhere: Something else streams the weights (``SuperpipeStrategy``): no resident blocks.
        call: The user's call, quoted in errors.

    Raises:
        GenerationError: If nothing fits, with the smallest budget that would.
    """
    hardware = hardware or Hardware()
    # Largest first: sizes the cost model ties on are won by fewer, larger micro-batches (less per-turn overhead).
    sizes = [micro_batch_size] if micro_batch_size else list(range(batch, 0, -1))
    weight_options = [compress_weights] if compress_weights is not None else [False, True]
    kv_options = [compress_kv] if compress_kv is not None else [False, True]
    resident = None if cache_device_fraction is None else int(round(cache_device_fraction * shape.layers))
    blocks = 0 if weights_streamed_elsewhere else resident_blocks
    best: Optional[SolvedPolicy] = None
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


__all__ = ["GenerationPolicy", "Hardware", "ModelShape", "SolvedPolicy", "choose_policy", "device_bytes"]
