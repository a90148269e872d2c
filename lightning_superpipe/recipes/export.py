"""A fine-tune exported for inference without this package: a ``peft`` adapter folder for LoRA and QLoRA, a
``save_pretrained`` folder (safetensors, sharded where large) for a full fine-tune; from a ``.ckpt``
(``superpipe export``) or a module (:func:`export_pretrained`), and beside every checkpoint of a run
(:class:`ExportCheckpoints`).

The folders are written by ``peft``'s and ``transformers``' own ``save_pretrained``, so ``PeftModel.from_pretrained``
and ``AutoModelForCausalLM.from_pretrained`` load them with neither this package nor Lightning installed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from typing_extensions import override

from lightning_superpipe.memory.home import kind_that_wrote
from lightning_superpipe.recipes.causal_lm import CausalLMModule
from lightning_superpipe.recipes.errors import RecipeError, first_line
from lightning_superpipe.recipes.tokenization import has_tokenizer_files
from lightning_superpipe.units import parse_bytes

__all__ = ["ExportCheckpoints", "export_pretrained"]

log = logging.getLogger(__name__)

#: The largest safetensors file of a full model's export (``transformers``' "5GB": 5 * 10**9 bytes); a larger model
#: is written in shards with their index, as on the Hugging Face Hub.
MAX_SHARD_SIZE = "5GB"
#: The subfolder of a LoRA export that holds its base model, where the base has no folder of its own (built from a
#: config, with random weights).
BASE_MODEL_FOLDER = "base_model"
#: The file of a QLoRA export that holds the base's ``BitsAndBytesConfig`` (``BitsAndBytesConfig.from_dict``), with
#: which the base loads as it was trained on.
BASE_QUANTIZATION_FILE = "base_quantization_config.json"
#: Why the adapters of a QLoRA run on random weights (``model.quantization`` without ``model.pretrained_path``) cannot
#: be exported: their base is in no file (not in the checkpoint, which holds the adapters only).
RANDOM_4BIT_BASE = (
    "the LoRA adapters are on a 4-bit base built from random weights, which neither the checkpoint nor a folder holds;"
    " train on a saved model (model.pretrained_path) to export an adapter others can load"
)
#: Checkpoint hyperparameters LightningCLI adds for ``load_from_checkpoint``, which are not the module's arguments.
_CLI_KEYS = ("_instantiator", "_class_path")

Source = Union[nn.Module, str, "os.PathLike[str]"]


def export_pretrained(
    source: Source,
    output_dir: Union[str, os.PathLike[str]],
    max_shard_size: Union[int, str] = MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> Path:
    """Writes ``source``'s model as ``transformers`` and ``peft`` load it, with neither this package nor Lightning.

    * LoRA and QLoRA: a ``peft`` adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), loaded by
      ``PeftModel.from_pretrained(base, output_dir)``. Its ``base_model_name_or_path`` is ``model.pretrained_path``,
      absolute. A base built from a config (random weights) has no folder: it is written to ``output_dir/base_model``
      and named there. Embeddings resized for the tokenizer are saved with the adapter (peft's
      ``save_embedding_layers``). A 4-bit base's ``BitsAndBytesConfig`` is written to
      ``base_quantization_config.json``, to load the base as it was trained on.
    * A full fine-tune: a ``save_pretrained`` folder (``config.json``, safetensors files of at most
      ``max_shard_size`` and their index), loaded by ``AutoModelForCausalLM.from_pretrained(output_dir)``.

    The tokenizer of ``model.pretrained_path``, where it has one, is saved beside. The folder appears whole: it is
    written beside and renamed into place.

    Args:
        source: A ``.ckpt`` of a :class:`CausalLMModule` run (the ``superpipe`` recipes; a disk-tier checkpoint's blocks
            are read from the files beside it), such a module, or a ``transformers`` or ``peft`` model.
        output_dir: The folder to write; it must not exist, or be empty, unless ``overwrite``.
        max_shard_size: The largest weights file of a full model, in bytes or as ``"5GB"``, ``"500MiB"``.
        overwrite: Replace an existing ``output_dir`` (once the new one is complete).

    Returns:
        The folder written, absolute.

    Raises:
        RecipeError: ``output_dir`` is taken, ``max_shard_size`` is no byte quantity, ``source`` is no model this can
            export, or the checkpoint lacks weights its module needs.
        FileNotFoundError: The checkpoint does not exist.
    """
    target = Path(output_dir).expanduser().absolute()
    shard_bytes = _shard_bytes(max_shard_size)
    _check_target(target, overwrite)
    module = _load_checkpoint(Path(source).expanduser()) if isinstance(source, (str, os.PathLike)) else source
    model, base_folder = _exported_model(module)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if _is_peft(model):
            from_recipe = isinstance(module, CausalLMModule)
            _write_adapter(model, staging, target, base_folder, shard_bytes, from_recipe)
            what = "the LoRA adapter"
        else:
            model.save_pretrained(str(staging), state_dict=model.state_dict(), max_shard_size=shard_bytes)
            what = "the model"
        if base_folder is not None and has_tokenizer_files(Path(base_folder)):
            _write_tokenizer(Path(base_folder), staging)
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("Exported %s to %s.", what, target)
    return target


def _shard_bytes(max_shard_size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes.

    Raises:
        RecipeError: It is no positive byte quantity.
    """
    try:
        nbytes = int(max_shard_size if isinstance(max_shard_size, int) else parse_bytes(str(max_shard_size)))
    except ValueError:
        nbytes = 0
    if isinstance(max_shard_size, bool) or nbytes <= 0:
        raise RecipeError(
            f"max_shard_size={max_shard_size!r} is not a size: write a number of bytes or a quantity such as '5GB'"
            " or '500MiB'"
        )
    return nbytes


