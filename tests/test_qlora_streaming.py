"""QLoRA streamed: a 4-bit bitsandbytes base with peft's LoRA on it trains through the strategy as plain Lightning
trains it (bitwise on the CPU, where both run bitsandbytes' same kernels), its blocks crossing the link in their
4-bit form.

The models are built as a QLoRA script builds them: a tiny ``transformers`` model saved to a folder, loaded back with
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...), device_map="cpu")``, optionally
``prepare_model_for_kbit_training``, then ``get_peft_model``.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from lightning_superpipe.memory.fourbit.quantized_layers import QuantizedLayerError
from tests import families, tasks

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

#: Every linear layer of a decoder block: LoRA on all of them, as QLoRA does.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Saves a tiny model of a :data:`tests.families.CAUSAL_LMS` architecture once per module (same seed, same
    weights) and returns its folder."""
    folders: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def folder(arch: str, **sizes: Any) -> Path:
        key = (arch, tuple(sorted(sizes.items())))
        if key not in folders:
            from transformers import AutoModelForCausalLM

            config = families.CAUSAL_LMS[arch][0](2)
            for name, value in sizes.items():
                setattr(config, name, value)
            torch.manual_seed(0)
            folders[key] = tmp_path_factory.mktemp(arch)
            AutoModelForCausalLM.from_config(config).save_pretrained(folders[key])
        return folders[key]

    return folder


def qlora(folder: Path, quant_type: str = "nf4", double_quant: bool = False, prepare: bool = False,
          lora_dropout: float = 0.1, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The QLoRA model of the checkpoint in ``folder``, in training mode (as a training script puts it); with a bf16
    ``compute_dtype`` loaded in bf16, as the usual QLoRA recipe loads it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                      bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu",
                                                 dtype=compute_dtype)
    if prepare:
        model = prepare_model_for_kbit_training(model)  # gradient checkpointing on, as by default
    torch.manual_seed(0)  # LoRA's A matrices are drawn (loading draws too, as many times as it likes)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=lora_dropout))
    return model.train()


fit_qlora = tasks.fit_lm
differences = tasks.state_differences


