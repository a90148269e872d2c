"""page_experts on small models of every supported family: exactness, budgets, moves, errors."""

import pytest
import torch

from lightning_superpipe.moe import (
    SUPPORTED_MODEL_TYPES,
    PageKey,
    PagingOptions,
    UnsupportedMoEModelError,
    full_expert_bytes,
    kv_cache_bytes,
    page_experts,
)
from lightning_superpipe.moe.experts import PAGED_EXPERTS_IMPLEMENTATION
from lightning_superpipe.moe.pages import CopyEngine
from lightning_superpipe.moe.testing import byte_corpus, tiny_moe
from lightning_superpipe.quantization import dequantize


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return byte_corpus()[:4096]


def _inputs(tokens: torch.Tensor, batch: int = 2, length: int = 48, offset: int = 0) -> torch.Tensor:
    return tokens[offset : offset + batch * length].view(batch, length)


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".experts." in name}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_full_budget_gives_unpaged_outputs_and_restore_gives_exact_weights(model_type, tokens):
    model = tiny_moe(model_type)
    input_ids = _inputs(tokens)
    expected = _logits(model, input_ids)
    params = _expert_params(model)
    originals = {name: p.detach().clone() for name, p in params.items()}
    full = full_expert_bytes(model)

    handle = page_experts(model, expert_budget=handle_max(model), calibration=[input_ids])
    assert model.config._experts_implementation == PAGED_EXPERTS_IMPLEMENTATION
    assert not _expert_params(model)  # the weights live in the page store now
    assert handle.full_bytes() == full
    assert set(handle.bits().values()) == {16}
    assert torch.equal(_logits(model, input_ids), expected)

    handle.set_budget(int(0.3 * full))
    assert not torch.equal(_logits(model, input_ids), expected)
    handle.restore()

    assert model.config._experts_implementation == "eager"
    restored = _expert_params(model)
    assert restored.keys() == params.keys()
    for name, param in restored.items():
        assert param is params[name]  # same Parameter objects: optimizers keep working
        assert torch.equal(param, originals[name])
    assert torch.equal(_logits(model, input_ids), expected)


def handle_max(model: torch.nn.Module) -> int:
    """Bytes of the original expert weights (routed and shared) in the model's dtype: fp32 here, twice the
    16-bit size."""
    return 2 * full_expert_bytes(model)


def test_device_bytes_never_exceed_the_budget_as_it_is_lowered_and_raised(tokens):
    model = tiny_moe("mixtral")
    input_ids = _inputs(tokens)
    expected = _logits(model, input_ids)
    handle = page_experts(model, calibration=[input_ids], options=PagingOptions(rows_per_page=32))
    assert handle.device_bytes() == handle.max_bytes()
    budgets = torch.linspace(handle.max_bytes(), handle.min_bytes(), 9).long().tolist()
    previous_error = 0.0
    for budget in budgets:
        handle.set_budget(budget)
        assert handle.device_bytes() <= budget
        assert handle.device_bytes() == handle.store.recount_device_bytes()
        error = (_logits(model, input_ids) - expected).abs().mean().item()
        assert error >= previous_error * 0.5  # quality degrades (loosely monotone) as bytes shrink
        previous_error = max(previous_error, error)
        assert handle.device_bytes() <= budget  # running the model commits nothing over budget
    assert set(handle.bits().values()) == {handle.store.min_level}
    for budget in budgets[::-1]:
        handle.set_budget(budget)
        assert handle.device_bytes() <= budget
        assert handle.device_bytes() == handle.store.recount_device_bytes()
    assert torch.equal(_logits(model, input_ids), expected)
    assert handle.moves.promotions > 0 and handle.moves.demotions > 0
    handle.restore()


