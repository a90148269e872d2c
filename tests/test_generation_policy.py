"""FlexGen's compression and cost model: its golden values, and the policy the solver picks under a budget."""

from __future__ import annotations

import pytest
import torch

from lightning_superpipe.generation import compression
from lightning_superpipe.generation.policy import Hardware, ModelShape, choose_policy, device_bytes
from lightning_superpipe.quantization import pack_nibbles, quantize_groupwise, unpack_nibbles
from tests.flexgen_reference import FlexGenConfig, flexgen_lp, flexgen_search


def test_flexgen_quantizer_golden_relative_rms_error() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096, 1024)
    packed = compression.compress(x, dim=0)  # weights: groups along the output dimension
    assert compression.relative_rms_error(compression.decompress(packed), x) == pytest.approx(0.0897, abs=5e-4)
    assert packed.nbytes == x.numel() * compression.BYTES_PER_ELEMENT == x.numel() * 0.5625


def test_four_bit_codes_pack_two_per_byte_and_keep_the_eight_bit_default() -> None:
    codes = torch.randint(0, 16, (3, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(codes).shape == (3, 64)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    assert quantize_groupwise(x, 64, bits=4).codes.max() == 15
    assert torch.equal(quantize_groupwise(x, 64).codes, quantize_groupwise(x, 64, bits=8).codes)
    assert quantize_groupwise(x, 64).codes.max() == 255


def test_cache_groups_run_along_head_dim() -> None:
    kv = torch.randn(5, 2, 3, 64)  # positions, batch, heads, head_dim
    packed = compression.compress(kv, dim=-1)
    assert packed.scale.shape == (5, 2, 3, 1) and packed.codes.shape == (5, 2, 3, 32)
    assert compression.relative_rms_error(compression.decompress(packed), kv) < 0.1


def test_flexgen_cost_model_reproduces_its_published_opt30b_prediction() -> None:
    # Its example for a fixed policy: --percent 20 80 0 100 0 100 --gpu-batch-size 48 --num-gpu-batches 3, alpha 1.2.
    fixed = flexgen_lp(FlexGenConfig(alpha=1.2), 144, 48, placement=dict(wg=0.2, wc=0.8, cg=0, cc=1, hg=0, hc=1))
    assert fixed.feasible
    assert fixed.tokens_per_s == pytest.approx(7.14, abs=0.005)
    assert fixed.t_prefill == pytest.approx(4.389, abs=5e-4) and fixed.t_decode == pytest.approx(0.292, abs=5e-4)


def test_flexgen_search_finds_32_by_5() -> None:
    found = flexgen_search(FlexGenConfig())
    assert (found.gpu_batch_size, found.num_gpu_batches) == (32, 5)
    assert found.tokens_per_s == pytest.approx(7.09, abs=0.005)
    assert sum(found.placement[k] for k in ("wg", "wc", "wn")) == pytest.approx(1.0)


SHAPE = ModelShape(layers=8, hidden=1024, heads=16, kv_heads=4, head_dim=64, vocab=32000, dtype_bytes=2,
                   block_bytes=2 * 12_600_000, block_params=12_600_000, compressible_fraction=0.999,
                   trunk_bytes=2 * 2 * 32000 * 1024, mlp=4096)


def test_policy_keeps_cache_on_the_device_when_it_fits_and_streams_it_when_not() -> None:
    exact = dict(compress_weights=False, compress_kv=False)
    roomy = choose_policy(SHAPE, batch=8, prompt=128, new_tokens=16, budget=4e9, **exact)
    assert roomy.cache_device_fraction == 1.0 and not roomy.compress_kv and not roomy.compress_weights
    tight_budget = device_bytes(SHAPE, 1, 64, 512, 32, 4, False, False)  # room for 4 of 8 layers at best
    placed = dict(resident_blocks=0, activations_on_host=False)  # blocks streamed, hidden on the device
    tight = choose_policy(SHAPE, batch=64, prompt=512, new_tokens=32, budget=tight_budget, **exact, **placed)
    assert tight.device_bytes <= tight_budget
    assert tight.cache_device_fraction == 0.5 and tight.micro_batch_size == 1
    # Compression allowed, the blocks streamed: over a slow link (weights dominate decode) the solver takes 4-bit
    # weights.
    slow = Hardware(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    auto = choose_policy(SHAPE, batch=4, prompt=64, new_tokens=16, budget=4e9, hardware=slow, **placed)
    plain = choose_policy(SHAPE, batch=4, prompt=64, new_tokens=16, budget=4e9, hardware=slow, **exact, **placed)
    assert auto.compress_weights and auto.tokens_per_s > 2 * plain.tokens_per_s


def test_policy_keeps_blocks_resident_and_moves_hidden_states_to_the_host_only_where_it_pays() -> None:
    exact = dict(compress_weights=False, compress_kv=False)
    # Room for everything: every block resident (no weights cross per token), hidden states on the device.
    roomy = choose_policy(SHAPE, batch=8, prompt=128, new_tokens=16, budget=4e9, **exact)
    assert roomy.resident_blocks == SHAPE.layers and not roomy.activations_on_host
    streamed = choose_policy(SHAPE, batch=8, prompt=128, new_tokens=16, budget=4e9, resident_blocks=0,
                             **exact)
    assert roomy.tokens_per_s > 1.5 * streamed.tokens_per_s  # decode of a small batch is weight-bound
    # Room for three resident blocks beside the two streamed ones in flight, the cache streamed: w = 3 exactly.
    fixed = dict(micro_batch_size=1, cache_device_fraction=0.0, activations_on_host=False, **exact)
    three = device_bytes(SHAPE, 1, 8, 128, 16, 0, False, False, resident_blocks=3)
    assert choose_policy(SHAPE, batch=8, prompt=128, new_tokens=16, budget=three, **fixed).resident_blocks == 3
    assert choose_policy(SHAPE, batch=8, prompt=128, new_tokens=16, budget=three - 1, **fixed).resident_blocks == 2
    # A batch whose hidden states alone overflow the device: only hidden states on the host fit.
    big = dict(batch=512, prompt=512, new_tokens=8)
    fits = device_bytes(SHAPE, 1, 512, 512, 8, 0, False, False, activations_on_host=True)
    assert device_bytes(SHAPE, 1, 512, 512, 8, 0, False, False) > 2 * fits
    hosted = choose_policy(SHAPE, budget=fits, **big, **exact)
    assert hosted.activations_on_host and hosted.device_bytes <= fits
    with pytest.raises(ValueError, match="cannot hold even one block"):
        choose_policy(SHAPE, budget=fits, activations_on_host=False, **big, **exact)
