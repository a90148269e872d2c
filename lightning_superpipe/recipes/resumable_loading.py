"""Data loading that can stop part-way through an epoch and continue there: samplers and a loader whose position goes
into Lightning's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from lightning_superpipe.recipes.errors import RecipeError


class ResumableSampler(Sampler[int]):
    """The indices ``0 .. num_samples - 1`` in an order fixed by ``seed`` and the epoch, from any position on.

    Lightning calls :meth:`set_epoch` before every training epoch, so each epoch has its own order, and a run resumed
    in the middle of an epoch draws the same order again. :class:`ResumableDataLoader` sets :attr:`start` to skip
    the samples an interrupted run had already trained on.

    Args:
        num_samples: Size of the dataset.
        shuffle: Draw a random order per epoch; ``False`` keeps ``0, 1, 2, ...``.
        seed: Seed of the order, combined with the epoch.
    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        #: Samples of this epoch's order to leave out at the start of the next pass.
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next pass on."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """The whole order of the current epoch."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start :])

    def __len__(self) -> int:
        # The whole epoch, also when starting part-way: Lightning counts an epoch's batches from ``len(loader)``.
        return self.num_samples


class LengthGroupedSampler(ResumableSampler):
    """A :class:`ResumableSampler` whose batches hold examples of similar length, so that padding each batch to its
    longest example wastes little.

    Each epoch draws a random order, cuts it into groups of ``batch_size * batches_per_group`` examples and sorts
    each group by length, longest first; batches never straddle two groups, so every batch is a run of similar
    lengths while the epoch's order stays random. The order depends only on the seed and the epoch, as
    :class:`ResumableDataLoader` needs to resume part-way.

    Args:
        lengths: Length of each example.
        batch_size: Examples per batch.
        seed: Seed of the order, combined with the epoch.
        batches_per_group: Batches per sorted group: more pads less, fewer keeps more randomness.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, batches_per_group: int = 50) -> None:
        super().__init__(len(lengths), shuffle=True, seed=seed)
        self.lengths = list(lengths)
        self.group_size = batch_size * batches_per_group

    @override
    def order(self) -> list[int]:
        shuffled = super().order()
        groups = [shuffled[start : start + self.group_size] for start in range(0, len(shuffled), self.group_size)]
        return [index for group in groups for index in sorted(group, key=lambda i: -self.lengths[i])]


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` whose position within the epoch goes into Lightning's checkpoints, so that ``fit`` resumed
    from the middle of an epoch trains on exactly the batches the interrupted run had not reached.

    Lightning's fit loop saves the ``state_dict`` of a training loader that has one and loads it before the resumed
    epoch starts (:class:`TextDataModule` loads it too, where Lightning would be too late). Batches are counted as
    the main process hands them over, not as worker processes prefetch them.
    With a :class:`ResumableSampler` the skipped samples are never loaded; with any other sampler whose order is
    reproducible (Lightning's distributed sampler, seeded by the epoch), the skipped batches are loaded and dropped.

    Takes the arguments of ``DataLoader``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_done = 0
        self._skip_batches = 0
        self._skip_epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: nothing is drawn until the first batch is asked for, by which time Lightning has called
        # ``set_epoch``, also for the first epoch of a resumed run.
        return self._counted_batches()

    def _counted_batches(self) -> Iterator[Any]:
        skip, self._skip_batches = self._skip_batches, 0
        skip_epoch, self._skip_epoch = self._skip_epoch, None
        if (skip_epoch is not None and self._epoch() != skip_epoch) or skip >= len(self):
            skip = 0  # the checkpoint's epoch was complete: this is the next one, from its start
        drop = skip
        if isinstance(self.sampler, ResumableSampler) and self.batch_size is not None:
            self.sampler.start, drop = skip * self.batch_size, 0
        self._batches_done = skip
        batches = super().__iter__()
        for _ in range(drop):
            next(batches, None)
        for batch in batches:
            self._batches_done += 1
            yield batch

    def _epoch(self) -> int | None:
        return getattr(self.sampler, "epoch", None)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch, its batches handed out so far, and what the order depends on."""
        state: dict[str, Any] = {
            "epoch": self._epoch(),
            "batches_done": self._batches_done,
            "num_batches": len(self),
            "batch_size": self.batch_size,
        }
        if isinstance(self.sampler, ResumableSampler):
            state.update(seed=self.sampler.seed, num_samples=self.sampler.num_samples, shuffle=self.sampler.shuffle)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` in the next pass.

        Raises:
            RecipeError: If the data differs from the checkpoint's in size or batch size, so that its position
                would point at other sequences.
        """
        sampler = self.sampler
        batches_done = int(state_dict.get("batches_done", 0))
        saved = {key: state_dict.get(key) for key in ("num_samples", "batch_size", "num_batches")}
        current = {"num_samples": getattr(sampler, "num_samples", None), "batch_size": self.batch_size}
        current["num_batches"] = len(self)
        changed = [key for key, value in saved.items() if value is not None and value != current[key]]
        # Between epochs the data may change; part-way through one, the position would point at other sequences.
        if changed and 0 < batches_done < (saved["num_batches"] or len(self)):
            details = ", ".join(f"{key} {saved[key]} then, {current[key]} now" for key in changed)
            raise RecipeError(
                f"the checkpoint stopped part-way through an epoch of other training data ({details}); resume "
                "with the data settings it was trained with (data.data_path, data.seq_len, data.batch_size, "
                "data.val_fraction, data.split_seed)"
            )
        if isinstance(sampler, ResumableSampler):
            sampler.seed = state_dict.get("seed", sampler.seed)
            sampler.shuffle = state_dict.get("shuffle", sampler.shuffle)
        epoch = state_dict.get("epoch")
        if epoch is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        self._skip_batches = batches_done
        self._skip_epoch = epoch
        self._batches_done = batches_done
