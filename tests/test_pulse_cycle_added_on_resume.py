"""A PulseCycle (and a ScheduledPrune next to it) added when resuming a checkpoint saved without one: the fit
starts at the checkpoint's step, and the clock runs on the steps left, counting the run's steps."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pulse import Phase, PruneOptions, PulseCycle, ScheduledPrune, phase_of
from lightning_pulse.phase import PhaseClock
from tests.conftest import RecordingLogger, trainer_kwargs

#: mnist1d_small trains 12 batches an epoch: the plain fit of 3 epochs saves its last checkpoint at step 36
PLAIN_EPOCHS, EPOCH_STEPS = 3, 12
SAVED_AT = PLAIN_EPOCHS * EPOCH_STEPS


class PhaseRecorder(Callback):
    """The phase each training batch runs in, by the global step it starts at, and every change told, with the
    global step it was told at."""

    def __init__(self) -> None:
        self.batch_phases: list[tuple[int, str]] = []
        self.changes: list[tuple[int, object]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_phases.append((trainer.global_step, phase_of(trainer).value))

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.changes.append((trainer.global_step, change))


class FirstLayerZeros(Callback):
    """The share of zeros in the first conv's weight after each step, where it changes: when pruning really
    happened, by global step."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        weight = pl_module.net[1].weight
        zeros = round(float((weight == 0).float().mean()), 3)
        if not self.seen or self.seen[-1][1] != zeros:
            self.seen.append((trainer.global_step, zeros))


def plain_checkpoint(mnist1d_small, tmp_path) -> str:
    """``last.ckpt`` of a plain fit of 3 epochs (no pulse callback), at step 36."""
    pl.seed_everything(0)
    model, data = mnist1d_small()
    saver = ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)
    kwargs = trainer_kwargs(enable_checkpointing=True, max_epochs=PLAIN_EPOCHS, limit_val_batches=1)
    trainer = pl.Trainer(callbacks=[saver], **kwargs)
    trainer.fit(model, data)
    assert trainer.global_step == SAVED_AT
    return str(tmp_path / "plain" / "last.ckpt")


def fit(mnist1d_small, callbacks, max_epochs, ckpt_path=None, **kwargs) -> pl.Trainer:
    pl.seed_everything(0)
    model, data = mnist1d_small()
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=max_epochs, **kwargs))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


CYCLE = dict(burst=4, replay=2, maintain=1, warmup=0.1, anneal=0.1, maintain_eval="none")


def test_a_pulse_cycle_added_on_resume_runs_on_the_steps_left_in_global_steps(
    mnist1d_small, tmp_path, caplog
):
    # a sweep: added when resuming a plain checkpoint at step 63 of 126, the clock started at 0 with warm-up
    # and anneal placed on the whole run: a 13-step warm-up at the resume, and the anneal (clock step 113)
    # never came
    ckpt = plain_checkpoint(mnist1d_small, tmp_path)
    # the reference: the same cycle over a fresh run as long as the steps left (36)
    fresh, fresh_phases = PulseCycle(**CYCLE), PhaseRecorder()
    fit(mnist1d_small, [fresh, fresh_phases], max_epochs=6 - PLAIN_EPOCHS)
    assert fresh.clock.stage == "anneal"

    cycle, recorder, logger = PulseCycle(**CYCLE), PhaseRecorder(), RecordingLogger()
    with caplog.at_level("INFO"):
        trainer = fit(
            mnist1d_small, [cycle, recorder], max_epochs=6, ckpt_path=ckpt, logger=logger, log_every_n_steps=1
        )
    assert trainer.global_step == 2 * SAVED_AT
    # the clock counts the run's steps: every change is told at the global step it names
    assert cycle.clock.step == trainer.global_step
    assert [step for step, _ in recorder.changes] == [change.step for _, change in recorder.changes]
    start = recorder.changes[0][1]
    assert (start.reason, start.step, start.current) == ("start", SAVED_AT, Phase.BURST)
    # warm-up and anneal are shares of the steps left, placed at global steps: the fresh run's phases, shifted
    assert recorder.batch_phases == [(SAVED_AT + step, phase) for step, phase in fresh_phases.batch_phases]
    assert recorder.batch_phases[:4] == [(step, "burst") for step in range(36, 40)]  # 0.1 of 36: 4 steps
    assert cycle.clock.stage == "anneal"  # the anneal came: the last 4 steps (0.1 of 36) are pure burst
    assert [phase for _, phase in recorder.batch_phases[-5:]] == ["maintain"] + ["burst"] * 4
    assert cycle.clock.steps_by_phase == fresh.clock.steps_by_phase
    # the phase rows sit at the global steps that trained in them
    codes = {phase.value: phase.code for phase in Phase}
    trained_in = {step: codes[phase] for step, phase in recorder.batch_phases}
    rows = dict(logger.logged("pulse/phase"))
    assert rows and min(rows) == SAVED_AT and all(rows[step] == trained_in[step] for step in rows)
    # one line says where it started and what it placed
    assert (
        "PulseCycle: starting at step 36 with no saved state (none of PulseCycle's was restored: a "
        "checkpoint without it, or a later fit of the Trainer): its clock counts the run's steps from there, "
        "and its phases run on the 36 steps left (steps 36 to 72): a warm-up to step 40 and an anneal from "
        "step 68, as shares of them." in caplog.text
    )


