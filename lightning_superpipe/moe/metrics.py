"""Quality of paged experts against full precision: perplexity change and KL divergence."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torchmetrics.regression import KLDivergence
from torchmetrics.text import Perplexity

__all__ = ["IGNORE_INDEX", "QualityMeter"]

IGNORE_INDEX = -100
"""Label value of positions that are not scored (``transformers``' convention)."""


class QualityMeter:
    """Accumulates next-token perplexity of paged and full-precision logits and their KL divergence.

    ``KL(full || paged)`` is averaged over scored positions; perplexities are token-weighted.
    """

    def __init__(self) -> None:
        self.ppl_paged = Perplexity(ignore_index=IGNORE_INDEX)
        self.ppl_full = Perplexity(ignore_index=IGNORE_INDEX)
        self.kl = KLDivergence(log_prob=True)
        self.tokens = 0

    def to(self, device: torch.device | str) -> QualityMeter:
        """Move the metric states to ``device``."""
        for metric in (self.ppl_paged, self.ppl_full, self.kl):
            metric.to(device)
        return self

    def update(self, logits: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch.

        Args:
            logits: ``[batch, seq, vocab]`` logits of the paged model.
            reference: Same, with full-precision experts.
            labels: ``[batch, seq]`` token ids (``IGNORE_INDEX`` where not scored); position ``t``
                is scored on predicting ``labels[:, t + 1]``.
        """
        target = labels[:, 1:]
        paged, full = logits[:, :-1].float(), reference[:, :-1].float()
        self.ppl_paged.update(paged, target)
        self.ppl_full.update(full, target)
        keep = target.reshape(-1) != IGNORE_INDEX
        vocab = paged.shape[-1]
        self.kl.update(
            F.log_softmax(full.reshape(-1, vocab)[keep], dim=-1),
            F.log_softmax(paged.reshape(-1, vocab)[keep], dim=-1),
        )
        self.tokens += int(keep.sum())

    def compute(self) -> dict[str, float]:
        """``ppl_paged``, ``ppl_full``, ``ppl_change`` (relative) and ``kl_to_full`` (nats/token)."""
        ppl_paged, ppl_full = self.ppl_paged.compute().item(), self.ppl_full.compute().item()
        return {
            "ppl_paged": ppl_paged,
            "ppl_full": ppl_full,
            "ppl_change": ppl_paged / ppl_full - 1.0,
            "kl_to_full": self.kl.compute().item(),
        }
