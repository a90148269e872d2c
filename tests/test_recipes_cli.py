"""The ``superpipe`` command and the shipped recipes, run end to end for a few steps the way a user would."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_superpipe.planning import parse_budget
from lightning_superpipe.recipes import CausalLMModule, TextDataModule, cli
from lightning_superpipe.recipes.testing import save_tiny_pretrained
from lightning_superpipe.recipes.text_data import embedded_documents
from lightning_superpipe.recipes.tokenization import ByteTokenizer
from tests.test_recipes_instruction import example_losses

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LORA, FULL, MOE = (str(RECIPES / name) for name in ("finetune_lora.yaml", "finetune_full.yaml", "eval_moe_paged.yaml"))
CHAT = str(RECIPES / "finetune_chat_lora.yaml")
# A few steps instead of the recipes' hundreds, set on the command line as a user would.
FEW_STEPS = [
    "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
    "--trainer.log_every_n_steps", "1",
]
QUIET = ["--trainer.enable_progress_bar", "false"]


def run_dir(root: Path, name: str) -> Path:
    """The newest run folder of recipe ``name`` under ``root``."""
    versions = sorted((root / "superpipe_logs" / name).glob("version_*"), key=lambda path: int(path.name.split("_")[1]))
    assert versions, f"no run folder for {name} under {root}"
    return versions[-1]


def metric_rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as file:
        return list(csv.DictReader(file))


def logged(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def module_of(recipe: str) -> CausalLMModule:
    """The module a recipe builds, made here independently of the CLI to check the run's figures against."""
    settings = yaml.safe_load(Path(recipe).read_text())["model"]
    return CausalLMModule(**settings, vocab_size=ByteTokenizer.vocab_size)


