"""Bad user input: the error type recipes raise, and one-line descriptions of configuration errors."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import traceback
from collections.abc import Iterable
from pathlib import Path


class RecipeError(ValueError):
    """A problem with what the user asked for: a path, a name or a value in the recipe.

    The ``superpipe`` command prints such errors as one line, without a traceback, because the fix is in the
    user's YAML or command line, not in the code. The message must therefore quote the offending input and, where
    possible, say what would have been accepted.
    """


class TokenizerError(RecipeError):
    """A tokenizer the recipe cannot train with: missing, unloadable, unable to encode ordinary text, or with more
    token ids than the model embeds.

    Raised before any text is tokenized and before the model's weights are loaded, so that a run never packs its
    data with a tokenizer that turns it into nothing, or feeds the model ids past its embeddings.
    """


# Lines of jsonargparse's nested messages that explain its search rather than the user's mistake.
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes"
    r"|Subtypes: .*|Errors:|Given value type: .*|Given value: .*"
    r"|Not a valid subclass of .*|Subclass types expect one of:|a class path \(str\)|a dict with.*|a dict without.*"
    r"|Expected a path but .* either not accessible or invalid)$"
)
_EXPECTED = re.compile(r"^Expected a <class '([\w.]+)'>(?:\. Got value: (.*))?$")


def first_line(error: BaseException) -> str:
    """The first non-blank line of ``error``'s message, or its type name when the message is empty."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest candidate, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def class_parameters(class_path: str) -> list[str]:
    """Names of the parameters of ``class_path``'s constructor; empty if it cannot be imported."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        return [name for name in inspect.signature(cls).parameters if name not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def describe_parse_error(message: str, known_keys: Iterable[str] = ()) -> str:
    """One line saying what is wrong in a recipe, from a (multi-line) jsonargparse error message.

    jsonargparse explains a rejected value by listing every type it tried; the user needs only the key, the
    offending name or value, and what would have been accepted.

    Args:
        message: The text of a ``jsonargparse`` ``ArgumentError``.
        known_keys: Every dotted key the parser accepts, for "did you mean" suggestions.

    Returns:
        For example ``"'trainer.max_stepz' is not a recipe key (did you mean 'trainer.max_steps'?)"`` or
        ``"model.lora: lightning_superpipe.recipes.LoRASettings has no option 'rnak' (did you mean 'rank'?)"``.
    """
    lines = [line.strip() for line in message.strip().splitlines()]
    lines = [line[2:] if line.startswith("- ") else line for line in lines if line.strip("- ")]
    keys: list[str] = []
    class_path: str | None = None
    reasons: list[str] = []
    expected_types: list[str] = []
    got: str | None = None
    for line in lines:
        if match := re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', line):
            keys.append(match.group(1))
            line = match.group(2)
            if not line:
                continue
        if match := re.fullmatch(r"Problem with given class_path '([^']+)':", line):
            class_path = class_path or match.group(1)
            continue
        if got is None and (match := re.fullmatch(r"Given value: (.*)", line)):
            got = match.group(1)
        if _NOISE.match(line):
            continue
        if match := _EXPECTED.match(line):
            expected_types.append(match.group(1))
            got = match.group(2) if match.group(2) is not None else got
            continue
        reasons.append(line)
    key = ".".join(dict.fromkeys(keys))
    prefix = f"{key}: " if key else ""

    if not reasons and expected_types:
        wanted = [name for name in dict.fromkeys(expected_types) if name != "NoneType"] or ["null"]
        return f"{prefix}expected {' or '.join(wanted)}" + (f", got {got}" if got is not None else "")
    reason = reasons[0] if reasons else (lines[0] if lines else "invalid configuration")

    if match := re.fullmatch(r"Option '([^']+)' is not accepted", reason):
        option = match.group(1)
        owner = class_path or "it"
        return f"{prefix}{owner} has no option '{option}'{did_you_mean(option, class_parameters(class_path or ''))}"
    if match := re.fullmatch(r"Subcommand '\w+' does not accept option '([^']+)'", reason):
        return f"'{match.group(1)}' is not a recipe key{did_you_mean(match.group(1), known_keys)}"
    if match := re.fullmatch(r"unrecognized arguments: --([^\s=]+).*", reason):
        return f"'{match.group(1)}' is not a recipe key{did_you_mean(match.group(1), known_keys)}"
    if class_path is not None and not reason.startswith(class_path):
        return f"{prefix}{class_path}: {reason}"
    return prefix + reason


def raised_by_jsonargparse(error: BaseException) -> bool:
    """Whether ``error`` was raised inside jsonargparse, which wraps the errors of the classes it instantiates."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and "jsonargparse" in Path(frames[-1].filename).parts


def describe_construction_error(error: BaseException) -> str:
    """One line for an error raised while jsonargparse built a class of the recipe (a callback, a logger ...).

    The root cause is the class's own complaint; the constructor it came from names the class.

    Returns:
        For example ``"PagedMoECallback: PagedMoECallback(expert_budget=0.5): a bare float is ambiguous ..."``.
    """
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    owner = None
    for frame, _ in traceback.walk_tb(root.__traceback__):
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            owner = type(frame.f_locals["self"]).__name__
    return f"{owner}: {first_line(root)}" if owner else first_line(root)
