"""Epochs the module's ``on_train_batch_start`` ends early (it returns -1: Lightning skips the rest of the
epoch), under HardSampleReplay's steps mode and PulseCycle, and under PulseCycle alone.

Found by a held-out sweep: the step plan fixed each epoch's batches at fit start, for an epoch starting at its
planned step; after a -1 every later pass yielded its replay windows in bursts and its plain batches in the
replay phase (1 of 8 replay steps trained a replay batch, 6 burst steps did), and the end line claimed a
saving against a plain run of full epochs (``0.667 of the plain run's 48``) that this module never takes.
"""

from __future__ import annotations

import logging
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import HardSampleReplay, PulseCycle, phase_of
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

BATCH = 16
SAMPLES = 192  # 12 plain batches an epoch
CYCLE = dict(burst=6, replay=4, maintain=2, warmup=0.1, anneal=0.2, maintain_eval="none")


class Samples(Dataset):
    def __init__(self, samples: int = SAMPLES) -> None:
        self.x = torch.randn(samples, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index]


class EndsEpochsEarly(BoringModel):
    """Lightning's BoringModel, whose ``on_train_batch_start`` returns -1 once ``batch_idx`` reaches ``stop``
    in the epochs ``cut`` (all: ``None``). ``schedule``: a OneCycleLR built for the run's steps."""

    def __init__(self, stop: int = 8, cut: tuple[int, ...] | None = None, schedule: bool = False) -> None:
        super().__init__()
        self.stop, self.cut, self.schedule = stop, cut, schedule

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx >= self.stop and (self.cut is None or self.current_epoch in self.cut):
            return -1

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.schedule:
            return optimizer
        steps = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]

    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=BATCH)


