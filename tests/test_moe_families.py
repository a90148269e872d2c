"""page_experts on every fused-experts family transformers builds offline, against its default implementation."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_superpipe.moe import UnsupportedMoEModelError, page_experts
from lightning_superpipe.moe.experts import PAGED_EXPERTS_IMPLEMENTATION
from lightning_superpipe.quantization import dequantize, pack_bit_planes, quantize_groupwise
from tests import moe_families

FAMILIES = moe_families.buildable_model_types()

# Families the issue names (by their model types here); each must be among those tested.
NAMED_IN_THE_ISSUE = (
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe_text",
    "granitemoe", "phimoe", "minimax", "ernie4_5_moe", "hunyuan_v1_moe", "gemma4_text", "gpt_oss",
)


def _inputs(length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


def test_every_fused_experts_family_is_tested_or_skipped_with_a_reason():
    surveyed = set(moe_families.fused_experts_model_types())
    skipped = moe_families.skipped_model_types()
    assert len(surveyed) > 100  # text, vision and audio sub-configs of the 67 modeling files
    assert set(FAMILIES) | set(skipped) == surveyed and not set(FAMILIES) & set(skipped)
    assert all(reason for reason in skipped.values())
    assert len(FAMILIES) >= 35, skipped
    assert set(NAMED_IN_THE_ISSUE) <= set(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_is_exact_at_full_budget_holds_the_budget_and_restores_bit_for_bit(model_type):
    model = moe_families.build(model_type)
    implementation = model.config._experts_implementation
    assert implementation == "grouped_mm"  # transformers 5's default: what users run
    input_ids = _inputs()
    expected = _logits(model, input_ids)
    params = _params(model)
    originals = {name: p.detach().clone() for name, p in params.items()}

    handle = page_experts(model, calibration=[input_ids])
    assert model.config._experts_implementation == PAGED_EXPERTS_IMPLEMENTATION
    assert handle.device_bytes() == handle.max_bytes()
    assert torch.equal(_logits(model, input_ids), expected)  # bit for bit, against grouped_mm

    # The budget falls to the minimum and rises back; the device bytes never exceed it.
    budgets = torch.linspace(handle.max_bytes(), handle.min_bytes(), 4).long().tolist()
    for budget in budgets + budgets[::-1]:
        handle.set_budget(budget)
        assert handle.device_bytes() <= budget
        assert handle.device_bytes() == handle.store.recount_device_bytes()
        if budget == handle.min_bytes():
            assert set(handle.bits().values()) == {handle.store.min_level}
            # Precision really lowered: the weights computed with are not the originals.
            for layer, proj in handle.store.projections():
                rebuilt = handle.store.projection_weight(layer, proj)
                assert not torch.equal(rebuilt, handle.store.host_weight(layer, proj))
            assert not torch.equal(_logits(model, input_ids), expected)
    assert set(handle.bits().values()) == {16}
    assert torch.equal(_logits(model, input_ids), expected)

    handle.restore()
    assert model.config._experts_implementation == implementation
    restored = _params(model)
    assert restored.keys() == params.keys()
    for name, param in restored.items():
        assert param is params[name] and torch.equal(param, originals[name])
    assert torch.equal(_logits(model, input_ids), expected)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_in_bf16_is_exact_at_full_budget_after_a_round_trip_through_the_minimum(model_type):
    model = moe_families.build(model_type, dtype=torch.bfloat16)
    input_ids = _inputs()
    expected = _logits(model, input_ids)
    handle = page_experts(model)
    assert handle.max_bytes() == handle.full_bytes()  # bf16: the originals are the 16-bit size
    assert torch.equal(_logits(model, input_ids), expected)
    handle.set_budget(handle.min_bytes())
    lowered = _logits(model, input_ids)
    handle.set_budget(None)
    assert torch.equal(_logits(model, input_ids), expected)
    assert not torch.equal(lowered, expected)
    handle.restore()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_full_budget_follows_the_implementation_that_was_active(implementation, top_k, dtype):
    model = moe_families.build("mixtral", num_experts_per_tok=top_k, dtype=dtype)
    model.set_experts_implementation(implementation)
    input_ids = _inputs(32)
    expected = _logits(model, input_ids)
    handle = page_experts(model)
    assert torch.equal(_logits(model, input_ids), expected)
    handle.set_budget(handle.min_bytes())
    handle.set_budget(None)
    assert torch.equal(_logits(model, input_ids), expected)
    handle.restore()
    assert model.config._experts_implementation == implementation


def test_eager_and_grouped_mm_differ_in_bf16_so_following_the_active_one_matters():
    model = moe_families.build("mixtral", num_experts_per_tok=8, dtype=torch.bfloat16)
    input_ids = _inputs(32)
    grouped = _logits(model, input_ids)
    model.set_experts_implementation("eager")
    assert not torch.equal(_logits(model, input_ids), grouped)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_default_implementation_in_bf16_top_8_is_followed_bit_for_bit(model_type):
    model = moe_families.build(model_type, num_experts_per_tok=8, dtype=torch.bfloat16, **_all_groups(model_type))
    input_ids = _inputs(32)
    expected = _logits(model, input_ids)
    handle = page_experts(model)
    assert torch.equal(_logits(model, input_ids), expected)
    handle.restore()


def _all_groups(model_type: str) -> dict[str, int]:
    """DeepSeek-V3's group-limited routing must allow all 8 experts for top-8."""
    return dict(topk_group=2) if model_type == "deepseek_v3" else {}


