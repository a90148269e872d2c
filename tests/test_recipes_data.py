"""Text data for the recipes: reading, tokenizing, packing, splitting and serving batches."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_superpipe.recipes import ByteTokenizer, RecipeError, TextDataModule, load_tokenizer
from lightning_superpipe.recipes.errors import TokenizerError
from lightning_superpipe.recipes.testing import save_tiny_pretrained
from lightning_superpipe.recipes.text_data import (
    PromptCollator,
    embedded_documents,
    pack_documents,
    read_documents,
    split_rows,
)
from lightning_superpipe.recipes.tokenization import PretrainedTokenizer, check_tokenizer


def test_byte_tokenizer_round_trips_any_text_and_drops_special_ids() -> None:
    tokenizer = ByteTokenizer()
    text = "naïve café — ∑ 😀"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == list(text.encode("utf-8"))
    assert max(ids) < tokenizer.vocab_size
    assert tokenizer.decode([*ids, tokenizer.eos_token_id, tokenizer.pad_token_id]) == text
    # A generated sequence can stop in the middle of a multi-byte character; decoding must not raise.
    assert tokenizer.decode(list("é".encode())[:1]) == "\ufffd"


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with its tokenizer, as ``save_pretrained`` writes both."""
    return save_tiny_pretrained(tmp_path_factory.mktemp("with_tokenizer"), num_hidden_layers=1)


def test_load_tokenizer_uses_the_model_folders_tokenizer_and_bytes_only_without_a_folder_or_when_asked(
    tmp_path: Path, with_tokenizer: Path
) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)  # a model built from a config
    tokenizer = load_tokenizer(with_tokenizer)
    assert isinstance(tokenizer, PretrainedTokenizer)
    text = "The for statement is used to iterate over the elements of a sequence."
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) < len(text.encode()) / 2  # a real subword vocabulary, not bytes
    assert tokenizer.decode(ids) == text
    without = save_tiny_pretrained(tmp_path / "without", with_tokenizer=False, num_hidden_layers=1)
    assert isinstance(load_tokenizer(without, byte_level=True), ByteTokenizer)
    assert isinstance(load_tokenizer(with_tokenizer, byte_level=True), ByteTokenizer)


def config_only(folder: Path, tokenizer_class: str) -> Path:
    """A folder whose only tokenizer file is ``tokenizer_config.json``, as a checkpoint copied without its vocabulary
    files is."""
    folder.mkdir()
    settings = {"tokenizer_class": tokenizer_class, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp, _: tmp / "missing", "tokenizer path '{path}' does not exist"),
        (lambda tmp, _: save_tiny_pretrained(tmp / "no_tokenizer", with_tokenizer=False, num_hidden_layers=1),
         "'{path}' has no tokenizer files (tokenizer.json, tokenizer_config.json, "),
        # A Qwen2 checkpoint without vocab.json and merges.txt: a tokenizer of one token that encodes text as nothing.
        (lambda tmp, _: config_only(tmp / "qwen2", "Qwen2Tokenizer"),
         "the tokenizer in '{path}' cannot encode text: it has 1 token ids and turns 'The quick brown fox"),
        (lambda tmp, _: config_only(tmp / "llama", "LlamaTokenizer"), "the tokenizer in '{path}' cannot encode text:"),
        # A fast tokenizer's config without its tokenizer.json: transformers cannot build it.
        (lambda tmp, good: config_only(tmp / "fast", json.loads((good / "tokenizer_config.json").read_text())
                                       ["tokenizer_class"]),
         "cannot load the tokenizer in '{path}': "),
    ],
    ids=["missing", "no tokenizer files", "qwen2 config only", "llama config only", "fast config only"],
)
def test_a_tokenizer_that_cannot_encode_text_is_one_clear_error(
    tmp_path: Path, with_tokenizer: Path, make: Any, message: str
) -> None:
    path = make(tmp_path, with_tokenizer)
    with pytest.raises(TokenizerError) as caught:
        load_tokenizer(path)
    assert str(caught.value).startswith(message.format(path=path)), str(caught.value)


def test_the_tokenizer_check_passes_what_round_trips_and_refuses_what_does_not() -> None:
    check_tokenizer(ByteTokenizer(), "bytes")

    class Lossy(ByteTokenizer):
        def decode(self, token_ids: Sequence[int]) -> str:  # drops the digits, as a vocabulary without them would
            return "".join(c for c in super().decode(token_ids) if not c.isdigit())

    with pytest.raises(TokenizerError, match="the tokenizer in 'lossy' cannot encode text: it has 259 token ids"):
        check_tokenizer(Lossy(), "lossy")


def test_the_embedded_corpus_is_pythons_documentation() -> None:
    from pydoc_data.topics import topics

    documents = embedded_documents()
    assert len(documents) == len(topics)
    assert documents[0] == topics[sorted(topics)[0]]
    assert sum(map(len, documents)) > 400_000