def param_bytes(module: CausalLMModule, trainable_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad or not trainable_only)


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One short fit with the LoRA recipe, shared by the tests that inspect its outputs."""
    root = tmp_path_factory.mktemp("lora_run")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        cli.main(["fit", "--config", LORA, *FEW_STEPS, *QUIET])
    yield root


def test_lora_recipe_fine_tunes_with_the_superpipe_strategy_and_reports_memory(lora_run: Path) -> None:
    run = run_dir(lora_run, "finetune_lora")
    rows = metric_rows(run)
    assert len(logged(rows, "train/loss")) >= 1 and len(logged(rows, "val/loss")) == 1
    assert logged(rows, "val/ppl") == pytest.approx([2.718281828 ** logged(rows, "val/loss")[0]], rel=1e-4)
    # The strategy logs what it holds on the device every step.
    assert logged(rows, "superpipe/peak_device_bytes")
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()

    report = json.loads((run / "memory_report.json").read_text())
    assert report["stage"] == "fit"
    # The recipe gives a memory budget: the first two steps are profiled, the third runs the plan.
    assert report["strategy"].startswith("SuperpipeStrategy (num_blocks=6, resident_blocks=")
    plan = report["strategy_report"]["plan"]
    assert plan["budget_bytes"] == 48 * 2**20 and plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert report["strategy_report"]["streamed_stacks"] == [
        "model.base_model.model.model.layers: 6 x LlamaDecoderLayer"
    ]
    module = module_of(LORA)
    assert report["param_bytes"] == param_bytes(module)
    assert report["gradient_bytes"] == param_bytes(module, trainable_only=True) < report["param_bytes"] / 10
    # AdamW keeps two moments per trainable weight (plus a step count per tensor).
    assert 2 * report["gradient_bytes"] <= report["optimizer_state_bytes"] < 2.01 * report["gradient_bytes"]
    plain_parts = (report["param_bytes"], report["gradient_bytes"], report["optimizer_state_bytes"])
    assert report["plain_total_bytes"] == sum(plain_parts)
    # Plain training's peak counts its activations, measured on the first batch: most of them are the blocks'.
    activations = report["plain_activation_bytes"]
    assert 0 < report["outside_blocks_activation_bytes"] < activations / 4
    assert report["plain_peak_bytes"] == report["plain_total_bytes"] + activations
    # Like for like: the strategy's ledger counts the activations outside the blocks too (as many as plain saves
    # there), and the recipe's settings hold less on the device than plain training.
    assert report["compared_peak_bytes"] == report["peak_bytes"]
    assert report["strategy_report"]["peak_outside_activation_bytes"] == report["outside_blocks_activation_bytes"]
    assert report["peak_ratio"] == report["compared_peak_bytes"] / report["plain_peak_bytes"] < 1
    strategy = report["strategy_report"]
    assert report["superpipe_peak_device_bytes"] == strategy["peak_device_bytes"] >= strategy["largest_block_bytes"]
    # The ledger counts everything the strategy put on the device, the weights outside the blocks included.
    assert (
        report["peak_bytes"]
        == strategy["peak_device_bytes"]
        >= strategy["trunk_device_bytes"] + strategy["largest_block_bytes"]
    )
    # What the strategy held stayed within the budget, profiled steps included.
    assert report["peak_bytes"] <= plan["budget_bytes"]
    assert [sample["batch"] for sample in report["samples"]] == [1, 2, 3]
    assert all(sample["device_bytes"] <= report["peak_bytes"] for sample in report["samples"])
    assert is_png(run / "device_memory.png")


def test_predict_continues_the_recipes_prompts_from_the_fit_checkpoint(
    lora_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(lora_run)
    checkpoint = run_dir(lora_run, "finetune_lora") / "checkpoints" / "last.ckpt"
    cli.main(
        ["predict", "--config", LORA, "--ckpt_path", str(checkpoint), "--model.generation.max_new_tokens", "8", *QUIET]
    )
    run = run_dir(lora_run, "finetune_lora")
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    prompts = yaml.safe_load(Path(LORA).read_text())["data"]["prompts"]
    assert [record["prompt"] for record in records] == prompts
    # Byte-level tokens: at most 8 new tokens are at most 8 bytes of text.
    assert all(isinstance(r["completion"], str) and len(r["completion"].encode()) <= 8 for r in records)
    out = capsys.readouterr().out
    assert f">>> {prompts[0]}" in out and "Device memory: predict with SuperpipeStrategy" in out


def test_full_recipe_trains_every_weight_with_clipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli.main(["fit", "--config", FULL, *FEW_STEPS, *QUIET, "--trainer.callbacks.save_last", "false"])
    run = run_dir(tmp_path, "finetune_full")
    losses = logged(metric_rows(run), "val/loss")
    assert len(losses) == 1 and 0 < losses[0] < 10
    report = json.loads((run / "memory_report.json").read_text())
    module = module_of(FULL)
    assert report["gradient_bytes"] == report["param_bytes"] == param_bytes(module)
    assert report["optimizer_state_bytes"] >= 2 * report["param_bytes"]
    # The recipe's budget, about half of what the plain strategy holds, is what the strategy held at most.
    budget = report["strategy_report"]["plan"]["budget_bytes"]
    assert report["peak_bytes"] <= budget == 40 * 2**20 < 0.55 * report["plain_total_bytes"]
    assert not (run / "checkpoints" / "last.ckpt").exists()
    assert is_png(run / "device_memory.png")


def test_eval_moe_recipe_keeps_the_experts_within_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    def smaller(settings: dict[str, Any]) -> None:
        # The shipped recipe at half its depth, width and length, for time: calibration runs GPTQ over every expert's
        # columns (56 of the 65 s the run took at full width).
        settings["model"]["config"].update(num_hidden_layers=2, hidden_size=128, intermediate_size=256)
        settings["data"]["seq_len"] = 64

    recipe = write_recipe(tmp_path / "eval_moe_paged.yaml", MOE, smaller)
    cli.main(["validate", "--config", recipe, "--trainer.limit_val_batches", "2", *QUIET])
    run = run_dir(tmp_path, "eval_moe_paged")
    rows = metric_rows(run)
    assert len(logged(rows, "val/loss")) == 1
    report = json.loads((run / "memory_report.json").read_text())
    paged = report["paged_moe"]
    written = yaml.safe_load(Path(MOE).read_text())["trainer"]["callbacks"][1]["init_args"]["expert_budget"]
    budget_fraction = parse_budget(written, "expert_budget").fraction
    assert 0 < paged["expert_bytes_device_max"] <= budget_fraction * paged["expert_bytes_16bit"]
    assert paged["ppl_paged"] == pytest.approx(paged["ppl_full"], rel=0.05)
    assert logged(rows, "paged_moe/validate/ppl_paged") == [paged["ppl_paged"]]
    # The plain strategy would hold every weight, the experts at their original float32 size included.
    assert report["param_bytes"] == param_bytes(module_of(recipe))
    assert report["sampled_max_bytes"] < report["param_bytes"] - paged["expert_bytes_16bit"]
    assert [sample["batch"] for sample in report["samples"]] == [1, 2]


def test_the_memory_table_degrades_gracefully_without_the_superpipe_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cli.main(["fit", "--config", LORA, "--trainer.strategy", "auto", "--trainer.max_steps", "2",
              "--trainer.limit_val_batches", "0", *QUIET])
    report = json.loads((run_dir(tmp_path, "finetune_lora") / "memory_report.json").read_text())
    assert report["strategy"] == "SingleDeviceStrategy" and report["strategy_report"] is None
    assert report["superpipe_peak_device_bytes"] is None and report["cuda_max_allocated_bytes"] is None
    # The plain strategy keeps everything on its device, so what it holds after a batch is exactly the plain
    # estimate, and with the activations its step held, plain training's peak.
    assert report["peak_bytes"] == report["sampled_max_bytes"] == report["plain_total_bytes"]
    assert report["compared_peak_bytes"] == report["plain_peak_bytes"] and report["peak_ratio"] == 1
    out = capsys.readouterr().out
    assert "Device memory: fit with SingleDeviceStrategy on cpu" in out
    assert re.search(r"device peak / plain peak \(activations included\) +100\.0 %", out)


def write_recipe(path: Path, recipe: str, edit: Any) -> str:
    """A copy of ``recipe`` with ``edit`` applied to its parsed YAML, as a user would edit the file."""
    settings = yaml.safe_load(Path(recipe).read_text())
    edit(settings)
    path.write_text(yaml.safe_dump(settings))
    return str(path)


BAD_INPUT = {
    "unknown YAML key": (
        lambda tmp: ["--config", write_recipe(tmp / "r.yaml", LORA, lambda s: s["trainer"].update(max_stepz=3))],
        "'trainer.max_stepz' is not a recipe key (did you mean 'trainer.max_steps'?)",
    ),
    "unknown nested YAML key": (
        lambda tmp: ["--config", write_recipe(tmp / "r.yaml", LORA, lambda s: s["model"]["lora"].update(rnak=4))],
        "model.lora: lightning_superpipe.recipes.LoRASettings has no option 'rnak' (did you mean 'rank'?)",
    ),
    "unknown strategy option": (
        lambda tmp: ["--config", LORA, "--trainer.strategy.resident_block", "2"],
        "has no option 'resident_block' (did you mean 'resident_blocks'?)",
    ),
    "missing model path": (
        lambda tmp: ["--config", LORA, "--model.pretrained_path", str(tmp / "no_model")],
        "model path '{tmp}/no_model' does not exist",
    ),
    "model path without a model": (
        lambda tmp: ["--config", LORA, "--model.pretrained_path", str(tmp)],
        "model path '{tmp}' holds no model: it has no config.json",
    ),
    "data path without text": (
        lambda tmp: ["--config", LORA, "--data.data_path", str(tmp)],
        "data path '{tmp}' holds no text: the folder has no .txt",
    ),
    "LoRA target not in the model": (
        lambda tmp: ["--config", LORA, "--model.lora.target_modules", "[q_proj, qkv_proj]"],
        "LoRA target module 'qkv_proj' is not in the model; modules LoRA can adapt in this model: down_proj,",
    ),
    "callback refusing its arguments": (
        lambda tmp: ["--config", LORA, "--trainer.callbacks.save_top_k", "-5"],
        "ResumableCheckpoint: Invalid value for save_top_k=-5. Must be >= -1",
    ),
    "bad value type": (
        lambda tmp: ["--config", LORA, "--data.seq_len", "long"],
        "data.seq_len: expected int, got long",
    ),
    "negative strategy knob": (
        lambda tmp: ["--config", LORA, "--trainer.strategy.prefetch", "-1"],
        "SuperpipeStrategy(prefetch=-1) must be a whole number, zero or more",
    ),
    # The strategy's constructor refuses a bad knob; jsonargparse would report that as a type mismatch.
    "strategy knob out of its values": (
        lambda tmp: ["--config", LORA, "--trainer.strategy.init_args.offload_device", "nvme"],
        "trainer.strategy: SuperpipeStrategy(offload_device='nvme', offload_path=None, host_buffer_bytes=None):"
        " offload_device must be 'cpu'",
    ),
    "strategy knobs that do not go together": (
        lambda tmp: ["--config", LORA, "--trainer.strategy.host_buffer_bytes", "4096"],
        "host_buffer_bytes=4096): host_buffer_bytes is used only by the disk tier",
    ),
    "unknown strategy name": (
        lambda tmp: ["--config", LORA, "--trainer.strategy", "superpip"],
        "trainer: You selected an invalid strategy name: `strategy='superpip'`",
    ),
    # Values transformers refuses while building the model: its own words, and the key they are about.
    "hidden size the heads do not divide": (
        lambda tmp: ["--config", LORA, "--model.config.hidden_size", "250"],
        "model.config.hidden_size: The hidden size (250) is not a multiple of the number of attention heads (4).",
    ),
    "no attention heads": (
        lambda tmp: ["--config", LORA, "--model.config.num_attention_heads", "0"],
        ("model.config.num_attention_heads: transformers cannot build a 'llama' configuration with "
         "num_attention_heads=0 (ZeroDivisionError: integer division or modulo by zero)"),
    ),
    "size that is not a number": (
        lambda tmp: ["--config", LORA, "--model.config.hidden_size", "abc"],
        "model.config.hidden_size: expected int, got str (value: 'abc')",
    ),
    "fractional layer count": (
        lambda tmp: ["--config", FULL, "--model.config.num_hidden_layers", "2.5"],
        "model.config.num_hidden_layers: expected int, got float (value: 2.5)",
    ),
    # Instruction data: each bad record is one line naming its file and line, before training starts.
    "chat record with a role the template refuses": (
        lambda tmp: ["--config", CHAT, "--data.data_path", chat_file(tmp, {"role": "tool", "content": "42"})],
        "line 2 of '{tmp}/chats.jsonl': the chat template refused the conversation: unknown role 'tool'",
    ),
    "chat record without messages": (
        lambda tmp: ["--config", CHAT, "--data.data_path", chat_file(tmp, None)],
        "line 2 of '{tmp}/chats.jsonl' has no 'messages' field (it has 'text'); set data.messages_field",
    ),
    "conversation longer than the sequence": (
        lambda tmp: ["--config", CHAT, "--data.seq_len", "64"],
        "line 1 of 'python_chats.jsonl' is 348 tokens, longer than data.seq_len=64; raise data.seq_len",
    ),
    "conversations without a chat template": (
        lambda tmp: ["--config", CHAT, "--data.chat_template", "null"],
        "conversations are rendered with the tokenizer's chat template, but the byte-level tokenizer has none; set "
        "data.chat_template",
    ),
    "unknown activation": (
        lambda tmp: ["--config", LORA, "--model.config.hidden_act", "gelu_fast_please"],
        ("model.config.hidden_act: transformers cannot build a 'llama' model with hidden_act='gelu_fast_please' "
         "(KeyError: 'gelu_fast_please')"),
    ),
}


def chat_file(folder: Path, message: dict[str, str] | None) -> str:
    """A JSONL of two conversations, the second with ``message`` before its answer (``None``: no messages)."""
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    second = {"text": "Hi?"} if message is None else {"messages": [good["messages"][0], message, good["messages"][1]]}
    path = folder / "chats.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(second) + "\n")
    return str(path)


def test_the_chat_recipe_trains_and_evaluates_on_the_answers_and_asks_its_prompts_as_chat_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cli.main(["fit", "--config", CHAT, *FEW_STEPS, *QUIET])
    fit_run = run_dir(tmp_path, "finetune_chat_lora")
    assert len(logged(metric_rows(fit_run), "train/loss")) >= 1
    checkpoint = fit_run / "checkpoints" / "last.ckpt"
    cli.main(["validate", "--config", CHAT, "--ckpt_path", str(checkpoint), *QUIET])
    [val_loss] = logged(metric_rows(run_dir(tmp_path, "finetune_chat_lora")), "val/loss")
    # The loss over the held-out conversations' answer tokens, each conversation run alone.
    settings = yaml.safe_load(Path(CHAT).read_text())["data"]
    data = TextDataModule(format="chat", chat_template=settings["chat_template"], seq_len=settings["seq_len"],
                          val_fraction=settings["val_fraction"], packing=False)
    data.setup("validate")
    module = CausalLMModule.load_from_checkpoint(checkpoint).eval()
    assert val_loss == pytest.approx(float(example_losses(module, data.val_set.examples)), rel=1e-5)

    cli.main(["predict", "--config", CHAT, "--ckpt_path", str(checkpoint), "--model.generation.max_new_tokens", "4",
              *QUIET])
    records = [json.loads(line) for line in (run_dir(tmp_path, "finetune_chat_lora") / "predictions.jsonl")
               .read_text().splitlines()]
    assert [record["prompt"] for record in records] == settings["prompts"]
    assert all(isinstance(record["completion"], str) for record in records)


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gets_one_clear_line_and_no_traceback(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    arguments, message = BAD_INPUT[case]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *arguments(tmp_path), *QUIET])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("superpipe: error: ")]
    assert len(errors) == 1, err
    assert message.format(tmp=tmp_path) in errors[0]
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``save_pretrained`` folders of a tiny Llama: with its tokenizer, without one, with only a Qwen2
    ``tokenizer_config.json``, with a tokenizer of more ids than it embeds; and the tokenizer alone."""
    root = tmp_path_factory.mktemp("models")
    good = save_tiny_pretrained(root / "good")
    tokenizer_files = [path for path in good.iterdir() if path.name.startswith("tokenizer")]
    folders = {
        "good": good,
        "no tokenizer": save_tiny_pretrained(root / "no_tokenizer", with_tokenizer=False),
        "config only": save_tiny_pretrained(root / "config_only", with_tokenizer=False),
        "too small for the tokenizer": save_tiny_pretrained(root / "small_vocab", with_tokenizer=False, vocab_size=300),
        "tokenizer": root / "tokenizer",
    }
    (folders["config only"] / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>"})
    )
    folders["tokenizer"].mkdir()
    for path in tokenizer_files:
        shutil.copy(path, folders["tokenizer"] / path.name)
        shutil.copy(path, folders["too small for the tokenizer"] / path.name)
    return folders


