"""The streaming machinery of :func:`lightning_superpipe.generate`: block weights and the KV cache between host and
device, one block's weights on the device for every micro-batch, the next block's and the next micro-batch's cache
copied while the current one computes.

What is reused from ``transformers``: each micro-batch runs the model's own ``generate`` with a
:class:`StreamedCache`, a ``DynamicCache`` subclass built from the model's config, so its per-layer classes
(``DynamicLayer``, ``DynamicSlidingWindowLayer``) keep their own semantics (what a sliding window keeps, the mask
sizes they report); only where the layers' tensors live between uses is ours: in host memory (pinned on CUDA), in
FlexGen's 4-bit form when ``compress_kv``, loaded just before the layer's ``update`` and stored right after it.

``OffloadedCache``-style offloading (``DynamicCache(offloading=True)``) is not used: it prefetches layer by layer
for one batch on the current stream and keeps every offloaded layer's full tensors, where this schedule needs
the copies of another micro-batch's cache ordered by the project's copier (CUDA streams or the emulated link).

FlexGen's other placements, by whole layers: the first ``weights_resident_blocks`` blocks' weights are copied to
the device once and stay (never streamed); with ``activations_on_host`` each micro-batch's hidden states go to host
memory after a block and come back (prefetched while the micro-batch before computes) for the next one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from transformers import DynamicCache

import lightning_superpipe.generation.compression as compression
from lightning_superpipe.generation.baton import Baton, Key
from lightning_superpipe.generation.compression import Packed
from lightning_superpipe.memory.pinned import PAGE, HostArena, page_rounded
from lightning_superpipe.streaming.copier import Copier, Event

KINDS = ("weights", "cache", "activations")


@dataclass
class Traffic:
    """Bytes copied per link and per kind."""

    h2d: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    d2h: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


class Ledger:
    """The engine's own count of the bytes it holds on the device (exact on any device, CPU included)."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {"trunk": 0, "weights": 0, "cache": 0, "activations": 0}
        self.peak = 0
        self.peaks = dict.fromkeys(self.held, 0)
        self._lock = threading.Lock()

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.held[kind] += nbytes
            self.peaks[kind] = max(self.peaks[kind], self.held[kind])
            self.peak = max(self.peak, sum(self.held.values()))

    def remove(self, kind: str, nbytes: int) -> None:
        self.add(kind, -nbytes)


def nbytes_of(item: Union[Tensor, Packed]) -> int:
    return item.nbytes if isinstance(item, Packed) else item.numel() * item.element_size()


def _output_dim(module: nn.Module, name: str, param: Tensor) -> Optional[int]:
    """The output dimension of a weight matrix (``nn.Linear``: 0; GPT-2's ``Conv1D``: 1), ``None`` for vectors."""
    if param.ndim != 2 or name != "weight":
        return None
    return 1 if type(module).__name__ == "Conv1D" else 0


class _Entry:
    """One streamed parameter of a block: the module, its original host tensor, what travels over the link."""

    def __init__(self, module: nn.Module, name: str, original: Tensor, home: Union[Tensor, Packed]) -> None:
        self.module = module
        self.name = name
        self.original = original
        self.home = home


class StreamedCache(DynamicCache):
    """A ``DynamicCache`` of one micro-batch whose layers live in host memory between uses (see the module).

    Args:
        config: The model's config (the per-layer classes follow it, sliding windows included).
        engine: The engine that stores and loads the layers.
        micro_batch: Which micro-batch this cache belongs to.
    """

    def __init__(self, config: Any, engine: "GenerationEngine", micro_batch: int) -> None:
        super().__init__(config=config)
        self.engine = engine
        self.micro_batch = micro_batch

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if self.layer_class_to_replicate is not None:  # a config without layer types: layers come lazily
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        return self.engine.cache_update(self, layer_idx, key_states, value_states, args, kwargs)


class _Store:
    """One (micro-batch, layer) of the KV cache in host memory, positions first so any range is contiguous.

    ``[max_len, batch, heads, head_dim]`` dense, or FlexGen-packed along head_dim. Holds the positions
    ``[cum - kept, cum)``: what the transformers layer keeps (everything, or a sliding window's last tokens).
    """

    def __init__(self) -> None:
        self.cum = 0
        self.kept = 0
        self.keys: Optional[Union[Tensor, Packed]] = None
        self.values: Optional[Union[Tensor, Packed]] = None
        self.stored: Event = None  # the last device-to-host copy into it
        self.shape: tuple[int, ...] = ()
        self.dtype: torch.dtype = torch.float32