def test_read_documents_from_a_file_a_folder_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("first file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "guide.md").write_text("second file")
    (tmp_path / "sub" / "records.jsonl").write_text(
        "\n".join(json.dumps(record) for record in [{"text": "record one"}, {"meta": 1}, {"text": "record two"}])
    )
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n")  # not a text suffix: skipped
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_text("hidden file")
    (tmp_path / "blank.txt").write_text("  \n")

    # Sorted by path; blank and hidden files and other suffixes are left out.
    assert read_documents(str(tmp_path)) == ["first file", "second file", "record one", "record two"]
    assert read_documents(str(tmp_path / "notes.txt")) == ["first file"]
    assert read_documents(str(tmp_path / "sub" / "records.jsonl")) == ["record one", "record two"]


@pytest.mark.parametrize(
    ("files", "target", "message"),
    [
        ({}, "missing", "data path '{root}/missing' does not exist"),
        ({"empty/": ""}, "empty", "data path '{root}/empty' holds no text: the folder has no .txt"),
        ({"empty.txt": "\n \n"}, "empty.txt", "data path '{root}/empty.txt' holds no text: the file is empty"),
        ({"d/a.txt": "", "d/b.md": " "}, "d", "data path '{root}/d' holds no text: its 2 files are empty"),
        ({"r.jsonl": '{"body": "x"}\n'}, "r.jsonl", "no record in '{root}/r.jsonl' has the text field 'text'"),
        ({"r.jsonl": '{"text": "ok"}\nnot json\n'}, "r.jsonl", "line 2 of '{root}/r.jsonl' is not JSON"),
        ({"r.jsonl": '{"text": 3}\n'}, "r.jsonl", "field 'text' on line 1 of '{root}/r.jsonl' is a int"),
        ({"bin.txt": b"\xff\xfe\x00"}, "bin.txt", "'{root}/bin.txt' is not UTF-8 text"),
    ],
)
def test_read_documents_refuses_paths_without_text(
    tmp_path: Path, files: dict[str, str | bytes], target: str, message: str
) -> None:
    for name, content in files.items():
        path = tmp_path / name
        if name.endswith("/"):
            path.mkdir()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RecipeError) as caught:
        read_documents(str(tmp_path / target))
    assert str(caught.value).startswith(message.format(root=tmp_path))


def test_pack_documents_ends_each_document_and_drops_the_short_tail() -> None:
    rows = pack_documents([[1, 2, 3], [4, 5], [6, 9]], seq_len=4, eos_token_id=9)
    # Stream: 1 2 3 9 | 4 5 9 6 | 9 (the last document already ends with 9; the tail is dropped).
    assert rows.tolist() == [[1, 2, 3, 9], [4, 5, 9, 6]]
    assert rows.dtype == torch.int32
    assert pack_documents([[1, 2, 3]], seq_len=2, eos_token_id=None).tolist() == [[1, 2]]


def test_split_rows_is_a_seeded_partition() -> None:
    rows = torch.arange(40).view(20, 2)
    train, held_out = split_rows(rows, val_fraction=0.25, seed=3)
    assert len(held_out) == 5 and len(train) == 15
    assert sorted(torch.cat([train, held_out])[:, 0].tolist()) == rows[:, 0].tolist()
    again_train, again_held_out = split_rows(rows, val_fraction=0.25, seed=3)
    assert torch.equal(held_out, again_held_out) and torch.equal(train, again_train)
    assert not torch.equal(split_rows(rows, val_fraction=0.25, seed=4)[1], held_out)
    # At least one row on each side, and everything held out for evaluation-only runs.
    assert [len(part) for part in split_rows(rows[:2], val_fraction=0.01, seed=0)] == [1, 1]
    assert [len(part) for part in split_rows(rows, val_fraction=1.0, seed=0)] == [0, 20]


