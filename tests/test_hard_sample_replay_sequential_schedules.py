"""HardSampleReplay(mode='steps') with composite LR schedules: a ``SequentialLR`` (warm-up, then cosine or
OneCycleLR) and a ``ChainedScheduler``, alone and nested.

Found by a held-out sweep: a warm-up + cosine ``SequentialLR([LinearLR(total_iters=5),
CosineAnnealingLR(T_max=59)], milestones=[5])`` built for a plain run of 64 steps was not refused (a plain
cosine of 64 was): the plan ran 53 steps and the schedule stopped at 83% of its course without a word.
``schedule_lengths`` read the inner lengths (5 and 59), not the SequentialLR's span (64), and the steps-left
checks of a resume and of an epoch ended early read them too (and a ``ChainedScheduler``, which keeps no
``last_epoch``, as never stepped).
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim import lr_scheduler

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.step_plan import schedule_course, schedule_lengths
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.test_hard_sample_replay_cut_epochs import OneCycleAtTheTail
from tests.test_hard_sample_replay_cut_epochs import _fit as _fit_cut_epochs
from tests.test_step_saving_replay import CYCLE, ShuffleFreeData

WARMUP = 5
PLAIN = 48  # 4 epochs of 12 batches (MNIST-1D's 800 training samples, 64 a batch)


def _warm_up_then(optimizer, last):
    return lr_scheduler.SequentialLR(
        optimizer, [lr_scheduler.LinearLR(optimizer, 0.1, total_iters=WARMUP), last], milestones=[WARMUP]
    )


class WarmUpCosine(MNIST1DClassifier):
    """A warm-up of 5 steps, then a cosine of ``cosine`` steps (``None``: the planned steps less the warm-up,
    from ``estimated_stepping_batches``)."""

    def __init__(self, cosine: int | None = None) -> None:
        super().__init__()
        self.cosine = cosine

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        length = self.cosine or int(self.trainer.estimated_stepping_batches) - WARMUP
        schedule = _warm_up_then(optimizer, lr_scheduler.CosineAnnealingLR(optimizer, T_max=length))
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def _one_cycle_within(optimizer, total: int, kind: str):
    """A OneCycleLR of ``total`` steps in all, inside a composite schedule ``kind``."""
    if kind == "chained":
        return lr_scheduler.ChainedScheduler([lr_scheduler.OneCycleLR(optimizer, 5e-3, total_steps=total)])
    one_cycle = lr_scheduler.OneCycleLR(optimizer, 5e-3, total_steps=total - WARMUP)
    sequential = _warm_up_then(optimizer, one_cycle)
    if kind == "sequential":
        return sequential
    return lr_scheduler.ChainedScheduler([sequential, lr_scheduler.ExponentialLR(optimizer, gamma=0.999)])


class OneCycleWithin(MNIST1DClassifier):
    """A OneCycleLR inside a composite schedule (``kind``) built for the planned steps."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        schedule = _one_cycle_within(optimizer, int(self.trainer.estimated_stepping_batches), self.kind)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def _fit(model, root, callbacks, ckpt_path=None, checkpoint_at=None):
    pl.seed_everything(0, verbose=False)
    saving = [] if checkpoint_at is None else [ModelCheckpoint(root, every_n_train_steps=checkpoint_at)]
    trainer = pl.Trainer(
        callbacks=[*callbacks, *saving],
        max_epochs=4,
        **trainer_kwargs(default_root_dir=root, enable_checkpointing=bool(saving)),
    )
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return trainer


def _callbacks():
    return [PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)]


