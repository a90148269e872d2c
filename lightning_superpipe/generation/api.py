"""``lightning_superpipe.generate``: throughput-oriented generation under a device budget (FlexGen's schedule)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_superpipe.generation.baton import Baton, _Aborted
from lightning_superpipe.generation.engine import GenerationEngine, StreamedCache
from lightning_superpipe.generation.errors import GenerationError
from lightning_superpipe.generation.policy import GenerationPolicy, ModelShape, SolvedPolicy, choose_policy
from lightning_superpipe.planning.budget import resolve_budget
from lightning_superpipe.streaming.blocks import NoBlocksFoundError, find_blocks
from lightning_superpipe.streaming.copier import make_copier


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
            ``seconds``, ``tokens_per_s`` and ``policy`` (a dict: the policy that ran).
    """

    sequences: Tensor
    stats: dict[str, Any]


@dataclass
class _Run:
    """One generation's inputs, resolved: what the threads share."""

    model: nn.Module
    input_ids: Tensor
    attention_mask: Optional[Tensor]
    max_new_tokens: int
    do_sample: bool
    generate_kwargs: dict[str, Any]
    compute: torch.device
    policy: GenerationPolicy  # every choice made: no None left
    starts: list[int]  # the first row of each micro-batch


def generate(
    model: nn.Module,
    input_ids: Tensor,
    policy: Optional[GenerationPolicy] = None,
    *,
    attention_mask: Optional[Tensor] = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    device: Union[str, torch.device, None] = None,
    link: Any = None,
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
        policy: Placement, compression and budget (:class:`~lightning_superpipe.generation.GenerationPolicy`;
            default: every block streamed, the cache in host memory, no compression).
        attention_mask: ``[batch, prompt]``, 0 on padding.
        max_new_tokens: Tokens to generate per row.
        do_sample: Sample instead of greedy decoding (passed to ``generate``).
        device: The compute device (default: CUDA if available, else the CPU).
        link: An :class:`~lightning_superpipe.EmulatedLink` to emulate an asynchronous device on the CPU.
        **generate_kwargs: Passed to ``model.generate`` (e.g. ``temperature``, ``eos_token_id``).

    Returns:
        The sequences and statistics.

    Raises:
        GenerationError: For bad arguments, a model without a stack of decoder layers, or a budget that cannot hold
            even one block.
    """
    policy = policy if policy is not None else GenerationPolicy()
    call = _call(max_new_tokens=max_new_tokens, device=device, policy=policy)
    _check_arguments(model, input_ids, attention_mask, max_new_tokens, generate_kwargs, call)
    compute = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                           else "cpu")
    blocks = _decoder_blocks(model, call)
    policy.check(len(blocks), call)
    chosen, budget = _choose(model, blocks, input_ids.shape, max_new_tokens, policy, compute, call)
    resolved = _resolve(policy, chosen, input_ids.shape[0])
    run = _Run(model, input_ids, attention_mask, max_new_tokens, do_sample, generate_kwargs, compute, resolved,
               list(range(0, input_ids.shape[0], resolved.micro_batch_size)))
    copier = make_copier(compute, link)
    engine = GenerationEngine(
        model, blocks, compute, copier, max_len=input_ids.shape[1] + max_new_tokens, max_steps=max_new_tokens,
        compress_weights=resolved.compress_weights, compress_kv=resolved.compress_kv,
        cache_resident_layers=_resident_layers(resolved, len(blocks)), overlap=resolved.overlap,
        stream_weights=resolved.stream_weights, weights_resident_blocks=resolved.resident_blocks,
        activations_on_host=resolved.activations_on_host,
    )
    baseline = _reset_peak(compute)
    results, seconds = _run_micro_batches(run, blocks, engine, copier)
    sequences = _join(results, model, input_ids.shape[0])
    stats = _stats(run, engine, sequences, seconds, len(blocks), chosen, budget)
    if compute.type == "cuda":
        stats["measured_peak_device_bytes"] = torch.cuda.max_memory_allocated(compute) - baseline
    return GenerationOutput(sequences=sequences, stats=stats)


def _call(**kwargs: Any) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"lightning_superpipe.generate(model, input_ids, {shown})"


def _check_arguments(
    model: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor], max_new_tokens: int,
    generate_kwargs: dict[str, Any], call: str,
) -> None:
    """Refuses inputs and ``model.generate`` arguments the schedule cannot serve, quoting ``call``."""
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise GenerationError(f"{call}: `input_ids` must be a [batch, prompt] tensor of token ids, got "
                              f"{getattr(input_ids, 'shape', type(input_ids).__name__)}.")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise GenerationError(f"{call}: `attention_mask` has shape {tuple(attention_mask.shape)}, expected "
                              f"{tuple(input_ids.shape)} like `input_ids`.")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"{call}: `max_new_tokens` must be a positive integer.")
    if generate_kwargs.get("num_beams", 1) != 1:
        raise GenerationError(f"{call}: beam search is not supported (num_beams must be 1).")
    for reserved in ("past_key_values", "cache", "use_cache", "max_length"):
        if reserved in generate_kwargs:
            raise GenerationError(f"{call}: `{reserved}` is set by the schedule; remove it.")
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise GenerationError(f"{call}: `model` must be a `transformers` causal LM (a `GenerationMixin`), got "
                              f"{type(model).__name__}.")


def _choose(
    model: nn.Module, blocks: list[nn.Module], shape: torch.Size, max_new_tokens: int, policy: GenerationPolicy,
    compute: torch.device, call: str,
) -> tuple[Optional[SolvedPolicy], Optional[int]]:
    """The cost model's choice for what ``policy`` leaves open, and the budget in bytes (``None``, ``None``
    without a budget)."""
    if policy.memory_budget is None:
        return None, None
    try:
        budget = resolve_budget(policy.memory_budget, compute, call=f"{call}: `memory_budget`")
    except ValueError as error:
        raise GenerationError(str(error)) from None
    batch, prompt = shape
    # The other streamer cannot compress or keep blocks: the cost model must not pick either.
    compress_weights = policy.compress_weights if policy.stream_weights else False
    chosen = choose_policy(
        ModelShape.of(model, blocks), batch=batch, prompt=prompt, new_tokens=max_new_tokens, budget=budget,
        hardware=policy.hardware, micro_batch_size=policy.micro_batch_size, compress_weights=compress_weights,
        compress_kv=policy.compress_kv, cache_device_fraction=policy.cache_device_fraction,
        resident_blocks=policy.resident_blocks, activations_on_host=policy.activations_on_host,
        weights_streamed_elsewhere=not policy.stream_weights, call=call,
    )
    return chosen, budget


def _resolve(policy: GenerationPolicy, chosen: Optional[SolvedPolicy], batch: int) -> GenerationPolicy:
    """``policy`` with every open choice made: the cost model's where it ran, else the defaults."""
    if chosen is not None:
        policy = replace(
            policy, micro_batch_size=chosen.micro_batch_size, compress_weights=chosen.compress_weights,
            compress_kv=chosen.compress_kv, cache_device_fraction=chosen.cache_device_fraction,
            resident_blocks=chosen.resident_blocks, activations_on_host=chosen.activations_on_host,
        )
    return replace(
        policy,
        micro_batch_size=min(policy.micro_batch_size or batch, batch),
        compress_weights=bool(policy.compress_weights) and policy.stream_weights,
        compress_kv=bool(policy.compress_kv),
        cache_device_fraction=policy.cache_device_fraction or 0.0,
        resident_blocks=(policy.resident_blocks or 0) if policy.stream_weights else 0,
        activations_on_host=bool(policy.activations_on_host),
    )


