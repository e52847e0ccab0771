"""GreenWindow resumed with other arguments than its checkpoint's, or added on a resume of a checkpoint saved
without it: the delay budget and the planned work follow what this fit was given, and it says so."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from lightning_pulse import GreenWindow, GreenWindowOptions, SimulatedClock
from lightning_pulse.callbacks.green_window import SUSPEND_CHECKPOINT
from lightning_pulse.cli import run_wait_for_window
from lightning_pulse.core.green_window import GreenSchedule, GreenWindowPolicy, ScheduleLedger, duration_arg
from lightning_pulse.energy.forecast import OracleForecast
from tests.test_green_window import DE_JUNE, STEP_S, SaveTimes, cycle, fit

H = 3600.0
START = "2020-06-19 00:00:00"  # the run waits the first hour, before its checkpoint at step 10


def _paused(tmp_path, clock_start, ckpt_path=None, save=False, **arguments):
    """A pause-mode run of 48 steps (8 h of compute) on its own SimulatedClock, ``max_delay=0.5`` of
    ``expected_duration="8h"`` unless given; its GreenWindow, its clock, the times its checkpoints (every 10
    steps, when ``save``) were saved at, and the GreenWindow warnings it gave."""
    clock = SimulatedClock(clock_start)
    green = GreenWindow(
        signal=DE_JUNE,
        when_dirty="pause",
        clock=clock,
        options=GreenWindowOptions(watts=300.0, report_dir=str(tmp_path / "report")),
        **{"max_delay": 0.5, "expected_duration": "8h", **arguments},
    )
    times = SaveTimes(clock)
    callbacks = [green, times]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1))
    trainer = fit(callbacks, clock, steps=48, enable_checkpointing=save, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(*_data(), ckpt_path=ckpt_path)
    said = [str(w.message) for w in caught if str(w.message).startswith("GreenWindow")]
    return green, clock, times.saved, said


def _data():
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

    return MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=64)


@pytest.mark.parametrize(
    ("given", "budget_s", "planned_s", "now", "was"),
    [
        # held-out sweep: each kept the checkpoint's 4 h budget, silently; max_delay=0 waited 3 h more
        ({"max_delay": 0.0}, 0.0, 8 * H, "`max_delay`=0.0", "`max_delay`=0.5"),
        ({"max_delay": "30min"}, 0.5 * H, 8 * H, "`max_delay`='30min'", "`max_delay`=0.5"),
        ({"max_delay": 2.0}, 16 * H, 8 * H, "`max_delay`=2.0", "`max_delay`=0.5"),
        (
            {"expected_duration": "16h"},
            8 * H,
            16 * H,
            "`expected_duration`='16h'",
            "`expected_duration`='8h'",
        ),
    ],
)
def test_a_resume_with_another_max_delay_or_expected_duration_rebuilds_the_budget_and_says_so(
    tmp_path, given, budget_s, planned_s, now, was
):
    full, _, saved, said = _paused(tmp_path, START, save=True)
    assert full.report["summary"]["budget_s"] == pytest.approx(4 * H) and not said
    waited_before = sum(s["end"] - s["start"] for s in full.report["segments"] if s["end"] <= saved[10])
    assert waited_before == pytest.approx(H)  # the first hour, waited before the checkpoint
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=10.ckpt")

    green, clock, _, said = _paused(tmp_path, saved[10], ckpt_path=str(checkpoint), **given)
    summary = green.report["summary"]
    assert summary["budget_s"] == pytest.approx(budget_s)
    assert summary["planned_work_s"] == pytest.approx(planned_s)
    assert summary["budget_left_s"] == pytest.approx(max(budget_s - summary["waited_s"], 0.0))
    (line,) = [line for line in said if "delay budget" in line]
    assert line.startswith(f"GreenWindow: resumed with {now}, where the checkpoint's delay budget was built ")
    assert f"from {was}: the budget is now " in line
    if "expected_duration" in given:  # the share placed on the new expected compute time
        assert "the budget is now 8.0 h (0.5 x 16.0 h of planned work, was 4.0 h)" in line
    assert "the 1.0 h already waited or held light counts against it" in line
    assert line.endswith(f"To keep the checkpoint's budget, resume with {was}.")
    if budget_s <= H:  # the hour already waited spent it: the rest of the run does not wait
        assert "leaving 0 s" in line
        assert summary["waited_s"] == pytest.approx(H)
        assert clock.time() == pytest.approx(saved[10] + 38 * STEP_S)
    else:
        assert summary["waited_s"] <= budget_s + 1e-6


def test_a_resume_with_the_checkpoints_arguments_keeps_its_budget_without_a_word(tmp_path):
    full, _, saved, _ = _paused(tmp_path, START, save=True)
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=10.ckpt")
    green, _, _, said = _paused(tmp_path, saved[10], ckpt_path=str(checkpoint), max_delay=0.5)
    assert not [line for line in said if "delay budget" in line]
    for name in ("budget_s", "planned_work_s", "waited_s", "budget_left_s", "decisions"):
        assert green.report["summary"][name] == pytest.approx(full.report["summary"][name]), name


def _schedule(max_delay: float = 0.5, share: bool = True, expected_s: float | None = 8 * H) -> GreenSchedule:
    ledger = ScheduleLedger(lambda start, end: 1.0)
    return GreenSchedule(GreenWindowPolicy(OracleForecast()), max_delay, share, expected_s, None, ledger)


def _saved_after_an_hour_waited(**arguments) -> dict:
    schedule = _schedule(**arguments)
    schedule.begin(0.0)
    schedule.budget_s, schedule.planned_work_s = 0.5 * 8 * H, 8 * H  # fixed at the first decision
    schedule.waited(0.0, H, None)
    schedule.ran("run", H, 2 * H, 6, None)  # 6 steps in an hour: 10 min a step
    return schedule.state_dict()


def _start_fit(schedule: GreenSchedule, step: int, steps_left: float) -> tuple[str | None, str | None]:
    """What :func:`~lightning_pulse.core.green_window.restart_run` asks of the schedule at train start (no
    open segment): the line it tells (added on a resume) and the one it warns (a rebuilt budget)."""
    told = schedule.start_fit(step, steps_left)
    schedule.begin(0.0)
    return told, schedule.restarted(step, steps_left)


def test_a_rebuilt_budget_is_the_one_saved_next_and_an_older_checkpoints_is_kept():
    rebuilt = _schedule(max_delay=1.0)
    rebuilt.load_state_dict(_saved_after_an_hour_waited())
    told, warned = _start_fit(rebuilt, 16, 32.0)
    assert told is None and "`max_delay`=1.0" in warned and rebuilt.budget_s == pytest.approx(8 * H)
    assert rebuilt.budget_left_s() == pytest.approx(7 * H)  # the hour waited counts against it
    again = _schedule(max_delay=1.0)  # a later resume with the same argument: nothing to build again
    again.load_state_dict(rebuilt.state_dict())
    assert _start_fit(again, 30, 18.0) == (None, None) and again.budget_s == pytest.approx(8 * H)

    older = _saved_after_an_hour_waited()
    del older["budget_from"]  # saved before the budget's arguments were: they cannot be compared
    kept = _schedule(max_delay=1.0)
    kept.load_state_dict(older)
    assert _start_fit(kept, 16, 32.0) == (None, None) and kept.budget_s == pytest.approx(4 * H)


def test_a_share_whose_expected_duration_was_dropped_is_placed_on_the_run_measured():
    # 6 steps took an hour (10 min a step), at step 16 of 48: the run's 48 steps are 8 h at that pace
    schedule = _schedule(max_delay=0.5, expected_s=None)
    schedule.load_state_dict(_saved_after_an_hour_waited(expected_s=12 * H))
    _, warned = _start_fit(schedule, 16, 32.0)
    assert schedule.planned_work_s == pytest.approx(8 * H) and schedule.budget_s == pytest.approx(4 * H)
    assert (
        "resumed with `expected_duration`=None, where" in warned
        and "from `expected_duration`='12h'" in warned
    )


def test_a_budget_changed_to_a_duration_keeps_the_planned_work_and_names_the_duration():
    schedule = _schedule(max_delay=5400.0, share=False)
    schedule.load_state_dict(_saved_after_an_hour_waited())
    _, warned = _start_fit(schedule, 16, 32.0)
    assert schedule.budget_s == 5400.0 and schedule.planned_work_s == pytest.approx(8 * H)
    assert warned.startswith("GreenWindow: resumed with `max_delay`='90min', where ")
    assert "the budget is now 1.5 h (was 4.0 h)" in warned and "leaving 30 min" in warned


@pytest.mark.parametrize("expected", ["8h", None])
def test_a_green_window_added_on_a_resume_plans_the_work_left_and_says_where_its_figures_start(
    tmp_path, caplog, expected
):
    # held-out sweep: added at step 24 of a 48-step, 8 h run, it planned 8 h of work with an 8 h budget for
    # the 4 h left, waited 6 h, and reported its half as the run ("complete", nothing said)
    clock = SimulatedClock(START)
    saving = ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=24, save_top_k=-1)
    fit([saving], clock, steps=48, enable_checkpointing=True, default_root_dir=tmp_path).fit(*_data())
    (checkpoint,) = (tmp_path / "plain").glob("*step=24.ckpt")

    clock = SimulatedClock("2020-06-19 04:00:00")
    report_dir = tmp_path / "report"
    green = GreenWindow(
        signal=DE_JUNE,
        when_dirty="pause",
        expected_duration=expected,
        clock=clock,
        options=GreenWindowOptions(watts=300.0, report_dir=str(report_dir)),
    )
    with caplog.at_level("INFO"):
        fit([green], clock, steps=48, default_root_dir=tmp_path).fit(*_data(), ckpt_path=str(checkpoint))
    summary = green.report["summary"]
    assert summary["planned_work_s"] == pytest.approx(4 * H) and summary["budget_s"] == pytest.approx(4 * H)
    assert summary["waited_s"] <= 4 * H + 1e-6
    assert summary.get("from_step") == 24 and summary["compute_s"] == pytest.approx(4 * H)
    (line,) = [line for line in caplog.messages if "added on a resume" in line]
    assert line.startswith("GreenWindow: added on a resume at step 24, with no state of its own in the ")
    assert "it plans the work left, 50% of the run's training batches" in line
    if expected is not None:  # a share of the whole run's expected compute time, by the steps left
        assert ": 4.0 h of `expected_duration` (8.0 h, the whole run's)" in line
    assert line.endswith("its report (compute, waits, saving) counts from step 24 on.")
    assert any(m.endswith(", counted from step 24 on.") for m in caplog.messages)  # the saving line
    markdown = (report_dir / "green_window_report.md").read_text()
    assert "| counts from step | 24 (GreenWindow was added on a resume there) |" in markdown


def test_a_green_window_added_on_a_resume_of_a_run_of_unknown_length_says_it_plans_its_expected_duration():
    schedule = _schedule(max_delay=1.0, expected_s=8 * H)
    told, warned = _start_fit(schedule, 24, math.inf)
    assert warned is None and schedule.from_step == 24 and schedule.work_share == 1.0
    assert "the run's length in steps is unknown: it plans `expected_duration` (8.0 h) as the rest" in told
    assert _start_fit(_schedule(), 0, 48.0) == (None, None)  # a new run: no line


@pytest.mark.parametrize("field", ["max_delay", "expected_duration"])
def test_one_duration_written_two_ways_is_no_change(field):
    # a review: "1.1h" parses to 3960.0000000000005 s, "66min" to 3960.0 s; compared exactly, a resume warned
    # that the budget was rebuilt, and named '3960s' as the way back
    saved = GreenWindow(signal=DE_JUNE, when_dirty="pause", **{field: "1.1h"}).schedule
    saved.begin(0.0)
    saved.budget_s, saved.planned_work_s = 3600.0, 3960.0
    resumed = GreenWindow(signal=DE_JUNE, when_dirty="pause", **{field: "66min"}).schedule
    resumed.load_state_dict(saved.state_dict())
    assert _start_fit(resumed, 10, 10.0) == (None, None) and resumed.budget_s == 3600.0
    assert duration_arg(saved.max_delay if field == "max_delay" else saved.expected_work_s) == "'66min'"


def test_a_duration_budget_replaced_by_a_share_names_no_expected_duration_it_was_built_from():
    schedule = _schedule(max_delay=0.5, expected_s=None)
    schedule.load_state_dict(_saved_after_an_hour_waited(max_delay=7200.0, share=False, expected_s=8 * H))
    _, warned = _start_fit(schedule, 16, 32.0)
    assert "built from `max_delay`='2h': the budget is now 4.0 h (0.5 x 8.0 h of planned work" in warned
    assert "expected_duration" not in warned and warned.endswith("resume with `max_delay`='2h'.")


def test_a_green_window_joined_under_an_accumulation_scheduler_says_the_share_of_batches_it_plans(
    tmp_path, caplog
):
    # a review: joined after 2 epochs of 12 batches, 1 a step, then 2 epochs at 2 a step (36 steps, 48
    # batches), it said "it plans the work left, 24 of the run's 48 steps": the run has 36, 12 of them left
    clock = SimulatedClock(START)
    saving = ModelCheckpoint(dirpath=tmp_path / "plain", every_n_epochs=2, save_top_k=-1)
    kwargs = dict(steps=-1, max_epochs=4, enable_checkpointing=True, default_root_dir=tmp_path)
    fit([saving, GradientAccumulationScheduler({0: 1, 2: 2})], clock, **kwargs).fit(*_data())
    (checkpoint,) = (tmp_path / "plain").glob("*step=24.ckpt")

    green = GreenWindow(signal=DE_JUNE, when_dirty="pause", expected_duration="8h", clock=clock)
    with caplog.at_level("INFO"):
        trainer = fit([green, GradientAccumulationScheduler({0: 1, 2: 2})], clock, **kwargs)
        trainer.fit(*_data(), ckpt_path=str(checkpoint))
    assert trainer.global_step == 36 and green.schedule.work_share == pytest.approx(0.5)
    (line,) = [line for line in caplog.messages if "added on a resume" in line]
    assert "it plans the work left, 50% of the run's training batches: 4.0 h of `expected_duration`" in line


class _AtTrainStart(pl.Callback):
    """What was waited (suspend mode holds no light), and the budget left, after GreenWindow's train start."""

    def __init__(self, green: GreenWindow) -> None:
        self.green, self.seen = green, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = self.green.schedule.delayed_s, self.green.schedule.budget_left_s()