def test_gpt_oss_transposed_layout_is_quantized_along_its_input_dimension_and_biases_stay():
    model = moe_families.build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    assert experts.is_transposed and experts.has_bias and not experts.is_concatenated
    gate_up = experts.gate_up_proj.detach().clone()  # [E, H, 2I]
    biases = {name: p for name, p in model.named_parameters() if name.endswith("_bias")}
    handle = page_experts(model)
    assert all(name in dict(model.named_parameters()) for name in biases)  # biases are not paged
    handle.set_budget(handle.min_bytes())
    handle.apply_levels([8] * len(handle.store.pages))
    rebuilt = handle.store.projection_weight(0, 0)
    assert rebuilt.shape == gate_up.shape
    # Groups run along H (dim -2 of the stored [E, H, 2I]): the same as quantizing each [2I, H] matrix.
    for expert in range(gate_up.shape[0]):
        codes = quantize_groupwise(gate_up[expert].mT, handle.store.group_size)
        planes = pack_bit_planes(codes.codes.reshape(1, -1))
        expected = dequantize(planes, codes.scale.unsqueeze(0), codes.minimum.unsqueeze(0), (1, *codes.codes.shape),
                              torch.float32)[0]
        assert torch.equal(rebuilt[expert].mT, expected)
    handle.restore()


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_shared_experts_are_paged_with_their_own_damage(model_type):
    model = moe_families.build(model_type)
    input_ids = _inputs(48)
    handle = page_experts(model, calibration=[input_ids])
    shared = [layer for layer in handle.layers if layer.shared]
    assert shared and all(layer.projections == ("gate_proj", "up_proj", "down_proj") for layer in shared)
    assert all(handle.unit_bytes()[layer.name] > 0 for layer in shared)
    damage = handle.damage()
    is_shared = torch.tensor([handle.layers[page.key.layer].shared for page in handle.store.pages])
    per_weight = damage[:, -1] / torch.tensor([page.host_weight.numel() for page in handle.store.pages])
    # Every token uses the shared expert: its pages are the most damaging to lower, per weight.
    assert per_weight[is_shared].mean() > per_weight[~is_shared].mean()
    handle.restore()


def _dbrx() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=256,
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
    )
    return AutoModelForCausalLM.from_config(config)


def _llama4() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama4_text", hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("build", "name"), [(_dbrx, "DbrxExperts"), (_llama4, "Llama4TextExperts")], ids=["dbrx", "llama4"]
)
def test_families_without_the_experts_interface_are_refused_clearly(build, name):
    model = build()
    params = _params(model)
    with pytest.raises(UnsupportedMoEModelError, match=rf"page_experts\(\w+\) refused: .*\({name}\) do not use it"):
        page_experts(model)
    assert _params(model) == params  # untouched
