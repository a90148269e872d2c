"""``quantize_frozen`` on a model built in ``configure_model`` from a saved folder (``load_safetensors``): each frozen
matrix is read and quantized on its own, so host memory never holds the full-precision base.

The reference is plain Lightning training the same model, built the same way (eagerly: plain strategies defer
nothing), with its frozen matrices replaced by bitsandbytes' round trip (:func:`tests.test_quantize_frozen.rounded`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy, load_safetensors
from lightning_superpipe.host_memory import HostMemoryError
from lightning_superpipe.memory.fourbit.frozen4bit import quantized_format
from tests import families, tasks
from tests.test_quantize_frozen import BLOCKS, TARGETS, config, rounded

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


class SavedLoRA(tasks.Task):
    """A LoRA model of the llama saved in ``folder``, built in ``configure_model``: from its config, its weights read
    with ``load_safetensors``, then peft's adapters (``round``: the frozen matrices replaced by their 4-bit round trip,
    for plain Lightning). ``dtype``: what the model is built in."""

    def __init__(self, folder: Path, round: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(lambda: None, "causal_lm", lr=1e-2, schedule=False, loss=families.hf_loss)
        self.folder, self.round, self.build_dtype = folder, round, dtype
        self.frozen_storages: dict[str, int] = {}

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is not None:
            return
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.folder), dtype=self.build_dtype)
        load_safetensors(model, self.folder)
        adapters = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["llama"], lora_dropout=0.1)
        model = get_peft_model(model, adapters).train()
        self.frozen_storages = {name: p.untyped_storage().data_ptr() for name, p in frozen(model)}
        self.model = rounded(model, BLOCKS["llama"]) if self.round else model


def frozen(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The frozen matrices of the decoder layers: what ``quantize_frozen`` quantizes."""
    return [(name, p) for name, p in model.named_parameters()
            if BLOCKS["llama"] in name and not p.requires_grad and p.dim() >= 2]


def save(folder: Path, **sizes: Any) -> Path:
    """A two-layer llama (:func:`tests.test_quantize_frozen.config`) with random weights, saved with
    ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config("llama", **sizes)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("saved"))


def fit(task: SavedLoRA, strategy: Any, steps: int = 3, **overrides: Any) -> SavedLoRA:
    data = families.get("llama").data(2 * steps, tasks.SEED)
    tasks.pl.seed_everything(8, verbose=False)  # configure_model builds (the adapters' draws) under the fit's seed
    tasks.trainer(strategy, max_steps=steps, gradient_clip_val=None, **overrides).fit(task, data)
    return task


def test_each_frozen_matrix_is_quantized_from_values_read_apart_and_trains_as_plain_lightning(
    emulated_link: str, saved: Path
) -> None:
    """Losses and adapters equal plain Lightning's on the round trip, bitwise; every frozen matrix's values were made
    apart from its own memory (its storage never written); after the run the matrices stay in 4 bits and the state
    dict holds their dequantized values, plain's."""
    plain = fit(SavedLoRA(saved, round=True), "auto")
    with tasks.fresh_initial_values() as fresh:
        streamed = fit(SavedLoRA(saved), SuperpipeStrategy(quantize_frozen="nf4"))
    assert len(streamed.losses) == 6 and streamed.losses == plain.losses
    assert tasks.state_differences(streamed, plain) == []
    matrices = frozen(streamed.model)
    assert {f"model.{name}" for name, _ in matrices} == {name for name, made_apart in fresh.items() if made_apart}
    assert all(quantized_format(p) is not None and quantized_format(p).kept for _, p in matrices)
    assert all(p.untyped_storage().nbytes() < p.nbytes for _, p in matrices)  # placeholders: no full copy

    # A later run streams the kept 4-bit matrices as they are: validation's loss is plain's.
    plain_loss = tasks.trainer("auto").validate(plain, families.get("llama").data(2, 5), verbose=False)
    streamed_loss = tasks.trainer(SuperpipeStrategy(quantize_frozen="nf4")).validate(
        streamed, families.get("llama").data(2, 5), verbose=False
    )
    assert streamed_loss == plain_loss


