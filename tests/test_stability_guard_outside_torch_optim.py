"""StabilityGuard skips under an optimizer outside ``torch.optim`` whose LR scheduler reads the gradients:
Hugging Face's ``Adafactor`` with ``AdafactorSchedule`` (the T5 recipe). Such an optimizer's skip zeroes the
gradients and undoes the step from a backup; the zeros stayed after it, so the schedule, which reads the state
of every group whose first parameter has a gradient, found the empty state of a parameter never stepped and
raised ``KeyError: 'step'`` (sweep s42 "optim", problem 4)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs


class _T5Recipe(pl.LightningModule):
    """A small classifier trained by HF Adafactor with relative steps and its proxy schedule. ``damage_at``:
    a NaN put into a weight at that step (the guard rolls back at once)."""

    def __init__(self, damage_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.damage_at = damage_at
        self.rates: list[float] = []  # the schedule's rate after each step (Lightning steps it every batch)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.damage_at:
            self.damage_at = None
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.rates.append(self.lr_schedulers().get_last_lr()[0])

    def configure_optimizers(self):
        from transformers.optimization import Adafactor, AdafactorSchedule

        optimizer = Adafactor(
            self.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": AdafactorSchedule(optimizer), "interval": "step"},
        }


class _Untouched(Callback):
    """Listed after the guard: at the first batch end, whether every parameter still has its starting value
    and no optimizer state."""

    def __init__(self) -> None:
        self.start: list[torch.Tensor] | None = None
        self.first: tuple[bool, bool] | None = None

    def on_train_start(self, trainer, pl_module):
        self.start = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first is None:
            moved = any(not torch.equal(p, s) for p, s in zip(pl_module.parameters(), self.start))
            self.first = (moved, bool(trainer.optimizers[0].state))


def _fit(tmp_path, module, guard, *callbacks, nan_rows=(), steps=8):
    pl.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    x[list(nan_rows)] = float("nan")
    trainer = pl.Trainer(
        callbacks=[guard, *callbacks], max_steps=steps, default_root_dir=tmp_path, **trainer_kwargs()
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    return trainer


def test_a_bad_sample_in_the_first_batch_is_skipped_and_adafactors_schedule_trains_on(tmp_path):
    """The skip comes before Adafactor's first update, so its state is empty: the fit crashed at the
    schedule's step. Now the step is skipped as a step not taken: no parameter moved, no state, and the
    schedule reads its initial rate, as with ``training_step`` returning ``None``."""
    pytest.importorskip("transformers")
    module, guard, untouched = _T5Recipe(), StabilityGuard(), _Untouched()
    trainer = _fit(tmp_path, module, guard, untouched, nan_rows=[3])
    assert trainer.global_step == 8 and guard.steps_skipped == 1 and guard.bad_batches == 1
    assert untouched.first == (False, False)
    assert module.rates[0] == 0.0 and all(
        rate > 0 for rate in module.rates[1:]
    )  # AdafactorSchedule's initial


def test_a_rollback_to_the_fit_start_and_its_skips_keep_adafactors_schedule_running(tmp_path):
    """A rollback to the fit-start snapshot brings back the empty state; the skips after it crashed the same
    way. Now the run trains on past them."""
    pytest.importorskip("transformers")
    module = _T5Recipe(damage_at=3)
    guard = StabilityGuard(rollback_margin=2, skip_after_rollback=3)
    trainer = _fit(tmp_path, module, guard, steps=12)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 0
    assert trainer.global_step == 12 and guard.steps_skipped == 4
    assert all(torch.isfinite(p).all() for p in module.parameters())
