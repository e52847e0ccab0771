"""StabilityGuard on a loss that goes negative, with the default log scale: a log scale cannot place a loss
<= 0, and from the first loss below 0 the positive losses are judged on a linear scale against every recent
loss (the windows of the positive losses alone missed a 400x spike of a mixture density network, sweep G)."""

from __future__ import annotations

import logging
import math
import statistics
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_pulse import StabilityGuard
from lightning_pulse.core.spike_detection import POOLED
from tests.conftest import trainer_kwargs


class _MixtureDensityNet(pl.LightningModule):
    """A 3-component Gaussian mixture density network predicting the last 8 pixels of a sklearn digit from
    the first 56: its negative log-likelihood falls from 2.6, hovers near 0 (steps 45-90) and settles near
    -0.3, so most of its last 100 losses before step 200 are negative."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(56, 64), nn.Tanh())
        self.head = nn.Linear(64, 8 * 3 * 3)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, targets = batch[0][:, :56], batch[0][:, 56:] * 4
        out = self.head(self.body(inputs)).view(-1, 8, 3, 3)
        log_weights, means, log_scales = out[..., 0].log_softmax(-1), out[..., 1], out[..., 2].clamp(-5, 3)
        log_densities = (
            -0.5 * ((targets[..., None] - means) / log_scales.exp()) ** 2
            - log_scales
            - 0.5 * math.log(2 * math.pi)
        )
        loss = -torch.logsumexp(log_weights + log_densities, -1).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def _digits_loader():
    from sklearn.datasets import load_digits

    pixels = torch.tensor(load_digits().data[:640], dtype=torch.float32) / 16.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels), batch_size=32)


class _PoisonedBatch(pl.Callback):
    """The inputs of the batch of ``step`` times 8 (a corrupted batch): a loss near 100."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            batch[0].mul_(8)


def _fit(poisoned_step: int | None, caplog) -> tuple[_MixtureDensityNet, StabilityGuard, list[str]]:
    pl.seed_everything(0)
    model, guard = _MixtureDensityNet(), StabilityGuard()
    trainer = pl.Trainer(max_steps=220, callbacks=[_PoisonedBatch(poisoned_step), guard], **trainer_kwargs())
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _digits_loader())
    said = [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard:")]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("StabilityGuard:")]
    return model, guard, said + lines


def _unjudged_note(count: int, whose: str) -> str:
    return (
        f"{count} of {whose} losses were <= 0, which a log scale cannot judge, so a loss spike among them "
        "would have gone unnoticed (the positive losses after the first below 0 were judged on a linear "
        "scale, against the recent losses): pass `config=StabilityGuardConfig(loss_scale='linear')` for such "
        "losses"
    )


def test_a_positive_spike_after_the_loss_went_negative_is_flagged_and_skipped(caplog):
    # sweep G: the batch of step 200 times 8 gave 99.35 against a median of -0.26; on the log scale only
    # the positive losses, spread over decades near 0, were its baseline (z 3.66): not flagged, and the end
    # line said "no spike" and that only a spike among the losses <= 0 would have gone unnoticed
    model, guard, said = _fit(200, caplog)
    assert model.losses[200] > 50 and statistics.median(model.losses[100:200]) < 0
    # skipped: the policy's answer to a first spike
    assert guard.events == [{"step": 200, "event": "loss_spike", "action": "skip"}]
    assert (guard.spikes_detected, guard.steps_skipped, guard.rollbacks) == (1, 1, 0)
    assert guard.detector.loss_window_scale == "linear"
    note = _unjudged_note(sum(loss <= 0 for loss in model.losses), "this fit's")
    assert said[-1] == (
        f"StabilityGuard: 1 spike(s), 1 step(s) skipped, 0 rollback(s), 1 step(s) of work lost. Also, {note}."
    ), said
    first_negative = next(loss for loss in model.losses if loss < 0)
    assert said[0] == (
        f"StabilityGuard: the loss is {first_negative:.4g} <= 0, which a log scale cannot judge; a loss "
        "spike that stays <= 0 goes unnoticed; a positive loss is judged from now on on a linear scale, "
        "against the recent losses. Pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses."
    ), said


def test_the_healthy_run_crossing_zero_is_not_flagged_and_its_end_line_gives_every_loss_median(caplog):
    model, guard, said = _fit(None, caplog)
    assert guard.spikes_detected == 0 and guard.events == []
    unjudged = sum(loss <= 0 for loss in model.losses)
    assert 100 < unjudged < 220 and any(loss > 0 for loss in model.losses[100:])  # it crosses 0 both ways
    median = statistics.median(model.losses[-100:])  # every loss of the window, negatives included
    grad_norm = guard.detector.baseline(POOLED)["grad_norm"]
    assert said[-1] == (
        "StabilityGuard: no spike or non-finite value in this fit's 220 optimizer step(s), but "
        f"{_unjudged_note(unjudged, 'their')} "
        f"(medians of the last 100 at most: loss {median:.4g}, grad norm {grad_norm:.4g})."
    ), said
