"""Checkpoints that hold the bytes of what they save, and exports a plain ``transformers`` / ``peft`` user loads.

A ``.ckpt`` of a LoRA or QLoRA run holds the adapters and their optimizer state, not the blocks' flat host buffers
its tensors are views into (host tier, disk tier, a 4-bit base); one of a full fine-tune keeps its views (the blocks
are saved whole). ``superpipe export``, :func:`export_pretrained` and :class:`ExportCheckpoints` write folders that a
process importing only torch, transformers and peft loads with the trained module's logits, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.disk import DiskTierError
from lightning_superpipe.recipes import (
    CausalLMModule,
    ExportCheckpoints,
    LoRASettings,
    QuantizationSettings,
    RecipeError,
    TextDataModule,
    cli,
    export_pretrained,
)
from lightning_superpipe.recipes.testing import save_tiny_pretrained
from lightning_superpipe.run.checkpoints import saved_bytes_only

LORA = LoRASettings(rank=4, alpha=8, dropout=0.1, target_modules="all-linear")
#: The logits are compared on these token ids (below every tokenizer's size here).
IDS = torch.arange(2 * 16).remainder(250).view(2, 16)

#: Loads each export as a user without this package would, and saves its logits on ``IDS``.
PLAIN_LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from peft import PeftModel

jobs = json.loads(sys.argv[1])
torch.set_num_threads(jobs["threads"])  # as many as the process that computed the trained logits: MKL's sums follow
ids = torch.load(jobs["ids"])
for job in jobs["exports"]:
    folder = job["folder"]
    try:
        adapter = json.load(open(folder + "/adapter_config.json"))
    except FileNotFoundError:
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        kwargs = {}
        if job.get("quantized"):
            settings = json.load(open(folder + "/base_quantization_config.json"))
            kwargs = dict(quantization_config=BitsAndBytesConfig.from_dict(settings), device_map="cpu")
        base = AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"], **kwargs)
        if job.get("rows"):  # embeddings resized for the tokenizer: resized before the adapter brings their values
            base.resize_token_embeddings(job["rows"])
        model = PeftModel.from_pretrained(base, folder)
    with torch.no_grad():
        torch.save(model.eval()(input_ids=ids).logits, job["logits"])
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in ("lightning", "lightning_superpipe"))))
"""


def storage_bytes(ckpt: Path) -> int:
    """The bytes of the tensors' storages in the ``torch.save`` file ``ckpt`` (its ``data/`` records)."""
    with zipfile.ZipFile(ckpt) as archive:
        return sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)


