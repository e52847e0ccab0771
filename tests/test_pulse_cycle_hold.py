"""PulseCycle's hold: another callback keeps the run in the light phases, and lets it go."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pulse import Phase, PhaseClock, PulseCycle, phase_of
from tests.conftest import trainer_kwargs


def run(clock: PhaseClock, steps: int, total: int | None = None) -> str:
    letters = ""
    for _ in range(steps):
        letters += clock.phase.value[0]
        clock.advance(1, total_steps=total)
    return letters


def test_hold_ends_a_burst_now_and_skips_bursts_until_released():
    clock = PhaseClock({"burst": 3, "replay": 2, "maintain": 1})
    clock.start(None)
    assert run(clock, 1) == "b"
    (change,) = clock.hold(True)
    assert (change.previous, change.current, change.reason) == (Phase.BURST, Phase.REPLAY, "hold")
    # replay, maintain, then replay again instead of the burst that falls due
    assert run(clock, 8) == "rrmrrmrr"
    assert clock.hold(True) == []  # holding twice changes nothing
    (change,) = clock.hold(False)
    assert (change.current, change.reason) == (Phase.BURST, "release")
    assert run(clock, 7) == "bbbrrmb"
    assert clock.steps_by_phase == {"burst": 5, "replay": 8, "maintain": 3}


def test_hold_is_in_the_state_and_warmup_stays_burst():
    clock = PhaseClock({"burst": 2, "replay": 2}, warmup=0.03)
    clock.start(100)
    assert clock.hold(True) == []  # warm-up is pure burst
    assert run(clock, 5, total=100) == "bbbrr"  # the cycle starts in replay, not in the held-off burst
    copy = PhaseClock({"burst": 2, "replay": 2}, warmup=0.03)
    copy.load_state_dict(clock.state_dict())
    assert copy.held and run(copy, 3, total=100) == run(clock, 3, total=100) == "rrr"


def test_hold_needs_a_light_phase():
    clock = PhaseClock({"burst": 4, "replay": 0})
    clock.start(None)
    assert clock.light_phases == () and clock.hold(True) == []
    assert run(clock, 6) == "bbbbbb"


class HoldBetween(Callback):
    """Holds the cycle from step `start` to step `end`, recording each batch's phase."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.phases: list[str] = []
        self.told: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.phases.append(phase_of(trainer).value[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        cycle = next(c for c in trainer.callbacks if isinstance(c, PulseCycle))
        if trainer.global_step in (self.start, self.end):
            cycle.hold_light(trainer, pl_module, trainer.global_step == self.start)

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.told.append(f"{change.current.value}:{change.reason}")


def test_pulse_cycle_hold_light_tells_listeners_and_holds_a_real_fit(mnist1d_small):
    model, data = mnist1d_small(arch="mlp")
    cycle = PulseCycle(burst=4, replay=2, maintain=0, warmup=0, anneal=0, maintain_eval="none")
    hold = HoldBetween(start=2, end=9)
    trainer = pl.Trainer(callbacks=[cycle, hold], max_steps=14, **trainer_kwargs())
    trainer.fit(model, data)
    assert "".join(hold.phases) == "bb" + "r" * 7 + "bbbbr"
    assert hold.told[:3] == ["burst:start", "replay:hold", "burst:release"]
    assert not cycle.held


def test_a_hold_asked_before_the_step_is_counted_takes_effect_after_it():
    # a scheduler's batch end that runs before PulseCycle's: the clock has not counted the step that trained
    clock = PhaseClock({"burst": 3, "replay": 2, "maintain": 1})
    clock.start(None)
    clock.rows.step_starts(clock)
    assert clock.hold(True, step=1) == [] and clock.holding and not clock.held
    assert clock.advance(1) == [] and clock.phase is Phase.BURST  # step 0 trained as burst, is counted so
    assert clock.take_due_hold() is True and clock.take_due_hold() is None
    (change,) = clock.hold(True, step=1)  # what PulseCycle's batch end does with it: as if asked now
    assert (change.step, change.current, change.ended_steps) == (1, Phase.REPLAY, 1)
    assert clock.steps_by_phase["burst"] == 1


@pytest.mark.parametrize("end", [9, 10])  # a release inside the second replay phase, and at its last step
def test_hold_light_before_pulse_cycles_batch_end_books_the_same_steps_as_after_it(mnist1d_small, end):
    def fit(hold_first: bool) -> tuple[PulseCycle, HoldBetween, pl.LightningModule]:
        pl.seed_everything(0)
        model, data = mnist1d_small(arch="mlp")
        cycle = PulseCycle(burst=4, replay=3, maintain=2, warmup=0, anneal=0, maintain_eval="none")
        hold = HoldBetween(start=2, end=end)
        callbacks = [hold, cycle] if hold_first else [cycle, hold]
        pl.Trainer(callbacks=callbacks, max_steps=20, **trainer_kwargs()).fit(model, data)
        return cycle, hold, model

    (cycle, hold, model), (cycle2, hold2, model2) = fit(hold_first=False), fit(hold_first=True)
    changes = [(c.step, c.current.value, c.reason, c.ended_steps) for c in cycle.history]
    assert changes == [(c.step, c.current.value, c.reason, c.ended_steps) for c in cycle2.history]
    assert changes[1] == (2, "replay", "hold", 2) and (end, "burst", "release") in [c[:3] for c in changes]
    assert hold2.phases == hold.phases and cycle2.clock.steps_by_phase == cycle.clock.steps_by_phase
    for mine, theirs in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(mine, theirs)
