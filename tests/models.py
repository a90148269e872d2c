"""Small models and a LightningModule shared by the strategy tests: built from configs, nothing downloaded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

# NaN-aware: inf when either model holds a NaN or an inf, or when their tensors differ in name or shape.
from tests.families import max_relative_difference  # noqa: F401

VOCAB = 96
SEQ = 16


def gpt2(dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


def llama(dropout: float = 0.1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=dropout, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def vit(dropout: float = 0.1) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, num_labels=5, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return ViTForImageClassification(config)


def sequential(dropout: float = 0.1) -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Dropout(dropout), nn.Linear(48, 24), nn.LayerNorm(24))

    return nn.Sequential(nn.Linear(12, 24), nn.Sequential(*[block() for _ in range(4)]), nn.Linear(24, 3))


class Lion(torch.optim.Optimizer):
    """The Lion optimizer (Chen et al., 2023: the sign of an interpolated momentum, decoupled weight decay), as
    third-party packages write one: an optimizer the strategy does not know, for
    :func:`lightning_superpipe.register_per_parameter_optimizer`."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                exp_avg = state["exp_avg"]
                param.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(param.grad, alpha=1 - beta1).sign_()
                param.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(param.grad, alpha=1 - beta2)
        return loss


class Task(pl.LightningModule):
    """Trains ``model`` on a fixed batch stream and records every loss it sees.

    Args:
        build: Builds the model (called under the seed the test set).
        kind: ``"lm"`` (causal LM on token ids), ``"image"`` (classification of images) or ``"vector"``.
        optimizer: ``"adamw"`` (a for-loop), ``"adamw-fused"``, ``"sgd"``, ``"transformers-adafactor"`` (its
            defaults, two groups), ``"lion"`` (:class:`Lion`, two groups, a warm-up), or the name of another class of ``torch.optim`` (its defaults, ``lr``, two groups,
            a warm-up).
    """

    def __init__(self, build: Callable[[], nn.Module], kind: str, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model = build()
        self.kind = kind
        self.lr = lr
        self.optimizer_name = optimizer
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, batch: Any) -> Tensor:
        if self.kind == "lm":
            return self.model(input_ids=batch[0], labels=batch[0]).loss
        if self.kind == "image":
            return self.model(pixel_values=batch[0], labels=batch[1]).loss
        return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        if self.optimizer_name == "transformers-adafactor":  # its defaults: relative step sizes, no LR to schedule
            from transformers.optimization import Adafactor

            return Adafactor([{"params": decay, "weight_decay": 0.01}, {"params": no_decay}], lr=None)
        if self.optimizer_name == "lion":
            optimizer = Lion([{"params": decay, "weight_decay": 0.1}, {"params": no_decay}], lr=self.lr / 10)
        elif hasattr(torch.optim, self.optimizer_name):
            optimizer = getattr(torch.optim, self.optimizer_name)(
                [{"params": decay, "weight_decay": 0.01}, {"params": no_decay}], lr=self.lr
            )
        else:
            implementation = {"fused": True} if self.optimizer_name == "adamw-fused" else {"foreach": False}
            optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, **implementation
            )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def two_backwards_and_a_step(task: Task, batch: Any) -> None:
    """A manual-optimization step as users write one: two backwards (half a batch each), clipping by norm 0.5 through
    ``self.clip_gradients``, the step, the LR schedule (if any) stepped by hand, ``zero_grad``."""
    optimizer = task.optimizers()
    for half in batch[0].chunk(2):
        loss = task((half,))
        task.losses.append(loss.item())
        task.manual_backward(loss / 2)
    task.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    optimizer.step()
    if task.lr_schedulers() is not None:
        task.lr_schedulers().step()
    optimizer.zero_grad()


