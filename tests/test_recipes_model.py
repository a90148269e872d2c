"""The causal-LM LightningModule: building models, LoRA, loss and perplexity, the optimizer, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_superpipe.recipes import (
    CausalLMModule,
    LoRASettings,
    OptimizerSettings,
    QuantizationSettings,
    RecipeError,
    TokenizerError,
)
from lightning_superpipe.recipes.causal_lm import WarmupCosine
from lightning_superpipe.recipes.testing import save_tiny_pretrained

VOCAB = 259
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def tiny(**kwargs: Any) -> CausalLMModule:
    return CausalLMModule(model_type="llama", config=dict(SIZES), vocab_size=VOCAB, **kwargs)


def token_batches(rows: int, seq_len: int = 16, batch_size: int = 2, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(0, 256, (seq_len,), generator=generator)} for _ in range(rows)]
    return DataLoader(samples, batch_size=batch_size)  # type: ignore[arg-type]


def trainer(**kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**settings, **kwargs})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pretrained(tmp_path_factory.mktemp("tiny_llama"))


def test_random_init_takes_the_given_sizes_and_the_tokenizers_vocabulary() -> None:
    module = tiny()
    config = module.model.config
    built = (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size)
    assert built == ("llama", 32, 2, VOCAB)
    assert module.model.get_input_embeddings().num_embeddings == VOCAB
    assert next(module.model.parameters()).dtype == torch.float32
    assert all(p.requires_grad for p in module.parameters())
    assert module.forward(torch.tensor([[1, 2, 3]])).shape == (1, 3, VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {"hiden_size": 32}}, "model.config has keys that the 'llama' configuration does not know: "
         "'hiden_size' (did you mean 'hidden_size'?)"),
        ({"model_type": "lama"}, "model_type 'lama' is not a transformers model type; did you mean 'llama'"),
        ({"model_type": "vit", "config": {}}, "model_type 'vit' has no causal-LM model in transformers"),
        # GPT-2's configuration checks no type under the alias hidden_size, so the text would reach the layers.
        ({"model_type": "gpt2", "config": {"hidden_size": "abc"}},
         "model.config.hidden_size: expected an integer (the default is 768), got 'abc'"),
        # Refused by the model, not its configuration: the key without which it builds is the one named.
        ({"model_type": "gpt2", "config": {"n_embd": 250, "n_head": 4, "n_layer": 1}},
         "model.config.n_embd: `embed_dim` must be divisible by num_heads (got `embed_dim`: 250 and `num_heads`: 4)."),
        ({"config": {**SIZES, "hidden_size": -32}},
         ("model.config.hidden_size: transformers cannot build a 'llama' model with hidden_size=-32 "
          "(RuntimeError: Trying to create tensor with negative dimension -32")),
    ],
)
def test_bad_model_settings_are_refused_with_the_users_words(kwargs: dict[str, Any], message: str) -> None:
    settings = {"model_type": "llama", "config": dict(SIZES), "vocab_size": VOCAB, **kwargs}
    with pytest.raises(RecipeError) as caught:
        CausalLMModule(**settings)
    assert str(caught.value).startswith(message)


def test_pretrained_paths_without_a_model_are_refused(tmp_path: Path, pretrained: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((pretrained / "config.json").read_text())
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text((pretrained / "config.json").read_text())
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not safetensors")
    expected = {
        "missing": "model path '{}' does not exist",
        "weights.bin": "model path '{}' is a file; expected a folder saved with save_pretrained",
        "empty": "model path '{}' holds no model: it has no config.json",
        "config_only": "model path '{}' holds no model weights: no *.safetensors or pytorch_model*.bin files",
        "corrupt": "cannot load a causal LM from '{}': ",
    }
    for name, message in expected.items():
        path = str(tmp_path / name)
        with pytest.raises(RecipeError) as caught:
            CausalLMModule(pretrained_path=path)
        assert str(caught.value).startswith(message.format(path)), str(caught.value)


def test_a_local_pretrained_model_is_loaded_as_saved(pretrained: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    # model_type and config are for random initialisation and must not alter a pretrained model.
    module = CausalLMModule(pretrained_path=str(pretrained), model_type="gpt2", config={"n_layer": 9}, vocab_size=384)
    input_ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        torch.testing.assert_close(module.forward(input_ids), reference(input_ids).logits, rtol=0, atol=0)
    # A tokenizer with more ids than the embedding gets them added when asked, keeping the existing rows.
    grown = CausalLMModule(pretrained_path=str(pretrained), vocab_size=400, resize_token_embeddings=True)
    embedding = grown.model.get_input_embeddings().weight
    assert embedding.shape[0] == 400
    torch.testing.assert_close(embedding[:384], reference.get_input_embeddings().weight, rtol=0, atol=0)


@pytest.mark.parametrize("in_configure_model", [False, True])
def test_a_tokenizer_with_more_ids_than_the_model_embeds_is_refused_before_the_weights_are_read(
    tmp_path: Path, pretrained: Path, in_configure_model: bool
) -> None:
    """Ids past the embedding would index outside it; the error comes from ``config.json``, before any weight is read
    (the folder's weights are corrupt here, which loading would report instead)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((pretrained / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TokenizerError) as caught:
        CausalLMModule(pretrained_path=str(folder), vocab_size=385, build_in_configure_model=in_configure_model)
    assert str(caught.value).startswith(
        f"the tokenizer has 385 token ids but the model in '{folder}' embeds 384: ids past its embeddings"
    )
    # As many ids as rows, or fewer (rows padded for speed), is what pretrained models ship with.
    with pytest.raises(RecipeError, match="cannot load a causal LM from"):
        CausalLMModule(pretrained_path=str(folder), vocab_size=384)


def test_lora_trains_only_the_adapters_and_starts_as_the_base_model() -> None:
    torch.manual_seed(0)
    base = tiny()
    torch.manual_seed(0)
    adapted = tiny(lora=LoRASettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    # One A and one B matrix per adapted projection: 2 projections x 2 layers.
    assert len(trainable) == 8 and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        # LoRA's B matrices start at zero, so the adapted model computes exactly what the base model does.
        torch.testing.assert_close(adapted.forward(input_ids), base.forward(input_ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("target_modules", "message"),
    [
        (["q_prj"], "LoRA target module 'q_prj' is not in the model; modules LoRA can adapt in this model: "
         "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
        (["q_proj", "mlp"], "LoRA target module 'mlp' is a LlamaMLP, which LoRA cannot adapt; modules LoRA can adapt"),
        ("layers\\.9\\..*proj", "LoRA target_modules 'layers\\.9\\..*proj' matches no module name in the model"),
        ([], "LoRA target_modules is an empty list"),
    ],
)
def test_lora_targets_that_are_not_in_the_model_are_refused(target_modules: list[str] | str, message: str) -> None:
    with pytest.raises(RecipeError) as caught:
        tiny(lora=LoRASettings(target_modules=target_modules))
    assert str(caught.value).startswith(message)


def test_lora_accepts_regular_expressions_and_gpt2_style_layers() -> None:
    by_pattern = tiny(lora=LoRASettings(rank=2, target_modules=r".*layers\.1\.self_attn\.(q|k)_proj"))
    assert sum(p.requires_grad for p in by_pattern.parameters()) == 4
    gpt2 = CausalLMModule(
        model_type="gpt2", config={"n_embd": 32, "n_layer": 2, "n_head": 2}, vocab_size=VOCAB,
        lora=LoRASettings(rank=2, target_modules=["c_attn"]),
    )
    assert gpt2.model.peft_config["default"].fan_in_fan_out  # Conv1D stores weights transposed
    assert gpt2.forward(torch.tensor([[1, 2, 3]])).shape == (1, 3, VOCAB)


def test_validation_reports_token_weighted_loss_and_its_exponential_as_perplexity() -> None:
    module = tiny()
    loader = token_batches(rows=5, batch_size=2)  # batches of 2, 2 and 1 rows
    [metrics] = trainer().validate(module, dataloaders=loader, verbose=False)
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            logits = module.forward(batch["input_ids"])
            nll_sum += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1), reduction="sum"
            ).item()
            tokens += batch["input_ids"][:, 1:].numel()
    assert metrics["val/loss"] == pytest.approx(nll_sum / tokens, rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(nll_sum / tokens), rel=1e-5)


def test_warmup_then_cosine_schedule() -> None:
    schedule = WarmupCosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [schedule(step) for step in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(9) == pytest.approx(0.55)  # halfway through the decay
    assert schedule(14) == pytest.approx(0.1) and schedule(20) == pytest.approx(0.1)
    assert WarmupCosine(warmup_steps=0, total_steps=None, min_lr_ratio=0.1)(1000) == 1.0


def test_optimizer_decays_matrices_only_and_follows_the_schedule() -> None:
    module = tiny(optimizer=OptimizerSettings(lr=0.01, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.5))
    fit = trainer(max_steps=4)
    fit.fit(module, train_dataloaders=token_batches(rows=8))
    optimizer = fit.optimizers[0]
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decayed["params"])
    assert not_decayed["weight_decay"] == 0.0 and all(p.ndim == 1 for p in not_decayed["params"])  # norm gains
    assert optimizer.defaults["fused"] is True  # no clipping: the fastest implementation
    # After 4 steps of a 4-step run (2 warm-up), the rate has decayed to lr * min_lr_ratio.
    assert decayed["lr"] == pytest.approx(0.005)
    # The schedule's length is not saved: a run resumed with a larger max_steps decays over its new length.
    assert fit.lr_scheduler_configs[0].scheduler.state_dict()["lr_lambdas"] == [None, None]  # one per group


def test_auto_optimizer_stays_fused_when_the_superpipe_strategy_clips_under_bf16() -> None:
    # No gradient scaler under bf16-mixed: the superpipe strategy lets the fused host AdamW clip.
    fit = trainer(max_steps=2, precision="bf16-mixed", gradient_clip_val=1.0, strategy="superpipe")
    fit.fit(tiny(), train_dataloaders=token_batches(rows=4))
    assert fit.optimizers[0].defaults["fused"] is True


def test_auto_optimizer_can_clip_gradients_under_mixed_precision() -> None:
    # Lightning refuses to clip with an optimizer that unscales gradients itself (fused AdamW) under mixed precision.
    module = tiny()
    fit = trainer(max_steps=2, precision="bf16-mixed", gradient_clip_val=1.0)
    fit.fit(module, train_dataloaders=token_batches(rows=4))
    assert fit.optimizers[0].defaults["foreach"] is False and not fit.optimizers[0].defaults["fused"]
    with pytest.raises(RecipeError, match="'fused' cannot clip gradients .* use 'auto' or 'for-loop'"):
        trainer(max_steps=1, precision="bf16-mixed", gradient_clip_val=1.0).fit(
            tiny(optimizer=OptimizerSettings(implementation="fused")), train_dataloaders=token_batches(rows=2)
        )


def test_lora_checkpoints_of_a_pretrained_model_hold_only_the_adapters(tmp_path: Path, pretrained: Path) -> None:
    lora = LoRASettings(rank=4, target_modules=["q_proj", "v_proj"])
    module = CausalLMModule(
        pretrained_path=str(pretrained), lora=lora, vocab_size=384, optimizer=OptimizerSettings(lr=0.05)
    )
    fit = trainer(max_steps=2)
    fit.fit(module, train_dataloaders=token_batches(rows=4))
    path = tmp_path / "adapters.ckpt"
    fit.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state and all(".lora_A." in key or ".lora_B." in key for key in state)
    assert sum(t.numel() for t in state.values()) == sum(p.numel() for p in module.parameters() if p.requires_grad)

    restored = CausalLMModule.load_from_checkpoint(path)  # base weights from pretrained_path, adapters from the file
    input_ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        torch.testing.assert_close(restored.forward(input_ids), module.forward(input_ids), rtol=0, atol=0)
    # A model built without the adapters must not silently drop them.
    with pytest.raises(RecipeError, match="the checkpoint has 8 weights this model lacks"):
        without_adapters = CausalLMModule(pretrained_path=str(pretrained), vocab_size=384)
        without_adapters.on_load_checkpoint(torch.load(path, weights_only=False))


def test_built_in_configure_model_a_pretrained_model_is_loaded_as_saved(pretrained: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    module = CausalLMModule(pretrained_path=str(pretrained), vocab_size=400, build_in_configure_model=True,
                            resize_token_embeddings=True)
    assert module.model is None  # built where the strategy decides how
    module.configure_model()
    embedding = module.model.get_input_embeddings().weight
    assert embedding.shape[0] == 400 and module.model.training
    torch.testing.assert_close(embedding[:384], reference.get_input_embeddings().weight, rtol=0, atol=0)
    reference_params = dict(reference.named_parameters())
    for name, param in module.model.named_parameters():
        if "embed_tokens" not in name and "lm_head" not in name:  # those two grew
            assert torch.equal(param, reference_params[name]), name
    with pytest.raises(RecipeError, match="model.config has keys .* 'nlayers'"):
        CausalLMModule(model_type="llama", config={"nlayers": 2}, build_in_configure_model=True)


def test_built_in_configure_model_under_the_disk_tier_trains_as_built_in_init(tmp_path: Path, pretrained: Path) -> None:
    """The recipe's module under ``SuperpipeStrategy(offload_device="disk")``: built in ``configure_model`` (each
    block's weights read from the folder as the block is written) it trains as when built by ``from_pretrained``."""
    from lightning_superpipe import SuperpipeStrategy

    runs = []
    for in_blocks in (False, True):
        module = CausalLMModule(pretrained_path=str(pretrained), vocab_size=384, build_in_configure_model=in_blocks)
        pl.seed_everything(0, verbose=False)
        strategy = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path / f"tier-{in_blocks}")
        (tmp_path / f"tier-{in_blocks}").mkdir()
        trainer(strategy=strategy, max_steps=3).fit(module, token_batches(6))
        runs.append(module)
    built, in_blocks = runs
    assert all(torch.equal(p, q) for p, q in zip(built.parameters(), in_blocks.parameters()))
    untrained = CausalLMModule(pretrained_path=str(pretrained), vocab_size=384)
    assert any(not torch.equal(p, q) for p, q in zip(built.parameters(), untrained.parameters()))  # it trained


def test_a_4bit_base_without_adapters_or_without_bitsandbytes_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.quantization`` freezes the base: without ``model.lora`` nothing would train; without bitsandbytes
    the error says what to install. Both before any model is built."""
    quantization = QuantizationSettings()
    with pytest.raises(RecipeError, match="set model.lora to train adapters"):
        CausalLMModule(config=dict(SIZES), vocab_size=VOCAB, quantization=quantization)
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(RecipeError, match=r"pip install 'lightning-superpipe\[qlora\]'"):
        CausalLMModule(config=dict(SIZES), vocab_size=VOCAB, quantization=quantization,
                       lora=LoRASettings(rank=2))


def test_a_pretrained_folder_loads_its_base_in_4_bits_under_the_adapters(tmp_path: Path) -> None:
    """With ``pretrained_path`` the linear layers load as bitsandbytes 4-bit layers (NF4 and FP4), the adapters on
    them are the only trainable weights, and the output layer stays in full precision."""
    pytest.importorskip("bitsandbytes")
    folder = save_tiny_pretrained(tmp_path / "model")
    for quant_type in ("nf4", "fp4"):
        module = CausalLMModule(pretrained_path=str(folder), lora=LoRASettings(rank=2, target_modules=["q_proj"]),
                                quantization=QuantizationSettings(quant_type=quant_type))
        kinds = {type(m).__name__ for m in module.model.modules()}
        assert "Linear4bit" in kinds
        weights = [m.weight for m in module.model.modules() if type(m).__name__ == "Linear4bit"]
        assert all(w.quant_state.quant_type == quant_type for w in weights)
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        assert module.model.get_output_embeddings().weight.dtype == torch.float32
