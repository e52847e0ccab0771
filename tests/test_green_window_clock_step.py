"""GreenWindow on a clock that steps forward mid-run (an NTP step, a resume from a laptop's suspend): the step
is time away, measured against the clock's monotonic companion, never compute."""

from __future__ import annotations

import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GreenWindow, SimulatedClock
from lightning_pulse.core.green_window import (
    GreenSchedule,
    GreenWindowPolicy,
    OpenSegment,
    RunClock,
    ScheduleLedger,
    SystemClock,
)
from lightning_pulse.energy.forecast import SeasonalBlendForecast
from tests.conftest import trainer_kwargs

HOUR = 3600.0


class SteppingClock(SimulatedClock):
    """A SimulatedClock with a monotonic companion: :meth:`run` moves both, :meth:`step` the clock alone."""

    def __init__(self, start: float) -> None:
        super().__init__(start)
        self.mono = 0.0

    def run(self, seconds: float) -> None:
        self.now, self.mono = self.now + seconds, self.mono + seconds

    def step(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.mono


def test_a_forward_step_is_booked_as_waited_between_the_computes_parts():
    clock = SteppingClock(1000.0)
    run_clock = RunClock(clock)
    run_clock.restart()
    ledger = ScheduleLedger(lambda t0, t1: 100.0)
    schedule = GreenSchedule(GreenWindowPolicy(SeasonalBlendForecast()), 1.0, True, None, None, ledger)
    segment = OpenSegment(schedule, watts=360.0, run_clock=run_clock)  # 360 W: 1e-4 kWh a second
    run_clock.news = schedule.news
    segment.begin(run_clock.time(), None)
    clock.run(10.0)
    segment.stepped(2)
    run_clock.time()
    clock.run(0.5)
    clock.step(HOUR)  # no time passes on the monotonic clock
    clock.run(5.0)
    run_clock.time()  # the step is placed at the end of the readings it fell between
    clock.step(0.5)  # reading jitter, under the tolerance: compute as before
    clock.run(1.0)
    segment.stepped(1)
    segment.close(run_clock.time(), lambda: None)

    assert schedule.compute_s == pytest.approx(17.0) and schedule.compute_steps == 3
    assert schedule.delayed_s == schedule.clock_away_s == pytest.approx(HOUR)
    kinds = [(s["kind"], s["start"], s["end"]) for s in ledger.segments]
    assert kinds == [("run", 1000.0, 1015.5), ("wait", 1015.5, 4615.5), ("run", 4615.5, 4617.0)]
    assert [s["kwh"] for s in ledger.segments] == pytest.approx([15.5e-4, 0.0, 1.5e-4])
    assert len(schedule.news) == 1 and "the clock stepped forward 1.0 h" in schedule.news[0]
    assert run_clock.away == []  # booked once


def test_a_step_not_yet_booked_at_a_save_is_booked_as_waited_after_the_resume():
    """Review, 39th pass: a step inside the open segment at a checkpoint's save was left out of the saved
    segment, and the resumed run booked it as compute (1,200 s of compute for a 0.7 s fit)."""

    def segment_on(clock):
        run_clock = RunClock(clock)
        ledger = ScheduleLedger(lambda t0, t1: 100.0)
        schedule = GreenSchedule(GreenWindowPolicy(SeasonalBlendForecast()), 1.0, True, None, None, ledger)
        run_clock.news = schedule.news
        return run_clock, schedule, OpenSegment(schedule, watts=360.0, run_clock=run_clock)

    clock = SteppingClock(1000.0)
    run_clock, _, segment = segment_on(clock)
    run_clock.restart()
    segment.begin(run_clock.time(), None)
    clock.run(1.0)
    run_clock.time()
    clock.step(1200.0)
    clock.run(1.0)
    segment.stepped(2)
    saved = segment.state_dict(run_clock.time(), next_check=5000.0)  # the step is in the open segment
    assert saved["away"] == [[1002.0, 2202.0]]  # placed at the end of the readings it fell between

    resumed_clock, schedule, resumed = segment_on(clock)  # a new process: the same clock, read on
    resumed.resume(saved, resumed_clock.restart(saved)[0], lambda: None)
    resumed.close(resumed_clock.time(), lambda: None)
    assert schedule.compute_s == pytest.approx(2.0) and schedule.clock_away_s == pytest.approx(1200.0)


def test_a_clock_without_a_monotonic_companion_is_taken_as_it_reads():
    clock = SimulatedClock(0.0)
    run_clock = RunClock(clock)
    run_clock.restart()
    clock.advance(HOUR)
    assert run_clock.time() == HOUR and run_clock.away == [] and run_clock.news == []
    assert callable(RunClock(SystemClock()).monotonic)


class ClockOfItsOwn:
    """A user's clock with ``time()`` and ``sleep()`` and no ``monotonic()``: the system clock's, ``offset_s``
    away (a wrapper at 0)."""

    def __init__(self, offset_s: float = 0.0) -> None:
        self.offset_s, self.system = offset_s, SystemClock()

    def time(self) -> float:
        return self.system.time() + self.offset_s

    def sleep(self, seconds: float) -> None:
        self.system.sleep(seconds)


class ClockToldToMove:
    """A user's simulated clock (no ``monotonic()``): it moves only when told, even if it starts at the
    system clock's time."""

    def __init__(self, start: float) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_clock_of_its_own_that_moves_only_when_told_is_taken_as_it_reads(monkeypatch):
    offset = [0.0]
    monkeypatch.setattr(SystemClock, "time", lambda self: time.time() + offset[0])
    clock = ClockToldToMove(time.time())  # reads the system clock's time at its start
    run_clock = RunClock(clock)
    start = run_clock.restart()[0]
    clock.sleep(HOUR)  # simulated compute, in no real time
    assert run_clock.time() == start + HOUR
    offset[0] += HOUR  # the system clock steps forward an hour; this clock did not move
    clock.sleep(600.0)
    assert run_clock.time() == start + HOUR + 600.0
    assert run_clock.away == [] and run_clock.news == []


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepTheClock(pl.Callback):
    """Steps the system clock forward an hour (``offset``) after ``at_step``; before GreenWindow reads it."""

    def __init__(self, offset: list[float], at_step: int | None) -> None:
        self.offset, self.at_step = offset, at_step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            self.offset[0] += HOUR


def fit_on_a_stepping_system_clock(
    monkeypatch, tmp_path, at_step: int | None, offset_s: float | None = None, **green_kwargs
):
    """40 steps of a tiny model under GreenWindow on the default clock, whose ``time()`` steps forward an hour
    after ``at_step`` (``time.monotonic`` does not); a pause is recorded, not slept. ``offset_s``: on a
    :class:`ClockOfItsOwn` that far from the system clock instead (it steps with it)."""
    torch.manual_seed(0)
    offset, slept = [0.0], [0.0]

    def sleep(self, seconds: float) -> None:  # as long as a real pause, on both clocks: waited either way
        slept[0] += seconds
        offset[0] += seconds

    monkeypatch.setattr(SystemClock, "time", lambda self: time.time() + offset[0])
    monkeypatch.setattr(SystemClock, "sleep", sleep)
    if offset_s is not None:
        green_kwargs["clock"] = ClockOfItsOwn(offset_s)
    now = time.time() + (offset_s or 0.0)
    # a daily cycle: an hour an hour after the start is dirtier than most, so a wrong plan pauses
    signal = [(now + (k - 48) * HOUR, 300.0 + 200.0 * ((k % 24) in range(10, 20))) for k in range(24 * 5)]
    green = GreenWindow(signal=signal, when_dirty="pause", max_delay=1.0, **green_kwargs)
    trainer = pl.Trainer(
        max_steps=40,
        callbacks=[StepTheClock(offset, at_step), green],
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    data = DataLoader(TensorDataset(torch.randn(320, 8), torch.randint(0, 2, (320,))), batch_size=8)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), data)
    real_s = time.monotonic() - started
    return green.report["summary"], real_s, slept[0], [str(w.message) for w in caught]