class Windows(Callback):
    """Per trained batch: its epoch, optimizer step, phase and the samples it was chosen from (a replay
    window: twice the batch)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, str, int]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        row = (trainer.current_epoch, trainer.global_step, phase_of(trainer).value, replay.offered_count)
        self.rows.append(row)


def _fit(module, root, *extra, ckpt_path=None, replay=None, cycle=None, **trainer_args):
    pl.seed_everything(0, verbose=False)
    windows = Windows()
    callbacks = [PulseCycle(**CYCLE | (cycle or {})), HardSampleReplay(**(replay or {})), windows, *extra]
    settings = dict(max_epochs=4, default_root_dir=root) | trainer_args
    checkpoints = any(isinstance(c, ModelCheckpoint) for c in extra)
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(enable_checkpointing=checkpoints, **settings))
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, windows.rows


def _misplaced(rows) -> list[tuple[int, str]]:
    """Steps that trained a replay window outside the replay phase."""
    return [(step, phase) for _, step, phase, window in rows if window > BATCH and phase != "replay"]


def _dropped_plain_steps(rows) -> int:
    """The plain run's steps over the samples each epoch's pass left untrained."""
    trained = [sum(window for epoch, *_, window in rows if epoch == e) for e in range(4)]
    return sum(SAMPLES // BATCH - math.ceil(samples / BATCH) for samples in trained)


@pytest.mark.parametrize("cut", [None, (0,)], ids=["every-epoch", "first-epoch"])
def test_replay_windows_train_in_the_replay_phase_after_epochs_end_early(tmp_path, caplog, cut):
    with caplog.at_level(logging.INFO):
        trainer, rows = _fit(EndsEpochsEarly(cut=cut), tmp_path)
    replay_steps = [window for _, _, phase, window in rows if phase == "replay"]
    # before: 6 burst steps trained replay windows (every epoch), 5 (the first only)
    assert _misplaced(rows) == []
    assert len(replay_steps) == 8 and sum(window == 2 * BATCH for window in replay_steps) >= 7
    cut_short = (
        "epoch 0 ended after 8 of its 11 planned batches (the module's `on_train_batch_start` returned -1)"
    )
    assert f"HardSampleReplay: {cut_short}, so the next epoch starts at step 8" in caplog.text
    assert "the rest of the run is planned again from there" in caplog.text
    # the end line compares with the plain run over the data this run trained, and says that the plain run of
    # this module (its epochs ended by the same rule) is not known: before, "0.667 of the plain run's 48" and
    # "It stopped early: 40 steps (0.833) were planned", for a run as long as the module's plain one (32)
    steps, dropped = trainer.global_step, _dropped_plain_steps(rows)
    plain = 4 * SAMPLES // BATCH - dropped
    assert dropped > 0 and steps == (32 if cut is None else 36)
    took = (
        f"the run took {steps} optimizer steps, {steps / plain:.3f} of the plain run's {plain} over the same"
    )
    left_out = f"the plain run's {dropped} steps over the untrained rest of epochs ended early left out"
    assert f"PulseCycle: {took} data ({left_out})" in caplog.text
    assert "its steps are not known here, and this is no saving against it" in caplog.text
    assert "It stopped early" not in caplog.text and "plain run's 48" not in caplog.text


class AsksToStopAfterFirstEpoch(Callback):
    """Asks the fit to stop at epoch 0's end, as EarlyStopping does; ``Trainer(min_epochs/min_steps)`` may
    overrule it (Lightning keeps ``should_stop`` set and trains on)."""

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = trainer.should_stop or trainer.current_epoch == 0


@pytest.mark.parametrize("minimum", [{"min_epochs": 4}, {"min_steps": 1000}], ids=["min_epochs", "min_steps"])
def test_a_stop_the_trainer_minimums_overrule_still_plans_an_epoch_ended_early_again(
    tmp_path, caplog, minimum
):
    # held-out sweep (pass 41): a stop asked for (EarlyStopping) that min_epochs/min_steps overruled was read
    # as the fit's end, so the epoch the module ended early was not planned again: the run trained on to
    # max_epochs out of step with its plan (37 steps for the plain run's 36, batches apart from epoch 2 on)
    plain, plain_rows = _fit(EndsEpochsEarly(stop=5, cut=(1,)), tmp_path / "plain")
    with caplog.at_level(logging.INFO):
        held, rows = _fit(
            EndsEpochsEarly(stop=5, cut=(1,)), tmp_path / "held", AsksToStopAfterFirstEpoch(), **minimum
        )
    print(f"steps: {plain.global_step} without the stop, {held.global_step} with it overruled by {minimum}")
    assert held.should_stop and held.current_epoch == 4  # asked, overruled: the fit ran its epochs
    assert held.global_step == plain.global_step and rows == plain_rows and _misplaced(rows) == []
    assert "epoch 1 ended after 5 of its" in caplog.text and "It stopped early" not in caplog.text


def test_a_run_bounded_by_max_steps_alone_keeps_its_data_and_its_plain_length_after_epochs_end_early(
    tmp_path, caplog
):
    # max_steps ends the plain run of this module too, however its epochs end: the plan keeps its total and
    # the samples an epoch left untrained stay in the run's data, and the saving is against max_steps
    with caplog.at_level(logging.INFO):
        trainer, rows = _fit(EndsEpochsEarly(), tmp_path, max_epochs=-1, max_steps=40)
    assert _misplaced(rows) == []
    steps = trainer.global_step
    assert steps == 33  # as the run without the early ends: the same data in the same phases
    assert f"the run took {steps} optimizer steps, {steps / 40:.3f} of the plain run's 40." in caplog.text
    assert "over the same data" not in caplog.text


class SaveAtEpochEnd(ModelCheckpoint):
    """Saves in every epoch's end hooks (after the plan was made again there)."""

    def __init__(self, dirpath) -> None:
        super().__init__(dirpath=dirpath, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)


@pytest.mark.parametrize(
    "resume_at",
    [
        "step-5",
        "step-8",
        "epoch-0-end",
        "step-12",
        "step-16",
        "step-17",
        "epoch-2-end",
        "accumulate-2-step-6",
        "accumulate-2-step-11",
    ],
)
def test_a_resume_across_epochs_ended_early_reproduces_the_uninterrupted_run(tmp_path, resume_at):
    # step 8: after the cut epoch 0's last trained batch; the resume draws the batch the hook skips, and ends
    # the epoch there. Steps 16 and 17: epoch 1's last batch and epoch 2's first, after epoch 0's skipped
    # batch, which Lightning counts processed but never started: it read the restart from its counters of all
    # epochs and took both checkpoints for ones saved before their batch had finished. From step 16 it fetched
    # the next pass's first batch in epoch 1 (the hook skipped it), which the plan took for a pass ended after
    # 0 of its 9 batches and planned again (24 steps, not 32); from step 17 `batch_idx` stayed one behind and
    # the -1 came a batch late (33 steps).
    # Accumulating 2 batches: step 11 is epoch 2's last batch (11 steps, not 15), step 6 inside epoch 1 (16)
    accumulate = 2 if resume_at.startswith("accumulate-2-") else 1
    resume_at = resume_at.removeprefix("accumulate-2-")
    every_step = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=1, save_top_k=-1)
    full, full_rows = _fit(
        EndsEpochsEarly(),
        tmp_path / "full",
        every_step,
        SaveAtEpochEnd(tmp_path / "ends"),
        accumulate_grad_batches=accumulate,
    )
    assert _misplaced(full_rows) == []
    kind, at = resume_at.split("-", 1)
    if kind == "step":
        path = next((tmp_path / "steps").glob(f"*-step={at}.ckpt"))
    else:
        path = next((tmp_path / "ends").glob(f"epoch={at.split('-')[0]}-*.ckpt"))
    resumed_module = EndsEpochsEarly()
    resumed, rows = _fit(
        resumed_module, tmp_path / "resumed", ckpt_path=str(path), accumulate_grad_batches=accumulate
    )
    start = torch.load(path, weights_only=False)["global_step"]
    assert resumed.global_step == full.global_step == (32 if accumulate == 1 else 15)
    assert rows == [row for row in full_rows if row[1] >= start]
    for mine, theirs in zip(resumed.lightning_module.parameters(), full.lightning_module.parameters()):
        assert torch.equal(mine, theirs)
    # the restart is read once, at the resume: nothing stays on the Trainer's loop
    assert "update_restart_stage" not in vars(resumed.fit_loop.epoch_loop)


