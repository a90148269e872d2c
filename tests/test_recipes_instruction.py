"""Instruction data for the recipes: conversations and prompt/response pairs, the loss on the answers only, packing
that keeps each example to itself, padding by length, and one clear error per bad record."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from transformers.masking_utils import find_packed_sequence_indices

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe.recipes import ByteTokenizer, CausalLMModule, RecipeError, TextDataModule
from lightning_superpipe.recipes.instruction_data import (
    IGNORE_INDEX,
    Example,
    embedded_conversations,
    encode_conversation,
    encode_prompt_response,
    pack_examples,
)
from lightning_superpipe.recipes.resumable_loading import LengthGroupedSampler
from lightning_superpipe.recipes.testing import CHATML_TEMPLATE, train_bpe_tokenizer
from lightning_superpipe.recipes.text_data import PromptCollator
from lightning_superpipe.recipes.tokenization import PretrainedTokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune_chat_lora.yaml"
#: The byte-level chat template of the shipped recipe.
BYTE_TEMPLATE = yaml.safe_load(RECIPE.read_text())["data"]["chat_template"]
#: ChatML with ``{% generation %}`` around the assistant's part, for ``return_assistant_tokens_mask``.
GENERATION_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does pass do?"},
    {"role": "assistant", "content": "Nothing: it is a placeholder."},
    {"role": "user", "content": "And break?"},
    {"role": "assistant", "content": "It ends the loop."},
]


@pytest.fixture(scope="module")
def chatml() -> PretrainedTokenizer:
    """A BPE tokenizer with ChatML control tokens and template, like an instruction-tuned model's."""
    return PretrainedTokenizer(train_bpe_tokenizer(chat=True))


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {"chat": root / "chat", "plain": root / "plain"}
    train_bpe_tokenizer(chat=True).save_pretrained(folders["chat"])
    train_bpe_tokenizer().save_pretrained(folders["plain"])
    return folders


