"""Deferred initialization: a model built in ``configure_model`` under the disk tier has its init functions recorded
instead of run, so that its blocks reach their files one at a time and the whole model never sits in host memory.

Every call of a ``torch.nn.init`` function (and of the in-place random fills ``Tensor.normal_``, ``uniform_``,
``zero_``, ``fill_``) on a host tensor is recorded with the state of the generator it draws from, and the
generator is advanced as the call would have advanced it (the call runs into a scratch tensor of the same layout,
freed at once). Replaying a record later restores that state first, so every tensor gets exactly the values an eager
build with the same seed gives it, in any order, and the code after construction sees the same random stream.

Any other operator that touches a tensor with pending records while the mode is active (a read, a partial write,
``load_state_dict``'s copies) first runs those records into it, so the user's code in ``configure_model`` never
sees an uninitialized value. What stays pending when ``configure_model`` returns is resolved by the strategy:
block parameters through :meth:`DeferredInit.initial_values` (a fresh tensor per parameter, written to its file and
dropped, while the parameter's own memory is never touched), everything else in place
(:meth:`DeferredInit.materialize`), whatever a checkpoint loads is dropped (:meth:`DeferredInit.discard`), and a
set-up that fails initializes everything in place (:meth:`DeferredInit.settled`).

:func:`load_safetensors` called inside the mode replaces a tensor's records with a read of the file's tensor, so
that a saved model's weights too are read block by block as the blocks are written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten
from typing_extensions import override

from lightning_superpipe.memory.disk import limit_heap_retention

#: Where init functions live: transformers 5 swaps ``torch.nn.init``'s functions for its own during ``post_init``.
_INIT_MODULES = {"torch.nn.init", "transformers.initialization"}
#: In-place tensor methods that initializers call directly (``module.weight.data.normal_()``): recorded too.
_FILL_METHODS = {"normal_", "uniform_", "zero_", "fill_"}
#: Functions that draw nothing from a generator: recording them needs no scratch run.
_DRAW_NOTHING = {"zeros_", "ones_", "constant_", "eye_", "dirac_", "copy_", "zero_", "fill_"}
#: Operators that read no values (metadata, views, attribute access): they leave records pending.
_NO_READ = {
    "__get__", "__set__", "size", "dim", "stride", "storage_offset", "numel", "data_ptr", "untyped_storage",
    "is_contiguous", "element_size", "requires_grad_", "detach", "view", "view_as", "t", "transpose", "permute",
    "narrow", "select", "unsqueeze", "squeeze", "expand", "expand_as", "as_strided", "__len__", "__hash__",
    "is_floating_point", "is_complex", "_make_subclass", "_has_compatible_shallow_copy_type",
}


@dataclass
class _Record:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Tensor
    generator: Optional[torch.Generator]
    state: Optional[Tensor]

    def run(self, target: Optional[Tensor] = None) -> None:
        """Runs the call into ``target`` (a tensor of ``self.target``'s layout; default: the recorded one) with the
        generator as it was when the call was recorded, then puts the generator back."""
        args, kwargs = self.args, self.kwargs
        if target is not None:
            args, kwargs = _replaced(args, kwargs, self.target, target)
        now = self.generator.get_state() if self.generator is not None else None
        if self.generator is not None:
            self.generator.set_state(self.state)
        try:
            with torch.no_grad():  # the call ran where it could write a parameter: an init function's own mode
                self.func(*args, **kwargs)
        finally:
            if self.generator is not None:
                self.generator.set_state(now)


class UnfilledNewTensors:
    """For the modes that build a model without touching its memory: ``Trainer(deterministic=True)``
    (``torch.utils.deterministic.fill_uninitialized_memory``) would write NaN into every page of each new tensor, so
    it is off while the mode is active (and ``enabled``, where the mode has that flag)."""

    def __enter__(self) -> Any:
        self._filled = torch.utils.deterministic.fill_uninitialized_memory
        if getattr(self, "enabled", True):
            torch.utils.deterministic.fill_uninitialized_memory = False
        return super().__enter__()  # type: ignore[misc]

    def __exit__(self, *exc: Any) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self._filled
        super().__exit__(*exc)  # type: ignore[misc]


class DeferredInit(UnfilledNewTensors, TorchFunctionMode):
    """Records the init calls on host tensors made inside it (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        #: Pending records by the address of the storage they write, in call order.
        self._pending: dict[int, list[_Record]] = {}

    @override
    def __enter__(self) -> DeferredInit:
        # A fixed mmap threshold: large tensors then get pages of their own, untouched until written, and the
        # scratch runs' pages go back to the system instead of into the next parameter's allocation.
        limit_heap_retention()
        return super().__enter__()

    @override
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        module = getattr(func, "__module__", None)
        initializer = module in _INIT_MODULES or (name in _FILL_METHODS and getattr(torch.Tensor, name, None) is func)
        target = (kwargs["tensor"] if "tensor" in kwargs else args[0] if args else None) if initializer else None
        if isinstance(target, Tensor) and target.device.type == "cpu" and not name.startswith("_"):
            if module == "transformers.initialization" and getattr(target, "_is_hf_initialized", False):
                return target  # what the function itself does for a tensor transformers has loaded
            self._record(func, args, kwargs, target)
            return target
        if name == "to" and args and isinstance(args[0], Tensor) and _same_tensor_after(args[0], args[1:], kwargs):
            return args[0]  # a cast to its own dtype and device reads nothing (a precision plugin's convert_module)
        if name not in _NO_READ and not (name == "__getitem__" and _basic_index(args[1])):
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, Tensor) and value.device.type == "cpu":
                    self._run_pending(value)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Tensor) -> None:
        generator = next((v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Generator)), None)
        name = func.__name__
        if generator is None and name not in _DRAW_NOTHING:
            generator = torch.default_generator
        state = generator.get_state() if generator is not None else None
        # An alias keeps the storage the call writes, and so its key, even after `param.data` is replaced (the tier
        # parks its parameters): a replay in place never writes the tensor that took the parameter's place.
        alias = target.detach()
        args, kwargs = _replaced(tuple(args), dict(kwargs), target, alias)
        record = _Record(func, args, kwargs, alias, generator, state)
        if generator is not None:  # the draws the call would have made, so that the stream goes on as eagerly
            scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
            scratch_args, scratch_kwargs = _replaced(args, kwargs, alias, scratch)
            func(*scratch_args, **scratch_kwargs)
            del scratch
        key = _storage_key(target)
        if _covers_storage(target):  # a whole overwrite: what was recorded for this storage before is moot
            self._pending[key] = [record]
        else:
            self._pending.setdefault(key, []).append(record)

    def _run_pending(self, tensor: Tensor) -> None:
        records = self._pending.pop(_storage_key(tensor), None)
        for record in records or ():
            record.run()

    def materialize(self, tensors: Union[nn.Module, Iterable[Tensor]]) -> None:
        """Runs the pending records of ``tensors``' storages (a module's: its parameters' and buffers') into them."""
        if isinstance(tensors, nn.Module):
            tensors = [*tensors.parameters(), *tensors.buffers()]
        for tensor in tensors:
            self._run_pending(tensor)

    def adopt_rank_zero_draws(self) -> None:
        """On several ranks, before rank 0's values are broadcast: gives every record rank 0's generator state, so
        that each rank's replay gives rank 0's values without them crossing between ranks (each rank built the same
        model in the same order, so its records line up with rank 0's). A tensor whose first record writes only
        part of it is initialized in place first: its other values are eager ones, which the broadcast brings.

        Raises:
            RanksDisagreeError: On every rank, where some rank recorded other calls than rank 0.
        """
        import torch.distributed as dist

        from lightning_superpipe.streaming.distributed import RanksDisagreeError, agree

        for pending in list(self._pending.values()):
            if not _covers_storage(pending[0].target):
                self._run_pending(pending[0].target)
        records = [record for pending in self._pending.values() for record in pending]
        mine = [(getattr(r.func, "__qualname__", repr(r.func)), tuple(r.target.shape)) for r in records]
        shared: list[Any] = [mine, [r.state for r in records]]
        dist.broadcast_object_list(shared, src=0)
        error = None
        if shared[0] != mine:
            theirs, ours = shared[0] + [None], mine + [None]
            differ = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
            error = RanksDisagreeError(
                f"configure_model made other init calls on rank {dist.get_rank()} than on rank 0 (call {differ}:"
                f" {ours[differ]} here, {theirs[differ]} there): every rank must build the same model in the same"
                " order."
            )
        agree(error, "initialize the model built in configure_model")
        for record, state in zip(records, shared[1]):
            record.state = state

    def determines(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s values are its pending records' alone (it covers its storage, and so does the first
        record), so that replaying them gives them whole."""
        records = self._pending.get(_storage_key(tensor))
        return records is not None and _covers_storage(tensor) and _covers_storage(records[0].target)

    def pending_bytes(self, tensors: Iterable[Tensor]) -> int:
        """Bytes of ``tensors``' storages that still wait for their records (each storage once): host memory that
        running them in place will fill."""
        storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors if _storage_key(t) in self._pending}
        return sum(storages.values())

    def discard(self, tensors: Iterable[Tensor]) -> None:
        """Drops the records of ``tensors``' storages (values loaded from a checkpoint replace them)."""
        for tensor in tensors:
            self._pending.pop(_storage_key(tensor), None)

    def initial_values(self, block: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each of ``block``'s tensors' values: a fresh tensor with its records run into it where it has any (its
        own memory stays untouched; the records stay until :meth:`settled` ends), else the tensor itself. A tensor
        that shares its storage with others, or covers only part of it, is initialized in place instead."""
        values: dict[str, Tensor] = {}
        for name, tensor in block.items():
            records = self._pending.get(_storage_key(tensor))
            if records is None:
                values[name] = tensor.detach()
            elif not self.determines(tensor):
                self._run_pending(tensor)  # shared, or its first record writes only part: start from its values
                values[name] = tensor.detach()
            elif (read := _whole_read(records, tensor)) is not None:
                values[name] = read  # a file's tensor as it was read: no second copy of it
            else:
                fresh = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
                for record in records:  # kept until `settled` ends: if the tier fails, the tensor still needs them
                    target = record.target
                    record.run(fresh.as_strided(target.size(), target.stride(), target.storage_offset()))
                values[name] = fresh
        return values

    def clear(self) -> None:
        self._pending.clear()

    @contextmanager
    def settled(self, module: nn.Module) -> Iterator[None]:
        """Leaves no record behind whatever happens inside: on an error, ``module``'s tensors still pending are
        initialized in place (a failed set-up loses no weight), then the records go."""
        try:
            yield
        except BaseException:
            self.materialize(module)
            raise
        finally:
            self.clear()

    def defer_load(self, target: Tensor, read: Callable[[], Tensor]) -> None:
        """Makes ``read()`` (a tensor of ``target``'s shape) ``target``'s value in place of its pending init."""
        alias = target.detach()  # as in `_record`
        self._pending[_storage_key(target)] = [_Record(_copy_read, (alias, read), {}, alias, None, None)]


def _copy_read(target: Tensor, read: Callable[[], Tensor]) -> None:
    target.copy_(read())


def _whole_read(records: list[_Record], tensor: Tensor) -> Optional[Tensor]:
    """The tensor a lone :meth:`DeferredInit.defer_load` record reads, as ``tensor``'s value (cast to its dtype where
    the file's differs), or ``None`` where ``tensor`` has other records or is not contiguous."""
    if len(records) != 1 or records[0].func is not _copy_read or not tensor.is_contiguous():
        return None
    read = records[0].args[1]().reshape(tensor.shape)
    return read.to(dtype=tensor.dtype, memory_format=torch.contiguous_format)


def load_safetensors(module: nn.Module, path: Union[str, os.PathLike[str], Sequence[Union[str, os.PathLike[str]]]],
                     strict: bool = True) -> list[str]:
    """Loads the tensors of safetensors files (a folder's ``*.safetensors``, or the files given) into ``module``'s
    parameters and buffers of the same names, one tensor at a time (never the whole file in host memory).

    Called in ``configure_model`` under ``SuperpipeStrategy(offload_device="disk")``, it reads nothing yet: each
    tensor is read when its block is written to the tier's files, so a model larger than host memory loads. Anywhere
    else it loads at once. Names follow ``module.state_dict()``: for a ``transformers`` model, call it on the model,
    whose names ``save_pretrained`` writes. A name that shares its tensor with a loaded one (tied weights) needs no
    tensor of its own.

    Returns:
        The module's names that no file holds (with ``strict=False``).

    Raises:
        ValueError: No files, a shape that differs, or (``strict``) names on one side only: with a list of each.
    """
    from safetensors import safe_open

    files = _safetensors_files(path)
    where: dict[str, Path] = {}
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for key in opened.keys():
                where[key] = file
                shapes[key] = opened.get_slice(key).get_shape()
    targets = module.state_dict(keep_vars=True)
    names, converted = _model_names(module, list(where), targets)
    keys_of = {name: key for key, name in names.items()}
    where = {names[key]: file for key, file in where.items() if key in names}
    shapes = {names[key]: shape for key, shape in shapes.items() if key in names}
    deferred = next((mode for mode in reversed(_get_current_function_mode_stack()) if isinstance(mode, DeferredInit)),
                    None)
    mismatched = [f"{name}: {shapes[name]} in the file, {list(t.shape)} here"
                  for name, t in targets.items() if name in where and list(t.shape) != shapes[name]]
    if mismatched:
        raise ValueError(f"load_safetensors: shapes differ from {files[0].parent}: {'; '.join(mismatched[:4])}")
    loaded = {_storage_key(t) for name, t in targets.items() if name in where}
    missing = [name for name, t in targets.items() if name not in where and _storage_key(t) not in loaded]
    unexpected = sorted(set(where) - set(targets)) + converted
    if strict and (missing or unexpected):
        raise ValueError(
            f"load_safetensors: {files[0].parent} does not match the module: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} ({len(missing)}), unexpected {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''} ({len(unexpected)}). A checkpoint whose layout transformers"
            " converts as it loads (fused experts of MoE models) cannot be read tensor by tensor: load it with"
            " `from_pretrained` instead, or pass strict=False to load what matches."
        )
    for name, target in targets.items():
        if name not in where:
            continue
        read = _reader(where[name], keys_of[name])
        if deferred is not None and target.device.type == "cpu":
            deferred.defer_load(target, read)
        else:
            with torch.no_grad():
                target.copy_(read())
    return missing


def save_safetensors(
    module: nn.Module, path: Union[str, os.PathLike[str]], dtype: Optional[torch.dtype] = None
) -> list[str]:
    """Writes ``module``'s state dict as one safetensors file, one tensor at a time (``safetensors``' own writer holds
    every tensor's bytes at once), so that a model larger than host memory is exported for inference without being
    gathered: after a run on the disk tier its parameters are views of the tier's files, read page by page here, and
    each tensor's pages are given back once written (:class:`~lightning_superpipe.memory.disk.MappedFiles`); during
    the run (a callback exporting every few steps) the blocks' committed values are written the same way, mapped
    from the tier's files: those of the last step committed.
    A tensor that is an earlier name's (tied weights) is written once, under its first name, as ``save_pretrained``
    writes it and :func:`load_safetensors` and ``from_pretrained`` read it. ``dtype`` casts the floating-point
    tensors (e.g. ``torch.bfloat16`` for inference).

    Returns:
        The names left out as another name's tensor.

    Raises:
        ValueError: A tensor holds no values (on the meta device, or a disk tier's placeholder outside its run).
        DiskTierError: Writing the file failed (it names the file; nothing is left half-written).
    """
    from lightning_superpipe.memory.disk import MappedFiles, write_safetensors

    layout, tensors, aliases = [], [], []
    seen: set[tuple[Any, ...]] = set()
    committed: Optional[dict[str, Tensor]] = None
    # The parameters themselves (keep_vars), so that tied ones are found by their storage.
    for name, tensor in module.state_dict(keep_vars=True).items():
        placeholder = isinstance(tensor, nn.Parameter) and _placeholder(tensor)
        if placeholder:
            # A disk tier's block parameter during its run: the plain state dict holds its committed value there,
            # mapped from the tier's file (its state-dict hook), tied parameters one mapping alike; outside a run,
            # the placeholder again.
            committed = module.state_dict() if committed is None else committed
            tensor = committed[name]
        if tensor.device.type == "meta" or (placeholder and _placeholder(tensor)):
            raise ValueError(
                f"save_safetensors: {name} holds no values (a tensor on the meta device, or a placeholder of the disk"
                " tier outside its run); save the model from a module that holds its weights, or from a checkpoint."
            )
        view = (_storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in seen:
            aliases.append(name)
            continue
        seen.add(view)
        layout.append((name, tensor.dtype, tuple(tensor.shape)))
        tensors.append(tensor)
    # Pages mapped from files are given back as each tensor is written: in the strategy benchmark's export of 0.86 GB
    # the peak resident set was 0.66 GB instead of 1.52 GB.
    write_safetensors(path, layout, tensors, dtype, written=MappedFiles().release)
    return aliases


def _placeholder(tensor: Tensor) -> bool:
    """A tensor whose storage is smaller than its elements: broadcast (for a parameter, the disk tier's placeholder)."""
    return tensor.device.type != "meta" and tensor.untyped_storage().nbytes() < tensor.nbytes


def _model_names(module: nn.Module, keys: list[str], targets: Mapping[str, Tensor]) -> tuple[dict[str, str], list[str]]:
    """Each file key's name in ``module``, renamed as ``from_pretrained`` renames it (``transformers``' renamings of
    legacy names and of the base model's prefix), and the keys that would need one of its conversions (tensors
    merged or split as they load), which cannot be read one by one."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # an older transformers: names as they are
        return {key: key for key in keys}, []
    if not isinstance(module, PreTrainedModel):
        return {key: key for key in keys}, []
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names, converted = {}, []
    for key in keys:
        name, conversion = rename_source_key(key, renamings, converters, module.base_model_prefix, dict(targets))
        if conversion is not None:
            converted.append(key)
        else:
            names[key] = name
    return names, converted


def _safetensors_files(path: Union[str, os.PathLike[str], Sequence[Union[str, os.PathLike[str]]]]) -> list[Path]:
    if isinstance(path, (str, os.PathLike)):
        folder = Path(path)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    else:
        files = [Path(item) for item in path]
    missing = [str(file) for file in files if not file.is_file()]
    if not files or missing:
        found = f"no such file {missing[0]}" if missing else "no *.safetensors files"
        raise ValueError(f"load_safetensors({str(path)!r}): {found}")
    return files


def _reader(file: Path, key: str) -> Callable[[], Tensor]:
    def read() -> Tensor:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as opened:  # open and closed per tensor: no mapping stays
            return opened.get_tensor(key)

    return read


def _storage_key(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _covers_storage(tensor: Tensor) -> bool:
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


def _same_tensor_after(tensor: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` returns ``tensor`` itself (asked of an empty tensor like it)."""
    if kwargs.get("copy") or "memory_format" in kwargs:
        return False
    probe = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return probe.to(*args, **kwargs) is probe


def _basic_index(index: Any) -> bool:
    """Whether ``tensor[index]`` is a view (integers, slices, ``None``, ``...``), which reads nothing."""
    items = index if isinstance(index, tuple) else (index,)
    basic = (int, slice, type(None), type(Ellipsis))
    return all(isinstance(item, basic) and not isinstance(item, bool) for item in items)


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], old: Tensor, new: Tensor) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the target ``old`` (by identity, at the top level) replaced by ``new``."""
    return (
        tuple(new if value is old else value for value in args),
        {key: new if value is old else value for key, value in kwargs.items()},
    )
