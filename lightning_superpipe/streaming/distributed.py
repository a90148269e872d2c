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


def is_distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
            keeps every averaged gradient.
        group: The process group (``None``: the default one).
    """

    def __init__(
        self, device: torch.device, owners: Optional[dict[nn.Parameter, int]] = None, group: Any = None
    ) -> None:
        self.device = device
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.owners = owners
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
        """The rank that keeps ``param``'s averaged gradient (``None``: every rank)."""
        return self.owners.get(param, self.rank) if self.owners is not None else None

    def owns(self, param: nn.Parameter) -> bool:
        """Whether this rank keeps (and steps) ``param``'s averaged gradient."""
        return self.owners is None or self.owners.get(param, self.rank) == self.rank

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
        if dist.get_backend(self.group) == "nccl":
            on_device = carrier.to(self.device)
            dist.all_reduce(on_device, group=self.group)
            carrier = on_device.cpu()
        else:
            dist.all_reduce(carrier, group=self.group)
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
    """After each rank stepped its share (``shard_optimizer``): broadcasts every block's masters, and every trunk
    parameter, of the optimizer's ``params`` from its owner, so that all ranks stream the same new weights."""
    for home in homes:
        pieces = [] if home is None else [piece for piece in home.slices if piece.param in params]
        if pieces:
            _broadcast_host(home.master, averager.owner(pieces[0].param), averager.device)  # type: ignore[arg-type]
    for param in trunk:
        if param in params:
            _broadcast_host(param.data, averager.owner(param), averager.device)  # type: ignore[arg-type]


def _broadcast_host(tensor: Tensor, src: int, device: torch.device) -> None:
    """Broadcasts a host tensor in place (through the device under NCCL)."""
    if dist.get_backend() == "nccl":
        carrier = tensor.to(device)
        dist.broadcast(carrier, src=src)
        tensor.copy_(carrier)
    else:
        dist.broadcast(tensor, src=src)


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
            what = lambda entries: repr(entries[first]) if first < len(entries) else "nothing"  # noqa: E731
            raise RanksDisagreeError(
                f"{call} needs the same model on every rank, but parameter {first} is {what(other)} on rank {rank}"
                f" and {what(ours)} on rank 0 (name, shape, dtype, requires_grad); rank {rank} has {len(other)}"
                f" parameters, rank 0 {len(ours)}."
            )


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
        error = caught
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        raise RanksDisagreeError(
            f"SuperpipeStrategy could not {what} on " + "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        )
    return result


def broadcast_from_rank_zero(model: nn.Module, device: torch.device) -> None:
    """Gives every rank rank 0's parameters and buffers, as ``DistributedDataParallel`` does when it wraps a model.

    The tensors are host-resident: gloo broadcasts them where they are; NCCL through the device, one at a time.
    """
    nccl = dist.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "meta":
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


def rss_bytes() -> tuple[int, int]:
    """This process's resident set size now and at its peak, in bytes (Linux; zeros elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return 0, 0
    rss, peak = (int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))
    return rss, peak
