"""Paged MoE precision: expert weights paged as bit planes between device and host under a budget of expert bytes.

``page_experts(model, expert_budget="30%")`` converts any ``transformers`` model whose experts go through its
experts interface (found structurally; shared experts included) in place
and returns a :class:`PagedExperts` handle; :class:`PagedMoECallback` does the same around
Lightning's validation, test and predict loops. :class:`PagingOptions` holds the codes', pages' and planner's
settings.
"""

from lightning_superpipe.moe.api import PagedExperts, expert_parameters, full_expert_bytes, kv_cache_bytes, page_experts
from lightning_superpipe.moe.callback import PagedMoECallback
from lightning_superpipe.moe.host_pages import TOP_LEVEL, PageKey
from lightning_superpipe.moe.layouts import SUPPORTED_MODEL_TYPES, UnsupportedMoEModelError
from lightning_superpipe.moe.options import DEFAULT_LEVELS, PagingOptions

__all__ = [
    "DEFAULT_LEVELS",
    "SUPPORTED_MODEL_TYPES",
    "TOP_LEVEL",
    "PageKey",
    "PagedExperts",
    "PagedMoECallback",
    "PagingOptions",
    "UnsupportedMoEModelError",
    "expert_parameters",
    "full_expert_bytes",
    "kv_cache_bytes",
    "page_experts",
]
