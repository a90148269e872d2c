"""The ``superpipe`` command: Lightning's CLI for causal-LM recipes, with one-line errors for bad input.

Usage::

    superpipe fit --config recipes/finetune_lora.yaml
    superpipe fit --config recipes/finetune_lora.yaml --trainer.max_steps 10 --model.lora.rank 4
    superpipe validate --config recipes/eval_moe_paged.yaml
    superpipe predict --config recipes/finetune_lora.yaml --ckpt_path superpipe_logs/.../last.ckpt
    superpipe export --ckpt_path superpipe_logs/.../last.ckpt --output_dir my-adapter

Ctrl-C or SIGTERM during ``fit`` saves ``last.ckpt`` after the current step and prints the command that resumes.
"""

from __future__ import annotations

import importlib
import logging
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import fields
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

# Registers the "superpipe" strategy name with Lightning before the recipe is parsed.
import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory import HostMemoryError
from lightning_superpipe.recipes.causal_lm import CausalLMModule
from lightning_superpipe.recipes.checkpointing import ResumableCheckpoint, TrainingInterrupted
from lightning_superpipe.recipes.errors import (
    RecipeError,
    describe_construction_error,
    describe_parse_error,
    first_line,
    raised_by_jsonargparse,
)
from lightning_superpipe.recipes.export import export_command
from lightning_superpipe.recipes.model_building import check_folder
from lightning_superpipe.recipes.progress import LoggingProgressBar, is_terminal
from lightning_superpipe.recipes.text_data import TextDataModule
from lightning_superpipe.run.options import KnobError, SuperpipeOptions
from lightning_superpipe.streaming import NoBlocksFoundError

#: Errors caused by the user's input, printed as one line. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    RecipeError,
    ArgumentError,
    MisconfigurationException,
    FileNotFoundError,
    NoBlocksFoundError,
    HostMemoryError,
)
#: A user error of MoE paging, raised only by its code: named here rather than imported, since importing the paging
#: code (and transformers' MoE integration) costs ``superpipe --help`` and every recipe without experts.
MOE_USER_ERROR = ("lightning_superpipe.moe.layouts", "UnsupportedMoEModelError")
#: Set to 1 to see the traceback of a user error too.
TRACEBACK_ENV = "SUPERPIPE_TRACEBACK"
#: Model settings that say how to run the model rather than what it is; the recipe's values win over a checkpoint's.
RUN_SETTINGS = ("optimizer", "generation")
SUBCOMMANDS = tuple(LightningCLI.subcommands())
#: What ``superpipe --help`` says of the subcommand that is not LightningCLI's.
EXPORT_HELP = (
    "superpipe export --ckpt_path CKPT --output_dir DIR writes a checkpoint's model for transformers and peft: a LoRA"
    " adapter folder, or a save_pretrained folder for a full fine-tune (superpipe export --help)."
)


