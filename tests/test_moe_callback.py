"""PagedMoECallback: one Trainer fine-tunes, then validates/tests/predicts with paged experts."""

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_superpipe import PagedMoECallback
from lightning_superpipe.moe.experts import PAGED_EXPERTS_IMPLEMENTATION
from lightning_superpipe.moe.testing import byte_corpus, tiny_moe


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)


class LitMoE(pl.LightningModule):
    def __init__(self, fail_validation: bool = False):
        super().__init__()
        self.model = tiny_moe("qwen2_moe").train()
        self.implementations: list[str] = []
        self.fail_validation = fail_validation

    def _loss(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.implementations.append(self.model.config._experts_implementation)
        if self.fail_validation:
            raise RuntimeError("validation failed on purpose")
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch).logits.argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def loader():
    windows = byte_corpus()[: 8 * 4 * 64].view(-1, 64)
    return DataLoader(windows, batch_size=4)


def _trainer(callback, logger=None, **overrides):
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        num_sanity_val_steps=1,
        logger=logger or False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


def _expert_params(module):
    return {name: p for name, p in module.named_parameters() if ".experts." in name}


def test_fit_then_validate_test_and_predict_under_a_budget(loader):
    module = LitMoE()
    params = _expert_params(module)
    initial = {name: p.detach().clone() for name, p in params.items()}
    callback = PagedMoECallback(expert_budget="30%", calibration_batches=2, measure_quality=True)
    logger = RecordingLogger()
    trainer = _trainer(callback, logger)

    trainer.fit(module, loader, loader)
    # Sanity check unpaged, the two validations during fit paged.
    assert module.implementations == ["eager"] + [PAGED_EXPERTS_IMPLEMENTATION] * 4
    after_fit = _expert_params(module)
    assert all(after_fit[name] is params[name] for name in params)  # the optimizer's parameters
    assert all(p.requires_grad for p in after_fit.values())
    changed = sum(not torch.equal(p, initial[name]) for name, p in after_fit.items())
    assert changed == len(params)  # training went on after each paged validation
    trained = {name: p.detach().clone() for name, p in after_fit.items()}

    trainer.validate(module, loader)
    assert all(torch.equal(p, trained[name]) for name, p in _expert_params(module).items())
    report = callback.reports["validate"]
    budget = int(0.3 * report["expert_bytes_16bit"])
    assert report["expert_bytes_device_max"] <= budget
    assert report["expert_bytes_fraction"] <= 0.3
    # 2 layers x (2 projections x 8 routed experts + 3 linears of the shared expert).
    assert sum(report[f"pages_{b}bit"] for b in (16, 8, 4, 3, 2)) == 2 * (2 * 8 + 3)
    assert report["tokens_per_s"] > 0
    assert report["ppl_paged"] > 0 and report["kl_to_full"] > 0
    assert report["ppl_change"] == pytest.approx(report["ppl_paged"] / report["ppl_full"] - 1)
    assert abs(report["ppl_change"]) < 0.05
    # The full-precision reference is the unpaged model: same perplexity as computed directly.
    module.model.eval()
    with torch.no_grad():
        losses = [module.model(input_ids=batch, labels=batch).loss for batch in list(loader)[:2]]
    assert report["ppl_full"] == pytest.approx(math.exp(sum(losses).item() / 2), rel=1e-4)
    assert logger.metrics["paged_moe/validate/expert_bytes_16bit"] == report["expert_bytes_16bit"]

    trainer.test(module, loader)
    assert callback.reports["test"]["expert_bytes_device_max"] <= budget
    predictions = trainer.predict(module, loader)
    assert len(predictions) == 2 and predictions[0].shape == (4, 64)
    assert callback.reports["predict"]["promotions"] >= 0
    assert module.model.config._experts_implementation == "eager"


def test_weights_are_restored_when_validation_fails(loader):
    module = LitMoE(fail_validation=True)
    params = _expert_params(module)
    before = {name: p.detach().clone() for name, p in params.items()}
    callback = PagedMoECallback(expert_budget="25%", calibration_batches=1)
    with pytest.raises(RuntimeError, match="on purpose"):
        _trainer(callback).validate(module, loader)
    assert module.implementations == [PAGED_EXPERTS_IMPLEMENTATION]
    assert callback.handle is None
    restored = _expert_params(module)
    assert all(restored[name] is params[name] and torch.equal(restored[name], before[name]) for name in params)


def test_stages_can_be_chosen_and_settings_are_checked(loader):
    module = LitMoE()
    callback = PagedMoECallback(expert_budget=None, stages=("test",))
    _trainer(callback).validate(module, loader)
    assert module.implementations == ["eager", "eager"]
    assert "validate" not in callback.reports
    with pytest.raises(ValueError, match="a bare float is ambiguous .* '50%'"):
        PagedMoECallback(expert_budget=0.5)
    with pytest.raises(ValueError, match="unknown stages"):
        PagedMoECallback(stages=("fit",))
