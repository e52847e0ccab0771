"""GradientCache's activation cache on DataLoaders with worker processes, and on loaders it cannot track."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

# plasticity threshold 2.0: every unit is stable after its first window, so the prefix freezes at step 4
FREEZE_AT_ONCE = dict(threshold=2.0, check_every=4, freeze_for=400)


class _DeepMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.pre(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(40, 4, generator=generator), torch.arange(40) % 3)


def _worker_loader(persistent: bool, workers: int = 2) -> DataLoader:
    # the sampler's own generator: the order is the same in every fit, whatever else draws random numbers
    return DataLoader(
        _data(),
        batch_size=8,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent and workers > 0,
        generator=torch.Generator().manual_seed(1),
    )


def _fit(megabytes: float, persistent: bool, max_epochs: int = 4, model=None, workers: int = 2, **fit_kwargs):
    model = _DeepMLP() if model is None else model
    cache = GradientCache(**FREEZE_AT_ONCE, activation_cache_mb=megabytes)
    trainer = pl.Trainer(callbacks=[cache], max_epochs=max_epochs, **trainer_kwargs())
    trainer.fit(model, _worker_loader(persistent, workers), **fit_kwargs)
    return trainer, cache, model


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
def test_the_activation_cache_replays_batches_of_worker_processes_and_trains_as_without_it(persistent):
    """A sweep found it died at the first batch ("SampleIndexTracker: no recorded indices for batch 0"): the
    tracker went in at train start, after the workers' first indices were drawn."""
    _, cache, cached = _fit(4, persistent)
    _, _, plain = _fit(0, persistent)
    assert cache.events and cache.activations.disabled_reason is None
    assert cache.activations.hits > 0  # later epochs replay what the first frozen batches recorded
    for (name, mine), theirs in zip(cached.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("workers", [0, 2], ids=["main_process", "persistent_workers"])
def test_a_fit_resumed_mid_freeze_records_and_replays_again(tmp_path, workers):
    """Also without workers, a resumed fit's first batch (which trains the restored prefix, for the graph
    check) was recorded: its output required grad, so the cache called the module uncacheable for the fit."""
    trainer, _, model = _fit(4, persistent=True, max_epochs=2, workers=workers)
    trainer.save_checkpoint(tmp_path / "two_epochs.ckpt")
    resumed = dict(model=model, ckpt_path=tmp_path / "two_epochs.ckpt", workers=workers)
    _, cache, _ = _fit(4, persistent=True, max_epochs=5, **resumed)
    assert cache.activations.uncached == {}
    assert cache.activations.hits > 0  # the restored freeze records epochs 2 and 3 and replays in epoch 4


class _Stream(IterableDataset):
    def __iter__(self):
        data = _data()
        return iter(data[i] for i in range(len(data)))


@pytest.mark.parametrize(
    "loaders, reason",
    [
        (lambda: DataLoader(_Stream(), batch_size=8), "IterableDataset"),
        (lambda: [_worker_loader(False), _worker_loader(False)], "2 DataLoaders"),
    ],
    ids=["iterable_dataset", "two_loaders"],
)
def test_a_loader_whose_sample_indices_cannot_be_tracked_is_refused_before_the_first_step(loaders, reason):
    """Before, the cache switched itself off with a warning the user could miss, after asking for it."""
    steps = []

    class _CountedSteps(_DeepMLP):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            batch = batch[0] if isinstance(batch[0], list) else batch  # two loaders: the first's
            return super().training_step(batch, batch_idx)

    cache = GradientCache(**FREEZE_AT_ONCE, activation_cache_mb=4)
    trainer = pl.Trainer(callbacks=[cache], max_epochs=1, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=rf"^GradientCache: .*{reason}.*activation_cache_mb=0") as refusal:
        trainer.fit(_CountedSteps(), loaders())
    assert steps == [], str(refusal.value)


@pytest.mark.parametrize("end", ["refused_at_train_start", "nothing_left_to_train"])
def test_a_fit_that_ends_before_training_leaves_no_loader_hook_on_the_strategy(tmp_path, end):
    """Review of eb164ca: the loader hook was taken off at the end of on_train_start only, so a fit refused
    there (two loaders) or resumed from its final checkpoint (no on_train_start) kept it on the strategy,
    holding the trainer in a closure (a later ddp_spawn fit could not pickle the callback)."""
    cache = GradientCache(**FREEZE_AT_ONCE, activation_cache_mb=4)
    trainer = pl.Trainer(callbacks=[cache], max_epochs=1, **trainer_kwargs(default_root_dir=str(tmp_path)))
    if end == "refused_at_train_start":
        with pytest.raises(PulseRefusal, match="GradientCache: .*2 DataLoaders"):
            trainer.fit(_DeepMLP(), [_worker_loader(False, 0), _worker_loader(False, 0)])
    else:
        first, _, model = _fit(4, persistent=False, max_epochs=1, workers=0)
        first.save_checkpoint(tmp_path / "done.ckpt")
        trainer.fit(model, _worker_loader(False, 0), ckpt_path=tmp_path / "done.ckpt")
        assert trainer.global_step == first.global_step  # nothing trained
    assert "process_dataloader" not in vars(trainer.strategy)