@pytest.mark.parametrize(
    ("cosine", "course", "share"),
    [(PLAIN - WARMUP, PLAIN, "75%"), (PLAIN, PLAIN + WARMUP, "68%")],
    ids=["span-of-the-plain-run", "cosine-of-the-plain-run"],
)
def test_a_warm_up_and_cosine_built_for_the_plain_run_is_refused_before_the_first_step(
    tmp_path, cosine, course, share
):
    # before: the span-of-the-plain-run schedule (5 + 43) trained the 36 planned steps unrefused and stopped
    # at 75% of its course; the cosine of 48 after the warm-up was refused, but as stopping at 75% of 48
    # steps, where its course is 53 (the plan reaches 68% of it)
    model, trainer = WarmUpCosine(cosine), None
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step SequentialLR") as refusal:
        trainer = _fit(model, tmp_path, _callbacks())
    message = str(refusal.value)
    assert trainer is None and model.global_step == 0
    assert f"was built for {PLAIN} steps, the run's length without step-saving replay" in message, message
    assert f"plans 36: the schedule would stop at {share} of its course" in message, message
    assert f"its CosineAnnealingLR from milestone {WARMUP} ends at step {course}: build that one" in message
    assert 36 / course == pytest.approx(int(share[:-1]) / 100, abs=0.005)


