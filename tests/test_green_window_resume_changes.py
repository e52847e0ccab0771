"""GreenWindow resumed with other arguments than its checkpoint's, or added on a resume of a checkpoint saved
without it: the delay budget and the planned work follow what this fit was given, and it says so."""

from __future__ import annotations

import math
import warnings

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pulse import GreenWindow, GreenWindowOptions, SimulatedClock
from lightning_pulse.core.green_window import GreenSchedule, GreenWindowPolicy, ScheduleLedger
from lightning_pulse.energy.forecast import OracleForecast
from tests.test_green_window import DE_JUNE, STEP_S, SaveTimes, fit

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


def test_a_rebuilt_budget_is_the_one_saved_next_and_an_older_checkpoints_is_kept():
    rebuilt = _schedule(max_delay=1.0)
    rebuilt.load_state_dict(_saved_after_an_hour_waited())
    told, warned = rebuilt.start_fit(16, 32.0)
    assert told is None and "`max_delay`=1.0" in warned and rebuilt.budget_s == pytest.approx(8 * H)
    assert rebuilt.budget_left_s() == pytest.approx(7 * H)  # the hour waited counts against it
    again = _schedule(max_delay=1.0)  # a later resume with the same argument: nothing to build again
    again.load_state_dict(rebuilt.state_dict())
    assert again.start_fit(30, 18.0) == (None, None) and again.budget_s == pytest.approx(8 * H)

    older = _saved_after_an_hour_waited()
    del older["budget_from"]  # saved before the budget's arguments were: they cannot be compared
    kept = _schedule(max_delay=1.0)
    kept.load_state_dict(older)
    assert kept.start_fit(16, 32.0) == (None, None) and kept.budget_s == pytest.approx(4 * H)


def test_a_share_whose_expected_duration_was_dropped_is_placed_on_the_run_measured():
    # 6 steps took an hour (10 min a step), at step 16 of 48: the run's 48 steps are 8 h at that pace
    schedule = _schedule(max_delay=0.5, expected_s=None)
    schedule.load_state_dict(_saved_after_an_hour_waited(expected_s=12 * H))
    _, warned = schedule.start_fit(16, 32.0)
    assert schedule.planned_work_s == pytest.approx(8 * H) and schedule.budget_s == pytest.approx(4 * H)
    assert (
        "resumed with `expected_duration`=None, where" in warned
        and "from `expected_duration`='12h'" in warned
    )


def test_a_budget_changed_to_a_duration_keeps_the_planned_work_and_names_the_duration():
    schedule = _schedule(max_delay=5400.0, share=False)
    schedule.load_state_dict(_saved_after_an_hour_waited())
    _, warned = schedule.start_fit(16, 32.0)
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
    assert "it plans the work left, 24 of the run's 48 steps" in line
    if expected is not None:  # a share of the whole run's expected compute time, by the steps left
        assert ": 4.0 h of `expected_duration` (8.0 h, the whole run's)" in line
    assert line.endswith("its report (compute, waits, saving) counts from step 24 on.")
    assert any(m.endswith(", counted from step 24 on.") for m in caplog.messages)  # the saving line
    markdown = (report_dir / "green_window_report.md").read_text()
    assert "| counts from step | 24 (GreenWindow was added on a resume there) |" in markdown


def test_a_green_window_added_on_a_resume_of_a_run_of_unknown_length_says_it_plans_its_expected_duration():
    schedule = _schedule(max_delay=1.0, expected_s=8 * H)
    told, warned = schedule.start_fit(24, math.inf)
    assert warned is None and schedule.from_step == 24 and schedule.work_share == 1.0
    assert "the run's length in steps is unknown: it plans `expected_duration` (8.0 h) as the rest" in told
    assert _schedule().start_fit(0, 48.0) == (None, None)  # a new run: no line