def write_jsonl(path: Path, records: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def trained_runs(example: Example) -> list[list[int]]:
    """The runs of consecutive labelled tokens of ``example``."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE_INDEX:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = label != IGNORE_INDEX
    return runs


def test_a_conversation_is_tokenized_as_apply_chat_template_does_and_labelled_on_the_assistants_turns(
    chatml: PretrainedTokenizer,
) -> None:
    example = encode_conversation(CONVERSATION, chatml, "line 1 of 'x.jsonl'")
    hf = chatml.tokenizer
    assert example.input_ids == hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    decoded = [hf.decode(run) for run in trained_runs(example)]
    assert decoded == ["Nothing: it is a placeholder.<|im_end|>\n", "It ends the loop.<|im_end|>\n"]
    # The same tokens as transformers' own assistant mask, for a template written with {% generation %} blocks.
    masked = hf.apply_chat_template(CONVERSATION, chat_template=GENERATION_TEMPLATE, tokenize=True,
                                    return_dict=True, return_assistant_tokens_mask=True)
    assert masked["input_ids"] == example.input_ids
    assert masked["assistant_masks"] == [int(label != IGNORE_INDEX) for label in example.labels]


def test_the_byte_tokenizer_renders_with_the_recipes_template_and_ends_each_answer_with_eos() -> None:
    tokenizer = ByteTokenizer(BYTE_TEMPLATE)
    example = encode_conversation(CONVERSATION, tokenizer, "x")
    assert example.input_ids[0] == tokenizer.bos_token_id and example.labels[0] == IGNORE_INDEX
    runs = trained_runs(example)
    assert [tokenizer.decode(run) for run in runs] == ["Nothing: it is a placeholder.\n", "It ends the loop.\n"]
    assert [run[-2] for run in runs] == [tokenizer.eos_token_id] * 2  # the template's `{{ eos_token }}`
    text = tokenizer.render_chat(CONVERSATION[:2], add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.\n<|user|>\nWhat does pass do?\n<|assistant|>\n"
    # The prompt opens the first example's tokens, as predict encodes it.
    prompt_ids = tokenizer.encode_rendered(text)[0]
    assert example.input_ids[: len(prompt_ids)] == prompt_ids


def test_a_prompt_response_pair_is_the_prompt_as_predict_encodes_it_then_the_labelled_response_and_eos(
    chatml: PretrainedTokenizer,
) -> None:
    example = encode_prompt_response("Name a loop: ", "for", chatml, "x")
    prompt_ids = chatml.encode("Name a loop: ")
    assert example.input_ids[: len(prompt_ids)] == prompt_ids
    assert example.labels[: len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)
    response = example.input_ids[len(prompt_ids) :]
    assert example.labels[len(prompt_ids) :] == response and response[-1] == chatml.eos_token_id
    assert chatml.tokenizer.decode(response[:-1]) == "for"


def example(length: int, first: int) -> Example:
    ids = list(range(first, first + length))
    return Example(ids, [IGNORE_INDEX, *ids[1:]], f"example {first}")


def test_packing_keeps_each_example_whole_with_positions_that_restart() -> None:
    examples = [example(5, 10), example(3, 20), example(4, 30), example(2, 40), example(8, 50)]
    packed = pack_examples(examples, seq_len=8, pad_token_id=0)
    # Best fit in order: 5 opens row 0, 3 fills it, 4 opens row 1, 2 joins it (the fullest that fits), 8 opens row 2.
    assert packed["input_ids"].tolist() == [
        [10, 11, 12, 13, 14, 20, 21, 22],
        [30, 31, 32, 33, 40, 41, 0, 0],
        [50, 51, 52, 53, 54, 55, 56, 57],
    ]
    assert packed["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7],
    ]
    # No label at an example's first token: the previous example's last token does not learn to predict it.
    assert packed["labels"][0].tolist() == [IGNORE_INDEX, 11, 12, 13, 14, IGNORE_INDEX, 21, 22]
    assert packed["labels"][1, -2:].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    # transformers reads the restarts as separate sequences (the padding is one of its own).
    assert find_packed_sequence_indices(packed["position_ids"]).tolist() == [
        [0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0],
    ]


def tiny_model(model_type: str, attention: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    if model_type == "gpt2":
        sizes = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    else:
        sizes.update(intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **sizes)
    config._attn_implementation = attention
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("model_type", "attention"), [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                                       ("gpt2", "sdpa"), ("gpt2", "eager")])
def test_transformers_keeps_attention_within_each_packed_example(model_type: str, attention: str) -> None:
    """The packed row's logits are each example's logits alone; without the positions they are not (the check
    can fail)."""
    model = tiny_model(model_type, attention)
    torch.manual_seed(1)
    examples = [torch.randint(0, 64, (length,)) for length in (7, 5, 9)]
    row = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(len(ids)) for ids in examples])[None]
    with torch.no_grad():
        # No cache, as in training: transformers reads restarting positions as packed examples only without one.
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0].split([7, 5, 9])
        alone = [model(input_ids=ids[None]).logits[0] for ids in examples]
        causal = model(input_ids=row).logits[0].split([7, 5, 9])
    for packed_logits, alone_logits in zip(packed, alone):
        torch.testing.assert_close(packed_logits, alone_logits, atol=1e-5, rtol=1e-5)
    assert (causal[1] - alone[1]).abs().max() > 1e-3


def example_losses(module: CausalLMModule, examples: Sequence[Example]) -> torch.Tensor:
    """The mean of the next-token losses on every labelled token, each example run alone."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for item in examples:
            logits = module(torch.tensor([item.input_ids]))[0, :-1]
            targets = torch.tensor(item.labels[1:])
            kept = targets != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[kept], targets[kept], reduction="sum").double()
            count += int(kept.sum())
    return total / count


def chat_data(**settings: Any) -> TextDataModule:
    return TextDataModule(format="chat", chat_template=BYTE_TEMPLATE, seq_len=384, **settings)


def tiny_module() -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4}, vocab_size=ByteTokenizer.vocab_size)


