"""StabilityGuard's stop message says what the guard knows (held-out sweep s40, objectives finding 1): a
healthy fit whose loss level changed on purpose (a loss weight raised x10 mid-run) stopped after rollbacks
that undid 50, 0 and 0 applied steps, each escalated without the rollback test (unbroken rows of flagged
steps); the message said the spikes "came from the model" on that test and advised a lower learning rate. It
now says the rows went untested and the rollbacks undid nothing, names a lasting change of the loss level and
the way out (both thresholds); a stop whose rollbacks were tested and undid steps keeps the old text."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard, StabilityGuardError
from lightning_pulse.core.snapshots import take_snapshot
from lightning_pulse.core.spike_detection import Verdict
from lightning_pulse.core.stability_policy import Action
from lightning_pulse.core.stability_steps import StabilityCore
from tests.conftest import trainer_kwargs

WEIGHT_RAISED_AT = 60


class WeightedDigits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.loss_weight = 1.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_weight * F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class RaiseLossWeight(pl.Callback):
    """A loss weight raised x10 for good, on purpose (with Adam the training dynamics hardly change)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.loss_weight = 10.0 if trainer.global_step >= WEIGHT_RAISED_AT else 1.0


def _fit_with_the_weight_raised(tmp_path, **thresholds):
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=20, window=40, snapshot_every=20, rollback_margin=5, skip_after_rollback=5, max_rollbacks=2,
        **thresholds,
    )  # fmt: skip
    trainer = pl.Trainer(
        callbacks=[RaiseLossWeight(), guard], max_steps=120, **trainer_kwargs(default_root_dir=str(tmp_path))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(WeightedDigits(), DataLoader(data, batch_size=32, shuffle=True))
        except StabilityGuardError as error:
            return guard, str(error)
    return guard, None


def test_a_stop_after_a_lasting_loss_weight_change_says_the_rows_went_untested_and_names_both_thresholds(
    tmp_path,
):
    guard, message = _fit_with_the_weight_raised(tmp_path)
    assert message is not None and guard.stopped
    # the first sentence: who, why, and the way out
    first = message.split(". ")[0]
    assert first.startswith("StabilityGuard stopped training at step ")
    assert "nothing shows that rolling back helps" in first
    assert "raise both `loss_zscore` and `grad_norm_zscore`" in first
    # what the guard knows, not a test that never ran
    assert "came in an unbroken row" in message and "without the snapshot test" in message
    assert "undid 0 applied steps" in message and "a rollback cannot help" in message
    assert "came from the model" not in message and "lower learning rate" not in message
    assert "a loss weight raised, a curriculum stage, a KL term" in message
    assert "raising `loss_zscore` alone still stops" in message and "load_from_checkpoint" in message
    undone = [escalation["undone"] for escalation in guard.policy.escalations]
    assert undone[0] > 0 and undone[1:] == [0, 0], undone  # back to the very weights the spikes came on
    # which the run bears out: loss_zscore=None alone stops the same way, both off train to the end
    guard, message = _fit_with_the_weight_raised(tmp_path / "loss-off", loss_zscore=None)
    assert message is not None and "undid 0 applied steps" in message
    guard, message = _fit_with_the_weight_raised(
        tmp_path / "both-off", loss_zscore=None, grad_norm_zscore=None
    )
    assert message is None and guard.rollbacks == 0


def _stopping_core(flagged_steps, tmp_path):
    """A core whose policy stops at the last of ``flagged_steps`` (no rollback allowed); every rollback test
    asked finds that rolling back helps (the data ruled out)."""
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 2, 2, 5, 2, 0, 0)  # rollback_after=2, max_rollbacks=0
    actions = [
        core.policy.decide(step, Verdict.LOSS_SPIKE, rollback_helps=lambda: True) for step in flagged_steps
    ]
    assert actions[-1] is Action.STOP
    return core.conclude_rollback(
        Action.STOP, flagged_steps[-1], take_snapshot(0, nn.Linear(3, 1)), 7, str(tmp_path)
    )


@pytest.mark.parametrize(("flagged_steps", "untested"), [((10, 12), False), ((10, 11), True)])
def test_a_stop_keeps_blaming_the_model_only_where_the_rollback_test_ran(tmp_path, flagged_steps, untested):
    message, _ = _stopping_core(flagged_steps, tmp_path)
    assert ("came from the model" in message) is not untested
    assert ("came in an unbroken row" in message) is untested
    # steps were undone (7): nothing rules the model out, so a lower learning rate stays one reading
    assert "lower learning rate" in message and "undid 0 applied steps" not in message
