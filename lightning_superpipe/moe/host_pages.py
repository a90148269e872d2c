"""The host side of the page store: expert weights cut into pages, each with its master copy in host memory.

Every page (a block of output rows of one expert's projection) keeps its original weights, its 8 bit planes and
its group metadata per bit level in host memory (pinned on CUDA), cut from each weight's canonical ``[E, out, in]``
view so that quantization groups run along the input dimension whatever the family's layout. What of it is on the
device, and the moves between levels, are :class:`~lightning_superpipe.moe.pages.PageStore`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_superpipe.moe.copies import DeviceCopy
from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.quantization import (
    CODE_BITS,
    PageableCodes,
    dequantize,
    metadata_dtype,
    pack_bit_planes,
    quantize_pageable,
)

__all__ = ["TOP_LEVEL", "HostPages", "Page", "PageKey"]

TOP_LEVEL = 16
"""Level of a page whose original weights are on the device. Reported as 16 bits whatever the
model's dtype; its device bytes are the real size of the original weights."""

WEIGHTED_ERROR_ELEMENTS = 1 << 24
"""Weights of the experts :meth:`HostPages.weighted_errors` rebuilds at once (a few float32 copies of them, 64 MiB
each): all of a projection's experts up to this size, one at a time beyond it."""


@dataclass(frozen=True)
class PageKey:
    """Where a page's weights live in the model.

    Args:
        layer: Index of the paged unit (a layer's routed experts, or its shared expert).
        proj: Index in the unit's ``projections`` (routed: 0 ``gate_up_proj``/``up_proj``, 1
            ``down_proj``; shared: 0 ``gate_proj``, 1 ``up_proj``, 2 ``down_proj``).
        expert: Expert index within the layer.
        block: Row block index within the projection.
    """

    layer: int
    proj: int
    expert: int
    block: int


