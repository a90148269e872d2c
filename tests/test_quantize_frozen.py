"""``SuperpipeStrategy(quantize_frozen="nf4")``: a plain model's frozen matrices kept, streamed and computed with in 4
bits, with no bitsandbytes code in the script.

Exactness is defined against plain Lightning training the same model whose frozen matrices were replaced beforehand
by bitsandbytes' own round trip, ``dequantize_4bit(quantize_4bit(w))``: the values the strategy computes with. The
models' matrices have a last dimension that is a multiple of 64, where bitsandbytes' CPU ``dequantize_4bit`` of a 2-D
shape is right (see :mod:`lightning_superpipe.memory.fourbit.frozen4bit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.fourbit.quantized_layers import QuantizedLayerError
from lightning_superpipe.run.options import KnobError
from tests import families, tasks
from tests.batches import data as tuple_data

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
functional = pytest.importorskip("bitsandbytes.functional")

#: LoRA's targets per architecture: every matrix of a decoder block.
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # transformers' Conv1D
}
#: Sizes whose matrices' last dimensions are multiples of bitsandbytes' block of 64.
SIZES = {
    "llama": dict(hidden_size=64, intermediate_size=128, head_dim=16),
    "qwen2": dict(hidden_size=64, intermediate_size=128, head_dim=16),
    "gpt2": dict(n_embd=64),
}


def config(arch: str, **sizes: Any) -> Any:
    """A tiny config of :data:`tests.families.CAUSAL_LMS`, two layers, with :data:`SIZES` (and ``sizes``)."""
    made = families.CAUSAL_LMS[arch][0](2)
    for name, value in {**SIZES[arch], **sizes}.items():
        setattr(made, name, value)
    return made


def lora(arch: str, **sizes: Any) -> nn.Module:
    """A LoRA model (peft) of a freshly initialized ``arch`` (the caller seeds), in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(arch, **sizes))
    adapters = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], lora_dropout=0.1,
                          fan_in_fan_out=arch == "gpt2")
    return get_peft_model(model, adapters).train()


def round_trip(weight: Tensor, mode: str = "nf4") -> Tensor:
    """bitsandbytes' 4-bit round trip of ``weight``: what the strategy computes with."""
    quant_type, double = mode.removesuffix("-dq"), mode.endswith("-dq")
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=double, quant_type=quant_type)
    return functional.dequantize_4bit(packed, state)


def rounded(model: nn.Module, blocks: str, mode: str = "nf4") -> nn.Module:
    """``model`` with every frozen matrix of the modules under ``blocks`` (the streamed stack's path) replaced by its
    round trip: what plain Lightning trains for the comparison."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if blocks in name and not param.requires_grad and param.dim() >= 2:
                param.copy_(round_trip(param, mode))
    return model


differences = tasks.state_differences
fit_lm = tasks.fit_lm


BLOCKS = {"llama": ".layers.", "qwen2": ".layers.", "gpt2": ".h."}


def test_the_comparison_sees_one_ulp_of_an_adapter_and_of_the_frozen_base() -> None:
    torch.manual_seed(0)
    model = lora("llama")
    other = lora("llama")
    other.load_state_dict(model.state_dict())
    assert differences(model, other) == []
    layer = other.base_model.model.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        for weight in (layer.lora_A.default.weight, layer.base_layer.weight):
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert differences(model, other) == [
        "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight",
    ]


class _StateDictDuringTheRun(tasks.pl.Callback):
    """Takes the model's state dict after a step, while the frozen matrices are 4-bit bytes in the homes."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.state = {key: value.clone() for key, value in pl_module.state_dict().items()}
        self.dequantized_now = trainer.strategy.engine.ledger.held["dequantized_weights"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_lora_on_a_4bit_frozen_base_trains_bitwise_as_plain_lightning_on_its_round_trip(
    emulated_link: str, arch: str
) -> None:
    """Losses, adapters and (after the run, given back) the frozen base equal plain Lightning's run of the model
    whose frozen matrices were rounded beforehand; every frozen matrix of the blocks streamed in 4 bits; a state dict
    taken during the run holds the same values, and no dequantized matrix outlives its block's use."""
    plain = fit_lm(lambda: rounded(lora(arch), BLOCKS[arch]), "auto")
    strategy, during = SuperpipeStrategy(quantize_frozen="nf4"), _StateDictDuringTheRun()
    streamed = fit_lm(lambda: lora(arch), strategy, callbacks=[during])
    assert len(streamed.losses) == len(plain.losses) == 6
    assert streamed.losses == plain.losses
    assert differences(streamed, plain) == []
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in during.state.items())
    assert during.dequantized_now == 0
    report = strategy.memory_report()
    frozen = [p for name, p in streamed.model.named_parameters()
              if BLOCKS[arch] in name and not p.requires_grad and p.dim() >= 2]
    assert report["packed_weight_numel"] == sum(p.numel() for p in frozen)
    assert report["peak_dequantized_weight_bytes"] >= 4 * sum(p.numel() for p in frozen) // 2  # a block, in fp32
    assert report["peak_block_gradient_bytes"] > 0  # the adapters' gradients came back through the strategy