def test_data_module_packs_the_embedded_corpus_into_training_and_held_out_batches() -> None:
    data = TextDataModule(seq_len=64, batch_size=4, val_fraction=0.1)
    assert data.vocab_size == ByteTokenizer.vocab_size
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    total_bytes = sum(len(document.encode()) + 2 for document in embedded_documents())  # + bos and eos
    assert len(data.train_set) + len(data.val_set) == total_bytes // 64
    assert len(data.val_set) == round(total_bytes // 64 * 0.1)
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.long
    held_out = next(iter(data.val_dataloader()))["input_ids"]
    assert torch.equal(held_out, next(iter(data.test_dataloader()))["input_ids"])
    # The rows are the corpus itself: decoding a held-out row gives text that occurs in the documentation.
    text = data.tokenizer.decode(held_out[0].tolist())
    assert any(text[:40] in document for document in embedded_documents())


def test_data_module_refuses_bad_settings_and_too_little_text(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="data path 'nowhere.txt' does not exist"):
        TextDataModule(data_path="nowhere.txt")
    with pytest.raises(RecipeError, match=r"data.val_fraction must be in \(0, 1\], got 0.0"):
        TextDataModule(val_fraction=0.0)
    with pytest.raises(RecipeError, match="data.seq_len must be at least 2, got 1"):
        TextDataModule(seq_len=1)
    short = tmp_path / "short.txt"
    short.write_text("only a few bytes")
    data = TextDataModule(data_path=str(short), seq_len=16)
    with pytest.raises(RecipeError, match=rf"data path '{short}' holds 17 tokens, too few for 2 sequence\(s\)"):
        data.setup("fit")
    everything_held_out = TextDataModule(seq_len=512, val_fraction=1.0)
    with pytest.raises(RecipeError, match="holds out every sequence: nothing to train on"):
        everything_held_out.setup("fit")
    everything_held_out.setup("validate")  # evaluation-only runs may hold out everything


def test_prompts_are_left_padded_for_generation() -> None:
    tokenizer = ByteTokenizer()
    batch = PromptCollator(tokenizer)(["ab", "abcd"])
    assert batch["prompts"] == ["ab", "abcd"]
    assert batch["input_ids"].tolist() == [
        [tokenizer.pad_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, 97, 98],
        [tokenizer.bos_token_id, 97, 98, 99, 100],
    ]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    data = TextDataModule(prompts=["x", "y", "z"], batch_size=2)
    data.setup("predict")
    assert [b["prompts"] for b in data.predict_dataloader()] == [["x", "y"], ["z"]]


def batch_rows(batches: Iterable[dict[str, torch.Tensor]]) -> list[list[int]]:
    """Each batch as the first tokens of its rows, which tell the packed rows apart."""
    return [batch["input_ids"][:, 0].tolist() for batch in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_training_loader_continues_part_way_through_an_epoch(num_workers: int) -> None:
    data = TextDataModule(seq_len=256, batch_size=4, num_workers=num_workers, shuffle_seed=7)
    data.setup("fit")
    loader = data.train_dataloader()
    loader.sampler.set_epoch(3)
    whole_epoch = batch_rows(loader)
    # Every row once, not in the stored order.
    first_tokens = [token for batch in whole_epoch for token in batch]
    stored = data.train_set.rows[:, 0].tolist()
    assert len(whole_epoch) == len(loader) and sorted(first_tokens) == sorted(stored) and first_tokens != stored

    batches = iter(loader)
    seen = [next(batches) for _ in range(5)]
    # Counted as handed over, not as the workers prefetch them.
    state = loader.state_dict()
    assert state == {"epoch": 3, "batches_done": 5, "num_batches": len(loader), "batch_size": 4, "seed": 7,
                     "num_samples": len(data.train_set), "shuffle": True}
    del batches

    resumed = TextDataModule(seq_len=256, batch_size=4, num_workers=num_workers)  # the seed comes from the state
    resumed.setup("fit")
    again = resumed.train_dataloader()
    again.load_state_dict(state)
    again.sampler.set_epoch(3)  # what Lightning does before the resumed epoch
    assert batch_rows(seen) + batch_rows(again) == whole_epoch
    # The next epoch starts from its beginning, in an order of its own.
    again.sampler.set_epoch(4)
    next_epoch = batch_rows(again)
    assert len(next_epoch) == len(loader) and next_epoch != whole_epoch


def test_a_checkpoint_of_a_finished_epoch_resumes_with_the_next_one() -> None:
    data = TextDataModule(seq_len=512, batch_size=8, shuffle_seed=1)
    data.setup("fit")
    loader = data.train_dataloader()
    first_epoch = batch_rows(loader)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batches_done"] == len(loader)
    again = data.train_dataloader()
    again.load_state_dict(state)
    again.sampler.set_epoch(1)
    second_epoch = batch_rows(again)
    assert len(second_epoch) == len(first_epoch) and second_epoch != first_epoch


def test_the_data_module_restores_the_loader_position_before_the_loader_exists() -> None:
    # Lightning restores the data module's state before ``configure_optimizers`` builds the training loader to
    # count the steps; the fit loop's own copy of the loader state would come too late (Lightning issue #20550).
    data = TextDataModule(seq_len=512, batch_size=8)
    data.setup("fit")
    assert data.state_dict() == {}
    loader = data.train_dataloader()
    batches = iter(loader)
    seen = [next(batches), next(batches)]
    saved = data.state_dict()
    assert saved["train_loader"]["batches_done"] == 2

    resumed = TextDataModule(seq_len=512, batch_size=8)
    resumed.load_state_dict(saved)
    resumed.setup("fit")
    rest = batch_rows(resumed.train_dataloader())
    assert batch_rows(seen) + rest == batch_rows(data.train_dataloader())


def test_resuming_with_other_data_settings_is_refused() -> None:
    data = TextDataModule(seq_len=512, batch_size=8)
    data.setup("fit")
    loader = data.train_dataloader()
    next(iter(loader))
    state = loader.state_dict()
    other = TextDataModule(seq_len=512, batch_size=4)
    other.setup("fit")
    with pytest.raises(RecipeError, match=r"the checkpoint stopped part-way through an epoch of other training data "
                                          r"\(batch_size 8 then, 4 now, num_batches \d+ then, \d+ now\)"):
        other.train_dataloader().load_state_dict(state)
