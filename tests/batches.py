"""Random batches for the test models: nothing downloaded, the same batches for the same seed.

Two shapes: the :mod:`tests.families` models take micro-batches that are dicts of tensors (``lm_data``,
``seq2seq_data``, ``image_data``, ``vector_data``, ``vlm_data``, one per :attr:`Family.kind
<tests.families.Family.kind>`); the quick examples of :mod:`tests.tasks` take tuples (:func:`data`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96  # token ids of the LMs; ids below FIRST_TOKEN are kept for special tokens
FIRST_TOKEN = 4
SEQ = 16  # tokens per row of the LMs
BATCH = 4  # rows per micro-batch (the MoE LMs use 2 x 8 tokens, so that some experts get none)

def _loader(rows: Sequence[Mapping[str, Tensor]], batch_size: int) -> DataLoader:
    # A list of dicts: the default collate stacks them into one dict per micro-batch.
    return DataLoader(list(rows), batch_size=batch_size, shuffle=False)


def _tokens(generator: torch.Generator, shape: tuple[int, ...], vocab: int = VOCAB) -> Tensor:
    return torch.randint(FIRST_TOKEN, vocab, shape, generator=generator)


def _lengths(generator: torch.Generator, rows: int, seq: int) -> Tensor:
    """Per row of a micro-batch: the first row is full, every other one is padded (half to seq - 1 tokens)."""
    lengths = torch.randint(seq // 2, seq, (rows,), generator=generator)
    lengths[0] = seq
    return lengths


def _pad(ids: Tensor, length: int, side: str, pad_id: int) -> tuple[Tensor, Tensor]:
    seq = ids.shape[0]
    mask = torch.zeros(seq, dtype=torch.long)
    if side == "right":
        mask[:length] = 1
    else:
        mask[seq - length :] = 1
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad_id)), mask


def lm_data(
    batches: int, seed: int, *, padding: str | None = None, pad_id: int = 0, batch_size: int = BATCH, seq: int = SEQ,
    vocab: int = VOCAB,
) -> DataLoader:
    """Random token rows for a causal LM; with ``padding``, rows but the first of each micro-batch are padded."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batches):
        lengths = _lengths(generator, batch_size, seq)
        for i in range(batch_size):
            ids = _tokens(generator, (seq,), vocab)
            if padding is None:
                rows.append({"input_ids": ids, "labels": ids.clone()})
                continue
            ids, mask = _pad(ids, int(lengths[i]), padding, pad_id)
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return _loader(rows, batch_size)


def seq2seq_data(
    batches: int, seed: int, *, padding: str | None = None, pad_id: int = 0, batch_size: int = BATCH,
    source: int = SEQ, target: int = SEQ // 2,
) -> DataLoader:
    """Source rows of ``source`` tokens and target rows of ``target`` tokens (the model builds the decoder
    inputs from ``labels``); with ``padding``, sources are padded on that side and targets on the right."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batches):
        source_lengths = _lengths(generator, batch_size, source)
        target_lengths = _lengths(generator, batch_size, target)
        for i in range(batch_size):
            ids, labels = _tokens(generator, (source,)), _tokens(generator, (target,))
            if padding is None:
                rows.append({"input_ids": ids, "labels": labels})
                continue
            ids, mask = _pad(ids, int(source_lengths[i]), padding, pad_id)
            labels[int(target_lengths[i]) :] = -100
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return _loader(rows, batch_size)


def image_data(batches: int, seed: int, *, size: int = 16, classes: int = 5, batch_size: int = BATCH) -> DataLoader:
    """Random RGB images of ``size`` x ``size`` pixels and their class labels."""
    generator = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    images = torch.randn(n, 3, size, size, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    return _loader([{"pixel_values": images[i], "labels": labels[i]} for i in range(n)], batch_size)


def vector_data(
    batches: int, seed: int, *, features: int = 12, classes: int = 3, batch_size: int = BATCH
) -> DataLoader:
    """Random feature vectors (``x``) and their class labels, for the plain torch models."""
    generator = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    x = torch.randn(n, features, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    return _loader([{"x": x[i], "labels": labels[i]} for i in range(n)], batch_size)


def vlm_data(
    batches: int, seed: int, *, image_token: int, image_tokens: int, image_size: int, batch_size: int = 2,
    text: int = 8, vocab: int = VOCAB, prompt: int | None = None,
) -> DataLoader:
    """Rows ``[bos, image_token x image_tokens, text...]`` with one image each; ``labels`` are -100 on the
    image tokens. Text ids avoid ``image_token``. With ``prompt``, the first ``prompt`` text tokens are a prompt:
    ``token_type_ids`` are 0 on the bos, image and prompt tokens and 1 on the rest, and ``labels`` -100 on the
    prompt too (PaliGemma's processor's layout: its prefix attends bidirectionally in training)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batches * batch_size):
        words = _tokens(generator, (text,), vocab)
        words = torch.where(words == image_token, torch.full_like(words, FIRST_TOKEN), words)
        ids = torch.cat([torch.tensor([1]), torch.full((image_tokens,), image_token), words])
        labels = ids.clone()
        prefix = 1 + image_tokens + (prompt or 0)
        labels[:prefix] = -100
        pixels = torch.randn(3, image_size, image_size, generator=generator)
        row = {"input_ids": ids, "pixel_values": pixels, "labels": labels}
        if prompt is not None:
            row["token_type_ids"] = (torch.arange(ids.shape[0]) >= prefix).long()
        rows.append(row)
    return _loader(rows, batch_size)


def data(kind: str, batches: int = 24, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Batches of tuples for the quick examples (:data:`tests.tasks.EXAMPLES`): ``(ids,)`` for ``"lm"`` (token ids
    from 0), ``(images, labels)`` for ``"image"`` (5 classes), ``(x, labels)`` for ``"vector"`` (3 classes)."""
    generator = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    if kind == "lm":
        dataset = TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=generator))
    elif kind == "image":
        images = torch.randn(n, 3, 16, 16, generator=generator)
        dataset = TensorDataset(images, torch.randint(0, 5, (n,), generator=generator))
    else:
        dataset = TensorDataset(torch.randn(n, 12, generator=generator), torch.randint(0, 3, (n,), generator=generator))
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)
