"""Quantized layers the strategy cannot stream: one error naming the layer and what to do, before anything is
allocated, and the model left as it was. (bitsandbytes 4-bit layers inside the streamed blocks stream: see
``test_qlora_streaming.py``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_superpipe  # noqa: F401
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.fourbit.quantized_layers import QuantizedLayerError, check_quantized_layers
from lightning_superpipe.streaming.blocks import assign_parameters, find_blocks
from tests import tasks

bnb = pytest.importorskip("bitsandbytes")


def _untouched(task: tasks.Task) -> dict[str, tuple[Any, torch.Tensor]]:
    """Where each parameter lives (for plain parameters: a quantized layer's own class may copy itself when Lightning
    moves the model), its class, and its values."""
    return {name: ((p.data_ptr() if type(p) is nn.Parameter else None, type(p)), p.detach().clone())
            for name, p in task.named_parameters()}


def _refused(task: tasks.Task, match: str) -> None:
    """Fitting ``task`` under the strategy fails with ``match`` in one error, and leaves every parameter where, of
    the class and what it was (nothing was re-homed)."""
    before = _untouched(task)
    with pytest.raises(MisconfigurationException, match=match) as raised:
        tasks.trainer(SuperpipeStrategy(), max_steps=1).fit(task, tasks.data(task.kind))
    assert isinstance(raised.value, QuantizedLayerError)
    after = _untouched(task)
    assert after.keys() == before.keys()
    for name, (pointer, value) in before.items():
        assert after[name][0] == pointer and torch.equal(after[name][1], value), name


def _llama() -> tasks.Task:
    return tasks.build_task("llama")


def test_a_bitsandbytes_8bit_layer_in_a_block_is_named_with_what_to_do() -> None:
    task = _llama()
    layer = task.model.model.layers[1].self_attn
    old = layer.q_proj
    layer.q_proj = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=False, has_fp16_weights=False).to("cpu")
    _refused(task, r"cannot stream `model\.model\.layers\.1\.self_attn\.q_proj`, a bitsandbytes layer"
                   r" \(bitsandbytes\.nn\.modules\.Linear8bitLt: its `weight` is a Int8Params\)\..*streams the"
                   r" 4-bit ones.*load the model without `quantization_config`")


def test_a_4bit_qlora_model_passes_when_its_blocks_stream_its_4bit_weights(tmp_path: Path) -> None:
    """``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` and peft's LoRA on it, as a
    QLoRA script writes it: its 4-bit layers pass where their weights stream with the blocks; where they would not
    (here: nothing streams), one error names a 4-bit layer and why (not a dtype ``TypeError`` from inside)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tasks.build_task("llama").model.save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    try:
        base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu")
    except Exception as error:  # noqa: BLE001 - transformers' own refusal of 4-bit loading on a machine
        pytest.skip(f"transformers does not load a 4-bit model here: {error}")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    block_params, _ = assign_parameters(model, find_blocks(model, None))
    check_quantized_layers(model, block_params)
    with pytest.raises(QuantizedLayerError, match=r"a bitsandbytes layer .*Linear4bit: its `weight` is a Params4bit"
                                                  r"\) \(and \d+ more such layers\)\..*outside the streamed blocks"):
        check_quantized_layers(model, [])


class _FakeGPTQLinear(nn.Module):
    """A layer as GPTQ packages define it: packed int32 weights and scales in buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(8, 32, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(1, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


_FakeGPTQLinear.__module__ = "auto_gptq.nn_modules.qlinear.qlinear_cuda"


def test_a_gptq_layer_and_an_integer_parameter_are_named() -> None:
    task = _llama()
    task.model.model.layers[0].mlp.extra = _FakeGPTQLinear()
    _refused(task, r"`model\.model\.layers\.0\.mlp\.extra`, a GPTQ \(auto-gptq\) layer .*its `qweight` holds"
                   r" torch\.int32 values\)\..*Load the model without quantization")
    task = _llama()
    packed = task.model.model.layers[0].mlp.down_proj
    packed.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.uint8), requires_grad=False)
    _refused(task, r"`model\.model\.layers\.0\.mlp\.down_proj`, a a quantized layer|its parameter `weight` holds"
                   r" torch\.uint8 values")


def test_ordinary_layers_of_those_packages_and_integer_buffers_pass() -> None:
    """bitsandbytes' float embeddings, integer buffers of ordinary modules (position ids, counters) and a boolean
    mask are not quantized weights: no error, and the check can still fail on the same model (a control)."""
    model = nn.Sequential(bnb.nn.StableEmbedding(16, 8), nn.BatchNorm1d(8))
    model.register_buffer("position_ids", torch.arange(16))
    model.register_buffer("mask", torch.ones(4, dtype=torch.bool))
    check_quantized_layers(model, [])
    model.append(bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=False))
    with pytest.raises(QuantizedLayerError, match=r"`2`, a bitsandbytes layer"):
        check_quantized_layers(model, [])


def test_the_refused_model_then_trains_under_plain_lightning() -> None:
    """Nothing was lost: after the refusal the same (unquantized) model trains as it would have."""
    task = _llama()
    task.model.model.layers[0].mlp.extra = _FakeGPTQLinear()
    with pytest.raises(QuantizedLayerError):
        tasks.trainer(SuperpipeStrategy(), max_steps=1).fit(task, tasks.data(task.kind))
    del task.model.model.layers[0].mlp.extra
    trained: Any = tasks.trainer("auto", max_steps=2)
    trained.fit(task, tasks.data(task.kind))
    assert trained.global_step == 2
