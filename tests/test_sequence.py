"""The head and loss in chunks of tokens, and position-wise modules in tiles: equal to the whole sequence's to fp32
rounding, and never holding the whole sequence's logits or MLP intermediates."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from lightning_superpipe.sequence import (
    causal_lm_loss,
    chunk_causal_lm_loss,
    chunked_cross_entropy,
    tile_position_wise,
    unchunk_causal_lm_loss,
    untile_position_wise,
)

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _models():
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**SMALL)),
        "qwen2-tied": Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)),
        "gemma2-softcap": Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=3.0)),
    }


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` of the largest magnitude of its expected value, and the same names."""
    assert actual.keys() == expected.keys() and expected
    for name, value in expected.items():
        scale = value.abs().max().clamp_min(1e-30)
        difference = (actual[name] - value).abs().max()
        assert torch.isfinite(actual[name]).all() and difference <= rtol * scale, (name, difference / scale)


def test_the_comparison_catches_a_wrong_or_missing_or_nan_gradient():
    expected = {"a": torch.ones(3), "b": torch.full((2,), 2.0)}
    for broken in (
        {"a": torch.ones(3), "b": torch.tensor([2.0, 2.001])},
        {"a": torch.ones(3)},
        {"a": torch.tensor([1.0, float("nan"), 1.0]), "b": torch.full((2,), 2.0)},
    ):
        with pytest.raises(AssertionError):
            _assert_close(broken, expected)
    _assert_close({k: v.clone() for k, v in expected.items()}, expected)


def _labels(input_ids: torch.Tensor) -> torch.Tensor:
    labels = input_ids.clone()
    labels[0, :7] = -100  # a prompt without loss
    labels[1, 20:23] = -100
    return labels


@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "gemma2-softcap"])
@pytest.mark.parametrize("num_items", [None, 50])
def test_the_chunked_loss_and_gradients_are_the_models_own(family, num_items):
    model = _models()[family]
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    labels = _labels(input_ids)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected_loss = model(input_ids=input_ids, labels=labels, use_cache=False, **extra).loss
    expected_loss.backward()
    expected = _gradients(model)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, input_ids, labels, chunk_tokens=13, **extra)  # chunks cross the batch's rows
    loss.backward()
    assert torch.allclose(loss, expected_loss, rtol=1e-6, atol=0)
    _assert_close(_gradients(model), expected)


def test_a_lora_head_trains_as_it_does_unchunked():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    model = get_peft_model(_models()["llama"], config)
    for module in model.modules():  # B starts at zero: make the adapters' gradients all non-zero
        if isinstance(module, nn.Linear) and module.weight.shape[1] == 4:
            nn.init.normal_(module.weight, std=0.1)
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    expected = _gradients(model)
    assert any("lm_head.lora_A" in name for name in expected)
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model, input_ids, input_ids, chunk_tokens=8).backward()
    _assert_close(_gradients(model), expected)


def test_no_more_than_one_chunk_of_logits_is_ever_held():
    model = _models()["llama"]
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 64))
    vocab, tokens = SMALL["vocab_size"], input_ids.numel()
    head_rows: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, output: head_rows.append(output.shape[0]))
    saved: list[torch.Size] = []

    def largest_saved_logits(chunked: bool) -> int:
        saved.clear()
        head_rows.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            loss = (
                causal_lm_loss(model, input_ids, input_ids, chunk_tokens=16)
                if chunked
                else model(input_ids=input_ids, labels=input_ids).loss
            )
        loss.backward()
        return max((shape.numel() for shape in saved if shape and shape[-1] == vocab), default=0)

    assert largest_saved_logits(chunked=False) >= tokens * vocab  # the check sees whole logits where they are kept
    assert largest_saved_logits(chunked=True) <= 16 * vocab  # none kept for backward: each chunk is recomputed
    assert head_rows and max(head_rows) == 16 and len(head_rows) == 2 * tokens // 16  # forward, then recomputed