@pytest.mark.parametrize("prune_first", [False, True], ids=["cycle_first", "prune_first"])
def test_scheduled_prune_added_with_a_pulse_cycle_on_resume_prunes_inside_its_schedule(
    mnist1d_small, tmp_path, prune_first, recwarn
):
    # a sweep: ScheduledPrune at maintain starts read PulseCycle's restarted clock (0 at global step 63) and
    # compared it with its schedule's global steps 70..110: nothing was pruned, and the end warning said so.
    # Listed first, it plans its maintain starts from the clock before PulseCycle's own train start
    ckpt = plain_checkpoint(mnist1d_small, tmp_path)
    cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    prune = ScheduledPrune(final_sparsity=0.5, start=40, end=60, probe_batches=1)
    recorder, zeros = PhaseRecorder(), FirstLayerZeros()
    pair = [prune, cycle] if prune_first else [cycle, prune]
    trainer = fit(mnist1d_small, [*pair, recorder, zeros], max_epochs=6, ckpt_path=ckpt, limit_val_batches=1)
    assert trainer.global_step == 2 * SAVED_AT
    events = [event["step"] for event in prune.events]
    maintain_entries = [step for step, change in recorder.changes if change.current is Phase.MAINTAIN]
    # events at maintain entries inside the schedule, labelled with the global step they happened at
    assert events and events == [step for step in maintain_entries if 40 <= step < 72][: len(events)]
    assert events[0] < 60 and all(40 <= step for step in events)
    assert [step for step, share in zeros.seen if share > 0][0] == events[0]
    # the final sparsity is reached, and no warning says the schedule went unfinished
    assert prune.finished and prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert not [str(w.message) for w in recwarn if "ScheduledPrune: the run ended" in str(w.message)]


def test_scheduled_prune_listed_first_plans_the_maintain_starts_of_the_resumed_clock(mnist1d_small, tmp_path):
    # ScheduledPrune's train start, before PulseCycle's, plays the clock forward to find maintain starts in
    # its schedule: a clock still at step 0 anneals from step 36 (half of 72), before the schedule starts, and
    # `cadence='maintain'` was refused. PulseCycle places its clock at the checkpoint's step when Lightning
    # restores it, so every plan made before its own train start reads the resumed clock (anneal from 54)
    ckpt = plain_checkpoint(mnist1d_small, tmp_path)
    cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0.5, maintain_eval="none")
    prune = ScheduledPrune(
        final_sparsity=0.5, start=40, end=50, probe_batches=1, options=PruneOptions(cadence="maintain")
    )
    recorder = PhaseRecorder()
    fit(mnist1d_small, [prune, cycle, recorder], max_epochs=6, ckpt_path=ckpt, limit_val_batches=1)
    maintain_entries = [step for step, change in recorder.changes if change.current is Phase.MAINTAIN]
    assert [event["step"] for event in prune.events] == [step for step in maintain_entries if step >= 40]
    assert prune.events and prune.finished


