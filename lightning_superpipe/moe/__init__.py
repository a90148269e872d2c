"""Paged MoE precision: expert weights paged as bit planes between device and host under a budget.

``page_experts(model, budget_bytes=...)`` converts any ``transformers`` model whose experts go through its
experts interface (found structurally; shared experts included) in place
and returns a :class:`PagedExperts` handle; :class:`PagedMoECallback` does the same around
Lightning's validation, test and predict loops.
"""

from lightning_superpipe.moe.api import PagedExperts, expert_parameters, full_expert_bytes, kv_cache_bytes, page_experts
from lightning_superpipe.moe.callback import PagedMoECallback
from lightning_superpipe.moe.layouts import SUPPORTED_MODEL_TYPES, UnsupportedMoEModelError
from lightning_superpipe.moe.pages import TOP_LEVEL, PageKey

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TOP_LEVEL",
    "PageKey",
    "PagedMoECallback",
    "PagedExperts",
    "UnsupportedMoEModelError",
    "expert_parameters",
    "full_expert_bytes",
    "kv_cache_bytes",
    "page_experts",
]