def _resident_layers(policy: GenerationPolicy, layers: int) -> int:
    """Layers whose KV cache stays on the device: the cache fraction in whole layers."""
    return int(round((policy.cache_device_fraction or 0.0) * layers))


def _reset_peak(compute: torch.device) -> int:
    """Device bytes allocated before the run, the base of its measured peak (0 off CUDA)."""
    if compute.type != "cuda":
        return 0
    torch.cuda.synchronize(compute)
    torch.cuda.reset_peak_memory_stats(compute)
    return torch.cuda.memory_allocated(compute)


def _run_micro_batches(
    run: _Run, blocks: list[nn.Module], engine: GenerationEngine, copier: Any
) -> tuple[dict[int, Tensor], float]:
    """Runs every micro-batch's ``model.generate`` in its own thread, one at a time by the baton.

    Returns:
        Each micro-batch's sequences by index, and the seconds the run took.
    """
    baton = Baton(len(run.starts))
    engine.baton = baton
    engine.caches = [StreamedCache(run.model.config, engine, index) for index in range(len(run.starts))]
    results: dict[int, Tensor] = {}
    local = threading.local()
    handles = _hook_blocks(blocks, engine, baton, local)
    # The threads compute on the caller's current stream: the copier orders its copies against that one.
    stream = torch.cuda.current_stream(run.compute) if run.compute.type == "cuda" else None
    initializer = copier.thread_initializer()  # the emulated link's checker watches every thread

    def micro_batch(index: int, start: int) -> None:
        local.micro_batch = index
        try:
            baton.start(index)
            if initializer is not None:
                initializer()
            if stream is not None:
                torch.cuda.set_device(run.compute)
                torch.cuda.set_stream(stream)
            results[index] = _generate_rows(run, engine.caches[index], start)
        except _Aborted:
            return
        except BaseException as error:  # re-raised on the caller's thread
            engine.leave(index)
            baton.leave(index, error)
            return
        engine.leave(index)
        baton.leave(index)

    started = time.perf_counter()
    threads = [threading.Thread(target=micro_batch, args=(i, s), name=f"superpipe-generate-{i}")
               for i, s in enumerate(run.starts)]
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
    return results, seconds


