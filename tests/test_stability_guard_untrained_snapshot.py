"""StabilityGuard's rollback test and an untrained snapshot (held-out sweep "spikes", problem 1): a 64-sample
shard with wrong labels that comes back every epoch spiked on the step-100 snapshot too (the data's), but the
test went on to the fit-start snapshot, where every loss is ~2.3, found the batch ordinary there and rolled
back to it: 203 applied steps undone, the train loss on clean labels 0.69-0.79 against 0.22 with no guard. An
older snapshot on which the batch does not stand out only because every loss is high there now tells nothing
once a newer one reproduced the spike; damage that began before the newest snapshot is still rolled back to a
healthy older one."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from lightning_pulse.core.stability_steps import rollback_test, spike_hidden
from tests.conftest import trainer_kwargs


@pytest.mark.parametrize(
    ("then", "reference", "trained", "now", "hidden"),
    [
        (2.306, 2.316, 0.661, 5.227, True),  # the sweep's fit start: ~ln(10) on every batch
        (0.3, 0.2, 0.2, 375.0, False),  # healthy there, as every loss is: damage since
        (1.2, 0.6, 0.66, 3.0, False),  # within 4x of now, but every loss is ordinary there: damage since
        (
            1.0,
            2.3,
            0.66,
            3.0,
            False,
        ),  # high losses there, but the batch below min_ratio squared x 0.66 (1.49)
        (0.5, 0.25, 0.2, 1.5, False),  # the ordinary loss there under min_ratio x the trained one: not high
        (2.306, 2.316, 0.661, 10.0, False),  # 4x below its loss now: not the same spike
        (2.306, float("nan"), 0.661, 5.227, False),  # nothing to compare with
        (2.306, float("inf"), 0.661, 5.227, False),
    ],
)
def test_a_batch_hidden_only_by_high_losses_everywhere(then, reference, trained, now, hidden):
    assert spike_hidden(then, reference, trained, now, min_ratio=1.5) is hidden


def _losses(table, asked):
    def at(target):
        asked.append(target.step)
        return table[target.step]

    return at


def test_a_snapshot_where_every_loss_is_high_is_no_rollback_target_once_a_newer_one_reproduced_the_spike():
    newest, start = SimpleNamespace(step=100), SimpleNamespace(step=0)
    asked = []
    sweep = {100: (4.097, 0.661), 0: (2.306, 2.316)}  # the sweep's losses at step 205
    assert rollback_test([newest, start], _losses(sweep, asked), 5.227, 1.5) == (False, None)  # was (True, 0)
    assert asked == [100, 0]
    # the fit start as the only (or newest) snapshot: nothing reproduced before it, rolled back there
    assert rollback_test([start], _losses(sweep, []), 5.227, 1.5) == (True, 0)
    # damage that began before the newest snapshot: ordinary on a healthy older one, rolled back to it
    damaged = {100: (4.097, 0.661), 0: (1.2, 0.6)}
    assert rollback_test([newest, start], _losses(damaged, []), 3.0, 1.5) == (True, 0)
    # ordinary at the newest: rolled back there, the older one not asked
    asked.clear()
    healthy = {100: (0.7, 0.661), 0: (2.306, 2.316)}
    assert rollback_test([newest, start], _losses(healthy, asked), 5.227, 1.5) == (True, 100) and asked == [
        100
    ]


def shuffled_digits(count: int = 1500) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits in a fixed shuffled order, scaled to [0, 1]: ``count`` of them."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (torch.tensor(x, dtype=torch.float32) / 16)[order][:count], torch.tensor(y)[order][:count]


class _Digits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_recurring_shard_of_wrong_labels_is_skipped_not_rolled_back_to_the_untrained_start():
    # the sweep's repro: batches 20 and 21 of every epoch relabelled wrong (an off-by-one in a labelling
    # script); the third flag within spike_memory (step 205) is tested on the step-100 snapshot (4.10 against
    # 0.66: reproduced) and the fit start (2.306 against 2.316)
    x, y = shuffled_digits()
    labels, shard = y.clone(), torch.arange(640, 704)
    labels[shard] = (labels[shard] + 1 + shard % 9) % 10
    pl.seed_everything(0)
    model, guard = _Digits(), StabilityGuard()
    trainer = pl.Trainer(callbacks=[guard], max_steps=220, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, labels), batch_size=32, drop_last=True))
    assert guard.rollbacks == 0 and not guard.stopped  # rolled back to step 0 at step 205 before
    assert {"step": 205, "event": "loss_spike", "cause": "recurring", "action": "skip"} in guard.events
    assert guard.recurring_spikes == 3 and guard.steps_lost < 10  # 220 of 220 before
    with torch.no_grad():
        assert (
            F.cross_entropy(model.net(x), y).item() < 0.3
        )  # 2.31 before: the untrained start, 15 steps after the rollback
