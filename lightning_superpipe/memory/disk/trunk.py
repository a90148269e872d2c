"""The trunk on the disk tier: the large parameters outside the blocks (an embedding, an untied head) keep their
masters, optimizer state and, for the step, their gradients in the tier's files, each as a record of its own after
the blocks' in the same :class:`~lightning_superpipe.memory.disk.DiskStore`, stepped through the store like a
block and committed in the same manifest.

Which ones (:func:`trunk_on_disk`): a trunk parameter that trains (``requires_grad``), is floating point and is a
matrix or more (two dimensions at least: token and position embeddings, a head). Vectors (norms, biases) stay in
host memory and are stepped by the optimizer in place, as on the host tier: their state is a few kilobytes even in
a 70B model (8192 elements), and a record of their own would cost a file, a read and a write per step each. A frozen
parameter has no optimizer state and stays in host memory too.

How they train (:class:`~lightning_superpipe.memory.disk.tier.DiskTier` does it):

* **Device copy**: resident, as every trunk parameter's (the engine's), copied again after each step from the
  record's new masters through the pool (:meth:`~lightning_superpipe.memory.home.Homes.copy_trunk_in`); the
  parameter itself holds a placeholder during the run, as a block's does.
* **Gradient**: arrives in ``.grad`` as any trunk parameter's and accumulates there over the micro-batches (so that
  several ranks average it as usual); after the backward of the last micro-batch (of every backward, in manual
  optimization) it is spilled to the record's gradient file with its norm and dropped. So the optimizer's own step
  skips it (``.grad`` is ``None``), and clipping, a ``16-mixed`` gradient scaler and the step count it among the
  blocks' spilled gradients: stepped from its file after the blocks, serial or pipelined (where a pipelined step
  steps it before launching the blocks', whose commit makes both the new step), never during backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

#: Least dimensions of a trunk parameter the disk tier keeps in its files: matrices; vectors (norms, biases) stay in
#: host memory.
TRUNK_ON_DISK_MIN_DIMS = 2


def trunk_on_disk(trunk_params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The trunk parameters the disk tier keeps in its files when it trains: those that train, floating point, of
    :data:`TRUNK_ON_DISK_MIN_DIMS` dimensions or more (a tied embedding and head are one parameter, kept once)."""
    seen: set[int] = set()
    found: list[nn.Parameter] = []
    for param in trunk_params:
        matrix = param.dim() >= TRUNK_ON_DISK_MIN_DIMS
        if param.requires_grad and param.dtype.is_floating_point and matrix and id(param) not in seen:
            seen.add(id(param))
            found.append(param)
    return found


def trunk_records(block_count: int, trunk: Sequence[nn.Parameter]) -> dict[nn.Parameter, int]:
    """Each trunk parameter's record in the store: after the ``block_count`` blocks', in order."""
    return {param: block_count + position for position, param in enumerate(trunk)}