def test_a_resumed_pulse_cycle_checkpoint_keeps_its_clock_counting_from_zero(mnist1d_small, tmp_path):
    # a guard, passing before the fix too: the clock a checkpoint holds is restored as it ran (begin_at, from
    # on_load_checkpoint and train start, leaves a started clock alone), so the resume goes on in the restored
    # cycle at its step, and a finished run resumed to a longer one cycles again, its anneal at the new end
    saver = ModelCheckpoint(dirpath=tmp_path / "pulsed", save_last=True)
    first = PulseCycle(**CYCLE)
    fit(
        mnist1d_small, [first, saver], max_epochs=PLAIN_EPOCHS, enable_checkpointing=True, limit_val_batches=1
    )
    assert first.clock.stage == "anneal"
    cycle, recorder = PulseCycle(**CYCLE), PhaseRecorder()
    fit(mnist1d_small, [cycle, recorder], max_epochs=6, ckpt_path=str(tmp_path / "pulsed" / "last.ckpt"))
    resumed = recorder.changes[0][1]
    assert (resumed.reason, resumed.step, resumed.cycle) == ("resume", SAVED_AT, first.clock.cycle)
    # a finished run resumed to a longer one: its anneal moves to the new end (0.9 of 72 steps: step 65)
    assert recorder.changes[1][1].reason == "extended" and recorder.changes[1][0] == SAVED_AT + 1
    assert cycle.clock._anneal_start(72) == 65 and cycle.clock.stage == "anneal"


def test_begin_at_places_warmup_and_anneal_on_the_steps_left():
    clock = PhaseClock({"burst": 3, "replay": 2}, order=["burst", "replay"], warmup=0.2, anneal=0.1)
    clock.begin_at(50)
    assert (clock.step, clock.origin) == (50, 50)
    start = clock.start(100)
    assert (start.step, start.current, clock.stage) == (50, Phase.BURST, "warmup")
    assert (clock._warmup_end(100), clock._anneal_start(100)) == (60, 95)  # 0.2 and 0.9 of the 50 steps left
    changes = []
    for _ in range(50):
        changes += clock.advance(1, 0.0, None, 100)
    # warm-up's burst (steps 50-59) hands over to the cycle's burst of 3 steps: the first change at step 63
    assert (changes[0].previous, changes[0].reason, changes[0].step) == (Phase.BURST, "budget", 63)
    assert changes[-1].reason == "anneal" and changes[-1].step == 95 and clock.stage == "anneal"
    # kept in the state, in a copy (the plans play one forward), and a started clock is not moved
    restored = PhaseClock({"burst": 3, "replay": 2}, order=["burst", "replay"], warmup=0.2, anneal=0.1)
    restored.load_state_dict(clock.state_dict())
    restored.begin_at(7)
    assert (restored.origin, restored.step, clock.copy().origin) == (50, 100, 50)
    # a state saved before the origin was: every clock then started at 0
    old = clock.state_dict()
    del old["origin"]
    restored.load_state_dict(old)
    assert restored.origin == 0 and restored._anneal_start(100) == 90


def test_a_clock_placed_past_zero_plays_forward_from_there():
    clock = PhaseClock({"burst": 4, "maintain": 1}, order=["burst", "maintain"], warmup=0.1)
    clock.begin_at(30)
    # the look-ahead ScheduledPrune and a step plan take: the first maintain entry after a 3-step warm-up
    assert clock.first_entry(Phase.MAINTAIN, 0, None, 60.0) == 37
    assert clock.step == 30 and clock.stage == "pending"  # the clock itself did not move
