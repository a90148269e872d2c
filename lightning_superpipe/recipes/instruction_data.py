"""Instruction data: conversations and prompt/response pairs, tokenized with the loss on the answers only, then packed
without attention across examples, or padded.

A conversation (``{"messages": [{"role": ..., "content": ...}, ...]}``) is rendered with the tokenizer's chat template.
The assistant's tokens are found by rendering the conversation prefix by prefix: the text an assistant message adds
after the prompt that opens its turn (``add_generation_prompt=True``) is its span, end-of-turn tokens included. Each
token overlapping such a span is trained on; every other label is ``-100``. This works with any template, where
``apply_chat_template(return_assistant_tokens_mask=True)`` needs one written with ``{% generation %}`` blocks, which
few models ship. A prompt/response pair is the prompt's tokens (encoded as ``predict`` encodes a prompt), then the
response's and an end-of-sequence token, which are trained on.

Packed rows follow the ``transformers`` convention for packed sequences: ``position_ids`` restart at 0 for each
example and there is no ``attention_mask``, from which ``transformers.masking_utils`` (``find_packed_sequence_indices``)
builds a mask that keeps attention within each example, for the eager, SDPA and flex implementations; flash
attention reads the same positions. Where packing is off, each example is a row of its own, padded to the longest
of its batch, and the training batches are drawn by similar length.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch.utils.data import Dataset

from lightning_superpipe.recipes.data_files import (
    JSONL_SUFFIX,
    TABLE_BUILDERS,
    SourcedRecord,
    find_files,
    jsonl_records,
    table_records,
)
from lightning_superpipe.recipes.errors import RecipeError, first_line
from lightning_superpipe.recipes.tokenization import ChatTokenizer, Message, TextTokenizer

log = logging.getLogger(__name__)

#: Label of the tokens that are not trained on (``torch.nn.CrossEntropyLoss``'s and ``transformers``' default).
IGNORE_INDEX = -100
#: What a data file holds: plain text, conversations, or prompt/response pairs.
DataFormat = Literal["text", "chat", "prompt_response"]
#: The values of ``data.format``.
FORMATS: tuple[str, ...] = get_args(DataFormat)
#: Suffixes of the files read as records of instruction data when the data path is a folder.
RECORD_SUFFIXES = (JSONL_SUFFIX, *TABLE_BUILDERS)
#: The conversations that ship with the package (questions and answers about Python, from its documentation).
EMBEDDED_CONVERSATIONS = "python_chats.jsonl"
#: The role whose messages are trained on.
TRAINED_ROLE = "assistant"


@dataclass(frozen=True)
class InstructionFields:
    """Field names of instruction records.

    Attributes:
        messages: The list of messages of a conversation.
        prompt: The prompt of a prompt/response pair.
        response: The response of a prompt/response pair.
    """

    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"


@dataclass(frozen=True)
class Example:
    """One tokenized example.

    Attributes:
        input_ids: Its token ids.
        labels: ``input_ids`` where the loss is taken, :data:`IGNORE_INDEX` elsewhere (always at the first token,
            which no token of the example predicts).
        where: The record it came from, for messages.
    """

    input_ids: list[int]
    labels: list[int]
    where: str

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss is taken on."""
        return sum(label != IGNORE_INDEX for label in self.labels)


def instruction_format_hint(fields: Sequence[str]) -> str:
    """``", or data.format: ..."`` for records whose ``fields`` look like instruction data, else ``""``."""
    if "messages" in fields:
        return ", or data.format: chat"
    if "prompt" in fields and "response" in fields:
        return ", or data.format: prompt_response"
    return ""


def embedded_conversations() -> list[SourcedRecord]:
    """The conversations that ship with the package: a few dozen questions about Python, answered from its
    documentation."""
    text = resources.files("lightning_superpipe.recipes").joinpath("data", EMBEDDED_CONVERSATIONS).read_text("utf-8")
    return list(jsonl_records(Path(EMBEDDED_CONVERSATIONS), text))


def find_record_files(folder: Path) -> list[Path]:
    """``.jsonl``, ``.json`` and ``.parquet`` files under ``folder``, recursively, hidden ones left out, in order."""
    return find_files(folder, RECORD_SUFFIXES)


