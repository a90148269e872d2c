"""Tokenizers for the recipes: the model's own (from a local folder) or a byte-level fallback.

Both kinds are wrapped behind the small :class:`TextTokenizer` protocol, which is all the data module and the
generation step need: encode a document, decode generated ids, and know the special ids used for packing,
padding and stopping.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning_superpipe.recipes.errors import RecipeError, first_line

log = logging.getLogger(__name__)

#: Files whose presence marks a folder as holding a ``transformers`` tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


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


class ByteTokenizer:
    """UTF-8 bytes as tokens, for models trained from scratch and folders that ship no tokenizer.

    Ids 0-255 are the bytes; 256, 257 and 258 are padding, begin-of-sequence and end-of-sequence. It needs no files,
    never meets an unknown word, and makes the embedding tiny, which is what a model trained from random weights on a
    laptop wants.
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.tokenizer).__name__}, vocab_size={self.vocab_size})"


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds the files of a ``transformers`` tokenizer."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_path: str | Path | None) -> TextTokenizer:
    """The tokenizer to use with the model in ``model_path``.

    Args:
        model_path: A local folder saved with ``save_pretrained``, or ``None`` for a model built from a config.

    Returns:
        The folder's own tokenizer when it has one, else a :class:`ByteTokenizer`.

    Raises:
        RecipeError: If the folder has tokenizer files that ``transformers`` cannot load.
    """
    if model_path is None:
        return ByteTokenizer()
    folder = Path(model_path).expanduser()
    if not folder.is_dir() or not has_tokenizer_files(folder):
        # A missing model folder is reported by the model, which is built from the same path; here we only decide
        # which tokenizer to use.
        if folder.is_dir():
            log.warning(
                "No tokenizer files in '%s' (looked for %s); using a byte-level tokenizer.",
                model_path,
                ", ".join(TOKENIZER_FILES),
            )
        return ByteTokenizer()

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"cannot load the tokenizer in '{model_path}': {first_line(error)}") from error
    return PretrainedTokenizer(tokenizer)