TOKENIZER_ERRORS = {
    "no tokenizer": "'{path}' has no tokenizer files (tokenizer.json, ",
    "config only": "the tokenizer in '{path}' cannot encode text: it has 1 token ids and turns",
    "too small for the tokenizer": "the tokenizer has 384 token ids but the model in '{path}' embeds 300: ",
}


@pytest.mark.parametrize("case", TOKENIZER_ERRORS)
def test_a_tokenizer_the_model_cannot_use_is_one_line_before_any_text_is_packed(
    case: str, model_folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    path = model_folders[case]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", LORA, "--model.pretrained_path", str(path), *QUIET])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"superpipe: error: {TOKENIZER_ERRORS[case].format(path=path)}" in err, err
    assert "Packed" not in err and "LoRA: training" not in err  # neither the data nor the model was touched


def test_the_tokenizer_path_flag_and_a_run_without_a_logger(
    model_folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--data.tokenizer_path`` (listed in the CLI reference) names the tokenizer of a model folder that has none;
    ``--trainer.logger false`` trains without a logger (the learning rate is the module's own metric)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text(" ".join(embedded_documents()[:3]))
    cli.main(["fit", "--config", LORA, "--model.pretrained_path", str(model_folders["no tokenizer"]),
              "--data.tokenizer_path", str(model_folders["tokenizer"]), "--data.data_path", "notes.txt",
              "--data.seq_len", "16", "--data.batch_size", "2", "--trainer.max_steps", "2",
              "--trainer.limit_val_batches", "0", "--trainer.logger", "false", *QUIET])
    checkpoint = torch.load(tmp_path / "superpipe_logs" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2 and not list(tmp_path.rglob("metrics.csv"))
    assert checkpoint["datamodule_hyper_parameters"]["tokenizer_path"] == str(model_folders["tokenizer"])
    assert checkpoint["hyper_parameters"]["vocab_size"] == 384  # the folder's BPE tokenizer, not bytes (259)


def test_moe_pagings_refusal_is_a_user_error_once_its_code_is_loaded() -> None:
    """The CLI names MoE paging's error without importing the paging code (which ``superpipe --help`` does not need);
    once that code is loaded, the error is one line like the others."""
    from lightning_superpipe.moe import UnsupportedMoEModelError

    assert UnsupportedMoEModelError in cli.user_errors()
    assert set(cli.USER_ERRORS) < set(cli.user_errors())


def test_the_traceback_of_a_user_error_is_available_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(cli.RecipeError, match="does not exist"):
        cli.main(["fit", "--config", LORA, "--model.pretrained_path", str(tmp_path / "missing")])


def superpipe_command() -> str:
    """The console script installed next to this Python, as ``pip install -e .`` puts it."""
    script = shutil.which("superpipe", path=str(Path(sys.executable).parent)) or shutil.which("superpipe")
    if script is None:
        pytest.fail("the `superpipe` console script is not installed; run `pip install -e .`")
    return script


def test_the_console_script_writes_plain_progress_lines_and_throughput_to_files(tmp_path: Path) -> None:
    """Under ``nohup``, SLURM or CI, output goes to files: plain lines instead of the progress bar's carriage
    returns, with the step, the loss, tokens/s, step time and the device's peak; the same figures in metrics.csv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(cli.TRACEBACK_ENV, None)

    def throughput_over_one_step(settings: dict[str, Any]) -> None:  # the recipe's 10-step means, for 3 steps
        for callback in settings["trainer"]["callbacks"]:
            if callback["class_path"].endswith("ThroughputLogger"):
                callback["init_args"] = {"window": 1}

    recipe = write_recipe(tmp_path / "finetune_lora.yaml", LORA, throughput_over_one_step)
    seq_len, batch_size = 32, 4  # shorter rows and batches than the recipe's, for time: the command is what is tested
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.txt").open("w") as err:
        done = subprocess.run(
            [superpipe_command(), "fit", "--config", recipe, "--trainer.max_steps", "3", "--trainer.limit_val_batches",
             "0", "--trainer.log_every_n_steps", "1", "--data.seq_len", str(seq_len), "--data.batch_size",
             str(batch_size)],
            cwd=tmp_path, env=env, stdout=out, stderr=err, timeout=300,
        )
    printed = (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()
    assert done.returncode == 0, printed[-3000:]
    assert "Device memory: fit with SuperpipeStrategy" in printed
    assert "\r" not in printed  # no progress bar redrawing itself
    figures = r"train/loss=[\d.]+, dev_mem_MiB=[\d.]+"
    assert re.search(rf"^train step 1/3, epoch 0 \(\d+:\d\d:\d\d elapsed, about \d+:\d\d:\d\d left\): {figures}.*; "
                     r"device peak [\d.]+ [KM]iB$", printed, re.MULTILINE), printed[-3000:]
    last = re.search(r"^training done: step 3 \(.*\): (.*)$", printed, re.MULTILINE)
    assert last, printed[-3000:]
    assert re.search(rf"{figures}, train/step_time_s=[\d.]+, train/tokens_per_s=[\d.,]+; device peak", last[1])

    rows = metric_rows(run_dir(tmp_path, "finetune_lora"))
    step_times, tokens_per_s = logged(rows, "train/step_time_s"), logged(rows, "train/tokens_per_s")
    assert len(step_times) == len(tokens_per_s) == 3 and min(step_times) > 0
    # Both figures cover the same steps: their product is the tokens of one step.
    assert [t * s for t, s in zip(tokens_per_s, step_times)] == pytest.approx([seq_len * batch_size] * 3, rel=1e-4)
    assert logged(rows, "superpipe/peak_device_bytes") and len(logged(rows, "train/lr")) == 3


def test_plain_progress_replaces_the_bar_only_where_standard_error_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not cli.wants_plain_progress(None, [])  # Lightning's own bar on a terminal
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cli.wants_plain_progress(None, []) and cli.wants_plain_progress(True, None)
    assert not cli.wants_plain_progress(False, [])  # --trainer.enable_progress_bar false: no bar, no lines
    assert not cli.wants_plain_progress(None, [TQDMProgressBar()])  # the recipe chose its bar


def test_the_console_script_reports_bad_input_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(cli.TRACEBACK_ENV, None)
    command = [superpipe_command(), "fit", "--config", LORA]
    failed = subprocess.run(
        [*command, "--model.lora.target_modules", "[q_proj, attn]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines()[-1].startswith(
        "superpipe: error: LoRA target module 'attn' is not in the model; modules LoRA can adapt in this model:"
    )
    assert "Traceback" not in failed.stderr


def test_the_full_recipe_runs_on_two_devices_with_the_disk_tier(tmp_path: Path) -> None:
    """``--trainer.devices 2`` on the CPU: Lightning launches a second process, each rank keeps its files in its own
    folder, and rank 0 writes the memory report (asking for the run's folder is a collective on every rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tier = tmp_path / "tier"
    tier.mkdir()

    def smaller(settings: dict[str, Any]) -> None:  # the shipped recipe's model and rows shrunk: two ranks, for time
        settings["model"]["config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        settings["data"].update(seq_len=32, batch_size=4)

    recipe = write_recipe(tmp_path / "finetune_full.yaml", FULL, smaller)
    done = subprocess.run(
        [superpipe_command(), "fit", "--config", recipe, *FEW_STEPS, *QUIET, "--trainer.devices", "2",
         "--trainer.strategy.init_args.memory_budget", "null", "--trainer.strategy.init_args.offload_device", "disk",
         "--trainer.strategy.init_args.offload_path", str(tier)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = run_dir(tmp_path, "finetune_full")
    report = json.loads((run / "memory_report.json").read_text())
    assert report["strategy_report"]["offload_device"] == "disk"
    assert sorted(p.name for p in tier.iterdir()) == ["rank-0", "rank-1"]
    assert len(logged(metric_rows(run), "val/loss")) == 1


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("fit", "validate", "test", "predict"))


QLORA = str(RECIPES / "finetune_qlora.yaml")


def test_qlora_recipe_streams_a_4bit_base_saves_only_the_adapters_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The QLoRA recipe on its embedded default: the base's linear layers in NF4 (double quantization), streamed in
    their 4-bit form; the memory table gives the base's host bytes and the bytes streamed a step beside their 16-bit
    figures; the checkpoint holds the adapters only, and a run resumed from it continues."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.chdir(tmp_path)
    steps = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]
    cli.main(["fit", "--config", QLORA, *steps, *QUIET])
    run = run_dir(tmp_path, "finetune_qlora")
    report = json.loads((run / "memory_report.json").read_text())["strategy_report"]
    assert report["packed_weight_bytes"] <= 0.3 * 2 * report["packed_weight_numel"]
    assert 0 < report["streamed_packed_weight_bytes"] < report["streamed_block_bytes"]
    printed = capsys.readouterr()
    table = printed.out + printed.err
    assert "frozen 4-bit base in host memory" in table and "with the base at 16 bits" in table
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["state_dict"] and all("lora_" in key for key in checkpoint["state_dict"])
    resumed = ["--trainer.max_steps", "3", "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]
    cli.main(["fit", "--config", QLORA, *resumed, "--trainer.limit_val_batches", "0", *QUIET])
    last = torch.load(run_dir(tmp_path, "finetune_qlora") / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3 and set(last["state_dict"]) == set(checkpoint["state_dict"])
    assert any(not torch.equal(last["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())  # it trained