def test_bad_arguments_are_one_clear_error():
    hidden, head = torch.randn(2, 8, 4), nn.Linear(4, 10)
    with pytest.raises(ValueError, match="one of labels= .* or shift_labels="):
        chunked_cross_entropy(hidden, head)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(hidden, head, torch.zeros(2, 8, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 7\) for hidden states of shape \(2, 8, 4\)"):
        chunked_cross_entropy(hidden, head, torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="tile_tokens=0"):
        tile_position_wise(nn.Linear(2, 2), 0)


def test_the_loss_of_aligned_labels_is_transformers_own():
    generator = torch.Generator().manual_seed(3)
    hidden, head = torch.randn(3, 10, 8, generator=generator), nn.Linear(8, 20)
    labels = torch.randint(0, 20, (3, 10), generator=generator)
    expected = ForCausalLMLoss(head(hidden), labels, vocab_size=20)
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    assert torch.allclose(
        chunked_cross_entropy(hidden, head, shift_labels=shifted, chunk_tokens=7), expected, rtol=1e-6, atol=0
    )


def test_tiled_mlps_give_the_whole_sequences_outputs_and_gradients_and_hold_one_tile():
    model = _models()["llama"]
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    keys = list(model.state_dict())
    saved: list[int] = []

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), _gradients(model), max(n for n in saved if n != 2 * 48 * SMALL["vocab_size"])

    expected_loss, expected, whole = step()
    assert tile_position_wise(model, tile_tokens=16) == SMALL["num_hidden_layers"]
    loss, gradients, tiled = step()
    assert torch.allclose(loss, expected_loss, rtol=1e-6, atol=0)
    _assert_close(gradients, expected)
    intermediates = 2 * 48 * SMALL["intermediate_size"]
    assert whole >= intermediates > tiled  # the whole MLP's intermediates were the largest; now none is kept
    assert list(model.state_dict()) == keys
    with torch.no_grad():  # no recomputation to prepare: plain tiles
        assert torch.allclose(model(input_ids=input_ids).logits[0, 0], model(input_ids=input_ids).logits[0, 0])
    assert untile_position_wise(model) == SMALL["num_hidden_layers"]
    assert "forward" not in model.model.layers[0].mlp.__dict__


@pytest.mark.usefixtures("emulated_link")
@pytest.mark.parametrize("activations", ["keep", "offload", "recompute"])
def test_chunked_loss_and_tiled_mlps_train_under_the_strategy_as_plain_lightning_trains_the_whole_model(activations):
    from lightning_superpipe import SuperpipeStrategy
    from lightning_superpipe.streaming import activations as activations_module
    from tests import batches, tasks

    head_rows: list[int] = []
    mlp_positions: list[int] = []

    def make(chunked: bool) -> tasks.Task:
        task = tasks.Task(tasks.llama, "lm")
        if chunked:
            chunk_causal_lm_loss(task.model, chunk_tokens=5)
            tile_position_wise(task.model, tile_tokens=4)
            task.model.lm_head.register_forward_hook(lambda module, args, output: head_rows.append(args[0].shape[0]))
            down = task.model.model.layers[0].mlp.down_proj
            down.register_forward_hook(lambda module, args, output: mlp_positions.append(args[0].shape[-2]))
        return task

    plain = tasks.fit_task(lambda: make(False), "auto", batches.data("lm"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(activations_module, "OFFLOAD_MIN_BYTES", 0)
        strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1, activations=activations)
        streamed = tasks.fit_task(lambda: make(True), strategy, batches.data("lm"))
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    assert head_rows and max(head_rows) == 5 and mlp_positions and max(mlp_positions) == 4  # chunks and tiles ran
    assert unchunk_causal_lm_loss(streamed.model) and not unchunk_causal_lm_loss(streamed.model)


def test_a_chunked_model_returns_the_loss_without_logits_and_runs_whole_without_labels():
    model = _models()["qwen2-tied"]
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(5))
    expected = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    chunk_causal_lm_loss(model, chunk_tokens=6)
    chunked = model(input_ids=input_ids, labels=input_ids)
    assert chunked.logits is None and torch.allclose(chunked.loss, expected.loss, rtol=1e-6, atol=0)
    assert torch.equal(model(input_ids=input_ids, use_cache=False).logits, expected.logits)  # no labels: whole
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunk_causal_lm_loss(model, chunk_tokens=0)
    with pytest.raises(ValueError, match="needs a transformers causal LM .* got Linear"):
        chunk_causal_lm_loss(nn.Linear(2, 2))
    assert unchunk_causal_lm_loss(model) and model(input_ids=input_ids, labels=input_ids).logits is not None


def test_the_recipes_module_takes_chunked_loss_and_tiled_mlps_and_gives_the_whole_computations_loss():
    from lightning_superpipe.recipes import CausalLMModule
    from lightning_superpipe.recipes.errors import RecipeError

    config = {key: value for key, value in SMALL.items() if key != "vocab_size"}
    batch = {"input_ids": torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(6))}
    losses = []
    for chunks in ({}, {"loss_chunk_tokens": 7, "mlp_tile_tokens": 16}):
        torch.manual_seed(0)
        module = CausalLMModule(config=config, vocab_size=96, **chunks)
        losses.append(module._loss(batch)[0])
        losses[-1].backward()
    assert torch.allclose(losses[1], losses[0], rtol=1e-6, atol=0)
    assert unchunk_causal_lm_loss(module.model) and untile_position_wise(module.model) == 2
    for bad in (0, 2.5, True):
        with pytest.raises(RecipeError, match=f"model.loss_chunk_tokens={bad!r} must be a whole number of tokens"):
            CausalLMModule(config=config, vocab_size=96, loss_chunk_tokens=bad)