def test_a_budget_below_the_minimum_names_the_minimum(tokens):
    model = tiny_moe("qwen3_moe")
    handle = page_experts(model)
    minimum = handle.min_bytes()
    assert minimum == sum(page.bytes_at(2) for page in handle.store.pages)
    with pytest.raises(ValueError, match=f"below the minimum of {minimum:,} bytes"):
        handle.set_budget(minimum - 1)
    handle.set_budget(minimum)
    assert handle.device_bytes() == minimum
    handle.restore()
    with pytest.raises(ValueError, match="levels"):
        page_experts(tiny_moe("mixtral"), expert_budget=minimum - 1, options=PagingOptions(levels=(16, 8, 4, 2)))
    model = tiny_moe("mixtral")
    params = _expert_params(model)
    with pytest.raises(ValueError, match="minimum"):
        page_experts(model, expert_budget=minimum - 1)
    assert _expert_params(model) == params  # refused before the model was touched
    assert model.config._experts_implementation == "eager"


def test_a_failing_calibration_leaves_the_model_as_it_was():
    model = tiny_moe("olmoe")
    params = _expert_params(model)
    with pytest.raises(TypeError, match="calibration items must be"):
        page_experts(model, calibration=["not a tensor"])
    assert _expert_params(model) == params
    assert model.config._experts_implementation == "eager"


def test_models_without_fused_experts_are_refused_with_what_is_supported():
    model = tiny_moe("llama")
    with pytest.raises(UnsupportedMoEModelError, match=r"LlamaForCausalLM \(model type 'llama'\) has no fused experts"):
        page_experts(model)
    with pytest.raises(UnsupportedMoEModelError, match="use_experts_implementation.*Mixtral"):
        full_expert_bytes(model)


def test_invalid_page_settings_are_refused():
    with pytest.raises(ValueError, match="rows_per_page=48 must divide"):
        page_experts(tiny_moe("mixtral"), options=PagingOptions(rows_per_page=48))
    with pytest.raises(ValueError, match="include 8"):
        page_experts(tiny_moe("mixtral"), options=PagingOptions(levels=(16, 4, 2)))
    with pytest.raises(ValueError, match="group_size=48"):
        page_experts(tiny_moe("mixtral"), options=PagingOptions(group_size=48))


def test_qwen2_moe_dense_layers_stay_and_shared_experts_are_paged(tokens):
    model = tiny_moe("qwen2_moe", num_layers=3, mlp_only_layers=[1])
    input_ids = _inputs(tokens)
    expected = _logits(model, input_ids)
    names = {name for name, _ in model.named_parameters()}
    shared = {name for name in names if ".shared_expert." in name}
    dense = {name for name in names if name.startswith("model.layers.1.mlp.")}
    assert len(shared) == 6 and len(dense) == 3

    handle = page_experts(model, expert_budget=None)
    # Two MoE blocks (the dense one skipped), each as routed experts + its shared expert.
    assert [layer.name for layer in handle.layers] == [
        "model.layers.0.mlp.experts", "model.layers.0.mlp.shared_expert",
        "model.layers.2.mlp.experts", "model.layers.2.mlp.shared_expert",
    ]
    left = {name for name, _ in model.named_parameters()}
    assert not shared & left  # the shared experts' linears are paged (their sigmoid gate is not)
    assert dense <= left
    assert torch.equal(_logits(model, input_ids), expected)
    handle.set_budget(handle.min_bytes())
    assert {b for k, b in handle.bits().items() if handle.layers[k.layer].shared} == {2}
    assert not torch.equal(_logits(model, input_ids), expected)
    handle.restore()
    assert {name for name, _ in model.named_parameters()} == names
    assert torch.equal(_logits(model, input_ids), expected)

    kept = page_experts(model, shared_experts=False)
    assert [layer.name for layer in kept.layers] == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    assert shared <= {name for name, _ in model.named_parameters()}
    kept.restore()


def test_reference_mode_is_exact_at_any_budget(tokens):
    model = tiny_moe("olmoe")
    input_ids = _inputs(tokens)
    expected = _logits(model, input_ids)
    handle = page_experts(model, calibration=[input_ids])
    handle.set_budget(handle.min_bytes())
    with handle.reference():
        assert torch.equal(_logits(model, input_ids), expected)
    assert not torch.equal(_logits(model, input_ids), expected)
    assert handle.device_bytes() == handle.min_bytes()
    handle.restore()