def read_records(data_path: str | None) -> list[SourcedRecord]:
    """The records at ``data_path``: a ``.jsonl``, ``.json`` or ``.parquet`` file, a folder of them, or ``None`` for
    the embedded conversations. ``.json`` and ``.parquet`` files need ``datasets``.

    Raises:
        RecipeError: If the path holds no records, or a file cannot be read.
    """
    if data_path is None:
        return embedded_conversations()
    path = Path(data_path).expanduser()
    if not path.exists():
        raise RecipeError(f"data path '{data_path}' does not exist")
    files = find_record_files(path) if path.is_dir() else [path]
    if not files:
        raise RecipeError(
            f"data path '{data_path}' holds no instruction data: the folder has no {', '.join(RECORD_SUFFIXES)} files"
        )
    records: list[SourcedRecord] = []
    for file in files:
        suffix = file.suffix.lower()
        records.extend(table_records(file) if suffix in TABLE_BUILDERS else jsonl_records(file))
    if not records:
        raise RecipeError(f"data path '{data_path}' holds no instruction data: no records")
    return records


def record_field(record: SourcedRecord, field: str, setting: str) -> Any:
    """The value of ``field`` in ``record``.

    Raises:
        RecipeError: If the record has no such field.
    """
    if field not in record.fields:
        has = ", ".join(repr(name) for name in record.fields) or "no fields"
        raise RecipeError(f"{record.where} has no '{field}' field (it has {has}); set {setting} to the record's field")
    return record.fields[field]