class SuperpipeCLI(LightningCLI):
    """``LightningCLI`` for :class:`CausalLMModule` and :class:`TextDataModule`, with the two wired together.

    The tokenizer is read from the model's folder (``model.pretrained_path``) unless ``data.tokenizer_path`` names
    another, and the model's vocabulary follows the tokenizer, so a recipe names the model once. Where standard error
    is not a terminal, plain progress lines (:class:`LoggingProgressBar`) replace Lightning's progress bar.
    Configuration errors become :class:`RecipeError` with a one-line message.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # `data.tokenizer_path` defaults to the model's folder in `before_instantiate_classes`, not by a link: the
        # target of a link cannot be given on the command line.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            raise RecipeError(describe_parse_error(str(error), self._known_keys())) from error
        subcommand = self.config.get("subcommand")
        prefix = f"{subcommand}.model" if subcommand else "model"
        self._run_settings = {key: deepcopy(self.config.get(f"{prefix}.{key}")) for key in RUN_SETTINGS}

    def before_instantiate_classes(self) -> None:
        # With ``--ckpt_path``, Lightning re-applies the checkpoint's hyperparameters over the recipe and the command
        # line, so that the model is rebuilt as it was trained. That is right for what defines the weights (the
        # model, its LoRA adapters, the vocabulary) but not for how to run it now: ``predict --ckpt_path ...
        # --model.generation.max_new_tokens 8`` must generate 8 tokens, not as many as the training recipe said.
        subcommand = self.config.get("subcommand")
        prefix = f"{subcommand}." if subcommand else ""
        for key, value in self._run_settings.items():
            self.config[f"{prefix}model.{key}"] = value
        check_strategy_knobs(self.config.get(f"{prefix}trainer.strategy"))
        pretrained_path = self.config.get(f"{prefix}model.pretrained_path")
        if pretrained_path is not None:
            # The model's folder is where its tokenizer is looked for, so a wrong path is reported as the model's.
            check_folder(pretrained_path)
            if self.config.get(f"{prefix}data.tokenizer_path") is None:
                self.config[f"{prefix}data.tokenizer_path"] = pretrained_path

    def _known_keys(self) -> list[str]:
        parsers = getattr(self, "_subcommand_parsers", {}) or {"": self.parser}
        return sorted({key for parser in parsers.values() for key in parser.get_defaults().keys()})

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            # A class named in the recipe refused its arguments; jsonargparse wraps that in a list of every type
            # it tried. The class's own message is the one to show.
            if isinstance(error, RecipeError) or not raised_by_jsonargparse(error):
                raise
            raise RecipeError(describe_construction_error(error)) from error

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        settings = {**(self._get(self.config_init, "trainer", default={}) or {}), **kwargs}
        if wants_plain_progress(settings.get("enable_progress_bar"), settings.get("callbacks")):
            callbacks = settings.get("callbacks") or []
            kwargs["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), LoggingProgressBar()]
        # Lightning checks the trainer's settings (strategy name, accelerator, precision) only when it is created,
        # and raises ValueError or MisconfigurationException: both mean a wrong value under ``trainer``.
        try:
            return super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as error:
            if isinstance(error, RecipeError):
                raise
            raise RecipeError(f"trainer: {first_line(error)}") from error

    def fit(self, **kwargs: Any) -> None:
        """Run ``Trainer.fit`` (LightningCLI calls this method for ``superpipe fit``).

        Raises:
            TrainingInterrupted: However a signal stopped training (Ctrl-C once or twice, SIGTERM), naming the
                checkpoint to resume from.
        """
        try:
            self.trainer.fit(**kwargs)
        except BaseException:
            # Lightning ends a run stopped by SIGTERM with ``SIGTERMException`` and one stopped by a second Ctrl-C
            # with ``SystemExit(1)``; the checkpoint callback knows what happened and what it saved.
            interruptions = [
                callback.interruption
                for callback in self.trainer.callbacks  # type: ignore[attr-defined]
                if isinstance(callback, ResumableCheckpoint) and callback.interruption is not None
            ]
            if interruptions:
                raise interruptions[0] from None
            raise


def wants_plain_progress(enable_progress_bar: bool | None, callbacks: Any) -> bool:
    """Whether the run gets :class:`LoggingProgressBar` in place of Lightning's bar: where standard error is not a
    terminal, the bar is not turned off, and the recipe names no progress bar of its own."""
    listed = callbacks if isinstance(callbacks, list) else [callbacks] if callbacks is not None else []
    chosen = any(isinstance(callback, ProgressBar) for callback in listed)
    return enable_progress_bar is not False and not chosen and not is_terminal()


def check_strategy_knobs(strategy: Any) -> None:
    """Checks the knobs of a ``SuperpipeStrategy`` in the recipe before jsonargparse builds it.

    The strategy's constructor refuses a bad knob with a message that quotes it, but jsonargparse reports an error in
    the constructor of a ``Union`` argument (the Trainer's ``strategy``: a name or a ``Strategy``) as a value that
    matches none of its types, without that message. The knobs' own class says it here instead. A value jsonargparse
    has yet to build (a ``link`` given by ``class_path``) is left to the constructor.

    Raises:
        RecipeError: A knob is wrong (``trainer.strategy: `` and the strategy's message).
    """
    class_path = getattr(strategy, "class_path", None)
    if not isinstance(class_path, str):
        return
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return  # jsonargparse says what is wrong with the class path
    if not (isinstance(cls, type) and issubclass(cls, SuperpipeStrategy)):
        return
    init_args = getattr(strategy, "init_args", None) or {}
    knobs = {
        field.name: init_args.get(field.name)
        for field in fields(SuperpipeOptions)
        if field.name in init_args and not isinstance(init_args.get(field.name), (Namespace, dict))
    }
    try:
        SuperpipeOptions(**knobs)
    except KnobError as error:
        raise RecipeError(f"trainer.strategy: {error}") from error


def user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS`, with MoE paging's once its code is loaded (it cannot have raised before)."""
    module_name, class_name = MOE_USER_ERROR
    module = sys.modules.get(module_name)
    return (*USER_ERRORS, getattr(module, class_name)) if module is not None else USER_ERRORS


def resume_command(args: Sequence[str], checkpoint_path: str) -> str:
    """The ``superpipe`` command line ``args`` with ``--ckpt_path checkpoint_path`` in place of any it had."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg == "--ckpt_path":
            skip_value = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["superpipe", *kept, "--ckpt_path", checkpoint_path])


def describe_interruption(stop: TrainingInterrupted, args: Sequence[str]) -> str:
    """One line: what stopped training, where the checkpoint is and the command that resumes from it."""
    if stop.checkpoint_path is None:
        return f"{stop}; nothing to resume from"
    return f"{stop}; resume with: {resume_command(args, stop.checkpoint_path)}"


def one_line(error: BaseException) -> str:
    """The user-facing one-line description of ``error``."""
    if isinstance(error, ArgumentError):
        return describe_parse_error(str(error))
    return first_line(error)


class CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a message is logged, not when the handler was made, so that
    messages follow a redirection (``contextlib.redirect_stderr``, pytest's capture) instead of hitting a closed
    stream."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def show_recipe_messages() -> None:
    """Print the recipes' informational messages (what was packed, how many parameters LoRA trains) and the paged
    experts' calibration progress to stderr, as Lightning does for its own, unless the application has configured
    logging for them already."""
    for name in ("lightning_superpipe.recipes", "lightning_superpipe.moe"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = CurrentStderrHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def main(args: Sequence[str] | None = None) -> None:
    """Run ``superpipe``; ``args`` replaces ``sys.argv[1:]`` (tests call ``main(["fit", "--config", ...])``).

    Raises:
        SystemExit: With code 2 and one line on standard error when the input is bad.
    """
    # The packed sequences are already in memory, so Lightning's advice to add data-loader workers does not apply.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    show_recipe_messages()
    # What the resume command repeats; LightningCLI itself reads ``sys.argv`` when no ``args`` are given.
    arguments = list(args) if args is not None else sys.argv[1:]
    try:
        if arguments[:1] == ["export"]:  # no trainer and no data: not one of LightningCLI's subcommands
            export_command(arguments[1:])
            return
        SuperpipeCLI(
            CausalLMModule,
            TextDataModule,
            args=list(args) if args is not None else None,
            # Raise instead of printing usage and exiting, so that ``main`` can report the error on one line.
            parser_kwargs={"exit_on_error": False, "epilog": EXPORT_HELP,
                           **{name: {"exit_on_error": False} for name in SUBCOMMANDS}},
            save_config_kwargs={"overwrite": True},
            # Optimizer and schedule are set under ``model.optimizer``, where the CPU-fast AdamW is chosen.
            auto_configure_optimizers=False,
        )
    except user_errors() as error:  # evaluated as an error goes by, when MoE paging may have been loaded
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        print(f"superpipe: error: {one_line(error)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except TrainingInterrupted as stop:
        print(f"superpipe: {describe_interruption(stop, arguments)}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
    except KeyboardInterrupt:
        # Ctrl-C before training started (while the model or the data is loaded): nothing to save.
        print("superpipe: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