def test_calibration_makes_routing_and_inputs_shape_the_damage(tokens):
    model = tiny_moe("mixtral")
    input_ids = _inputs(tokens, batch=4, length=64)
    weight_only = page_experts(model).damage()
    handle = page_experts(tiny_moe("mixtral"), calibration=[input_ids])
    calibrated = handle.damage()
    assert calibrated.shape == weight_only.shape == (len(handle.bits()), 5)
    assert (calibrated[:, 0] == 0).all() and (calibrated[:, 1:] > 0).all()
    # More bits, less damage, for every page.
    assert (calibrated[:, 1:].diff(dim=1) > 0).all()
    # Routing shares differ between experts, so damage is not the weight error up to a constant.
    ratio = calibrated[:, -1] / weight_only[:, -1]
    assert ratio.max() / ratio.min() > 2
    shares = handle.routing.shares()
    assert all(abs(s.sum().item() - 2.0) < 1e-6 for s in shares)  # top-2 routing


def test_routing_shifts_move_bits_to_hot_experts(tokens):
    model = tiny_moe("mixtral")
    hot = (5, 6)

    def force_routing(module, args, output):
        logits, weights, index = output
        forced = torch.tensor(hot).expand_as(index)
        return logits, torch.full_like(weights, 0.5), forced

    hooks = [layer.mlp.gate.register_forward_hook(force_routing) for layer in model.model.layers]
    handle = page_experts(model, options=PagingOptions(rebalance_every=1, routing_half_life_tokens=64.0))
    handle.set_budget(int(0.35 * handle.full_bytes()))

    def mean_bits(experts):
        bits = handle.bits()
        return sum(b for k, b in bits.items() if k.expert in experts) / sum(1 for k in bits if k.expert in experts)

    cold = tuple(e for e in range(8) if e not in hot)
    before = mean_bits(hot) - mean_bits(cold)
    for offset in range(3):
        _logits(model, _inputs(tokens, offset=100 * offset))
    assert mean_bits(hot) - mean_bits(cold) > before
    assert mean_bits(hot) > mean_bits(cold)
    assert handle.device_bytes() <= handle.budget
    for hook in hooks:
        hook.remove()
    handle.restore()


def test_pressure_mode_shrinks_expert_bytes_as_the_kv_cache_grows(tokens):
    model = tiny_moe("mixtral")
    prompt = _inputs(tokens, batch=2, length=16)
    probe = page_experts(model)
    kv_per_token = 2 * 2 * 2 * 16 * 4 * 2  # keys+values, layers, kv heads, head dim, fp32, batch
    total = probe.max_bytes() + 20 * kv_per_token  # everything fits for the first 20 positions
    probe.restore()

    # Frequent routing-driven replanning must respect the pressure budget too.
    handle = page_experts(model, expert_and_kv_budget=total, calibration=[prompt],
                          options=PagingOptions(rebalance_every=4))
    trace = []

    def record(module, args, kwargs, output):
        trace.append((handle.device_bytes(), kv_cache_bytes(output.cache)))

    hook = model.register_forward_hook(record, with_kwargs=True)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    hook.remove()
    assert len(trace) == 40
    assert trace[-1][1] == (16 + 39) * kv_per_token
    for expert_bytes, kv_bytes in trace:
        assert expert_bytes + kv_bytes <= total
    assert trace[0][0] == handle.max_bytes()
    assert trace[-1][0] < trace[0][0]
    expert_bytes = [e for e, _ in trace]
    assert expert_bytes == sorted(expert_bytes, reverse=True)
    # Hysteresis: the cache grows every token, pages move in far fewer steps.
    assert len(set(expert_bytes)) < len(expert_bytes) // 2

    with pytest.raises(RuntimeError, match="KV cache needs"):
        handle.set_expert_and_kv_budget(handle.min_bytes() + 10 * kv_per_token)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    handle.restore()


class ManualCopyEngine(CopyEngine):
    """Copies whose completion the test decides, to check the asynchronous bookkeeping on a CPU."""

    asynchronous = True

    def __init__(self, device):
        super().__init__(device)
        self.landed = 0
        self.issued = 0

    def fence(self):
        self.issued += 1
        return self.issued

    def is_done(self, fence):
        return fence is None or fence <= self.landed


