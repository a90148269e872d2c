"""Several devices and nodes: data parallelism on Lightning's DDP machinery and ``torch.distributed``.

Each rank streams its own copy of the model through its own device, on its share of the data (Lightning's
``DistributedSampler``); the only difference from one device is the way back. :class:`GradientAverager` averages
each block's gradients across ranks on the device, as soon as the block's backward delivers them and before their
copy to the host, as DDP averages its buckets: the gradients (plus, under accumulation, what the earlier micro-batches
left in ``.grad``) go into one fp32 buffer per block, multiplied by ``1 / world_size`` and summed by an asynchronous
all-reduce (NCCL on a side stream on CUDA, so neither compute nor the host waits for it; gloo's own threads on a CPU,
where the host waits only when the next block's gradients arrive). The result replaces ``.grad``: the arithmetic of
DDP, so fp32 weights equal ``strategy="ddp"``'s. Every block's buffer ends with one flag per parameter (1 where the rank
has a gradient for it): a parameter no rank computed a gradient for keeps ``.grad`` as it was.

Gradient accumulation reduces at the boundary, as Lightning's DDP does: the micro-batches before the last run inside
:meth:`SuperpipeStrategy.block_backward_sync`, accumulate locally in host ``.grad`` and communicate nothing; the
last one folds the host sum into its buffers before the all-reduce. Since ``.grad`` holds the averaged gradients by
the time a block completes, the overlapped optimizer step (:mod:`.overlap`) stays exact.

With ``shard_optimizer=True`` (ZeRO stage 2) each block, and each trunk parameter, has one owner rank
(:func:`assign_owners`, balanced by bytes): its averaged gradients are reduced to the owner only, the other ranks drop
theirs, so only the owner keeps ``.grad`` and, since optimizers skip parameters without one, optimizer state for
it. Each rank steps its share; :func:`share_stepped` then broadcasts every block's new masters from its owner.
Clipping by norm gathers the owners' per-parameter norms into the global norm as ``clip_grad_norm_`` computes it
(:meth:`GradientAverager.clip_by_norm`), and a checkpoint gathers the optimizer state to rank 0
(:func:`gather_optimizer_state`). The masters stay replicated: every rank streams every block.

With ``shard_optimizer="node"`` the masters are not replicated within a node either: the ranks of each node
(:class:`NodeShare`) build the blocks' homes in one region of shared memory (:meth:`.HostArena.shared`, written by
local rank 0) and stream from it. Each block, and each trunk parameter, has one owner among the node's local ranks
(the same on every node); the gradients are averaged over all ranks (reduced to the owner on one node, all-reduced
on several, so that every node's owner holds them) and only the owner keeps them, and optimizer state. Each node's
owner then applies the same update to the one shared copy: nodes stay equal without broadcasting masters.
:func:`share_stepped_on_node` then waits for the node's owners (a barrier) and tells each engine which blocks changed
under it (:meth:`.StreamingEngine.mark_stepped`): the owners wrote the masters and transfer copies, the others only
make their device copies again; trunk parameters, one copy per rank as before, are broadcast from their owner within
the node. Clipping by norm sums the per-parameter norms over the node (every node holds the same gradients).

Collectives are issued in the order backward delivers gradients, which the model's structure fixes, so every rank
must run the same model with the same knobs: :func:`check_same_setup` compares them before anything is allocated,
and :func:`on_every_rank` turns an error on one rank into one on every rank instead of a hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

T = TypeVar("T")


class RanksDisagreeError(RuntimeError):
    """The ranks of a distributed run were set up differently, or failed to set up on some of them."""


#: Set on an error every rank of the run already raised together (:func:`agree`): :func:`on_every_rank` lets it through
#: instead of exchanging errors a second time, which the ranks that failed first would never join.
_AGREED = "_superpipe_agreed_on_every_rank"


def is_distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class NodeShare:
    """The ranks of one node, which share one host copy of the blocks (``shard_optimizer="node"``).

    Lightning numbers the ranks node by node (``global_rank = node_rank * devices + local_rank``); each node's ranks
    form a process group (created identically on every rank; on one node, the run's own group).

    Args:
        local_rank: This rank's index on its node.
        local_size: The ranks per node.
        node_rank: This node's index.
        num_nodes: The number of nodes.
        call: How the user wrote the strategy, for messages.

    Raises:
        RanksDisagreeError: The global ranks are not numbered node by node.
    """

    def __init__(self, local_rank: int, local_size: int, node_rank: int, num_nodes: int, call: str) -> None:
        self.local_rank = local_rank
        self.local_size = local_size
        self.num_nodes = num_nodes
        self.call = call
        self.base = node_rank * local_size
        if dist.get_rank() != self.base + local_rank or dist.get_world_size() != local_size * num_nodes:
            raise RanksDisagreeError(
                f"{call} shares host memory between the ranks of a node and needs them numbered node by node, but"
                f" global rank {dist.get_rank()} of {dist.get_world_size()} is local rank {local_rank} of"
                f" {local_size} on node {node_rank} of {num_nodes}."
            )
        self.group = _node_group(local_size, num_nodes, node_rank)
        self.ranks = list(range(self.base, self.base + local_size))

    def global_rank(self, local_rank: int) -> int:
        """The global rank of this node's ``local_rank``."""
        return self.base + local_rank

    def agree(self, error: Optional[BaseException], payload: Any = None) -> list[Any]:
        """A step every rank of the node took (:func:`agree`): raises on all of them if it failed on any, else returns
        every local rank's ``payload``."""
        return agree(error, "share the blocks' host memory", self.group, self.ranks, payload)

    def barrier(self) -> None:
        """Waits for every rank of the node."""
        dist.barrier(group=self.group)


_node_groups: list[Any] = []  # [the run's default group, (ranks per node, nodes), one group per node]


def _node_group(local_size: int, num_nodes: int, node_rank: int) -> Any:
    """The process group of ``node_rank``'s ranks (``None``, the run's own, on one node), made once per run:
    ``new_group`` must be called by every rank for every group, in the same order."""
    if num_nodes == 1:
        return None
    world = dist.group.WORLD
    if not _node_groups or _node_groups[0] is not world or _node_groups[1] != (local_size, num_nodes):
        groups = [dist.new_group(list(range(n * local_size, (n + 1) * local_size))) for n in range(num_nodes)]
        _node_groups[:] = [world, (local_size, num_nodes), groups]
    return _node_groups[2][node_rank]


class Reduction:
    """One all-reduce in flight: a flat fp32 buffer of averaged gradients and its per-parameter flags.

    Args:
        bucket: The buffer: each parameter's gradient, then one flag per parameter.
        numels: The parameters' sizes, in order.
        shapes: Their shapes.
        work: The all-reduce's work handle (``None`` once it is stream-ordered, on CUDA).
        stream: The side stream the reduction ran on (CUDA), under which the copy to the host must be issued.
    """

    def __init__(
        self,
        bucket: Tensor,
        numels: Sequence[int],
        shapes: Sequence[torch.Size],
        work: Any,
        stream: Optional[torch.cuda.Stream],
    ) -> None:
        self.bucket = bucket
        self.work = work
        self.stream = stream
        self.views: list[Tensor] = []
        offset = 0
        for numel, shape in zip(numels, shapes):
            self.views.append(bucket[offset : offset + numel].view(shape))
            offset += numel
        self.flags = bucket[offset:]

    @property
    def nbytes(self) -> int:
        return self.bucket.numel() * self.bucket.element_size()

    def wait(self) -> None:
        """Blocks the host until the reduction is done (gloo); nothing to wait for once stream-ordered (NCCL)."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def context(self) -> AbstractContextManager[Any]:
        """Where the copy of the result to the host must be issued: after the reduction on its stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()


class GradientAverager:
    """Averages gradients across the ranks of the default process group, one block at a time, on the device.

    Args:
        device: The compute device, where the reduction buffers live.
        owners: With ``shard_optimizer``, each parameter's owner rank (:func:`assign_owners`); ``None``: every rank
            keeps every averaged gradient. With ``node``, owners are local ranks, the same on every node.
        group: The process group (``None``: the default one).
        node: The node's ranks, which share the blocks' homes (``shard_optimizer="node"``), or ``None``.
    """

    def __init__(
        self, device: torch.device, owners: Optional[dict[nn.Parameter, int]] = None, group: Any = None,
        node: Optional[NodeShare] = None,
    ) -> None:
        self.device = device
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.owners = owners
        self.node = node
        #: The rank numbering the owners use: on the node with ``node``, else in ``group``.
        self._me = node.local_rank if node is not None else self.rank
        #: Off during the micro-batches of an accumulation before the last (Lightning's ``block_backward_sync``).
        self.sync = True
        nccl = device.type == "cuda" and dist.get_backend(group) == "nccl"
        self._stream = torch.cuda.Stream(device) if nccl else None
        #: Whether the host must wait for a reduction before its result can be copied (gloo): then the wait is
        #: deferred until the next block's gradients arrive, so the reduction overlaps that block's backward.
        self.deferred = self._stream is None
        #: Reductions issued, over the run (every rank issues the same number).
        self.reductions = 0

    @property
    def sharded(self) -> bool:
        """Whether each parameter's gradient and optimizer state live on its owner rank only."""
        return self.owners is not None

    def owner(self, param: nn.Parameter) -> Optional[int]:
        """The rank to reduce ``param``'s averaged gradient to (``None``: every rank gets it). With ``node`` on
        several nodes every node's owner needs it: all of them."""
        if self.owners is None:
            return None
        if self.node is None:
            return self.owners.get(param, self.rank)
        return self.node.global_rank(self.owners.get(param, self._me)) if self.node.num_nodes == 1 else None

    def owns(self, param: nn.Parameter) -> bool:
        """Whether this rank keeps (and steps) ``param``'s averaged gradient."""
        return self.owners is None or self.owners.get(param, self._me) == self._me

    def source(self, param: nn.Parameter) -> int:
        """The global rank whose stepped value of ``param`` the others take: its owner (on this node, with ``node``)."""
        assert self.owners is not None
        owner = self.owners.get(param, self._me)
        return self.node.global_rank(owner) if self.node is not None else owner

    def start(
        self, grads: Sequence[Optional[Tensor]], priors: Sequence[Optional[Tensor]], shapes: Sequence[torch.Size],
        dtype: torch.dtype, owner: Optional[int] = None,
    ) -> Reduction:
        """Starts averaging ``priors[i] + grads[i]`` (either may be ``None``) across ranks, asynchronously.

        Args:
            grads: This backward's gradients on the device, one per parameter (``None``: none on this rank).
            priors: What ``.grad`` already holds for each parameter (earlier micro-batches), or ``None``.
            shapes: The parameters' shapes.
            dtype: The masters' dtype, in which the gradients are summed (as DDP sums the parameters' own).
            owner: The only rank that needs the result (``shard_optimizer``), or ``None``: every rank.
        """
        numels = [shape.numel() for shape in shapes]
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients were computed there
        total = sum(numels)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            bucket = torch.empty(total + len(numels), dtype=dtype, device=self.device)
            offset = 0
            for index, (grad, prior, numel) in enumerate(zip(grads, priors, numels)):
                segment = bucket[offset : offset + numel]
                offset += numel
                if prior is not None:
                    segment.copy_(prior.reshape(-1), non_blocking=False)
                    if grad is not None:
                        segment.add_(grad.reshape(-1))
                elif grad is not None:
                    segment.copy_(grad.reshape(-1))
                else:
                    segment.zero_()
                if grad is not None and stream is not None:
                    grad.record_stream(stream)
                bucket[total + index] = float(grad is not None or prior is not None)
            bucket.mul_(1.0 / self.world_size)  # DDP's division before its sum: (a + b) / 2 bit for bit
            if owner is None:
                work = dist.all_reduce(bucket, group=self.group, async_op=True)
            else:
                work = dist.reduce(bucket, dst=owner, group=self.group, async_op=True)
            self.reductions += 1
            if stream is not None:
                work.wait()  # NCCL: the side stream waits for the reduction, the host does not
                work = None
        return Reduction(bucket, numels, shapes, work, stream)


    def clip_by_norm(self, params: Sequence[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``clip_grad_norm_(params, max_norm)`` over the owners' gradients: each owner's per-parameter norms are
        gathered (summed with the others' zeros, which is exact), the total norm taken over them in the order
        ``clip_grad_norm_`` takes it, and each owner scales its own gradients.

        Returns:
            The total norm, on every rank.
        """
        present = [p for p in params if p.grad is not None]
        norms = torch._foreach_norm([p.grad for p in present], norm_type) if present else []
        position = {p: i for i, p in enumerate(params)}
        # Each norm in float64 (exact for any float32 or narrower), then a flag per parameter: 1 where it has one.
        carrier = torch.zeros(2 * len(params), dtype=torch.float64)
        for param, norm in zip(present, norms):
            carrier[position[param]] = norm.double()
            carrier[len(params) + position[param]] = 1.0
        # With ``node`` every node holds the same gradients: the node's owners have each parameter's norm once.
        group = self.node.group if self.node is not None else self.group
        if dist.get_backend(group) == "nccl":
            on_device = carrier.to(self.device)
            dist.all_reduce(on_device, group=group)
            carrier = on_device.cpu()
        else:
            dist.all_reduce(carrier, group=group)
        # clip_grad_norm_ groups the gradients by dtype (all on the host here), in order of first appearance.
        groups: dict[torch.dtype, list[Tensor]] = {}
        for i, param in enumerate(params):
            if carrier[len(params) + i] > 0:
                dtype = param.grad.dtype if param.grad is not None else param.dtype
                groups.setdefault(dtype, []).append(carrier[i].to(dtype))
        ordered = [norm for group in groups.values() for norm in group]
        if not ordered:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(ordered), norm_type)
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if present:
            torch._foreach_mul_([p.grad for p in present], coefficient)
        return total


def assign_owners(parts: Sequence[tuple[Sequence[nn.Parameter], int]], world_size: int) -> dict[nn.Parameter, int]:
    """Gives each part (a block's parameters, or one trunk parameter) to the rank holding the fewest bytes so far,
    in order: the same answer on every rank.

    Args:
        parts: Each part's parameters and its gradient bytes.
        world_size: The number of ranks.
    """
    loads = [0] * world_size
    owners: dict[nn.Parameter, int] = {}
    for params, nbytes in parts:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += nbytes
        owners.update(dict.fromkeys(params, rank))
    return owners


def share_stepped(homes: Sequence[Any], trunk: Sequence[nn.Parameter], params: set[nn.Parameter],
                  averager: GradientAverager) -> None:
    """After each rank stepped its share (``shard_optimizer=True``): broadcasts every block's masters, and every trunk
    parameter, of the optimizer's ``params`` from its owner, so that all ranks stream the same new weights."""
    for home in homes:
        pieces = [] if home is None else [piece for piece in home.slices if piece.param in params]
        if pieces:
            _broadcast_host(home.master, averager.source(pieces[0].param), averager.device)
    for param in trunk:
        if param in params:
            _broadcast_host(param.data, averager.source(param), averager.device)


def share_stepped_on_node(engine: Any, params: set[nn.Parameter], averager: GradientAverager) -> None:
    """After each rank stepped its share (``shard_optimizer="node"``): the owners bring the shared homes of the blocks
    they stepped up to date (their transfer copies), the trunk parameters of ``params`` are broadcast from their
    owners within the node, and once the node's owners are all done (a barrier), every rank counts the blocks the
    others stepped as changed, so that its device copies are made again from the shared homes, which it does not
    write.

    Args:
        engine: The rank's :class:`~.engine.StreamingEngine`.
        params: The optimizer's parameters.
        averager: The engine's averager, with ``node``.
    """
    node = averager.node
    assert node is not None
    elsewhere: list[int] = []
    for index, home in enumerate(engine.homes):
        stepped = [] if home is None else [piece.param for piece in home.slices if piece.param in params]
        if stepped and averager.owns(stepped[0]):
            engine.mark_stepped(index, stepped)
        elif stepped:
            elsewhere.append(index)
    for param in engine.trunk_parameters():
        if param in params:
            _broadcast_host(param.data, averager.source(param), averager.device, node.group)
    node.barrier()  # no rank copies a block in before its owner finished writing it
    for index in elsewhere:
        engine.mark_stepped(index)


def _broadcast_host(tensor: Tensor, src: int, device: torch.device, group: Any = None) -> None:
    """Broadcasts a host tensor in place from global rank ``src`` over ``group`` (through the device under NCCL)."""
    if dist.get_backend(group) == "nccl":
        carrier = tensor.to(device)
        dist.broadcast(carrier, src=src, group=group)
        tensor.copy_(carrier)
    else:
        dist.broadcast(tensor, src=src, group=group)


def gather_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A sharded optimizer's state dict with every rank's ``state`` (disjoint parameters) merged, on rank 0; the
    other ranks keep theirs (only rank 0 writes the checkpoint)."""
    everyone: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state["state"], everyone, dst=0)
    if everyone is None:
        return state
    merged = {key: value for part in everyone for key, value in part.items()}
    return {**state, "state": dict(sorted(merged.items()))}


def fingerprint(model: nn.Module, knobs: Mapping[str, Any], precision: str) -> dict[str, Any]:
    """What must agree between ranks: the knobs as written, the precision, and each parameter's name, shape, dtype
    and whether it trains."""
    return {
        "knobs": {name: _describe(value) for name, value in knobs.items()},
        "precision": precision,
        "parameters": [
            (name, tuple(param.shape), str(param.dtype), param.requires_grad)
            for name, param in model.named_parameters()
        ],
    }


def _describe(value: Any) -> str:
    """A knob's value, comparable across processes (no object addresses)."""
    if callable(value) and not isinstance(value, type):
        return f"{type(value).__name__} {getattr(value, '__qualname__', '')}"
    if isinstance(value, (set, frozenset, list, tuple)):
        return repr(sorted(getattr(v, "__qualname__", repr(v)) for v in value))
    if hasattr(value, "__dict__") and not isinstance(value, (str, int, float, bool, type)):
        public = sorted((k, repr(v)) for k, v in vars(value).items() if not k.startswith("_"))
        return f"{type(value).__name__}({public})"
    return repr(value)


def check_same_setup(mine: dict[str, Any], call: str) -> None:
    """Compares every rank's :func:`fingerprint` with rank 0's; raises on every rank if any differs.

    Args:
        mine: This rank's fingerprint.
        call: How the user wrote the strategy, for the message.

    Raises:
        RanksDisagreeError: Naming the first knob or parameter that differs, and on which rank.
    """
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for name, value in reference["knobs"].items():
            if theirs["knobs"].get(name) != value:
                raise RanksDisagreeError(
                    f"{call} must be given the same knobs on every rank, but rank {rank} has {name}="
                    f"{theirs['knobs'].get(name)} where rank 0 has {name}={value}. Each rank streams its blocks and"
                    " reduces their gradients in the same order, so the ranks cannot differ."
                )
        if theirs["precision"] != reference["precision"]:
            raise RanksDisagreeError(
                f"{call} needs one precision on every rank, but rank {rank} runs precision={theirs['precision']!r}"
                f" where rank 0 runs {reference['precision']!r}."
            )
        if theirs["parameters"] != reference["parameters"]:
            ours, other = reference["parameters"], theirs["parameters"]
            first = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
            what = lambda entries, first=first: repr(entries[first]) if first < len(entries) else "nothing"  # noqa: E731
            raise RanksDisagreeError(
                f"{call} needs the same model on every rank, but parameter {first} is {what(other)} on rank {rank}"
                f" and {what(ours)} on rank 0 (name, shape, dtype, requires_grad); rank {rank} has {len(other)}"
                f" parameters, rank 0 {len(ours)}."
            )


def _exchange(
    error: Optional[BaseException], group: Any = None, payload: Any = None
) -> list[tuple[Optional[str], Any]]:
    """Every rank's error message (``None``: none) and ``payload``, gathered over ``group``."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    message = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(everyone, (message, payload), group=group)
    return everyone


def _failures(what: str, everyone: Sequence[tuple[Optional[str], Any]], ranks: Sequence[int]) -> RanksDisagreeError:
    failed = [(rank, message) for rank, (message, _) in zip(ranks, everyone) if message is not None]
    return RanksDisagreeError(
        f"SuperpipeStrategy could not {what} on " + "; ".join(f"rank {rank}: {message}" for rank, message in failed)
    )


def agree(
    error: Optional[BaseException], what: str, group: Any = None, ranks: Optional[Sequence[int]] = None,
    payload: Any = None,
) -> list[Any]:
    """One step that every rank of ``group`` took: raises on all of them if it failed on any, else returns every
    rank's ``payload``.

    Args:
        error: This rank's failure in the step, or ``None``.
        what: The step, for the message (e.g. ``"share the blocks' host memory"``).
        group: The ranks (``None``: every rank of the run).
        ranks: Their global ranks, for the message (default: ``0 ..``).
        payload: What this rank tells the others.

    Raises:
        BaseException: This rank's own ``error``.
        RanksDisagreeError: Quoting the failed ranks' errors, on the others.
    """
    everyone = _exchange(error, group, payload)
    if all(message is None for message, _ in everyone):
        return [payload for _, payload in everyone]
    failure = error if error is not None else _failures(what, everyone, ranks or range(len(everyone)))
    if group is None:  # every rank of the run raises now: on_every_rank must not exchange errors again
        setattr(failure, _AGREED, True)
    raise failure


def ready_on_every_rank(what: str) -> None:
    """Before a step with collectives of its own inside :func:`on_every_rank`'s ``work``: every rank got this far, or
    every rank raises now (the ranks that failed earlier, in :func:`on_every_rank`, hear of no new failure).

    Raises:
        RanksDisagreeError: Quoting the errors of the ranks that failed before getting here.
    """
    everyone = _exchange(None)
    if any(message is not None for message, _ in everyone):
        failure = _failures(what, everyone, range(len(everyone)))
        setattr(failure, _AGREED, True)
        raise failure


def on_every_rank(work: Callable[[], T], what: str) -> T:
    """Runs ``work`` on every rank and raises on every rank if it failed on any, instead of leaving the others
    waiting in their first collective.

    Args:
        work: What each rank does (setting up streaming).
        what: What it is, for the message (e.g. ``"start streaming"``).

    Raises:
        BaseException: This rank's own error, where ``work`` failed here.
        RanksDisagreeError: Quoting the failed ranks' errors, on the ranks where ``work`` succeeded.
    """
    error: Optional[BaseException] = None
    result: Any = None
    try:
        result = work()
    except Exception as caught:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
        if getattr(caught, _AGREED, False):  # every rank raised it together already
            raise
        error = caught
    agree(error, what)
    return result


def broadcast_from_rank_zero(
    model: nn.Module, device: torch.device, skip: Optional[Callable[[Tensor], bool]] = None
) -> None:
    """Gives every rank rank 0's parameters and buffers, as ``DistributedDataParallel`` does when it wraps a model,
    but those ``skip`` names (every rank will compute rank 0's values for them).

    The tensors are host-resident: gloo broadcasts them where they are; NCCL through the device, one at a time.
    """
    nccl = dist.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "meta" or (skip is not None and skip(tensor)):
                continue
            carrier = tensor.detach()
            if nccl:
                carrier = carrier.to(device)
            elif not carrier.is_contiguous():
                carrier = carrier.contiguous()
            dist.broadcast(carrier, src=0)
            if carrier.data_ptr() != tensor.data_ptr():
                tensor.copy_(carrier)


def every_ranks_rng_states(states: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG states, gathered (each rank draws its own dropout masks)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, states)
    return everyone