def test_a_checkpoint_of_a_fit_resumed_at_an_epochs_last_batch_resumes_as_the_uninterrupted_run(tmp_path):
    # resumed at epoch 1's last batch (step 16), Lightning closed that epoch but went on with epoch 2 as one
    # restored mid-epoch, never counted started: a checkpoint saved inside it (step 20) read as one saved at
    # an epoch's end, and its resume began `batch_idx` at 0 again: the batch the -1 skips trained (33 steps;
    # a plain Lightning run retrains the whole epoch there)
    def saver(name):
        return ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=1, save_top_k=-1)

    full, full_rows = _fit(EndsEpochsEarly(), tmp_path / "full", saver("steps"))
    first = str(next((tmp_path / "steps").glob("*-step=16.ckpt")))
    _fit(EndsEpochsEarly(), tmp_path / "first", saver("resumed-steps"), ckpt_path=first)
    second = str(next((tmp_path / "resumed-steps").glob("*-step=20.ckpt")))
    resumed, rows = _fit(EndsEpochsEarly(), tmp_path / "second", ckpt_path=second)
    assert resumed.global_step == full.global_step == 32
    assert rows == [row for row in full_rows if row[1] >= 20]
    for mine, theirs in zip(resumed.lightning_module.parameters(), full.lightning_module.parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("saved_at", ["last-batch", "epoch-end"])
def test_a_resume_from_a_short_pass_the_plan_made_after_an_epoch_ended_early_is_read_as_its_end(
    tmp_path, caplog, saved_at
):
    # regression sweep of pass 41: under max_steps alone the samples epoch 0 left untrained stay in the run's
    # data, so the plan made again ends it with passes shorter than the data's (epochs 3 and 4: one batch
    # each). The resume read epoch 3's end against the whole dataset: saved in the epoch's end hooks, it was
    # taken for a stop inside epoch 3 ("the checkpoint was saved at a stop inside epoch 3", "26 optimizer steps
    # instead of 19 (1.368x") and trained 26 steps of 27; saved at its last batch, step 26 trained in epoch 5
    every_step = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=1, save_top_k=-1)
    module, run = EndsEpochsEarly(stop=5, cut=(0,)), dict(max_epochs=-1, max_steps=30)
    full, full_rows = _fit(module, tmp_path / "full", every_step, SaveAtEpochEnd(tmp_path / "ends"), **run)
    assert [row[:2] for row in full_rows[-3:]] == [(2, 24), (3, 25), (4, 26)]  # two one-batch passes
    ends = tmp_path / ("steps" if saved_at == "last-batch" else "ends")
    path = next(ends.glob("epoch=3-step=26*.ckpt"))

    def stream(checkpoint):
        return torch.load(checkpoint, weights_only=False)["callbacks"]["HardSampleReplay"]["stream"]

    # the short pass's length is saved; a whole pass's checkpoint is as it was
    assert stream(path)["pass_samples"] == BATCH
    assert "pass_samples" not in stream(next((tmp_path / "ends").glob("epoch=1-*.ckpt")))
    with caplog.at_level(logging.INFO):
        resumed, rows = _fit(
            EndsEpochsEarly(stop=5, cut=(0,)), tmp_path / "resumed", ckpt_path=str(path), **run
        )
    assert resumed.global_step == full.global_step == 27
    assert rows == full_rows[-1:] and rows[0][:2] == (4, 26)
    for mine, theirs in zip(resumed.lightning_module.parameters(), full.lightning_module.parameters()):
        assert torch.equal(mine, theirs)
    assert "stop inside" not in caplog.text and "instead of 19" not in caplog.text


