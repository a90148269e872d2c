"""The one LightningModule and the one Trainer factory of the strategy tests, the quick example models, and the
helpers to train and compare: built from configs, nothing downloaded.

Two ways in:

* the quick examples (:data:`EXAMPLES`: ``gpt2``, ``llama``, ``vit``, ``sequential``, ``tied``) on tuple batches of
  :func:`tests.batches.data`, through :func:`build_task`, :func:`fit` and :func:`fit_task` (10 steps of 2
  micro-batches, gradients clipped to norm 0.5, AdamW at 1e-2 with a warm-up);
* the model families of :mod:`tests.families` on their own dict batches, through :func:`build_family_task` and
  :func:`fit_family` (4 steps of 2 micro-batches, no clipping, AdamW at 1e-3).

Both train a :class:`Task` with :func:`trainer`, and compare with :func:`max_relative_difference` and
:func:`max_relative_loss_difference`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Mapping, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tests.batches import SEQ, VOCAB, data
from tests.families import FAMILIES, Family, get

Loss = Callable[[nn.Module, Any], Tensor]

SEED = 7
ACCUMULATE = 2

# ------------------------------------------------------------------------------------------- the quick examples


def gpt2(dropout: float = 0.1) -> nn.Module:
    """GPT-2, 3 layers, dropout ``dropout`` everywhere, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


def llama(dropout: float = 0.1) -> nn.Module:
    """Llama, 3 layers, GQA, attention dropout ``dropout``, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=dropout, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def vit(dropout: float = 0.1) -> nn.Module:
    """A ViT classifier of 16x16 images in 5 classes, 3 layers."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, num_labels=5, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return ViTForImageClassification(config)


def sequential(dropout: float = 0.1) -> nn.Module:
    """A plain ``nn.Sequential``: an input layer, 4 MLP blocks in a ``nn.Sequential``, a head (12 -> 3)."""

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Dropout(dropout), nn.Linear(48, 24), nn.LayerNorm(24))

    return nn.Sequential(nn.Linear(12, 24), nn.Sequential(*[block() for _ in range(4)]), nn.Linear(24, 3))


def tied(dropout: float = 0.1) -> nn.Module:
    """A stack whose first and last blocks share a layer, and whose output head is tied to its input."""
    shared = nn.Linear(24, 24)
    stack = nn.Sequential(
        nn.Sequential(shared, nn.GELU(), nn.Dropout(dropout)),
        nn.Sequential(nn.Linear(24, 24), nn.GELU()),
        nn.Sequential(nn.Linear(24, 24), shared, nn.LayerNorm(24)),
    )
    return nn.Sequential(nn.Linear(12, 24), stack, nn.Linear(24, 3))


#: name -> (builder, kind of its batches in :func:`tests.batches.data`)
EXAMPLES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "lm"), "llama": (llama, "lm"), "vit": (vit, "image"), "sequential": (sequential, "vector"),
    "tied": (tied, "vector"),
}


def _lm_loss(model: nn.Module, batch: Any) -> Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _image_loss(model: nn.Module, batch: Any) -> Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


def _vector_loss(model: nn.Module, batch: Any) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


#: The loss of each kind of tuple batch of :func:`tests.batches.data`.
KIND_LOSSES: dict[str, Loss] = {"lm": _lm_loss, "image": _image_loss, "vector": _vector_loss}

# ------------------------------------------------------------------------------------------------ the optimizers


class Lion(torch.optim.Optimizer):
    """The Lion optimizer (Chen et al., 2023: the sign of an interpolated momentum, decoupled weight decay), as
    third-party packages write one: an optimizer the strategy does not know, for
    :func:`lightning_superpipe.register_per_parameter_optimizer`."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Lion step of every parameter with a gradient."""
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


def _two_groups(
    parameters: list[tuple[str, nn.Parameter]], decay: float, no_decay: float | None
) -> list[dict[str, Any]]:
    """Matrices (``ndim >= 2``) decayed by ``decay``, the rest by ``no_decay`` (the optimizer's default if
    ``None``); a group left empty is dropped."""
    groups: list[dict[str, Any]] = [{"params": [p for _, p in parameters if p.ndim >= 2], "weight_decay": decay}]
    groups.append({"params": [p for _, p in parameters if p.ndim < 2]})
    if no_decay is not None:
        groups[1]["weight_decay"] = no_decay
    return [group for group in groups if group["params"]]


