"""PagedMoECallback under SuperpipeStrategy: pages on the compute device, the paged experts no longer stream."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_superpipe import EmulatedLink, PagedMoECallback, SuperpipeStrategy
from lightning_superpipe.moe import expert_parameters
from lightning_superpipe.moe.experts import PAGED_EXPERTS_IMPLEMENTATION
from lightning_superpipe.moe.testing import byte_corpus, tiny_moe
from tests import moe_families


class LitMoE(pl.LightningModule):
    def __init__(self, family: str = "qwen2_moe") -> None:
        super().__init__()
        self.model = tiny_moe(family).train()
        self.val_losses: list[torch.Tensor] = []
        self.streamed: list[dict[str, object]] = []
        self.train_block_bytes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.train_block_bytes.append(self.trainer.strategy.engine.largest_block_bytes())
        return self.model(input_ids=batch, labels=batch).loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.val_losses.append(loss.detach().clone())
        engine = self.trainer.strategy.engine
        self.streamed.append({
            "implementation": self.model.config._experts_implementation,
            "largest_block_bytes": engine.largest_block_bytes(),
            "device_bytes": engine.ledger.total_bytes,
            "link_bytes": self.trainer.strategy.link.stats.bytes if self.trainer.strategy.link else None,
        })
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def loader() -> DataLoader:
    return DataLoader(byte_corpus()[: 6 * 4 * 64].view(-1, 64), batch_size=4)


def _trainer(strategy, callbacks=(), **overrides) -> pl.Trainer:
    settings = dict(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=4, val_check_interval=2,
        check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
        callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


def _expert_bytes(module: LitMoE) -> int:
    return sum(p.numel() * p.element_size() for p in expert_parameters(module.model))


@pytest.mark.parametrize("link", [None, "lazy", "thread"])
def test_at_a_full_budget_validation_equals_unpaged_streaming_and_the_experts_stop_streaming(loader, link) -> None:
    """Full budget: the paged forward computes with the original weights, now from pages on the compute device,
    so the losses are bit for bit the unpaged streamed model's, while the link carries only the other weights."""
    links = {}

    def strategy(name: str) -> SuperpipeStrategy:
        links[name] = EmulatedLink(mode=link, seed=3) if link else None
        # One slot: every block streams in again at every batch.
        return SuperpipeStrategy(resident_blocks=0, prefetch=0, link=links[name])

    torch.manual_seed(0)
    plain = LitMoE()
    paged = LitMoE()
    paged.load_state_dict(plain.state_dict())
    _trainer(strategy("plain")).validate(plain, loader, verbose=False)
    # Calibration (GPTQ over every expert page, op by op under the link's checker: 25 of the case's 30 s) runs on
    # the CPU link and the lazy one, which delays every copy the most; at a full budget every page keeps 16 bits.
    callback = PagedMoECallback(expert_budget=None, calibration_batches=0 if link == "thread" else 1)
    _trainer(strategy("paged"), [callback]).validate(paged, loader, verbose=False)

    assert [r["implementation"] for r in paged.streamed] == [PAGED_EXPERTS_IMPLEMENTATION] * 2
    assert all(torch.equal(a, b) for a, b in zip(paged.val_losses, plain.val_losses, strict=True))
    # Each block's device copy lost exactly its experts (both blocks are alike; alignment keeps offsets whole).
    experts_per_block = _expert_bytes(paged) // 2
    full_block, paged_block = plain.streamed[0]["largest_block_bytes"], paged.streamed[0]["largest_block_bytes"]
    assert full_block - paged_block == pytest.approx(experts_per_block, rel=0.02)
    assert paged_block < full_block / 2  # the experts are most of a MoE block
    assert paged.streamed[0]["device_bytes"] == plain.streamed[0]["device_bytes"] - experts_per_block  # one slot
    # On the device now: the fp32 originals, as many bytes as stopped streaming.
    assert callback.handle is None and callback.reports["validate"]["expert_bytes_device"] == _expert_bytes(paged)
    if link:
        assert not links["paged"].stats.violations and not links["plain"].stats.violations
        # What one batch's forward streamed: its 2 blocks, without their experts when paged.
        per_batch = {name: m.streamed[1]["link_bytes"] - m.streamed[0]["link_bytes"]
                     for name, m in (("plain", plain), ("paged", paged))}
        assert per_batch["plain"] == 2 * full_block
        assert per_batch["paged"] == 2 * paged_block


