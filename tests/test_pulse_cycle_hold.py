"""PulseCycle's hold: another callback keeps the run in the light phases, and lets it go."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pulse import EnergyLogger, Phase, PhaseClock, PulseCycle, phase_of
from tests.conftest import RecordingLogger, trainer_kwargs


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


def steps_ran(clock: PhaseClock) -> list[int]:
    """The steps of every phase that ended, by the clock's history (the start ended none)."""
    return [change.ended_steps for change in clock.history if change.previous is not None]


def test_a_release_where_a_held_cycle_wraps_starts_the_burst_in_that_cycle():
    # held from step 1: replay, maintain, then at step 5 replay again (cycle 1), where the release lands
    clock = PhaseClock({"burst": 4, "replay": 2, "maintain": 2})
    clock.start(None)
    assert run(clock, 1) == "b" and len(clock.hold(True)) == 1 and run(clock, 4) == "rrmm"
    assert (clock.phase, clock.cycle, clock.step) == (Phase.REPLAY, 1, 5)  # entered now: no step ran in it
    restored = PhaseClock({"burst": 4, "replay": 2, "maintain": 2})
    restored.load_state_dict(clock.state_dict())  # saved between the entry and the release: no state is lost
    for each in (clock, restored):
        (change,) = each.hold(False)  # not a zero-step replay of a cycle 1 and a burst of cycle 2
        assert (change.previous, change.current, change.reason) == (Phase.MAINTAIN, Phase.BURST, "release")
        assert (change.cycle, change.step, change.ended_steps) == (1, 5, 2)
        assert steps_ran(each) == [1, 2, 2] and each.cycle == 1 and run(each, 5) == "bbbbr"
    assert restored.state_dict() == clock.state_dict()


def test_a_hold_at_the_start_starts_the_clock_where_it_leads():
    # a scheduler listed after PulseCycle holds at its fit start, after the clock started in burst
    clock = PhaseClock({"burst": 4, "replay": 2, "maintain": 2})
    clock.start(None)
    (told,) = clock.hold(True)  # the burst of no step is replaced: as if held before the start
    assert (told.previous, told.current, told.reason, told.cycle) == (None, Phase.REPLAY, "start", 0)
    assert clock.history == [told] and told.metrics() == {}  # no `pulse/burst_steps` 0 row
    held_first = PhaseClock({"burst": 4, "replay": 2, "maintain": 2})
    assert held_first.hold(True) == [] and held_first.start(None) == told


def test_a_hold_asked_inside_the_step_that_ends_a_phase_replaces_its_entry_before_anyone_hears_of_it():
    clock = PhaseClock({"burst": 4, "replay": 2, "maintain": 2})
    clock.start(None)
    assert run(clock, 7) == "bbbbrrm"
    clock.rows.step_starts(clock)
    assert clock.hold(True, step=8) == []  # a scheduler's batch end before PulseCycle's: waits for the count
    (entry,) = clock.advance(1)  # the maintain ends with step 7: a burst of cycle 1 falls due
    assert (entry.current, entry.cycle) == (Phase.BURST, 1)
    (change,) = clock.with_due_hold([entry])  # the burst, which no step ran in, is never told
    assert (change.previous, change.current, change.reason) == (Phase.MAINTAIN, Phase.REPLAY, "hold")
    assert (change.cycle, change.ended_steps) == (1, 2) and steps_ran(clock) == [4, 2, 2]


def test_a_hold_where_a_burst_falls_due_in_a_cycle_of_one_light_phase_keeps_the_replay_going():
    clock = PhaseClock({"burst": 2, "replay": 2})
    clock.start(None)
    assert run(clock, 4) == "bbrr"  # at step 4 the replay's budget ran out: a burst of cycle 1 falls due
    (told,) = clock.hold(True)  # the burst entry was told already: listeners hear the replay goes on
    assert (told.previous, told.current, told.reason, told.cycle) == (None, Phase.REPLAY, "resume", 1)
    assert told not in clock.history and steps_ran(clock) == [2]
    assert run(clock, 3) == "rrr" and clock.cycle == 2  # as a held cycle of one phase: a budget, then another
    (change,) = clock.hold(False)
    assert (change.previous, change.current, change.ended_steps) == (Phase.REPLAY, Phase.BURST, 5)
    # asked inside the step that ends the phase: nothing to tell, nothing kept
    clock = PhaseClock({"burst": 2, "replay": 2})
    clock.start(None)
    assert run(clock, 3) == "bbr"
    clock.rows.step_starts(clock)
    clock.hold(True, step=4)
    assert clock.with_due_hold(clock.advance(1)) == [] and clock.phase is Phase.REPLAY
    assert steps_ran(clock) == [2] and clock.cycle == 1


def test_a_release_as_a_held_warmup_ends_goes_on_in_burst():
    clock = PhaseClock({"burst": 2, "replay": 2}, warmup=0.1)
    clock.start(40)
    assert clock.hold(True) == [] and run(clock, 4, total=40) == "bbbb"  # held warm-up: it ends into replay
    (told,) = clock.hold(False)
    assert (told.current, told.reason) == (Phase.BURST, "resume") and steps_ran(clock) == []
    assert run(clock, 3, total=40) == "bbr"  # the burst's budget starts with the cycle, as unheld
    assert clock.history[-1].ended_steps == 6  # warm-up's 4 and the cycle's 2, one stay in burst