def test_a_warm_up_and_cosine_built_for_the_planned_steps_trains_to_its_floor(tmp_path):
    trainer = _fit(WarmUpCosine(), tmp_path, _callbacks())
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == schedule.last_epoch == 36 < PLAIN
    assert schedule_course(schedule) == (36, 0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("kind", ["sequential", "chained", "chained-sequential"])
def test_a_resume_with_a_pulse_cycle_added_is_refused_before_a_composite_one_cycle_overruns(tmp_path, kind):
    # HardSampleReplay alone plans 24 steps. Before, resumed at step 20 with a PulseCycle added: inside a
    # SequentialLR the OneCycleLR's 19 steps were read as the schedule's length (not 5 + 19), and a
    # ChainedScheduler (no last_epoch) as never stepped, so neither was refused and the OneCycleLR raised
    # "Tried to step 20 times" mid-run (25 times: a OneCycleLR of 24 steps alone in a ChainedScheduler)
    saved = _fit(OneCycleWithin(kind), tmp_path, [HardSampleReplay(replay_fraction=0.5)], checkpoint_at=20)
    assert saved.global_step == 24
    resumed, path = None, str(next(tmp_path.glob("*step=20.ckpt")))
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step") as refusal:
        resumed = _fit(OneCycleWithin(kind), tmp_path / "resumed", _callbacks(), ckpt_path=path)
    name = "SequentialLR" if kind == "sequential" else "ChainedScheduler"
    assert resumed is None
    assert f"the per-step {name} restored from the checkpoint spans 24 steps" in str(refusal.value)
    assert "a PulseCycle was added since" in str(refusal.value)


class SequentialOneCycleAtTheTail(OneCycleAtTheTail):
    """Skips epoch 2's last planned batch, with a warm-up, then a OneCycleLR, built for the planned steps."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        steps = int(self.trainer.estimated_stepping_batches)
        schedule = _warm_up_then(
            optimizer, lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=steps - WARMUP)
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def test_a_plan_made_again_that_would_outrun_a_sequential_one_cycle_keeps_its_old_total(tmp_path, caplog):
    # as test_a_plan_made_again_that_would_outrun_a_one_cycle_schedule_keeps_its_old_total, the OneCycleLR
    # after a warm-up: before, its 26 steps were read as the schedule's length (shorter than the 31 planned:
    # taken to run out anyway), the plan was solved again to 33 steps and the OneCycleLR raised "Tried to step
    # 27 times" at the run's end
    replay, cycle = dict(replay_fraction=0.25), dict(burst=3, replay=3, maintain=3)
    with caplog.at_level(logging.INFO):
        trainer, _ = _fit_cut_epochs(SequentialOneCycleAtTheTail(), tmp_path, replay=replay, cycle=cycle)
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert "warm-up and anneal kept where they were placed" in caplog.text
    assert "the per-step SequentialLR, which has 9 steps left" in caplog.text
    assert schedule.last_epoch <= WARMUP + schedule._schedulers[-1].total_steps == 31
    assert trainer.global_step == trainer.max_steps < 31


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _steps_before_raising(schedule) -> int:
    for stepped in range(200):
        schedule.optimizer.step()
        try:
            schedule.step()
        except ValueError:  # OneCycleLR: "Tried to step N times"
            return stepped
    raise AssertionError("never raised")


@pytest.mark.parametrize(
    "build",
    [
        lambda o: _warm_up_then(o, lr_scheduler.OneCycleLR(o, 0.1, total_steps=59)),
        lambda o: lr_scheduler.ChainedScheduler([lr_scheduler.OneCycleLR(o, 0.1, total_steps=64)]),
        lambda o: lr_scheduler.ChainedScheduler(
            [
                _warm_up_then(o, lr_scheduler.OneCycleLR(o, 0.1, total_steps=59)),
                lr_scheduler.ExponentialLR(o, 1.0),
            ]
        ),
        lambda o: lr_scheduler.SequentialLR(
            o,
            [
                lr_scheduler.ChainedScheduler([lr_scheduler.LinearLR(o, 0.1, total_iters=5)]),
                lr_scheduler.OneCycleLR(o, 0.1, total_steps=54),
            ],
            milestones=[10],
        ),
        # torch steps a SequentialLR first in another once more at construction: its course ends a step early
        lambda o: lr_scheduler.SequentialLR(
            o, [_warm_up_then(o, lr_scheduler.OneCycleLR(o, 0.1, total_steps=60))], milestones=[]
        ),
    ],
    ids=["sequential", "chained", "chained-sequential", "sequential-chained", "sequential-sequential"],
)
def test_the_course_of_a_composite_schedule_ends_where_its_one_cycle_raises(build):
    schedule = build(_optimizer())
    assert schedule_course(schedule) == (64, 64)
    for _ in range(20):
        schedule.optimizer.step()
        schedule.step()
    assert schedule_course(schedule) == (64, 44)
    assert _steps_before_raising(schedule) == 44


def test_a_chain_ends_with_its_first_scheduler_to_end_and_is_refused_by_its_share():
    # a review: a ChainedScheduler was read by its latest end; a OneCycleLR in it raises at its own, whatever a
    # sibling closing over a longer horizon says (a resume was not refused and raised mid-run)
    from types import SimpleNamespace

    from lightning_pulse.step_saving import UnplannedLengths

    def chain(optimizer, one_cycle_steps):
        one_cycle = lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=one_cycle_steps)
        return lr_scheduler.ChainedScheduler(
            [one_cycle, lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 100)]
        )

    schedule = chain(_optimizer(), 30)
    assert schedule_course(schedule) == (30, 30)
    assert _steps_before_raising(schedule) == 30
    plain = SimpleNamespace(interval="step", frequency=1, scheduler=chain(_optimizer(), 48))
    assert UnplannedLengths(48, 4, 12, 1, None).cut_short(plain, 36).share == pytest.approx(0.75)


def test_a_schedule_that_ends_periodic_or_held_has_no_course():
    optimizer = _optimizer()
    restarts = lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)
    assert schedule_lengths(restarts) == set() and schedule_course(restarts) is None
    warm_restarts = _warm_up_then(optimizer, lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10))
    assert schedule_lengths(warm_restarts) == {WARMUP} and schedule_course(warm_restarts) is None
    # a cosine, then held at its floor: its end is read as a length (refused when the plan cuts it), and
    # the schedule has no end to step past
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=PLAIN - WARMUP)
    held = lr_scheduler.SequentialLR(
        optimizer,
        [
            lr_scheduler.LinearLR(optimizer, 0.1, total_iters=WARMUP),
            cosine,
            lr_scheduler.LambdaLR(optimizer, lambda s: 0.0),
        ],
        milestones=[WARMUP, PLAIN],
    )
    assert PLAIN in schedule_lengths(held) and schedule_course(held) is None


def test_a_resume_with_the_hard_sample_replay_left_out_is_refused_before_a_sequential_one_cycle_overruns(
    tmp_path,
):
    # PulseCycle's own check on a resume without the plan (more steps than the 36 the checkpoint planned):
    # before, the OneCycleLR's 31 steps were read as the schedule's length and it raised mid-run
    saved = _fit(OneCycleWithin("sequential"), tmp_path, _callbacks(), checkpoint_at=20)
    assert saved.global_step == 36
    resumed, path = None, str(next(tmp_path.glob("*step=20.ckpt")))
    with pytest.raises(PulseRefusal, match="PulseCycle: the per-step SequentialLR restored") as refusal:
        resumed = _fit(
            OneCycleWithin("sequential"), tmp_path / "resumed", [PulseCycle(**CYCLE)], ckpt_path=path
        )
    assert resumed is None and "spans 36 steps" in str(refusal.value)
    # the resumed run's own length (forty-fourth pass): the 20 planned steps taken, then plain epochs (48 read
    # a fresh plain run's); either way past the 36 steps the schedule spans
    assert "this run without a HardSampleReplay(mode='steps') takes 42" in str(refusal.value)


class WarmUpCosineFloor(MNIST1DClassifier):
    """A warm-up of ``warm_up`` steps, a cosine of ``cosine`` steps (``None``: the planned steps, with the
    warm-up not taken off), then (``floor``) the learning rate held at a tenth from the plain run's end on."""

    def __init__(self, warm_up: int, cosine: int | None = None, floor: bool = False) -> None:
        super().__init__()
        self.warm_up, self.cosine, self.floor = warm_up, cosine, floor

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        length = self.cosine or int(self.trainer.estimated_stepping_batches)
        schedules = [
            lr_scheduler.LinearLR(optimizer, 0.1, total_iters=self.warm_up),
            lr_scheduler.CosineAnnealingLR(optimizer, T_max=length, eta_min=0.005),
        ]
        if self.floor:
            schedules.append(lr_scheduler.LambdaLR(optimizer, lambda _: 0.1))
        milestones = [self.warm_up, self.warm_up + length][: len(schedules) - 1]
        schedule = lr_scheduler.SequentialLR(optimizer, schedules, milestones=milestones)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def test_the_sequential_way_out_names_the_cosine_a_held_floor_follows_not_the_floor(tmp_path):
    # a review: the added sentence said "its last scheduler's length" where a constant LambdaLR (no length)
    # follows the cosine of 43 steps after the warm-up of 5, which ends at the plain run's 48
    model, trainer = WarmUpCosineFloor(WARMUP, PLAIN - WARMUP, floor=True), None
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step SequentialLR") as refusal:
        trainer = _fit(model, tmp_path, _callbacks())
    message = str(refusal.value)
    assert trainer is None and f"was built for {PLAIN} steps, the run's length without" in message, message
    assert message.endswith(
        f"A SequentialLR restarts each scheduler at its milestone, and its CosineAnnealingLR from milestone "
        f"{WARMUP} ends at step {PLAIN}: build that one for `estimated_stepping_batches` less {WARMUP}."
    ), message


def test_a_cosine_built_for_the_planned_steps_with_its_warm_up_not_taken_off_is_refused_as_such(tmp_path):
    # a review: a warm-up of 12 then a cosine of the 36 planned steps (T_max=estimated_stepping_batches, the
    # warm-up not taken off) spans 48, the plain run's length: the refusal said only "built for 48 steps, the
    # run's length without step-saving replay", and its way out ("build its length from
    # estimated_stepping_batches") was what the module did
    model, trainer = WarmUpCosineFloor(12), None
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step SequentialLR's") as refusal:
        trainer = _fit(model, tmp_path, _callbacks())
    assert trainer is None and model.global_step == 0
    assert str(refusal.value) == (
        "HardSampleReplay: the per-step SequentialLR's CosineAnnealingLR starts at milestone 12 and was built "
        "for 36 steps: the run's 36 planned steps (`estimated_stepping_batches`) with the milestone not taken "
        "off, or, with it, the SequentialLR built for 48, the run's length without step-saving replay "
        "(max_epochs=4 of 12 optimizer steps). Either way the SequentialLR ends at step 48, and mode='steps' "
        "plans 36: the schedule would stop at 75% of its course. Build its CosineAnnealingLR for "
        "`self.trainer.estimated_stepping_batches - 12` in configure_optimizers, or use mode='batch'."
    )
    # built so, it trains the planned steps to the cosine's floor
    trainer = _fit(WarmUpCosineFloor(12, 36 - 12), tmp_path / "fixed", _callbacks())
    assert trainer.global_step == 36
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.005, abs=1e-9)