class GenerationEngine:
    """Streams a model's blocks and KV cache for the micro-batches' generation threads.

    Args:
        model: The ``transformers`` causal LM (its parameters in host memory).
        blocks: Its decoder layers, in order (block ``i`` is cache layer ``i``).
        device: The compute device.
        copier: Orders the copies (CUDA streams, the emulated link, or plain copies on the CPU).
        max_len: Prompt plus new tokens: the most positions any cache layer holds.
        max_steps: Forwards per micro-batch (the new tokens): no prefetch is issued past the last one.
        compress_weights: Keep and move block weight matrices in FlexGen's 4-bit form.
        compress_kv: Keep and move the KV cache in FlexGen's 4-bit form.
        cache_resident_layers: The first this many layers keep their cache on the device (FlexGen's cache GPU
            fraction, by layer).
        weights_resident_blocks: The first this many blocks keep their weights on the device for the whole run
            (FlexGen's weight GPU fraction, by block): copied once at the start (in their packed form with
            ``compress_weights``, rebuilt when the block computes), never streamed.
        activations_on_host: Between blocks, each micro-batch's hidden states live in host memory (FlexGen's
            activations on the CPU): a block's output is copied to the host after it computes and back before the
            next block, the next micro-batch's while the current one computes; only the last block's output stays
            (the final norm and head need it).
        overlap: Prefetch the next block and the next micro-batch's cache while the current one computes; ``False``
            loads everything when it is needed and waits for it (a serialized, Accelerate-like schedule).
        stream_weights: Move the weights (``False``: something else already does, e.g. ``SuperpipeStrategy``'s
            engine during ``trainer.predict``; this engine then only schedules and moves the KV cache).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        device: torch.device,
        copier: Copier,
        max_len: int,
        max_steps: int,
        compress_weights: bool = False,
        compress_kv: bool = False,
        cache_resident_layers: int = 0,
        overlap: bool = True,
        stream_weights: bool = True,
        weights_resident_blocks: int = 0,
        activations_on_host: bool = False,
    ) -> None:
        self.model = model
        self.stream_weights = stream_weights
        self.blocks = blocks
        self.device = device
        self.copier = copier
        self.max_len = max_len
        self.max_steps = max_steps
        self.compress_weights = compress_weights
        self.compress_kv = compress_kv
        self.cache_resident_layers = cache_resident_layers
        self.weights_resident_blocks = weights_resident_blocks if stream_weights else 0
        self.activations_on_host = activations_on_host
        self.overlap = overlap
        self.traffic = Traffic()
        self.ledger = Ledger()
        self.arena = HostArena(pin=copier.pin_memory)
        self.baton: Optional[Baton] = None
        self.caches: list[StreamedCache] = []
        self._stores: dict[tuple[int, int], _Store] = {}
        self._entries: list[list[_Entry]] = []
        self._trunk_moved: list[tuple[Any, str, Tensor]] = []
        self._installed: Optional[tuple[int, int]] = None  # (step, block)
        self._installed_bytes = 0
        self._pending_weights: dict[int, tuple[Event, list[Union[Tensor, Packed]]]] = {}
        self._pending_cache: dict[tuple[int, int], tuple[Event, tuple[Any, Any]]] = {}
        self._transient_cache: dict[int, int] = {}  # micro-batch -> cache bytes its running block holds
        self._activations: dict[int, int] = {}  # micro-batch -> hidden-state bytes it holds on the device
        # block -> its weights kept on the device, and the event of their one copy (every computing thread waits).
        self._resident: dict[int, tuple[Event, list[Union[Tensor, Packed]]]] = {}
        # Hidden states in host memory: micro-batch -> (the host tensor its model code holds, the copy's event);
        # and the device copies prefetched for their next block: micro-batch -> (event, tensor).
        self._parked: dict[int, tuple[Tensor, Event]] = {}
        self._pending_hidden: dict[int, tuple[Event, Tensor]] = {}
        self._stores_reserved = False
        self._installed_event: Event = None
        if stream_weights:
            self._prepare_weights()

    # ------------------------------------------------------------------ setup and teardown

    def _prepare_weights(self) -> None:
        in_blocks = {id(p) for block in self.blocks for p in block.parameters()}
        # Everything outside the blocks (embeddings, final norm, head) and every buffer stays on the device.
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) not in in_blocks:
                    self._to_device(module, name, param)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    self._to_device(module, name, buffer, is_buffer=True)
        plan = []  # (block, module, name, tensor, grouping dim or None)
        for index, block in enumerate(self.blocks):
            for module in block.modules():
                for name, param in module._parameters.items():
                    if param is None:
                        continue
                    dim = _output_dim(module, name, param.data) if self.compress_weights else None
                    if dim is not None and compression.group_size_for(param.shape[dim]) is None:
                        dim = None  # an output dimension without groups of 64 (or an even one under 64) stays dense
                    plan.append((index, module, name, param.data, dim))
        if self.copier.pin_memory:
            # Asynchronous copies need page-locked sources: one registration for every dense weight of every block.
            self.arena.reserve(sum(page_rounded(t.numel() * t.element_size()) for *_, t, dim in plan if dim is None))
        self._entries = [[] for _ in self.blocks]
        for index, module, name, original, dim in plan:
            if dim is not None:
                home: Union[Tensor, Packed] = compression.compress(original, dim)
            elif self.copier.pin_memory:
                home = self.arena.empty(original.numel(), original.dtype).view(original.shape)
                home.copy_(original)
            else:
                home = original
            self._entries[index].append(_Entry(module, name, original, home))
        for index in range(min(self.weights_resident_blocks, len(self.blocks))):
            # Resident blocks cross the link once, in the form they are stored in; they stay for the whole run.
            self._resident[index] = self._copy_weights(index)

    def _to_device(self, module: nn.Module, name: str, tensor: Tensor, is_buffer: bool = False) -> None:
        self.ledger.add("trunk", tensor.numel() * tensor.element_size())
        if tensor.device == self.device:
            return
        self._trunk_moved.append((module, name, tensor.data if not is_buffer else tensor))
        if is_buffer:
            module._buffers[name] = tensor.to(self.device)
        else:
            module._parameters[name].data = tensor.data.to(self.device)

    def close(self) -> None:
        """Puts every parameter and buffer back where it was and waits for outstanding copies."""
        self.copier.synchronize()
        self._uninstall()
        self._pending_weights.clear()
        self._pending_cache.clear()
        self._pending_hidden.clear()
        self._parked.clear()
        self._resident.clear()
        for module, name, original in self._trunk_moved:
            if name in module._buffers:
                module._buffers[name] = original
            else:
                module._parameters[name].data = original
        self._trunk_moved = []
        self.copier.close()
        self.arena.close()

    # ------------------------------------------------------------------ the turns

    def arrive(self, micro_batch: int, hidden: Any) -> None:
        """Runs on ``micro_batch``'s thread when it reaches a block, before it waits for its turn: counts the hidden
        states it holds on the device meanwhile (none when they are parked in host memory)."""
        parked = self._parked.get(micro_batch)
        held = 0
        if isinstance(hidden, Tensor) and not (parked is not None and hidden is parked[0]):
            held = hidden.numel() * hidden.element_size()
        self._set_activations(micro_batch, held)

    def _set_activations(self, micro_batch: int, nbytes: int) -> None:
        previous = self._activations.get(micro_batch, 0)
        self._activations[micro_batch] = nbytes
        self.ledger.add("activations", nbytes - previous)

    def begin_turn(self, key: Key, hidden: Any = None) -> Any:
        """Runs on the thread whose turn ``key`` starts, before its block computes.

        Returns:
            The hidden states the block is to compute on: ``hidden`` itself, or its device copy when it was parked in
            host memory.
        """
        step, block, micro_batch = key
        parked = self._parked.pop(micro_batch, None)
        pending = self._pending_hidden.pop(micro_batch, None)
        if parked is not None and hidden is parked[0]:
            event, hidden = pending or self._load_hidden(micro_batch, parked)
            self.copier.wait_on_compute(event)
            self.ledger.remove("activations", nbytes_of(hidden))  # counted as loaded (or prefetched) until now
            self._set_activations(micro_batch, nbytes_of(hidden))
        elif pending is not None:  # the model code replaced the parked tensor: its prefetched copy is unused
            self.ledger.remove("activations", nbytes_of(pending[1]))
        if self.stream_weights and self._installed != (step, block):
            self._install(block)
            self._installed = (step, block)
            if self.overlap and not (step == self.max_steps - 1 and block == len(self.blocks) - 1):
                self._prefetch_weights((block + 1) % len(self.blocks))
        elif self.stream_weights:
            # Every thread that computes with the block waits for its copy (free on one CUDA stream; the emulated
            # link's checker tracks waits per thread).
            self.copier.wait_on_compute(self._installed_event)
        if self.overlap and self.baton is not None:
            upcoming = self.baton.waiting_keys()
            if upcoming:
                _, next_block, next_micro_batch = upcoming[0]
                self._prefetch_cache(next_micro_batch, next_block)
                self._prefetch_hidden(next_micro_batch)
        return hidden

    def end_turn(self, micro_batch: int, block: int, output: Any) -> Any:
        """Runs after the block of ``micro_batch``'s turn: the cache tensors its attention used are gone, and with
        ``activations_on_host`` its output goes to host memory (but the last block's).

        Returns:
            What the model code is to hold until the next block: ``output``, or the host tensor it was parked in.
        """
        self.ledger.remove("cache", self._transient_cache.pop(micro_batch, 0))
        if not self.activations_on_host or block == len(self.blocks) - 1 or not isinstance(output, Tensor):
            if isinstance(output, Tensor):
                self._set_activations(micro_batch, nbytes_of(output))
            return output
        host = torch.empty(output.shape, dtype=output.dtype, pin_memory=self.copier.pin_memory)
        event = self.copier.to_host(host, output, what=f"hidden states of micro-batch {micro_batch} block {block}")
        self.traffic.d2h["activations"] += nbytes_of(output)
        self._parked[micro_batch] = (host, event)
        self._set_activations(micro_batch, 0)
        return host

    def _load_hidden(self, micro_batch: int, parked: tuple[Tensor, Event]) -> tuple[Event, Tensor]:
        host, stored = parked
        self.copier.wait_on_host(stored)  # the host tensor holds what the park wrote
        after = self.copier.mark_compute()  # fresh device memory may be memory compute still reads
        dst = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        event = self.copier.to_device(dst, host, after=after, what=f"hidden states of micro-batch {micro_batch}")
        self.traffic.h2d["activations"] += nbytes_of(dst)
        self.ledger.add("activations", nbytes_of(dst))
        return event, dst

    def _prefetch_hidden(self, micro_batch: int) -> None:
        parked = self._parked.get(micro_batch)
        if parked is not None and micro_batch not in self._pending_hidden:
            self._pending_hidden[micro_batch] = self._load_hidden(micro_batch, parked)

    def leave(self, micro_batch: int) -> None:
        self.ledger.remove("activations", self._activations.pop(micro_batch, 0))
        self._parked.pop(micro_batch, None)
        pending = self._pending_hidden.pop(micro_batch, None)
        if pending is not None:
            self.ledger.remove("activations", nbytes_of(pending[1]))

    # ------------------------------------------------------------------ weights

    def _issue_weights(self, block: int) -> tuple[Event, list[Union[Tensor, Packed]]]:
        if block in self._resident:
            return self._resident[block]
        return self._copy_weights(block)

    def _copy_weights(self, block: int) -> tuple[Event, list[Union[Tensor, Packed]]]:
        after = self.copier.mark_compute()  # fresh device memory may be memory compute still reads
        event: Event = None
        loaded: list[Union[Tensor, Packed]] = []
        for entry in self._entries[block]:
            home = entry.home
            if isinstance(home, Packed):
                dst: Union[Tensor, Packed] = compression.empty_like_packed(home, self.device)
                pairs = list(zip(dst.tensors(), home.tensors()))
            else:
                dst = torch.empty_like(home, device=self.device)
                pairs = [(dst, home)]
            for d, s in pairs:
                event = self.copier.to_device(d, s, after=after, what=f"block {block} {entry.name}")
            nbytes = nbytes_of(home)
            self.traffic.h2d["weights"] += nbytes
            self.ledger.add("weights", nbytes)
            loaded.append(dst)
        return event, loaded  # copies on one stream run in order: the last event covers them all

    def _prefetch_weights(self, block: int) -> None:
        if block not in self._pending_weights and block not in self._resident:
            self._pending_weights[block] = self._issue_weights(block)

    def _install(self, block: int) -> None:
        self._uninstall()
        event, loaded = self._pending_weights.pop(block, None) or self._issue_weights(block)
        self.copier.wait_on_compute(event)
        self._installed_event = event
        installed = 0  # what the block frees when it leaves: a streamed block's weights, a resident one's rebuild
        resident = block in self._resident
        for entry, item in zip(self._entries[block], loaded):
            if isinstance(item, Packed):
                # A streamed block's packed form is freed once rebuilt (a resident one's stays); the dense block
                # lives until the next block comes.
                if not resident:
                    self.ledger.remove("weights", item.nbytes)
                item = compression.decompress(item)
                self.ledger.add("weights", nbytes_of(item))
                installed += nbytes_of(item)
            elif not resident:
                installed += nbytes_of(item)
            entry.module._parameters[entry.name].data = item
        self._installed_bytes = installed
        self._installed_block = block

    def _uninstall(self) -> None:
        if self._installed is None:
            return
        for entry in self._entries[self._installed_block]:
            entry.module._parameters[entry.name].data = entry.original
        self.ledger.remove("weights", self._installed_bytes)
        self._installed = None
        self._installed_bytes = 0

    # ------------------------------------------------------------------ the KV cache

    def _store(self, micro_batch: int, layer: int) -> _Store:
        return self._stores.setdefault((micro_batch, layer), _Store())

    def _allocate_store(self, store: _Store, keys: Tensor) -> None:
        batch, heads, _, head_dim = keys.shape
        if not self._stores_reserved:
            # The first store: one host chunk (one page-locking) for every micro-batch's and layer's, as big as this.
            self._stores_reserved = True
            per_position = 2 * heads * head_dim * keys.element_size()
            if self.compress_kv:
                per_position = 2 * heads * head_dim * compression.BYTES_PER_ELEMENT
            streamed_layers = len(self.blocks) - self.cache_resident_layers
            pages = page_rounded(int(self.max_len * batch * per_position)) + 6 * PAGE  # each tensor starts a page
            self.arena.reserve(max(len(self.caches), 1) * streamed_layers * pages)
        store.shape = (self.max_len, batch, heads, head_dim)
        store.dtype = keys.dtype
        compressible = self.compress_kv and compression.group_size_for(head_dim) is not None
        for which in ("keys", "values"):
            if compressible:
                group = compression.group_size_for(head_dim)
                assert group is not None
                lead = (self.max_len, batch, heads)
                packed = Packed(
                    self._host(lead + (head_dim // 2,), torch.uint8),
                    self._host(lead + (head_dim // group,), torch.float16),
                    self._host(lead + (head_dim // group,), torch.float16),
                    -1,
                    keys.dtype,
                )
                setattr(store, which, packed)
            else:
                setattr(store, which, self._host(store.shape, keys.dtype))

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        numel = 1
        for size in shape:
            numel *= size
        return self.arena.empty(numel, dtype).view(shape)

    def _issue_cache(self, micro_batch: int, layer: int) -> Optional[tuple[Event, tuple[Any, Any]]]:
        store = self._stores.get((micro_batch, layer))
        if store is None or store.kept == 0:
            return None
        self.copier.wait_on_host(store.stored)  # the host holds what the last store wrote
        after = self.copier.mark_compute()
        lo, hi = store.cum - store.kept, store.cum
        event: Event = None
        loaded = []
        for home in (store.keys, store.values):
            assert home is not None
            if isinstance(home, Packed):
                dst: Any = Packed(
                    *(torch.empty_like(t[lo:hi], device=self.device) for t in home.tensors()), home.dim, home.dtype
                )
                pairs = list(zip(dst.tensors(), (t[lo:hi] for t in home.tensors())))
            else:
                dst = torch.empty_like(home[lo:hi], device=self.device)
                pairs = [(dst, home[lo:hi])]
            for d, s in pairs:
                what = f"cache of micro-batch {micro_batch} layer {layer}"
                event = self.copier.to_device(d, s, after=after, what=what)
            nbytes = nbytes_of(dst)
            self.traffic.h2d["cache"] += nbytes
            self.ledger.add("cache", nbytes)
            loaded.append(dst)
        return event, (loaded[0], loaded[1])

    def _prefetch_cache(self, micro_batch: int, layer: int) -> None:
        if layer < self.cache_resident_layers or (micro_batch, layer) in self._pending_cache:
            return
        issued = self._issue_cache(micro_batch, layer)
        if issued is not None:
            self._pending_cache[(micro_batch, layer)] = issued

    def cache_update(
        self, cache: StreamedCache, layer_index: int, keys: Tensor, values: Tensor, args: tuple, kwargs: dict
    ) -> tuple[Tensor, Tensor]:
        """The layer's ``update`` with its past loaded from host first and its new tokens stored to host after."""
        layer = cache.layers[layer_index]
        micro_batch = cache.micro_batch
        if layer_index < self.cache_resident_layers:
            before = _layer_bytes(layer)
            out = layer.update(keys, values, *args, **kwargs)
            self.ledger.add("cache", _layer_bytes(layer) - before)
            return out
        store = self._store(micro_batch, layer_index)
        issued = self._pending_cache.pop((micro_batch, layer_index), None)
        issued = issued or self._issue_cache(micro_batch, layer_index)
        loaded_bytes = 0
        if issued is not None:
            event, (past_keys, past_values) = issued
            self.copier.wait_on_compute(event)
            loaded_bytes = nbytes_of(past_keys) + nbytes_of(past_values)
            if isinstance(past_keys, Packed):
                past_keys, past_values = compression.decompress(past_keys), compression.decompress(past_values)
            # Stored positions first; the layer's layout is [batch, heads, positions, head_dim].
            layer.keys = past_keys.permute(1, 2, 0, 3)
            layer.values = past_values.permute(1, 2, 0, 3)
        out_keys, out_values = layer.update(keys, values, *args, **kwargs)
        self.ledger.remove("cache", loaded_bytes)
        held = 2 * out_keys.numel() * out_keys.element_size()
        self._transient_cache[micro_batch] = self._transient_cache.get(micro_batch, 0) + held
        self.ledger.add("cache", held)
        self._store_tail(store, layer, keys.shape[-2], micro_batch, layer_index)
        return out_keys, out_values

    def _store_tail(self, store: _Store, layer: Any, new: int, micro_batch: int, layer_index: int) -> None:
        kept = layer.keys.shape[-2]
        if store.keys is None:
            self._allocate_store(store, layer.keys)
        cum = store.cum + new
        start = max(store.cum, cum - kept)  # the new positions the layer keeps
        event: Event = None
        for which in ("keys", "values"):
            current: Tensor = getattr(layer, which)
            tail = current[:, :, kept - (cum - start) :, :].permute(2, 0, 1, 3).contiguous()
            home = getattr(store, which)
            if isinstance(home, Packed):
                packed = compression.compress(tail, -1)
                pairs = list(zip((t[start:cum] for t in home.tensors()), packed.tensors()))
                nbytes = packed.nbytes
            else:
                pairs = [(home[start:cum], tail)]
                nbytes = tail.numel() * tail.element_size()
            for dst, src in pairs:
                event = self.copier.to_host(dst, src, what=f"cache of micro-batch {micro_batch} layer {layer_index}")
            self.traffic.d2h["cache"] += nbytes
            # Between uses the layer holds only the shape (read by get_seq_length and the masks), no memory.
            setattr(layer, which, torch.empty(current.shape, dtype=current.dtype, device="meta"))
        store.cum, store.kept, store.stored = cum, kept, event

    def cache_bytes(self) -> int:
        """Bytes the whole KV cache of every micro-batch takes at the end: host stores in their (maybe packed) form
        plus the resident layers on the device."""
        resident = self.cache_resident_layers
        total = sum(_layer_bytes(layer) for cache in self.caches for layer in cache.layers[:resident])
        for store in self._stores.values():
            for home in (store.keys, store.values):
                if home is None:
                    continue
                per_position = nbytes_of(home) // self.max_len
                total += per_position * store.kept
        return total


def _layer_bytes(layer: Any) -> int:
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        return 0
    return 2 * layer.keys.numel() * layer.keys.element_size()