@pytest.mark.parametrize(("max_delay", "budget_s", "left"), [("3h", 3 * H, "0 s"), (1.5, 12 * H, "5.0 h")])
def test_a_resume_from_its_own_suspend_with_another_max_delay_counts_the_suspension_in_its_warning(
    tmp_path, max_delay, budget_s, left
):
    # a review: suspended 7 h and resumed with max_delay="3h", it warned "the 0 s already waited or held light
    # counts against it, leaving 3.0 h": the 7 h away were counted as waited after the warning was written
    clock, folder = SimulatedClock("2020-06-16 12:00:00"), tmp_path / "ckpt"

    def attempt(max_delay, ckpt_path=None):
        green = GreenWindow(
            signal=DE_JUNE, when_dirty="suspend", max_delay=max_delay, clock=clock, options={"watts": 300.0}
        )
        probe = _AtTrainStart(green)
        saving = ModelCheckpoint(dirpath=folder, save_top_k=0)
        trainer = fit(
            [green, probe, saving], clock, steps=48, enable_checkpointing=True, default_root_dir=tmp_path
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(*_data(), ckpt_path=ckpt_path)
        return green, probe, trainer, [str(w.message) for w in caught if "delay budget" in str(w.message)]

    first, _, trainer, _ = attempt(1.0)
    assert trainer.global_step == 25 and first.schedule.budget_s == pytest.approx(8 * H)
    suspended_at = first.suspended["at"]
    assert run_wait_for_window([str(folder)], clock=clock) == 0
    assert clock.time() - suspended_at == pytest.approx(7 * H)

    green, probe, trainer, (line,) = attempt(max_delay, str(folder / SUSPEND_CHECKPOINT))
    assert f"the budget is now {budget_s / H:.1f} h (" in line
    assert f"and the 7.0 h already waited or held light counts against it, leaving {left}. " in line
    # the figures the run goes on with: the suspension counted as waited, the budget left
    assert probe.seen == pytest.approx((7 * H, max(budget_s - 7 * H, 0.0)))
    if left == "0 s":  # the budget is spent: the run trains to its end without another suspend
        summary = green.report["summary"]
        assert trainer.global_step == 48 and green.report["status"] == "complete"
        assert summary["waited_s"] == pytest.approx(7 * H) and summary["budget_left_s"] == 0.0


def _light(tmp_path, clock_start, ckpt_path=None, save=False, max_delay=0.5):
    """A light-mode run of 48 steps under a PulseCycle of 3 bursts and 3 replays; its report, the times its
    checkpoints (every 5 steps, when ``save``) were saved at, and the delay-budget warnings it gave."""
    clock = SimulatedClock(clock_start)
    green = GreenWindow(
        signal=DE_JUNE, when_dirty="light", max_delay=max_delay, clock=clock, options={"watts": 300.0}
    )
    times = SaveTimes(clock)
    callbacks = [cycle(), green, times]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1))
    trainer = fit(callbacks, clock, steps=48, enable_checkpointing=save, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(*_data(), ckpt_path=ckpt_path)
    said = [str(w.message) for w in caught if "delay budget" in str(w.message)]
    return green.report["summary"], times.saved, said


@pytest.mark.parametrize(
    ("step", "held_s", "warned"), [(25, 2 * H, "2.0 h"), (30, 2 * H + 5 * STEP_S, "2.8 h")]
)
def test_a_light_resume_whose_rebuilt_budget_is_spent_holds_no_more_light(tmp_path, step, held_s, warned):
    # a review: resumed at step 25 with max_delay 0.2 (1.6 h of 8 h), the slot the checkpoint was holding ran
    # to its end, its next decision the checkpoint's: 3.0 h held light on a 1.6 h budget; resumed at step 30,
    # the warning left out the 5 steps held in the open segment ("2.0 h already ... held light")
    full, saved, _ = _light(tmp_path, START, save=True)
    assert full["light_s"] > 2 * H
    (checkpoint,) = (tmp_path / "ckpt").glob(f"*step={step}.ckpt")
    summary, _, (line,) = _light(tmp_path, saved[step], ckpt_path=str(checkpoint), max_delay=0.2)
    assert f"the {warned} already waited or held light counts against it, leaving 0 s." in line
    assert summary["budget_s"] == pytest.approx(1.6 * H)
    assert summary["light_s"] == pytest.approx(held_s)  # what was held before the resume, and nothing after