class Page:
    """One page: its host master copy and its device copy.

    Args:
        key: Location of the page.
        host_weight: Original weights ``[rows, cols]`` in host memory.
        host_planes: ``uint8`` bit planes ``[8, rows * cols // 8]`` in host memory.
        host_scale: Group scales per bit level ``[bit levels, rows, groups]`` in host memory (the
            store's bit levels, highest first).
        host_minimum: Group minima, same shape.
        meta_index: Index in ``host_scale`` of every bit level.
    """

    def __init__(
        self,
        key: PageKey,
        host_weight: torch.Tensor,
        host_planes: torch.Tensor,
        host_scale: torch.Tensor,
        host_minimum: torch.Tensor,
        meta_index: dict[int, int],
    ) -> None:
        self.key = key
        self.host_weight = host_weight
        self.host_planes = host_planes
        self.host_scale = host_scale
        self.host_minimum = host_minimum
        self.meta_index = meta_index
        self.current: DeviceCopy | None = None
        self.pending: DeviceCopy | None = None

    @property
    def shape(self) -> torch.Size:
        """Shape of the page's weights, ``[rows, cols]``."""
        return self.host_weight.shape

    @property
    def level(self) -> int:
        """Precision the page computes at now (0 before it was first placed)."""
        return self.current.level if self.current is not None else 0

    @property
    def target_level(self) -> int:
        """Precision the page is at or on its way to."""
        return self.pending.level if self.pending is not None else self.level

    def device_nbytes(self) -> int:
        """Device bytes of the page, including an upload in flight."""
        held = self.current.nbytes() if self.current is not None else 0
        return held + (self.pending.nbytes() if self.pending is not None else 0)

    def bytes_at(self, level: int) -> int:
        """Device bytes the page holds once settled at ``level``."""
        if level == TOP_LEVEL:
            return self.host_weight.nbytes
        plane_bytes = self.host_planes.shape[-1] * level
        return plane_bytes + self.meta_nbytes()

    def meta_nbytes(self) -> int:
        """Device bytes of one level's scale and minimum."""
        return self.host_scale[0].nbytes + self.host_minimum[0].nbytes

    def meta(self, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host scale and minimum of bit level ``level``, ``[rows, groups]`` each."""
        index = self.meta_index[level]
        return self.host_scale[index], self.host_minimum[index]


class HostPages:
    """Every page's host master copy: original weights, bit planes and metadata, built from the model's experts.

    Args:
        layers: The model's paged units; their weights are read, not modified.
        device: Device that computes with the experts (host memory is pinned for a CUDA one).
        group_size: Columns (input features) per quantization group.
        levels: Allowed levels, ``TOP_LEVEL`` and bit counts in ``1 .. 8`` (8 is always included).
        rows_per_page: Rows (output features) of a projection per page (``None``: one page per
            expert and projection). Must divide the output size of every projection.
    """

    def __init__(
        self,
        layers: list[MoELayer],
        *,
        device: torch.device,
        group_size: int,
        levels: Iterable[int],
        rows_per_page: int | None,
    ) -> None:
        self.device = torch.device(device)
        self.levels = _check_levels(levels)
        self.group_size = group_size
        self.rows_per_page = rows_per_page
        # Segment boundaries of the bit planes: every level <= 8 and 0.
        self._bounds = sorted({0, *(b for b in self.levels if b != TOP_LEVEL)})
        self._bit_levels = tuple(b for b in self.levels if b != TOP_LEVEL)  # highest first
        self._meta_index = {b: i for i, b in enumerate(self._bit_levels)}
        self._meta_dtype: dict[tuple[int, int], torch.dtype] = {}
        self.pages: list[Page] = []
        self._index: dict[tuple[int, int, int], list[Page]] = {}
        self._page_ids: dict[tuple[int, int], list[int]] = {}
        self._transposed: dict[tuple[int, int], bool] = {}
        self._host_weights: dict[tuple[int, int], torch.Tensor] = {}
        self._host_planes: dict[tuple[int, int], torch.Tensor] = {}
        self._host_meta: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in layers:
            for proj in range(len(layer.projections)):
                self._add_projection(layer, proj)

    # ------------------------------------------------------------------ building
    def _add_projection(self, layer: MoELayer, proj: int) -> None:
        key = (layer.index, proj)
        param = layer.weight(proj).detach()
        transposed = layer.transposed
        canonical = param.mT if transposed else param  # [E, rows (out), cols (in)]
        num_experts, rows, cols = canonical.shape
        rows_per_page = self.rows_per_page or rows
        if rows % rows_per_page:
            raise ValueError(
                f"rows_per_page={rows_per_page} must divide the output size of every expert projection; "
                f"{layer.projections[proj]} of {layer.name} has {rows}. Use a common divisor "
                f"(e.g. {math.gcd(rows, rows_per_page)}) or None for one page per expert and projection."
            )
        blocks = rows // rows_per_page
        pin = self.device.type == "cuda"
        meta_dtype = metadata_dtype(param)
        host_weight = _to_host(param, pin)  # the model's own layout, so that restore is exact
        host_canonical = host_weight.mT if transposed else host_weight
        page_numel = rows_per_page * cols
        host_planes = _host_empty((num_experts, blocks, CODE_BITS, page_numel // 8), torch.uint8, pin)
        bit_levels = self._bit_levels
        first = quantize_pageable(canonical[0], self.group_size, bit_levels, meta_dtype)  # checks group_size first
        groups = first.scale.shape[-1]
        host_scale = _host_empty((len(bit_levels), num_experts, rows, groups), meta_dtype, pin)
        host_minimum = _host_empty((len(bit_levels), num_experts, rows, groups), meta_dtype, pin)
        self._meta_dtype[key] = meta_dtype
        # One expert at a time bounds the float32 working memory of quantization; groups run along
        # the input dimension of the canonical view, whichever way the family stores the weight.
        for expert in range(num_experts):
            codes = (
                first if expert == 0 else quantize_pageable(canonical[expert], self.group_size, bit_levels, meta_dtype)
            )
            self._write_codes(host_planes, host_scale, host_minimum, expert, codes)
        self._host_weights[key] = host_weight
        self._host_planes[key] = host_planes
        self._host_meta[key] = (host_scale, host_minimum)
        self._transposed[key] = transposed
        self._page_ids[key] = []
        for expert in range(num_experts):
            pages = []
            for block in range(blocks):
                rows_slice = slice(block * rows_per_page, (block + 1) * rows_per_page)
                page = Page(
                    PageKey(layer.index, proj, expert, block),
                    host_canonical[expert, rows_slice],
                    host_planes[expert, block],
                    host_scale[:, expert, rows_slice],
                    host_minimum[:, expert, rows_slice],
                    self._meta_index,
                )
                pages.append(page)
                self._page_ids[key].append(len(self.pages))
                self.pages.append(page)
            self._index[(layer.index, proj, expert)] = pages

    def _write_codes(
        self,
        host_planes: torch.Tensor,
        host_scale: torch.Tensor,
        host_minimum: torch.Tensor,
        expert: int | slice,
        codes: PageableCodes,
    ) -> None:
        """Store the codes of one expert (or a slice of experts) as bit planes and their metadata per bit level
        (host order)."""
        planes = host_planes[expert]
        planes.copy_(pack_bit_planes(codes.codes.reshape(*planes.shape[:-2], -1)))
        for level, index in self._meta_index.items():
            width = codes.widths.index(level)
            host_scale[index, expert].copy_(codes.scale[width])
            host_minimum[index, expert].copy_(codes.minimum[width])

    def host_weight(self, layer: int, proj: int) -> torch.Tensor:
        """Host master copy of one fused projection in the model's layout (the original weights)."""
        return self._host_weights[(layer, proj)]

    def canonical_host_weight(self, layer: int, proj: int) -> torch.Tensor:
        """:meth:`host_weight` seen as ``[E, out, in]`` (a transpose for transposed layouts)."""
        weight = self._host_weights[(layer, proj)]
        return weight.mT if self._transposed[(layer, proj)] else weight

    def projections(self) -> list[tuple[int, int]]:
        """``(layer, proj)`` of every paged projection."""
        return list(self._host_weights)

    def weighted_errors(
        self, layer: int, proj: int, row_weight: torch.Tensor | None, col_weight: torch.Tensor | None
    ) -> torch.Tensor:
        """Weighted squared quantization error of every page of a projection at every bit level.

        ``sum_ij row_weight[i] * col_weight[j] * (W_ij - W^_ij)^2`` over each page's rows (output
        features ``i``, input features ``j`` of the canonical view), with ``W^`` rebuilt exactly as
        the experts forward rebuilds it; with a full ``[E, cols, cols]`` ``col_weight`` (the input
        second moments) ``sum_i row_weight[i] * e_i^T C e_i``, which counts how the errors of a row
        cancel or add up on correlated inputs. Computed on the store's device, experts together up to
        :data:`WEIGHTED_ERROR_ELEMENTS`.

        Args:
            layer: MoE layer index.
            proj: Projection index.
            row_weight: ``[E, rows]`` weight of each output row (``None``: 1).
            col_weight: ``[E, cols]`` weight of each input column, or ``[E, cols, cols]`` (``None``: 1).

        Returns:
            ``float64 [E, blocks, bit levels]``, bit levels in the order of :attr:`levels` without
            ``TOP_LEVEL``.
        """
        host_weight = self.canonical_host_weight(layer, proj)
        host_planes = self._host_planes[(layer, proj)]
        host_scale, host_minimum = self._host_meta[(layer, proj)]
        num_experts, rows, cols = host_weight.shape
        blocks = host_planes.shape[1]
        bit_levels = self._bit_levels
        block_shape = (blocks, rows // blocks, cols)
        full = col_weight is not None and col_weight.dim() == 3
        errors = torch.empty(num_experts, blocks, len(bit_levels), dtype=torch.float64)
        at_once = max(1, WEIGHTED_ERROR_ELEMENTS // (rows * cols))  # experts at a time: a few float32 copies each
        for first in range(0, num_experts, at_once):
            experts = slice(first, min(first + at_once, num_experts))
            shape = (experts.stop - first, *block_shape)
            weight = host_weight[experts].to(self.device, torch.float32).reshape(shape)
            planes = host_planes[experts].to(self.device)
            rows_w = torch.ones(rows, device=self.device) if row_weight is None else row_weight[experts]
            rows_w = rows_w.to(self.device, torch.float32).reshape(-1, blocks, rows // blocks, 1)
            if full:
                cols_w = col_weight[experts].to(self.device, torch.float32).unsqueeze(1)  # [experts, 1, cols, cols]
            else:
                cols_w = torch.ones(cols, device=self.device) if col_weight is None else col_weight[experts]
                cols_w = cols_w.to(self.device, torch.float32).reshape(-1, 1, 1, cols)
            for i, bits in enumerate(bit_levels):
                scale = host_scale[i, experts].to(self.device).reshape(*shape[:-1], -1)
                minimum = host_minimum[i, experts].to(self.device).reshape(*shape[:-1], -1)
                rebuilt = dequantize(planes[:, :, :bits], scale, minimum, shape, torch.float32)
                difference = rebuilt - weight
                if full:
                    error = (difference @ cols_w).mul_(difference).mul_(rows_w)
                else:
                    error = difference.square_().mul_(cols_w).mul_(rows_w)
                errors[experts, :, i] = error.sum(dim=(2, 3)).double().cpu()
        return errors

    @property
    def min_level(self) -> int:
        """Lowest allowed level."""
        return min(self.levels)

    def bytes_table(self) -> torch.Tensor:
        """``int64 [pages, levels]``: device bytes of each page at each of ``self.levels``."""
        return torch.tensor([[page.bytes_at(level) for level in self.levels] for page in self.pages])

def _check_levels(levels: Iterable[int]) -> tuple[int, ...]:
    chosen = tuple(sorted(set(levels), reverse=True))
    allowed = {TOP_LEVEL, *range(1, CODE_BITS + 1)}
    if not chosen or any(level not in allowed for level in chosen) or CODE_BITS not in chosen:
        raise ValueError(
            f"levels={tuple(levels)} must be drawn from {TOP_LEVEL} (original weights) and 1..8 bits "
            "and include 8, e.g. (16, 8, 4, 3, 2)."
        )
    return chosen


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def _to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """Host copy of ``tensor``; a CPU tensor that needs no pinning, or is pinned already (a streamed model's home
    under ``SuperpipeStrategy``), is used as it is (no copy)."""
    if tensor.device.type == "cpu" and (not pin or tensor.is_pinned()):
        return tensor
    host = _host_empty(tuple(tensor.shape), tensor.dtype, pin)
    host.copy_(tensor)
    return host
