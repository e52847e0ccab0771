"""The evaluation probe (PulseCycle's maintain probe, ScheduledPrune's event probes) reads the first
validation batches through the validation DataLoader, whose own generators (``DataLoader(shuffle=True,
generator=g)``, a ``RandomSampler`` with a generator) it gives back as it found them: it advanced them, so
every later Lightning validation saw another permutation, and with ``limit_val_batches`` another
``val_loss`` (read by ReduceLROnPlateau, ModelCheckpoint, EarlyStopping)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_pulse import PruneOptions, PulseCycle, ScheduledPrune
from lightning_pulse.probe import _loader_generators_kept
from tests.conftest import trainer_kwargs


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ValidationBatches(Callback):
    """The samples of every batch Lightning's own validation loop takes (the probe does not run its hooks)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.seen.append(batch[2].tolist())


def _dataset(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g), torch.arange(64)
    )


def _fit(callback: Callback, by_sampler: bool) -> list[list[int]]:
    pl.seed_everything(0, verbose=False)
    val = _dataset(2)
    if by_sampler:
        sampler = RandomSampler(val, generator=torch.Generator().manual_seed(3))
        val_loader = DataLoader(val, batch_size=8, sampler=sampler)
    else:
        val_loader = DataLoader(val, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    recorder = _ValidationBatches()
    trainer = pl.Trainer(
        max_steps=24,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        callbacks=[callback, recorder],
        **trainer_kwargs(),
    )
    trainer.fit(_Classifier(), DataLoader(_dataset(1), batch_size=8, shuffle=True), val_loader)
    return recorder.seen


def _cycle(probe: bool) -> Callback:
    settings = dict(burst=4, replay=2, maintain=2, warmup=0, anneal=0)
    return PulseCycle(**settings, probe_batches=2) if probe else PulseCycle(**settings, maintain_eval="none")


def _prune(probe: bool) -> Callback:
    options = PruneOptions(cadence="steps")
    return ScheduledPrune(start=4, end=16, every=4, probe_batches=2 if probe else 0, options=options)


@pytest.mark.parametrize("by_sampler", [False, True])
@pytest.mark.parametrize("make", [_cycle, _prune], ids=["pulse_cycle", "scheduled_prune"])
def test_the_probe_leaves_the_validation_loaders_shuffle_as_it_was(make, by_sampler):
    without, probed = _fit(make(probe=False), by_sampler), _fit(make(probe=True), by_sampler)
    assert len(without) == 12
    assert probed == without  # was: another permutation at every validation after the first probe


def test_each_generator_a_loader_reaches_is_given_back_also_on_error():
    data = range(32)
    shuffled = torch.Generator().manual_seed(1)
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=shuffled)  # the sampler's is the same
    inner, own = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    sampled = DataLoader(
        data, batch_sampler=BatchSampler(RandomSampler(data, generator=inner), 4, False), generator=own
    )
    for each, generators in ((loader, [shuffled]), (sampled, [inner, own])):
        states = [g.get_state() for g in generators]
        with pytest.raises(RuntimeError, match="read failed"), _loader_generators_kept(each):
            next(iter(each))
            for g in generators:
                torch.rand(3, generator=g)
            raise RuntimeError("read failed")
        assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, states))