# ---------------------------------------------------------------------------------------------- the LightningModule


class Task(pl.LightningModule):
    """Trains a model with a loss on a fixed batch stream and records every loss it sees.

    Args:
        build: Builds the model (called here, under the seed the caller set).
        kind: How batches look: ``"lm"``, ``"image"`` or ``"vector"`` for the tuples of :func:`tests.batches.data`
            (their loss is then :data:`KIND_LOSSES`), or a :attr:`Family.kind <tests.families.Family.kind>`.
        lr: The learning rate.
        optimizer: ``"adamw"`` (``foreach=False``: a for-loop), ``"adamw-fused"``, ``"sgd"`` (momentum 0.9, one
            group, never scheduled), ``"transformers-adafactor"`` (its defaults: relative step sizes, nothing to
            schedule), ``"lion"`` (:class:`Lion` at ``lr / 10``), or the name of another class of ``torch.optim``
            (its defaults, ``lr``). All but SGD split the parameters in two groups: matrices decayed, the rest not
            (AdamW and Lion) or by the optimizer's default (the others).
        schedule: Adds a per-step linear LR warm-up over 4 steps (to every optimizer but SGD and Adafactor).
        loss: ``loss(model, batch)``, the scalar training loss; by default the loss of ``kind``.
    """

    def __init__(
        self, build: Callable[[], nn.Module], kind: str, lr: float = 1e-2, optimizer: str = "adamw",
        schedule: bool = True, loss: Loss | None = None,
    ) -> None:
        super().__init__()
        self.model = build()
        self.kind = kind
        self.loss_function = KIND_LOSSES[kind] if loss is None else loss
        self.lr = lr
        self.optimizer_name = optimizer
        self.schedule = schedule
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    @classmethod
    def of(cls, family: str | Family, lr: float = 1e-3, optimizer: str = "adamw", schedule: bool = False) -> Task:
        """The task of a :mod:`tests.families` family (its model, its kind, its loss); its model is built here."""
        f = get(family)
        return cls(f.build, f.kind, lr=lr, optimizer=optimizer, schedule=schedule, loss=f.loss)

    def forward(self, batch: Any) -> Tensor:
        """The loss of ``batch``."""
        return self.loss_function(self.model, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss, recorded in ``losses``."""
        loss = self(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss, recorded in ``val_losses`` and logged as ``val_loss``."""
        loss = self(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """The optimizer ``optimizer`` names, with the warm-up if ``schedule``."""
        parameters = list(self.named_parameters())
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.optimizer_name == "transformers-adafactor":
            from transformers.optimization import Adafactor

            return Adafactor(_two_groups(parameters, 0.01, None), lr=None)
        if self.optimizer_name == "lion":
            optimizer: torch.optim.Optimizer = Lion(_two_groups(parameters, 0.1, None), lr=self.lr / 10)
        elif hasattr(torch.optim, self.optimizer_name):
            optimizer = getattr(torch.optim, self.optimizer_name)(_two_groups(parameters, 0.01, None), lr=self.lr)
        else:
            implementation = {"fused": True} if self.optimizer_name == "adamw-fused" else {"foreach": False}
            optimizer = torch.optim.AdamW(_two_groups(parameters, 0.1, 0.0), lr=self.lr, **implementation)
        if not self.schedule:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


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
        """Freezes the decoder layers."""
        self.freeze(pl_module.model.model.layers)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        """Unfreezes the decoder layers at epoch 1, in a new parameter group."""
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.model.layers, optimizer, lr=1e-2)


class HeadFirstTask(Task):
    """A task whose optimizer holds all but the decoder layers, for :class:`UnfreezeLayersAtEpochOne`."""

    def configure_optimizers(self) -> Any:
        """SGD over the parameters outside ``.layers.``; the callback adds the layers' group at epoch 1."""
        head = [p for n, p in self.named_parameters() if ".layers." not in n]
        return torch.optim.SGD(head, lr=self.lr, momentum=0.9)


# ------------------------------------------------------------------------------------------------------- training


def trainer(strategy: Any, **overrides: Any) -> pl.Trainer:
    """The comparison Trainer: CPU, deterministic, nothing logged or saved, 10 steps of 2 micro-batches, gradients
    clipped to norm 0.5, no validation; ``overrides`` replace any of these."""
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=10, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.5,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
    )
    options.update(overrides)
    return pl.Trainer(strategy=strategy, **options)