class UnfreezeLayersAtEpochOne(BaseFinetuning):
    """The usual transfer-learning schedule: train the head first, then the layers too."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.model.model.layers)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.model.layers, optimizer, lr=1e-2)


class HeadFirstTask(Task):
    def configure_optimizers(self) -> Any:  # UnfreezeLayersAtEpochOne adds the layers' group at epoch 1
        head = [p for n, p in self.named_parameters() if ".layers." not in n]
        return torch.optim.SGD(head, lr=self.lr, momentum=0.9)


def data(kind: str, batches: int = 24, batch_size: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    if kind == "lm":
        dataset = TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=generator))
    elif kind == "image":
        dataset = TensorDataset(torch.randn(n, 3, 16, 16, generator=generator), torch.randint(0, 5, (n,), generator=generator))
    else:
        dataset = TensorDataset(torch.randn(n, 12, generator=generator), torch.randint(0, 3, (n,), generator=generator))
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def tied(dropout: float = 0.1) -> nn.Module:
    """A stack whose first and last blocks share a layer, and whose output head is tied to its input."""
    shared = nn.Linear(24, 24)
    stack = nn.Sequential(
        nn.Sequential(shared, nn.GELU(), nn.Dropout(dropout)),
        nn.Sequential(nn.Linear(24, 24), nn.GELU()),
        nn.Sequential(nn.Linear(24, 24), shared, nn.LayerNorm(24)),
    )
    return nn.Sequential(nn.Linear(12, 24), stack, nn.Linear(24, 3))


FAMILIES = {"gpt2": (gpt2, "lm"), "llama": (llama, "lm"), "vit": (vit, "image"), "sequential": (sequential, "vector"), "tied": (tied, "vector")}


def trainer(strategy: Any, **overrides: Any) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_steps=10, accumulate_grad_batches=2, gradient_clip_val=0.5,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
    )
    options.update(overrides)
    return pl.Trainer(strategy=strategy, **options)


def build_task(family: str, seed: int = 7, **kwargs: Any) -> Task:
    build, kind = FAMILIES[family]
    pl.seed_everything(seed, verbose=False)
    return Task(build, kind, **kwargs)


def extra_slot_references(engine: Any) -> list[int]:
    """For each slot, the references to its storage beyond the slot's own tensor (and the temporary storage object
    asked for the count): 0 when nothing, autograd included, holds a view of it."""
    engine.copier.synchronize()  # an emulated link's queued copies hold views of the slots they fill
    return [torch._C._storage_Use_Count(slot.flat.untyped_storage()._cdata) - 2 for slot in engine._slots]


def fit_task(make: Callable[[], Task], strategy: Any, train: DataLoader, val: DataLoader | None = None, seed: int = 7, **overrides: Any) -> Task:
    """Builds a task under ``seed`` and fits it under ``seed + 1``, so that two runs differ only in ``strategy``."""
    pl.seed_everything(seed, verbose=False)
    task = make()
    pl.seed_everything(seed + 1, verbose=False)
    trainer(strategy, **overrides).fit(task, train, val)
    return task


def fit(family: str, strategy: Any, seed: int = 7, optimizer: str = "adamw", **overrides: Any) -> Task:
    build, kind = FAMILIES[family]
    return fit_task(lambda: Task(build, kind, optimizer=optimizer), strategy, data(kind), seed=seed, **overrides)


@contextmanager
def fresh_initial_values() -> Iterator[dict[str, bool]]:
    """Spies on the disk tier's deferred init inside: for each block parameter it wrote, whether its values were made
    apart from the parameter's own memory (``True``: the parameter was never initialized whole in host memory)."""
    from lightning_superpipe.streaming.deferred_init import DeferredInit

    fresh: dict[str, bool] = {}
    original = DeferredInit.initial_values

    def spy(self: DeferredInit, block: Any) -> dict[str, Tensor]:
        values = original(self, block)
        fresh.update({name: values[name].data_ptr() != block[name].data_ptr() for name in block})
        return values

    DeferredInit.initial_values = spy  # type: ignore[method-assign]
    try:
        yield fresh
    finally:
        DeferredInit.initial_values = original  # type: ignore[method-assign]