def _check_target(target: Path, overwrite: bool) -> None:
    """Raises:
    RecipeError: ``target`` is a file, or a folder with files in it and ``overwrite`` is off."""
    if target.exists() and not target.is_dir():
        raise RecipeError(f"the export's output_dir '{target}' is a file; name a folder")
    if not overwrite and target.is_dir() and any(target.iterdir()):
        raise RecipeError(
            f"the export's output_dir '{target}' exists and is not empty; name a new folder, or pass overwrite=True"
            " (superpipe export --overwrite true) to replace it"
        )


def _load_checkpoint(path: Path) -> CausalLMModule:
    """The :class:`CausalLMModule` of the ``.ckpt`` at ``path``, built from its hyperparameters and given its weights:
    an adapter-only checkpoint's base from ``pretrained_path``, a disk-tier checkpoint's blocks from its files.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        RecipeError: The checkpoint is not a :class:`CausalLMModule`'s, its base cannot be built again, or it lacks
            weights the module needs.
    """
    if not path.is_file():
        raise FileNotFoundError(f"the checkpoint '{path}' to export does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    settings = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if k not in _CLI_KEYS}
    if "model_type" not in settings or "state_dict" not in checkpoint:
        raise RecipeError(
            f"the checkpoint '{path}' was not written by CausalLMModule (the superpipe recipes); export the model of"
            " your own module instead: export_pretrained(module.model, output_dir)"
        )
    if settings.get("quantization") and settings.get("pretrained_path") is None:
        raise RecipeError(f"the checkpoint '{path}': {RANDOM_4BIT_BASE}")
    module = CausalLMModule(**settings)
    module.configure_model()
    state: dict[str, Tensor] = dict(checkpoint["state_dict"])
    rebuilt: set[str] = set()  # a 4-bit base kept apart: built again from pretrained_path, as a resume does
    writer = kind_that_wrote(checkpoint)
    if writer is not None:  # the blocks are beside the .ckpt (the disk tier's files)
        values, modules = writer.checkpoint_weights(path, checkpoint)
        state.update(values)
        rebuilt = {f"{name}." for name in modules}
    floating = {value.dtype for value in state.values() if value.is_floating_point()}
    if module.quantization is None and len(floating) == 1:
        module.model.to(floating.pop())  # a bf16-true run's weights stay bf16, not the built model's float32
    _load_weights(module, state, path, tuple(rebuilt))
    return module


def _load_weights(module: CausalLMModule, state: dict[str, Tensor], path: Path, rebuilt: tuple[str, ...]) -> None:
    """Loads ``state`` into ``module``, which may lack only what the run did not save: the frozen base of an
    adapter-only checkpoint, or the names under ``rebuilt``.

    Raises:
        RecipeError: ``state`` has weights the module lacks, or lacks weights the run saved.
    """
    unexpected = sorted(set(state) - set(module.state_dict()))
    if unexpected:
        raise RecipeError(
            f"the checkpoint has {len(unexpected)} weights this model lacks (first: '{unexpected[0]}'); "
            "was it trained with other model or lora settings?"
        )
    missing = module.load_state_dict(state, strict=False).missing_keys
    named = dict(module.named_parameters(remove_duplicate=False))
    loaded = {id(named[name]) for name in state if name in named}  # a tied alias of a loaded weight is loaded
    lacking = [
        name for name in missing
        if id(named.get(name)) not in loaded and not name.startswith(rebuilt)
        and not (module.saves_trainable_only and not (name in named and named[name].requires_grad))
    ]
    if lacking:
        raise RecipeError(
            f"the checkpoint '{path}' lacks {len(lacking)} weights of its model (first: '{lacking[0]}'); export the"
            " checkpoint a run saved, whole"
        )


def _exported_model(module: nn.Module) -> tuple[nn.Module, Optional[str]]:
    """The ``transformers`` or ``peft`` model of ``module`` and the folder its base comes from (``None``: none, or
    not known).

    Raises:
        RecipeError: ``module`` is neither such a model nor holds one as ``module.model``.
    """
    model = getattr(module, "model", None) if isinstance(module, LightningModule) else module
    if not (_is_peft(model) or hasattr(model, "save_pretrained")):
        holds = f" holding {type(model).__name__}" if isinstance(module, LightningModule) else ""
        raise RecipeError(
            "export_pretrained takes a transformers or peft model, a LightningModule holding one as `model` (built:"
            f" after configure_model), or a .ckpt of CausalLMModule; got {type(module).__name__}{holds}"
        )
    base_folder = getattr(module, "pretrained_path", None) if isinstance(module, CausalLMModule) else None
    if isinstance(module, CausalLMModule) and module.quantization is not None and base_folder is None:
        raise RecipeError(f"export_pretrained: {RANDOM_4BIT_BASE}")
    return model, base_folder


def _is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _write_adapter(model: Any, folder: Path, target: Path, base_folder: Optional[str], shard_bytes: int,
                   from_recipe: bool) -> None:
    """``peft``'s adapter folder of ``model`` in ``folder`` (bound for ``target``), naming its base: ``base_folder``
    absolute, or, for a recipe's model built from a config, its base written to :data:`BASE_MODEL_FOLDER`."""
    config = model.peft_config[model.active_adapter]
    base_name = config.base_model_name_or_path
    if base_folder is not None:
        base_name = str(Path(base_folder).expanduser().absolute())
    elif from_recipe:
        _write_base_model(model, folder / BASE_MODEL_FOLDER, shard_bytes)
        base_name = str(target / BASE_MODEL_FOLDER)
    quantization = getattr(model.get_base_model().config, "quantization_config", None)
    if quantization is not None:  # the 4-bit settings the base must be loaded with again, for the same logits
        quantization.to_json_file(str(folder / BASE_QUANTIZATION_FILE))
    resized = from_recipe and _embeddings_resized(model, base_folder)
    state = _adapter_state(model, embeddings=resized)
    previous, config.base_model_name_or_path = config.base_model_name_or_path, base_name
    try:
        # The adapters' state only: the whole state dict would dequantize a quantize_frozen base, or map every
        # block of a disk tier's. peft's "auto" looks the base up (on the Hub for a name that is no folder).
        model.save_pretrained(str(folder), state_dict=state, save_embedding_layers=resized if from_recipe else "auto")
    finally:
        config.base_model_name_or_path = previous


def _adapter_state(model: nn.Module, embeddings: bool) -> dict[str, Tensor]:
    """The state of ``model``'s modules that own trainable parameters (the adapters, and any module peft trains whole),
    by the model's names; with ``embeddings``, the input and output embeddings' too. A model with no trainable
    parameter (adapters set to inference) gives its whole state dict."""
    owners = [name for name, module in model.named_modules()
              if any(p.requires_grad for p in module.parameters(recurse=False))]
    if not owners:
        return model.state_dict()
    if embeddings:
        base = model.get_base_model()
        layers = {id(base.get_input_embeddings()), id(base.get_output_embeddings())}
        owners += [name for name, module in model.named_modules() if id(module) in layers]
    modules = dict(model.named_modules())
    state: dict[str, Tensor] = {}
    for name in dict.fromkeys(owners):
        # Each module's own state_dict: the hooks of the streamed blocks (a disk tier's committed values) run.
        state.update(modules[name].state_dict(prefix=f"{name}."))
    return state


def _embeddings_resized(model: Any, base_folder: Optional[str]) -> bool:
    """Whether ``model``'s input embeddings have other rows than its base folder's configuration says (resized for
    the tokenizer: the new rows are in no file but the export)."""
    if base_folder is None:
        return False
    from transformers import AutoConfig

    rows = model.get_base_model().get_input_embeddings().num_embeddings
    config = AutoConfig.from_pretrained(base_folder, local_files_only=True)
    return rows != getattr(config.get_text_config(), "vocab_size", rows)


def _write_base_model(model: Any, folder: Path, shard_bytes: int) -> None:
    """The base of the peft ``model`` (its LoRA layers' base layers, by the base model's own names) as a
    ``save_pretrained`` folder."""
    base = model.get_base_model()
    state = {name.replace(".base_layer.", "."): value for name, value in base.state_dict().items()
             if ".lora_" not in name}
    base.save_pretrained(str(folder), state_dict=state, max_shard_size=shard_bytes)


def _write_tokenizer(source: Path, folder: Path) -> None:
    """The tokenizer of ``source``, saved into ``folder`` by ``transformers``.

    Raises:
        RecipeError: ``transformers`` cannot load it.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as error:
        raise RecipeError(f"cannot export the tokenizer of '{source}': {first_line(error)}") from error
    tokenizer.save_pretrained(str(folder))


def _move_into_place(staging: Path, target: Path) -> None:
    """Renames the complete ``staging`` folder to ``target``, replacing what was there only once it is in place."""
    previous = staging.with_name(staging.name + ".previous") if target.exists() else None
    if previous is not None:
        target.rename(previous)
    staging.rename(target)
    if previous is not None:
        shutil.rmtree(previous)


def export_folder(ckpt_path: Union[str, os.PathLike[str]]) -> Path:
    """Where :class:`ExportCheckpoints` writes the export of the checkpoint ``ckpt_path``: ``<name>.ckpt.export``."""
    return Path(f"{os.fspath(ckpt_path)}.export")


class ExportCheckpoints(Callback):
    """Writes an export (:func:`export_pretrained`) beside each checkpoint the run saves: ``last.ckpt.export/``
    beside ``last.ckpt``, replaced when ``last.ckpt`` is, removed when a checkpoint is (``ModelCheckpoint``'s
    ``save_top_k``).

    Rank 0 writes it right after the ``.ckpt``, from the module's weights, which are the checkpoint's then. It works
    through the strategy's checkpoint IO plugin, so every save is followed (``ModelCheckpoint``'s, those of
    :class:`~lightning_superpipe.recipes.ResumableCheckpoint` on Ctrl-C, ``trainer.save_checkpoint`` during ``fit``).
    Opt in: the recipes take ``--trainer.callbacks+=lightning_superpipe.recipes.ExportCheckpoints``.

    Args:
        max_shard_size: As :func:`export_pretrained`'s.
    """

    def __init__(self, max_shard_size: Union[int, str] = MAX_SHARD_SIZE) -> None:
        _shard_bytes(max_shard_size)
        self.max_shard_size = max_shard_size
        self._wrapped: Optional[tuple[Any, CheckpointIO]] = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _exported_model(pl_module)  # the module is built now (configure_model ran): refuse it before any step
        if self._wrapped is None:
            strategy = trainer.strategy
            self._wrapped = (strategy, strategy.checkpoint_io)
            strategy.checkpoint_io = _ExportingCheckpointIO(strategy.checkpoint_io,
                                                            lambda path: self._export(pl_module, path))

    def _export(self, module: LightningModule, ckpt_path: Union[str, os.PathLike[str]]) -> None:
        export_pretrained(module, export_folder(ckpt_path), self.max_shard_size, overwrite=True)

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            strategy, io = self._wrapped
            strategy.checkpoint_io = io
            self._wrapped = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap()


class _ExportingCheckpointIO(CheckpointIO):
    """The strategy's checkpoint IO, with ``export(path)`` after each save and the export's folder removed with its
    checkpoint."""

    def __init__(self, inner: CheckpointIO, export: Callable[[str], None]) -> None:
        self.inner = inner
        self.export = export

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.export(path)

    @override
    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
                        ) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        folder = export_folder(path)
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)

    @override
    def teardown(self) -> None:
        self.inner.teardown()


def export_command(args: Sequence[str]) -> Path:
    """``superpipe export --ckpt_path CKPT --output_dir DIR [--max_shard_size 5GB] [--overwrite true]``.

    Raises:
        ArgumentError: The arguments do not parse (``superpipe`` prints one line).
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="superpipe export", exit_on_error=False,
        description="Write a checkpoint's model for transformers and peft: a LoRA adapter folder, or a full"
                    " save_pretrained folder, which from_pretrained loads without lightning_superpipe.",
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt of a superpipe recipe's run.")
    parser.add_argument("--output_dir", type=str, required=True, help="The folder to write (new, or empty).")
    parser.add_argument("--max_shard_size", type=Union[int, str], default=MAX_SHARD_SIZE,
                        help="The largest weights file of a full model: bytes, or e.g. 5GB, 500MiB.")
    parser.add_argument("--overwrite", type=bool, default=False, help="Replace an existing output_dir.")
    config = parser.parse_args(list(args))
    return export_pretrained(config.ckpt_path, config.output_dir, config.max_shard_size, config.overwrite)