def test_the_packed_and_the_padded_loss_are_the_mean_over_the_examples_answer_tokens() -> None:
    module = tiny_module().eval()
    padded = chat_data(packing=False, batch_size=64, val_fraction=0.5)
    padded.setup("fit")
    examples = padded.train_set.examples  # the split is by example, the same packed or padded
    expected = float(example_losses(module, examples))
    for packing in (True, False):
        data = chat_data(packing=packing, batch_size=64, val_fraction=0.5)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        extra = "position_ids" if packing else "attention_mask"
        assert set(batch) == {"input_ids", "labels", extra}
        assert len(batch["input_ids"]) == len(data.train_set)  # one batch holds the whole split
        if packing:
            assert len(data.train_set) < len(examples)  # several examples a row
        with torch.no_grad():
            loss, tokens = module._loss(batch)
        assert int(tokens) == sum(item.trained_tokens for item in examples)
        assert float(loss) == pytest.approx(expected, rel=2e-6, abs=0)
    # The plain-text batch is unchanged: every token trained on.
    with torch.no_grad():
        plain = module._loss({"input_ids": batch["input_ids"]})
    assert plain[1] == batch["input_ids"].numel() - len(batch["input_ids"])


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_chat(strategy: str, packing: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    pl.seed_everything(3)
    data = chat_data(packing=packing, batch_size=4, val_fraction=0.1, shuffle_seed=5)
    module = tiny_module()
    recorder = LossRecorder()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])
    trainer.fit(module, data)
    return recorder.losses, {name: value.detach().clone() for name, value in module.state_dict().items()}


@pytest.mark.parametrize("packing", [True, False])
def test_instruction_tuning_through_the_strategy_matches_plain_lightning(packing: bool) -> None:
    """fp32, every weight trained: the same losses and weights, position_ids (or the padding mask) reaching every
    streamed layer."""
    plain_losses, plain_weights = fit_chat("auto", packing)
    streamed_losses, streamed_weights = fit_chat("superpipe", packing)
    assert len(plain_losses) == 4
    assert streamed_losses == pytest.approx(plain_losses, rel=1e-5)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(streamed_weights[name], weight, rtol=1e-5, atol=1e-6)
    start = tiny_module().state_dict()
    assert any(not torch.equal(start[name], weight) for name, weight in plain_weights.items())


PLAIN_ONLY_TEMPLATE = (  # renders system, user and assistant messages and drops any other silently
    "{%- for message in messages -%}{%- if message['role'] in ['system', 'user', 'assistant'] -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
GOOD = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
BAD_RECORDS: dict[str, tuple[list[Any], dict[str, Any], str]] = {
    "no messages field": ([GOOD, {"text": "hi"}], {}, "line 2 of '{path}' has no 'messages' field (it has 'text'); "
                                                       "set data.messages_field"),
    "a role the template refuses": (
        [GOOD, {"messages": [{"role": "user", "content": "Hi?"}, {"role": "tool", "content": "42"},
                             {"role": "assistant", "content": "Hello."}]}],
        {}, "line 2 of '{path}': the chat template refused the conversation: Unknown role: tool"),
    "a role the template leaves out": (
        [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "tool", "content": "42"},
                       {"role": "assistant", "content": "Hello."}]}],
        {"chat_template": PLAIN_ONLY_TEMPLATE},
        "line 1 of '{path}': the chat template leaves message 2 (role 'tool') out of the text"),
    "an example longer than the sequence": (
        [GOOD, {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "word " * 20}]}],
        {"seq_len": 24}, "line 2 of '{path}' is 80 tokens, longer than data.seq_len=24"),
    "a message without content": (
        [{"messages": [{"role": "user"}, {"role": "assistant", "content": "Hello."}]}], {},
        "line 1 of '{path}': message 1 has no string 'content' (missing)"),
    "no assistant message": ([{"messages": [{"role": "user", "content": "Hi?"}]}], {},
                             "line 1 of '{path}' has no 'assistant' message: nothing to train on"),
    "messages that are not a list": ([{"messages": "Hi?"}], {}, "line 1 of '{path}': 'messages' is a str"),
    "a prompt without a response": ([{"prompt": "Hi?", "response": "Hello."}, {"prompt": "Hi?"}],
                                    {"format": "prompt_response"},
                                    "line 2 of '{path}' has no 'response' field (it has 'prompt'); set "
                                    "data.response_field"),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_a_bad_record_is_one_error_naming_its_file_and_line_in_setup(
    case: str, tmp_path: Path, tokenizer_folders: dict[str, Path]
) -> None:
    records, settings, message = BAD_RECORDS[case]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    settings = {"format": "chat", "seq_len": 128, **settings}
    data = TextDataModule(data_path=str(path), tokenizer_path=str(tokenizer_folders["chat"]), **settings)
    with pytest.raises(RecipeError) as error:
        data.setup("fit")
    assert message.format(path=path) in str(error.value) and "\n" not in str(error.value)