def test_a_set_up_that_fails_gives_the_matrices_the_values_of_the_folder(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the homes fails after the matrices were quantized: the model the user keeps holds the folder's own
    values (not their 4-bit round trip, nor the untouched memory the deferred init left)."""
    from transformers import AutoModelForCausalLM

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no homes today")

    monkeypatch.setattr("lightning_superpipe.run.setup.StreamingEngine", fail)
    task = SavedLoRA(saved)
    with pytest.raises(RuntimeError, match="no homes today"):
        fit(task, SuperpipeStrategy(quantize_frozen="nf4"))
    expected = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    base = task.model.base_model.model
    state = {name.replace(".base_layer", ""): value for name, value in base.state_dict().items() if "lora" not in name}
    assert set(state) == set(expected)
    assert [name for name in expected if not torch.equal(state[name], expected[name])] == []
    assert all(quantized_format(p) is None for _, p in frozen(task.model))


def test_a_16bit_base_under_bf16_true_is_quantized_without_a_cast_reading_it(saved: Path) -> None:
    """``bf16-true`` casts the model (``convert_module``): a model built in bfloat16 needs no cast, so the frozen
    matrices are still quantized from values made apart."""
    with tasks.fresh_initial_values() as fresh:
        streamed = fit(SavedLoRA(saved, dtype=torch.bfloat16), SuperpipeStrategy(quantize_frozen="nf4"), steps=2,
                       precision="bf16-true")
    matrices = frozen(streamed.model)
    assert {f"model.{name}" for name, _ in matrices} <= {name for name, made_apart in fresh.items() if made_apart}
    assert all(torch.isfinite(torch.tensor(loss)) for loss in streamed.losses)


def test_the_host_memory_check_counts_the_base_in_4_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With host memory for half of the full-precision model the run starts (its frozen matrices, 97% of it, need
    about a seventh of their bytes in 4 bits); with a tenth it is refused before anything is allocated, with the
    bytes it needs."""
    from transformers import AutoModelForCausalLM

    saved = save(tmp_path, hidden_size=256, intermediate_size=1024, head_dim=64)
    full = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(saved).parameters())
    monkeypatch.setattr("lightning_superpipe.host_memory.available_host_bytes", lambda: full // 2)
    fit(SavedLoRA(saved), SuperpipeStrategy(quantize_frozen="nf4"), steps=1)
    monkeypatch.setattr("lightning_superpipe.host_memory.available_host_bytes", lambda: full // 10)
    task = SavedLoRA(saved)
    with pytest.raises((HostMemoryError, MisconfigurationException), match=r"needs about .* more host memory"):
        fit(task, SuperpipeStrategy(quantize_frozen="nf4"), steps=1)


def test_under_the_disk_tier_each_block_goes_to_its_file_as_it_is_quantized(
    emulated_link: str, saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``offload_device="disk"`` each block's frozen matrices are written to its read-only file once quantized,
    before the next block's are read (host memory holds one block's 4-bit matrices at a time), and the run trains as
    plain Lightning on the round trip (the host tier's run, :func:`test_each_frozen_matrix_is_quantized_from_values_
    read_apart_and_trains_as_plain_lightning`), bitwise; after it the matrices stay in 4 bits, mapped from their
    files."""
    from lightning_superpipe.memory.disk.frozen import FrozenFiles

    written: list[tuple[int, int]] = []  # (block, 4-bit matrices of the model when it was written)
    write = FrozenFiles.write_block

    def counted(self: FrozenFiles, index: int, params: Any) -> None:
        model = task.model
        written.append((index, sum(quantized_format(p) is not None for _, p in frozen(model))))
        write(self, index, params)

    monkeypatch.setattr(FrozenFiles, "write_block", counted)
    plain = fit(SavedLoRA(saved, round=True), "auto")
    task = SavedLoRA(saved)
    streamed = fit(task, SuperpipeStrategy(quantize_frozen="nf4", offload_device="disk", offload_path=tmp_path))
    assert streamed.losses == plain.losses
    assert tasks.state_differences(streamed, plain) == []
    per_block = len(frozen(streamed.model)) // 2
    assert written == [(0, per_block), (1, 2 * per_block)]
    assert all(quantized_format(p) is not None and quantized_format(p).kept for _, p in frozen(streamed.model))