def test_promotions_stay_pending_until_their_copy_lands(tokens, monkeypatch):
    engine = ManualCopyEngine(torch.device("cpu"))
    monkeypatch.setattr("lightning_superpipe.moe.api.SyncCopyEngine", lambda device: engine)
    model = tiny_moe("mixtral")
    input_ids = _inputs(tokens)
    expected = _logits(model, input_ids)
    handle = page_experts(model, options=PagingOptions(async_moves=False))
    engine.landed = engine.issued  # the first placement landed
    handle.set_budget(handle.min_bytes())
    low = _logits(model, input_ids)
    assert set(handle.bits().values()) == {2}

    handle.set_budget(None)  # promotions start, nothing landed
    pending = [p for p in handle.store.pages if p.pending is not None]
    assert len(pending) == len(handle.store.pages)
    assert set(handle.bits().values()) == {2}  # still computing at the old precision
    assert handle.device_bytes() == handle.store.recount_device_bytes() > handle.max_bytes()
    assert torch.equal(_logits(model, input_ids), low)

    engine.landed = engine.issued
    assert torch.equal(_logits(model, input_ids), expected)  # committed on first use
    assert set(handle.bits().values()) == {16}
    assert handle.device_bytes() == handle.store.recount_device_bytes() == handle.max_bytes()

    handle.set_budget(handle.min_bytes())
    handle.set_budget(None)
    handle.set_budget(handle.min_bytes())  # demotion cancels the uploads in flight
    assert all(p.pending is None for p in handle.store.pages)
    assert handle.device_bytes() == handle.store.recount_device_bytes() == handle.min_bytes()
    handle.restore()


