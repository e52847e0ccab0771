"""StabilityGuard's rollback with ``rewind_lr_schedule=True`` (the default) returns the LR schedulers and the
hyperparameters of the optimizers they drive to the snapshot. An optimizer no scheduler drives keeps the rate
its module set: Lightning's documented warm-up inside ``optimizer_step`` is keyed on ``global_step``, which
does not go back, so a rollback into the warm-up left the run at its warm-up rate for good (a held-out sweep:
0.025 for 0.05 to the end, nothing said)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs

BASE_LR, WARMUP, FAULT_AT = 0.05, 10, 11


class _WarmupByHand(pl.LightningModule):
    """Lightning's ``optimizer_step`` warm-up recipe; a NaN written into a weight at ``FAULT_AT`` (a rollback)."""

    def __init__(self, scheduled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.scheduled, self.rates, self.faulted = scheduled, [], False

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=BASE_LR, momentum=0.9)
        if not self.scheduled:
            return optimizer
        # chainable: each step multiplies the group's current rate, so a rate not rewound would carry on
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if not self.scheduled and self.trainer.global_step < WARMUP:
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (self.trainer.global_step + 1) / WARMUP) * BASE_LR

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == FAULT_AT and not self.faulted:
            self.faulted = True  # NaN model state: the guard rolls back at once
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def _fit(model: pl.LightningModule):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    guard = StabilityGuard(
        warmup=5, snapshot_every=5, max_snapshots=3, rollback_margin=6, skip_after_rollback=2
    )
    trainer = pl.Trainer(max_steps=24, callbacks=[guard], **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    rollbacks = [event["to_step"] for event in guard.events if event["event"] == "rollback"]
    return model, trainer, rollbacks


def test_a_rollback_into_a_warm_up_set_by_hand_keeps_the_modules_rate():
    model, _, rollbacks = _fit(_WarmupByHand(scheduled=False))
    assert rollbacks == [5]  # into the warm-up: the snapshot's rate was 0.6 * BASE_LR
    after = model.rates[FAULT_AT:]
    assert after and all(rate == BASE_LR for rate in after), after


def test_a_rollback_still_rewinds_a_scheduler_and_the_rate_it_drives():
    model, trainer, rollbacks = _fit(_WarmupByHand(scheduled=True))
    assert rollbacks == [5]
    schedule = trainer.lr_scheduler_configs[0].scheduler
    # the schedule went back to step 5's (6 steps taken back; the rolled-back step does not step it either)
    assert schedule.last_epoch == 24 - (FAULT_AT - 5) - 1
    assert model.rates[-1] == pytest.approx(BASE_LR * 0.9**schedule.last_epoch, rel=1e-9)


class _CountingSGD(torch.optim.SGD):
    """An SGD that keeps a step counter in its parameter groups, as schedule-free optimizers (``k``) and
    Prodigy (``d``) keep theirs."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
        return loss


def test_a_rollback_returns_the_counters_an_optimizer_keeps_in_its_groups():
    class _Counting(_WarmupByHand):
        def configure_optimizers(self):
            return _CountingSGD(self.parameters(), lr=BASE_LR, momentum=0.9)

    model, trainer, rollbacks = _fit(_Counting())
    assert rollbacks == [5]
    # back to the snapshot's 5, then one per applied step after the rollback: steps 12-23 less the skip
    # window's 2 (kept at the incident's 11 instead, it would end at 21)
    assert trainer.optimizers[0].param_groups[0]["k"] == 5 + (24 - (FAULT_AT + 1) - 2)
    assert model.rates[-1] == BASE_LR


class _RaisedOnceByHand(_WarmupByHand):
    """No warm-up: at ``FAULT_AT`` a hook sets the rate x100 once (a typo, a mid-run finder) as the weights
    go bad."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == FAULT_AT and not self.faulted:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 100 * BASE_LR
        super().on_train_batch_start(batch, batch_idx)


def test_a_rollback_undoes_a_rate_raised_by_hand_far_above_the_snapshots():
    # kept, a x100 rate set once by hand rolled back three times and stopped the run (a regression sweep)
    model, _, rollbacks = _fit(_RaisedOnceByHand())
    assert rollbacks == [5]
    assert model.rates[FAULT_AT:] and all(rate == BASE_LR for rate in model.rates[FAULT_AT:]), model.rates