def test_a_long_example_is_cut_only_when_asked(tmp_path: Path, tokenizer_folders: dict[str, Path]) -> None:
    long = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "word " * 20}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [GOOD, long, GOOD])
    folder = str(tokenizer_folders["chat"])
    with pytest.raises(RecipeError, match=r"line 2 of .* tokens, longer than data.seq_len=24; raise data.seq_len, "
                                          r"shorten the example, or set data.truncate: true"):
        TextDataModule(data_path=str(path), tokenizer_path=folder, format="chat", seq_len=24).setup("fit")
    data = TextDataModule(data_path=str(path), tokenizer_path=folder, format="chat", seq_len=24, truncate=True,
                          packing=False, val_fraction=0.3)
    data.setup("fit")
    lengths = sorted(len(item.input_ids) for split in (data.train_set, data.val_set) for item in split.examples)
    assert lengths[-1] == 24 and len(lengths) == 3


def test_conversations_need_a_chat_template_before_anything_is_read(tokenizer_folders: dict[str, Path]) -> None:
    folder = tokenizer_folders["plain"]
    with pytest.raises(RecipeError, match=rf"the tokenizer in '{folder}' has none; set data.chat_template"):
        TextDataModule(format="chat", tokenizer_path=str(folder))
    with pytest.raises(RecipeError, match="the byte-level tokenizer has none"):
        TextDataModule(format="chat")
    with pytest.raises(RecipeError, match="the chat template is not valid Jinja: line 1"):
        TextDataModule(format="chat", chat_template="{% for message in messages %}")
    with pytest.raises(RecipeError, match="data.chat_template 'missing.jinja' is neither a Jinja template"):
        TextDataModule(format="chat", chat_template="missing.jinja")
    # Prompt/response pairs need no template, and a template may come from a file.
    TextDataModule(format="prompt_response", tokenizer_path=str(folder))
    template_file = folder.parent / "template.jinja"
    template_file.write_text(CHATML_TEMPLATE)
    assert TextDataModule(format="chat", tokenizer_path=str(folder),
                          chat_template=str(template_file)).tokenizer.chat_template == CHATML_TEMPLATE


def test_a_text_field_error_points_at_the_instruction_formats(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [GOOD])
    with pytest.raises(RecipeError, match=r"set data.text_field, or data.format: chat\)"):
        TextDataModule(data_path=str(path)).setup("fit")


def parquet_and_json_folder(folder: Path, records: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(records[:3]), folder / "a.parquet")
    (folder / "b.json").write_text(json.dumps(records[3:]))


def test_parquet_and_json_files_are_read_with_datasets(tmp_path: Path, tokenizer_folders: dict[str, Path]) -> None:
    pytest.importorskip("datasets")
    records = [record.fields for record in embedded_conversations()[:6]]
    records[1]["messages"][0]["name"] = "someone"  # a key other messages lack: a table gives them None
    parquet_and_json_folder(tmp_path / "tables", records)
    jsonl = write_jsonl(tmp_path / "same.jsonl", records)
    settings = {"format": "chat", "tokenizer_path": str(tokenizer_folders["chat"]), "seq_len": 512,
                "packing": False, "val_fraction": 0.5}
    from_tables, from_jsonl = TextDataModule(data_path=str(tmp_path / "tables"), **settings), \
        TextDataModule(data_path=str(jsonl), **settings)
    for data in (from_tables, from_jsonl):
        data.setup("fit")
    for split in ("train_set", "val_set"):
        assert [item.input_ids for item in getattr(from_tables, split).examples] == \
            [item.input_ids for item in getattr(from_jsonl, split).examples]
    broken = tmp_path / "broken"
    parquet_and_json_folder(broken, [records[0], {"text": "hi"}, records[2], records[3]])
    with pytest.raises(RecipeError, match=rf"record 2 of '{broken / 'a.parquet'}' has no 'messages' field"):
        TextDataModule(data_path=str(broken), **settings).setup("fit")


