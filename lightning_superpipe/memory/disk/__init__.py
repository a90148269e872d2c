"""The disk tier: block masters, optimizer state and spilled gradients in files, streamed through a bounded pool.

With Adam a full fine-tune keeps about 16 bytes per parameter on the host (fp32 master, gradient, two moments). The
disk tier keeps each streamed block's fp32 masters and its whole optimizer state (every tensor ``optimizer.state[p]``
holds, e.g. Adam's ``step``, ``exp_avg``, ``exp_avg_sq``, and any non-tensor values) in files under ``offload_path``,
and optionally its fp32 gradients, so host memory holds only a bounded pool of block buffers.

Files (all under one folder):

* ``block{i:05d}.{slot}.bin``, two slots per block: a block's record, its masters first (in the block's parameter
  order, each on a 256-byte boundary) and then its state tensors; the file is rounded up to 4 KiB for direct I/O.
* ``grad{i:05d}.bin``: a block's spilled fp32 gradients (same offsets as the masters); scratch, never committed.
* ``manifest.json``: the committed step: for every block, which slot holds it, the record's layout and the
  non-tensor state values. A step writes every stepped block to its *other* slot and ``fsync``s it, then writes the
  manifest to a temporary name, ``fsync``s it, renames it over the old one and ``fsync``s the folder. A kill at any
  moment leaves the folder at the previous step or the new one, never a mix: the old slots are not touched until
  the manifest that stops naming them is durable.

I/O: files are read and written with ``os.preadv``/``os.pwritev`` on worker threads, in chunks, into page-aligned
buffers from a :class:`BufferPool` (page-locked on CUDA), with ``O_DIRECT`` where the file system accepts it
(``ext4``, ``xfs``) and otherwise buffered, with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after each chunk so the
page cache does not grow by the files' size (``tmpfs`` refused ``O_DIRECT`` before Linux 6.6; file systems over
the network may). Nothing is memory-mapped: mapping grows the process's resident memory to the size of the file.
The step's reads ahead wait for their buffers on a reader thread, in block order, and a write hands its buffer back
once the bytes have left it, before its ``fsync``: the commit waits for the ``fsync``s, the next read only for the
buffer. :class:`IoClock` counts where the time goes (``DiskStore.io_seconds``).

How the engine is meant to use it (``offload_device="disk"``)::

    limit_heap_retention()                       # else glibc keeps freed block-sized tensors resident
    store = DiskStore.create(offload_path, [dict(block.named_parameters(prefix)) for ...], optimizer,
                             spill_grads=needs_spill, host_buffer_bytes=host_buffer_bytes)   # or DiskStore.open
    # The block parameters now hold placeholders (right shape and dtype, no memory); their values are in files.
    # Forward/backward: lease = store.prefetch_masters(i); views = lease.wait(); derive the device copy (cast to the
    #   compute dtype on the fly: no bf16 copy on disk, which would cost 2 bytes/parameter of writes per step);
    #   lease.release() once the copy is made.
    # Gradients: either leave them in ``p.grad`` (exact per-block stepping during backward) or, with clipping or
    #   accumulation, ``store.spill_grads(i, grads, accumulate=micro_batch > 0, wait=False, norms=last_micro)``
    #   and drop them from memory. Clipping by global norm: stack store.grad_norms(i) with the trunk's norms in
    #   parameter order, take clip_grad_norm_'s clamped coefficient and pass it as step(..., grad_scale=coef).
    store.step(optimizer, grads="param" or "disk")   # block by block: read, step the user's optimizer restricted
                                                     # to the block, write to the other slot; then commit
    # (or, stepping during backward where that is exact: store.step(optimizer, blocks=[i], commit=False) as each
    #  block's gradients complete, and store.commit() after the last; on an error the store is back at the last
    #  commit and the whole optimizer step must be redone)
    with restricted(optimizer, trunk_params): optimizer.step()    # the rest (the trunk) stays in memory
    scheduler.step()                                  # param groups and LR live in the optimizer, in memory
    # Checkpoint: manifest = store.snapshot(checkpoint_folder(ckpt_path) / unique_name) (hard links, no RAM), put
    #   it in the .ckpt; a fresh folder per save, so a kill mid-save leaves the previous .ckpt its copy.
    # Resume: DiskStore.restore(checkpoint_folder(ckpt_path), offload_path, blocks, optimizer).
    # Inference export: store.export_safetensors("model.safetensors", extra=trunk_state_dict).

Between steps ``optimizer.state`` holds nothing for block parameters: their state is in the files, and
``optimizer.state_dict()`` covers the trunk only (the store's manifest and files cover the rest).
(``restricted`` is :func:`lightning_superpipe.stepping.param_groups.restricted`.)

Modules, by job (each imports only those listed after it):

* :mod:`.store`: :class:`DiskStore`, tying the parts together (construction, reads, checkpoints, export);
* :mod:`.step`: the optimizer step through the store, and its commit; :mod:`.spills`: the gradient files;
* :mod:`.piece_step`: the step of a block too large for one pool buffer, piece by piece (:mod:`.pieces`: which
  parameters, or slices of one, a piece holds); :mod:`.entry_io`: whole tensors of such a block through the pool;
* :mod:`.core`: :class:`StoreOptions` and the state the store's parts share;
* :mod:`.folder`: the files' names, the manifest and its atomic commit, links into a checkpoint's folder;
* :mod:`.export`: safetensors written one tensor at a time; :mod:`.file_io`: whole files read and written in
  chunks on worker threads; :mod:`.space`: checks before training; :mod:`.buffers`: aligned buffers and their
  pool; :mod:`.clock`: :class:`IoClock`; :mod:`.records`: a block's record and its optimizer state's size;
  :mod:`.errors`.
"""


from __future__ import annotations

from lightning_superpipe.memory.disk.buffers import ACQUIRE_TIMEOUT_S, BufferPool
from lightning_superpipe.memory.disk.clock import CLOCK_COUNTERS, IoClock
from lightning_superpipe.memory.disk.core import StoreOptions
from lightning_superpipe.memory.disk.errors import DiskSpaceError, DiskTierError
from lightning_superpipe.memory.disk.export import MappedFiles, write_safetensors
from lightning_superpipe.memory.disk.file_io import CHUNK_BYTES
from lightning_superpipe.memory.disk.folder import FORMAT, MANIFEST, VERSION, checkpoint_folder
from lightning_superpipe.memory.disk.records import ENTRY_ALIGNMENT, Entry, Record, StateSize, probe_state_size
from lightning_superpipe.memory.disk.space import (
    PathLike,
    free_bytes,
    limit_heap_retention,
    preflight,
    supports_direct_io,
)
from lightning_superpipe.memory.disk.store import BlockState, DiskStore, MasterLease

__all__ = [
    "ACQUIRE_TIMEOUT_S",
    "CHUNK_BYTES",
    "CLOCK_COUNTERS",
    "ENTRY_ALIGNMENT",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "BlockState",
    "BufferPool",
    "DiskSpaceError",
    "DiskStore",
    "DiskTierError",
    "Entry",
    "IoClock",
    "MappedFiles",
    "MasterLease",
    "PathLike",
    "Record",
    "StateSize",
    "StoreOptions",
    "checkpoint_folder",
    "free_bytes",
    "limit_heap_retention",
    "preflight",
    "probe_state_size",
    "supports_direct_io",
    "write_safetensors",
]
