"""StabilityGuard and a spike that comes from the user's LR schedule (held-out sweep "spikes", item 2): a
per-step LambdaLR that is x100 for five steps. With the default `rewind_lr_schedule=True` every rollback took
the schedule back with the model, so the run met the same x100 steps again: a digits MLP rolled back to the
same snapshot after each and stopped with a message that never named the learning rate. Now a rollback whose
incident came back at the schedule position of one a rewinding rollback returned from, with the rate far above
the snapshot's, keeps the schedule where it is (it moves past the spike) and says so; a stop names the
learning rate schedule. The first rollback still rewinds (the default `benchmarks/studies/guard_lr_rewind.py`
chose), and so does every rollback whose rate was not raised."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard, StabilityGuardConfig, StabilityGuardError
from lightning_pulse.core.schedule_replay import (
    LR_RAISED_FACTOR,
    RateRise,
    ScheduleReplay,
    group_rates,
    position_recurs,
    rate_rise,
    saved_rates,
    schedule_positions,
)
from lightning_pulse.core.snapshots import take_snapshot
from lightning_pulse.core.stability_steps import StabilityCore
from tests.conftest import trainer_kwargs

SPIKE = (60, 65)  # the schedule positions where the typo'd LambdaLR multiplies the rate by 100
STEPS = 150


class TypoSchedule(pl.LightningModule):
    """A digits MLP whose per-step LambdaLR is x100 at positions ``SPIKE`` (meant x1.00); ``raised=False``:
    a flat schedule, and the loss is multiplied by 100 there instead (a spike at the same positions, with the
    rate not raised)."""

    def __init__(self, raised: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.raised = raised

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        position = self.trainer.lr_scheduler_configs[0].scheduler.last_epoch
        if not self.raised and SPIKE[0] <= position < SPIKE[1]:
            loss = loss * 100
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
        first, end, raised = *SPIKE, self.raised
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: 100.0 if raised and first <= k < end else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _fit(tmp_path, raised: bool = True, **guard_kwargs):
    """``(guard, trainer, the guard's warnings, the stop's message or None)``."""
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=20, window=40, snapshot_every=20, rollback_margin=5, skip_after_rollback=5, **guard_kwargs
    )
    trainer = pl.Trainer(callbacks=[guard], max_steps=STEPS, **trainer_kwargs(default_root_dir=str(tmp_path)))
    stopped = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TypoSchedule(raised), DataLoader(data, batch_size=32, shuffle=True))
        except StabilityGuardError as error:
            stopped = str(error)
    said = [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard: rollback")]
    return guard, trainer, said, stopped


def _escalations(guard):
    return [e for e in guard.events if e["event"] in ("rollback", "stop")]


def test_a_spike_the_rewound_lr_schedule_brings_back_is_rolled_back_once_more_keeping_the_schedule(tmp_path):
    guard, trainer, said, stopped = _fit(tmp_path)
    assert stopped is None  # before: 3 rollbacks to the snapshot before the x100 steps, then a stop
    first, second = _escalations(guard)
    assert first["event"] == second["event"] == "rollback"
    assert "lr_schedule" not in first  # the first rollback rewinds the schedule, as the default does
    assert second["lr_schedule"] == "kept"
    # the schedule went back once (the first rollback's steps), and then followed the step counter
    position = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    assert position == STEPS - (first["step"] + 1 - first["to_step"])
    assert "lr_schedule" not in said[0] and "learning rate" not in said[0]
    assert "100x the snapshot's 0.003" in said[1] and "keeps the LR schedule where it is" in said[1]
    assert guard.rollbacks == 2


def test_a_stop_after_the_lr_schedule_replayed_its_spike_names_the_schedule_and_keeps_its_position(tmp_path):
    guard, trainer, _, stopped = _fit(tmp_path, max_rollbacks=1)
    assert stopped is not None
    assert "0.3 at the flagged steps, 100x the snapshot's 0.003" in stopped
    assert "the likely cause is the learning rate schedule" in stopped
    stop = _escalations(guard)[-1]
    assert stop["event"] == "stop" and stop["lr_schedule"] == "kept"
    checkpoint = torch.load(guard_stop_path(tmp_path, stop["step"]), weights_only=False)
    # past the x100 steps where the spikes were flagged; the snapshot's schedule was before them (before: 56)
    assert checkpoint["lr_schedulers"][0]["last_epoch"] > SPIKE[0]


def guard_stop_path(root, step):
    return root / "stability_guard" / f"stopped-step={step}.ckpt"


def test_a_spike_at_the_same_schedule_position_with_the_rate_unchanged_still_rewinds_the_schedule(tmp_path):
    guard, trainer, said, stopped = _fit(tmp_path, raised=False, max_rollbacks=2)
    escalations = _escalations(guard)
    assert len(escalations) == 3  # the loss x100 comes back with the rewound position each time: as before
    assert all("lr_schedule" not in e for e in escalations)
    assert not any("learning rate" in s for s in said)
    assert stopped is not None and "learning rate schedule" not in stopped


def test_keep_schedule_config_keeps_it_at_every_rollback_and_the_stop_still_names_the_rate(tmp_path):
    config = StabilityGuardConfig(rewind_lr_schedule=False)
    guard, trainer, said, stopped = _fit(tmp_path, config=config, max_rollbacks=0)
    assert stopped is not None and "the likely cause is the learning rate schedule" in stopped
    assert "lr_schedule" not in _escalations(guard)[-1]  # not the guard's choice: the config's


# ----------------------------------------------------------------------------------- the pure parts
def test_rate_rise_takes_the_group_raised_most_and_needs_a_comparable_layout():
    snapshot = [[1e-3, 2e-3]]
    rise = rate_rise([[[1e-3, 2e-3]], [[0.1, 4e-3]]], snapshot)
    assert rise == RateRise(100.0, 0.1, 1e-3) and rise.far
    assert not rate_rise([[[3e-3, 2e-3]]], snapshot).far  # 3x: below LR_RAISED_FACTOR
    assert LR_RAISED_FACTOR == 4.0
    assert rate_rise([[[0.1]]], snapshot) is None  # another group layout
    assert rate_rise([[[None, None]]], snapshot) is None  # no number to compare
    warm = rate_rise([[[1e-3]]], [[0.0]])  # a warm-up from 0 at the snapshot
    assert math.isinf(warm.ratio) and warm.far and "far above" in warm.said()


def test_position_recurs_within_the_span_give_or_take_the_margin_for_every_known_scheduler():
    span = ([61, 3], [63, 3])
    assert position_recurs([56, 3], span, 5) and position_recurs([68, 3], span, 5)
    assert not position_recurs([55, 3], span, 5) and not position_recurs([69, 3], span, 5)
    assert not position_recurs([61, 9], span, 5)  # the second scheduler is elsewhere
    assert position_recurs([61, None], span, 0)  # a scheduler keeping no position is left out
    assert not position_recurs([None, None], ([None, None], [None, None]), 5)  # none keeps one
    assert not position_recurs([61], span, 5)  # another number of schedulers


def test_saved_and_live_rates_read_groups_tensors_nested_states_and_plateau_rates():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-2}], lr=1e-3)
    assert group_rates([optimizer]) == [[1e-3, 1e-2]]
    optimizer.param_groups[0]["lr"] = torch.tensor(5e-4)  # a tensor rate (capturable optimizers)
    assert group_rates([optimizer])[0][0] == pytest.approx(5e-4)
    state = optimizer.state_dict()
    assert saved_rates(state)[1] == 1e-2
    assert saved_rates({"inner": state, "step": 3})[1] == 1e-2  # Lookahead nests torch's state
    assert saved_rates(state, [0.5, 0.25]) == [0.5, 0.25]  # a ReduceLROnPlateau's, set after the snapshot
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    optimizer.step()  # no gradients: nothing moves (torch warns of a scheduler stepped first)
    scheduler.step()
    assert schedule_positions([scheduler, object()]) == [1, None]


def test_schedule_replay_keeps_the_schedule_only_at_a_recurrence_with_the_rate_far_above_the_snapshots():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 100.0 if 60 <= k < 65 else 1.0)
    optimizer.step()  # no gradients: nothing moves (torch warns of a scheduler stepped first)
    for _ in range(40):
        scheduler.step()
    snapshot = take_snapshot(40, model, [optimizer], [scheduler])
    replay = ScheduleReplay()

    def incident(steps):
        for step in steps:
            while scheduler.last_epoch < step:
                scheduler.step()
            replay.note(step, [optimizer], [scheduler], memory=50)
        return steps

    first = incident([61, 62, 63])
    assert replay.decide(first, snapshot, True, 5)  # the first rollback rewinds
    assert replay.rise.far and not replay.kept and replay.rollback_note() == ""
    replay.rolled_back(first, rewound=True)
    assert replay.rewound == [([61], [63])] and replay.flagged == {}
    scheduler.load_state_dict(snapshot.schedulers[0])  # the rewound schedule
    second = incident([62, 63, 64])
    again = ScheduleReplay()
    again.load_state_dict(replay.state_dict())  # what a checkpoint carries
    assert not replay.decide(second, snapshot, True, 5)
    assert replay.kept and "100x the snapshot's 0.01" in replay.rollback_note()
    assert not again.decide(second, snapshot, True, 5) and again.kept
    event = {"event": "rollback"}
    replay.mark(event)
    assert event["lr_schedule"] == "kept"
    assert "keeps the schedule where it was" in replay.stop_note()
    assert not replay.decide(second, snapshot, False, 5) and not replay.kept  # the config keeps it anyway
    assert "holds the snapshot's schedule" in replay.stop_note()
    calm = ScheduleReplay()
    calm.load_state_dict(replay.state_dict())
    calm.flagged = {70: ([[0.01]], [70])}  # the same span's position is not reached: rewound
    assert calm.decide([70], snapshot, True, 5) and not calm.kept and calm.stop_note() == ""


def test_a_resume_keeps_the_rewound_positions_and_a_new_fit_of_the_same_guard_forgets_them():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.01)
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 3, 20, 10, 2, 5, 3)
    core.start(0, [optimizer])
    core.lr_replay.rewound = [([61], [63])]
    resumed = StabilityCore(None, 6.0, 8.0, 20, 5, 3, 20, 10, 2, 5, 3)
    resumed.load_state_dict(core.state_dict())
    resumed.start(90, [optimizer])
    assert resumed.lr_replay.rewound == [([61], [63])]
    core.start(0, [optimizer])  # trainer.fit again: configure_optimizers builds new schedulers from 0
    assert core.lr_replay.rewound == []