def test_restore_under_inference_mode_leaves_trainable_parameters(tokens):
    model = tiny_moe("qwen2_moe").train()
    input_ids = _inputs(tokens)
    with torch.inference_mode():
        handle = page_experts(model, expert_budget=None, calibration=[input_ids])
        handle.set_budget(int(0.3 * handle.full_bytes()))
        model(input_ids=input_ids)
        handle.restore()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = [p.grad for p in _expert_params(model).values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_apply_levels_and_bits_are_keyed_by_page(tokens):
    model = tiny_moe("mixtral")
    handle = page_experts(model)
    keys = list(handle.bits())
    assert keys[0] == PageKey(layer=0, proj=0, expert=0, block=0)
    wanted = {key: (8 if key.expert % 2 else 3) for key in keys}
    handle.apply_levels(wanted)
    assert handle.bits() == wanted
    assert handle.level_counts() == {16: 0, 8: len(keys) // 2, 4: 0, 3: len(keys) // 2, 2: 0}
    assert handle.device_bytes() == handle.store.recount_device_bytes()
    handle.restore()


def _rebuilt_from_host(store, page, level: int) -> torch.Tensor:
    """A page's weights at ``level`` from its host planes and that level's host metadata."""
    scale, minimum = page.meta(level)
    planes = page.host_planes[:level].unsqueeze(0)
    return dequantize(planes, scale.unsqueeze(0), minimum.unsqueeze(0), (1, *page.shape), torch.float32)[0]


def test_calibrated_codes_stay_pageable_and_each_level_uses_its_own_metadata(tokens):
    model = tiny_moe("mixtral")
    input_ids = _inputs(tokens, batch=4, length=64)
    plain = page_experts(model)
    rounded = [page.host_planes.clone() for page in plain.store.pages]
    plain.restore()
    handle = page_experts(model, calibration=[input_ids])
    store = handle.store
    # Error feedback changed the codes (they are no longer round-to-nearest) ...
    assert any(not torch.equal(page.host_planes, r) for page, r in zip(store.pages, rounded))
    handle.set_budget(handle.min_bytes())
    for level in (8, 4, 3, 2, 3, 8):  # down and up again: prefixes of one 8-bit code
        handle.apply_levels([level] * len(store.pages))
        assert handle.device_bytes() == store.recount_device_bytes() == sum(p.bytes_at(level) for p in store.pages)
        rebuilt = store.projection_weight(0, 1)
        for page in store.pages[: 2 * 8]:
            if page.key.proj == 1:
                assert torch.equal(page.current.scale, page.meta(level)[0])
                assert torch.equal(rebuilt[page.key.expert].float(), _rebuilt_from_host(store, page, level))
    # ... and the 8-bit code is within the 8-bit step of the weights it encodes.
    page = store.pages[0]
    step = page.meta(8)[0].float().repeat_interleave(store.group_size, dim=-1)
    assert ((_rebuilt_from_host(store, page, 8) - page.host_weight.float()).abs() <= 8 * step + 1e-6).all()
    handle.restore()


def test_calibrating_again_requantizes_the_pages_already_placed(tokens):
    model = tiny_moe("mixtral")
    handle = page_experts(model, expert_budget=None, calibration=[_inputs(tokens)])
    handle.set_budget(int(0.3 * handle.full_bytes()))
    before = [page.host_planes.clone() for page in handle.store.pages]
    handle.calibrate([_inputs(tokens, batch=4, length=64, offset=1000)])
    store = handle.store
    assert any(not torch.equal(page.host_planes, b) for page, b in zip(store.pages, before))
    assert handle.device_bytes() == store.recount_device_bytes() <= handle.budget
    rebuilt = store.projection_weight(0, 0)
    for page in store.pages:
        if page.key.layer == 0 and page.key.proj == 0 and page.level != 16:
            assert torch.equal(rebuilt[page.key.expert].float(), _rebuilt_from_host(store, page, page.level))
    handle.restore()


def test_promotions_between_bit_levels_keep_the_old_metadata_until_they_land(tokens, monkeypatch):
    engine = ManualCopyEngine(torch.device("cpu"))
    monkeypatch.setattr("lightning_superpipe.moe.api.SyncCopyEngine", lambda device: engine)
    model = tiny_moe("mixtral")
    input_ids = _inputs(tokens)
    handle = page_experts(model, options=PagingOptions(async_moves=False), calibration=[input_ids])
    engine.landed = engine.issued
    handle.set_budget(handle.min_bytes())
    engine.landed = engine.issued
    low = _logits(model, input_ids)
    store = handle.store
    page_id = 0
    extra = store.promotion_bytes(page_id, 4)
    before = handle.device_bytes()
    store.set_level(page_id, 4)
    page = store.pages[page_id]
    assert page.pending is not None and page.level == 2
    assert torch.equal(page.current.scale, page.meta(2)[0])  # still computing at 2 bits
    assert store.device_bytes() - before == extra == store.recount_device_bytes() - before
    assert extra == page.bytes_at(4) - page.bytes_at(2) + page.meta_nbytes()
    assert torch.equal(_logits(model, input_ids), low)
    engine.landed = engine.issued
    store.synchronize()
    assert page.level == 4 and torch.equal(page.current.scale, page.meta(4)[0])
    assert store.device_bytes() == store.recount_device_bytes() == before + page.bytes_at(4) - page.bytes_at(2)
    handle.restore()


@pytest.mark.parametrize("experts_at_once", [1, 3])
def test_requantizing_in_batches_writes_each_experts_own_codes(tokens, monkeypatch, experts_at_once):
    # All of one shape at once (every layer's experts), or 3 at a time (runs that cross from one layer to the next),
    # or one at a time: each expert's planes and metadata are the same.
    def paged_codes():
        handle = page_experts(tiny_moe("mixtral"), expert_budget=None, calibration=[_inputs(tokens)], progress=False)
        store = handle.store
        codes = [(page.host_planes.clone(), page.host_scale.clone(), page.host_minimum.clone()) for page in store.pages]
        handle.restore()
        return codes

    together = paged_codes()
    widths = 4  # levels 8, 4, 3, 2
    largest = max(rows * cols for rows, cols in [(256, 64), (64, 128)])  # the tiny Mixtral's gate_up and down
    monkeypatch.setattr("lightning_superpipe.moe.pages.REQUANTIZE_ELEMENTS", experts_at_once * widths * largest)
    batched = paged_codes()
    assert len(batched) == len(together) == 2 * 2 * 8
    for mine, theirs in zip(batched, together):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
