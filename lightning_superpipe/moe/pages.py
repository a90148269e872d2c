"""Page store: expert weights cut into pages whose precision moves between device and host.

Every page (a block of output rows of one expert's projection: ``gate_up_proj``/``up_proj`` or
``down_proj`` of routed experts, or a linear of a dense shared expert) has a complete master copy in
host memory (pinned on CUDA): its original weights, its 8 bit planes and its group metadata. Pages
are cut from each weight's canonical ``[E, out, in]`` view, so that quantization groups run along the
input dimension whatever the family's layout (gpt-oss stores ``[E, in, out]``). The device holds a
*subset* chosen by the planner:

* level ``TOP_LEVEL`` (reported as 16 bits): the original weights, nothing else;
* level ``b <= 8``: bit planes ``0 .. b-1`` plus the group scale and minimum *of level b*.

The codes are :func:`~lightning_superpipe.quantization.quantize_pageable`'s nested codes: every level
keeps the top planes of the one 8-bit code (putting planes back restores it exactly), and each level
has its own scale and minimum on the host; the device holds those of its level only, so a level
costs the same bytes as with one shared set. Before calibration the codes are round-to-nearest and
every level shares the 8-bit grid (rebuilt at its buckets' middles); after it,
:meth:`PageStore.requantize` rounds the codes again with each expert's Hessian (error feedback at
every level at once) and refits each level's scale and minimum to its codes.

Because the host copy is never modified (only :meth:`PageStore.requantize` rewrites the codes, and
then refreshes the pages on the device), demoting a page only frees device tensors (no copy back)
and promoting it only uploads what is missing; promotion is therefore exact. Planes are held on
the device in *segments* that end at level boundaries (e.g. planes ``[0, 2)``, ``[2, 3)``,
``[3, 4)``, ``[4, 8)`` for levels 8/4/3/2), so any demotion frees whole tensors.

On CUDA uploads run on a side stream. A promotion stays *pending* (the page keeps computing at
its old precision) until its copy has finished; a demotion from the original weights to bit
planes takes effect at once and the compute stream waits for the planes on their first use. On
the CPU the same code runs with synchronous copies (device and host are then the same memory, so
the "uploads" are views and cost nothing, but the byte accounting is the same as on CUDA).

For computing, :meth:`PageStore.projection_weight` hands out a whole projection in the model's own
layout: when all its pages hold their original weights it is one tensor kept by the store (the
host copy itself on the CPU), otherwise a tensor rebuilt with one batched dequantization per level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from lightning_superpipe.moe.copies import CopyEngine, CudaCopyEngine, DeviceCopy, SyncCopyEngine
from lightning_superpipe.moe.host_pages import TOP_LEVEL, HostPages, Page, PageKey
from lightning_superpipe.moe.layouts import MoELayer
from lightning_superpipe.quantization import CODE_BITS, PageableCodes, dequantize, quantize_pageable

REQUANTIZE_ELEMENTS = 1 << 26
"""Elements of the error-compensated weight copies (one per code width, float32) that :meth:`PageStore.requantize`
works on at once (256 MiB): expert matrices of one shape are rounded together up to this size, one at a time beyond
it."""

__all__ = ["TOP_LEVEL", "CopyEngine", "CudaCopyEngine", "Page", "PageKey", "PageStore", "SyncCopyEngine"]


class PageStore(HostPages):
    """All pages of a model's paged experts (:class:`HostPages`), with what of them is on the device and the moves
    between levels.

    Args:
        layers: The model's paged units; their weights are read, not modified.
        device: Device that computes with the experts.
        group_size: Columns (input features) per quantization group.
        levels: Allowed levels, ``TOP_LEVEL`` and bit counts in ``1 .. 8`` (8 is always included).
        rows_per_page: Rows (output features) of a projection per page (``None``: one page per
            expert and projection). Must divide the output size of every projection.
        copy_engine: How host data reaches the device (default: asynchronous on CUDA).
    """

    def __init__(
        self,
        layers: list[MoELayer],
        *,
        device: torch.device,
        group_size: int,
        levels: Iterable[int],
        rows_per_page: int | None,
        copy_engine: CopyEngine | None = None,
    ) -> None:
        device = torch.device(device)
        self.copy = copy_engine or (CudaCopyEngine(device) if device.type == "cuda" else SyncCopyEngine(device))
        # Projections whose pages all hold their original weights, as one tensor in the model's
        # layout: what the experts implementation reads at a full budget, with no copy.
        self._full: dict[tuple[int, int], torch.Tensor] = {}
        self._device_bytes = 0
        self.commits = 0
        """Promotions committed after their upload landed (the planner may then use freed bytes)."""
        super().__init__(layers, device=device, group_size=group_size, levels=levels, rows_per_page=rows_per_page)

    def requantize(
        self,
        hessians: dict[tuple[int, int], torch.Tensor | None],
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Round the codes again with each expert matrix's Hessian (GPTQ-style error feedback).

        The new codes are :func:`quantize_pageable`'s nested codes for the store's bit levels, so they
        stay pageable; pages on the device at a bit level get their new planes and metadata (the
        original weights, and so pages at ``TOP_LEVEL``, are unchanged). Expert matrices of one shape
        (a projection's experts, in every layer) are rounded together, as many at a time as
        :data:`REQUANTIZE_ELEMENTS` allows: one pass over their columns for all of them.

        Args:
            hessians: ``[E, cols, cols]`` input second moments per ``(layer, proj)`` (``None`` or
                missing: left as they are).
            progress: Called with the number of expert matrices done, after each batch of them.
        """
        self.synchronize()  # no upload in flight reads the host codes being replaced
        jobs = {key: hessian for key, hessian in hessians.items() if hessian is not None and key in self._host_planes}
        for batch in self._requantize_batches(list(jobs)):
            weight = torch.cat([self.canonical_host_weight(*key)[experts].to(self.device) for key, experts in batch])
            hessian = torch.cat([jobs[key][experts].to(self.device) for key, experts in batch])
            meta_dtype = self._meta_dtype[batch[0][0]]
            codes = quantize_pageable(weight, self.group_size, self._bit_levels, meta_dtype, hessian)
            done = 0
            for key, experts in batch:
                part = slice(done, done + experts.stop - experts.start)
                done = part.stop
                mine = PageableCodes(codes.codes[part], codes.scale[:, part], codes.minimum[:, part], codes.widths)
                self._write_codes(self._host_planes[key], *self._host_meta[key], experts, mine)
            if progress is not None:
                progress(done)
        for key in jobs:
            for page_id in self._page_ids[key]:
                page = self.pages[page_id]
                if page.current is not None and page.current.level != TOP_LEVEL:
                    page.current = self._planes_copy(page, page.current.level)  # same bytes, new codes
        self.synchronize()

    def _requantize_batches(self, keys: list[tuple[int, int]]) -> Iterator[list[tuple[tuple[int, int], slice]]]:
        """:meth:`requantize`'s batches: runs of experts ``(key, experts)`` of one shape and metadata dtype, at most
        :data:`REQUANTIZE_ELEMENTS` of working copies each (at least one expert)."""
        same_shape: dict[tuple[int, int, torch.dtype], list[tuple[int, int]]] = {}
        for key in keys:
            rows, cols = self.canonical_host_weight(*key).shape[1:]
            same_shape.setdefault((rows, cols, self._meta_dtype[key]), []).append(key)
        widths = len({*self._bit_levels, CODE_BITS})
        for (rows, cols, _), group in same_shape.items():
            at_once = max(1, REQUANTIZE_ELEMENTS // (widths * rows * cols))
            batch: list[tuple[tuple[int, int], slice]] = []
            taken = 0
            for key in group:
                experts = self.canonical_host_weight(*key).shape[0]
                first = 0
                while first < experts:
                    take = min(experts - first, at_once - taken)
                    batch.append((key, slice(first, first + take)))
                    first, taken = first + take, taken + take
                    if taken == at_once:
                        yield batch
                        batch, taken = [], 0
            if batch:
                yield batch

    def requantized_matrices(self, hessians: dict[tuple[int, int], torch.Tensor | None]) -> int:
        """How many expert matrices :meth:`requantize` rounds again with ``hessians`` (a progress bar's total)."""
        return sum(
            self.canonical_host_weight(*key).shape[0]
            for key, hessian in hessians.items()
            if hessian is not None and key in self._host_planes
        )

    # ------------------------------------------------------------------ accounting
    def device_bytes(self) -> int:
        """Expert bytes on the device now, including uploads in flight."""
        return self._device_bytes

    def recount_device_bytes(self) -> int:
        """Recount :meth:`device_bytes` from the tensors themselves (for checks)."""
        return sum(page.device_nbytes() for page in self.pages)

    def promotion_bytes(self, page_id: int, level: int) -> int:
        """Extra device bytes while ``page_id`` is being promoted to ``level``.

        An asynchronous promotion to the original weights keeps the page's bit planes until the
        upload lands, so both are counted; one between bit levels keeps the old level's scale and
        minimum meanwhile (unless an upload in flight already holds the new ones); otherwise only
        the difference is.
        """
        page = self.pages[page_id]
        if level == TOP_LEVEL and self.copy.asynchronous:
            return page.bytes_at(TOP_LEVEL)
        extra = page.bytes_at(level) - page.bytes_at(page.target_level)
        if (
            self.copy.asynchronous
            and page.pending is None
            and page.current is not None
            and page.current.level != TOP_LEVEL
            and level > page.current.level
        ):
            extra += page.meta_nbytes()
        return extra

    # ------------------------------------------------------------------ moves
    def set_level(self, page_id: int, level: int) -> None:
        """Move a page to ``level``: free device data to demote, upload what is missing to promote.

        Args:
            page_id: Index in :attr:`pages`.
            level: One of :attr:`levels`.
        """
        if level not in self.levels:
            raise ValueError(f"level {level} is not one of the store's levels {self.levels}")
        page = self.pages[page_id]
        if level != page.target_level:
            self._split((page.key.layer, page.key.proj))
        before = page.device_nbytes()
        if level > page.target_level:
            self._promote(page, level)
        elif level < page.target_level:
            self._demote(page, level)
        self._device_bytes += page.device_nbytes() - before

    def _upload_planes(self, page: Page, start: int, stop: int) -> list[torch.Tensor]:
        lo, hi = self._bounds.index(start), self._bounds.index(stop)
        spans = zip(self._bounds[lo:hi], self._bounds[lo + 1 : hi + 1])
        return [self.copy.upload(page.host_planes[a:b]) for a, b in spans]

    def _planes_copy(self, page: Page, level: int) -> DeviceCopy:
        segments = self._upload_planes(page, 0, level)
        scale, minimum = (self.copy.upload(t) for t in page.meta(level))
        return DeviceCopy(level, segments=segments, scale=scale, minimum=minimum, fence=self.copy.fence())

    def _promote(self, page: Page, level: int) -> None:
        if page.current is None:  # first placement: nothing to keep computing with meanwhile
            page.current = self._fresh_copy(page, level)
            return
        if level == TOP_LEVEL:
            incoming = DeviceCopy(level, weight=self.copy.upload(page.host_weight))
        else:
            # Extends an upload in flight, if any: planes from the target level up, and the
            # metadata of the new level (the page computes with its old level's until it lands).
            earlier = page.pending.segments if page.pending is not None else []
            scale, minimum = (self.copy.upload(t) for t in page.meta(level))
            incoming = DeviceCopy(
                level,
                segments=earlier + self._upload_planes(page, page.target_level, level),
                scale=scale,
                minimum=minimum,
            )
        incoming.fence = self.copy.fence()
        page.pending = incoming
        self._settle(page)

    def _fresh_copy(self, page: Page, level: int) -> DeviceCopy:
        if level == TOP_LEVEL:
            return DeviceCopy(level, weight=self.copy.upload(page.host_weight), fence=self.copy.fence())
        return self._planes_copy(page, level)

    def _demote(self, page: Page, level: int) -> None:
        page.pending = None  # cancel: the upload's memory is ordered on the copy stream
        current = page.current
        if current is None or current.level == level:
            return
        if current.level < level:  # the cancelled upload overshot; upload less instead
            self._promote(page, level)
        elif current.level == TOP_LEVEL:
            page.current = self._planes_copy(page, level)
        else:
            current.segments = current.segments[: self._bounds.index(level)]
            current.scale, current.minimum = (self.copy.upload(t) for t in page.meta(level))
            current.level = level
            current.fence = self.copy.fence()

    def _settle(self, page: Page) -> None:
        """Commit a landed upload; make compute wait for data it is about to read."""
        pending = page.pending
        if pending is not None and self.copy.is_done(pending.fence):
            for tensor in pending.tensors():
                self.copy.hand_over(tensor)
            if pending.level == TOP_LEVEL:
                page.current = pending
            else:
                page.current.segments.extend(pending.segments)
                page.current.scale, page.current.minimum = pending.scale, pending.minimum
                page.current.level = pending.level
            page.pending = None
            self.commits += 1
        current = page.current
        if current is not None and current.fence is not None:
            self.copy.wait(current.fence)
            for tensor in current.tensors():
                self.copy.hand_over(tensor)
            current.fence = None

    def synchronize(self) -> None:
        """Wait for every upload in flight and commit it."""
        if isinstance(self.copy, CudaCopyEngine):
            self.copy.stream.synchronize()
        for page in self.pages:
            if page.pending is not None:
                before = page.device_nbytes()
                self._settle(page)
                self._device_bytes += page.device_nbytes() - before

    def release(self) -> None:
        """Drop every device copy (the host master copies stay)."""
        self._full.clear()
        for page in self.pages:
            page.current = page.pending = None
        self._device_bytes = 0

    def _split(self, key: tuple[int, int]) -> None:
        """Before a page of a consolidated projection moves: give its other pages their own copies,
        so that freeing one page really frees its bytes (a no-op when they alias host memory)."""
        full = self._full.pop(key, None)
        if full is None or _aliases(full, self._host_weights[key]):
            return
        for page_id in self._page_ids[key]:
            current = self.pages[page_id].current
            if current is not None and current.weight is not None:
                current.weight = current.weight.clone()

    # ------------------------------------------------------------------ compute
    def full_weight(self, layer: int, proj: int) -> torch.Tensor | None:
        """The projection's original weights as one device tensor in the model's layout, if every page
        of it holds them now (``None`` otherwise). No copy once gathered: the full-budget fast path."""
        key = (layer, proj)
        full = self._full.get(key)
        if full is not None:
            return full
        page_ids = self._page_ids[key]
        if any(self.pages[i].target_level != TOP_LEVEL for i in page_ids):
            return None
        if any(self._usable(self.pages[i]).level != TOP_LEVEL for i in page_ids):
            return None  # promotions still in flight
        return self._consolidate(key)

    def projection_weight(self, layer: int, proj: int, experts: list[int] | None = None) -> torch.Tensor:
        """Device weights of one fused projection, in the model's layout and dtype, for computing now.

        With every page of the projection at its original weights this is one tensor held by the
        store (no copy, no kernel): the experts implementation then runs exactly as unpaged. Otherwise a
        fresh tensor is filled: original weights copied, and the pages of each bit level dequantized
        together in one batched rebuild over all the experts and row blocks at that level.

        Args:
            layer: Index of the paged unit.
            proj: Projection index.
            experts: The experts whose weights are needed (``None``: all). The others are left as
                zeros: implementations only read the weights of experts that tokens were routed to.

        Returns:
            ``[E, ...]`` weights shaped like the model's parameter.
        """
        key = (layer, proj)
        page_ids = self._page_ids[key]
        if experts is None:
            wanted = page_ids
        else:
            per_expert = len(page_ids) // self._host_weights[key].shape[0]
            wanted = [page_ids[e * per_expert + b] for e in experts for b in range(per_expert)]
        full = self.full_weight(layer, proj)
        if full is not None:
            return full
        copies = [self._usable(self.pages[i]) for i in wanted]
        host = self._host_weights[key]
        out = (torch.empty if len(wanted) == len(page_ids) else torch.zeros)(
            host.shape, dtype=host.dtype, device=self.device
        )
        num_experts, rows, cols = self.canonical_host_weight(layer, proj).shape
        blocks = len(page_ids) // num_experts
        # [E, blocks, rows per page, cols]: a view of `out` in both layouts (no copy on writes).
        view = (out.mT if self._transposed[key] else out).unflatten(1, (blocks, rows // blocks))
        by_level: dict[int, list[int]] = {}
        for n, current in enumerate(copies):
            by_level.setdefault(current.level, []).append(n)
        for level, members in by_level.items():
            keys = [self.pages[wanted[n]].key for n in members]
            index = (
                torch.tensor([k.expert for k in keys], device=self.device),
                torch.tensor([k.block for k in keys], device=self.device),
            )
            if level == TOP_LEVEL:
                values = torch.stack([copies[n].weight for n in members])
            else:
                planes = torch.stack([_joined(copies[n].segments) for n in members])
                scale = torch.stack([copies[n].scale for n in members])
                minimum = torch.stack([copies[n].minimum for n in members])
                values = dequantize(planes, scale, minimum, (len(members), rows // blocks, cols), host.dtype)
            view.index_put_(index, values)
        return out

    def _consolidate(self, key: tuple[int, int]) -> torch.Tensor:
        """One tensor in the model's layout for a projection whose pages all hold original weights."""
        host = self._host_weights[key]
        page_ids = self._page_ids[key]
        weights = [self.pages[i].current.weight for i in page_ids]
        if host.device == self.device and all(_aliases(w, host) for w in weights):
            full = host  # the pages are views of the host copy (a CPU store): nothing to gather
        else:
            full = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            canonical = full.mT if self._transposed[key] else full
            blocks = len(page_ids) // host.shape[0]
            view = canonical.unflatten(1, (blocks, canonical.shape[1] // blocks))
            for page_id, weight in zip(page_ids, weights):
                page = self.pages[page_id]
                target = view[page.key.expert, page.key.block]
                target.copy_(weight)
                page.current.weight = target  # the separate copy is freed; the bytes stay the same
        self._full[key] = full
        return full

    def reference_weight(self, layer: int, proj: int) -> torch.Tensor:
        """The original weights of one projection on the device, streamed from host memory.

        Used to compute full-precision references within a device budget: the projection is on
        the device only transiently (no copy when the store is on the CPU).
        """
        return self._host_weights[(layer, proj)].to(self.device, non_blocking=True)

    def _usable(self, page: Page) -> DeviceCopy:
        """The page's device copy, after committing a landed upload."""
        if page.pending is not None:
            before = page.device_nbytes()
            self._settle(page)
            self._device_bytes += page.device_nbytes() - before
        else:
            self._settle(page)
        if page.current is None:
            raise RuntimeError(f"page {page.key} has no device copy; the store was released")
        return page.current


def _aliases(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view into the memory of ``base``."""
    return tensor.device == base.device and tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated along dim 0, without a copy when there is only one."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