def test_the_comparison_sees_one_ulp_and_one_4bit_code(saved: Callable[..., Path]) -> None:
    """The helper the exactness test trusts can fail: one LoRA weight moved by one ulp, one packed 4-bit byte
    changed."""
    model, other = qlora(saved("llama")), qlora(saved("llama"))
    assert differences(model, other) == []
    layer = other.base_model.model.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        weight = layer.lora_A.default.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
        layer.base_layer.weight.data[3, 0] ^= 1
    assert differences(model, other) == [
        "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight",
    ]


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing but its own presence, as the emulated link's happens-before checker."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("arch", "quant_type", "double_quant", "prepare", "precision", "lora_dropout"),
    [
        ("llama", "nf4", False, True, "32-true", 0.1),
        ("qwen2", "fp4", True, False, "32-true", 0.1),
        ("gemma", "nf4", True, False, "32-true", 0.1),
        ("llama", "fp4", False, False, "32-true", 0.1),
        # The usual recipe: loaded in bf16, computing in bf16, prepared. On a CPU, peft casts a LoRA layer's input to
        # its adapter's dtype where it sees no CUDA autocast: streamed in bf16, the adapter makes dropout run on bf16
        # inputs, plain on fp32 ones (last bits differ). Without dropout both compute the same; on CUDA peft sees
        # autocast and casts nothing.
        ("qwen2", "nf4", True, True, "bf16-mixed", 0.0),
        ("gemma", "nf4", False, False, "bf16-true", 0.1),
    ],
)
def test_qlora_trains_bitwise_as_plain_lightning(
    saved: Callable[..., Path], emulated_link: str, arch: str, quant_type: str, double_quant: bool, prepare: bool,
    precision: str, lora_dropout: float,
) -> None:
    """Losses, LoRA weights and the untouched 4-bit base equal plain Lightning's, bit for bit; the 4-bit weights
    stream (the report counts them) and the blocks' gradients come back through the strategy. With
    ``prepare_model_for_kbit_training`` the layers' own gradient checkpointing is on in plain Lightning; the strategy
    turns it off while it streams them (it checkpoints the blocks itself) and back on after.

    Under CPU autocast, any Python dispatch mode (the emulated link's checker is one) changes what bitsandbytes'
    4-bit kernels compute in the last bits, plain Lightning included: plain runs under one there too."""
    compute_dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    build = lambda: qlora(saved(arch), quant_type, double_quant, prepare, lora_dropout, compute_dtype)  # noqa: E731
    like_the_checker = emulated_link != "cpu" and precision == "bf16-mixed"
    with _PassThrough() if like_the_checker else nullcontext():
        plain = fit_qlora(build, "auto", precision=precision)
    strategy = SuperpipeStrategy()
    streamed = fit_qlora(build, strategy, precision=precision)
    assert len(streamed.losses) == len(plain.losses) == 6
    assert streamed.losses == plain.losses
    differ = differences(streamed, plain)
    # bitsandbytes casts a 4-bit layer's bias to its compute dtype in place, on the tensor it is handed: plain's frozen
    # host biases change dtype (rounded to bf16 under bf16-mixed, widened to fp32 under bf16-true); the strategy
    # hands the layers device copies, and its host biases stay as they were.
    plain_state, streamed_state = plain.state_dict(), streamed.state_dict()
    recast = [key for key in differ if key.endswith(".bias") and plain_state[key].dtype != streamed_state[key].dtype]
    assert all(torch.equal(streamed_state[key].to(plain_state[key].dtype), plain_state[key]) for key in recast)
    differ = [key for key in differ if key not in recast]
    assert differ == []
    # Training moved the adapters (so the comparison compared something) and left the 4-bit base as it was.
    tasks.pl.seed_everything(tasks.SEED, verbose=False)
    initial = build().to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    moved = differences(streamed.model, initial)
    assert moved and all("lora_" in key for key in moved), moved
    decoder_layers = streamed.model.base_model.model.model.layers
    assert all(layer.gradient_checkpointing is prepare for layer in decoder_layers)
    report = strategy.memory_report()
    # The blocks' gradients came back through the strategy (not through a recomputation that bypassed it).
    assert report["peak_block_gradient_bytes"] > 0
    layers = [module for module in streamed.modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert report["packed_weight_numel"] == sum(layer.weight.quant_state.shape.numel() for layer in layers)


def _block_bf16_bytes(block: nn.Module) -> int:
    """What the block's parameters would take in bf16 (a 4-bit weight counted as its unpacked matrix)."""
    total = 0
    for param in block.parameters():
        state = getattr(param, "quant_state", None)
        total += 2 * (state.shape.numel() if state is not None else param.numel())
    return total


class _SlotBytes(tasks.pl.Callback):
    """Reads the ledger's block weights (the device slots) during the step."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.block_weight_bytes = trainer.strategy.engine.ledger.peaks["block_weights"]


@pytest.mark.parametrize(
    ("quant_type", "double_quant", "bound", "weights_bound"), [("nf4", True, 0.3, 0.265), ("fp4", False, 0.32, 0.285)]
)
def test_a_4bit_block_streams_at_most_three_tenths_of_its_bf16_bytes(
    saved: Callable[..., Path], quant_type: str, double_quant: bool, bound: float, weights_bound: float
) -> None:
    """The report's largest block (what one copy of it moves) and the ledger's slots: at most 0.3x of the block in
    bf16 (4-bit codes, their scales, fp32 LoRA adapters and norms, alignment) with double quantization. Without it
    the scales take 0.5 bits per weight more: the 4-bit weights alone are 0.28x of bf16, and rank-4 fp32 adapters
    on every matrix of this 512-wide block add 0.03x."""
    folder = saved("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64)
    model = qlora(folder, quant_type, double_quant, lora_dropout=0.0)
    decoder_layers = model.base_model.model.model.layers
    block_bf16 = max(_block_bf16_bytes(layer) for layer in decoder_layers)
    slots = _SlotBytes()
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    tasks.fit_task(lambda: tasks.Task(lambda: model, "causal_lm", lr=1e-3, loss=families.hf_loss), strategy,
                   families.get("llama").data(1, 0), max_steps=1, accumulate_grad_batches=1,
                   gradient_clip_val=None, callbacks=[slots])
    report = strategy.memory_report()
    largest = report["largest_block_bytes"]
    assert largest <= bound * block_bf16, (largest, block_bf16)
    assert slots.block_weight_bytes == 2 * largest  # two slots of the largest block, nothing dequantized beside
    assert report["peak_device_bytes"] >= 2 * largest + report["trunk_device_bytes"]
    # The 4-bit weights themselves (codes, scales, codebooks): 4.125 or 4.5 bits per weight, and alignment.
    assert report["packed_weight_bytes"] <= weights_bound * 2 * report["packed_weight_numel"]
    # In host memory too: the blocks' homes (what the engine allocated on the host, a CPU device pins nothing), and
    # each 4-bit weight and its scales moved into its block's home, not held a second time.
    assert report["host_bytes"] <= bound * sum(_block_bf16_bytes(layer) for layer in decoder_layers) + 2 * 4096
    for layer in decoder_layers:
        linears = [module for module in layer.modules() if isinstance(module, bnb.nn.Linear4bit)]
        tensors = [t for linear in linears for t in (linear.weight, linear.weight.quant_state.absmax)]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_other_quantized_layers_stay_refused_beside_4bit_ones(saved: Callable[..., Path]) -> None:
    """An 8-bit layer in a QLoRA model is named with what to do; nothing is allocated."""
    model = qlora(saved("llama"))
    attention = model.base_model.model.model.layers[0].self_attn
    attention.extra = bnb.nn.Linear8bitLt(32, 32, bias=False, has_fp16_weights=False).to("cpu")
    with pytest.raises(QuantizedLayerError, match=r"self_attn\.extra`, a bitsandbytes layer .*Linear8bitLt.*streams"
                                                  r" the 4-bit ones"):
        fit_qlora(lambda: model, SuperpipeStrategy(), steps=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(activations="keep"), r"activations='keep'.*block 0 would keep its activations"),
        (dict(memory_budget="1GB"), r"memory_budget='1GB'.*activations='recompute'"),
    ],
)
def test_knobs_4bit_blocks_do_not_support_are_refused(
    saved: Callable[..., Path], options: dict[str, Any], match: str
) -> None:
    model = qlora(saved("llama"))
    with pytest.raises(QuantizedLayerError, match=match):
        fit_qlora(lambda: model, SuperpipeStrategy(**options), steps=1)


def test_the_disk_tier_streams_4bit_blocks_bitwise_as_the_host_tier(
    saved: Callable[..., Path], emulated_link: str, tmp_path: Path
) -> None:
    """The 4-bit base (double quantization: its nested state too) in the disk tier's read-only files, written once,
    never by a step (their bytes and times stay), the adapters and norms in its records, cast to bf16 on the way:
    losses and weights equal the host tier's bit for bit; the files hold the 4-bit weights' regions and no more, and
    host memory a staging buffer of them per device slot and one more. (0.3x of bf16: the wide-model test of
    ``test_quantize_frozen``.)"""
    precision = "bf16-mixed"
    build = lambda: qlora(saved("qwen2"), "nf4", True, lora_dropout=0.0, compute_dtype=torch.bfloat16)  # noqa: E731
    host = fit_qlora(build, SuperpipeStrategy(), precision=precision)
    written: dict[str, tuple[int, bytes]] = {}

    class Files(tasks.pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            for path in sorted(tmp_path.glob("frozen*.bin")):
                seen = (path.stat().st_mtime_ns, path.read_bytes())
                assert written.setdefault(path.name, seen) == seen  # never written again

    strategy = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path)
    disk = fit_qlora(build, strategy, precision=precision, callbacks=[Files()])
    assert disk.losses == host.losses
    assert differences(disk, host) == []
    report = strategy.memory_report()
    assert len(written) == 2 and all((tmp_path / name).stat().st_mode & 0o222 == 0 for name in written)
    assert report["frozen_disk_bytes"] == report["packed_weight_bytes"] > 0  # the 4-bit weights' regions, no more
    layers = [module for module in disk.modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert report["packed_weight_numel"] == sum(layer.weight.quant_state.shape.numel() for layer in layers)
    assert report["frozen_disk_bytes_read"] > 0 and report["frozen_staging_host_bytes"] <= 3 * report[
        "frozen_disk_bytes"] / 2


def test_a_4bit_layer_outside_the_blocks_is_refused(saved: Callable[..., Path]) -> None:
    """A 4-bit head (outside the streamed blocks) would lose its quantization state as a resident copy."""
    model = qlora(saved("llama"))
    head = model.base_model.model.lm_head
    quantized = bnb.nn.Linear4bit(head.in_features, head.out_features, bias=False, quant_type="nf4",
                                  compute_dtype=torch.float32)
    quantized.load_state_dict(head.state_dict())
    model.base_model.model.lm_head = quantized.to("cpu")
    with pytest.raises(QuantizedLayerError, match=r"`model\.base_model\.model\.lm_head`, a bitsandbytes layer.*"
                                                  r"outside the streamed blocks"):
        fit_qlora(lambda: model, SuperpipeStrategy(), steps=1)


def test_a_checkpoint_resumes_as_the_uninterrupted_run(saved: Callable[..., Path], tmp_path: Path) -> None:
    """A ``.ckpt`` written at the end of a first epoch carries the adapters and their optimizer state only (the frozen
    4-bit base is no trainable state), and ``fit(ckpt_path=...)`` continues as the run that was never stopped; one
    written after ``fit`` (the 4-bit tensors still views of their homes) saves too. The task loads non-strictly:
    torch's strict load does not know bitsandbytes' quantization-state keys, in plain Lightning neither."""
    build = lambda: qlora(saved("qwen2"), "nf4", True, prepare=True)  # noqa: E731

    def make() -> tasks.Task:
        task = tasks.Task(build, "causal_lm", lr=1e-2, schedule=False, loss=families.hf_loss)
        task.strict_loading = False
        return task

    runs = tasks.resume_after_an_epoch(make, SuperpipeStrategy, tmp_path)
    assert runs["resumed"].losses == runs["whole"].losses[4:]
    assert differences(runs["resumed"], runs["whole"]) == []


def test_the_disk_tiers_4bit_files_are_read_ahead_and_a_failed_read_raises_from_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_ahead`` starts reading the blocks' frozen files on a thread of their own, nearest first, into the
    staging buffers no other read holds (one per device slot and one more); the copy of a block uses its read (the
    file's bytes), and a read that failed raises its ``DiskTierError`` from the copy."""
    import threading

    from lightning_superpipe.memory.disk import frozen as disk_frozen
    from lightning_superpipe.memory.disk.errors import DiskTierError
    from lightning_superpipe.memory.pinned import HostArena
    from lightning_superpipe.streaming.copier import Copier

    readers: list[tuple[int, str]] = []
    read = disk_frozen._read

    def watched(path: Path, buffer: torch.Tensor, nbytes: int) -> None:
        readers.append((int(path.stem[len("frozen"):]), threading.current_thread().name))
        read(path, buffer, nbytes)

    monkeypatch.setattr(disk_frozen, "_read", watched)
    blocks = [bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4").to("cpu") for _ in range(4)]
    files = disk_frozen.FrozenFiles(tmp_path, itemsize=2)
    files.write_missing([list(block.parameters()) for block in blocks])
    files.attach(Copier(torch.device("cpu")), HostArena(pin=False), slots=1)  # two staging buffers
    dst = torch.zeros(files.numel(0), dtype=torch.int16)
    try:
        files.read_ahead([0, 1, 2, 3])
        assert files.reads_ahead == 2  # as many as buffers
        files.copy_in(dst, 0, None, "block 0")
        assert dst.view(torch.uint8).tolist() == list((tmp_path / disk_frozen.frozen_name(0)).read_bytes())
        files.read_ahead([1, 2, 3])  # block 1's read goes on; block 2's takes the buffer block 0's copy left
        files.copy_in(dst, 1, None, "block 1")
        files.copy_in(dst, 2, None, "block 2")
        assert dst.view(torch.uint8).tolist() == list((tmp_path / disk_frozen.frozen_name(2)).read_bytes())
        assert files.reads_ahead == 3 and [block for block, _ in readers] == [0, 1, 2]
        assert all(name.startswith("superpipe-frozen-reads") for _, name in readers)  # none on the copying thread
        (tmp_path / disk_frozen.frozen_name(3)).unlink()
        files.read_ahead([3])
        with pytest.raises(DiskTierError, match="frozen 4-bit weights .* are missing"):
            files.copy_in(dst, 3, None, "block 3")
        assert files.memory_report()["frozen_disk_reads_ahead"] == 4
    finally:
        files.close()