def test_a_forward_step_before_the_first_estimate_plans_no_hours_of_work(monkeypatch, tmp_path):
    # sweep-meters: a 1 h step after step 1 was taken as compute: a 1.2 s job planned 40 h of work (its budget
    # 40 h too) and paused an hour (real sleeps on the system clock)
    summary, real_s, slept, said = fit_on_a_stepping_system_clock(monkeypatch, tmp_path, at_step=1)
    assert summary["compute_s"] <= real_s + 0.5
    assert summary["planned_work_s"] < real_s + 1.0 and summary["budget_s"] < real_s + 1.0
    assert slept == 0.0  # the step spent the budget: no pause
    assert summary["clock_away_s"] == pytest.approx(HOUR, abs=1.0)
    assert summary["waited_s"] == pytest.approx(summary["clock_away_s"])
    stepped = [line for line in said if "the clock stepped forward" in line]
    assert len(stepped) == 1 and "booked as time away (waited" in stepped[0]


def test_a_forward_step_later_is_no_compute_and_no_missed_deadline(monkeypatch, tmp_path):
    # sweep-meters: a 1 h step after step 5 reported compute_s 3601 s for a 1.2 s fit, and warned that a 3 h
    # deadline could not be met with "about 7.0 h of work left"
    summary, real_s, _, said = fit_on_a_stepping_system_clock(monkeypatch, tmp_path, 5, deadline="+3h")
    assert summary["compute_s"] <= real_s + 0.5
    assert not [line for line in said if "cannot be met" in line or "has passed" in line]
    assert summary["deadline_unmet"] is None
    assert summary["clock_away_s"] == pytest.approx(HOUR, abs=1.0)


def test_without_a_step_nothing_is_booked_away(monkeypatch, tmp_path):
    summary, real_s, slept, said = fit_on_a_stepping_system_clock(monkeypatch, tmp_path, None)
    assert summary["clock_away_s"] == 0.0 and summary["waited_s"] == slept
    assert 0.0 < summary["compute_s"] <= real_s + 0.5
    assert not [line for line in said if "stepped forward" in line]


@pytest.mark.parametrize("offset_s", [0.0, -86400.0], ids=["a-wrapper", "a-day-behind"])
def test_a_step_of_a_clock_of_its_own_that_follows_the_system_clock_is_time_away(
    monkeypatch, tmp_path, offset_s
):
    # pass 39 left it open: a clock of the user's with time() and sleep() and no monotonic() (a wrapper of the
    # system clock, or one offset from it) booked the system clock's 1 h step as compute, and a 1.2 s job
    # planned 40 h of work
    summary, real_s, slept, said = fit_on_a_stepping_system_clock(monkeypatch, tmp_path, 1, offset_s)
    assert summary["compute_s"] <= real_s + 0.5 and summary["planned_work_s"] < real_s + 1.0
    assert slept == 0.0
    assert summary["clock_away_s"] == pytest.approx(HOUR, abs=1.0)
    assert len([line for line in said if "the clock stepped forward 1.0 h" in line]) == 1
