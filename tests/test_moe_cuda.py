"""CUDA-only paths: pinned host copies, asynchronous uploads, real device memory (skipped without a GPU)."""

import pytest
import torch

from lightning_superpipe.moe import page_experts
from lightning_superpipe.moe.pages import CudaCopyEngine
from lightning_superpipe.moe.testing import byte_corpus, tiny_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model() -> torch.nn.Module:
    return tiny_moe("mixtral", hidden_size=256, intermediate_size=512).to("cuda", torch.bfloat16)


def _inputs() -> torch.Tensor:
    return byte_corpus()[: 4 * 128].view(4, 128).cuda()


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_device_memory_follows_the_accounting():
    model = _model()
    input_ids = _inputs()
    expected = _logits(model, input_ids)
    expert_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    handle = page_experts(model, expert_budget=int(0.3 * expert_bytes), calibration=[input_ids])
    assert isinstance(handle.store.copy, CudaCopyEngine)
    assert all(page.host_weight.is_pinned() and page.host_planes.is_pinned() for page in handle.store.pages)
    handle.synchronize()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    # Allocations are rounded up to 512 bytes; each page holds at most 7 tensors.
    slack = 512 * 7 * len(handle.store.pages)
    assert abs((after - before) - (handle.device_bytes() - expert_bytes)) <= slack
    assert handle.device_bytes() <= int(0.3 * expert_bytes)

    handle.set_budget(None)  # asynchronous promotions; computing goes on meanwhile
    _logits(model, input_ids)
    handle.synchronize()
    handle.rebalance()
    handle.synchronize()
    assert set(handle.bits().values()) == {16}
    assert torch.equal(_logits(model, input_ids), expected)
    handle.restore()
    assert all(p.is_cuda for p in model.parameters())
    assert torch.equal(_logits(model, input_ids), expected)


def test_budget_holds_with_uploads_in_flight():
    model = _model()
    input_ids = _inputs()
    handle = page_experts(model, calibration=[input_ids])
    budgets = torch.linspace(handle.max_bytes(), handle.min_bytes(), 6).long().tolist()
    for budget in budgets + budgets[::-1]:
        handle.set_budget(budget)
        assert handle.device_bytes() <= budget
        _logits(model, input_ids)
        assert handle.device_bytes() <= budget
        assert handle.device_bytes() == handle.store.recount_device_bytes()
    handle.restore()
