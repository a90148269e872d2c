"""Host bytes page-locked for a model's homes: PyTorch's caching host allocator (``pin_memory()``) against the arena.

For each model (built on the meta device from its config: nothing is allocated or downloaded) it sums, over the
buffers the strategy pins (every block's fp32 masters and bf16 transfer copy under ``bf16-mixed``, the trunk's
masters, two gradient staging buffers of a block), the bytes requested, the bytes the caching host allocator would
reserve (each request rounded up to a power of two, as its allocator does) and the bytes the arena allocates (each
rounded up to a page). With a GPU, ``tests/test_host_arena.py`` checks that the arena's bytes are what is pinned.

Usage:
    python benchmarks/pinned_memory.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightning_superpipe.memory.host import ALIGNMENT
from lightning_superpipe.memory.pinned import caching_allocator_bytes, page_rounded
from lightning_superpipe.streaming.blocks import assign_parameters, find_blocks

MODELS = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256),
    "the recipes' default (6 x 256)": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                           num_attention_heads=4, num_key_value_heads=4, vocab_size=260),
}


def pinned_requests(config: dict[str, int]) -> list[int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **config))
    blocks = find_blocks(model)
    block_params, trunk_params = assign_parameters(model, blocks, mixed_precision=True)  # bf16-mixed
    requests = []
    for params in block_params:
        numel = sum(-(-p.numel() // ALIGNMENT) * ALIGNMENT for p in params)
        requests += [numel * 4, numel * 2]  # fp32 masters, bf16 transfer copy
    requests += [p.numel() * 4 for p in trunk_params]
    largest = max(sum(p.numel() for p in params) for params in block_params)
    requests += [largest * 2, largest * 2]  # gradient staging, bf16
    return requests


def main() -> None:
    rows = []
    for name, config in MODELS.items():
        requests = pinned_requests(config)
        requested = sum(requests)
        caching = sum(caching_allocator_bytes(n) for n in requests)
        arena = sum(page_rounded(n) for n in requests)
        rows.append(
            dict(model=name, buffers=len(requests), requested=requested, caching_allocator=caching, arena=arena)
        )
    lines = [
        "| model | pinned buffers | requested | caching host allocator | arena |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['buffers']} | {r['requested'] / 2**30:.2f} GiB"
            f" | {r['caching_allocator'] / 2**30:.2f} GiB"
            f" (+{100 * (r['caching_allocator'] / r['requested'] - 1):.1f}%) | {r['arena'] / 2**30:.2f} GiB"
            f" (+{100 * (r['arena'] / r['requested'] - 1):.3f}%) |"
        )
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pinned_memory.md").write_text("\n".join(lines) + "\n")
    (out / "pinned_memory.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