class FrozenMix(nn.Module):
    """A block of no known kind: a frozen matrix used through ``F.linear``, another through ``@``, a trainable
    low-rank pair beside them, a norm."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / 8, requires_grad=False)
        self.v = nn.Parameter(torch.randn(width, width) / 8, requires_grad=False)
        self.a = nn.Parameter(torch.randn(4, width) / 8)
        self.b = nn.Parameter(torch.randn(width, 4) / 8)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return x + torch.tanh(nn.functional.linear(h, self.w) + (h @ self.a.t()) @ self.b.t()) @ self.v


def mixed(width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(12, width), nn.Sequential(*[FrozenMix(width) for _ in range(3)]),
                         nn.Linear(width, 3))


def test_a_custom_module_with_frozen_matrices_trains_in_4bit() -> None:
    """Frozen matrices used through ``F.linear`` and ``@`` are quantized, and train bitwise as plain Lightning's round
    trip (with the double quantization of ``"fp4-dq"``)."""
    def fit(strategy: Any, mode: str = "") -> tasks.Task:
        build = (lambda: rounded(mixed(), "1.", mode)) if mode else mixed
        make = lambda: tasks.Task(build, "vector", lr=1e-2, schedule=False)  # noqa: E731
        return tasks.fit_task(make, strategy, tuple_data("vector", batches=8), max_steps=4, gradient_clip_val=None)

    plain = fit("auto", "fp4-dq")
    strategy = SuperpipeStrategy(quantize_frozen="fp4-dq")
    streamed = fit(strategy)
    assert streamed.losses == plain.losses
    assert differences(streamed, plain) == []
    assert strategy.memory_report()["packed_weight_numel"] == 3 * 2 * 64 * 64
    tasks.pl.seed_everything(tasks.SEED, verbose=False)
    initial = tasks.Task(mixed, "vector")
    assert not torch.equal(streamed.model[1][0].a, initial.model[1][0].a)  # the adapters trained


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_kept_or_offloaded_activations_dequantize_the_matrices_again_in_backward(
    emulated_link: str, activations: str
) -> None:
    """Blocks that keep (or offload) their activations save their dense dequantized matrices as handles, made again
    from the block's 4-bit bytes in backward (the slot holds other blocks meanwhile): bitwise plain Lightning's
    round trip."""
    def fit(strategy: Any, mode: str = "") -> tasks.Task:
        build = (lambda: rounded(mixed(), "1.", mode)) if mode else mixed
        make = lambda: tasks.Task(build, "vector", lr=1e-2, schedule=False)  # noqa: E731
        return tasks.fit_task(make, strategy, tuple_data("vector", batches=4), max_steps=2, gradient_clip_val=None)

    plain = fit("auto", "nf4")
    strategy = SuperpipeStrategy(quantize_frozen="nf4", activations=activations, resident_blocks=0, prefetch=1)
    streamed = fit(strategy)
    assert streamed.losses == plain.losses
    assert differences(streamed, plain) == []
    report = strategy.memory_report()
    assert report["peak_activation_bytes"] > 0 or report["host_activation_bytes"] > 0


def _block_bf16_bytes(block: nn.Module) -> int:
    return sum(2 * p.numel() for p in block.parameters())


@pytest.mark.parametrize(("mode", "bound", "offload_device"),
                         [("nf4-dq", 0.3, "cpu"), ("nf4", 0.32, "cpu"), ("nf4-dq", 0.3, "disk")])
def test_the_4bit_base_takes_three_tenths_of_its_bf16_bytes(
    mode: str, bound: float, offload_device: str, tmp_path: Path
) -> None:
    """The frozen base's bytes in the homes (also what of it crosses the link per copy of each block; on the disk
    tier, in its files) and a block's streamed bytes, against bfloat16: at most 0.3x with double quantization (4.13
    bits per weight, alignment, and the block's fp32 adapters and norms)."""
    sizes = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    torch.manual_seed(0)
    model = lora("llama", **sizes)
    layers = model.base_model.model.model.layers
    block_bf16 = max(_block_bf16_bytes(layer) for layer in layers)
    tier = dict(offload_device="disk", offload_path=tmp_path) if offload_device == "disk" else {}
    strategy = SuperpipeStrategy(quantize_frozen=mode, resident_blocks=0, prefetch=1, **tier)
    tasks.fit_task(lambda: tasks.Task(lambda: model, "causal_lm", lr=1e-3, loss=families.hf_loss), strategy,
                   families.get("llama").data(1, 0), max_steps=1, accumulate_grad_batches=1, gradient_clip_val=None)
    report = strategy.memory_report()
    base_ratio = report["packed_weight_bytes"] / (2 * report["packed_weight_numel"])
    block_ratio = report["largest_block_bytes"] / block_bf16
    host_ratio = report["host_bytes"] / sum(_block_bf16_bytes(layer) for layer in layers)
    print(f"{mode}: base {base_ratio:.4f}, block {block_ratio:.4f}, host {host_ratio:.4f} of bf16")
    assert base_ratio <= (0.265 if mode == "nf4-dq" else 0.285)
    assert block_ratio <= bound
    if offload_device == "disk":  # in its files; in host memory a staging buffer per device slot and one more
        assert report["frozen_disk_bytes"] == report["packed_weight_bytes"]
        assert report["frozen_staging_host_bytes"] <= 3 * report["packed_weight_bytes"] / len(layers)
    else:
        assert host_ratio <= bound
    assert report["peak_dequantized_weight_bytes"] == 4 * report["packed_weight_numel"] // len(layers)


