"""``lightning_superpipe.generate``: throughput-oriented generation under a device budget (FlexGen's schedule)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_superpipe.generation.baton import Baton, _Aborted
from lightning_superpipe.generation.engine import StreamedCache, GenerationEngine
from lightning_superpipe.streaming.blocks import NoBlocksFoundError, find_blocks
from lightning_superpipe.streaming.copier import make_copier
from lightning_superpipe.units import parse_bytes


class GenerationError(ValueError):
    """A bad argument or a model or budget :func:`generate` cannot serve; the message says what to change."""


@dataclass
class GenerationOutput:
    """What :func:`generate` returns.

    Attributes:
        sequences: ``[batch, prompt + new]`` token ids, as ``model.generate`` returns them (rows that finished early
            padded with the pad token).
        stats: ``h2d_bytes`` and ``d2h_bytes`` (dicts by kind: ``weights`` (the resident blocks' one copy included),
            ``cache``, ``activations``),
            ``peak_device_bytes`` (the engine's own count of what it holds on the device: trunk, block weights,
            cache, hidden states), ``peak_device_bytes_by_kind``, ``measured_peak_device_bytes`` (CUDA's allocator,
            on a CUDA device only), ``cache_bytes`` (the whole KV cache at the end), ``new_tokens``,
            ``seconds``, ``tokens_per_s`` and ``policy`` (a dict).
    """

    sequences: Tensor
    stats: dict[str, Any]


def _call(**kwargs: Any) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"lightning_superpipe.generate(model, input_ids, {shown})"


def generate(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    max_new_tokens: int = 32,
    device: Union[str, torch.device, None] = None,
    memory_budget: Union[None, int, str] = None,
    micro_batch_size: Optional[int] = None,
    compress_weights: Optional[bool] = False,
    compress_kv: Optional[bool] = False,
    do_sample: bool = False,
    cache_device_fraction: Optional[float] = None,
    weights_device_fraction: Optional[float] = None,
    activations_on_host: Optional[bool] = None,
    overlap: bool = True,
    link: Any = None,
    hardware: Any = None,
    stream_weights: bool = True,
    **generate_kwargs: Any,
) -> GenerationOutput:
    """Generates for a large batch with a model's blocks streamed through the device once per token.

    FlexGen's loop order token -> block -> micro-batch: for each new token each block's weights come to the device
    once and compute every micro-batch of the batch before the next block; the next block's weights, and the next
    micro-batch's KV cache, are copied while the current one computes. The KV cache lives in host memory (pinned on
    CUDA), optionally in FlexGen's 4-bit form, as do the weights with ``compress_weights``. Each micro-batch runs
    the model's own ``generate`` (in a thread; only one runs at a time), so inputs, masks, positions and logits
    processing are exactly ``transformers``'.

    Args:
        model: A ``transformers`` causal LM whose parameters are in host memory.
        input_ids: ``[batch, prompt]`` token ids (left-padded where rows differ in length).
        attention_mask: ``[batch, prompt]``, 0 on padding.
        max_new_tokens: Tokens to generate per row.
        device: The compute device (default: CUDA if available, else the CPU).
        memory_budget: Device bytes (``"8GiB"`` or a number): the policy then picks the micro-batch size, the cache's
            device fraction and compression (:mod:`.policy`), unless given explicitly.
        micro_batch_size: Rows per micro-batch (default: the policy's, or the whole batch).
        compress_weights: Block weight matrices in FlexGen's 4-bit form in host memory and over the link;
            ``None`` with ``memory_budget``: the policy decides.
        compress_kv: The KV cache in FlexGen's 4-bit form in host memory and over the link; ``None`` with
            ``memory_budget``: the policy decides.
        do_sample: Sample instead of greedy decoding (passed to ``generate``).
        cache_device_fraction: Fraction of the layers whose KV cache stays on the device (default 0, or the policy's).
        weights_device_fraction: Fraction of the blocks whose weights stay on the device for the whole generation,
            the first ones, rounded to whole blocks (FlexGen's ``w_gpu_percent``): copied once instead of once per
            token (default 0, or the policy's).
        activations_on_host: Keep each micro-batch's hidden states in host memory between blocks (FlexGen's
            activations on the CPU; bytes counted under ``activations``), so that the device holds one micro-batch's
            instead of every micro-batch's (default ``False``, or the policy's).
        overlap: Prefetch while computing (``False``: load each thing when needed and wait, for comparison).
        link: An :class:`~lightning_superpipe.EmulatedLink` to emulate an asynchronous device on the CPU.
        hardware: :class:`~lightning_superpipe.generation.policy.Hardware` constants for the policy's cost model.
        stream_weights: ``False`` when something else streams the weights (``SuperpipeStrategy`` in
            ``trainer.predict``): only the schedule and the KV cache are this function's then.
        **generate_kwargs: Passed to ``model.generate`` (e.g. ``temperature``, ``eos_token_id``).

    Returns:
        The sequences and statistics.

    Raises:
        GenerationError: For bad arguments, a model without a stack of decoder layers, or a budget that cannot hold
            even one block.
    """
    from lightning_superpipe.generation import policy as policy_module

    shown: dict[str, Any] = dict(max_new_tokens=max_new_tokens, device=device, memory_budget=memory_budget,
                                 micro_batch_size=micro_batch_size)
    for name, value in (("weights_device_fraction", weights_device_fraction),
                        ("activations_on_host", activations_on_host)):
        if value is not None:
            shown[name] = value
    call = _call(**shown)
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise GenerationError(f"{call}: `input_ids` must be a [batch, prompt] tensor of token ids, got "
                              f"{getattr(input_ids, 'shape', type(input_ids).__name__)}.")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise GenerationError(f"{call}: `attention_mask` has shape {tuple(attention_mask.shape)}, expected "
                              f"{tuple(input_ids.shape)} like `input_ids`.")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"{call}: `max_new_tokens` must be a positive integer.")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise GenerationError(f"{call}: `micro_batch_size` must be a positive integer or None.")
    for name, fraction in (("cache_device_fraction", cache_device_fraction),
                           ("weights_device_fraction", weights_device_fraction)):
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0.0 <= fraction <= 1.0):
            raise GenerationError(f"{call}: `{name}` must be a number between 0 and 1, got {fraction!r}.")
    if generate_kwargs.get("num_beams", 1) != 1:
        raise GenerationError(f"{call}: beam search is not supported (num_beams must be 1).")
    for reserved in ("past_key_values", "cache", "use_cache", "max_length"):
        if reserved in generate_kwargs:
            raise GenerationError(f"{call}: `{reserved}` is set by the schedule; remove it.")
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise GenerationError(f"{call}: `model` must be a `transformers` causal LM (a `GenerationMixin`), got "
                              f"{type(model).__name__}.")
    budget: Optional[float] = None
    if memory_budget is not None:
        try:
            budget = parse_bytes(memory_budget) if isinstance(memory_budget, str) else float(memory_budget)
        except ValueError:
            raise GenerationError(f"{call}: `memory_budget` must be bytes, e.g. '8GiB' or 8e9.") from None
        if budget <= 0:
            raise GenerationError(f"{call}: `memory_budget` must be positive.")
    if not stream_weights and compress_weights:
        raise GenerationError(f"{call}: `compress_weights=True` needs `stream_weights=True`: whatever streams the"
                              " weights instead (SuperpipeStrategy) moves them uncompressed.")
    if not stream_weights and weights_device_fraction:
        raise GenerationError(f"{call}: `weights_device_fraction={weights_device_fraction!r}` needs"
                              " `stream_weights=True`: whatever streams the weights instead (SuperpipeStrategy) keeps"
                              " its own resident blocks (its `resident_blocks`).")
    if not stream_weights:
        compress_weights = False  # the policy must not pick what the other streamer cannot do
        weights_device_fraction = 0.0
    default = "cuda" if torch.cuda.is_available() else "cpu"
    compute = torch.device(device) if device is not None else torch.device(default)
    blocks = _decoder_blocks(model, call)

    batch, prompt = input_ids.shape
    shape = policy_module.ModelShape.of(model, blocks)
    chosen: Optional[policy_module.Policy] = None
    if budget is not None:
        chosen = policy_module.choose_policy(
            shape, batch=batch, prompt=prompt, new_tokens=max_new_tokens, budget=budget, hardware=hardware,
            micro_batch_size=micro_batch_size, compress_weights=compress_weights,
            compress_kv=compress_kv, cache_device_fraction=cache_device_fraction,
            weights_device_fraction=weights_device_fraction, activations_on_host=activations_on_host,
            weights_streamed_elsewhere=not stream_weights, call=call,
        )
        micro_batch_size = chosen.micro_batch_size
        compress_weights, compress_kv = chosen.compress_weights, chosen.compress_kv
        cache_device_fraction = chosen.cache_device_fraction
        weights_device_fraction = chosen.weights_device_fraction
        activations_on_host = chosen.activations_on_host
    micro_batch_size = min(micro_batch_size or batch, batch)
    compress_weights, compress_kv = bool(compress_weights), bool(compress_kv)
    cache_device_fraction = cache_device_fraction or 0.0
    resident_layers = int(round(cache_device_fraction * len(blocks)))
    resident_blocks = int(round((weights_device_fraction or 0.0) * len(blocks)))
    activations_on_host = bool(activations_on_host)

    copier = make_copier(compute, link)
    engine = GenerationEngine(
        model, blocks, compute, copier, max_len=prompt + max_new_tokens, max_steps=max_new_tokens,
        compress_weights=compress_weights, compress_kv=compress_kv, cache_resident_layers=resident_layers,
        overlap=overlap, stream_weights=stream_weights, weights_resident_blocks=resident_blocks,
        activations_on_host=activations_on_host,
    )
    starts = list(range(0, batch, micro_batch_size))
    baton = Baton(len(starts))
    engine.baton = baton
    engine.caches = [StreamedCache(model.config, engine, index) for index in range(len(starts))]
    results: dict[int, Tensor] = {}
    local = threading.local()
    handles = _hook_blocks(blocks, engine, baton, local)
    if compute.type == "cuda":
        torch.cuda.synchronize(compute)
        torch.cuda.reset_peak_memory_stats(compute)
        baseline = torch.cuda.memory_allocated(compute)

    # The threads compute on the caller's current stream: the copier orders its copies against that one.
    stream = torch.cuda.current_stream(compute) if compute.type == "cuda" else None
    initializer = copier.thread_initializer()  # the emulated link's checker watches every thread

    def run(index: int, start: int) -> None:
        local.micro_batch = index
        try:
            baton.start(index)
            if initializer is not None:
                initializer()
            if stream is not None:
                torch.cuda.set_device(compute)
                torch.cuda.set_stream(stream)
            rows = slice(start, start + micro_batch_size)
            ids = input_ids[rows].to(compute)
            mask = attention_mask[rows].to(compute) if attention_mask is not None else None
            # no_grad, not inference_mode: the copier may run deferred copies into these tensors on other threads.
            with torch.no_grad():
                results[index] = model.generate(
                    input_ids=ids, attention_mask=mask, cache=engine.caches[index],
                    max_new_tokens=max_new_tokens, do_sample=do_sample, use_cache=True, **generate_kwargs,
                )
        except _Aborted:
            return
        except BaseException as error:  # re-raised on the caller's thread
            engine.leave(index)
            baton.leave(index, error)
            return
        engine.leave(index)
        baton.leave(index)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i, s), name=f"superpipe-generate-{i}") for i, s in enumerate(starts)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        copier.synchronize()
    finally:
        for handle in handles:
            handle.remove()
        engine.close()
    seconds = time.perf_counter() - started
    if baton.failed is not None:
        raise baton.failed
    sequences = _join(results, model, batch)
    new_tokens = batch * (sequences.shape[1] - prompt)
    stats: dict[str, Any] = {
        "h2d_bytes": dict(engine.traffic.h2d),
        "d2h_bytes": dict(engine.traffic.d2h),
        "peak_device_bytes": engine.ledger.peak,
        "peak_device_bytes_by_kind": dict(engine.ledger.peaks),
        "cache_bytes": engine.cache_bytes(),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else math.inf,
        "policy": {
            "micro_batch_size": micro_batch_size,
            "num_micro_batches": len(starts),
            "cache_device_fraction": resident_layers / len(blocks),
            "weights_device_fraction": resident_blocks / len(blocks),
            "resident_blocks": resident_blocks,
            "activations_on_host": activations_on_host,
            "compress_weights": compress_weights,
            "compress_kv": compress_kv,
            "overlap": overlap,
            # The cost model's prediction with `hardware`'s constants (FlexGen's T4 figures by default).
            "predicted_tokens_per_s": chosen.tokens_per_s if chosen is not None else None,
            "memory_budget": budget,
        },
    }
    if compute.type == "cuda":
        stats["measured_peak_device_bytes"] = torch.cuda.max_memory_allocated(compute) - baseline
    return GenerationOutput(sequences=sequences, stats=stats)


def _decoder_blocks(model: nn.Module, call: str) -> list[nn.Module]:
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    try:
        blocks = find_blocks(model)
    except NoBlocksFoundError:
        blocks = []
    if layers is None:
        layers = getattr(model.config, "n_layer", None)
    if not blocks or (layers is not None and len(blocks) != layers):
        found = f"{len(blocks)} repeated modules" if blocks else "no stack of repeated modules"
        raise GenerationError(
            f"{call}: unknown model layout: {type(model).__name__} has {found}, but its config says"
            f" {layers} decoder layers. generate streams the decoder layers of a `transformers` causal LM (one"
            " `nn.ModuleList` of layers, e.g. `model.model.layers` or `model.transformer.h`); use"
            " `AutoModelForCausalLM`."
        )
    for index, block in enumerate(blocks):
        if any(p.device.type != "cpu" for p in block.parameters()):
            raise GenerationError(f"{call}: the model's parameters must be in host memory (call `model.cpu()` first);"
                                  f" block {index} is on {next(block.parameters()).device}.")
    return blocks


def _hook_blocks(blocks: list[nn.Module], engine: GenerationEngine, baton: Baton, local: threading.local) -> list[Any]:
    handles = []
    for index, block in enumerate(blocks):

        def before(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> Optional[tuple[tuple, dict]]:
            micro_batch = getattr(local, "micro_batch", None)
            if micro_batch is None:
                raise RuntimeError("a streamed block ran outside lightning_superpipe.generate's threads")
            hidden = args[0] if args else kwargs.get("hidden_states")
            engine.arrive(micro_batch, hidden)
            key = baton.arrive(micro_batch, index)
            loaded = engine.begin_turn(key, hidden)
            if loaded is hidden:
                return None
            if args:  # the hidden states were parked in host memory: the block computes on their device copy
                return (loaded,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": loaded}

        def after(module: nn.Module, args: tuple, output: Any, index: int = index) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            kept = engine.end_turn(local.micro_batch, index, hidden)
            if kept is hidden:
                return None
            return (kept,) + tuple(output[1:]) if isinstance(output, tuple) else kept

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after))
    return handles


def _join(results: dict[int, Tensor], model: nn.Module, batch: int) -> Tensor:
    """The micro-batches' sequences as one batch; those that stopped early padded like ``model.generate`` pads."""
    parts = [results[i].cpu() for i in sorted(results)]
    length = max(p.shape[1] for p in parts)
    config = model.generation_config
    pad = config.pad_token_id
    if pad is None:
        eos = config.eos_token_id
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
    padded = [torch.nn.functional.pad(p, (0, length - p.shape[1]), value=int(pad)) for p in parts]
    out = torch.cat(padded)
    assert out.shape[0] == batch
    return out
