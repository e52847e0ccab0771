"""GradientCache under StabilityGuard rollbacks: real guarded fits on MNIST-1D with an injected LR fault.

The guard restores callbacks that set ``restore_on_rollback = True`` by calling their ``load_state_dict`` in the
middle of training; GradientCache must then return its caches, windows, timers and frozen set (with
``requires_grad``) to the snapshot at once.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.stability_guard import FaultInjector
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.phase import Phase, PhaseChange
from tests.conftest import trainer_kwargs

# every unit counts as stable after one window: freeze at step 5, release at 25 for one window, refreeze at 30
EAGER = dict(threshold=2.0, check_every=5, freeze_for=20)


class CacheRecorder(Callback):
    """At the end of every step (after the guard, which may have rolled back): GradientCache's state, each
    parameter's ``requires_grad``, and the first conv layer's weights."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache = cache
        self.state: dict[int, dict] = {}
        self.trains: dict[int, dict[str, bool]] = {}
        self.first_weight: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.state[step] = copy.deepcopy(self.cache.state_dict()["cache"])
        self.trains[step] = {name: p.requires_grad for name, p in pl_module.named_parameters()}
        self.first_weight[step] = pl_module.net[1].weight.detach().clone()


def assert_same_cache_state(actual: dict | None, expected: dict | None) -> None:
    assert (actual is None) == (expected is None)
    if expected is None:
        return
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if key == "snapshot":
            assert len(actual[key]) == len(value), key
            for unit, (got, want) in enumerate(zip(actual[key], value)):
                assert (got is None) == (want is None), (key, unit)
                for got_tensor, want_tensor in zip(got or [], want or []):
                    assert torch.equal(got_tensor, want_tensor), (key, unit)
        else:
            assert actual[key] == value, key


def guarded_fit(mnist1d_small, snapshot_every: int, max_snapshots: int, max_steps: int = 45, **settings):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    cache = GradientCache(**{**EAGER, **settings})
    recorder = CacheRecorder(cache)
    guard = StabilityGuard(
        warmup=8,
        grad_norm_zscore=None,  # freezing changes the gradient norm on purpose: judge the loss only
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=snapshot_every,
        max_snapshots=max_snapshots,
        rollback_margin=1,
    )
    # the learning rate explodes at steps 26-27, while the refresh window (25-29) trains every unit
    fault = FaultInjector("lr", start=26, length=2, factor=100.0)
    trainer = pl.Trainer(
        callbacks=[fault, cache, guard, recorder], max_steps=max_steps, **trainer_kwargs(limit_val_batches=0)
    )
    trainer.fit(model, data)
    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert len(rollbacks) == 1, guard.events
    return model, cache, recorder, rollbacks[0]


def test_rollback_returns_the_caches_timers_and_frozen_set_to_the_snapshot(mnist1d_small):
    model, cache, recorder, rollback = guarded_fit(mnist1d_small, snapshot_every=10, max_snapshots=3)
    assert rollback["to_step"] == 20
    rolled_back_at = rollback["step"] + 1  # the step counter after the flagged step that triggered it
    # the rollback happens in the released refresh window: every unit trained right before it ...
    assert all(recorder.trains[rolled_back_at - 1].values())
    # ... and is back to the snapshot's state after it: caches, windows, timers, frozen flags, statistics
    assert_same_cache_state(recorder.state[rolled_back_at], recorder.state[20])
    assert recorder.state[20]["frozen"] == [True, True, True, False]
    assert recorder.trains[rolled_back_at] == recorder.trains[20]
    assert [name for name, trains in recorder.trains[rolled_back_at].items() if not trains] == [
        "net.1.weight",
        "net.1.bias",
        "net.3.weight",
        "net.3.bias",
        "net.5.weight",
        "net.5.bias",
    ]
    assert {"step": rolled_back_at, "from": 0, "to": 3, "reason": "restore"} in cache.events
    # the restored freeze holds: the frozen layer keeps the snapshot's weights until its timer releases it
    # (validated at cache step 5, so 20 cache steps later: 5 after the rollback, the skipped batches included)
    for step in range(rolled_back_at, rolled_back_at + 5):
        assert torch.equal(recorder.first_weight[step], recorder.first_weight[20]), step
        assert not recorder.trains[step]["net.1.weight"], step
    assert recorder.trains[rolled_back_at + 5]["net.1.weight"]
    assert all(p.requires_grad for p in model.parameters())  # and the module leaves fit as it came in