def fit_task(
    make: Callable[[], Task], strategy: Any, train: DataLoader, val: DataLoader | None = None, seed: int = SEED,
    **overrides: Any,
) -> Task:
    """Builds a task under ``seed`` and fits it under ``seed + 1``, so that two runs differ only in ``strategy``."""
    pl.seed_everything(seed, verbose=False)
    task = make()
    pl.seed_everything(seed + 1, verbose=False)
    trainer(strategy, **overrides).fit(task, train, val)
    return task


def build_task(example: str, seed: int = SEED, **task_options: Any) -> Task:
    """The task of a quick example of :data:`EXAMPLES` with its initial weights, exactly as :func:`fit` builds it."""
    build, kind = EXAMPLES[example]
    pl.seed_everything(seed, verbose=False)
    return Task(build, kind, **task_options)


def fit(example: str, strategy: Any, seed: int = SEED, optimizer: str = "adamw", **overrides: Any) -> Task:
    """Trains a quick example of :data:`EXAMPLES` on its 24 batches with :func:`trainer` (``overrides`` replace
    its options) and returns the task."""
    build, kind = EXAMPLES[example]
    return fit_task(lambda: Task(build, kind, optimizer=optimizer), strategy, data(kind), seed=seed, **overrides)


def build_family_task(name: str | Family, seed: int = SEED, **task_options: Any) -> Task:
    """The task of a :mod:`tests.families` family with its initial weights, exactly as :func:`fit_family` builds
    it (``task_options`` as in :meth:`Task.of`)."""
    pl.seed_everything(seed, verbose=False)
    return Task.of(name, **task_options)


def fit_family(
    name: str | Family, strategy: Any, steps: int = 4, seed: int = SEED, *, validate: bool = False,
    lr: float = 1e-3, optimizer: str = "adamw", schedule: bool = False, **trainer_overrides: Any,
) -> Task:
    """Trains a :mod:`tests.families` family ``steps`` optimizer steps (``2 * steps`` micro-batches, the family's
    default dropout on, no clipping) and returns the task (``task.losses``: one per micro-batch;
    ``task.val_losses`` with ``validate``).

    Seeds before building (``seed``) and before fitting (``seed + 1``), so two runs with ``strategy="auto"``
    are bitwise identical. ``validate`` adds 2 validation batches (another seed) after every epoch; pass
    ``val_check_interval`` etc. in ``trainer_overrides`` for more.
    """
    f = get(name)
    micro_batches = trainer_overrides.get("accumulate_grad_batches", ACCUMULATE) * steps
    options: dict[str, Any] = dict(max_steps=steps, gradient_clip_val=None)
    options.update(trainer_overrides)
    val = None
    if validate:
        options.setdefault("limit_val_batches", 2)
        val = f.data(2, seed + 1000)
    make = lambda: Task.of(f, lr=lr, optimizer=optimizer, schedule=schedule)  # noqa: E731
    return fit_task(make, strategy, f.data(micro_batches, seed), val, seed=seed, **options)


# ------------------------------------------------------------------------------------------------- the plain runs


class Finished:
    """What a finished run leaves to compare against: its losses, its validation losses and its final state (a
    detached copy), read like a :class:`Task` by the comparisons (``losses``, ``val_losses``, ``state_dict()``)."""

    def __init__(self, task: Task) -> None:
        self.losses = list(task.losses)
        self.val_losses = list(task.val_losses)
        self._state = {key: value.detach().clone() for key, value in task.state_dict().items()}

    def state_dict(self) -> dict[str, Tensor]:
        """The final weights and buffers."""
        return self._state


_PLAIN_RUNS: dict[Any, Finished] = {}


