"""The class, not the example: every model family ``tests/families.py`` builds, with its default config (the KV
cache on, sdpa or eager attention, padding masks, dropout), trains through the strategy exactly as plain
Lightning trains it in fp32."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import lightning_superpipe  # noqa: F401  (registers "superpipe")
from lightning_superpipe import SuperpipeStrategy
from tests import batches, families, tasks

# Every test here runs on the plain CPU link and on the emulated asynchronous link in both modes.
pytestmark = pytest.mark.usefixtures("emulated_link")


def _plain_and_streamed(name: str, **options: Any) -> tuple[tasks.Finished, tasks.Task]:
    plain = tasks.plain_fit_family(name, **options)  # once for the three links
    streamed = tasks.fit_family(name, SuperpipeStrategy(resident_blocks=1, prefetch=1), **options)
    return plain, streamed


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_every_family_trains_exactly_as_plain_lightning(name: str) -> None:
    plain, streamed = _plain_and_streamed(name)
    assert len(streamed.losses) == len(plain.losses) == 8
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-5
    assert tasks.max_relative_difference(streamed, plain) < 1e-5
    # Training moved the weights, so the comparison compared something.
    assert tasks.max_relative_difference(streamed, tasks.build_family_task(name), integers=False) > 1e-4


@pytest.mark.parametrize("name", ["llama-eager-padded", "t5-padded", "llava", "resnet"])
def test_validation_between_steps_matches_plain(name: str) -> None:
    plain, streamed = _plain_and_streamed(name, validate=True, val_check_interval=2)
    assert len(streamed.val_losses) == len(plain.val_losses) == 8  # 4 validations of 2 batches
    np.testing.assert_allclose(streamed.val_losses, plain.val_losses, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "stacks"),
    [
        ("t5", ["model.encoder.block: 2 x T5Block", "model.decoder.block: 3 x T5Block"]),
        (
            "bart",
            ["model.model.encoder.layers: 2 x BartEncoderLayer", "model.model.decoder.layers: 2 x BartDecoderLayer"],
        ),
        ("llama-1layer", ["model.model.layers: 1 x LlamaDecoderLayer"]),
        ("jamba", ["model.model.layers: 2 x JambaAttentionDecoderLayer/JambaMambaDecoderLayer"]),
        ("dropout-list", ["model.blocks: 3 x _Residual"]),
    ],
)
def test_every_stack_of_blocks_streams_and_the_report_says_which(name: str, stacks: list[str]) -> None:
    strategy = SuperpipeStrategy()
    tasks.fit_family(name, strategy, steps=1)
    assert strategy.memory_report()["streamed_stacks"] == stacks


def test_a_vision_language_model_streams_its_vision_tower_and_its_language_model() -> None:
    strategy = SuperpipeStrategy()
    task = tasks.fit_family("llava", strategy, steps=1)
    stacks = strategy.memory_report()["streamed_stacks"]
    assert len(stacks) == 2
    assert "vision_tower" in stacks[0] and "CLIPEncoderLayer" in stacks[0]
    assert "language_model" in stacks[1] and "LlamaDecoderLayer" in stacks[1]
    assert strategy.memory_report()["num_blocks"] == len(task.model.model.vision_tower.encoder.layers) + len(
        task.model.model.language_model.layers
    )


class _CacheSpy(tasks.Task):
    """Records how many positions the KV cache the model returns holds after each training forward."""

    def forward(self, batch: Any) -> torch.Tensor:
        output = self.model(**batch)
        self.cached.append(output.past_key_values.get_seq_length() if output.past_key_values is not None else 0)
        return output.loss


def test_training_keeps_no_layers_keys_and_values_alive_through_the_step() -> None:
    """With `use_cache=True` (the default), plain training fills a `DynamicCache` with every layer's keys and
    values and keeps it to the end of the step; streamed blocks are handed no cache in training."""

    def run(strategy: Any) -> list[int]:
        tasks.pl.seed_everything(7, verbose=False)
        task = _CacheSpy.of("llama-padded")
        task.cached = []  # type: ignore[attr-defined]
        family = families.get("llama-padded")
        tasks.trainer(strategy, max_steps=1, gradient_clip_val=None).fit(task, family.data(2, 0))
        return task.cached  # type: ignore[attr-defined]

    assert run("auto") == [batches.SEQ, batches.SEQ]
    assert run("superpipe") == [0, 0]


def test_a_filled_cache_in_training_is_refused_with_a_clear_message() -> None:
    """A cache that already holds keys and values (a cached prefix) would be appended to twice by the
    recomputation; the strategy refuses it rather than train something else."""
    from transformers import DynamicCache

    class PrefixTask(tasks.Task):
        def forward(self, batch: Any) -> torch.Tensor:
            with torch.no_grad():
                prefix = self.model(input_ids=batch["input_ids"][:, :4], use_cache=True).past_key_values
            return self.model(
                input_ids=batch["input_ids"][:, 4:], past_key_values=prefix, labels=batch["labels"][:, 4:]
            ).loss

    tasks.pl.seed_everything(7, verbose=False)
    task = PrefixTask.of("llama")
    assert DynamicCache is not None
    with pytest.raises(ValueError, match=r"key-value cache that already\s+holds keys and values"):
        tasks.trainer("superpipe", max_steps=1, gradient_clip_val=None).fit(task, families.get("llama").data(2, 0))


@pytest.mark.parametrize("name", ["llama-eager-padded", "gpt_neox-padded", "gemma3", "t5-padded", "llava", "resnet"])
def test_bf16_mixed_is_plain_bf16_mixed_for_dense_families(name: str) -> None:
    """Matrices stream in bf16 (what autocast casts them to before each matmul); norms, biases and embedding tables
    stay fp32 and resident, as autocast keeps them. (Fused MoE experts stream in bf16 too, where plain autocast may
    compute them in fp32, so MoE families are close, not equal: see docs/concepts/exactness.md.)"""
    plain = tasks.plain_fit_family(name, precision="bf16-mixed")
    streamed = tasks.fit_family(name, SuperpipeStrategy(), precision="bf16-mixed")
    assert tasks.max_relative_loss_difference(streamed.losses, plain.losses) < 1e-6
    assert tasks.max_relative_difference(streamed, plain) < 1e-6