def _generate_rows(run: _Run, cache: StreamedCache, start: int) -> Tensor:
    """``model.generate`` for the micro-batch of rows from ``start``, on its streamed cache."""
    rows = slice(start, start + run.policy.micro_batch_size)
    ids = run.input_ids[rows].to(run.compute)
    mask = run.attention_mask[rows].to(run.compute) if run.attention_mask is not None else None
    # no_grad, not inference_mode: the copier may run deferred copies into these tensors on other threads.
    with torch.no_grad():
        return run.model.generate(
            input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=run.max_new_tokens,
            do_sample=run.do_sample, use_cache=True, **run.generate_kwargs,
        )


def _stats(
    run: _Run, engine: GenerationEngine, sequences: Tensor, seconds: float, layers: int,
    chosen: Optional[SolvedPolicy], budget: Optional[int],
) -> dict[str, Any]:
    """What :class:`GenerationOutput` reports (see there)."""
    policy = run.policy
    new_tokens = sequences.shape[0] * (sequences.shape[1] - run.input_ids.shape[1])
    return {
        "h2d_bytes": dict(engine.traffic.h2d),
        "d2h_bytes": dict(engine.traffic.d2h),
        "peak_device_bytes": engine.ledger.peak,
        "peak_device_bytes_by_kind": dict(engine.ledger.peaks),
        "cache_bytes": engine.cache_bytes(),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else math.inf,
        "policy": {
            "micro_batch_size": policy.micro_batch_size,
            "num_micro_batches": len(run.starts),
            "cache_device_fraction": _resident_layers(policy, layers) / layers,
            "resident_blocks": policy.resident_blocks,
            "activations_on_host": policy.activations_on_host,
            "compress_weights": policy.compress_weights,
            "compress_kv": policy.compress_kv,
            "overlap": policy.overlap,
            # The cost model's prediction with `hardware`'s constants (FlexGen's T4 figures by default).
            "predicted_tokens_per_s": chosen.tokens_per_s if chosen is not None else None,
            "memory_budget": budget,
        },
    }




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
