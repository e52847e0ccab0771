"""GreenWindow's resume file (``green_window.json``) across a chain of suspended fits, as a wrapper that loops on
``lightning-pulse wait-for-window`` reads it: finished once the run completes, the last suspend's otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_pulse import GreenWindow, SimulatedClock
from lightning_pulse.callbacks.green_window import SUSPEND_CHECKPOINT
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.cli import main as cli_main
from lightning_pulse.cli import run_wait_for_window
from lightning_pulse.core.green_window import WINDOW_FINISHED_EXIT
from tests.conftest import trainer_kwargs

DE_JUNE = str(
    Path(__file__).resolve().parents[1] / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv"
)
# from this start, 10-minute steps suspend after step 12 (to 22:50) and, past 40 steps, after step 42
START = "2020-06-15 14:00:00"
STEP_S = 600.0


def attempt(clock, mnist1d_small, steps, ckpt_path=None, callbacks=(), root=None, mode="suspend", **kwargs):
    """One fit of the run (a new process's: new callbacks), resumed from ``ckpt_path``, its report in
    ``root``; the first step it trained, and the trainer."""
    first = []
    seen = pl.Callback()
    seen.on_train_start = lambda trainer, module: first.append(trainer.global_step)
    green = GreenWindow(signal=DE_JUNE, when_dirty=mode, max_delay=1.0, clock=clock)
    trainer = pl.Trainer(
        callbacks=[SimulatedStepTime(clock, STEP_S), green, seen, *callbacks],
        max_steps=steps,
        limit_val_batches=0,
        **trainer_kwargs(enable_checkpointing=True, default_root_dir=root, **kwargs),
    )
    trainer.fit(*mnist1d_small(arch="mlp"), ckpt_path=ckpt_path)
    return first[0], trainer


def wrapper_loop(clock, folder, resume, limit=8):
    """What a cron or Slurm wrapper does: ``while wait-for-window FOLDER; do <its resume command>; done``.
    Returns the fits' ``(first step, last step)`` and wait-for-window's last exit status."""
    fits = []
    while len(fits) < limit and (status := run_wait_for_window([str(folder)], clock=clock)) == 0:
        checkpoint = json.loads((Path(folder) / "green_window.json").read_text())["checkpoint"]
        first, trainer = resume(checkpoint)
        fits.append((first, trainer.global_step))
    return fits, status


def test_a_suspended_run_resumed_to_completion_marks_its_resume_file_finished_and_the_wrapper_loop_ends(
    mnist1d_small, tmp_path, capsys
):
    # a sweep: the completed run left the suspend's record; wait-for-window said "window open; resume with
    # ... last-green-window.ckpt" at once, and the loop trained steps 12 to 40 again on every call
    clock, folder = SimulatedClock(START), tmp_path / "ckpt"

    def resume(checkpoint):
        callbacks = [ModelCheckpoint(dirpath=folder, save_top_k=0)]
        return attempt(clock, mnist1d_small, 40, checkpoint, callbacks, root=tmp_path)

    _, trainer = resume(None)
    suspended_at = trainer.global_step
    record = json.loads((folder / "green_window.json").read_text())
    assert 0 < suspended_at < 40 and record["checkpoint"] == str(folder / SUSPEND_CHECKPOINT)

    fits, status = wrapper_loop(clock, folder, resume)
    assert fits == [(suspended_at, 40)]  # one resume, from the suspend, to the end; no step trained twice
    assert status == WINDOW_FINISHED_EXIT == 3
    record = json.loads((folder / "green_window.json").read_text())
    assert record["status"] == "finished" and record["global_step"] == 40 and "checkpoint" not in record
    capsys.readouterr()
    assert cli_main(["wait-for-window", str(folder), "--print", "--format", "slurm"]) == 3
    out, err = capsys.readouterr()
    assert out == ""  # nothing for `sbatch --begin=$(...)` to start a job at
    assert "the run finished at step 40" in err and "nothing to resume" in err


def test_a_chain_suspended_into_new_version_folders_keeps_the_first_resume_file_on_its_latest_suspend(
    mnist1d_small, tmp_path
):
    # ModelCheckpoint without a dirpath: each resume writes into the logger's next version folder, while the
    # wrapper reads version_0's file; it must name the latest suspend, then say the run finished
    clock = SimulatedClock(START)

    def resume(checkpoint):
        logger = CSVLogger(tmp_path, name="run")
        return attempt(clock, mnist1d_small, 48, checkpoint, [ModelCheckpoint(save_top_k=0)], logger=logger)

    _, trainer = resume(None)
    first_folder = tmp_path / "run" / "version_0" / "checkpoints"
    fits, status = wrapper_loop(clock, first_folder, resume)
    starts = [trainer.global_step] + [last for _, last in fits[:-1]]
    assert [first for first, _ in fits] == starts  # each fit resumed where the one before stopped
    assert len(fits) >= 2 and fits[-1][1] == 48 and status == WINDOW_FINISHED_EXIT
    files = sorted(tmp_path.glob("run/version_*/checkpoints/green_window.json"))
    assert len(files) == len(fits) + 1  # one per fit: every fit but the last suspended; the last completed
    assert {json.loads(file.read_text())["status"] for file in files} == {"finished"}


def test_a_resumed_run_early_stopping_is_complete_and_one_ending_in_an_exception_keeps_the_suspend(
    mnist1d_small, tmp_path
):
    clock, folder = SimulatedClock(START), tmp_path / "ckpt"
    checkpointing = ModelCheckpoint(dirpath=folder, save_top_k=0)
    _, trainer = attempt(clock, mnist1d_small, 40, None, [checkpointing], root=tmp_path)
    suspended_at, suspend = trainer.global_step, json.loads((folder / "green_window.json").read_text())
    assert 0 < suspended_at < 24 and run_wait_for_window([str(folder)], clock=clock) == 0

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 20:
                raise RuntimeError("node lost")

    checkpoint = str(folder / SUSPEND_CHECKPOINT)
    with pytest.raises(RuntimeError, match="node lost"):
        callbacks = [ModelCheckpoint(dirpath=folder, save_top_k=0), Crash()]
        attempt(clock, mnist1d_small, 40, checkpoint, callbacks, root=tmp_path)
    assert json.loads((folder / "green_window.json").read_text()) == suspend  # still the suspend to resume
    assert run_wait_for_window([str(folder)], clock=clock) == 0

    # EarlyStopping ends the run for good (at the end of epoch 1, step 24 of 40): complete, finished
    stop = EarlyStopping("train_loss", stopping_threshold=1e9, check_on_train_epoch_end=True)
    callbacks = [ModelCheckpoint(dirpath=folder, save_top_k=0), stop]
    first, trainer = attempt(clock, mnist1d_small, 40, checkpoint, callbacks, root=tmp_path)
    assert first == suspended_at and trainer.global_step == 24 and stop.stopped_epoch == 1
    record = json.loads((folder / "green_window.json").read_text())
    assert record["status"] == "finished" and record["global_step"] == 24
    assert run_wait_for_window([str(folder)], clock=clock) == WINDOW_FINISHED_EXIT


def test_a_suspend_mode_run_that_never_suspended_writes_a_finished_resume_file(mnist1d_small, tmp_path):
    # so that `lightning-pulse fit ...; while lightning-pulse wait-for-window DIR; do ...; done` ends at once
    clock, folder = SimulatedClock(START), tmp_path / "ckpt"
    checkpointing = ModelCheckpoint(dirpath=folder, save_top_k=0)
    _, trainer = attempt(clock, mnist1d_small, 6, None, [checkpointing], root=tmp_path)
    assert trainer.global_step == 6
    assert json.loads((folder / "green_window.json").read_text())["status"] == "finished"
    assert run_wait_for_window([str(folder)], clock=clock) == WINDOW_FINISHED_EXIT


def test_a_suspended_run_resumed_in_pause_mode_to_completion_marks_the_suspends_file_finished(
    mnist1d_small, tmp_path
):
    # a review: in another mode no SuspendSave is attached, and the suspend's record stayed: the wrapper's
    # loop went back to the suspend checkpoint after the run had completed
    clock, folder = SimulatedClock(START), tmp_path / "ckpt"
    callbacks = [ModelCheckpoint(dirpath=folder, save_top_k=0)]
    _, trainer = attempt(clock, mnist1d_small, 40, None, callbacks, root=tmp_path)
    assert 0 < trainer.global_step < 40
    assert run_wait_for_window([str(folder)], clock=clock) == 0
    checkpoint = json.loads((folder / "green_window.json").read_text())["checkpoint"]
    _, trainer = attempt(clock, mnist1d_small, 40, checkpoint, callbacks, root=tmp_path, mode="pause")
    assert trainer.global_step == 40
    assert json.loads((folder / "green_window.json").read_text())["status"] == "finished"
    assert run_wait_for_window([str(folder)], clock=clock) == WINDOW_FINISHED_EXIT