def once(key: Any, run: Callable[[], Task]) -> Finished:
    """``run()``'s result, run once per test process for each ``key``: for the plain Lightning runs that several
    cases of a test (its emulated-link modes, its strategy knobs) compare against. A plain run does not depend on
    the case (the ``emulated_link`` fixture changes only ``SuperpipeStrategy``), and two plain runs are bitwise the
    same, so the cases compare against what each would have run itself. ``key`` must name everything ``run``
    depends on (the ``emulated_link`` case too, for a run through the strategy)."""
    if key not in _PLAIN_RUNS:
        _PLAIN_RUNS[key] = Finished(run())
    return _PLAIN_RUNS[key]


def plain_fit(example: str, **overrides: Any) -> Finished:
    """``fit(example, "auto", **overrides)``, run once per test process (``overrides`` hashable)."""
    return once(("fit", example, tuple(sorted(overrides.items()))), lambda: fit(example, "auto", **overrides))


def plain_fit_family(name: str, **options: Any) -> Finished:
    """``fit_family(name, "auto", **options)``, run once per test process (``options`` hashable)."""
    return once(("fit_family", name, tuple(sorted(options.items()))), lambda: fit_family(name, "auto", **options))


# ------------------------------------------------------------------------------------------------------ the probes


def extra_slot_references(engine: Any) -> list[int]:
    """For each slot, the references to its storage beyond the slot's own tensor (and the temporary storage object
    asked for the count): 0 when nothing, autograd included, holds a view of it."""
    engine.copier.synchronize()  # an emulated link's queued copies hold views of the slots they fill
    return [torch._C._storage_Use_Count(slot.flat.untyped_storage()._cdata) - 2 for slot in engine._slots]


@contextmanager
def fresh_initial_values() -> Iterator[dict[str, bool]]:
    """Spies on the disk tier's deferred init inside: for each block parameter it wrote, whether its values were made
    apart from the parameter's own memory (``True``: the parameter was never initialized whole in host memory)."""
    from lightning_superpipe.construction.deferred_init import DeferredInit

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


# ---------------------------------------------------------------------------------------------------- comparisons


def _state(module: nn.Module | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    return module if isinstance(module, Mapping) else module.state_dict()


def max_relative_difference(
    a: nn.Module | Mapping[str, Tensor], b: nn.Module | Mapping[str, Tensor], *, integers: bool = True,
) -> float:
    """The largest ``|x - y| / max(|x|, |y|)`` (Frobenius norms) over the floating tensors of two state dicts
    (0 for equal tensors, at most 2; the symmetric denominator keeps zero-initialised biases meaningful).

    ``math.inf`` when the key sets differ, a pair's shapes differ, or any floating tensor of either holds a NaN
    or an infinity. With ``integers`` (the default), an integer buffer that differs (BatchNorm's
    ``num_batches_tracked``) is ``math.inf`` too.
    """
    x_state, y_state = _state(a), _state(b)
    if set(x_state) != set(y_state):
        return math.inf
    worst = 0.0
    for key, x in x_state.items():
        y = y_state[key]
        if x.shape != y.shape or x.is_floating_point() != y.is_floating_point():
            return math.inf
        x, y = x.detach().cpu(), y.detach().cpu()
        if not x.is_floating_point():
            if integers and not torch.equal(x, y):
                return math.inf
            continue
        x, y = x.double(), y.double()
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return math.inf
        difference = (x - y).norm().item()
        if difference == 0.0:
            continue
        worst = max(worst, difference / max(x.norm().item(), y.norm().item()))
    return worst


def max_relative_loss_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest ``|a_i - b_i| / max(|a_i|, |b_i|)``; ``math.inf`` when the lengths differ or a loss is not
    finite."""
    if len(a) != len(b) or not all(math.isfinite(v) for v in [*a, *b]):
        return math.inf
    return max((abs(x - y) / max(abs(x), abs(y)) for x, y in zip(a, b) if x != y), default=0.0)


def self_check() -> None:
    """``max_relative_difference`` sees a NaN (``max(worst, nan)`` would not) and a missing key."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert max_relative_difference(model, state) == 0.0
    poisoned = {k: v.clone() for k, v in state.items()}
    poisoned["0.weight"][0, 0] = float("nan")
    assert max_relative_difference(poisoned, state) == math.inf
    assert max_relative_difference(state, poisoned) == math.inf
    poisoned["0.weight"][0, 0] = float("inf")
    assert max_relative_difference(poisoned, state) == math.inf
    assert max_relative_difference({k: v for k, v in state.items() if k != "0.bias"}, state) == math.inf
    counted = dict(state, **{"1.num_batches_tracked": state["1.num_batches_tracked"] + 1})
    assert max_relative_difference(counted, state) == math.inf
    assert max_relative_difference(counted, state, integers=False) == 0.0
    assert max_relative_loss_difference([1.0, float("nan")], [1.0, 2.0]) == math.inf
    assert max_relative_loss_difference([1.0, 2.0], [1.0, 2.0]) == 0.0


if __name__ == "__main__":
    self_check()
    print("self-check passed;", len(FAMILIES), "families:", ", ".join(FAMILIES))


def fit_lm(build: Callable[[], nn.Module], strategy: Any, steps: int = 3, **overrides: Any) -> Task:
    """Trains the causal LM ``build`` makes ``steps`` AdamW steps of two micro-batches of the ``llama`` family's token
    ids (the same for every architecture here), no clipping, seeded as :func:`fit_task` seeds; ``overrides`` go to
    the Trainer."""
    from tests import families

    data = families.get("llama").data(2 * steps, SEED)
    make = lambda: Task(build, "causal_lm", lr=1e-2, schedule=False, loss=families.hf_loss)  # noqa: E731
    return fit_task(make, strategy, data, max_steps=steps, gradient_clip_val=None, **overrides)


def state_differences(a: nn.Module, b: nn.Module) -> list[str]:
    """The entries of two models' state dicts that are not bitwise equal (dtype, shape and values: ``torch.equal``
    alone compares values across dtypes), or present in one only."""
    x, y = a.state_dict(), b.state_dict()
    same = lambda u, v: u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v)  # noqa: E731
    return sorted(set(x) ^ set(y)) + [key for key in x if key in y and not same(x[key], y[key])]


