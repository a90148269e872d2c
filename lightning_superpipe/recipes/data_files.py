"""Reading the recipes' data files: UTF-8 text, JSON Lines with line numbers, and Parquet or JSON tables through
``datasets``.

Every record comes with where it was read (``line 3 of 'chats.jsonl'``), so that a bad one can be named.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_superpipe.recipes.errors import RecipeError

#: Suffix of the files read as one JSON object a line.
JSONL_SUFFIX = ".jsonl"
#: Suffixes of the files read as tables of records with ``datasets``, and the ``datasets`` builder of each.
TABLE_BUILDERS = {".parquet": "parquet", ".json": "json"}


@dataclass(frozen=True)
class SourcedRecord:
    """One record of a data file and where it was read.

    Attributes:
        where: ``line N of 'FILE'`` (JSON Lines) or ``record N of 'FILE'`` (tables), for messages.
        fields: The record's fields.
    """

    where: str
    fields: dict[str, Any]


def find_files(folder: Path, suffixes: Collection[str]) -> list[Path]:
    """Files under ``folder`` with one of ``suffixes`` (any case), recursively, hidden ones left out, in order."""
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and path.suffix.lower() in suffixes
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )


def read_text_file(path: Path) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        RecipeError: If the file is not UTF-8 text.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RecipeError(f"'{path}' is not UTF-8 text (undecodable byte at offset {error.start})") from error


def jsonl_records(path: Path, text: str | None = None) -> Iterator[SourcedRecord]:
    """The JSON objects of the JSON Lines file ``path`` (or of its ``text``), blank lines skipped.

    Raises:
        RecipeError: If a line is not a JSON object.
    """
    for line_number, line in enumerate((read_text_file(path) if text is None else text).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RecipeError(f"line {line_number} of '{path}' is not JSON: {error.msg}") from error
        if not isinstance(record, dict):
            raise RecipeError(f"line {line_number} of '{path}' is a JSON {type(record).__name__}, expected an object")
        yield SourcedRecord(f"line {line_number} of '{path}'", record)


def table_records(path: Path) -> list[SourcedRecord]:
    """The rows of a Parquet or JSON file (a JSON array of objects, or one object a line), read with ``datasets``.

    ``datasets`` gives every row the columns of the whole file: a field that a row lacks reads as ``None`` there, and
    is left out here, so that a missing field is reported as missing.

    Raises:
        RecipeError: If ``datasets`` is not installed or cannot read the file.
    """
    builder = TABLE_BUILDERS[path.suffix.lower()]
    try:
        import datasets
    except ImportError as error:
        raise RecipeError(
            f"reading '{path}' needs the datasets package (pip install datasets), which is not installed; or convert "
            "it to JSON Lines (.jsonl), which the recipes read without it"
        ) from error
    # A cache of its own, dropped afterwards: the rows are read into memory, and nothing is left in the user's
    # ``datasets`` cache for a local file.
    with tempfile.TemporaryDirectory(prefix="superpipe-datasets-") as cache_dir:
        was_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            table = datasets.load_dataset(
                builder, data_files=[str(path)], split="train", cache_dir=cache_dir, keep_in_memory=True
            )
        except Exception as error:  # noqa: BLE001 - pyarrow and datasets raise many types for a malformed file
            message = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise RecipeError(f"cannot read '{path}' as {builder}: {message}") from error
        finally:
            if was_enabled:
                datasets.enable_progress_bars()
        rows = table.to_list()
    return [
        SourcedRecord(f"record {number} of '{path}'", {key: value for key, value in row.items() if value is not None})
        for number, row in enumerate(rows, start=1)
    ]