class HoldAt(Callback):
    """Holds (True) or releases (False) the cycle at the given steps' batch ends; records what it hears."""

    def __init__(self, at: dict[int, bool]) -> None:
        self.at, self.told = at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.at:
            cycle = next(c for c in trainer.callbacks if isinstance(c, PulseCycle))
            cycle.hold_light(trainer, pl_module, self.at[trainer.global_step])

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.told.append(change)


def changes_of(history) -> list[tuple[int, str, str, int, int]]:
    return [(c.step, c.current.value, c.reason, c.cycle, c.ended_steps) for c in history]


# held from step 2: replay 2-3, maintain 4-5, replay 6-7 (cycle 1), maintain 8-9, and at step 10 the held
# cycle wraps to replay (cycle 2) as the release lands; or a burst 0-3, replay, maintain, and at step 8 a
# burst of cycle 1 falls due as the hold lands, and at step 14, held, a maintain as the release lands (the
# steps on a boundary, then the changes)
BOUNDARY_HOLDS = {
    "release as a held cycle wraps": (
        {2: True, 10: False},
        [10],
        [(0, "burst", "start", 0, 0), (2, "replay", "hold", 0, 2), (4, "maintain", "budget", 0, 2)]
        + [(6, "replay", "budget", 1, 2), (8, "maintain", "budget", 1, 2), (10, "burst", "release", 2, 2)]
        + [(14, "replay", "budget", 2, 4)],
    ),
    "hold as a burst falls due": (
        {8: True, 14: False},
        [8, 14],
        [(0, "burst", "start", 0, 0), (4, "replay", "budget", 0, 4), (6, "maintain", "budget", 0, 2)]
        + [(8, "replay", "hold", 1, 2), (10, "maintain", "budget", 1, 2), (12, "replay", "budget", 2, 2)]
        + [(14, "burst", "release", 3, 2)],
    ),
}


@pytest.mark.parametrize("hold_first", [False, True], ids=["hold_after", "hold_before"])
@pytest.mark.parametrize("case", list(BOUNDARY_HOLDS))
def test_a_hold_on_a_phase_boundary_records_no_phase_without_steps_nor_a_cycle_for_it(
    mnist1d_small, tmp_path, case, hold_first
):
    at, on_boundary, expected = BOUNDARY_HOLDS[case]
    pl.seed_everything(0)
    model, data = mnist1d_small(arch="mlp")
    cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    hold, energy, logger = HoldAt(at), EnergyLogger(), RecordingLogger()
    callbacks = [hold, cycle, energy] if hold_first else [cycle, hold, energy]
    kwargs = trainer_kwargs(logger=logger, log_every_n_steps=50, default_root_dir=tmp_path)
    pl.Trainer(callbacks=callbacks, max_steps=15, **kwargs).fit(model, data)

    assert changes_of(cycle.history) == expected and cycle.cycle == expected[-1][3]
    logged = [(key, value) for _, row in logger.rows for key, value in row.items()]
    assert [row for row in logged if row[0].endswith("_steps") and not row[1]] == []
    cycles = energy.report["cycles"]
    assert sorted(cycles, key=int) == [str(n) for n in range(expected[-1][3] + 1)]
    assert all(cycles[n]["steps"] > 0 for n in cycles)
    assert [value for key, value in logged if key == "energy/cycle"] == [float(n) for n in range(cycle.cycle)]
    told = changes_of(hold.told)
    if hold_first:  # asked before PulseCycle's batch end: the phase that never ran is never told
        assert told == expected
    else:  # told by PulseCycle's batch end before the hold came, then replaced at once, at its step
        replaced = [index for index, change in enumerate(told) if change not in expected]
        assert [told[index][0] for index in replaced] == on_boundary
        assert all(told[index + 1][0] == told[index][0] for index in replaced)
        assert [change for index, change in enumerate(told) if index not in replaced] == expected


def test_a_run_resumed_after_a_hold_on_a_boundary_goes_on_as_the_uninterrupted_one(mnist1d_small, tmp_path):
    def fit(max_steps: int, ckpt_path: str | None = None) -> PulseCycle:
        pl.seed_everything(0)
        model, data = mnist1d_small(arch="mlp")
        cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0, maintain_eval="none")
        saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
        kwargs = trainer_kwargs(enable_checkpointing=True)
        trainer = pl.Trainer(
            callbacks=[cycle, HoldAt({2: True, 10: False}), saves], max_steps=max_steps, **kwargs
        )
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return cycle

    whole = fit(16)
    (saved,) = [
        path for path in tmp_path.iterdir() if "step=10" in path.name
    ]  # saved right after the release
    resumed = fit(16, str(saved))
    assert changes_of(resumed.history) == changes_of(whole.history)
    assert all(change.ended_steps for change in resumed.history[1:])  # no phase without a step
    assert (resumed.cycle, resumed.clock.steps_by_phase) == (whole.cycle, whole.clock.steps_by_phase)