def tensor_bytes(ckpt: Path) -> int:
    """The bytes of the tensors saved in ``ckpt``, each view counted once."""
    views: dict[tuple[Any, ...], int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
            views[key] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(torch.load(ckpt, weights_only=True))
    return sum(views.values())


def test_the_size_helpers_see_a_view_saved_with_its_whole_storage(tmp_path: Path) -> None:
    """What the checkpoint tests compare can differ: ``torch.save`` of a view writes its whole storage."""
    whole = torch.zeros(1000)
    torch.save({"view": whole[:10]}, tmp_path / "view.pt")
    assert tensor_bytes(tmp_path / "view.pt") == 40
    assert storage_bytes(tmp_path / "view.pt") == 4000


def test_views_of_a_partly_saved_storage_are_copied_and_those_of_a_whole_one_kept() -> None:
    flat = torch.arange(1000, dtype=torch.float32)
    live_state = {"exp_avg": flat[900:]}
    checkpoint = {
        "state_dict": {"a": flat[:100].view(10, 10), "tied": flat[:100].view(10, 10), "own": torch.ones(3)},
        "optimizer_states": [{"state": {0: live_state}}],
        "epoch": 1,
    }
    written = saved_bytes_only(checkpoint)
    state = written["state_dict"]
    assert torch.equal(state["a"], flat[:100].view(10, 10)) and state["a"].untyped_storage().nbytes() == 400
    assert state["tied"] is state["a"]  # one place, one copy: tied weights stay tied
    assert state["own"] is checkpoint["state_dict"]["own"] and written["epoch"] == 1
    copied_state = written["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(copied_state, flat[900:]) and copied_state.untyped_storage().nbytes() == 400
    # Nothing the checkpoint held (the optimizer's live state among it) was changed.
    assert live_state["exp_avg"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert checkpoint["state_dict"]["a"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # Views covering all but 5% of their storage stay views (a block saved whole, but for its alignment gaps); 15%
    # unsaved is copied.
    most = {"state_dict": {"a": flat[:500], "b": flat[500:950]}}
    assert saved_bytes_only(most) is most
    less = {"state_dict": {"a": flat[:500], "b": flat[500:850]}}
    assert saved_bytes_only(less)["state_dict"]["b"].untyped_storage().nbytes() == 350 * 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved model with its tokenizer, as a user's local folder from the Hub."""
    return save_tiny_pretrained(tmp_path_factory.mktemp("pretrained") / "base")


def fit(module: CausalLMModule, root: Path, steps: int, strategy: Any = None, tokenizer: Path | None = None,
        callbacks: list[Any] | None = None, ckpt_path: Path | None = None) -> pl.Trainer:
    data = TextDataModule(tokenizer_path=str(tokenizer) if tokenizer else None, seq_len=32, batch_size=4)
    trainer = pl.Trainer(
        strategy=strategy or SuperpipeStrategy(), accelerator="cpu", max_steps=steps, limit_val_batches=0,
        logger=False, default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def logits(module: CausalLMModule) -> torch.Tensor:
    with torch.no_grad():
        return module.model.eval()(input_ids=IDS).logits


def trainable(module: CausalLMModule) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Short runs of each kind, their checkpoints, exports and the trained modules' logits."""
    root = tmp_path_factory.mktemp("runs")
    found: dict[str, dict[str, Any]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # LoRA on the host tier, a checkpoint every 2 steps; exported from the last one by `superpipe export`.
        pl.seed_everything(0, verbose=False)
        lora = CausalLMModule(pretrained_path=str(pretrained), lora=LORA, vocab_size=384)
        every_two = ModelCheckpoint(dirpath=root / "lora", every_n_train_steps=2, save_top_k=-1)
        fit(lora, root, 4, tokenizer=pretrained, callbacks=[every_two])
        cli.main(["export", "--ckpt_path", str(root / "lora" / "epoch=0-step=4.ckpt"), "--output_dir",
                  str(root / "lora-export")])
    found["lora"] = dict(ckpt=root / "lora" / "epoch=0-step=2.ckpt", export=root / "lora-export", logits=logits(lora),
                         module=lora, warnings=[str(w.message) for w in caught])
    # QLoRA (a bitsandbytes 4-bit base), exported from its checkpoint by the Python call.
    pl.seed_everything(0, verbose=False)
    qlora = CausalLMModule(pretrained_path=str(pretrained), lora=LORA, quantization=QuantizationSettings(),
                           vocab_size=384)
    trainer = fit(qlora, root / "qlora", 2, tokenizer=pretrained)
    ckpt = Path(trainer.checkpoint_callback.best_model_path)
    found["qlora"] = dict(ckpt=ckpt, export=export_pretrained(ckpt, root / "qlora-export"), logits=logits(qlora))
    # A full fine-tune, exported in shards from its checkpoint.
    pl.seed_everything(0, verbose=False)
    full = CausalLMModule(pretrained_path=str(pretrained), vocab_size=384)
    trainer = fit(full, root / "full", 2, tokenizer=pretrained)
    ckpt = Path(trainer.checkpoint_callback.best_model_path)
    found["full"] = dict(ckpt=ckpt, export=export_pretrained(ckpt, root / "full-export", max_shard_size="100KB"),
                         logits=logits(full), module=full)
    # LoRA on the disk tier, exported beside each checkpoint by the callback (one checkpoint kept), and from it.
    pl.seed_everything(0, verbose=False)
    disk = CausalLMModule(pretrained_path=str(pretrained), lora=LORA, vocab_size=384)
    (root / "tier").mkdir()
    latest = ModelCheckpoint(dirpath=root / "disk", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    fit(disk, root, 2, SuperpipeStrategy(offload_device="disk", offload_path=root / "tier"), pretrained,
        [latest, ExportCheckpoints()])
    ckpt = Path(latest.best_model_path)
    found["disk"] = dict(ckpt=ckpt, export=Path(f"{ckpt}.export"), logits=logits(disk), folder=root / "disk")
    found["disk-ckpt"] = dict(export=export_pretrained(ckpt, root / "disk-export"), logits=found["disk"]["logits"])
    # LoRA on a base built from a config (the shipped recipe as it is): the base is exported beside the adapter.
    pl.seed_everything(0, verbose=False)
    random = CausalLMModule(config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4), lora=LORA, vocab_size=259)
    fit(random, root / "random", 2)
    found["random"] = dict(export=export_pretrained(random, root / "random-export"), logits=logits(random))
    # Embeddings resized for a tokenizer with more ids (their new rows random, frozen): saved with the adapter.
    resized = CausalLMModule(pretrained_path=str(pretrained), lora=LORA, vocab_size=384)
    resized.model.get_base_model().resize_token_embeddings(400)
    with torch.no_grad():
        for name, parameter in resized.model.named_parameters():
            if ".lora_B." in name:  # trained adapters, without a run
                parameter.normal_(std=0.02)
    found["resized"] = dict(export=export_pretrained(resized, root / "resized-export"), logits=logits(resized),
                            rows=400)
    return found


@pytest.fixture(scope="module")
def plain(runs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each export loaded by a process that imports torch, transformers and peft only: its logits, and the modules
    of Lightning or this package it imported (none)."""
    root = tmp_path_factory.mktemp("plain")
    torch.save(IDS, root / "ids.pt")
    jobs = {"ids": str(root / "ids.pt"), "threads": torch.get_num_threads(), "exports": [
        {"folder": str(run["export"]), "logits": str(root / f"{name}.pt"), "quantized": name == "qlora",
         "rows": run.get("rows")}
        for name, run in runs.items()
    ]}
    done = subprocess.run([sys.executable, "-c", PLAIN_LOADER, json.dumps(jobs)], capture_output=True, text=True,
                          cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"imported": json.loads(done.stdout.splitlines()[-1]),
            **{name: torch.load(root / f"{name}.pt") for name in runs}}


@pytest.mark.parametrize("kind", ["lora", "qlora", "disk"])
def test_an_adapter_checkpoint_holds_the_bytes_of_the_adapters_and_their_optimizer_state(
    runs: dict[str, dict[str, Any]], pretrained: Path, kind: str
) -> None:
    """Host tier, disk tier and a 4-bit base: the file's storages are the saved tensors' bytes (each a copy of its
    view), not the blocks' flat buffers; the state dict is the adapters' (the disk tier's are in its files)."""
    ckpt = runs[kind]["ckpt"]
    saved = tensor_bytes(ckpt)
    assert storage_bytes(ckpt) <= 1.1 * saved, (storage_bytes(ckpt), saved)
    base_bytes = (pretrained / "model.safetensors").stat().st_size
    assert storage_bytes(ckpt) < base_bytes / 4  # rank-4 adapters and AdamW's two moments: far under the base
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert (state and all(".lora_" in name for name in state)) if kind != "disk" else not state


def test_a_full_fine_tune_checkpoint_keeps_its_views_and_holds_the_model(runs: dict[str, dict[str, Any]]) -> None:
    """Every tensor of each block is saved, so the views stay (no copy doubles host memory while saving): the file's
    storages are the blocks' buffers, alignment gaps and all, within a tenth of the tensors' bytes."""
    ckpt = runs["full"]["ckpt"]
    assert tensor_bytes(ckpt) < storage_bytes(ckpt) <= 1.1 * tensor_bytes(ckpt)
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert set(state) == set(runs["full"]["module"].state_dict())


def test_a_lora_run_resumed_from_an_adapter_only_checkpoint_equals_the_uninterrupted_run(
    runs: dict[str, dict[str, Any]], pretrained: Path, tmp_path: Path
) -> None:
    pl.seed_everything(0, verbose=False)
    resumed = CausalLMModule(pretrained_path=str(pretrained), lora=LORA, vocab_size=384)
    every_two = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)  # as the first run had
    fit(resumed, tmp_path, 4, tokenizer=pretrained, callbacks=[every_two], ckpt_path=runs["lora"]["ckpt"])
    whole = trainable(runs["lora"]["module"])
    assert whole.keys() == trainable(resumed).keys()
    assert [name for name, value in trainable(resumed).items() if not torch.equal(value, whole[name])] == []


@pytest.mark.parametrize("kind", ["lora", "qlora", "full", "disk", "disk-ckpt", "random", "resized"])
def test_an_export_loads_in_plain_transformers_and_peft_with_the_trained_logits(
    runs: dict[str, dict[str, Any]], plain: dict[str, Any], kind: str
) -> None:
    assert plain["imported"] == []
    assert torch.equal(plain[kind], runs[kind]["logits"])


def test_the_exports_are_peft_and_transformers_folders(runs: dict[str, dict[str, Any]], pretrained: Path) -> None:
    lora = runs["lora"]["export"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in lora.iterdir()}
    assert json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"] == str(pretrained)
    # Loaded as the adapter-only checkpoint it is: no warning lists the base's weights as missing.
    assert not [message for message in runs["lora"]["warnings"] if "missing" in message.lower()]
    assert (runs["qlora"]["export"] / "base_quantization_config.json").is_file()
    full = {p.name for p in runs["full"]["export"].iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= full
    assert len([name for name in full if name.endswith(".safetensors")]) > 2  # 100KB shards
    random = runs["random"]["export"]
    named = json.loads((random / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(random / "base_model") and (random / "base_model" / "config.json").is_file()
    # The callback's exports follow the checkpoints: only the kept one has its export beside it.
    assert sorted(p.name for p in runs["disk"]["folder"].iterdir() if p.name.endswith(".export")) == [
        f"{runs['disk']['ckpt'].name}.export"
    ]


def test_a_taken_output_folder_or_a_bad_shard_size_is_refused_before_anything_is_loaded(
    runs: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.ckpt"  # would fail to load: the folder's check comes first
    with pytest.raises(RecipeError, match="exists and is not empty; name a new folder, or pass overwrite=True"):
        export_pretrained(missing, runs["lora"]["export"])
    with pytest.raises(RecipeError, match=r"max_shard_size='5 gigs' is not a size"):
        export_pretrained(missing, tmp_path / "out", max_shard_size="5 gigs")
    with pytest.raises(FileNotFoundError, match="to export does not exist"):
        export_pretrained(missing, tmp_path / "out")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["export", "--ckpt_path", str(missing), "--output_dir", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"superpipe: error: the checkpoint '{missing}' to export does not exist\n"
    assert not (tmp_path / "out").exists()
    # A disk-tier checkpoint whose folder lost a block's file says so, and writes nothing.
    copy = tmp_path / "disk" / runs["disk"]["ckpt"].name
    shutil.copytree(runs["disk"]["ckpt"].parent, copy.parent, ignore=shutil.ignore_patterns("*.export"))
    next(Path(f"{copy}.disk-tier").glob("*/block00001.*.bin")).unlink()
    with pytest.raises(DiskTierError, match=r"block00001\..*\(block 1 of the step committed in .*is missing: the"):
        export_pretrained(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # The callback refuses a module it cannot export when fit starts, and a bad size when it is made.
    with pytest.raises(RecipeError, match="a transformers or peft model, .* got LightningModule holding NoneType"):
        ExportCheckpoints().on_fit_start(pl.Trainer(logger=False), pl.LightningModule())
    with pytest.raises(RecipeError, match="is not a size"):
        ExportCheckpoints(max_shard_size=0)
