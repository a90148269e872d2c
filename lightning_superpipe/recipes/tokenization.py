"""Tokenizers for the recipes: the model's own (from a local folder, checked to encode text) or UTF-8 bytes.

Bytes are for a model built from a config, or when asked for (``data.byte_tokenizer``): a pretrained model's folder
without a usable tokenizer is an error, not a silent switch to bytes.

Both kinds are wrapped behind the small :class:`TextTokenizer` protocol, which is all the data module and the
generation step need: encode a document, decode generated ids, and know the special ids used for packing,
padding and stopping. Instruction data needs :class:`ChatTokenizer` too: render a conversation with a Jinja chat
template and encode the rendered text with the character span of each token, so that the loss can be kept to the
assistant's tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_superpipe.recipes.errors import TokenizerError, first_line

#: Files whose presence marks a folder as holding a ``transformers`` tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
#: Ordinary text that every language model's tokenizer encodes and decodes back (whitespace and case aside).
PROBE_TEXT = "The quick brown fox jumps over the lazy dog: 0123456789 times, (twice) as fast!"


@runtime_checkable
class TextTokenizer(Protocol):
    """What the recipes need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included; the model's embedding must have at least this many rows."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """Id that starts a sequence, if the tokenizer uses one."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """Id that ends a document; it separates documents in packed sequences and stops generation."""
        ...

    @property
    def pad_token_id(self) -> int:
        """Id used to left-pad prompts to a common length."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the special tokens the model expects at the start of a sequence."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens left out."""
        ...


#: One message of a conversation: ``{"role": ..., "content": ...}`` (templates may read more keys).
Message = Mapping[str, Any]
#: Character span ``(start, end)`` of a token in the text it was encoded from.
Span = tuple[int, int]


@runtime_checkable
class ChatTokenizer(TextTokenizer, Protocol):
    """What instruction data needs besides :class:`TextTokenizer`: a chat template and the spans of tokens."""

    chat_template: str | None
    """The Jinja template that renders a conversation as text, ``None`` where the tokenizer has none."""

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """``messages`` rendered with :attr:`chat_template`, with the opening of an assistant turn when asked."""
        ...

    def encode_rendered(self, text: str) -> tuple[list[int], list[Span]]:
        """Token ids of template-rendered ``text`` and each one's character span; special tokens written in the
        text are encoded as such, and none is added (the template writes the ones it wants)."""
        ...


def render_with_template(
    template: str, messages: Sequence[Message], add_generation_prompt: bool, special_tokens: Mapping[str, str]
) -> str:
    """``messages`` rendered by the Jinja chat ``template`` as ``transformers``' ``apply_chat_template`` renders them,
    with the tokenizer's ``special_tokens`` (``bos_token``, ``eos_token`` ...) as template variables."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[list(messages)], chat_template=template, add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )
    return str(rendered[0])


class ByteTokenizer:
    """UTF-8 bytes as tokens, for models trained from scratch and folders that ship no tokenizer.

    Ids 0-255 are the bytes; 256, 257 and 258 are padding, begin-of-sequence and end-of-sequence. It needs no files,
    never meets an unknown word, and makes the embedding tiny, which is what a model trained from random weights on a
    laptop wants.

    It has no chat template of its own; give it one for instruction data. Rendered text spells its special tokens
    as ``<pad>``, ``<s>`` and ``</s>`` (the template variables ``pad_token``, ``bos_token`` and ``eos_token``).

    Args:
        chat_template: A Jinja chat template, for conversations.
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259
    pad_token = "<pad>"
    bos_token = "<s>"
    eos_token = "</s>"

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        """Bytes of ``text`` after a begin-of-sequence id.

        Args:
            text: Any string.

        Returns:
            ``[bos] + list(text.encode("utf-8"))``.
        """
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the byte ids in ``token_ids``; special ids are dropped and broken UTF-8 is replaced.

        Args:
            token_ids: Ids produced by this tokenizer or by a model trained with it.

        Returns:
            The decoded string.
        """
        return bytes(int(i) for i in token_ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """``messages`` rendered with :attr:`chat_template`.

        Raises:
            TokenizerError: If there is no chat template.
        """
        if self.chat_template is None:
            raise TokenizerError("the byte-level tokenizer has no chat template; set data.chat_template")
        special_tokens = {"pad_token": self.pad_token, "bos_token": self.bos_token, "eos_token": self.eos_token}
        return render_with_template(self.chat_template, messages, add_generation_prompt, special_tokens)

    def encode_rendered(self, text: str) -> tuple[list[int], list[Span]]:
        """The bytes of ``text``, with ``<pad>``, ``<s>`` and ``</s>`` as their ids; each byte's span is its
        character's."""
        specials = {
            self.pad_token: self.pad_token_id, self.bos_token: self.bos_token_id, self.eos_token: self.eos_token_id
        }
        ids: list[int] = []
        spans: list[Span] = []
        position = 0
        while position < len(text):
            special = next((token for token in specials if text.startswith(token, position)), None)
            if special is not None:
                ids.append(specials[special])
                spans.append((position, position + len(special)))
                position += len(special)
                continue
            for byte in text[position].encode("utf-8"):
                ids.append(byte)
                spans.append((position, position + 1))
            position += 1
        return ids, spans

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class PretrainedTokenizer:
    """Adapter from a ``transformers`` tokenizer to :class:`TextTokenizer`.

    Args:
        tokenizer: A ``PreTrainedTokenizerBase`` loaded from the model's folder.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        # We pack documents into fixed-length sequences ourselves, so the tokenizer's maximum length only produces
        # a misleading "sequence longer than the model accepts" warning for each long document.
        tokenizer.model_max_length = sys.maxsize  # type: ignore[attr-defined]

    @property
    def vocab_size(self) -> int:
        # ``len`` counts added tokens, which ``tokenizer.vocab_size`` leaves out.
        return len(self.tokenizer)  # type: ignore[arg-type]

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id  # type: ignore[attr-defined,no-any-return]

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id  # type: ignore[attr-defined,no-any-return]

    @property
    def pad_token_id(self) -> int:
        # Many causal-LM tokenizers define no padding token; the padded positions are masked out, so any id will do
        # and the end-of-sequence id is the usual choice.
        for token_id in (self.tokenizer.pad_token_id, self.eos_token_id):  # type: ignore[attr-defined]
            if token_id is not None:
                return int(token_id)
        return 0

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])  # type: ignore[operator]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        # A tokenizer may keep several named templates; the default one renders conversations.
        if isinstance(template, dict):
            template = template.get("default")
        return template if isinstance(template, str) and template.strip() else None

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.tokenizer.chat_template = template  # type: ignore[attr-defined]

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return str(
            self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [dict(message) for message in messages], tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode_rendered(self, text: str) -> tuple[list[int], list[Span]]:
        # As ``apply_chat_template(tokenize=True)`` encodes: the template wrote the special tokens it wants.
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # type: ignore[operator]
        return list(encoding["input_ids"]), [(int(start), int(end)) for start, end in encoding["offset_mapping"]]

    @property
    def has_offsets(self) -> bool:
        """Whether the tokenizer gives each token's character span (a "fast" one, from ``tokenizer.json``)."""
        return bool(getattr(self.tokenizer, "is_fast", False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.tokenizer).__name__}, vocab_size={self.vocab_size})"


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds the files of a ``transformers`` tokenizer."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def same_text(decoded: str, text: str) -> bool:
    """Whether ``decoded`` is ``text`` up to whitespace and case, which some tokenizers normalize."""
    return " ".join(decoded.split()).casefold() == " ".join(text.split()).casefold()


