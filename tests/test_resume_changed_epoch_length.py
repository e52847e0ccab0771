"""A run resumed from a checkpoint with another epoch length (``accumulate_grad_batches``, the batch size, the
data set, ``limit_train_batches``) under ``max_epochs``: the shares of the run are placed on the length the
resumed run trains (the steps taken, the rest of the restored epoch at the new length, the epochs left), not on
a fresh run's with the new settings (``compat.run_length``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache, PulseCycle, ScheduledPrune
from lightning_pulse import _lightning_compat as compat


class Tiny(pl.LightningModule):
    def __init__(self, batch_size: int = 8, samples: int = 128) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 16, generator=generator)
        y = torch.randint(0, 4, (self.samples,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


class SaveAt(pl.Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path, self.saved = step, path, False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)


class Lengths(pl.Callback):
    """The run length read at train start and the steps and batches the fit really ended at."""

    def on_train_start(self, trainer, pl_module):
        self.planned = compat.run_length(trainer)

    def on_train_end(self, trainer, pl_module):
        self.ran = (float(trainer.global_step), float(trainer.fit_loop.epoch_loop.total_batch_idx + 1))


class FirstAnnealStep(pl.Callback):
    step = None

    def on_train_batch_end(self, trainer, *args):
        cycle = next(c for c in trainer.callbacks if isinstance(c, PulseCycle))
        if cycle.clock.stage == "anneal" and self.step is None:
            self.step = trainer.global_step


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    settings = dict(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    settings.update(enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
    return pl.Trainer(callbacks=callbacks, **{**settings, **kwargs})


def _checkpoint(tmp_path, step: int, callbacks=(), **kwargs) -> str:
    path = str(tmp_path / f"at_{step}.ckpt")
    _trainer([*callbacks, SaveAt(step, path)], **kwargs).fit(Tiny())  # 16 batches an epoch
    return path


def _cycle() -> PulseCycle:
    return PulseCycle(burst=6, replay=3, maintain=2, warmup=0.1, anneal=0.2, maintain_eval="none")


@pytest.mark.parametrize(
    ("change", "trainer_kwargs", "module_kwargs"),
    [
        ("accumulation 1 -> 2", dict(accumulate_grad_batches=2), {}),
        ("batch size 8 -> 16", {}, dict(batch_size=16)),
        ("data set 128 -> 256 samples", {}, dict(samples=256)),
        ("limit_train_batches 16 -> 4", dict(limit_train_batches=4), {}),
    ],
)
def test_pulse_cycles_anneal_is_a_share_of_the_resumed_runs_length_after_the_epoch_length_changed(
    tmp_path, change, trainer_kwargs, module_kwargs
):
    path = _checkpoint(tmp_path, 16, [_cycle()])  # epoch 0's last batch
    anneal, lengths = FirstAnnealStep(), Lengths()
    trainer = _trainer([_cycle(), anneal, lengths], **trainer_kwargs)
    trainer.fit(Tiny(**module_kwargs), ckpt_path=path)
    total = trainer.global_step
    assert lengths.planned[0] == total, change  # before: a fresh run's max_epochs x the new epoch
    assert anneal.step is not None, change  # 128 -> 256 samples: planned on 96 steps, the run ended at 64
    assert (total - anneal.step) / total == pytest.approx(0.2, abs=0.04), change  # before: 0.41 annealed


@pytest.mark.parametrize("save_at", [5, 10, 16, 21])
@pytest.mark.parametrize(
    ("trainer_kwargs", "module_kwargs"),
    [
        ({}, {}),  # unchanged settings: the length as before
        (dict(accumulate_grad_batches=3), {}),
        (dict(limit_train_batches=4), {}),  # the restored count reaches the new length: the epoch starts over
        ({}, dict(samples=256)),  # saved at an epoch's last batch: Lightning goes on from its count
        ({}, dict(batch_size=16)),
        (dict(max_steps=30, accumulate_grad_batches=2), {}),
    ],
)
def test_the_run_length_read_at_a_resumes_start_is_the_length_the_resumed_fit_trains(
    tmp_path, save_at, trainer_kwargs, module_kwargs
):
    path = _checkpoint(tmp_path, save_at)
    lengths = Lengths()
    _trainer([lengths], **trainer_kwargs).fit(Tiny(**module_kwargs), ckpt_path=path)
    assert lengths.planned == lengths.ran


@pytest.mark.parametrize(
    ("trainer_kwargs", "module_kwargs"), [({}, {}), (dict(accumulate_grad_batches=2), {})]
)
def test_the_run_length_after_an_epoch_end_checkpoint_is_the_length_the_resumed_fit_trains(
    tmp_path, trainer_kwargs, module_kwargs
):
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
    )
    _trainer([checkpoints], enable_checkpointing=True).fit(Tiny())
    lengths = Lengths()
    path = str(tmp_path / "epoch=0-step=16.ckpt")
    _trainer([lengths], **trainer_kwargs).fit(Tiny(**module_kwargs), ckpt_path=path)
    assert lengths.planned == lengths.ran


def test_scheduled_prunes_span_is_placed_on_the_resumed_runs_length_after_limit_train_batches_changed(
    tmp_path,
):
    def prune():
        return ScheduledPrune(0.5, start=0.1, end=0.7, every=2, probe_batches=0)

    path = _checkpoint(tmp_path, 10, [prune()], max_epochs=4)  # 64 steps planned, saved at step 10
    resumed = prune()
    trainer = _trainer([resumed], max_epochs=4, limit_train_batches=4)
    trainer.fit(Tiny(), ckpt_path=path)
    assert trainer.global_step == 26  # 10 + epoch 0 again (its count reached 4) + 3 epochs of 4
    after = [event for event in resumed.events if event["step"] > 10]
    # before: the span ended at step 11 of a 16-step reading, one cut 0.139 -> 0.500 at step 12
    assert len(after) >= 3
    assert 16 <= max(event["step"] for event in after) <= 20  # end=0.7 of 26 steps


def test_gradient_caches_share_start_is_placed_on_the_resumed_runs_length_after_the_accumulation_changed(
    tmp_path,
):
    path = _checkpoint(tmp_path, 10, [GradientCache(start_at=0.5, check_every=2, freeze_for=4)])
    cache = GradientCache(start_at=0.5, check_every=2, freeze_for=4)
    trainer = _trainer([cache], accumulate_grad_batches=2)
    trainer.fit(Tiny(), ckpt_path=path)
    assert trainer.global_step == 29  # 10 + 3 (the rest of epoch 0, at 2 batches a step) + 2 epochs of 8
    assert cache._span == cache.window.steps(29)  # before: placed on 24 steps


class EarlyReader(pl.Callback):
    """Reads the run length in ``on_fit_start`` (as GreenWindow does), before Lightning restores the loops."""

    def on_fit_start(self, trainer, pl_module):
        self.early = compat.run_length(trainer)


def test_a_run_length_read_before_the_loops_are_restored_does_not_fix_the_resumes_reading(tmp_path):
    path = _checkpoint(tmp_path, 16, [_cycle()])
    early, anneal, lengths = EarlyReader(), FirstAnnealStep(), Lengths()
    trainer = _trainer([early, _cycle(), anneal, lengths], accumulate_grad_batches=2)
    trainer.fit(Tiny(), ckpt_path=path)
    # a review: the early read cached a resume point of zeros, and PulseCycle planned on 24 steps again
    assert lengths.planned[0] == trainer.global_step == 32
    assert (32 - anneal.step) / 32 == pytest.approx(0.2, abs=0.04)


@pytest.mark.parametrize("save_at", [10, 16])
def test_a_max_steps_runs_batches_before_a_resume_keep_their_accumulation(tmp_path, save_at):
    # before: saved at step 10 at accumulation 1 and resumed to max_steps=60 at 2, the run's batches were read
    # as 60 x 2 = 120 where it trains 10 + 50 x 2 = 110
    path = _checkpoint(tmp_path, save_at, max_steps=40, max_epochs=-1)
    lengths = Lengths()
    _trainer([lengths], max_steps=60, max_epochs=-1, accumulate_grad_batches=2).fit(Tiny(), ckpt_path=path)
    assert lengths.planned == lengths.ran == (60.0, save_at + (60 - save_at) * 2.0)


class TinyValidated(Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize(
    ("saved_step", "interval", "resumed", "module_kwargs"),
    [
        (8, 0.5, dict(limit_train_batches=4), {}),  # past the length: one batch more (17, read 16 before)
        (8, 0.5, dict(limit_train_batches=6), {}),  # the same, not validating at the restart (21)
        (8, 0.5, dict(limit_train_batches=8), {}),  # at the length, validating at the restart: none more
        (16, 1.0, dict(limit_train_batches=6), {}),  # the epoch's last batch, not validating: one more
        (16, 1.0, dict(limit_train_batches=4), {}),  # validating: its restored last batch ends it
        (16, 1.0, dict(limit_train_batches=7, accumulate_grad_batches=2), {}),
        (16, 0.5, {}, dict(samples=256)),  # a longer epoch, validating: the restored last batch ends it
    ],
)
def test_a_validation_end_checkpoint_resumed_at_another_epoch_length_is_read_as_lightning_goes_on(
    tmp_path, saved_step, interval, resumed, module_kwargs
):
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    _trainer([saver], enable_checkpointing=True, val_check_interval=interval).fit(TinyValidated())
    lengths = Lengths()
    trainer = _trainer([lengths], val_check_interval=interval, **resumed)
    trainer.fit(TinyValidated(**module_kwargs), ckpt_path=str(tmp_path / f"epoch=0-step={saved_step}.ckpt"))
    assert lengths.planned == lengths.ran
