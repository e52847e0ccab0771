"""HardSampleReplay (mode='steps') added when resuming a checkpoint that holds no state of it: the plan covers
the epochs left, as a fresh run plans them, and the cap counts the steps already taken."""

from __future__ import annotations

import collections

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.digits.data import DigitsDataModule
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.core.cycle_budget import spent_report
from lightning_pulse.core.step_plan import StepPlan, plan_summary, spent_summary
from lightning_pulse.errors import PulseRefusal
from tests.clients import EncoderClassifier
from tests.conftest import trainer_kwargs

BATCH = 128
EPOCH_BATCHES = 11  # 1295 training digits in batches of 128
CYCLE = dict(burst=6, replay=4, maintain=2, maintain_eval="none")


class OfferedPerEpoch(Callback):
    """Steps and raw samples offered (a light step's whole window) per epoch, and the steps whose planned
    window (cut: light) disagrees with the phase PulseCycle's clock is in; after HardSampleReplay."""

    def __init__(self, replay: HardSampleReplay | None) -> None:
        self.replay, self.steps, self.offered = replay, collections.Counter(), collections.Counter()
        self.plan_off_clock: list[tuple[int, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps[trainer.current_epoch] += 1
        offered = self.replay.offered_count if self.replay is not None else len(batch[1])
        self.offered[trainer.current_epoch] += offered
        # an epoch's short last window (fewer samples than a batch) is not cut in any phase
        if self.replay is not None and pulse_cycle_of(trainer) is not None and offered >= BATCH:
            phase = phase_of(trainer).value
            if (offered > len(batch[1])) != (phase in self.replay.phases):
                self.plan_off_clock.append((trainer.global_step, phase))


def _fit(
    callbacks, epochs, ckpt_path=None, checkpoints=None, every_n_train_steps=None, accumulate=1, max_steps=-1
):
    pl.seed_everything(0)
    replay = next((c for c in callbacks if isinstance(c, HardSampleReplay)), None)
    counter = OfferedPerEpoch(replay)
    saving = []
    if checkpoints is not None:
        saving = [ModelCheckpoint(dirpath=checkpoints, save_last=True)]
        if every_n_train_steps:
            saving.append(
                ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=every_n_train_steps, save_top_k=-1)
            )
    trainer = pl.Trainer(
        callbacks=[*callbacks, counter, *saving],
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        max_steps=max_steps,
        **trainer_kwargs(enable_checkpointing=bool(saving), limit_val_batches=1),
    )
    data = DigitsDataModule(batch_size=BATCH)
    trainer.fit(EncoderClassifier(), data, ckpt_path=ckpt_path)
    return trainer, counter, len(data.train_set)


def test_added_on_a_plain_runs_resume_it_plans_the_epochs_left_as_a_fresh_run_does(tmp_path):
    plain, _, _ = _fit([], epochs=2, checkpoints=tmp_path)
    assert plain.global_step == 2 * EPOCH_BATCHES

    replay = HardSampleReplay()
    resumed, counts, samples = _fit([replay], epochs=4, ckpt_path=str(tmp_path / "last.ckpt"))
    fresh_replay = HardSampleReplay()
    fresh, fresh_counts, _ = _fit([fresh_replay], epochs=4)

    # every epoch left trains a whole pass of the data, in the steps a fresh run's plan gives that epoch
    assert dict(counts.steps) == {2: fresh_counts.steps[2], 3: fresh_counts.steps[3]}
    assert dict(counts.offered) == {2: samples, 3: samples}
    planned_rest = fresh_counts.steps[2] + fresh_counts.steps[3]
    assert planned_rest < 2 * EPOCH_BATCHES  # light steps: the plan saves steps
    assert resumed.global_step == resumed.max_steps == 2 * EPOCH_BATCHES + planned_rest
    assert resumed.current_epoch == 4

    # the figures are this fit's: the plain steps before it are not counted as its saving
    plan = replay.steps.plan
    assert plan.steps_before == plain.global_step
    assert plan.spent == pytest.approx(fresh_replay.steps.plan.spent, abs=0.02)
    spent, line = spent_summary(plan, resumed.global_step, None)
    assert spent == pytest.approx(planned_rest / (2 * EPOCH_BATCHES))
    assert f"took {planned_rest} optimizer steps from step {plain.global_step} on" in line


def test_added_beside_a_restored_pulse_cycle_it_trains_every_epoch_left_in_full(tmp_path):
    _fit([PulseCycle(**CYCLE)], epochs=2, checkpoints=tmp_path)

    replay = HardSampleReplay()
    resumed, counts, samples = _fit(
        [PulseCycle(**CYCLE), replay], epochs=4, ckpt_path=str(tmp_path / "last.ckpt")
    )
    # the restored clock goes on at step 22 and the plan with it; planned from epoch 0, the last epoch lost
    # about half its data to the cap
    assert dict(counts.offered) == {2: samples, 3: samples}
    assert resumed.current_epoch == 4
    assert resumed.global_step == resumed.max_steps == replay.steps.plan.total_steps
    assert replay.steps.plan.steps_before == 2 * EPOCH_BATCHES


def test_added_on_a_mid_epoch_checkpoint_it_is_refused_before_any_step_naming_the_ways_out(tmp_path):
    _fit([], epochs=2, checkpoints=tmp_path, every_n_train_steps=15)
    mid_epoch = str(next(tmp_path.glob("*step=15.ckpt")))  # 4 batches into epoch 1

    with pytest.raises(PulseRefusal) as refused:
        _fit([HardSampleReplay()], epochs=4, ckpt_path=mid_epoch)
    message = str(refused.value)
    assert message.startswith(
        "HardSampleReplay: the checkpoint holds no HardSampleReplay(mode='steps') state"
    )
    assert "resumes at step 15, 4 batches into epoch 1" in message
    assert "`max_epochs=2`" in message and "mode='batch'" in message

    # the ways out it names train the run
    batch_mode, counts, _ = _fit([HardSampleReplay(mode="batch")], epochs=4, ckpt_path=mid_epoch)
    assert batch_mode.global_step == 4 * EPOCH_BATCHES
    finished, _, _ = _fit([], epochs=2, ckpt_path=mid_epoch, checkpoints=tmp_path / "finished")
    then, counts, samples = _fit(
        [HardSampleReplay()], epochs=4, ckpt_path=str(tmp_path / "finished" / "last.ckpt")
    )
    assert finished.global_step == 2 * EPOCH_BATCHES
    assert dict(counts.offered) == {2: samples, 3: samples}


def test_added_with_a_pulse_cycle_on_a_plain_runs_resume_both_new_it_trains_every_epoch_left_in_full(
    tmp_path,
):
    # the clock too starts on the resume, at step 22: the plan plays it from there with its own begin_at,
    # start and advance, so every planned light window comes in a light phase of the real clock
    _fit([], epochs=2, checkpoints=tmp_path)

    replay, cycle = HardSampleReplay(), PulseCycle(**CYCLE)
    resumed, counts, samples = _fit([cycle, replay], epochs=4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert dict(counts.offered) == {2: samples, 3: samples}
    assert counts.plan_off_clock == [] and cycle.clock.stage == "anneal"
    assert resumed.current_epoch == 4
    assert resumed.global_step == resumed.max_steps == replay.steps.plan.total_steps
    assert replay.steps.plan.steps_before == 2 * EPOCH_BATCHES


def test_added_at_an_epochs_last_batch_or_to_a_second_fit_of_the_trainer_it_plans_from_the_next_epoch(
    tmp_path,
):
    # saved inside the epoch's last batch (every_n_train_steps landing there): Lightning's epoch is not
    # closed yet, but its batches all trained
    _fit([], epochs=2, checkpoints=tmp_path, every_n_train_steps=EPOCH_BATCHES)
    last_batch = str(next(tmp_path.glob(f"*step={EPOCH_BATCHES}.ckpt")))
    resumed, counts, samples = _fit([HardSampleReplay()], epochs=3, ckpt_path=last_batch)
    assert dict(counts.offered) == {1: samples, 2: samples}
    assert resumed.global_step == resumed.max_steps == EPOCH_BATCHES + counts.steps[1] + counts.steps[2]

    # no checkpoint: the same Trainer fits again to more epochs, HardSampleReplay added (the loops' batch
    # count still holds the finished epoch's)
    trainer, counts, samples = _fit([], epochs=2)
    replay = HardSampleReplay()
    trainer.callbacks.insert(0, replay)
    counts.replay = replay
    trainer.fit_loop.max_epochs = 3
    trainer.fit(EncoderClassifier(), DigitsDataModule(batch_size=BATCH))
    assert counts.offered[2] == samples and set(counts.steps) == {0, 1, 2}
    assert trainer.global_step == trainer.max_steps == 2 * EPOCH_BATCHES + counts.steps[2]


def test_a_resume_of_the_fit_it_joined_keeps_counting_the_steps_before_it_as_plain(tmp_path):
    _fit([], epochs=2, checkpoints=tmp_path)
    joined, _, _ = _fit(
        [HardSampleReplay()], epochs=3, ckpt_path=str(tmp_path / "last.ckpt"), checkpoints=tmp_path / "j"
    )
    replay = HardSampleReplay()
    resumed, counts, samples = _fit([replay], epochs=4, ckpt_path=str(tmp_path / "j" / "last.ckpt"))
    assert dict(counts.offered) == {3: samples}
    assert replay.steps.plan.steps_before == 2 * EPOCH_BATCHES
    spent, line = spent_summary(replay.steps.plan, resumed.global_step, None)
    assert spent == pytest.approx((resumed.global_step - 2 * EPOCH_BATCHES) / (2 * EPOCH_BATCHES))
    assert f"from step {2 * EPOCH_BATCHES} on" in line


def test_joined_after_a_fit_of_other_steps_per_epoch_its_figures_compare_with_the_epochs_left(tmp_path):
    # the earlier fit accumulated 2 batches a step: 6 steps an epoch where this fit's plain epoch takes 11
    _fit([], epochs=2, checkpoints=tmp_path, accumulate=2)
    replay = HardSampleReplay()
    resumed, counts, samples = _fit(
        [replay], epochs=4, ckpt_path=str(tmp_path / "last.ckpt"), checkpoints=tmp_path / "j"
    )
    plan, rest = replay.steps.plan, counts.steps[2] + counts.steps[3]
    assert (plan.steps_before, plan.plain_before, plan.own_steps) == (12, 2 * EPOCH_BATCHES, rest)
    assert plan.own_plain_steps == 2 * EPOCH_BATCHES  # the two epochs left, plain: not 44 - 12 steps
    assert f"takes {rest} optimizer steps instead of {2 * EPOCH_BATCHES} " in plan_summary(plan, None)
    spent, line = spent_summary(plan, resumed.global_step, None)
    assert spent == pytest.approx(rest / (2 * EPOCH_BATCHES)) == pytest.approx(plan.spent)
    assert (
        f"took {rest} optimizer steps from step 12 on" in line and f"plain run's {2 * EPOCH_BATCHES} " in line
    )
    _, stopped = spent_report(plan, resumed.global_step - 1, None)
    assert f"It stopped early: {rest} steps from step 12 on ({plan.spent:.3f}) were planned." in stopped

    # a resume of that fit counts the plain steps before the join in its own epochs (here 6 steps each)
    again = HardSampleReplay()
    _fit([again], epochs=5, ckpt_path=str(tmp_path / "j" / "last.ckpt"), accumulate=2)
    assert (again.steps.plan.steps_before, again.steps.plan.plain_before) == (12, 2 * 6)
    assert again.steps.plan.own_plain_steps == 3 * 6


@pytest.mark.parametrize("max_steps", [30, 20])
def test_joined_after_a_fit_of_other_steps_per_epoch_a_binding_max_steps_counts_the_steps_taken(
    tmp_path, max_steps
):
    # the earlier fit ended at step 12 (6 steps an epoch); max_steps, a global step, leaves max_steps - 12
    _fit([], epochs=2, checkpoints=tmp_path, accumulate=2)
    plain, _, _ = _fit([], epochs=5, ckpt_path=str(tmp_path / "last.ckpt"), max_steps=max_steps)
    assert plain.global_step == max_steps
    replay = HardSampleReplay()
    joined, counts, _ = _fit([replay], epochs=5, ckpt_path=str(tmp_path / "last.ckpt"), max_steps=max_steps)
    plan = replay.steps.plan
    assert plan.own_plain_steps == max_steps - 12  # what a plain resume trains
    assert 0 < plan.own_steps < max_steps - 12  # light steps save some; before, 30 - 22 plain steps were left
    assert joined.global_step == 12 + plan.own_steps == 12 + sum(counts.steps.values())


def test_both_added_to_a_second_fit_of_the_trainer_the_plan_follows_the_clock_placed_at_train_start():
    # no checkpoint: PulseCycle places its clock at step 22 only at train start, after the plan was made
    trainer, counts, samples = _fit([], epochs=2)
    replay, cycle = HardSampleReplay(), PulseCycle(**CYCLE)
    trainer.callbacks[:0] = [cycle, replay]
    counts.replay = replay
    trainer.fit_loop.max_epochs = 4
    trainer.fit(EncoderClassifier(), DigitsDataModule(batch_size=BATCH))
    assert counts.offered[2] == counts.offered[3] == samples
    assert counts.plan_off_clock == [] and cycle.clock.origin == 2 * EPOCH_BATCHES
    assert trainer.global_step == trainer.max_steps == replay.steps.plan.total_steps


def test_the_plan_line_of_a_resume_of_a_joined_fit_counts_its_light_steps_from_the_resume():
    # joined at step 24, resumed at step 32: the steps count from the join, the light steps (the plan's
    # from the resume on) say where they count from
    plan = StepPlan(3, [[16] * 6], 45, 48, light_steps=3, from_step=32, steps_before=24, plain_before=24)
    line = plan_summary(plan, None)
    assert (
        "takes 21 optimizer steps instead of 24 (0.875x; 3 of the 13 from step 32 on in light phases)" in line
    )
    joined = StepPlan(3, [[16] * 6], 45, 48, light_steps=4, from_step=24, steps_before=24, plain_before=24)
    assert "(0.875x; 4 in light phases)" in plan_summary(joined, None)