def test_fit_with_paged_validations_trains_exactly_as_without_them(loader) -> None:
    """Paging for validation and handing the experts back to streaming afterwards changes no training step."""
    torch.manual_seed(0)
    reference = LitMoE()
    paged = LitMoE()
    paged.load_state_dict(reference.state_dict())
    _trainer(SuperpipeStrategy(resident_blocks=1, prefetch=1)).fit(reference, loader, loader)
    callback = PagedMoECallback(expert_budget="30%", calibration_batches=1)
    _trainer(SuperpipeStrategy(resident_blocks=1, prefetch=1), [callback]).fit(paged, loader, loader)

    assert [r["implementation"] for r in paged.streamed] == [PAGED_EXPERTS_IMPLEMENTATION] * 4
    assert not torch.equal(paged.val_losses[0], reference.val_losses[0])  # below full budget: really paged
    # Training streams the experts again after each paged validation.
    assert paged.train_block_bytes == reference.train_block_bytes
    assert paged.streamed[0]["largest_block_bytes"] < reference.streamed[0]["largest_block_bytes"]
    for (name, a), b in zip(paged.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    report = callback.reports["validate"]
    assert report["expert_bytes_device_max"] <= 0.3 * report["expert_bytes_16bit"]


@pytest.fixture
def paged_devices(monkeypatch) -> dict[str, torch.device]:
    """Where page_experts, as the callback calls it, put the pages and left the experts' masters."""
    import lightning_superpipe.moe.callback as callback_module

    seen: dict[str, torch.device] = {}
    original = callback_module.page_experts

    def recording(model, **kwargs):
        handle = original(model, **kwargs)
        seen["pages"] = handle.store.device
        seen["masters"] = next(iter(handle._params.values())).device
        return handle

    monkeypatch.setattr(callback_module, "page_experts", recording)
    return seen


def test_pages_go_to_the_strategys_device_not_the_host_masters_device(loader, paged_devices) -> None:
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    _trainer(strategy, [PagedMoECallback(expert_budget="50%", calibration_batches=1)]).validate(LitMoE(), loader)
    assert paged_devices == {"pages": strategy.root_device, "masters": torch.device("cpu")}


def test_the_disk_tier_refuses_paged_experts_and_loses_nothing(loader, tmp_path) -> None:
    module = LitMoE()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    strategy = SuperpipeStrategy(offload_device="disk", offload_path=tmp_path, resident_blocks=0, prefetch=1)
    callback = PagedMoECallback(expert_budget="50%", calibration_batches=1)
    with pytest.raises(RuntimeError, match="offload_device='disk'"):
        _trainer(strategy, [callback]).validate(module, loader)
    assert callback.handle is None
    assert module.model.config._experts_implementation != PAGED_EXPERTS_IMPLEMENTATION
    for name, param in module.named_parameters():
        assert torch.equal(param, before[name]), name


def test_only_block_parameters_can_be_withheld(loader) -> None:
    module = LitMoE()
    trainer = _trainer(SuperpipeStrategy(resident_blocks=0, prefetch=1), limit_val_batches=1)
    trainer.validate(module, loader, verbose=False)
    strategy = trainer.strategy
    strategy.model_to_device()  # streaming again, as inside a stage
    try:
        with pytest.raises(ValueError, match="do not stream with a block"):
            strategy.engine.withhold([module.model.model.embed_tokens.weight])
        assert module.model.model.embed_tokens.weight not in strategy.engine.withheld
    finally:
        strategy.teardown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pages_live_on_the_gpu_and_the_masters_on_the_host(loader, paged_devices) -> None:
    module = LitMoE()
    callback = PagedMoECallback(expert_budget="50%", calibration_batches=1)
    trainer = _trainer(SuperpipeStrategy(resident_blocks=0, prefetch=1), [callback], accelerator="gpu")
    trainer.validate(module, loader, verbose=False)
    assert paged_devices["pages"].type == "cuda" and paged_devices["masters"].type == "cpu"
    report = callback.reports["validate"]
    assert 0 < report["expert_bytes_device_max"] <= 0.5 * report["expert_bytes_16bit"]
    assert all(p.device.type == "cpu" for p in module.parameters())


class _FamilyModule(pl.LightningModule):
    """A fused-experts family as a user builds it (its default experts implementation), validated on fixed inputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.logits: list[torch.Tensor] = []
        self.unstreamed: list[int] = []  # elements of the blocks' homes that do not stream now

    def validation_step(self, batch, batch_idx):
        self.logits.append(self.model(input_ids=batch).logits.detach().clone())
        engine = self.trainer.strategy.engine
        blocks = [i for i, home in enumerate(engine.homes) if home is not None]
        at_home = sum(piece.numel for i in blocks for piece in engine.homes[i].slices)
        self.unstreamed.append(at_home - sum(piece.numel for i in blocks for piece in engine.streamed_slices(i)))


def _validate_streamed(model: torch.nn.Module, inputs: torch.Tensor, callbacks: list) -> _FamilyModule:
    module = _FamilyModule(model)
    strategy = SuperpipeStrategy(resident_blocks=0, prefetch=1)
    _trainer(strategy, callbacks).validate(module, DataLoader(list(inputs), batch_size=None), verbose=False)
    assert len(module.logits) == 1
    return module


@pytest.mark.parametrize("model_type", moe_families.buildable_model_types())
def test_every_fused_experts_family_pages_under_superpipe_exactly_at_a_full_budget(model_type) -> None:
    """Each family streamed with its experts paged at a full budget computes the logits of the same model streamed
    unpaged bit for bit, and its blocks stream without exactly the paged weights. Against the unstreamed model the
    logits agree to fp32's tolerance: on some CPUs the math library's last bits depend on where tensors sit in memory
    (Jamba's, by 1e-7, under MKL's reproducible mode), which streaming changes."""
    model = moe_families.build(model_type).eval()
    inputs = torch.randint(0, 256, (1, 2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = [model(input_ids=batch).logits for batch in inputs]
    unpaged = _validate_streamed(model, inputs, [])
    paged_numel = sum(p.numel() for p in expert_parameters(model))
    callback = PagedMoECallback(expert_budget=None, calibration_batches=0)  # calibration places pages: none here
    module = _validate_streamed(model, inputs, [callback])
    for got, want, plain in zip(module.logits, unpaged.logits, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, plain)
    assert module.unstreamed == [paged_numel]
