"""Text for causal-LM recipes: read documents, tokenize, pack into fixed-length sequences, split, serve batches.

Documents come from a plain-text file, a folder of text files, a JSONL file with a text field, or, by default,
Python's own documentation (``pydoc_data.topics``), which ships with every CPython so a recipe runs with no download.
The data module serves instruction data too (conversations, prompt/response pairs), which
:mod:`lightning_superpipe.recipes.instruction_data` reads and tokenizes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_superpipe.recipes.data_files import JSONL_SUFFIX, find_files, jsonl_records, read_text_file
from lightning_superpipe.recipes.errors import RecipeError
from lightning_superpipe.recipes.instruction_data import (
    FORMATS,
    DataFormat,
    InstructionFields,
    PackedExamples,
    PaddedExamples,
    check_chat_tokenizer,
    instruction_format_hint,
    load_examples,
    read_chat_template,
)
from lightning_superpipe.recipes.resumable_loading import LengthGroupedSampler, ResumableDataLoader, ResumableSampler
from lightning_superpipe.recipes.tokenization import ByteTokenizer, ChatTokenizer, TextTokenizer, load_tokenizer

log = logging.getLogger(__name__)

#: Suffixes of the files read as plain text when the data path is a folder.
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")
#: Prompts for ``superpipe predict`` when the recipe gives none; they open topics of the embedded corpus.
DEFAULT_PROMPTS = (
    "The for statement is used to",
    "A class definition defines a class object",
    "Exceptions are raised",
)
#: What ``superpipe predict`` asks a model tuned on instruction data, when the recipe gives no prompts.
DEFAULT_CHAT_PROMPTS = (
    "What is the for statement used for?",
    "What does a class definition do?",
    "How are exceptions raised?",
)


def embedded_documents() -> list[str]:
    """Python's documentation topics, one document each, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def read_jsonl(path: Path, text_field: str) -> list[str]:
    """The ``text_field`` of each JSON object in the JSONL file ``path``.

    Records without the field are skipped with a warning; a file where no record has it is an error, because the
    field name is then almost certainly wrong.

    Raises:
        RecipeError: If a line is not a JSON object, the field is not a string, or no record has the field.
    """
    texts: list[str] = []
    first_record_fields: list[str] | None = None
    records = 0
    for record in jsonl_records(path):
        records += 1
        if first_record_fields is None:
            first_record_fields = list(record.fields)
        if text_field not in record.fields:
            continue
        value = record.fields[text_field]
        if not isinstance(value, str):
            raise RecipeError(
                f"field '{text_field}' on {record.where} is a {type(value).__name__}, expected a string"
            )
        texts.append(value)
    if records and not texts:
        hint = instruction_format_hint(first_record_fields or [])
        raise RecipeError(
            f"no record in '{path}' has the text field '{text_field}'; the first record has "
            f"{', '.join(repr(name) for name in first_record_fields or [])} (set data.text_field{hint})"
        )
    if len(texts) < records:
        missing = records - len(texts)
        log.warning("%d of %d records in '%s' have no '%s' field; skipped.", missing, records, path, text_field)
    return texts


def find_text_files(folder: Path) -> list[Path]:
    """Text and JSONL files under ``folder``, recursively, hidden ones left out, in a fixed order."""
    return find_files(folder, {*TEXT_SUFFIXES, JSONL_SUFFIX})


def read_documents(data_path: str | None, text_field: str = "text") -> list[str]:
    """The non-blank documents at ``data_path``.

    Args:
        data_path: A text file (any suffix; ``.jsonl`` is read as JSONL), a folder searched recursively for
            ``.txt``/``.text``/``.md``/``.markdown``/``.rst``/``.jsonl`` files, or ``None`` for the embedded corpus.
        text_field: The field holding the text in JSONL records.

    Returns:
        One string per file or JSONL record.

    Raises:
        RecipeError: If the path does not exist or holds no text.
    """
    if data_path is None:
        return embedded_documents()
    path = Path(data_path).expanduser()
    if not path.exists():
        raise RecipeError(f"data path '{data_path}' does not exist")
    if path.is_dir():
        files = find_text_files(path)
        if not files:
            listed = ", ".join([*TEXT_SUFFIXES, JSONL_SUFFIX])
            raise RecipeError(f"data path '{data_path}' holds no text: the folder has no {listed} files")
    else:
        files = [path]
    documents: list[str] = []
    for file in files:
        if file.suffix.lower() == JSONL_SUFFIX:
            documents.extend(read_jsonl(file, text_field))
        else:
            documents.append(read_text_file(file))
    documents = [document for document in documents if document.strip()]
    if not documents:
        what = "the file is empty" if len(files) == 1 else f"its {len(files)} files are empty"
        raise RecipeError(f"data path '{data_path}' holds no text: {what}")
    return documents