def check_tokenizer(tokenizer: TextTokenizer, where: str) -> None:
    """Refuse a tokenizer that cannot encode ordinary text and decode it back.

    A folder whose only tokenizer file is ``tokenizer_config.json`` loads, for some tokenizer classes, as a tokenizer
    of one token that encodes any text as nothing: the run would then pack its data into a handful of end-of-text
    tokens and train on those.

    Args:
        tokenizer: The tokenizer to check.
        where: The folder it came from, for the message.

    Raises:
        TokenizerError: If :data:`PROBE_TEXT` does not survive encoding and decoding.
    """
    ids = tokenizer.encode(PROBE_TEXT)
    decoded = tokenizer.decode(ids)
    if not same_text(decoded, PROBE_TEXT):
        shown = ids if len(ids) <= 8 else [*ids[:8], "..."]
        raise TokenizerError(
            f"the tokenizer in '{where}' cannot encode text: it has {tokenizer.vocab_size} token ids and turns "
            f"{PROBE_TEXT!r} into {shown}, which decodes to {decoded!r}; copy the model's tokenizer files "
            "(tokenizer.json, or the vocabulary files its tokenizer_config.json names) into the folder, or set "
            "data.byte_tokenizer: true to train on UTF-8 bytes"
        )


def load_tokenizer(tokenizer_path: str | Path | None, byte_level: bool = False) -> TextTokenizer:
    """The tokenizer in ``tokenizer_path``, checked to encode text, or a :class:`ByteTokenizer`.

    Args:
        tokenizer_path: A local folder with the files of a ``transformers`` tokenizer (usually the model's own
            folder, saved with ``save_pretrained``), or ``None`` for a model built from a config.
        byte_level: Use a :class:`ByteTokenizer` whatever ``tokenizer_path`` holds.

    Returns:
        A :class:`ByteTokenizer` for ``None`` or ``byte_level``; else the folder's tokenizer.

    Raises:
        TokenizerError: If the folder does not exist or has no tokenizer files, if ``transformers`` cannot load them,
            or if the tokenizer cannot encode ordinary text (:func:`check_tokenizer`).
    """
    if tokenizer_path is None or byte_level:
        return ByteTokenizer()
    folder = Path(tokenizer_path).expanduser()
    if not folder.exists():
        raise TokenizerError(f"tokenizer path '{tokenizer_path}' does not exist")
    if not folder.is_dir() or not has_tokenizer_files(folder):
        what = "is a file" if not folder.is_dir() else f"has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        raise TokenizerError(
            f"'{tokenizer_path}' {what}: a pretrained model needs its own tokenizer; point data.tokenizer_path at "
            "the folder holding it, or set data.byte_tokenizer: true to train on UTF-8 bytes (the model then learns "
            "a new vocabulary from scratch)"
        )

    from transformers import AutoTokenizer

    try:
        tokenizer = PretrainedTokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as error:
        # transformers raises any of these for missing vocabulary files, unknown classes, malformed JSON or a
        # library the tokenizer's class needs (sentencepiece).
        raise TokenizerError(f"cannot load the tokenizer in '{tokenizer_path}': {first_line(error)}") from error
    check_tokenizer(tokenizer, str(tokenizer_path))
    return tokenizer
