"""Throughput-oriented generation (``lightning_superpipe.generate``, FlexGen's schedule) against the alternatives.

Three measurements, in one run, on the CPU (no download: models from small configs, text from ``pydoc_data``):

1. **Bytes per generated token per link**, counted: ours (the engine's counters), HF Accelerate's ``cpu_offload``
   on the same model and batch (its copies counted by wrapping ``accelerate.hooks.set_module_tensor_to_device``;
   it moves every weight before every module's forward and keeps the KV cache on the device), and FlexGen's
   formula for the same policy (weights streamed every token, cache in host memory).
2. **Tokens/s, overlapped against serialized**, on an emulated asynchronous link whose bandwidth is capped so that
   bytes per FLOP match a T4 (12.89 GB/s host-to-device over 4.3 TFLOP/s decode matmuls, FlexGen's fitted
   figures): the CPU's matmul rate is measured first and the link set to ``rate * 12.89 / 4300`` bytes/s.
   Serialized is Accelerate's order: each copy issued when needed and waited for.
   Also FlexGen's other placements on the same run: half the blocks resident, hidden states in host memory.
3. **Compression**: a small Llama (4 x 128, two heads of 64) trained here on Python's documentation, once per
   training seed (``--seeds``); held-out perplexity exact, with 4-bit weights, with a 4-bit KV cache, and both,
   measured three ways: inside ``generate`` itself (:class:`TeacherForcing`: a 32-token prompt prefilled, the next
   96 held-out tokens forced and scored, each decode step against the cache as ``generate`` keeps it), fed in
   chunks of 32 against a round-tripped cache within the trained context of 128, and the first version's way
   (256 positions, twice the trained context, and a round trip that also compressed the chunk's own keys); the
   keys' and values' quantization errors and channel outliers; and the bytes ``generate`` moves with both
   compressed against none.

Usage:
    python benchmarks/bench_generation.py              # about 15 minutes on one core (5 training seeds)
    python benchmarks/bench_generation.py --parts compression --seeds 2
    python benchmarks/bench_generation.py --json out.json --train-steps 400
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

from lightning_superpipe import EmulatedLink, generate
from lightning_superpipe.generation import GenerationPolicy, compression

VOCAB_OFFSET = 4  # byte b is token b + 4; 0..3 special
T4_BYTES_PER_FLOP = 12.89 / 4300  # FlexGen's fitted T4 ctog bandwidth (GB/s) over decode matmul rate (GFLOP/s)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def documentation_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def prompts_from_docs(batch: int, length: int, offset: int = 0) -> torch.Tensor:
    data = documentation_bytes()
    rows = [list(data[offset + i * 997 : offset + i * 997 + length]) for i in range(batch)]
    return torch.tensor(rows, dtype=torch.long) + VOCAB_OFFSET


# ------------------------------------------------------------------ 1. bytes per generated token


def count_accelerate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict[str, Any]:
    """Runs ``model.generate`` under Accelerate's ``cpu_offload`` and counts the bytes its hooks copy."""
    import accelerate.hooks as hooks
    from accelerate import cpu_offload

    counted = {"bytes": 0, "calls": 0}
    original = hooks.set_module_tensor_to_device

    def counting(module: Any, tensor_name: str, device: Any, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        if value is not None and str(device) != "meta":
            counted["bytes"] += value.numel() * value.element_size()
            counted["calls"] += 1
        return original(module, tensor_name, device, value, *args, **kwargs)

    hooks.set_module_tensor_to_device = counting
    try:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        offloaded = cpu_offload(model, execution_device=torch.device("cpu"), state_dict=state)
        started = time.perf_counter()
        out = offloaded.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        seconds = time.perf_counter() - started
    finally:
        hooks.set_module_tensor_to_device = original
    return {"h2d_bytes": counted["bytes"], "calls": counted["calls"], "sequences": out, "seconds": seconds}


def flexgen_formula(model: Any, batch: int, prompt: int, new: int, compressed: bool = False) -> dict[str, float]:
    """FlexGen's per-layer terms (its cost model) for weights streamed every token and the cache in host memory.

    h2d per layer: ``wi`` weights every forward, plus the cache ``bls * (s + n/2) * kv`` every decode step;
    d2h per layer: the new cache, ``bls * s * kv`` at prefill and ``bls * kv`` per decode step.
    FlexGen counts ``4 * h1`` bytes of cache per token (fp16 keys and values); here ``kv`` is the model's own
    ``2 * kv_heads * head_dim * bytes`` (grouped KV heads), and ``wi`` its block bytes.
    """
    blocks = model.model.layers
    wi = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_key_value_heads * head_dim * 4
    if compressed:
        wi, kv = wi * compression.BYTES_PER_ELEMENT / 4, kv * compression.BYTES_PER_ELEMENT / 4
    layers, s, n = len(blocks), prompt, new
    h2d = layers * (n * wi + (n - 1) * batch * (s + n / 2) * kv)
    d2h = layers * (batch * s * kv + (n - 1) * batch * kv)
    return {"h2d_bytes": h2d, "d2h_bytes": d2h}


def bytes_per_token(args: argparse.Namespace) -> dict[str, Any]:
    model = llama(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=256 + VOCAB_OFFSET)
    batch, prompt, new = 32, 64, 16
    ids = prompts_from_docs(batch, prompt)
    mask = torch.ones_like(ids)
    ours = generate(model, ids, GenerationPolicy(micro_batch_size=8), attention_mask=mask, max_new_tokens=new)
    generated = batch * new
    # FlexGen's other placements: half the blocks resident (copied once), hidden states in host memory.
    half = generate(model, ids, GenerationPolicy(micro_batch_size=8, resident_blocks=2), attention_mask=mask,
                    max_new_tokens=new)
    hosted = generate(model, ids, GenerationPolicy(micro_batch_size=8, activations_on_host=True), attention_mask=mask,
                      max_new_tokens=new)
    placements = {
        name: {"h2d_by_kind_per_token": {k: v / generated for k, v in out.stats["h2d_bytes"].items()},
               "d2h_by_kind_per_token": {k: v / generated for k, v in out.stats["d2h_bytes"].items()},
               "peak_device_bytes": out.stats["peak_device_bytes"],
               "peak_device_bytes_by_kind": out.stats["peak_device_bytes_by_kind"],
               "same_tokens": bool(torch.equal(out.sequences, ours.sequences))}
        for name, out in (("streamed", ours), ("half_blocks_resident", half), ("hidden_states_on_host", hosted))
    }
    fresh = llama(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=260)
    accelerate = count_accelerate(fresh, ids, mask, new)
    formula = flexgen_formula(model, batch, prompt, new)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Accelerate at the same device budget: it keeps the whole KV cache and the hidden states on the device, so its
    # batch is what fits in our peak beside one module's weights (the largest: the embedding or the head).
    budget = ours.stats["peak_device_bytes"]
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_row = (len(model.model.layers) * (prompt + new) * 2 * config.num_key_value_heads * head_dim * 4
               + 2 * prompt * config.hidden_size * 4)
    largest_module = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    same_budget_batch = max(1, int((budget - largest_module) // per_row))
    same_budget = count_accelerate(llama(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=260),
                                   ids[:same_budget_batch], mask[:same_budget_batch], new)
    return {
        "model": "llama 4 x 256 (GQA 4/2), fp32", "batch": batch, "prompt": prompt, "new_tokens": new,
        "model_bytes": params,
        "ours_h2d_per_token": sum(ours.stats["h2d_bytes"].values()) / generated,
        "ours_h2d_by_kind_per_token": {k: v / generated for k, v in ours.stats["h2d_bytes"].items()},
        "ours_d2h_per_token": sum(ours.stats["d2h_bytes"].values()) / generated,
        "flexgen_formula_h2d_per_token": formula["h2d_bytes"] / generated,
        "flexgen_formula_d2h_per_token": formula["d2h_bytes"] / generated,
        "accelerate_h2d_per_token": accelerate["h2d_bytes"] / generated,
        "accelerate_d2h_per_token": 0.0,
        "accelerate_copy_calls": accelerate["calls"],
        "same_tokens_as_accelerate": bool(torch.equal(accelerate["sequences"], ours.sequences)),
        "ours_peak_device_bytes": budget,
        "accelerate_same_budget_batch": same_budget_batch,
        "accelerate_same_budget_h2d_per_token": same_budget["h2d_bytes"] / (same_budget_batch * new),
        "placements": placements,
    }


# ------------------------------------------------------------------ 2. overlapped against serialized


def matmul_flops() -> float:
    a, b = torch.randn(64, 512), torch.randn(512, 1376)
    for _ in range(5):
        a @ b
    started, reps = time.perf_counter(), 200
    for _ in range(reps):
        a @ b
    return 2 * 64 * 512 * 1376 * reps / (time.perf_counter() - started)


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    model = llama(hidden=512, layers=4, heads=8, kv_heads=4, inter=1376, vocab=260)
    batch, prompt, new = 32, 32, 8
    ids = prompts_from_docs(batch, prompt, offset=5000)
    mask = torch.ones_like(ids)
    flops = matmul_flops()
    bandwidth = flops * T4_BYTES_PER_FLOP
    results = {}
    for name, overlapped in (("overlapped", True), ("serialized", False)):
        link = EmulatedLink(mode="lazy", bandwidth=bandwidth, check=False, verify=False)
        out = generate(model, ids, GenerationPolicy(micro_batch_size=8, overlap=overlapped), attention_mask=mask,
                       max_new_tokens=new, link=link)
        results[name] = {"tokens_per_s": out.stats["tokens_per_s"], "seconds": out.stats["seconds"],
                         "exposed_copy_wait_s": link.stats.wait_seconds, "sequences": out.sequences}
    no_link = generate(model, ids, GenerationPolicy(micro_batch_size=8), attention_mask=mask, max_new_tokens=new)
    return {
        "model": "llama 4 x 512, fp32", "batch": batch, "micro_batch": 8, "prompt": prompt, "new_tokens": new,
        "cpu_matmul_flops": flops, "link_bytes_per_s": bandwidth,
        "overlapped_tokens_per_s": results["overlapped"]["tokens_per_s"],
        "serialized_tokens_per_s": results["serialized"]["tokens_per_s"],
        "speedup": results["overlapped"]["tokens_per_s"] / results["serialized"]["tokens_per_s"],
        "overlapped_exposed_wait_s": results["overlapped"]["exposed_copy_wait_s"],
        "serialized_exposed_wait_s": results["serialized"]["exposed_copy_wait_s"],
        "no_link_tokens_per_s": no_link.stats["tokens_per_s"],
        "same_tokens": bool(torch.equal(results["overlapped"]["sequences"], results["serialized"]["sequences"])),
    }


# ------------------------------------------------------------------ 3. compression


def train_small_model(steps: int, seq: int = 128, batch: int = 16, seed: int = 0) -> tuple[Any, torch.Tensor]:
    """Trains the Llama 4 x 128 (two heads of 64) on Python's documentation; ``seed`` sets its init and data order.

    Returns:
        The model (eval mode) and the held-out last 5% of the bytes as tokens.
    """
    data = torch.tensor(list(documentation_bytes()), dtype=torch.long) + VOCAB_OFFSET
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]
    model = llama(hidden=128, layers=4, heads=2, kv_heads=2, inter=384, vocab=260, seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([train[s : s + seq] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval(), held_out


def _round_trip(tensor: torch.Tensor) -> torch.Tensor:
    return compression.decompress(compression.compress(tensor, -1))


class _RoundTripCache(DynamicCache):
    """A DynamicCache that keeps new keys/values in FlexGen's 4-bit form (round-tripped) while the chunk that made
    them attends to them exactly, as ``GenerationPolicy(compress_kv=True)`` and FlexGen do (the new token's own keys and
    values are used uncompressed, the stored past is decompressed)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        q = key_states.shape[-2]
        # New tensors for what is kept: ``keys``/``values`` (returned to attention) keep the exact tail.
        layer.keys = torch.cat([keys[..., :-q, :], _round_trip(keys[..., -q:, :])], dim=-2)
        layer.values = torch.cat([values[..., :-q, :], _round_trip(values[..., -q:, :])], dim=-2)
        return keys, values


class _FirstVersionRoundTripCache(DynamicCache):
    """The first version of this benchmark's cache, kept to reproduce its figure: it round-trips the new positions
    in place, and since ``DynamicLayer.update`` returns the very tensors it keeps, the chunk attended to its own
    compressed keys and values too (not what ``generate`` does)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        q = key_states.shape[-2]
        for name in ("keys", "values"):
            stored = getattr(layer, name)
            stored[..., -q:, :] = _round_trip(stored[..., -q:, :])
        return keys, values


@torch.no_grad()
def chunked_perplexity(model: Any, held_out: torch.Tensor, compress_kv: bool, seq: int = 128, chunk: int = 32,
                       rows: int = 48, first_version: bool = False) -> float:
    """Perplexity of every position, the text fed ``chunk`` tokens at a time against a round-tripped cache
    (``first_version``: the first version's in-place round trip, see :class:`_FirstVersionRoundTripCache`)."""
    total, count = 0.0, 0
    kind = _FirstVersionRoundTripCache if first_version else _RoundTripCache
    for r in range(rows):
        tokens = held_out[r * seq : (r + 1) * seq].unsqueeze(0)
        cache = kind(config=model.config) if compress_kv else DynamicCache(config=model.config)
        for start in range(0, seq - 1, chunk):
            inputs = tokens[:, start : min(start + chunk, seq - 1)]
            targets = tokens[:, start + 1 : start + 1 + inputs.shape[1]]
            logits = model(input_ids=inputs, past_key_values=cache, use_cache=True).logits
            total += torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="sum").item()
            count += targets.shape[1]
    return math.exp(total / count)


class TeacherForcing(LogitsProcessor):
    """Scores the held-out continuation inside ``generate`` and forces it as the next token.

    Each call adds ``-log p(target)`` from the raw logits of every row, then leaves only the target allowed, so
    ``generate`` decodes exactly the held-out text: every decode step attends to the cache as ``generate`` keeps it
    (compressed in host memory with ``compress_kv``), the prompt is prefilled as ``generate`` prefills it.

    Args:
        prompts: ``[rows, prompt]`` the prompts ``generate`` gets (rows are found by their prompt).
        targets: ``[rows, new]`` the continuation to score.
    """

    def __init__(self, prompts: torch.Tensor, targets: torch.Tensor) -> None:
        self.rows = {tuple(row.tolist()): index for index, row in enumerate(prompts)}
        self.prompt = prompts.shape[1]
        self.targets = targets
        self.nll = 0.0
        self.count = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt
        rows = torch.tensor([self.rows[tuple(r.tolist())] for r in input_ids[:, : self.prompt].cpu()])
        target = self.targets[rows, step].to(scores.device)
        logp = torch.log_softmax(scores.float(), dim=-1).gather(1, target[:, None])
        self.nll -= logp.sum().item()
        self.count += target.numel()
        forced = torch.full_like(scores, -math.inf)
        forced.scatter_(1, target[:, None], 0.0)
        return forced

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)


def generate_perplexity(model: Any, held_out: torch.Tensor, compress_weights: bool, compress_kv: bool,
                        prompt: int = 32, new: int = 96, rows: int = 48) -> float:
    """Perplexity of the ``new`` tokens after a ``prompt``-token prefix, scored inside ``lightning_superpipe.generate``
    (teacher-forced): exactly what ``generate`` computes with
    ``GenerationPolicy(compress_weights=..., compress_kv=...)``."""
    text = held_out[: rows * (prompt + new)].view(rows, prompt + new)
    forcing = TeacherForcing(text[:, :prompt], text[:, prompt:])
    policy = GenerationPolicy(micro_batch_size=rows // 3, compress_weights=compress_weights, compress_kv=compress_kv)
    out = generate(model, text[:, :prompt], policy, max_new_tokens=new, logits_processor=LogitsProcessorList([forcing]))
    assert torch.equal(out.sequences, text), "the forced continuation must be what generate decoded"
    return forcing.perplexity


@torch.no_grad()
def key_value_errors(model: Any, held_out: torch.Tensor, seq: int = 128) -> dict[str, Any]:
    """FlexGen's relative RMS error of the 4-bit round trip of keys (after RoPE) and values, and how outlying the
    largest channel of a 64-wide head group is (per-channel RMS, max over median), per layer."""
    cache = DynamicCache(config=model.config)
    model(input_ids=held_out[:seq].unsqueeze(0), past_key_values=cache, use_cache=True)
    out: dict[str, Any] = {"keys_error": [], "values_error": [], "keys_channel_max_over_median": [],
                           "values_channel_max_over_median": []}
    for layer in cache.layers:
        for name, tensor in (("keys", layer.keys), ("values", layer.values)):
            rebuilt = compression.decompress(compression.compress(tensor, -1))
            out[f"{name}_error"].append(compression.relative_rms_error(rebuilt, tensor))
            channel_rms = tensor.float().pow(2).mean(dim=(0, 2)).sqrt()  # [heads, head_dim]
            ratio = (channel_rms.max(dim=-1).values / channel_rms.median(dim=-1).values).max().item()
            out[f"{name}_channel_max_over_median"].append(ratio)
    return out


def compression_quality(args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity with FlexGen's 4-bit weights and cache, over training seeds, measured as ``generate`` runs."""
    per_seed = []
    for seed in range(args.seeds):
        started = time.perf_counter()
        model, held_out = train_small_model(args.train_steps, seed=seed)
        trained_s = time.perf_counter() - started
        found: dict[str, Any] = {"seed": seed, "train_seconds": trained_s}
        for name, cw, ckv in (("exact", False, False), ("weights", True, False), ("kv", False, True),
                              ("both", True, True)):
            found[f"generate_ppl_{name}"] = generate_perplexity(model, held_out, cw, ckv)
        exact = chunked_perplexity(model, held_out, compress_kv=False)
        quantized = compress_block_weights(model)
        found["chunked_ppl_exact"] = exact
        found["chunked_ppl_weights"] = chunked_perplexity(quantized, held_out, compress_kv=False)
        found["chunked_ppl_kv"] = chunked_perplexity(model, held_out, compress_kv=True)
        found["chunked_ppl_both"] = chunked_perplexity(quantized, held_out, compress_kv=True)
        # The first version's measurement: rows of 256 positions (twice the 128 the model was trained on) and the
        # in-place round trip.
        old: dict[str, Any] = dict(seq=256, rows=24, first_version=True)
        found["first_version_ppl_exact"] = chunked_perplexity(model, held_out, compress_kv=False, **old)
        found["first_version_ppl_weights"] = chunked_perplexity(quantized, held_out, compress_kv=False, **old)
        found["first_version_ppl_kv"] = chunked_perplexity(model, held_out, compress_kv=True, **old)
        found["first_version_ppl_both"] = chunked_perplexity(quantized, held_out, compress_kv=True, **old)
        for kind in ("generate", "chunked", "first_version"):
            for name in ("weights", "kv", "both"):
                found[f"{kind}_change_{name}"] = found[f"{kind}_ppl_{name}"] / found[f"{kind}_ppl_exact"] - 1
        found.update(key_value_errors(model, held_out))
        print(json.dumps({"seed": found}, default=float), flush=True)
        per_seed.append(found)
    summary: dict[str, Any] = {}
    for kind in ("generate", "chunked", "first_version"):
        for name in ("weights", "kv", "both"):
            values = torch.tensor([f[f"{kind}_change_{name}"] for f in per_seed], dtype=torch.float64)
            summary[f"{kind}_change_{name}_mean"] = values.mean().item()
            summary[f"{kind}_change_{name}_std"] = values.std().item() if len(values) > 1 else 0.0
            summary[f"{kind}_change_{name}_min"] = values.min().item()
            summary[f"{kind}_change_{name}_max"] = values.max().item()
    model, held_out = train_small_model(args.train_steps, seed=0)
    ids = held_out[: 16 * 64].view(16, 64)
    plain = generate(model, ids, GenerationPolicy(micro_batch_size=8), max_new_tokens=16)
    packed = generate(model, ids, GenerationPolicy(micro_batch_size=8, compress_weights=True, compress_kv=True),
                      max_new_tokens=16)
    moved = lambda out: sum(out.stats["h2d_bytes"].values()) + sum(out.stats["d2h_bytes"].values())  # noqa: E731
    return {
        "model": "llama 4 x 128 (head_dim 64), fp32, trained here", "train_steps": args.train_steps,
        "seeds": args.seeds, "per_seed": per_seed, **summary,
        "bytes_moved_ratio": moved(packed) / moved(plain),
        "h2d_weights_ratio": packed.stats["h2d_bytes"]["weights"] / plain.stats["h2d_bytes"]["weights"],
        "h2d_cache_ratio": packed.stats["h2d_bytes"]["cache"] / plain.stats["h2d_bytes"]["cache"],
        "greedy_token_agreement": (packed.sequences[:, 64:] == plain.sequences[:, 64:]).float().mean().item(),
    }


def compress_block_weights(model: Any) -> Any:
    """A copy of ``model`` with every block matrix replaced by its 4-bit round trip (groups along the output dim)."""
    import copy

    quantized = copy.deepcopy(model)
    for block in quantized.model.layers:
        for module in block.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and compression.group_size_for(weight.shape[0]):
                module.weight.data = compression.decompress(compression.compress(weight.data, 0))
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=5, help="training seeds of the compression part")
    parser.add_argument("--parts", default="bytes_per_token,overlap,compression", help="comma-separated parts to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {}
    parts = (("bytes_per_token", bytes_per_token), ("overlap", overlap), ("compression", compression_quality))
    for name, part in parts:
        if name not in args.parts.split(","):
            continue
        started = time.perf_counter()
        report[name] = part(args)
        report[name]["wall_s"] = time.perf_counter() - started
        print(json.dumps({name: report[name]}, indent=2, default=float), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2, default=float)


if __name__ == "__main__":
    main()
