"""A causal LM's head and cross-entropy over chunks of tokens, recomputed chunk by chunk in backward.

At long context the logits are the largest tensor of a step: ``tokens x vocabulary`` in float32 (19.9 GB at 32k
tokens for a 152k vocabulary), twice that with their gradient. Here each chunk's logits live only while its loss is
computed: the chunk's loss is checkpointed (``torch.utils.checkpoint``, non-reentrant), so backward recomputes the
chunk's logits, takes their gradient and frees them before the next chunk. The head is called as a module, so a
LoRA adapter on it, a tied embedding or the strategy's hooks on it work as they do unchunked.

The loss is ``transformers``' ``ForCausalLMLoss`` (labels shifted by one, ``ignore_index``, the mean over the
counted tokens or the sum over ``num_items_in_batch``) summed in another order: equal to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: the logits of 1024 tokens of a 152k vocabulary are 0.6 GB in float32."""


def chunked_cross_entropy(
    hidden_states: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    logits_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The causal LM loss of ``head(hidden_states)`` against ``labels``, never holding more than one chunk's logits.

    Args:
        hidden_states: ``[batch, tokens, hidden]``, the decoder's last hidden states.
        head: The output layer (``model.get_output_embeddings()``), called on ``[chunk, hidden]`` slices.
        labels: ``[batch, tokens]`` token ids, shifted here as ``transformers`` shifts them (the last position
            predicts nothing); ``ignore_index`` where no loss is taken.
        shift_labels: Labels already aligned with ``hidden_states`` (instead of ``labels``).
        chunk_tokens: Tokens whose logits are computed at once.
        ignore_index: The label of positions without loss.
        num_items_in_batch: Divide the summed loss by this (gradient accumulation); default: the mean over the
            counted tokens.
        logits_transform: Applied to each chunk's float32 logits before the loss (a family's soft-capping or
            scaling).

    Returns:
        The scalar loss.

    Raises:
        ValueError: Neither or both of ``labels`` and ``shift_labels``, shapes that disagree, or ``chunk_tokens``
            below 1.
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("chunked_cross_entropy takes one of labels= (shifted here) or shift_labels= (aligned)")
    if chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy(chunk_tokens={chunk_tokens}) needs at least one token per chunk")
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"chunked_cross_entropy: labels of shape {tuple(shift_labels.shape)} for hidden states of shape "
            f"{tuple(hidden_states.shape)}; they must agree on every dimension but the last"
        )
    flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(hidden_states.device)
    total = hidden_states.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(
            _chunk_loss,
            flat_hidden[start:end],
            flat_labels[start:end],
            head,
            ignore_index,
            logits_transform,
            use_reentrant=False,
        )
    if num_items_in_batch is None:
        return total / (flat_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    ignore_index: int,
    logits_transform: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    logits = head(hidden).float()
    if logits_transform is not None:
        logits = logits_transform(logits)
    return nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def logits_transform_of(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a ``transformers`` family does to the head's output before the loss, read from its config.

    Gemma 2 and 3 soft-cap the logits (``final_logit_softcapping``); Cohere scales them (``logit_scale``).
    """
    transforms: list[Callable[[torch.Tensor], torch.Tensor]] = []
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        transforms.append(lambda logits: logits * scale)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        transforms.append(lambda logits: torch.tanh(logits / cap) * cap)
    if not transforms:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in transforms:
            logits = step(logits)
        return logits

    return transform


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """``model(input_ids, labels=labels).loss`` of a ``transformers`` causal LM, its logits computed chunk by chunk.

    The decoder runs as the model's own forward runs it (``model_kwargs``: ``attention_mask``, ``position_ids``,
    ...); the head is ``model.get_output_embeddings()`` (a LoRA-wrapped head included), the family's logit
    scaling or soft-capping applied as its forward applies it.

    Args:
        model: A ``transformers`` causal LM (a ``peft`` model around one included).
        input_ids: ``[batch, tokens]``.
        labels: ``[batch, tokens]``, shifted as ``transformers`` shifts them.
        chunk_tokens: Tokens whose logits are computed at once.
        ignore_index: The label of positions without loss.
        num_items_in_batch: As ``transformers``' loss takes it.
        **model_kwargs: Passed to the decoder.

    Returns:
        The scalar loss.
    """
    causal_lm = _causal_lm(model)
    decoder = causal_lm.get_decoder()
    head = causal_lm.get_output_embeddings()
    if decoder is None or head is None:
        raise ValueError(
            f"causal_lm_loss needs a transformers causal LM with a decoder and an output layer; "
            f"{type(causal_lm).__name__} has {'no decoder' if decoder is None else 'no output embeddings'}"
        )
    model_kwargs.setdefault("use_cache", False)  # a training step: no key/value cache to build
    hidden_states = decoder(input_ids=input_ids, **model_kwargs).last_hidden_state
    return chunked_cross_entropy(
        hidden_states,
        head,
        labels,
        chunk_tokens=chunk_tokens,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        logits_transform=logits_transform_of(causal_lm.config),
    )


def _causal_lm(model: nn.Module) -> Any:
    """The ``transformers`` model inside a ``peft`` wrapper (its modules, adapters included, are the same)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


_UNCHUNKED_FORWARD = "_superpipe_unchunked_forward"


def chunk_causal_lm_loss(model: nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> nn.Module:
    """Make ``model(input_ids, labels=labels)`` compute its loss with :func:`causal_lm_loss`.

    A call with ``labels`` (and without ``logits_to_keep``, ``inputs_embeds`` or a cache) returns the loss with
    ``logits=None``: the whole sequence's logits are what this avoids. A call without labels (generation,
    validation that reads logits) runs the model's own forward. The model's ``forward`` is replaced on the instance
    (its parameters, hooks and checkpoint keys stay as they were); :func:`unchunk_causal_lm_loss` puts it back.

    Args:
        model: A ``transformers`` causal LM, or a ``peft`` model around one.
        chunk_tokens: Tokens whose logits are computed at once.

    Returns:
        The model, changed in place.

    Raises:
        ValueError: ``chunk_tokens`` below 1, or a model that is not a causal LM with a decoder and a head.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_causal_lm_loss(chunk_tokens={chunk_tokens}) needs at least one token per chunk")
    causal_lm = _causal_lm(model)
    if not callable(getattr(causal_lm, "get_decoder", None)) or causal_lm.get_output_embeddings() is None:
        raise ValueError(
            f"chunk_causal_lm_loss needs a transformers causal LM with a decoder and an output layer; got "
            f"{type(causal_lm).__name__}"
        )
    own = causal_lm.__dict__.get(_UNCHUNKED_FORWARD) or causal_lm.forward
    setattr(causal_lm, _UNCHUNKED_FORWARD, own)

    def forward(
        input_ids: torch.Tensor | None = None, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        whole = (
            args
            or labels is None
            or input_ids is None
            or any(kwargs.get(name) is not None for name in ("inputs_embeds", "past_key_values", "cache"))
            or kwargs.get("logits_to_keep", 0) != 0
        )
        if whole:
            return own(input_ids, *args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        loss = causal_lm_loss(causal_lm, input_ids, labels, chunk_tokens=chunk_tokens, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    causal_lm.forward = forward
    return model


def unchunk_causal_lm_loss(model: nn.Module) -> bool:
    """Give a model :func:`chunk_causal_lm_loss` changed its own ``forward`` back; whether it had been changed."""
    causal_lm = _causal_lm(model)
    if _UNCHUNKED_FORWARD not in causal_lm.__dict__:
        return False
    del causal_lm.__dict__["forward"]
    del causal_lm.__dict__[_UNCHUNKED_FORWARD]
    return True
