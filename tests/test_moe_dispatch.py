"""What the paged experts forward runs: the original tensors at a full budget, batched rebuilds below it."""

import pytest
import torch

from lightning_superpipe.moe import PagingOptions, page_experts
from lightning_superpipe.moe import experts as experts_module
from lightning_superpipe.moe import pages as pages_module
from lightning_superpipe.moe.damage import RoutingStats
from lightning_superpipe.moe.testing import tiny_moe


def _inputs(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(0))


def _count_dequantize(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the leading shape of every rebuild the store makes."""
    calls: list[tuple[int, ...]] = []
    original = pages_module.dequantize

    def counted(planes, scale, minimum, shape, dtype):
        calls.append(tuple(shape[:-2]))
        return original(planes, scale, minimum, shape, dtype)

    monkeypatch.setattr(pages_module, "dequantize", counted)
    return calls


def test_full_budget_runs_the_original_tensors_without_rebuilding(monkeypatch):
    model = tiny_moe("mixtral")
    model.set_experts_implementation("grouped_mm")
    pointers = {name: p.data_ptr() for name, p in model.named_parameters() if ".experts." in name}
    handle = page_experts(model)
    calls = _count_dequantize(monkeypatch)
    handed: dict[int, list[int]] = {}
    original = experts_module.ExpertsRuntime.weights

    def recorded(self, layer, top_k_index):
        weights = original(self, layer, top_k_index)
        handed[layer] = [w.data_ptr() for w in weights]
        return weights

    monkeypatch.setattr(experts_module.ExpertsRuntime, "weights", recorded)
    with torch.no_grad():
        model(input_ids=_inputs())
    assert sorted(handed) == [0, 1] and not calls  # both layers ran, nothing was rebuilt
    for layer in range(2):  # the very tensors the parameters held: no copy either
        prefix = f"model.layers.{layer}.mlp.experts."
        assert handed[layer] == [pointers[prefix + "gate_up_proj"], pointers[prefix + "down_proj"]]
    handle.restore()


def test_below_a_full_budget_each_projection_is_rebuilt_once_per_level(monkeypatch):
    model = tiny_moe("mixtral")
    handle = page_experts(model, options=PagingOptions(rows_per_page=32))
    levels = [8 if page.key.expert % 2 else 3 for page in handle.store.pages]
    handle.set_budget(sum(page.bytes_at(level) for page, level in zip(handle.store.pages, levels)))
    handle.apply_levels(levels)  # exactly the budget: the planner has nothing to move
    calls = _count_dequantize(monkeypatch)
    input_ids = torch.arange(256).view(4, 64)  # every expert gets tokens
    with torch.no_grad():
        model(input_ids=input_ids)
    assert [page.level for page in handle.store.pages] == levels
    # 2 layers x 2 projections x 2 levels, each rebuild covering all its experts' row blocks at once.
    assert len(calls) == 2 * 2 * 2
    blocks = {0: 256 // 32, 1: 64 // 32}  # gate_up_proj [E, 256, 64], down_proj [E, 64, 128] in 32-row pages
    assert sorted(calls) == sorted([(4 * blocks[proj],) for _ in range(2) for proj in (0, 1) for _ in range(2)])
    handle.restore()


def test_routing_counts_fold_with_the_half_life_of_every_call():
    layers = page_experts(tiny_moe("mixtral")).layers
    stats = RoutingStats(layers, half_life_tokens=4.0, prior_tokens=0.0)
    stats.attach()
    calls = [torch.tensor([[0, 1], [0, 2]]), torch.tensor([[3, 1]]), torch.tensor([[0, 3], [2, 1], [1, 0], [9, 0]])]
    for index in calls:
        stats.observe(0, index)
    # The same counts folded one call at a time: counts = counts * 0.5 ** (tokens / half-life) + new.
    counts, tokens = torch.zeros(8, dtype=torch.float64), 0.0
    for index in calls:
        decay = 0.5 ** (index.shape[0] / 4.0)
        counts = counts * decay + torch.bincount(index.reshape(-1), minlength=10)[:8].double()
        tokens = tokens * decay + index.shape[0]
    shares = stats.shares()[0]
    assert torch.allclose(shares, counts / tokens, rtol=1e-12, atol=0)
    assert stats.top_k[0] == 2
    assert stats.tokens_seen() == pytest.approx(tokens / 2)  # averaged over the two routed layers