class OneCycleAtTheTail(EndsEpochsEarly):
    """Skips epoch 2's last planned batch (its 6th), with a OneCycleLR built for the planned steps."""

    def __init__(self) -> None:
        super().__init__(stop=5, cut=(2,), schedule=True)


def test_a_plan_made_again_that_would_outrun_a_one_cycle_schedule_keeps_its_old_total(tmp_path, caplog):
    # solved again, this plan takes 33 steps where the OneCycleLR was built for the 31 planned (it raised
    # "Tried to step 32 times" at the run's end): it keeps warm-up and anneal where they were placed instead
    replay, cycle = dict(replay_fraction=0.25), dict(burst=3, replay=3, maintain=3)
    ends = SaveAtEpochEnd(tmp_path / "ends")
    with caplog.at_level(logging.INFO):
        trainer, rows = _fit(OneCycleAtTheTail(), tmp_path, ends, replay=replay, cycle=cycle)
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert "warm-up and anneal kept where they were placed" in caplog.text
    assert "the per-step OneCycleLR, which has 9 steps left" in caplog.text
    assert schedule.last_epoch <= schedule.total_steps == 31
    assert trainer.global_step == trainer.max_steps < 31 and _misplaced(rows) == []
    # resumed from the cut epoch's end, the run follows that plan
    path = str(next((tmp_path / "ends").glob("epoch=2-*.ckpt")))
    resumed, resumed_rows = _fit(
        OneCycleAtTheTail(), tmp_path / "r", ckpt_path=path, replay=replay, cycle=cycle
    )
    assert resumed.global_step == trainer.global_step and resumed_rows == [r for r in rows if r[0] == 3]
    for mine, theirs in zip(resumed.lightning_module.parameters(), trainer.lightning_module.parameters()):
        assert torch.equal(mine, theirs)


class SkipsEachTail(EndsEpochsEarly):
    """Skips each epoch's short last batch (200 samples: 12 of 16 and one of 8), with a OneCycleLR."""

    def __init__(self) -> None:
        super().__init__(schedule=True)

    def on_train_batch_start(self, batch, batch_idx):
        if batch.shape[0] < BATCH:
            return -1

    def train_dataloader(self):
        return DataLoader(Samples(200), batch_size=BATCH)


def test_a_plan_that_a_one_cycle_schedule_cannot_follow_is_refused_before_the_next_step(tmp_path):
    # Lightning steps the scheduler for the skipped batch too, and dropping 8 samples saves no step: planned
    # again, the run needs 52 more steps where the schedule has 51 left. mode='batch' spans whole epochs
    with pytest.raises(PulseRefusal) as refused:
        trainer, _ = _fit(SkipsEachTail(), tmp_path, max_epochs=6)
    message = str(refused.value)
    assert message.startswith("HardSampleReplay: epoch 0 ended after 12 of its 13 planned batches")
    assert "`on_train_batch_start` returned -1" in message and "mode='batch'" in message
    assert "takes 52 more optimizer steps, where the per-step OneCycleLR of 64 steps has 51 left" in message


def test_pulse_cycle_alone_warns_once_that_epochs_ended_early_move_its_anneal(tmp_path):
    # warm-up and anneal are shares of Lightning's 48 steps of whole epochs; the run takes 32, so its anneal
    # (from step 38) never came, without a word
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE)], **trainer_kwargs(max_epochs=4, default_root_dir=tmp_path)
    )
    with pytest.warns(
        UserWarning,
        match=r"PulseCycle: an epoch ended early \(the module.s `on_train_batch_start` returned -1",
    ) as caught:
        trainer.fit(EndsEpochsEarly())
    said = [str(w.message) for w in caught if "ended early" in str(w.message)]
    assert len(said) == 1 and "PulseCycle (`warmup`=0.1, `anneal`=0.2)" in said[0]
    assert "Set Trainer(max_steps=N)" in said[0] and trainer.global_step == 32
    # the way out: max_steps ends the run however its epochs end, and the shares are placed on it
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE)], **trainer_kwargs(max_steps=40, default_root_dir=tmp_path)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(EndsEpochsEarly())
    assert trainer.global_step == 40 and not [w for w in caught if "ended early" in str(w.message)]