def conversation(record: SourcedRecord, field: str) -> list[dict[str, Any]]:
    """The messages of ``record``: each a dict with a string ``role`` and ``content``; keys holding ``None`` (a
    table's columns that a message lacks) left out.

    Raises:
        RecipeError: If the field is missing, is not a non-empty list of such messages, has no assistant message,
            or opens with one.
    """
    value = record_field(record, field, "data.messages_field")
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else f"a {type(value).__name__}"
        raise RecipeError(f"{record.where}: '{field}' is {what}, expected a list of messages with 'role' and 'content'")
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise RecipeError(f"{record.where}: message {number} is a {type(message).__name__}, expected an object "
                              "with 'role' and 'content'")
        message = {key: item for key, item in message.items() if item is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = type(message[key]).__name__ if key in message else "missing"
                raise RecipeError(f"{record.where}: message {number} has no string '{key}' ({got})")
        messages.append(message)
    roles = [message["role"] for message in messages]
    if TRAINED_ROLE not in roles:
        raise RecipeError(f"{record.where} has no '{TRAINED_ROLE}' message: nothing to train on (roles: "
                          f"{', '.join(roles)})")
    if roles[0] == TRAINED_ROLE:
        raise RecipeError(f"{record.where}: message 1 is the assistant's; a conversation opens with a prompt (a user "
                          "or system message)")
    return messages


class _Renderer:
    """Renders prefixes of one conversation, turning the template's refusals into errors that name the record."""

    def __init__(self, tokenizer: ChatTokenizer, where: str) -> None:
        self.tokenizer = tokenizer
        self.where = where

    def __call__(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError, TypeError) as error:
            # Templates refuse what they do not know with ``raise_exception(...)``: an unknown role, roles that do
            # not alternate, a system message where none is allowed.
            refusal = first_line(error)
            raise RecipeError(f"{self.where}: the chat template refused the conversation: {refusal}") from error


def assistant_spans(
    messages: Sequence[Message], tokenizer: ChatTokenizer, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant message in it.

    Raises:
        RecipeError: If the template refuses the conversation, leaves a message out, or renders an earlier part of
            the conversation differently once later messages follow (then no span can be told).
    """
    render = _Renderer(tokenizer, where)
    full = render(messages)
    spans = []
    for index, message in enumerate(messages):
        content = message["content"].strip()
        if content and content not in full:
            raise RecipeError(
                f"{where}: the chat template leaves message {index + 1} (role '{message['role']}') out of the text: "
                "a role it does not know?"
            )
        if message["role"] != TRAINED_ROLE:
            continue
        prompt = render(messages[:index], add_generation_prompt=True)
        turn = render(messages[: index + 1])
        if not (turn.startswith(prompt) and full.startswith(turn)):
            raise RecipeError(
                f"{where}: the chat template renders the conversation up to message {index + 1} differently once "
                "more follows, so the assistant's tokens cannot be told apart; set data.chat_template to a template "
                "that renders each turn the same whatever follows"
            )
        spans.append((len(prompt), len(turn)))
    return full, spans


def encode_conversation(messages: Sequence[Message], tokenizer: ChatTokenizer, where: str) -> Example:
    """A conversation as tokens, labelled on the tokens that overlap an assistant message's span.

    Raises:
        RecipeError: As :func:`assistant_spans`, or if no token falls in the assistant's spans.
    """
    text, spans = assistant_spans(messages, tokenizer, where)
    input_ids, offsets = tokenizer.encode_rendered(text)
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for position, (start, end) in enumerate(offsets):
        # Spans and tokens both run left to right; a token is trained on when it overlaps a span.
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if end > spans[span_index][0] and end > start:
            labels[position] = input_ids[position]
    labels[0] = IGNORE_INDEX
    if all(label == IGNORE_INDEX for label in labels):
        raise RecipeError(f"{where}: the assistant's messages render to no tokens: nothing to train on")
    return Example(input_ids, labels, where)


def encode_prompt_response(prompt: str, response: str, tokenizer: ChatTokenizer, where: str) -> Example:
    """The prompt's tokens as ``predict`` encodes a prompt, then the response's and the end-of-sequence token, on
    which the loss is taken."""
    prompt_ids = tokenizer.encode(prompt)
    response_ids, _ = tokenizer.encode_rendered(response)
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    if not response_ids:
        raise RecipeError(f"{where}: the response is empty and the tokenizer has no end-of-sequence token: nothing "
                          "to train on")
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
    labels[0] = IGNORE_INDEX
    return Example(prompt_ids + response_ids, labels, where)


def encode_record(record: SourcedRecord, data_format: DataFormat, fields: InstructionFields,
                  tokenizer: ChatTokenizer) -> Example:
    """One record as an :class:`Example`.

    Raises:
        RecipeError: If the record lacks its fields or holds values of the wrong type, or as
            :func:`encode_conversation`.
    """
    if data_format == "chat":
        return encode_conversation(conversation(record, fields.messages), tokenizer, record.where)
    texts = []
    for field, setting in ((fields.prompt, "data.prompt_field"), (fields.response, "data.response_field")):
        value = record_field(record, field, setting)
        if not isinstance(value, str):
            raise RecipeError(f"{record.where}: '{field}' is a {type(value).__name__}, expected a string")
        texts.append(value)
    return encode_prompt_response(texts[0], texts[1], tokenizer, record.where)


def fit_to_length(example: Example, seq_len: int, truncate: bool) -> Example | None:
    """``example`` if it fits in ``seq_len`` tokens; else cut to them when ``truncate`` (``None`` if nothing trained
    on is left).

    Raises:
        RecipeError: If it is longer and ``truncate`` is off.
    """
    if len(example.input_ids) <= seq_len:
        return example
    if not truncate:
        raise RecipeError(
            f"{example.where} is {len(example.input_ids)} tokens, longer than data.seq_len={seq_len}; raise "
            "data.seq_len, shorten the example, or set data.truncate: true to cut examples to data.seq_len"
        )
    cut = Example(example.input_ids[:seq_len], example.labels[:seq_len], example.where)
    return cut if cut.trained_tokens else None


def load_examples(
    data_path: str | None,
    data_format: DataFormat,
    fields: InstructionFields,
    tokenizer: ChatTokenizer,
    seq_len: int,
    truncate: bool = False,
) -> list[Example]:
    """Read, check and tokenize every record at ``data_path`` (see :func:`read_records`).

    Raises:
        RecipeError: At the first bad record, naming its file and line (or record number).
    """
    examples = []
    dropped = 0
    for record in read_records(data_path):
        example = fit_to_length(encode_record(record, data_format, fields, tokenizer), seq_len, truncate)
        if example is None:
            dropped += 1
        else:
            examples.append(example)
    if dropped:
        log.warning("%d examples have nothing to train on within data.seq_len=%d tokens once cut; dropped.",
                    dropped, seq_len)
    return examples


def pack_examples(examples: Sequence[Example], seq_len: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pack examples into rows of ``seq_len`` tokens, each example whole in one row.

    Each example goes to the fullest row it fits in (best fit, in the given order). Within a row each example's
    ``position_ids`` start at 0; the padding that ends a row gets positions of its own and labels of
    :data:`IGNORE_INDEX`.

    Args:
        examples: Examples of at most ``seq_len`` tokens each.
        seq_len: Tokens per row.
        pad_token_id: Id of the padding that fills a row.

    Returns:
        ``input_ids``, ``labels`` and ``position_ids``, ``int32`` tensors of shape ``(rows, seq_len)``.
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row), ascending
    for index, example in enumerate(examples):
        length = len(example.input_ids)
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            left, row = free.pop(slot)
        else:
            left, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if left - length > 0:
            bisect.insort(free, (left - length, row))
    input_ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.int32)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int32)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int32)
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            example = examples[index]
            end = start + len(example.input_ids)
            input_ids[row, start:end] = torch.tensor(example.input_ids, dtype=torch.int32)
            labels[row, start:end] = torch.tensor(example.labels, dtype=torch.int32)
            position_ids[row, start:end] = torch.arange(end - start, dtype=torch.int32)
            start = end
        position_ids[row, start:] = torch.arange(seq_len - start, dtype=torch.int32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class PackedExamples(Dataset[dict[str, torch.Tensor]]):
    """Rows of packed examples (:func:`pack_examples`), served as ``input_ids``, ``labels`` and ``position_ids``.

    Args:
        examples: Examples of at most ``seq_len`` tokens each.
        seq_len: Tokens per row.
        pad_token_id: Id of the padding that fills a row.
    """

    def __init__(self, examples: Sequence[Example], seq_len: int, pad_token_id: int) -> None:
        self.tensors = pack_examples(examples, seq_len, pad_token_id)
        self.num_examples = len(examples)

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index].long() for name, tensor in self.tensors.items()}


class PaddedExamples(Dataset[dict[str, torch.Tensor]]):
    """One example a row, padded per batch by :meth:`collate` (use it as the loader's ``collate_fn``).

    Args:
        examples: The examples.
        pad_token_id: Id of the padding.
    """

    def __init__(self, examples: Sequence[Example], pad_token_id: int) -> None:
        self.examples = list(examples)
        self.pad_token_id = pad_token_id
        self.num_examples = len(self.examples)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each example."""
        return [len(example.input_ids) for example in self.examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.examples[index]
        return {"input_ids": torch.tensor(example.input_ids), "labels": torch.tensor(example.labels)}

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad ``items`` to the longest: padding ids, :data:`IGNORE_INDEX` labels and an ``attention_mask``."""
        width = max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            length = len(item["input_ids"])
            input_ids[row, :length] = item["input_ids"]
            labels[row, :length] = item["labels"]
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def check_chat_tokenizer(tokenizer: TextTokenizer, needs_template: bool, source: str) -> ChatTokenizer:
    """``tokenizer``, checked to render and encode instruction data.

    Args:
        tokenizer: The data module's tokenizer.
        needs_template: Whether conversations are rendered (``data.format: chat``, chat prompts).
        source: The tokenizer in words (``the tokenizer in 'FOLDER'``), for the message.

    Raises:
        RecipeError: If it cannot give the character spans of its tokens, has no chat template where one is needed,
            or its template is not valid Jinja.
    """
    if not isinstance(tokenizer, ChatTokenizer) or not getattr(tokenizer, "has_offsets", True):
        raise RecipeError(
            f"{source} cannot tell where each token comes from in the text, which instruction "
            "data needs to find the assistant's tokens; use a fast tokenizer (its folder's tokenizer.json)"
        )
    if not needs_template:
        return tokenizer
    if tokenizer.chat_template is None:
        raise RecipeError(
            f"conversations are rendered with the tokenizer's chat template, but {source} has none; set "
            "data.chat_template to a Jinja chat template, or to a file holding one"
        )
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.render_chat([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    except TemplateSyntaxError as error:
        raise RecipeError(f"the chat template is not valid Jinja: line {error.lineno}: {error.message}") from error
    except Exception:  # noqa: BLE001, S110 - a template may refuse this probe conversation; records show what it refuses
        pass
    return tokenizer


def read_chat_template(template: str) -> str:
    """``template`` itself when it is Jinja (holds ``{{`` or ``{%``), else the text of the file it names.

    Raises:
        RecipeError: If it is neither a template nor a file.
    """
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise RecipeError(
            f"data.chat_template '{template}' is neither a Jinja template (no '{{{{' or '{{%') nor a file"
        )
    return path.read_text(encoding="utf-8")
