"""PulseCycle's hold: another callback keeps the run in the light phases, and lets it go."""

from __future__ import annotations

import lightning.pytorch as pl
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