def test_the_loss_is_within_half_a_percent_of_bitsandbytes_qlora(tmp_path: Path) -> None:
    """The same weights, LoRA-trained the same steps: as a ``BitsAndBytesConfig(load_in_4bit=True, nf4)`` QLoRA model
    (item 1) and as a full-precision model under ``quantize_frozen="nf4"``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config("llama")).save_pretrained(tmp_path)

    def build(quantization: Any = None) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map="cpu",
                                                     dtype=torch.float32)
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["llama"])).train()

    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    qlora = fit_lm(lambda: build(four_bit), "auto", steps=4)
    knob = fit_lm(build, SuperpipeStrategy(quantize_frozen="nf4"), steps=4)
    last = lambda task: sum(task.losses[-2:]) / 2  # noqa: E731
    assert abs(last(knob) - last(qlora)) <= 0.005 * last(qlora), (knob.losses, qlora.losses)


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
def test_a_checkpoint_resumes_as_the_uninterrupted_run(tmp_path: Path, offload_device: str) -> None:
    """A ``.ckpt`` of the first epoch holds the adapters' optimizer state and, on the host tier, the frozen base's
    dequantized values (plain Lightning's checkpoint of the rounded model); on the disk tier none of the base (it is
    no trainable state: the resumed run quantizes the model's values into its files again). ``fit(ckpt_path=...)``
    continues as the run never stopped (the values quantize to themselves). One written after ``fit`` holds the same
    values."""
    def make() -> tasks.Task:
        return tasks.Task(lambda: lora("qwen2"), "causal_lm", lr=1e-2, schedule=False, loss=families.hf_loss)

    tier = dict(offload_device="disk", offload_path=tmp_path / "tier") if offload_device == "disk" else {}
    (tmp_path / "tier").mkdir()
    runs = tasks.resume_after_an_epoch(make, lambda: SuperpipeStrategy(quantize_frozen="nf4", **tier), tmp_path,
                                       blocks_in_files=bool(tier))
    state = runs["checkpoint"]["state_dict"]
    assert all(torch.isfinite(value).all() for value in state.values())
    frozen = [name for name, p in runs["first"].named_parameters() if ".layers." in name and not p.requires_grad
              and p.dim() >= 2]
    assert all((name in state) is (offload_device == "cpu") for name in frozen)
    assert runs["resumed"].losses == runs["whole"].losses[4:]
    assert differences(runs["resumed"], runs["whole"]) == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(quantize_frozen="int4"), r"quantize_frozen='int4'\) must be 'nf4', 'nf4-dq', 'fp4' or 'fp4-dq'"),
    ],
)
def test_bad_values_fail_where_the_strategy_is_made(options: dict[str, Any], match: str) -> None:
    with pytest.raises(KnobError, match=match):
        SuperpipeStrategy(**options)


def test_without_bitsandbytes_the_knob_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_superpipe.run.options.bitsandbytes_installed", lambda: False)
    with pytest.raises(KnobError, match=r"pip install bitsandbytes"):
        SuperpipeStrategy(quantize_frozen="nf4")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(memory_budget="1GB"), r"memory_budget='1GB'\).*Pin the activations: `activations='recompute'`"),
    ],
)
def test_what_the_knob_does_not_support_is_refused_with_the_model_untouched(
    options: dict[str, Any], match: str
) -> None:
    torch.manual_seed(0)
    model = mixed()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(QuantizedLayerError, match=match):
        tasks.fit_task(lambda: tasks.Task(lambda: model, "vector"), SuperpipeStrategy(quantize_frozen="nf4", **options),
                       tuple_data("vector", batches=2), max_steps=1)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_a_model_in_4bit_already_is_told_the_knob_is_not_needed() -> None:
    torch.manual_seed(0)
    model = mixed()
    model[1][1].extra = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    match = r"4-bit weights already \(`model\.1\.1\.extra\.weight`\).*leave it out"
    with pytest.raises(QuantizedLayerError, match=match):
        tasks.fit_task(lambda: tasks.Task(lambda: model, "vector"), SuperpipeStrategy(quantize_frozen="nf4"),
                       tuple_data("vector", batches=2), max_steps=1)


class _Meddles(tasks.pl.Callback):
    """During the run, loads a state dict holding a quantized matrix, or unfreezes one."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.how == "load":
            pl_module.load_state_dict(pl_module.state_dict())
        else:
            pl_module.model[1][0].w.requires_grad_(True)


@pytest.mark.parametrize(
    ("how", "match"),
    [("load", r"`load_state_dict` was given `model\.1\.0\.w`, a frozen matrix"), ("unfreeze", r"require gradients")],
)
def test_a_quantized_matrix_cannot_be_loaded_or_unfrozen_during_the_run(how: str, match: str) -> None:
    """Its 4-bit bytes stream, not its storage: one clear error, and the model gets its values back."""
    torch.manual_seed(0)
    model = mixed()
    with pytest.raises(RuntimeError, match=match):
        tasks.fit_task(lambda: tasks.Task(lambda: model, "vector"), SuperpipeStrategy(quantize_frozen="nf4"),
                       tuple_data("vector", batches=4), max_steps=2, callbacks=[_Meddles(how)])
    assert torch.equal(model[1][0].v, round_trip(model[1][0].v.detach().clone()))  # given back, rounded


def test_under_bf16_mixed_the_matrices_are_dequantized_into_bfloat16() -> None:
    """The dense matrices are made in the dtype the blocks compute in (one block's at a time, counted), and the
    parameters get their values back in their own fp32; the first step is plain Lightning's on the round trip."""
    plain = fit_lm(lambda: rounded(lora("llama"), BLOCKS["llama"]), "auto", steps=2, precision="bf16-mixed")
    strategy = SuperpipeStrategy(quantize_frozen="nf4")
    streamed = fit_lm(lambda: lora("llama"), strategy, steps=2, precision="bf16-mixed")
    assert streamed.losses[:2] == plain.losses[:2]
    assert streamed.losses == pytest.approx(plain.losses, rel=1e-3)
    report = strategy.memory_report()
    assert report["peak_dequantized_weight_bytes"] == 2 * report["packed_weight_numel"] // 2  # bf16, one of 2 blocks
    frozen = streamed.model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    assert frozen.dtype == torch.float32 and torch.isfinite(frozen).all()


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4-dq"])
def test_quantizing_a_piece_at_a_time_gives_bitsandbytes_codes_and_state(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matrix larger than the piece (and not a multiple of it) is quantized into the codes, scales and nested
    state bitsandbytes' own ``quantize_4bit`` gives the whole of it; a changed value shows."""
    from lightning_superpipe.memory.fourbit import frozen4bit

    monkeypatch.setattr(frozen4bit, "CHUNK", 64 * 16)
    quant_type, double = frozen4bit.MODES[mode]
    values = torch.randn(64 * 16 * 5 + 64 * 3, dtype=torch.bfloat16)

    def parts(data: Tensor, state: Any) -> list[Tensor]:
        return [data, *(t for t in state.as_dict(packed=True).values() if isinstance(t, Tensor))]

    expected = parts(*functional.quantize_4bit(values, blocksize=64, compress_statistics=double,
                                               quant_type=quant_type))
    assert all(torch.equal(a, b) for a, b in zip(parts(*frozen4bit.quantize_4bit(values, quant_type, double)),
                                                 expected, strict=True))
    values[64 * 16 * 3] += 1.0
    changed = parts(*frozen4bit.quantize_4bit(values, quant_type, double))
    assert not all(torch.equal(a, b) for a, b in zip(changed, expected, strict=True))
