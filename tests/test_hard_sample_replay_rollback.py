"""HardSampleReplay under StabilityGuard: a rollback returns the replay state to the snapshot's.

A real guarded fit: MNIST-1D (720 training samples, 12 batches of 60 per epoch), HardSampleReplay selecting
half of each batch from epoch 2 on, and ``FaultInjector`` (shared with the guard's own tests) putting a NaN
into the batch training_step sees at steps 32 and 33. The guard skips 32, rolls back at 33 to its snapshot
of step 30 (mid-epoch 3: a table of two epochs of scores plus the steps measured since). Both callback
orders are run: HardSampleReplay's batch end before the guard's (its measurement of the flagged step is
rolled back) and after it (the step in flight is dropped).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.stability_guard import FaultInjector
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.callbacks.stability_guard import StabilityGuard
from tests.conftest import trainer_kwargs

FAULT_STEP, SNAPSHOT_STEP = 32, 30


class SnapshotTwin(Callback):
    """Placed after both: copies the replay state at the start and once every batch end of a step ran, where
    the guard snapshots in either order (before HardSampleReplay's batch end, a snapshot held the replay
    state a step behind the weights), so it holds what a snapshot of the step holds."""

    def __init__(self, guard: StabilityGuard, replay: HardSampleReplay) -> None:
        self.guard, self.replay = guard, replay
        self.at_step: dict[int, dict] = {}

    def _record(self, trainer: pl.Trainer) -> None:
        self.at_step[trainer.global_step] = copy.deepcopy(self.replay.state_dict())

    def on_train_start(self, trainer, pl_module):
        self._record(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer)


class AfterRollback(Callback):
    """Placed last: the replay state at every batch start, and once every callback has run after a rollback."""

    def __init__(self, guard: StabilityGuard, replay: HardSampleReplay) -> None:
        self.guard, self.replay = guard, replay
        self.before_step: dict[int, dict] = {}
        self.after_rollback: dict | None = None
        self.rollback_step: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before_step[trainer.global_step] = copy.deepcopy(self.replay.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.guard.rollbacks and self.after_rollback is None:
            self.after_rollback = copy.deepcopy(self.replay.state_dict())
            self.rollback_step = trainer.global_step - 1


def differences(actual: dict, expected: dict) -> list[str]:
    """What differs between two replay states: table (NaN = never scored compares equal), unapplied steps,
    totals, threshold."""
    found = []
    for name, value in expected["table"].items():
        other = actual["table"][name]
        same = (
            other.numpy().tobytes() == value.numpy().tobytes()
            if isinstance(value, torch.Tensor)
            else other == value
        )
        if not same:
            found.append(f"table.{name}")
    mine, theirs = actual["unapplied"] or {}, expected["unapplied"] or {}
    if mine.keys() != theirs.keys():
        found.append("unapplied")
    for name, value in theirs.items():
        other = mine.get(name)
        same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
        if not same:
            found.append(f"unapplied.{name}")
    if actual["totals"] != expected["totals"]:
        found.append("totals")
    if not np.array_equal(actual["threshold"], expected["threshold"], equal_nan=True):
        found.append("threshold")
    return found


@pytest.fixture(scope="module")
def data():
    module = MNIST1DDataModule(num_samples=1000, batch_size=60)
    module.setup()
    return module


@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-before-guard", "replay-after-guard"])
def test_rollback_returns_scores_and_unapplied_steps_to_the_snapshot(data, replay_first):
    pl.seed_everything(0)
    replay = HardSampleReplay(replay_fraction=0.5, mode="batch")  # the fault step is fixed
    assert HardSampleReplay.restore_on_rollback is True
    guard = StabilityGuard(
        warmup=10,
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=2,
        max_snapshots=3,
        rollback_margin=1,
    )
    twin, after = SnapshotTwin(guard, replay), AfterRollback(guard, replay)
    # the injector follows the replay callback, so its NaN lands in the batch training_step really sees
    fault = FaultInjector("nan_output", start=FAULT_STEP, length=2)
    callbacks = [replay, fault, guard, twin, after] if replay_first else [guard, replay, fault, twin, after]
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=4, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(MNIST1DClassifier(arch="mlp"), data)

    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == SNAPSHOT_STEP
    assert after.rollback_step == FAULT_STEP + 1
    snapshot = twin.at_step[SNAPSHOT_STEP]
    # not a vacuous comparison: two epochs of scores, steps of this epoch still waiting to be applied, and a
    # state that had moved on by the time the rollback came
    assert np.isfinite(snapshot["table"]["scores"].numpy()).sum() == 720
    assert snapshot["unapplied"] is not None and min(snapshot["unapplied"]["steps"]) >= 24
    assert differences(after.before_step[FAULT_STEP + 1], snapshot)

    assert differences(after.after_rollback, snapshot) == []
    # and the run carries on from there: every later epoch is selected from the restored scores
    assert trainer.global_step == 48
    assert replay.metrics()["table_seen"] == 720
    assert replay.metrics()["replay_fraction"] < 0.8