def test_every_share_placed_on_whole_epochs_is_named_once_after_an_epoch_ends_early(tmp_path):
    # ScheduledPrune and GradientCache read it at the next epoch's first batch, EnergyLogger at its start
    from lightning_pulse import EnergyLogger, GradientCache, MeterConfig, ScheduledPrune

    prune = ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.8, every=2)
    cache = GradientCache(check_every=2, release_at=0.8)
    energy = EnergyLogger(
        report_dir=str(tmp_path), cpu="constant", ram="none", meters=MeterConfig(cpu_watts=50)
    )
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[prune, cache, energy], **trainer_kwargs(max_epochs=4, default_root_dir=tmp_path)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(EndsEpochsEarly())
    said = [str(w.message) for w in caught if "an epoch ended early" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("ScheduledPrune, GradientCache, EnergyLogger: an epoch ")
    placed = "ScheduledPrune (`start`=0.1, `end`=0.8), GradientCache (`release_at`=0.8)."
    assert "These were placed as shares of 48 steps and will not land where asked: " + placed in said[0]
    assert "so blind to the lengths of the epochs still to come: EnergyLogger" in said[0]


class EveryOtherStepOneCycle(EndsEpochsEarly):
    """Skips epoch 2's last planned batch (its 6th), with a OneCycleLR of ``estimated_stepping_batches // 2``
    steps that Lightning steps with ``"frequency": 2``."""

    def __init__(self) -> None:
        super().__init__(stop=5, cut=(2,), schedule=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        steps = int(self.trainer.estimated_stepping_batches) // 2
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
        return [optimizer], [{"scheduler": schedule, "interval": "step", "frequency": 2}]


def test_a_plan_made_again_counts_a_frequency_2_schedules_steps_per_epoch_as_lightning_does(tmp_path, caplog):
    # a review: the check read one scheduler step per 2 optimizer steps of the run, so the 9 steps left
    # after the cut epoch (passes of 6 and 3 batches: 3 + 1 = 4 scheduler steps) outran the 4 the OneCycleLR
    # has left and the run was refused; Lightning steps it exactly to its end
    replay, cycle = dict(replay_fraction=0.25), dict(burst=3, replay=3, maintain=3)
    with caplog.at_level(logging.INFO):
        trainer, rows = _fit(EveryOtherStepOneCycle(), tmp_path, replay=replay, cycle=cycle)
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert "the per-step OneCycleLR, which has 4 steps left" in caplog.text
    assert trainer.global_step == 30 and schedule.last_epoch == schedule.total_steps == 15
    assert _misplaced(rows) == []


class Filtering(torch.utils.data.Sampler):
    """A length-filtering sampler: yields the 128 samples short enough to train (8 batches), while its
    length says the dataset's 192 (as many such samplers do); Lightning ends each epoch where it runs out."""

    def __iter__(self):
        return iter([index for index in range(SAMPLES) if index % 3 != 2])

    def __len__(self) -> int:
        return SAMPLES


class FilteredEpochs(EndsEpochsEarly):
    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=BATCH, sampler=Filtering())


def test_epochs_a_sampler_ends_short_of_its_length_are_not_blamed_on_the_module(tmp_path, caplog):
    """Sweep: under a sampler whose length overstates, PulseCycle's end line said the epochs ended because
    `on_train_batch_start` returned -1 (the module has none) and that the share was no saving against the
    plain run, whose steps it called unknown; the plain run takes 32 steps, as the line's figure says."""
    plain = pl.Trainer(**trainer_kwargs(max_epochs=4, default_root_dir=tmp_path))
    plain.fit(FilteredEpochs(stop=99))
    with caplog.at_level(logging.INFO):
        trainer, _ = _fit(FilteredEpochs(stop=99), tmp_path)
    assert plain.global_step == 32 and trainer.global_step < 32
    assert f"of the plain run's {plain.global_step} over the same data" in caplog.text
    assert "returned -1" not in caplog.text and "no saving against it" not in caplog.text
    assert (
        "epoch 0 ended after 8 of its 11 planned batches (its sampler ran out after 128 of the 192 samples "
        in caplog.text
    )
    assert (
        "epochs ended before their planned passes did: the sampler gave fewer samples than its length says"
        in caplog.text
    )

    # one epoch the module ends (-1 at its 5th batch), the others the sampler: both causes, counted
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _fit(FilteredEpochs(stop=4, cut=(0,)), tmp_path)
    assert (
        "epoch 0 ended after 4 of its 11 planned batches (the module's `on_train_batch_start` returned -1)"
        in (caplog.text)
    )
    assert (
        "4 epochs ended before their planned passes did (3 because the sampler gave fewer samples than its "
        "length says, 1 because `on_train_batch_start` returned -1)"
    ) in caplog.text
