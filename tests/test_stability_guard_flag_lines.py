"""StabilityGuard's flagged-step lines are capped per fit: a recurring fault over a long run printed one info
line per flagged step (a sweep: a spike every 5 steps, thousands of lines over 100k steps)."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch

from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.core.stability_steps import FLAG_LINES_PER_FIT
from tests.conftest import trainer_kwargs
from tests.test_stability_guard import DigitsBatchNormMLP, _digits_loader


class _SpikeEvery5(DigitsBatchNormMLP):
    """A loss 50 times its usual size at every fifth step after the warm-up: an isolated spike, skipped."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 50 if self.global_step >= 12 and self.global_step % 5 == 4 else loss


def test_flagged_step_lines_stop_after_the_cap_with_one_line_saying_where_the_rest_are_counted(caplog):
    torch.manual_seed(0)
    config = StabilityGuardConfig(learn_recurring_level=False)
    guard = StabilityGuard(warmup=10, window=20, rollback_after=100, config=config)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=12 + 5 * 16, callbacks=[guard]))
    with caplog.at_level(logging.INFO):
        trainer.fit(_SpikeEvery5(), _digits_loader())
    lines = [record.getMessage() for record in caplog.records if "StabilityGuard:" in record.getMessage()]
    flagged = [line for line in lines if " flagged as " in line]
    assert guard.policy.steps_skipped >= FLAG_LINES_PER_FIT + 5  # the fault recurred past the cap
    assert len(flagged) == FLAG_LINES_PER_FIT, lines
    capped = [line for line in lines if "further flagged steps" in line]
    assert capped == [
        f"StabilityGuard: {FLAG_LINES_PER_FIT} flagged steps printed in this fit; further flagged steps are "
        "counted in the logged stability/* metrics and the end-of-training line, and only rollbacks and stops "
        "are printed."
    ]
    assert lines.index(capped[0]) == lines.index(flagged[-1]) + 1
