"""Small, self-contained MoE models and real text for tests, examples and benchmarks.

Nothing here downloads anything: models are built from ``transformers`` configs with random
weights and the text is the English documentation that CPython ships in ``pydoc_data.topics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["byte_corpus", "byte_batches", "tiny_moe", "train_tiny_moe"]


def byte_corpus() -> torch.Tensor:
    """Return CPython's bundled documentation as a 1-D tensor of byte tokens (vocabulary of 256).

    Returns:
        A ``torch.long`` tensor of about 0.47 M tokens, one per UTF-8 byte.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def byte_batches(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Yield an endless stream of random windows of ``tokens``.

    Args:
        tokens: 1-D token tensor, e.g. from :func:`byte_corpus`.
        batch_size: Windows per batch.
        seq_len: Tokens per window.
        generator: Source of randomness, so that streams are reproducible.

    Yields:
        ``[batch_size, seq_len]`` ``torch.long`` tensors.
    """
    offsets = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size, 1), generator=generator)
        yield tokens[starts + offsets]


def tiny_moe(
    model_type: str = "mixtral",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    vocab_size: int = 256,
    seed: int = 0,
    **overrides: object,
) -> nn.Module:
    """Build a small randomly initialised MoE causal LM (Mixtral-, Qwen-MoE- or OLMoE-shaped configs).

    Args:
        model_type: ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"`` or ``"olmoe"`` (or any other
            ``transformers`` model type, e.g. to check that unsupported layouts are refused).
        hidden_size: Model width.
        intermediate_size: Width of each routed expert (and of Qwen2-MoE's shared expert).
        num_layers: Decoder layers.
        num_experts: Routed experts per layer.
        top_k: Experts per token.
        vocab_size: Vocabulary size (256 for byte tokens).
        seed: Seed of the weight initialisation.
        **overrides: Further config attributes.

    Returns:
        The model in evaluation mode, in float32 on the CPU, with the ``eager`` experts
        implementation (the reference that paged outputs are compared to).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=intermediate_size,
        shared_expert_intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        num_local_experts=num_experts,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        # Byte vocabularies have no special tokens; the families' defaults point past 256.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    return model.eval()


def train_tiny_moe(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    steps: int = 300,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` briefly on random windows of ``tokens`` (AdamW, cosine schedule).

    Args:
        model: A causal LM such as one from :func:`tiny_moe`.
        tokens: 1-D training tokens.
        steps: Optimiser steps.
        batch_size: Windows per step.
        seq_len: Tokens per window.
        lr: Peak learning rate.
        seed: Seed of the data order.

    Returns:
        The training loss of every step.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = byte_batches(tokens, batch_size=batch_size, seq_len=seq_len, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    for _ in range(steps):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses
