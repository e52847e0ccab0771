"""GreenWindow when the fit is not an ordinary run: SIGTERM during a pause, and a fast_dev_run smoke test."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pulse import GreenWindow, GreenWindowOptions, SimulatedClock
from tests.conftest import trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]


def dirty_now_signal(now: float) -> list[tuple[float, float]]:
    """Three weeks back and three days ahead of ``now``: 500 in the hour of ``now`` and the next (so the slot
    starting now is dirty whatever its minute), 100 otherwise; the same every day."""
    hour = now - now % 3600
    return [(hour + k * 3600, 500.0 if k % 24 in (0, 1) else 100.0) for k in range(-21 * 24, 3 * 24)]


# the child fits on the system clock: GreenWindow pauses a one-hour slot at train start
SIGTERM_CHILD = textwrap.dedent(
    """
    import time, torch
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from lightning_pulse import GreenWindow, GreenWindowOptions
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from tests.test_green_window_interruptions import dirty_now_signal

    green = GreenWindow(
        signal=dirty_now_signal(time.time()), when_dirty="pause", threshold=200.0, max_delay="6h",
        expected_duration="1h", options=GreenWindowOptions(watts=100.0, report_dir=REPORT_DIR),
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=50, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[green],
    )
    try:
        trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000))
    except SIGTERMException:
        print(f"SIGTERMException at step {trainer.global_step}, waited {green.schedule.delayed_s:.0f} s")
    """
)


def test_sigterm_during_a_pause_ends_the_wait_and_lightning_stops_the_fit(tmp_path):
    # a pause slept its slot in one time.sleep; Lightning's SIGTERM handler only sets a flag, so the process
    # slept on (up to an hour) until the supervisor's SIGKILL, with no checkpoint
    code = SIGTERM_CHILD.replace("REPORT_DIR", repr(str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in child.stdout:  # the child's imports take seconds on a loaded machine
            lines.append(line)
            if "GreenWindow: waits (pause)" in line:
                break
        assert "GreenWindow: waits (pause)" in lines[-1], "".join(lines)
        time.sleep(1.5)  # inside the sleep, past a first slice
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        try:
            rest, _ = child.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("still sleeping 15 s after SIGTERM: the pause ignores it")
        took = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert took < 10, rest
    assert "GreenWindow: SIGTERM received; the pause ends after" in rest
    # as without GreenWindow: Lightning's own SIGTERMException at the end of the next batch (the first)
    assert "SIGTERMException at step 1" in rest, rest
    waited = int(rest.split("waited ")[1].split(" s")[0])
    assert 1 <= waited < 60  # the pause, cut short, not its hour


@pytest.mark.parametrize("when_dirty", ["suspend", "pause"])
def test_a_fast_dev_run_smoke_test_runs_its_batch_without_waiting_or_suspending(
    mnist1d_small, tmp_path, caplog, when_dirty
):
    # it suspended before the one batch (writing two checkpoints and a resume file Lightning would not) or
    # paused until the window opened, and the smoke test "passed" with global_step 0
    model, data = mnist1d_small(arch="mlp")
    clock = SimulatedClock("2020-06-15 06:00:00")
    start = clock.time()
    green = GreenWindow(
        signal=dirty_now_signal(start),
        when_dirty=when_dirty,
        expected_duration="8h",
        clock=clock,
        options=GreenWindowOptions(watts=100.0, report_dir=str(tmp_path / "report")),
    )
    checkpoints = tmp_path / "ckpt"
    trainer = pl.Trainer(
        callbacks=[green, ModelCheckpoint(dirpath=checkpoints, save_last=True)],
        **trainer_kwargs(fast_dev_run=True, enable_checkpointing=True, default_root_dir=tmp_path),
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(model, data)
    assert trainer.global_step == 1 and clock.time() == start  # its batch ran, and no time was waited
    assert green.suspended is None and green.schedule.decisions == []
    # (Lightning 2.6 itself still writes ModelCheckpoint's last.ckpt at the end of a fast_dev_run)
    assert (
        not [*tmp_path.rglob("*green-window*"), *tmp_path.rglob("green_window*")] and green.report_paths == []
    )
    # kept in memory; sweep-flags: its status was "complete", as a whole run's is
    assert green.report is not None and green.report["status"] == "smoke_test"
    said = [r.getMessage() for r in caplog.records if "GreenWindow: fast_dev_run" in r.getMessage()]
    assert len(said) == 1 and "does not act" in said[0]
    # sweep-flags: "0.0% less CO2 than the carbon-agnostic schedule" came right after "it does not act"
    assert not [r for r in caplog.records if "carbon-agnostic schedule" in r.getMessage()]
    # the same callbacks without fast_dev_run still wait: the smoke test is what changes it
    check = GreenWindow(
        signal=dirty_now_signal(start), when_dirty="pause", expected_duration="8h", clock=clock
    )
    control = trainer_kwargs(max_steps=1, default_root_dir=tmp_path / "control")
    pl.Trainer(callbacks=[check], **control).fit(*mnist1d_small(arch="mlp"))
    assert clock.time() > start


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_report_write_that_fails_keeps_the_report_and_the_last_paths(mnist1d_small, tmp_path, failure):
    # a review: the report was only kept once its files were written (a Ctrl-C there left `.report` None),
    # and a failed write emptied the paths the run's earlier report was written to
    model, data = mnist1d_small(arch="mlp")
    clock = SimulatedClock("2020-06-15 12:00:00")
    green = GreenWindow(
        signal=dirty_now_signal(clock.time() - 12 * 3600),  # dirty at midnight only: this fit runs clean
        when_dirty="pause",
        clock=clock,
        options=GreenWindowOptions(watts=100.0, report_dir=str(tmp_path / "report")),
    )
    trainer = pl.Trainer(callbacks=[green], **trainer_kwargs(max_steps=3, default_root_dir=tmp_path))
    trainer.fit(model, data)
    written = list(green.report_paths)
    assert written and all(path.exists() for path in written)

    def fail(*args, **kwargs):
        raise failure

    green.report = None
    with pytest.MonkeyPatch.context() as patch:  # a fake only for the failing disk / the interrupt
        patch.setattr("lightning_pulse.core.green_report.write_green_report", fail)
        if isinstance(failure, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                green._write_report(tmp_path / "report", "complete")
        else:
            with pytest.warns(UserWarning, match="GreenWindow: could not write the report"):
                green._write_report(tmp_path / "report", "complete")
    assert green.report is not None and green.report["status"] == "complete"
    assert green.report_paths == written