def test_rollback_to_a_snapshot_from_before_the_first_backward_traces_the_units_again(mnist1d_small):
    # the only snapshot is the one taken at train start, when no backward has ordered the units yet
    model, cache, recorder, rollback = guarded_fit(mnist1d_small, snapshot_every=0, max_snapshots=1)
    assert rollback["to_step"] == 0
    rolled_back_at = rollback["step"] + 1
    assert recorder.state[rolled_back_at] is None
    assert all(recorder.trains[rolled_back_at].values())
    # training goes on: the units are traced again at the next backward and freeze after two windows
    refrozen = [
        event for event in cache.events if event["step"] > rolled_back_at and event["reason"] == "check"
    ]
    assert refrozen and refrozen[0]["to"] == 3
    assert [unit.name for unit in cache.freezer.units] == ["net.1", "net.3", "net.5", "net.8"]
    assert all(p.requires_grad for p in model.parameters())


def test_a_rollback_to_before_the_first_backward_names_the_units_once_and_the_end_note_counts_the_fit(
    mnist1d_small, caplog
):
    """Held-out sweep F: the units were named again at each rollback to the step-0 snapshot (3 times in a fit),
    and the end note said "froze nothing in 199 steps" in a 342-step fit (a rollback takes the count back)."""
    with caplog.at_level("INFO"):  # threshold 0: the weights always move, so nothing ever freezes
        model, cache, recorder, rollback = guarded_fit(mnist1d_small, 0, 1, threshold=0.0)
    messages = [record.getMessage() for record in caplog.records]
    assert rollback["to_step"] == 0 and cache.freezer is not None and cache.events == []
    assert sum("GradientCache: units in forward order" in message for message in messages) == 1
    notes = [message for message in messages if "froze nothing" in message]
    after = rollback["step"] + 1  # the steps taken when it rolled back, the flagged one included
    assert cache.freezer.steps <= 45 - after  # the freezer's own count went back with the rollback
    assert len(notes) == 1 and notes[0].startswith(
        f"GradientCache: froze nothing in 45 steps (a rollback after {after} steps took its scores back to "
        "those of a snapshot): a frozen prefix starts at the first unit, net.1, last scored"
    )


def test_a_freeze_that_a_rollback_undid_is_not_reported_as_nothing_frozen(mnist1d_small, caplog):
    # frozen at step 5, rolled back at step 28 to the step-0 snapshot; the fit ends before anything refreezes
    with caplog.at_level("INFO"):
        model, cache, recorder, rollback = guarded_fit(mnist1d_small, 0, 1, max_steps=31)
    assert rollback["to_step"] == 0 and cache.freezer is not None and cache.freezer.freezes == 0
    assert cache.events[0] == {"step": 5, "from": 0, "to": 3, "reason": "check"}  # the history stays
    assert cache.frozen_units == [] and "froze nothing" not in caplog.text


class AnnounceBurstResume(Callback):
    """At step ``step`` tells GradientCache, as StabilityGuard does after a rollback, that the clock is in a
    burst (reason ``"resume"``), then records which parameters train."""

    def __init__(self, cache: GradientCache, step: int) -> None:
        self.cache, self.step = cache, step
        self.frozen_before: list[str] = []
        self.trains_after: dict[str, bool] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        self.frozen_before = list(self.cache.frozen_units)
        change = PhaseChange(None, Phase.BURST, 0, trainer.global_step, "resume")
        self.cache.on_pulse_phase_change(trainer, pl_module, change)
        self.trains_after = {name: p.requires_grad for name, p in pl_module.named_parameters()}


def test_a_prefix_restored_into_a_burst_is_released_at_once(mnist1d_small):
    # the clock does not roll back: a snapshot from a replay phase can come back while the clock is in a burst
    model, data = mnist1d_small()
    cache = GradientCache(**EAGER)
    announce = AnnounceBurstResume(cache, step=10)
    trainer = pl.Trainer(callbacks=[cache, announce], max_steps=12, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, data)
    assert announce.frozen_before == ["net.1", "net.3", "net.5"]
    assert all(announce.trains_after.values())
    assert cache.events[-1] == {"step": 10, "from": 3, "to": 0, "reason": "phase:burst"}