def pack_documents(token_ids: Iterable[Sequence[int]], seq_len: int, eos_token_id: int | None) -> torch.Tensor:
    """Concatenate tokenized documents, each ended by ``eos_token_id``, and cut the stream into rows.

    Packing wastes no compute on padding; the tail shorter than ``seq_len`` is dropped.

    Args:
        token_ids: Token ids of each document.
        seq_len: Tokens per row.
        eos_token_id: Id appended to each document that does not already end with it; ``None`` to append nothing.

    Returns:
        An ``int32`` tensor of shape ``(rows, seq_len)``.
    """
    stream: list[int] = []
    for ids in token_ids:
        stream.extend(ids)
        if eos_token_id is not None and (not ids or ids[-1] != eos_token_id):
            stream.append(eos_token_id)
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.int32).view(rows, seq_len)


def split_rows(rows: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split packed rows into training and held-out rows by a seeded random draw.

    Args:
        rows: Packed sequences, one a row.
        val_fraction: Share of rows held out, at least one row; ``1.0`` holds out every row (evaluation only).
        seed: Seed of the draw, so the split is the same in ``fit`` and in a later ``validate``.

    Returns:
        ``(train_rows, held_out_rows)``, each in the original order.
    """
    train, held_out = split_indices(len(rows), val_fraction, seed)
    return rows[train], rows[held_out]


def split_indices(count: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of :func:`split_rows`' training and held-out rows among ``count``, each ascending."""
    held_out = count if val_fraction >= 1.0 else min(count - 1, max(1, round(count * val_fraction)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[held_out:].sort().values, order[:held_out].sort().values


class PackedSequences(Dataset[dict[str, torch.Tensor]]):
    """Packed token rows served as ``{"input_ids": LongTensor[seq_len]}``.

    Args:
        rows: An integer tensor of shape ``(rows, seq_len)``.
    """

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index].long()}


class PromptCollator:
    """Tokenize prompts and left-pad them, as generation with a decoder-only model needs.

    Args:
        tokenizer: The tokenizer of the model that will continue the prompts.
        chat: Render each prompt as a user message with the tokenizer's chat template, followed by the opening of the
            assistant's turn, as a model tuned on conversations expects.
    """

    def __init__(self, tokenizer: TextTokenizer, chat: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt``, as a chat turn or as it is."""
        if not self.chat:
            return self.tokenizer.encode(prompt)
        tokenizer: ChatTokenizer = self.tokenizer  # type: ignore[assignment]  # checked by the data module
        text = tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer.encode_rendered(text)[0]

    def __call__(self, prompts: list[str]) -> dict[str, Any]:
        encoded = [self.encode(prompt) for prompt in prompts]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            if ids:
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, width - len(ids) :] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": list(prompts)}


class TextDataModule(LightningDataModule):
    """Text for causal-LM fine-tuning and evaluation, packed into fixed-length sequences; or instruction data
    (conversations, prompt/response pairs) with the loss on the answers only.

    ``fit`` trains on the training rows and validates on the held-out rows; ``validate`` and ``test`` evaluate the
    held-out rows (set ``val_fraction: 1.0`` to evaluate on everything); ``predict`` continues ``prompts``.

    Plain text (``format: text``) is one token stream cut into rows, documents attending to the ones before them in
    a row. Instruction data (``format: chat`` or ``prompt_response``, read by ``recipes.instruction_data``) is split
    by example, and each example stays whole and attends only to itself: packed rows carry ``position_ids`` that
    restart per example (``packing: true``), or each example is a padded row of its own.
    Every record is read, checked and tokenized in ``setup``, before training starts; a bad one is one
    :class:`~lightning_superpipe.recipes.RecipeError` naming its file and line.

    Args:
        data_path: A text file, a folder of ``.txt``/``.md``/``.rst``/``.jsonl`` files, or a JSONL file; ``None``
            (the default) uses Python's documentation, which ships with every CPython. For instruction data: a
            ``.jsonl`` file, a ``.json`` or ``.parquet`` file (read with ``datasets``, if installed), or a folder of
            them; ``None`` uses the conversations that ship with the package (questions about Python).
        text_field: The field holding the text in JSONL records.
        format: ``text``, ``chat`` (records with a list of messages, rendered with the tokenizer's chat template, the
            loss on the assistant's messages) or ``prompt_response`` (the loss on the response).
        messages_field: The field holding a conversation's messages (``format: chat``).
        response_field: The field holding the response (``format: prompt_response``; the prompt is
            ``prompt_field``).
        chat_template: A Jinja chat template, or a file holding one, replacing the tokenizer's (or giving one to a
            tokenizer that has none, such as the byte-level one).
        packing: Pack several examples into each row of ``seq_len`` tokens, each attending only to itself; ``false``
            pads each example to the longest of its batch and draws training batches of similar lengths.
        truncate: Cut an instruction example longer than ``seq_len`` to its first ``seq_len`` tokens; off, such an
            example is an error.
        chat_prompts: Render ``predict``'s prompts as user messages with the chat template; ``None`` does so for
            ``format: chat``.
        tokenizer_path: Folder of the model's tokenizer, checked to load and to encode text
            (:func:`~lightning_superpipe.recipes.load_tokenizer`); ``None`` uses a byte-level tokenizer, for a model
            built from a config. The ``superpipe`` command sets it to ``model.pretrained_path`` unless given.
        byte_tokenizer: Use the byte-level tokenizer (UTF-8 bytes, 259 ids) whatever ``tokenizer_path`` holds: for a
            pretrained model whose folder has no tokenizer, which is otherwise an error.
        seq_len: Tokens per training sequence.
        batch_size: Sequences (or prompts) per batch.
        val_fraction: Share of the packed sequences held out for validation, in ``(0, 1]``.
        split_seed: Seed of the train/held-out split.
        shuffle_seed: Seed of the order of the training sequences, which changes every epoch; ``None`` takes the
            seed that ``seed_everything`` set (``torch.initial_seed()``). Checkpoints keep the seed and the position
            within the epoch, so ``fit --ckpt_path`` continues with the batches the interrupted run had not reached.
        num_workers: Data-loader worker processes; the rows are already in memory, so 0 is usually fastest.
        prompts: Prompts that ``predict`` continues; ``None`` uses a few openings of the embedded corpus.
        prompts_path: A JSONL file of prompts for ``predict`` (its ``prompt_field``); replaces ``prompts``.
        prompt_field: The field holding the prompt in ``prompts_path``'s records.
        num_prompts: Without ``prompts`` or ``prompts_path``: this many prompts cut from Python's documentation
            (:func:`documentation_prompts`), e.g. a large batch for throughput-oriented generation.
        prompt_chars: Characters per prompt cut from the documentation (at most; cut at a word boundary).
        predict_batch_size: Prompts per ``predict`` batch (default ``batch_size``): the effective batch that
            ``model.generation.schedule: flexgen`` splits into micro-batches.
    """

    def __init__(
        self,
        data_path: str | None = None,
        text_field: str = "text",
        tokenizer_path: str | None = None,
        byte_tokenizer: bool = False,
        format: DataFormat = "text",
        messages_field: str = "messages",
        response_field: str = "response",
        chat_template: str | None = None,
        packing: bool = True,
        truncate: bool = False,
        chat_prompts: bool | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        split_seed: int = 0,
        shuffle_seed: int | None = None,
        num_workers: int = 0,
        prompts: list[str] | None = None,
        prompts_path: str | None = None,
        prompt_field: str = "prompt",
        num_prompts: int | None = None,
        prompt_chars: int = 64,
        predict_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise RecipeError(f"data.seq_len must be at least 2, got {seq_len}")
        if batch_size < 1:
            raise RecipeError(f"data.batch_size must be at least 1, got {batch_size}")
        if not 0.0 < val_fraction <= 1.0:
            raise RecipeError(f"data.val_fraction must be in (0, 1], got {val_fraction}")
        if data_path is not None and not Path(data_path).expanduser().exists():
            # Checked here, before the model is built, so a typo costs no loading time.
            raise RecipeError(f"data path '{data_path}' does not exist")
        if prompts is not None and not prompts:
            raise RecipeError("data.prompts is an empty list; give at least one prompt or leave it unset")
        if format not in FORMATS:
            raise RecipeError(f"data.format must be one of {', '.join(FORMATS)}, got '{format}'")
        self.save_hyperparameters()
        self.data_path = data_path
        self.text_field = text_field
        self.format: DataFormat = format
        self.fields = InstructionFields(messages=messages_field, prompt=prompt_field, response=response_field)
        self.packing = packing
        self.truncate = truncate
        self.chat_prompts = format == "chat" if chat_prompts is None else chat_prompts
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        default_prompts = DEFAULT_CHAT_PROMPTS if format != "text" else DEFAULT_PROMPTS
        self.prompts = list(prompts) if prompts is not None else list(default_prompts)
        if prompts_path is not None:
            path = Path(prompts_path).expanduser()
            if not path.exists():
                raise RecipeError(f"data.prompts_path '{prompts_path}' does not exist")
            self.prompts = read_jsonl(path, prompt_field)
        elif num_prompts is not None and prompts is None:
            if num_prompts < 1 or prompt_chars < 1:
                raise RecipeError(f"data.num_prompts and data.prompt_chars must be at least 1, got {num_prompts}"
                                  f" and {prompt_chars}")
            self.prompts = documentation_prompts(num_prompts, prompt_chars)
        if predict_batch_size is not None and predict_batch_size < 1:
            raise RecipeError(f"data.predict_batch_size must be at least 1, got {predict_batch_size}")
        self.predict_batch_size = predict_batch_size
        self.tokenizer: TextTokenizer = load_tokenizer(tokenizer_path, byte_level=byte_tokenizer)
        if chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(chat_template)  # type: ignore[attr-defined]
        if format != "text" or self.chat_prompts:
            # Checked here, before the model is built: whether the tokenizer can render and locate the answers.
            byte_level = isinstance(self.tokenizer, ByteTokenizer)
            source = "the byte-level tokenizer" if byte_level else f"the tokenizer in '{tokenizer_path}'"
            check_chat_tokenizer(self.tokenizer, format == "chat" or self.chat_prompts, source)
        self.train_set: Dataset[dict[str, torch.Tensor]] | None = None
        self.val_set: Dataset[dict[str, torch.Tensor]] | None = None
        self._train_loader: ResumableDataLoader | None = None
        self._train_loader_state: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the model must be able to embed."""
        return self.tokenizer.vocab_size

    def setup(self, stage: str) -> None:
        """Read, tokenize, pack and split the text once; ``predict`` needs only the prompts.

        Raises:
            RecipeError: If the data holds no text, too little for one sequence per split, or nothing to train on.
        """
        if stage == "predict" or self.val_set is not None:
            self._check_train_rows(stage)
            return
        if self.format != "text":
            self._setup_instruction_data()
            self._check_train_rows(stage)
            return
        documents = read_documents(self.data_path, self.text_field)
        token_ids = [self.tokenizer.encode(document) for document in documents]
        rows = pack_documents(token_ids, self.seq_len, self.tokenizer.eos_token_id)
        needed = 1 if self.val_fraction >= 1.0 else 2
        if len(rows) < needed:
            source = f"data path '{self.data_path}'" if self.data_path is not None else "the embedded corpus"
            raise RecipeError(
                f"{source} holds {sum(map(len, token_ids))} tokens, too few for {needed} sequence(s) of "
                f"data.seq_len={self.seq_len}; lower data.seq_len or add text"
            )
        train_rows, held_out_rows = split_rows(rows, self.val_fraction, self.split_seed)
        self.train_set, self.val_set = PackedSequences(train_rows), PackedSequences(held_out_rows)
        log.info(
            "Packed %d documents into %d training and %d held-out sequences of %d tokens.",
            len(documents),
            len(train_rows),
            len(held_out_rows),
            self.seq_len,
        )
        self._check_train_rows(stage)

    def _setup_instruction_data(self) -> None:
        """Tokenize the instruction records, split them by example, and pack or pad each split."""
        tokenizer: ChatTokenizer = self.tokenizer  # type: ignore[assignment]  # checked in ``__init__``
        examples = load_examples(self.data_path, self.format, self.fields, tokenizer, self.seq_len, self.truncate)
        needed = 1 if self.val_fraction >= 1.0 else 2
        if len(examples) < needed:
            source = f"data path '{self.data_path}'" if self.data_path is not None else "the embedded conversations"
            raise RecipeError(f"{source} holds {len(examples)} example(s), too few for {needed} split(s); add examples")
        train_indices, held_out_indices = split_indices(len(examples), self.val_fraction, self.split_seed)
        splits = [[examples[i] for i in indices.tolist()] for indices in (train_indices, held_out_indices)]
        pad_token_id = self.tokenizer.pad_token_id
        if self.packing:
            self.train_set, self.val_set = (PackedExamples(split, self.seq_len, pad_token_id) for split in splits)
        else:
            self.train_set, self.val_set = (PaddedExamples(split, pad_token_id) for split in splits)
        trained = sum(example.trained_tokens for example in examples)
        total = sum(len(example.input_ids) for example in examples)
        layout = f"packed into rows of {self.seq_len} tokens" if self.packing else "padded per batch"
        log.info(
            "Read %d %s examples (%d tokens, %d of them trained on): %d for training and %d held out, %s.",
            len(examples), self.format, total, trained, len(splits[0]), len(splits[1]), layout,
        )

    def _check_train_rows(self, stage: str) -> None:
        if stage == "fit" and self.train_set is not None and len(self.train_set) == 0:
            raise RecipeError(f"data.val_fraction={self.val_fraction} holds out every sequence: nothing to train on")

    def _loader(self, dataset: Dataset[Any] | None, shuffle: bool) -> DataLoader[Any]:
        if dataset is None:
            raise RuntimeError("TextDataModule.setup() must run before its data loaders are requested")
        seed = self.shuffle_seed if self.shuffle_seed is not None else torch.initial_seed()
        collate = dataset.collate if isinstance(dataset, PaddedExamples) else None
        settings: dict[str, Any] = {
            "collate_fn": collate,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "persistent_workers": self.num_workers > 0,
            # Every new iterator draws a seed for its workers. From a generator of its own, it leaves the global
            # one, which dropout draws from, in the state a resumed run restores from the checkpoint.
            "generator": torch.Generator().manual_seed(seed),
        }
        if not shuffle:
            return DataLoader(dataset, shuffle=False, **settings)
        if isinstance(dataset, PaddedExamples):
            sampler: ResumableSampler = LengthGroupedSampler(dataset.lengths, self.batch_size, seed=seed)
        else:
            sampler = ResumableSampler(len(dataset), shuffle=True, seed=seed)  # type: ignore[arg-type]
        return ResumableDataLoader(dataset, sampler=sampler, **settings)

    def train_dataloader(self) -> ResumableDataLoader:
        loader: ResumableDataLoader = self._loader(self.train_set, shuffle=True)  # type: ignore[assignment]
        if self._train_loader_state is not None:
            loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position, for checkpoints.

        Lightning's fit loop saves it as well, but Lightning 2.6 does not restore it when ``configure_optimizers``
        asks for ``trainer.estimated_stepping_batches``, as :class:`CausalLMModule` does (Lightning issue #20550):
        the data module's state is restored before the optimizers are configured.
        """
        return {"train_loader": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next training loader continue where the checkpoint's stopped."""
        state = state_dict.get("train_loader")
        if state is None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._train_loader_state = state

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        # There is no separate test split: ``test`` reports on the held-out rows, like ``validate``.
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.prompts,  # type: ignore[arg-type]
            batch_size=getattr(self, "predict_batch_size", None) or self.batch_size,
            shuffle=False,
            collate_fn=PromptCollator(self.tokenizer, chat=getattr(self, "chat_prompts", False)),
        )


def documentation_prompts(count: int, chars: int = 64) -> list[str]:
    """``count`` prompts cut from Python's documentation: the opening of evenly spaced paragraphs, at most
    ``chars`` characters each, cut at a word boundary (the same prompts every time)."""
    paragraphs = [
        " ".join(part.split())
        for document in embedded_documents()
        for part in document.split("\n\n")
        if len(part.split()) >= 8 and not part.lstrip().startswith((">>>", "*", "-", "="))
    ]
    step = max(1, len(paragraphs) // count)
    prompts = []
    for index in range(count):
        text = paragraphs[(index * step) % len(paragraphs)]
        cut = text[:chars].rsplit(" ", 1)[0] if len(text) > chars else text
        prompts.append(cut)
    return prompts