def resume_after_an_epoch(make: Callable[[], Task], strategy: Callable[[], Any], folder: Any,
                          blocks_in_files: bool = False) -> dict[str, Any]:
    """Two epochs of two steps each uninterrupted (``whole``); the first alone with a ``last.ckpt`` in ``folder``
    (``first``, ``checkpoint``), saved again after ``fit`` (``after``); the second resumed from ``last.ckpt`` into a
    model ``make`` builds afresh (``resumed``). Checks that the checkpoint holds the trainable parameters' optimizer
    state only (``blocks_in_files``: the disk tier's, whose blocks' state is in the files beside it, the trunk's), and
    that the one saved after ``fit`` holds the same values."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests import families

    data = lambda: families.get("llama").data(4, SEED)  # noqa: E731  an epoch: two steps of two micro-batches
    epochs = dict(max_steps=-1, gradient_clip_val=None)
    whole = fit_task(make, strategy(), data(), max_epochs=2, **epochs)
    saving = ModelCheckpoint(dirpath=folder, save_last=True)
    first = fit_task(make, strategy(), data(), max_epochs=1, enable_checkpointing=True, callbacks=[saving], **epochs)
    checkpoint = torch.load(folder / "last.ckpt", weights_only=False)
    trainable = [p for p in first.parameters() if p.requires_grad]
    saved = len(checkpoint["optimizer_states"][0]["state"])
    assert saved < len(trainable) if blocks_in_files else saved == len(trainable)
    first.trainer.save_checkpoint(folder / "after.ckpt")
    after = torch.load(folder / "after.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(value, checkpoint["state_dict"][key]) for key, value in after.items()
               if key in checkpoint["state_dict"] or not blocks_in_files)  # after the run, the blocks are whole
    pl.seed_everything(SEED, verbose=False)
    resumed = make()
    pl.seed_everything(SEED + 1, verbose=False)
    trainer(strategy(), max_epochs=2, **epochs).fit(resumed, data(), ckpt_path=folder / "last.ckpt")
    return dict(whole=whole, first=first, checkpoint=checkpoint, resumed=resumed)
