"""StabilityGuard resumed with another number of samples per optimizer step (batch size x accumulation x
processes): the restored gradient-norm baselines were measured at the old one, so they are dropped and warm up
again, said once at train start; the same number keeps them. Tiny MLP on random data, CPU."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs

_generator = torch.Generator().manual_seed(0)
X = torch.randn(1024, 16, generator=_generator)
Y = (X @ torch.randn(16, 4, generator=_generator)).argmax(1)


class _Mlp(pl.LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size)


def _fit(batch_size: int, max_steps: int, ckpt=None) -> tuple[StabilityGuard, pl.Trainer, list[str]]:
    pl.seed_everything(0)
    guard = StabilityGuard()
    trainer = pl.Trainer(callbacks=[guard], max_steps=max_steps, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Mlp(batch_size), ckpt_path=ckpt)
    return guard, trainer, [str(w.message) for w in caught if "samples per optimizer step" in str(w.message)]


def test_a_resume_at_a_smaller_batch_size_warms_the_gradient_norm_baselines_up_again(tmp_path):
    # before: resumed at a batch of 4 from one of 32 (an OOM on a smaller GPU), a healthy run was judged
    # against gradient-norm windows measured at 32 (medians 0.47 there, 1.3 at 4): 5 spikes, 25 steps skipped,
    # a rollback and 46 steps of work lost, where a fresh run at 4 flagged nothing
    _, trainer, _ = _fit(32, 100)
    trainer.save_checkpoint(tmp_path / "bs32.ckpt")
    guard, _, said = _fit(4, 200, tmp_path / "bs32.ckpt")
    figures = guard.metrics()
    assert figures["stability/spikes"] == 0 and figures["stability/rollbacks"] == 0
    assert len(said) == 1
    assert "trains 4 samples per optimizer step" in said[0] and "measured at 32" in said[0]
    assert "gradient-norm baselines were dropped" in said[0]
    state = torch.load(tmp_path / "bs32.ckpt", weights_only=False)["callbacks"]["StabilityGuard"]
    assert state["samples_per_step"] == 32


def test_a_resume_at_the_same_samples_per_step_or_from_an_older_checkpoint_keeps_the_baselines(tmp_path):
    _, trainer, _ = _fit(32, 60)
    trainer.save_checkpoint(tmp_path / "bs32.ckpt")
    checkpoint = torch.load(tmp_path / "bs32.ckpt", weights_only=False)
    del checkpoint["callbacks"]["StabilityGuard"]["samples_per_step"]  # as an earlier version saved it
    torch.save(checkpoint, tmp_path / "old.ckpt")
    for path, batch_size in ((tmp_path / "bs32.ckpt", 32), (tmp_path / "old.ckpt", 4)):
        guard, _, said = _fit(batch_size, 61, path)
        assert not said
        windows = guard.detector._grad_norm.values()  # restored, and one step more: still warm
        assert windows and all(len(window.values) >= guard.detector.warmup for window in windows)


class _Buckets(torch.utils.data.Sampler):
    """A user's bucketing batch sampler: it names its size otherwise than ``batch_size``."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self):
        for start in range(0, self.n - self.size + 1, self.size):
            yield list(range(start, start + self.size))

    def __len__(self) -> int:
        return self.n // self.size


class _BucketedMlp(_Mlp):
    def __init__(self, batch_size: int, loaders: int = 1) -> None:
        super().__init__(batch_size)
        self.loaders = loaders

    def training_step(self, batch, batch_idx):
        batch = batch if self.loaders == 1 else batch["buckets"]
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def train_dataloader(self):
        buckets = DataLoader(TensorDataset(X, Y), batch_sampler=_Buckets(len(X), self.batch_size))
        if self.loaders == 1:
            return buckets
        return {
            "buckets": buckets,
            "other": DataLoader(TensorDataset(X, Y), batch_sampler=_Buckets(len(X), 2)),
        }


def _fit_bucketed(batch_size: int, max_steps: int, ckpt=None, loaders: int = 1):
    pl.seed_everything(0)
    guard = StabilityGuard()
    trainer = pl.Trainer(callbacks=[guard], max_steps=max_steps, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_BucketedMlp(batch_size, loaders), ckpt_path=ckpt)
    said = [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard")]
    return guard, trainer, said


def test_a_batch_sampler_without_batch_size_is_read_from_the_first_batch(tmp_path):
    # before: a bucketing batch sampler with no `batch_size` read as "not known", and the resume at 4 from 32
    # kept the baselines measured at 32 without a word: 5 spikes, 25 steps skipped and a rollback
    _, trainer, _ = _fit_bucketed(32, 100)
    trainer.save_checkpoint(tmp_path / "bs32.ckpt")
    state = torch.load(tmp_path / "bs32.ckpt", weights_only=False)["callbacks"]["StabilityGuard"]
    assert state["samples_per_step"] == 32  # read from the first batch, and saved
    guard, _, said = _fit_bucketed(4, 200, tmp_path / "bs32.ckpt")
    figures = guard.metrics()
    assert figures["stability/spikes"] == 0 and figures["stability/rollbacks"] == 0
    assert len(said) == 1 and "trains 4 samples per optimizer step" in said[0] and "measured at 32" in said[0]
    assert guard.core.samples_per_step == 4 and guard.core.samples_reader is None


def test_baselines_kept_for_want_of_this_fits_samples_per_step_are_said(tmp_path):
    _, trainer, _ = _fit_bucketed(32, 60)
    trainer.save_checkpoint(tmp_path / "bs32.ckpt")
    guard, _, said = _fit_bucketed(32, 61, tmp_path / "bs32.ckpt", loaders=2)  # two loaders: not read
    assert len(said) == 1 and "could not be read" in said[0] and "measured at 32 samples" in said[0]
    assert guard.detector.has_grad_norms()


def test_a_scheduled_accumulation_reads_alike_from_the_loader_and_from_the_first_batch(tmp_path):
    # a review: the first-batch read took the scheduler's accumulation at the first step (4), the checkpoint the
    # one at train start (1): a resume that changed nothing dropped the baselines and said "measured at 32"
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def fit(epochs: int, ckpt=None):
        pl.seed_everything(0)
        guard = StabilityGuard()
        kwargs = {k: v for k, v in trainer_kwargs().items() if k not in ("max_epochs", "max_steps")}
        schedule = GradientAccumulationScheduler({0: 1, 1: 4})
        trainer = pl.Trainer(callbacks=[guard, schedule], max_epochs=epochs, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_BucketedMlp(32), ckpt_path=ckpt)
        return guard, trainer, [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard")]

    _, trainer, _ = fit(2)
    trainer.save_checkpoint(tmp_path / "scheduled.ckpt")
    guard, _, said = fit(3, tmp_path / "scheduled.ckpt")
    assert not said and guard.detector.has_grad_norms()
