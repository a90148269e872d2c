"""lightning_superpipe.generate: FlexGen's schedule on any transformers causal LM, exact against model.generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_superpipe import EmulatedLink, generate
from lightning_superpipe.generation import GenerationError, GenerationPolicy
from lightning_superpipe.generation.policy import ModelShape, device_bytes

VOCAB = 96
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(family: str, dtype: torch.dtype = torch.float32, layers: int = 3) -> torch.nn.Module:
    """A tiny random model of ``family`` (weights from seed 0)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, **SPECIAL)
    if family == "llama":  # grouped KV heads: 4 query heads share 2 KV heads
        config = AutoConfig.for_model("llama", **sizes)
    elif family == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=128,
                                      **SPECIAL)
    elif family == "mistral":  # a window shorter than prompt + new tokens
        config = AutoConfig.for_model("mistral", sliding_window=6, **sizes)
    else:
        raise ValueError(family)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def prompts(batch: int = 6, length: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: row ``r`` has ``r % 4`` pad tokens."""
    ids = torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(batch):
        ids[row, : row % 4] = 0
        mask[row, : row % 4] = 0
    return ids, mask


def reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def block_bytes(model: torch.nn.Module) -> int:
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    return sum(p.numel() * p.element_size() for p in layers[0].parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_greedy_tokens_equal_model_generate(family: str, dtype: torch.dtype) -> None:
    model = build(family, dtype)
    ids, mask = prompts()
    new = 8
    expected = reference(model, ids, mask, new)
    out = generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=new)
    assert torch.equal(out.sequences, expected)
    # Loop order token -> block -> micro-batch: each block's weights crossed once per token for all 3 micro-batches.
    assert out.stats["h2d_bytes"]["weights"] == new * 3 * block_bytes(model)
    assert out.stats["policy"]["num_micro_batches"] == 3
    assert out.stats["d2h_bytes"]["cache"] > 0 and out.stats["tokens_per_s"] > 0
    # The model is left as it was: its parameters in host memory, no hooks.
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(reference(model, ids, mask, new), expected)


@pytest.mark.parametrize("mode", ["lazy", "thread"])
def test_emulated_asynchronous_link_keeps_the_order_and_the_tokens(mode: str) -> None:
    """Deferred copies with the happens-before checker: a missing wait raises or shows as NaN tokens."""
    model = build("llama")
    ids, mask = prompts()
    expected = reference(model, ids, mask, 6)
    link = EmulatedLink(mode=mode, seed=0, max_delay_s=2e-4)
    out = generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=6, link=link)
    assert torch.equal(out.sequences, expected)
    assert link.stats.copies > 0 and not link.stats.violations


def test_cache_device_fraction_keeps_some_layers_on_the_device() -> None:
    model = build("mistral")
    ids, mask = prompts()
    expected = reference(model, ids, mask, 6)
    host = generate(model, ids, GenerationPolicy(micro_batch_size=3), attention_mask=mask, max_new_tokens=6)
    split = generate(model, ids, GenerationPolicy(micro_batch_size=3, cache_device_fraction=2 / 3), attention_mask=mask,
                     max_new_tokens=6)
    assert torch.equal(split.sequences, expected) and torch.equal(host.sequences, expected)
    assert split.stats["policy"]["cache_device_fraction"] == pytest.approx(2 / 3)
    assert 0 < split.stats["h2d_bytes"]["cache"] < 0.5 * host.stats["h2d_bytes"]["cache"]


def test_device_peak_stays_in_the_budget_while_the_cache_is_larger() -> None:
    model = build("llama", layers=4)
    ids, mask = prompts(batch=32, length=40)
    new = 6
    expected = reference(model, ids, mask, new)
    budget = 1_300_000
    out = generate(model, ids, GenerationPolicy(memory_budget=budget), attention_mask=mask, max_new_tokens=new)
    assert torch.equal(out.sequences, expected)
    # layers * rows * positions * (k, v) * kv heads * head_dim * fp32; the last token's entries are never made.
    kv_all = 4 * 32 * (40 + new - 1) * 2 * 2 * 16 * 4
    assert out.stats["cache_bytes"] == kv_all
    assert kv_all > budget
    assert out.stats["peak_device_bytes"] <= budget
    assert out.stats["policy"]["num_micro_batches"] > 1  # the whole batch's cache would not fit at once
    assert out.stats["policy"]["predicted_tokens_per_s"] > 0


def test_compressed_weights_and_cache_move_a_fraction_of_the_bytes() -> None:
    model = build("llama")
    ids, mask = prompts()
    plain = generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=6)
    packed = generate(model, ids, GenerationPolicy(micro_batch_size=2, compress_weights=True, compress_kv=True),
                      attention_mask=mask, max_new_tokens=6)
    for kind in ("weights", "cache"):
        assert packed.stats["h2d_bytes"][kind] <= 0.3 * plain.stats["h2d_bytes"][kind]
    assert packed.stats["d2h_bytes"]["cache"] <= 0.3 * plain.stats["d2h_bytes"]["cache"]
    # Random weights are the worst case for 4 bits; the prompts survive and most new tokens still agree.
    assert torch.equal(packed.sequences[:, :10], ids)
    assert (packed.sequences == plain.sequences).float().mean() > 0.6


def shape_of(model: torch.nn.Module) -> ModelShape:
    return ModelShape.of(model, list(model.model.layers))


def test_resident_blocks_cross_the_link_once_and_fit_the_budget() -> None:
    model = build("llama", layers=4)
    ids, mask = prompts(batch=6, length=10)
    new, block = 6, block_bytes(model)
    expected = reference(model, ids, mask, new)
    streamed = generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=new)
    # A budget with room for one resident block beside the two streamed ones in flight (two resident and two in
    # flight is as much as all four resident, which does not fit either); the cache and hidden states fixed.
    budget = int(device_bytes(shape_of(model), 2, 6, 10, new, 0, False, False, resident_blocks=1)) + 1
    fixed = dict(micro_batch_size=2, cache_device_fraction=0.0, activations_on_host=False)
    out = generate(model, ids, GenerationPolicy(memory_budget=budget, **fixed), attention_mask=mask, max_new_tokens=new)
    assert torch.equal(out.sequences, expected)
    assert out.stats["policy"]["resident_blocks"] == 1
    # The resident block crosses once at the start, the other three once per token: one block's bytes fewer a token.
    assert out.stats["h2d_bytes"]["weights"] == new * 3 * block + block
    assert streamed.stats["h2d_bytes"]["weights"] - out.stats["h2d_bytes"]["weights"] == (new - 1) * block
    assert out.stats["peak_device_bytes"] <= budget
    assert out.stats["peak_device_bytes_by_kind"]["weights"] == 3 * block  # resident + installed + prefetched
    # Every block resident: the weights cross once, no double buffer; compressed: packed on the device, the same
    # tokens as streaming the packed blocks (the rebuild is the same).
    whole = generate(model, ids, GenerationPolicy(micro_batch_size=2, resident_blocks=4), attention_mask=mask,
                     max_new_tokens=new)
    assert torch.equal(whole.sequences, expected) and whole.stats["h2d_bytes"]["weights"] == 4 * block
    packed = generate(model, ids, GenerationPolicy(micro_batch_size=2, compress_weights=True), attention_mask=mask,
                      max_new_tokens=new)
    resident = GenerationPolicy(micro_batch_size=2, compress_weights=True, resident_blocks=2)
    packed_resident = generate(model, ids, resident, attention_mask=mask, max_new_tokens=new)
    assert torch.equal(packed_resident.sequences, packed.sequences)
    packed_block = packed.stats["h2d_bytes"]["weights"] // (new * 4)
    assert packed_resident.stats["h2d_bytes"]["weights"] == new * 2 * packed_block + 2 * packed_block


def test_hidden_states_on_host_let_a_batch_fit_that_does_not_otherwise() -> None:
    model = build("llama", layers=4)
    batch, length, new = 24, 30, 5
    ids, mask = prompts(batch=batch, length=length)
    full = dict(min_new_tokens=new)  # no micro-batch stops early: every step's copies are counted below
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **full)
    shape = shape_of(model)
    on_device = min(device_bytes(shape, m, batch, length, new, 0, False, False) for m in range(1, batch + 1))
    on_host = min(device_bytes(shape, m, batch, length, new, 0, False, False, activations_on_host=True)
                  for m in range(1, batch + 1))
    assert on_host < on_device
    budget = int(on_host + on_device) // 2  # no micro-batch size fits with every micro-batch's hidden states on device
    with pytest.raises(GenerationError, match=r"activations_on_host=False.*cannot hold even one block"):
        generate(model, ids, GenerationPolicy(memory_budget=budget, activations_on_host=False), attention_mask=mask,
                 max_new_tokens=new)
    out = generate(model, ids, GenerationPolicy(memory_budget=budget), attention_mask=mask, max_new_tokens=new, **full)
    assert torch.equal(out.sequences, expected)
    assert out.stats["policy"]["activations_on_host"] and out.stats["peak_device_bytes"] <= budget
    # Out after every block but the last and back before the next: (layers - 1) copies each way of every row's
    # hidden states, the prompt's at prefill and one token's per decode step.
    row = 64 * 4
    moved = (4 - 1) * (batch * length * row + (new - 1) * batch * row)
    assert out.stats["h2d_bytes"]["activations"] == out.stats["d2h_bytes"]["activations"] == moved
    # The device holds a few micro-batches' hidden states, not the whole batch's.
    assert out.stats["peak_device_bytes_by_kind"]["activations"] < batch * length * row / 2
    kept = generate(model, ids, GenerationPolicy(micro_batch_size=4), attention_mask=mask, max_new_tokens=new)
    assert kept.stats["peak_device_bytes_by_kind"]["activations"] >= batch * length * row
    assert kept.stats["h2d_bytes"]["activations"] == 0


@pytest.mark.parametrize("mode", ["lazy", "thread"])
def test_resident_blocks_and_parked_hidden_states_keep_the_order_on_the_emulated_link(mode: str) -> None:
    model = build("gpt2", layers=3)
    ids, mask = prompts()
    expected = reference(model, ids, mask, 5)
    link = EmulatedLink(mode=mode, seed=1, max_delay_s=2e-4)
    policy = GenerationPolicy(micro_batch_size=2, resident_blocks=1, activations_on_host=True, compress_kv=False)
    out = generate(model, ids, policy, attention_mask=mask, max_new_tokens=5, link=link)
    assert torch.equal(out.sequences, expected)
    assert link.stats.copies > 0 and not link.stats.violations
    assert out.stats["h2d_bytes"]["activations"] > 0 and out.stats["policy"]["resident_blocks"] == 1


def test_errors_quote_the_call() -> None:
    model = build("llama")
    ids, mask = prompts()
    with pytest.raises(GenerationError, match=r"generate\(model, input_ids, max_new_tokens=0.*positive integer"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(GenerationError, match=r"memory_budget=.*cannot hold even one block.*Raise `memory_budget`"):
        generate(model, ids, GenerationPolicy(memory_budget="100KiB"), attention_mask=mask, max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"attention_mask` has shape"):
        generate(model, ids, attention_mask=mask[:, :3], max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"resident_blocks=5\)\).*`resident_blocks` must be a count of blocks"
                                              r" between 0 and the model's 3, got 5"):
        generate(model, ids, GenerationPolicy(resident_blocks=5), max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"`resident_blocks=1` needs `stream_weights=True`"):
        generate(model, ids, GenerationPolicy(resident_blocks=1, stream_weights=False), max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"a bare float is ambiguous .* '50%'"):
        generate(model, ids, GenerationPolicy(memory_budget=0.5), max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"`cache` is set by the schedule"):
        generate(model, ids, max_new_tokens=4, cache=None)
    model.model.layers = torch.nn.ModuleList([model.model.layers[0], torch.nn.Linear(64, 64)])  # no uniform stack
    with pytest.raises(GenerationError, match=r"unknown model layout: LlamaForCausalLM"):
        generate(model, ids, max_new_tokens=4)


def test_rows_that_stop_early_are_padded_like_model_generate() -> None:
    model = build("gpt2")
    ids, mask = prompts()
    free = reference(model, ids, mask, 6)
    eos = int(free[0, ids.shape[1] + 1])  # row 0 stops after two tokens
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    out = generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=6,
                   eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert (expected[:, ids.shape[1] :] == model.generation_config.pad_token_id).any()  # some row stopped early


def test_sampling_is_reproducible_under_a_seed() -> None:
    model = build("llama")
    ids, mask = prompts()
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(generate(model, ids, GenerationPolicy(micro_batch_size=2), attention_mask=mask, max_new_tokens=6,
                             do_sample=True, temperature=1.5).sequences)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], reference(model, ids, mask, 6))