def test_without_datasets_a_parquet_file_is_one_clear_error(
    tmp_path: Path, tokenizer_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "chats.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    data = TextDataModule(data_path=str(path), format="chat", tokenizer_path=str(tokenizer_folders["chat"]))
    with pytest.raises(RecipeError, match=rf"reading '{path}' needs the datasets package \(pip install datasets\)"):
        data.setup("fit")


def test_padded_batches_are_drawn_by_length_and_resume_part_way() -> None:
    data = chat_data(packing=False, batch_size=4, val_fraction=0.1, shuffle_seed=2)
    data.setup("fit")
    loader = data.train_dataloader()
    assert isinstance(loader.sampler, LengthGroupedSampler)
    loader.sampler.set_epoch(1)
    epoch = list(loader)
    lengths = [batch["attention_mask"].sum(1).tolist() for batch in epoch]
    assert all(row == sorted(row, reverse=True) for row in lengths)  # within a batch, longest first
    order = [length for row in lengths for length in row]
    assert sorted(order, reverse=True) == order  # one group this small: the whole epoch by length
    batches = iter(loader)
    seen = [next(batches) for _ in range(3)]
    state = loader.state_dict()
    resumed = chat_data(packing=False, batch_size=4, val_fraction=0.1)
    resumed.setup("fit")
    again = resumed.train_dataloader()
    again.load_state_dict(state)
    again.sampler.set_epoch(1)
    ids = [batch["input_ids"].tolist() for batch in [*seen, *again]]
    assert ids == [batch["input_ids"].tolist() for batch in epoch]
    # Another epoch, another order; groups sorted within themselves.
    sampler = LengthGroupedSampler([5, 1, 4, 2, 3, 6, 7, 0], batch_size=2, seed=0, batches_per_group=2)
    first = sampler.order()
    assert sorted(first) == list(range(8))
    assert all(sorted(first[i : i + 4], key=lambda j: -sampler.lengths[j]) == first[i : i + 4] for i in (0, 4))


def test_predict_asks_chat_prompts_as_user_turns(chatml: PretrainedTokenizer) -> None:
    batch = PromptCollator(chatml, chat=True)(["What does pass do?"])
    expected = chatml.tokenizer.apply_chat_template([{"role": "user", "content": "What does pass do?"}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    assert batch["input_ids"][0].tolist() == expected and batch["prompts"] == ["What does pass do?"]
    data = chat_data(prompts=["Hi?"])
    data.setup("predict")
    ids = next(iter(data.predict_dataloader()))["input_ids"][0].tolist()
    assert data.tokenizer.decode(ids) == "<|user|>\nHi?\n<|assistant|>\n"
    assert ids[0] == ByteTokenizer.bos_token_id
    plain = TextDataModule(prompts=["Hi?"])
    plain.setup("predict")
    assert next(iter(plain.predict_dataloader()))["input_ids"][0].tolist() == ByteTokenizer().encode("Hi?")


def test_the_shipped_conversations_are_valid_and_fit_the_recipe() -> None:
    records = embedded_conversations()
    assert len(records) >= 36
    tokenizer = ByteTokenizer(BYTE_TEMPLATE)
    for record in records:
        messages = record.fields["messages"]
        assert {message["role"] for message in messages} <= {"system", "user", "assistant"}
        assert messages[-1]["role"] == "assistant"
        assert len(encode_conversation(messages, tokenizer, record.where).input_ids) <= 384
    assert any(sum(message["role"] == "assistant" for message in record.fields["messages"]) > 1
               for record in records)
