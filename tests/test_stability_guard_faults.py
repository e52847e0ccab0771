"""Fault injection: each fault alone, guarded vs unguarded, against a clean run.

All runs share one 20-epoch MNIST-1D CNN schedule (the reference config: Adam 0.03, weight decay 5e-4,
one-cycle). The first 16 epochs are trained once and checkpointed; every variant resumes from there with the
same seed, so clean, unguarded and guarded runs differ only by the fault and the guard. The fault hits 30
steps after the resume, once the guard's baseline is warm. The guarded run must end within 2% of the clean
run's final validation loss; the unguarded run must diverge or end clearly worse.

Faults late in a run cost the guard little: benchmarks/stability_guard.py also places them mid-run, where
the steps it loses matter more, and reports that too.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest

from benchmarks.stability_guard import FaultInjector
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.stability_guard import StabilityGuard
from tests.conftest import stop_after_epochs, trainer_kwargs

EPOCHS, PREFIX_EPOCHS, STEPS_BEFORE_FAULT, WINDOW = 20, 16, 30, 6

pytestmark = pytest.mark.slow


def reference_model() -> MNIST1DClassifier:
    return MNIST1DClassifier(arch="cnn", lr=0.03, weight_decay=5e-4, scheduler="onecycle")


def fit_tail(data, checkpoint, callbacks) -> float:
    """Resume the shared prefix to the end of the schedule; the final validation loss."""
    pl.seed_everything(1)
    model = reference_model()
    trainer = pl.Trainer(
        max_epochs=EPOCHS, callbacks=callbacks, check_val_every_n_epoch=EPOCHS + 1, **trainer_kwargs()
    )
    trainer.fit(model, data, ckpt_path=checkpoint)
    return trainer.validate(model, data, verbose=False)[0]["val_loss"]


@pytest.fixture(scope="module")
def shared_prefix(tmp_path_factory):
    data = MNIST1DDataModule()  # the paper's 5000 samples: 3600 train, 400 val
    data.setup()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        max_epochs=EPOCHS, callbacks=[stop_after_epochs(PREFIX_EPOCHS)], **trainer_kwargs(limit_val_batches=0)
    )
    trainer.fit(reference_model(), data)
    checkpoint = str(tmp_path_factory.mktemp("prefix") / "prefix.ckpt")
    trainer.save_checkpoint(checkpoint)
    clean = fit_tail(data, checkpoint, [])
    return data, checkpoint, trainer.global_step + STEPS_BEFORE_FAULT, clean


def guard_for_tests() -> StabilityGuard:
    # frequent snapshots of a 6k-parameter model cost nothing; they keep the steps lost small
    return StabilityGuard(
        warmup=20,
        snapshot_every=2,
        max_snapshots=3,
        rollback_margin=3,
        rollback_after=2,
        skip_after_rollback=WINDOW - 2,
    )


@pytest.mark.parametrize(
    ("kind", "length", "expected_events"),
    [
        ("nan", 1, ["nonfinite_loss"]),
        ("scale", 1, ["loss_spike"]),
        ("labels", WINDOW, ["loss_spike", "loss_spike", "rollback"]),
        ("lr", WINDOW, ["loss_spike", "loss_spike", "rollback"]),
    ],
)
def test_guarded_run_ends_within_two_percent_of_clean_while_unguarded_fails(
    shared_prefix, kind, length, expected_events
):
    data, checkpoint, fault_step, clean = shared_prefix
    unguarded = fit_tail(data, checkpoint, [FaultInjector(kind, fault_step, length)])
    guard = guard_for_tests()
    guarded = fit_tail(data, checkpoint, [FaultInjector(kind, fault_step, length), guard])

    assert [event["event"] for event in guard.events] == expected_events
    assert guard.events[0]["step"] >= fault_step
    assert guarded == pytest.approx(clean, rel=0.02)
    assert not math.isfinite(unguarded) or unguarded > 1.5 * clean
    assert guard.steps_lost <= 2 * length + 3
